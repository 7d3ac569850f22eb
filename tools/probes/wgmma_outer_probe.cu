// Standalone probe for gemm/sm90/wgmma_outer.cuh (WgmmaGroupedOuter, the weight-gradient grouped GEMM): correctness
// against a tiled fp32 GPU reference, then timing.
//   wgmma_outer_probe [--small-only] [--no-timing]
// Exit codes: 0 all PASS, 1 some FAIL, 2 CUDA error, 3 watchdog timeout.
// Rows of lhs / rhs that belong to no group (past min(sum(sizes), M)) are filled with NaN, so a reduction tail that
// is not masked in BOTH operands shows up as non-finite output; empty groups must come out exactly +0.
#include "cuda/gemm/sm90/wgmma_outer.cuh"
#include "probe_common.cuh"

// Reference: ref[g, k, n] = sum_{r in group g} lhs[r, k] * rhs[r, n] in fp32. Block 16 x 16 threads, 64 x 64 outputs
// (4 x 4 per thread), rows in steps of 16 through smem. K, N multiples of 64.
__global__ void RefOuterKernel(const __nv_bfloat16* lhs, const __nv_bfloat16* rhs, const int* row_start, int K, int N,
                               float* ref) {
  __shared__ float As[16][64], Bs[16][64];
  const int g = blockIdx.z, k0 = blockIdx.y * 64, n0 = blockIdx.x * 64;
  const int tx = threadIdx.x, ty = threadIdx.y, t = ty * 16 + tx;
  const int r_beg = row_start[g], r_end = row_start[g + 1];
  float acc[4][4] = {};
  for (int r0 = r_beg; r0 < r_end; r0 += 16) {
    for (int i = t; i < 16 * 64; i += 256) {
      const int rr = i / 64, cc = i % 64, r = r0 + rr;
      As[rr][cc] = r < r_end ? __bfloat162float(lhs[(int64_t)r * K + k0 + cc]) : 0.f;
      Bs[rr][cc] = r < r_end ? __bfloat162float(rhs[(int64_t)r * N + n0 + cc]) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < 16; ++rr) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = As[rr][ty + 16 * i], b[i] = Bs[rr][tx + 16 * i];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) ref[((int64_t)g * K + k0 + ty + 16 * i) * N + n0 + tx + 16 * j] = acc[i][j];
}

