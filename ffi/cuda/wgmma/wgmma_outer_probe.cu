// Standalone probe for wgmma_outer.cuh (WgmmaGroupedOuter, the weight-gradient grouped GEMM): correctness against
// a tiled fp32 GPU reference, then timing.
//   wgmma_outer_probe [--small-only] [--no-timing]
// Exit codes: 0 all PASS, 1 some FAIL, 2 CUDA error, 3 watchdog timeout.
// Rows of lhs / rhs that belong to no group (past min(sum(sizes), M)) are filled with NaN, so a reduction tail that
// is not masked in BOTH operands shows up as non-finite output; empty groups must come out exactly +0.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "wgmma_outer.cuh"

#define CK(x)                                                                                        \
  do {                                                                                               \
    cudaError_t e_ = (x);                                                                            \
    if (e_ != cudaSuccess) {                                                                         \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
      exit(2);                                                                                       \
    }                                                                                                \
  } while (0)

static double g_watchdog_s = 10.0;

// The kernel may spin forever on an mbarrier if something is wrong: never block in cudaStreamSynchronize.
static void WaitOrDie(cudaStream_t s, const std::string& what) {
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      fprintf(stderr, "CUDA error %s while waiting for %s\n", cudaGetErrorString(e), what.c_str());
      exit(2);
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (dt > g_watchdog_s) {
      printf("TIMEOUT case %s (%.0f s)\n", what.c_str(), g_watchdog_s);
      fflush(stdout);
      exit(3);  // a hung kernel cannot be cancelled; process exit tears the context down
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

__device__ __forceinline__ uint32_t Hash(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return (uint32_t)x;
}

// Values in +-[1/8, 1]: never zero, so a skipped product cannot hide.
__global__ void FillKernel(__nv_bfloat16* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const uint32_t h = Hash(i * 0x9E3779B97F4A7C15ULL + seed);
    const float mag = 0.125f + 0.875f * (float)(h >> 8) / 16777216.0f;
    p[i] = __float2bfloat16((h & 1) ? mag : -mag);
  }
}

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

struct CmpResult {
  unsigned int max_err_bits;  // non-negative floats compare like their bit patterns
  unsigned int max_ref_bits;
  unsigned long long bad_values;  // non-finite (leftover poison or leaked NaN rows)
  unsigned long long bad_empty;   // empty groups not exactly +0
};

template <bool kF32>
__global__ void CompareKernel(const void* out, const float* ref, const int* row_start, int64_t G, int64_t KN,
                              CmpResult* res) {
  float my_err = 0.f, my_ref = 0.f;
  unsigned long long bad_v = 0, bad_e = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < G * KN; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t g = i / KN;
    uint32_t bits;
    float o;
    if (kF32) {
      o = reinterpret_cast<const float*>(out)[i];
      bits = __float_as_uint(o);
    } else {
      const __nv_bfloat16 h = reinterpret_cast<const __nv_bfloat16*>(out)[i];
      bits = __bfloat16_as_ushort(h);
      o = __bfloat162float(h);
    }
    if (row_start[g + 1] == row_start[g]) {
      bad_e += bits != 0;
    } else if (!isfinite(o)) {
      ++bad_v;
    } else {
      my_err = fmaxf(my_err, fabsf(o - ref[i]));
      my_ref = fmaxf(my_ref, fabsf(ref[i]));
    }
  }
  atomicMax(&res->max_err_bits, __float_as_uint(my_err));
  atomicMax(&res->max_ref_bits, __float_as_uint(my_ref));
  if (bad_v) atomicAdd(&res->bad_values, bad_v);
  if (bad_e) atomicAdd(&res->bad_empty, bad_e);
}

struct Case {
  std::string name;
  int64_t M, K, N;
  std::vector<int32_t> sizes;
  bool small;
};

