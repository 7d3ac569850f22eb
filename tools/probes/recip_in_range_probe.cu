// Exhaustive probe of ops/e4m3.cuh's RecipInRange on one GPU: for every positive float32 x with 2^-126 <= x < 2^126
// (the callers pass logistic denominators >= 1 and tile scales >= 2^-126, both positive), RecipInRange(x) must be bit
// for bit __frcp_rn(x) and __fdiv_rn(1, x), the IEEE quotient the CPU handlers compute. Outside that range the callers
// do not use it (SwiGluSigmoids' exact path, QuantizerOfTileScale's non-finite scales), so nothing is claimed there.
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -Iffi -Iffi/include \
//     -o /tmp/recip_in_range_probe tools/probes/recip_in_range_probe.cu && /tmp/recip_in_range_probe
//   prints: values checked, mismatches (and the first few), ms; exit 0 all equal, 1 a mismatch, 2 CUDA error,
//   3 watchdog timeout.
#include "probe_common.cuh"

#include "cuda/ops/e4m3.cuh"

namespace {

constexpr uint32_t kFirst = 0x00800000u;  // 2^-126
constexpr uint32_t kEnd = 0x7E800000u;    // 2^126 (excluded)
constexpr int kKeep = 8;

__global__ void CheckRecip(unsigned long long* mismatches, uint32_t* first) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t b = kFirst + uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; b < kEnd; b += stride) {
    const float x = __uint_as_float(static_cast<uint32_t>(b));
    const uint32_t got = __float_as_uint(jmo::cuda::RecipInRange(x));
    if (got != __float_as_uint(__frcp_rn(x)) || got != __float_as_uint(__fdiv_rn(1.0f, x))) {
      const unsigned long long n = atomicAdd(mismatches, 1ull);
      if (n < kKeep) first[n] = static_cast<uint32_t>(b);
    }
  }
}

}  // namespace

int main() {
  unsigned long long* d_n;
  uint32_t* d_first;
  CK(cudaMalloc(&d_n, sizeof(*d_n)));
  CK(cudaMalloc(&d_first, kKeep * sizeof(uint32_t)));
  CK(cudaMemset(d_n, 0, sizeof(*d_n)));
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0, s));
  CheckRecip<<<4096, 256, 0, s>>>(d_n, d_first);
  CK(cudaGetLastError());
  CK(cudaEventRecord(e1, s));
  WaitOrDie(s, "CheckRecip");
  float ms = 0.f;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  unsigned long long n = 0;
  uint32_t first[kKeep] = {};
  CK(cudaMemcpy(&n, d_n, sizeof(n), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(first, d_first, sizeof(first), cudaMemcpyDeviceToHost));
  printf("recip_in_range: %llu values in [2^-126, 2^126) checked against __frcp_rn and __fdiv_rn(1, x): %llu mismatches"
         " (%.1f ms)\n", static_cast<unsigned long long>(kEnd - kFirst), n, ms);
  for (unsigned long long i = 0; i < n && i < kKeep; ++i) printf("  mismatch at x bits 0x%08x\n", first[i]);
  return n == 0 ? 0 : 1;
}