int main(int argc, char** argv) {
  const ProbeArgs args = ParseProbeArgs(argc, argv);
  const int num_sms = ProbeDevice(wgmma_outer::kOuterSmemBytes);
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int failures = 0;

  // Shapes the kernel must refuse (host checks only, nothing launched).
  {
    const cudaError_t e1 = WgmmaGroupedOuter(nullptr, 64, 96, nullptr, 64, 1, nullptr, nullptr, false, num_sms, stream);
    const cudaError_t e2 = WgmmaGroupedOuter(nullptr, 64, 64, nullptr, 64, 2000, nullptr, nullptr, false, num_sms, stream);
    const bool ok = e1 == cudaErrorInvalidValue && e2 == cudaErrorInvalidValue;
    printf("case refuse_K96_and_G2000 %s (%s, %s)\n", ok ? "PASS" : "FAIL", cudaGetErrorName(e1), cudaGetErrorName(e2));
    failures += !ok;
  }

  std::vector<int32_t> g300 = RandomSizes(4000, 300, 5, 0.9);
  std::vector<Case> cases = {
      {"small_M300_K128_N192_G3_{0,130,170}", 300, 128, 192, {0, 130, 170}, true},
      {"small_tail_M300_K128_N192_G3_{50,0,100}", 300, 128, 192, {50, 0, 100}, true},
      {"small_clamp_M300_K192_N320_G2_{250,250}", 300, 192, 320, {250, 250}, true},
      {"small_rows1_M200_K64_N64_G4_{1,0,1,100}", 200, 64, 64, {1, 0, 1, 100}, true},
      {"small_636465_M256_K256_N256_G4_{63,64,65,-5}", 256, 256, 256, {63, 64, 65, -5}, true},
      {"small_many_M1000_K128_N128_G40", 1000, 128, 128, RandomSizes(1000, 40, 7, 0.8), true},
      {"small_unsorted_M4000_K64_N128_G300", 4000, 64, 128, g300, true},
      {"M16384_K2048_N4096_G8_balanced", 16384, 2048, 4096, Balanced(16384, 8), false},
      {"M16384_K2048_N4096_G8_skew60", 16384, 2048, 4096, Skewed(16384, 8, 2, 0.6), false},
      {"M16384_K2048_N4096_G64_random", 16384, 2048, 4096, RandomSizes(16384, 64, 11, 1.0), false},
      {"M16384_K4096_N14336_G8_balanced", 16384, 4096, 14336, Balanced(16384, 8), false},
      {"M16384_K14336_N4096_G8_skew60", 16384, 14336, 4096, Skewed(16384, 8, 5, 0.6), false},
      {"dense_M8192_K8192_N8192_G1", 8192, 8192, 8192, {8192}, false},
  };

  for (const Case& c : cases) {
    if (args.small_only && !c.small) continue;
    const int64_t M = c.M, K = c.K, N = c.N, G = (int64_t)c.sizes.size();
    const std::vector<int> row_start = ClampedRowStart(c.sizes, M);
    const int64_t total_rows = row_start[G];
    const double flops = 2.0 * (double)total_rows * (double)K * (double)N;

    __nv_bfloat16 *lhs, *rhs;
    float* ref;
    void* out;
    int32_t* d_sizes;
    int* d_row_start;
    CmpResult* d_res;
    CK(cudaMalloc(&lhs, M * K * 2));
    CK(cudaMalloc(&rhs, M * N * 2));
    CK(cudaMalloc(&ref, G * K * N * 4));
    CK(cudaMalloc(&out, G * K * N * 4));
    CK(cudaMalloc(&d_sizes, G * 4));
    CK(cudaMalloc(&d_row_start, (G + 1) * 4));
    CK(cudaMalloc(&d_res, sizeof(CmpResult)));
    CK(cudaMemcpyAsync(d_sizes, c.sizes.data(), G * 4, cudaMemcpyHostToDevice, stream));
    CK(cudaMemcpyAsync(d_row_start, row_start.data(), (G + 1) * 4, cudaMemcpyHostToDevice, stream));
    FillKernel<<<1024, 256, 0, stream>>>(lhs, M * K, 1);
    FillKernel<<<1024, 256, 0, stream>>>(rhs, M * N, 2);
    CK(cudaGetLastError());
    // Rows in no group: NaN in both operands (0xFFFF).
    CK(cudaMemsetAsync(lhs + total_rows * K, 0xFF, (M - total_rows) * K * 2, stream));
    CK(cudaMemsetAsync(rhs + total_rows * N, 0xFF, (M - total_rows) * N * 2, stream));
    RefOuterKernel<<<dim3(N / 64, K / 64, G), dim3(16, 16), 0, stream>>>(lhs, rhs, d_row_start, (int)K, (int)N, ref);
    CK(cudaGetLastError());
    {
      const double saved = g_watchdog_s;
      g_watchdog_s = std::max(saved, 60.0);
      WaitOrDie(stream, c.name + " (reference)");
      g_watchdog_s = saved;
    }

    for (int variant = 0; variant < 2; ++variant) {
      const bool f32 = variant == 1;
      const std::string vname = c.name + (f32 ? " out=f32" : " out=bf16");
      auto call = [&]() {
        const cudaError_t e = WgmmaGroupedOuter(lhs, M, K, rhs, N, G, d_sizes, out, f32, num_sms, stream);
        if (e != cudaSuccess) {
          printf("case %s FAIL launch error: %s\n", vname.c_str(), cudaGetErrorString(e));
          exit(2);
        }
      };
      // Poison: 0xFF bytes are NaN in bf16 (0xFFFF) and in f32 (0xFFFFFFFF).
      CK(cudaMemsetAsync(out, 0xFF, G * K * N * (f32 ? 4 : 2), stream));
      call();
      WaitOrDie(stream, vname);
      CK(cudaMemsetAsync(d_res, 0, sizeof(CmpResult), stream));
      if (f32)
        CompareGroupsKernel<true><<<1024, 256, 0, stream>>>(out, ref, d_row_start, G, K * N, d_res);
      else
        CompareGroupsKernel<false><<<1024, 256, 0, stream>>>(out, ref, d_row_start, G, K * N, d_res);
      CK(cudaGetLastError());
      const CmpSummary cmp = ReadCompare(d_res, stream, vname, f32, total_rows);
      const bool pass = cmp.ok;
      if (!pass) ++failures;

      const double ms = args.timing && !c.small ? TimeCalls(call, 3, 10, stream, vname) : 0.0;
      printf("case %-46s %-9s %s err=%.3e (max_err=%.3e max_ref=%.3e nonfinite=%llu bad_empty=%llu) ms=%.4f "
             "TFLOP/s=%.1f\n",
             c.name.c_str(), f32 ? "out=f32" : "out=bf16", pass ? "PASS" : "FAIL", cmp.rel, cmp.max_err, cmp.max_ref,
             cmp.res.bad_values, cmp.res.bad_zero, ms, ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0);
      fflush(stdout);
    }
    CK(cudaFree(lhs));
    CK(cudaFree(rhs));
    CK(cudaFree(ref));
    CK(cudaFree(out));
    CK(cudaFree(d_sizes));
    CK(cudaFree(d_row_start));
    CK(cudaFree(d_res));
  }
  printf("%s: %d failing variant(s)\n", failures ? "FAILED" : "ALL PASS", failures);
  return failures ? 1 : 0;
}
