// Harness shared by the standalone wgmma probes (wgmma_probe.cu: grouped GEMM, wgmma_outer_probe.cu: grouped outer):
// CUDA error checks, a host watchdog instead of blocking syncs, random bf16 fill, the fused error / poison / must-be-
// zero comparison against an fp32 reference (and the grouped GEMM's reference itself), the bitwise diff of two
// results, group-size generators, command line, device setup and timing.
// Exit codes used here: 2 CUDA error or bad usage, 3 watchdog timeout.
#pragma once

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

#define CK(x)                                                                                        \
  do {                                                                                               \
    cudaError_t e_ = (x);                                                                            \
    if (e_ != cudaSuccess) {                                                                         \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
      exit(2);                                                                                       \
    }                                                                                                \
  } while (0)

static double g_watchdog_s = 10.0;  // WGMMA_WATCHDOG_S overrides (ParseProbeArgs)

// The kernels may spin forever on an mbarrier if something is wrong: never block in cudaStreamSynchronize.
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

// The grouped GEMM's naive float32 reference (lhs [M, K] @ rhs_kn[g] [K, N] for the rows of group g): one thread
// per output element; row_start (host-computed, clamped, G + 1 entries).
__global__ void RefKernel(const __nv_bfloat16* lhs, const __nv_bfloat16* rhs_kn, const int* row_start, int G, int M,
                          int K, int N, float* ref) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  const int r = blockIdx.y * blockDim.y + threadIdx.y;
  if (n >= N || r >= M) return;
  if (r >= row_start[G]) {
    ref[(int64_t)r * N + n] = 0.f;
    return;
  }
  int g = 0;
  while (!(r >= row_start[g] && r < row_start[g + 1])) ++g;
  const __nv_bfloat16* a = lhs + (int64_t)r * K;
  const __nv_bfloat16* b = rhs_kn + (int64_t)g * K * N + n;
  float acc = 0.f;
  for (int k = 0; k < K; ++k) acc += __bfloat162float(a[k]) * __bfloat162float(b[(int64_t)k * N]);
  ref[(int64_t)r * N + n] = acc;
}

// Counts the 32-bit words in which a and b differ.
__global__ void DiffWordsKernel(const uint32_t* a, const uint32_t* b, int64_t n, unsigned long long* diff) {
  unsigned long long d = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    d += a[i] != b[i];
  if (d) atomicAdd(diff, d);
}

inline double Tflops(double flops, float ms) { return ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0; }

struct CmpResult {
  unsigned int max_err_bits;  // non-negative floats compare like their bit patterns
  unsigned int max_ref_bits;
  unsigned long long bad_values;  // non-finite (leftover poison, leaked NaN rows) where a value is expected
  unsigned long long bad_zero;    // elements that must be exactly +0 (padding rows / empty groups) and are not
};