static std::vector<int32_t> Balanced(int64_t M, int G) {
  std::vector<int32_t> s(G);
  for (int g = 0; g < G; ++g) s[g] = (int32_t)(M / G + (g < M % G ? 1 : 0));
  return s;
}
static std::vector<int32_t> Skewed(int64_t M, int G, int big, double frac) {
  std::vector<int32_t> s(G);
  const int64_t b = (int64_t)(M * frac) + 37;  // deliberately not a multiple of 64
  const int64_t rest = M - b;
  int64_t used = 0;
  for (int g = 0, j = 0; g < G; ++g) {
    if (g == big) continue;
    s[g] = (int32_t)(rest / (G - 1) + (j < rest % (G - 1) ? 1 : 0));
    used += s[g];
    ++j;
  }
  s[big] = (int32_t)(M - used);
  return s;
}
static std::vector<int32_t> RandomSizes(int64_t M, int G, uint64_t seed, double fill) {
  std::vector<double> w(G);
  double sum = 0;
  for (int g = 0; g < G; ++g) {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    w[g] = (g % 7 == 3) ? 0.0 : 0.2 + (double)(seed >> 40) / (double)(1ULL << 24);  // some empty groups
    sum += w[g];
  }
  std::vector<int32_t> s(G);
  int64_t used = 0;
  for (int g = 0; g < G; ++g) {
    s[g] = (int32_t)(w[g] / sum * M * fill);
    used += s[g];
  }
  if (fill >= 1.0) s[G - 1] += (int32_t)(M - used);  // exact cover
  return s;
}

int main(int argc, char** argv) {
  bool small_only = false, timing = true;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--small-only")) small_only = true;
    else if (!strcmp(argv[i], "--no-timing")) timing = false;
    else {
      fprintf(stderr, "usage: %s [--small-only] [--no-timing]\n", argv[0]);
      return 2;
    }
  }
  if (const char* w = getenv("WGMMA_WATCHDOG_S")) g_watchdog_s = atof(w);

  int dev = 0, num_sms = 0;
  CK(cudaSetDevice(dev));
  CK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  printf("device %s sm_%d%d, %d SMs, smem/block optin %zu, kernel smem %d\n", prop.name, prop.major, prop.minor,
         num_sms, prop.sharedMemPerBlockOptin, wgmma_outer::kOuterSmemBytes);
  if (prop.major != 9) {
    fprintf(stderr, "needs a Hopper (sm_90) GPU\n");
    return 2;
  }
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
    if (small_only && !c.small) continue;
    const int64_t M = c.M, K = c.K, N = c.N, G = (int64_t)c.sizes.size();
    std::vector<int> row_start(G + 1, 0);
    int64_t acc = 0;
    for (int64_t g = 0; g < G; ++g) {
      row_start[g] = (int)std::min<int64_t>(acc, M);
      acc += std::max<int32_t>(0, c.sizes[g]);
    }
    row_start[G] = (int)std::min<int64_t>(acc, M);
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
        CompareKernel<true><<<1024, 256, 0, stream>>>(out, ref, d_row_start, G, K * N, d_res);
      else
        CompareKernel<false><<<1024, 256, 0, stream>>>(out, ref, d_row_start, G, K * N, d_res);
      CK(cudaGetLastError());
      CmpResult res;
      CK(cudaMemcpyAsync(&res, d_res, sizeof(res), cudaMemcpyDeviceToHost, stream));
      WaitOrDie(stream, vname + " (compare)");
      float max_err, max_ref;
      memcpy(&max_err, &res.max_err_bits, 4);
      memcpy(&max_ref, &res.max_ref_bits, 4);
      const double rel = max_ref > 0 ? max_err / max_ref : max_err;
      const double tol = f32 ? 2e-3 : 1e-2;
      const bool pass = res.bad_values == 0 && res.bad_empty == 0 && rel < tol && (total_rows == 0 || max_ref > 0);
      if (!pass) ++failures;

      double ms = 0;
      if (timing && !c.small) {
        for (int i = 0; i < 3; ++i) call();
        WaitOrDie(stream, vname + " (warm-up)");
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        CK(cudaEventRecord(e0, stream));
        for (int i = 0; i < 10; ++i) call();
        CK(cudaEventRecord(e1, stream));
        WaitOrDie(stream, vname + " (timing)");
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        ms = t / 10;
        CK(cudaEventDestroy(e0));
        CK(cudaEventDestroy(e1));
      }
      printf("case %-46s %-9s %s err=%.3e (max_err=%.3e max_ref=%.3e nonfinite=%llu bad_empty=%llu) ms=%.4f "
             "TFLOP/s=%.1f\n",
             c.name.c_str(), f32 ? "out=f32" : "out=bf16", pass ? "PASS" : "FAIL", rel, max_err, max_ref,
             res.bad_values, res.bad_empty, ms, ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0);
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