// Body of the probes' CompareKernel: grid-stride over out[0, n) (bf16 or f32 per kF32) against ref. Element i
// belongs to block b = block_of(i) (an output row, a group); must_be_zero(b) says whether the block must be exactly
// +0 (else each element is compared with ref[i] and must be finite).
template <bool kF32, class BlockOf, class MustBeZero>
__device__ __forceinline__ void CompareOut(const void* out, const float* ref, int64_t n, BlockOf block_of,
                                          MustBeZero must_be_zero, CmpResult* res) {
  float my_err = 0.f, my_ref = 0.f;
  unsigned long long bad_v = 0, bad_z = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t b = block_of(i);
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
    if (must_be_zero(b)) {
      bad_z += bits != 0;
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
  if (bad_z) atomicAdd(&res->bad_zero, bad_z);
}

// The grouped GEMMs' comparison: out [M, N] (bf16 or f32) against ref [M, N]; rows >= total_rows (past the groups)
// must be exactly +0.
template <bool kF32>
__global__ void CompareRowsKernel(const void* out, const float* ref, int64_t total_rows, int64_t M, int64_t N,
                                  CmpResult* res) {
  CompareOut<kF32>(
      out, ref, M * N, [=](int64_t i) { return i / N; }, [=](int64_t r) { return r >= total_rows; }, res);
}

// The grouped outer GEMMs' comparison: out [G, K, N] (KN = K * N elements per group) against ref; a group without
// rows (row_start[g + 1] == row_start[g], G + 1 entries) must be exactly +0.
template <bool kF32>
__global__ void CompareGroupsKernel(const void* out, const float* ref, const int* row_start, int64_t G, int64_t KN,
                                    CmpResult* res) {
  CompareOut<kF32>(
      out, ref, G * KN, [=](int64_t i) { return i / KN; }, [=](int64_t g) { return row_start[g + 1] == row_start[g]; },
      res);
}

// Host side of the comparison: reads d_res back (watchdog wait), relative error max_err / max_ref; `ok` = no
// non-finite value, no bad zero, rel below the tolerance (tol; by default 2e-3 f32 out, 1e-2 bf16 out) and a
// non-zero reference unless nothing was computed.
struct CmpSummary {
  CmpResult res;
  float max_err, max_ref;
  double rel;
  bool ok;
};
static CmpSummary ReadCompare(const CmpResult* d_res, cudaStream_t stream, const std::string& what, bool f32,
                              int64_t total_rows, double tol = 0.0) {
  CmpSummary s;
  CK(cudaMemcpyAsync(&s.res, d_res, sizeof(s.res), cudaMemcpyDeviceToHost, stream));
  WaitOrDie(stream, what + " (compare)");
  memcpy(&s.max_err, &s.res.max_err_bits, 4);
  memcpy(&s.max_ref, &s.res.max_ref_bits, 4);
  s.rel = s.max_ref > 0 ? s.max_err / s.max_ref : s.max_err;
  if (tol <= 0.0) tol = f32 ? 2e-3 : 1e-2;
  s.ok = s.res.bad_values == 0 && s.res.bad_zero == 0 && s.rel < tol && (total_rows == 0 || s.max_ref > 0);
  return s;
}

// One checked call of a grouped GEMM: out [M, N] (f32 or bf16) poisoned (0xFF bytes: NaN in both), call() issued on
// stream and waited for (watchdog), then compared with ref (CompareRowsKernel: rows >= total_rows must be +0).
template <class Call>
static CmpSummary CheckGroupedCall(Call call, void* out, const float* ref, int64_t total_rows, int64_t M, int64_t N,
                                   bool f32, CmpResult* d_res, cudaStream_t stream, const std::string& what,
                                   double tol = 0.0) {
  CK(cudaMemsetAsync(out, 0xFF, M * N * (f32 ? 4 : 2), stream));
  call();
  WaitOrDie(stream, what);
  CK(cudaMemsetAsync(d_res, 0, sizeof(CmpResult), stream));
  if (f32)
    CompareRowsKernel<true><<<1024, 256, 0, stream>>>(out, ref, total_rows, M, N, d_res);
  else
    CompareRowsKernel<false><<<1024, 256, 0, stream>>>(out, ref, total_rows, M, N, d_res);
  CK(cudaGetLastError());
  return ReadCompare(d_res, stream, what, f32, total_rows, tol);
}

// cudaFree of each pointer, checked.
template <class... P>
static void FreeAll(P... p) {
  for (void* q : {static_cast<void*>(p)...}) CK(cudaFree(q));
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
  const int64_t b = (int64_t)(M * frac) + 37;  // deliberately not a multiple of 64 (or 128)
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

// Clamped group row offsets, G + 1 entries: row_start[g] = min(sum_{h<g} max(0, size_h), M).
inline std::vector<int> ClampedRowStart(const std::vector<int32_t>& sizes, int64_t M) {
  const int64_t G = (int64_t)sizes.size();
  std::vector<int> row_start(G + 1, 0);
  int64_t acc = 0;
  for (int64_t g = 0; g < G; ++g) {
    row_start[g] = (int)std::min<int64_t>(acc, M);
    acc += std::max<int32_t>(0, sizes[g]);
  }
  row_start[G] = (int)std::min<int64_t>(acc, M);
  return row_start;
}

// A case's extents and groups as the grouped-GEMM probes use them.
struct CaseShape {
  int64_t M, K, N, G;
  std::vector<int> row_start;  // ClampedRowStart: G + 1 entries
  int64_t total_rows;          // rows in groups (row_start[G])
  double flops;                // 2 total_rows K N
  explicit CaseShape(const Case& c)
      : M(c.M), K(c.K), N(c.N), G((int64_t)c.sizes.size()), row_start(ClampedRowStart(c.sizes, c.M)),
        total_rows(row_start[G]), flops(2.0 * (double)total_rows * (double)K * (double)N) {}
};

struct ProbeArgs {
  bool small_only = false, timing = true;
};
// [--small-only] [--no-timing]; WGMMA_WATCHDOG_S sets the watchdog. Exits 2 on a bad argument.
static ProbeArgs ParseProbeArgs(int argc, char** argv) {
  ProbeArgs a;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--small-only")) a.small_only = true;
    else if (!strcmp(argv[i], "--no-timing")) a.timing = false;
    else {
      fprintf(stderr, "usage: %s [--small-only] [--no-timing]\n", argv[0]);
      exit(2);
    }
  }
  if (const char* w = getenv("WGMMA_WATCHDOG_S")) g_watchdog_s = atof(w);
  return a;
}

// Device 0: prints it (with the kernel's dynamic smem), exits 2 unless it is a Hopper (sm_90) GPU; returns the SM
// count.
static int ProbeDevice(int kernel_smem) {
  int dev = 0, num_sms = 0;
  CK(cudaSetDevice(dev));
  CK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  printf("device %s sm_%d%d, %d SMs, smem/block optin %zu, kernel smem %d\n", prop.name, prop.major, prop.minor,
         num_sms, prop.sharedMemPerBlockOptin, kernel_smem);
  if (prop.major != 9) {
    fprintf(stderr, "needs a Hopper (sm_90) GPU\n");
    exit(2);
  }
  return num_sms;
}

// Mean milliseconds per call of `call` (launches on `stream`): `warmup` calls, then `iters` timed with events.
template <class Call>
static double TimeCalls(Call call, int warmup, int iters, cudaStream_t stream, const std::string& what) {
  for (int i = 0; i < warmup; ++i) call();
  WaitOrDie(stream, what + " (warm-up)");
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0, stream));
  for (int i = 0; i < iters; ++i) call();
  CK(cudaEventRecord(e1, stream));
  WaitOrDie(stream, what + " (timing)");
  float t;
  CK(cudaEventElapsedTime(&t, e0, e1));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return t / iters;
}

// Median milliseconds of `reps` launches, each timed alone by its own event pair (`before()` runs untimed ahead of
// each one: e.g. an L2 flush). The caller warms up and checks the results first.
template <class Launch, class Before>
static float MedianLaunchMs(cudaStream_t stream, int reps, Launch launch, Before before) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) {
    before(r);
    CK(cudaEventRecord(e0, stream));
    launch();
    CK(cudaEventRecord(e1, stream));
    CK(cudaEventSynchronize(e1));
    float m;
    CK(cudaEventElapsedTime(&m, e0, e1));
    ms.push_back(m);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}
