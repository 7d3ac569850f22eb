// Standalone probe for CutlassGroupedGemm / CutlassGroupedOuter on one Hopper GPU.
//
// For every shape: random nonzero bf16 inputs, a naive fp32 reference on the GPU (one thread per
// output element), then each variant with the output poisoned (all-ones bits) before the call;
// checks error vs. tolerance, exact zeros where required, no poison left; then 5 warm-up and 20
// timed calls (cudaEvents) and a re-check of the last timed output.
//
// Usage: cutlass_probe [--only NAME]... [--small] [--iters N] [--warmup N] [--timeout S]
// Exit: 0 all PASS, 1 some FAIL, 2 CUDA/usage error, 3 TIMEOUT (watchdog: a stream or event that
// does not complete within --timeout seconds, default 20).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cutlass_grouped_gemm.cuh"

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::printf("CUDA error %s at %s:%d: %s\n", #x, __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::fflush(stdout);                                                                    \
      std::exit(2);                                                                           \
    }                                                                                         \
  } while (0)

static double g_timeout_s = 20.0;

// Watchdog: never block in a CUDA sync call; poll and give up after g_timeout_s.
static void wait_until(const char* what, cudaStream_t s, cudaEvent_t ev) {
  auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    cudaError_t e = ev ? cudaEventQuery(ev) : cudaStreamQuery(s);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      std::printf("CUDA error while waiting for %s: %s\n", what, cudaGetErrorString(e));
      std::fflush(stdout);
      std::exit(2);
    }
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (dt > g_timeout_s) {
      std::printf("TIMEOUT waiting for %s after %.1f s\n", what, dt);
      std::fflush(stdout);
      std::exit(3);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}
static void wait_stream(const char* what, cudaStream_t s) { wait_until(what, s, nullptr); }

// ------------------------------------------------------------------------------------------
// Device helpers
// ------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
  return (uint32_t)x;
}
// Values with magnitude in [0.25, 1) and random sign: never zero.
__global__ void fill_random(__nv_bfloat16* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint32_t h = hash32(seed * 0x9E3779B97F4A7C15ULL + (uint64_t)i);
    float mag = 0.25f + 0.75f * (float)(h >> 8) * (1.0f / 16777216.0f);
    p[i] = __float2bfloat16((h & 1u) ? -mag : mag);
  }
}
// rhsT[g, n, k] = rhs[g, k, n]
__global__ void transpose_kn(const __nv_bfloat16* rhs, __nv_bfloat16* rhsT, int64_t G, int64_t K, int64_t N) {
  int64_t total = G * K * N;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    int64_t g = i / (K * N), rem = i % (K * N), n = rem / K, k = rem % K;
    rhsT[i] = rhs[(g * K + k) * N + n];
  }
}
// Forward reference: ref[r, n] = sum_k lhs[r, k] * rhs[g(r), k, n]; 0 for tail rows (g = -1).
__global__ void ref_forward(const __nv_bfloat16* lhs, const __nv_bfloat16* rhs, const int* row_group,
                            int64_t M, int64_t K, int64_t N, float* ref) {
  int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (n >= N) return;
  for (int64_t r = blockIdx.y; r < M; r += gridDim.y) {  // gridDim.y <= 65535
    int g = row_group[r];
    float acc = 0.f;
    if (g >= 0) {
      const __nv_bfloat16* a = lhs + r * K;
      const __nv_bfloat16* b = rhs + (int64_t)g * K * N + n;
      for (int64_t k = 0; k < K; ++k) acc += __bfloat162float(a[k]) * __bfloat162float(b[k * N]);
    }
    ref[r * N + n] = acc;
  }
}
// Outer reference: ref[g, k, n] = sum_{r in group g} lhs[r, k] * rhs2[r, n].
__global__ void ref_outer(const __nv_bfloat16* lhs, const __nv_bfloat16* rhs2, const int64_t* gstart,
                          const int64_t* grows, int64_t K, int64_t N, float* ref) {
  int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  int64_t k = blockIdx.y, g = blockIdx.z;
  if (n >= N) return;
  float acc = 0.f;
  for (int64_t r = gstart[g]; r < gstart[g] + grows[g]; ++r)
    acc += __bfloat162float(lhs[r * K + k]) * __bfloat162float(rhs2[r * N + n]);
  ref[(g * K + k) * N + n] = acc;
}

struct Stats {
  unsigned int max_err_bits;   // float bits of max |out - ref| (non-negative floats order as ints)
  unsigned int max_ref_bits;   // float bits of max |ref|
  unsigned long long poison;   // elements still holding the poison pattern
  unsigned long long nan;      // other non-finite values
  unsigned long long nonzero;  // nonzero values where exact zeros are required
};
// must_zero(i): i >= zero_from, or (zero_group && zero_group[i / group_elems]).
template <bool kF32>
__global__ void compare(const void* out, const float* ref, int64_t n, int64_t zero_from,
                        const unsigned char* zero_group, int64_t group_elems, Stats* st) {
  float lerr = 0.f, lref = 0.f;
  unsigned long long lp = 0, ln = 0, lz = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float v;
    bool poison;
    if (kF32) {
      uint32_t bits = reinterpret_cast<const uint32_t*>(out)[i];
      poison = bits == 0xFFFFFFFFu;
      v = __uint_as_float(bits);
    } else {
      uint16_t bits = reinterpret_cast<const uint16_t*>(out)[i];
      poison = bits == 0xFFFFu;
      v = __bfloat162float(__ushort_as_bfloat16(bits));
    }
    float r = ref[i];
    lref = fmaxf(lref, fabsf(r));
    if (poison) { ++lp; continue; }
    if (!isfinite(v)) { ++ln; continue; }
    bool mz = i >= zero_from || (zero_group != nullptr && zero_group[i / group_elems]);
    if (mz && v != 0.f) ++lz;
    lerr = fmaxf(lerr, fabsf(v - r));
  }
  atomicMax(&st->max_err_bits, __float_as_uint(lerr));
  atomicMax(&st->max_ref_bits, __float_as_uint(lref));
  if (lp) atomicAdd(&st->poison, lp);
  if (ln) atomicAdd(&st->nan, ln);
  if (lz) atomicAdd(&st->nonzero, lz);
}

// ------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------
struct Shape {
  std::string name;
  bool outer;  // variant C instead of A/B
  int64_t M, K, N;
  std::vector<int32_t> sizes;
  bool small;
};

static std::vector<int32_t> balanced(int64_t M, int G) {
  std::vector<int32_t> s(G, (int32_t)(M / G));
  for (int i = 0; i < (int)(M % G); ++i) s[i]++;
  return s;
}
static std::vector<int32_t> skewed(int64_t M, int G, int big) {  // group `big` gets 60%
  std::vector<int32_t> s(G, 0);
  int64_t b = M * 6 / 10;
  s[big] = (int32_t)b;
  int64_t rest = M - b;
  for (int i = 0, j = 0; i < G; ++i)
    if (i != big) { s[i] = (int32_t)(rest / (G - 1) + (j < rest % (G - 1) ? 1 : 0)); ++j; }
  return s;
}
static std::vector<int32_t> random_sizes(int64_t M, int G, uint32_t seed) {  // ~10% empty groups
  std::mt19937 rng(seed);
  std::exponential_distribution<double> ex(1.0);
  std::vector<double> w(G);
  for (int i = 0; i < G; ++i) w[i] = (rng() % 10 == 0) ? 0.0 : ex(rng);
  w[G / 2] += 1.0;
  double sum = 0;
  for (double x : w) sum += x;
  std::vector<int32_t> s(G);
  int64_t acc = 0;
  for (int i = 0; i < G; ++i) { s[i] = (int32_t)std::floor(w[i] / sum * (double)M); acc += s[i]; }
  s[G / 2] += (int32_t)(M - acc);
  return s;
}

struct Runner {
  cudaStream_t stream;
  int warmup = 5, iters = 20;
  int failures = 0, passes = 0;
  cudaEvent_t e0, e1;
};

static void launch_compare(Runner& R, const void* out, bool f32, const float* ref, int64_t n,
                           int64_t zero_from, const unsigned char* zero_group, int64_t group_elems,
                           Stats* d_st, Stats* h_st) {
  CK(cudaMemsetAsync(d_st, 0, sizeof(Stats), R.stream));
  int blocks = (int)std::min<int64_t>(4096, std::max<int64_t>(1, (n + 255) / 256));
  if (f32) compare<true><<<blocks, 256, 0, R.stream>>>(out, ref, n, zero_from, zero_group, group_elems, d_st);
  else compare<false><<<blocks, 256, 0, R.stream>>>(out, ref, n, zero_from, zero_group, group_elems, d_st);
  CK(cudaGetLastError());
  CK(cudaMemcpyAsync(h_st, d_st, sizeof(Stats), cudaMemcpyDeviceToHost, R.stream));
  wait_stream("compare", R.stream);
}

static float bits2f(unsigned int b) { float f; std::memcpy(&f, &b, 4); return f; }

// Runs `call` (one library call, returns cudaError_t) checked + timed, prints the case line.
template <class Call>
static void run_case(Runner& R, const std::string& label, Call call, void* out, bool f32, int64_t n_out,
                     const float* ref, int64_t zero_from, const unsigned char* zero_group,
                     int64_t group_elems, double flops, Stats* d_st, Stats* h_st) {
  const size_t out_bytes = (size_t)n_out * (f32 ? 4 : 2);
  CK(cudaMemsetAsync(out, 0xFF, out_bytes, R.stream));  // poison
  cudaError_t e = call();
  if (e != cudaSuccess) {
    std::printf("case %s FAIL call returned %s\n", label.c_str(), cudaGetErrorString(e));
    std::fflush(stdout);
    R.failures++;
    return;
  }
  wait_stream(label.c_str(), R.stream);
  launch_compare(R, out, f32, ref, n_out, zero_from, zero_group, group_elems, d_st, h_st);
  Stats first = *h_st;

  for (int i = 0; i < R.warmup; ++i) CK(call());
  CK(cudaEventRecord(R.e0, R.stream));
  for (int i = 0; i < R.iters; ++i) CK(call());
  CK(cudaEventRecord(R.e1, R.stream));
  wait_until("timed loop", R.stream, R.e1);
  float ms_total = 0.f;
  CK(cudaEventElapsedTime(&ms_total, R.e0, R.e1));
  double ms = ms_total / std::max(1, R.iters);
  launch_compare(R, out, f32, ref, n_out, zero_from, zero_group, group_elems, d_st, h_st);
  Stats again = *h_st;

  const double tol = f32 ? 2e-3 : 1e-2;
  auto judge = [&](const Stats& s, double* rel) {
    double err = bits2f(s.max_err_bits), mref = bits2f(s.max_ref_bits);
    *rel = mref > 0 ? err / mref : err;
    return s.poison == 0 && s.nan == 0 && s.nonzero == 0 && *rel < tol;
  };
  double rel1 = 0, rel2 = 0;
  bool ok1 = judge(first, &rel1), ok2 = judge(again, &rel2);
  bool ok = ok1 && ok2;
  if (ok) R.passes++; else R.failures++;
  std::printf("case %s %s err=%.3e ms=%.4f TFLOP/s=%.1f", label.c_str(), ok ? "PASS" : "FAIL",
              std::max(rel1, rel2), ms, flops / (ms * 1e-3) / 1e12);
  if (!ok1 || !ok2) {
    const Stats& s = ok1 ? again : first;
    std::printf(" [%s: rel_err=%.3e tol=%.0e poison=%llu nonfinite=%llu nonzero_in_zero_region=%llu max|ref|=%.3e]",
                ok1 ? "after timing" : "first call", ok1 ? rel2 : rel1, tol, s.poison, s.nan, s.nonzero,
                (double)bits2f(s.max_ref_bits));
  }
  std::printf("\n");
  std::fflush(stdout);
}

static std::string sizes_str(const std::vector<int32_t>& s) {
  if (s.size() > 8) return "G=" + std::to_string(s.size());
  std::string r = "{";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? "," : "") + std::to_string(s[i]);
  return r + "}";
}

static void run_shape(Runner& R, const Shape& sh) {
  const int64_t M = sh.M, K = sh.K, N = sh.N, G = (int64_t)sh.sizes.size();
  // Host-side group bookkeeping for the REFERENCE only (the library reads sizes on device).
  std::vector<int64_t> start(G), rows(G);
  int64_t acc = 0;
  for (int64_t g = 0; g < G; ++g) {
    int64_t v = std::max<int32_t>(sh.sizes[g], 0);
    start[g] = std::min(acc, M);
    rows[g] = std::min(acc + v, M) - start[g];
    acc += v;
  }
  const int64_t total = std::min(acc, M);
  const double flops = 2.0 * (double)total * (double)K * (double)N;
  const std::string base = sh.name + " M=" + std::to_string(M) + " K=" + std::to_string(K) + " N=" +
                           std::to_string(N) + " sizes=" + sizes_str(sh.sizes);

  __nv_bfloat16 *lhs = nullptr, *rhs = nullptr, *rhsT = nullptr;
  int32_t* d_sizes = nullptr;
  float* ref = nullptr;
  void* out = nullptr;
  Stats *d_st = nullptr, *h_st = nullptr;
  const int64_t rhs_elems = sh.outer ? M * N : G * K * N;
  const int64_t out_elems = sh.outer ? G * K * N : M * N;
  CK(cudaMalloc(&lhs, std::max<int64_t>(1, M * K) * 2));
  CK(cudaMalloc(&rhs, std::max<int64_t>(1, rhs_elems) * 2));
  CK(cudaMalloc(&d_sizes, std::max<int64_t>(1, G) * 4));
  CK(cudaMalloc(&ref, std::max<int64_t>(1, out_elems) * 4));
  CK(cudaMalloc(&out, std::max<int64_t>(1, out_elems) * 4));
  CK(cudaMalloc(&d_st, sizeof(Stats)));
  CK(cudaMallocHost(&h_st, sizeof(Stats)));
  fill_random<<<2048, 256, 0, R.stream>>>(lhs, M * K, 1234 + M);
  fill_random<<<2048, 256, 0, R.stream>>>(rhs, rhs_elems, 777 + N);
  CK(cudaGetLastError());
  CK(cudaMemcpyAsync(d_sizes, sh.sizes.data(), G * 4, cudaMemcpyHostToDevice, R.stream));

  if (!sh.outer) {
    std::vector<int> row_group(M, -1);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = start[g]; r < start[g] + rows[g]; ++r) row_group[r] = (int)g;
    int* d_rg = nullptr;
    CK(cudaMalloc(&d_rg, std::max<int64_t>(1, M) * 4));
    CK(cudaMemcpyAsync(d_rg, row_group.data(), M * 4, cudaMemcpyHostToDevice, R.stream));
    CK(cudaMalloc(&rhsT, std::max<int64_t>(1, rhs_elems) * 2));
    transpose_kn<<<4096, 256, 0, R.stream>>>(rhs, rhsT, G, K, N);
    ref_forward<<<dim3((unsigned)((N + 127) / 128), (unsigned)std::min<int64_t>(M, 65535)), 128, 0, R.stream>>>(lhs, rhs, d_rg, M, K, N, ref);
    CK(cudaGetLastError());
    wait_stream("reference", R.stream);
    CK(cudaFree(d_rg));
    // Variant B is checked against the same reference with rhs transposed to [G, N, K].
    struct V { bool kmajor, f32; };
    std::vector<V> vs = {{false, false}, {true, false}};
    if (sh.small || sh.name == "bal8") { vs.push_back({false, true}); vs.push_back({true, true}); }
    for (const V& v : vs) {
      std::string label = base + (v.kmajor ? " var=B" : " var=A") + (v.f32 ? " out=f32" : " out=bf16");
      const __nv_bfloat16* r = v.kmajor ? rhsT : rhs;
      auto call = [&]() {
        return CutlassGroupedGemm(lhs, M, K, r, G, N, v.kmajor, d_sizes, out, v.f32, R.stream);
      };
      run_case(R, label, call, out, v.f32, out_elems, ref, total * N, nullptr, 1, flops, d_st, h_st);
    }
  } else {
    int64_t *d_start = nullptr, *d_rows = nullptr;
    unsigned char* d_empty = nullptr;
    std::vector<unsigned char> empty(G);
    for (int64_t g = 0; g < G; ++g) empty[g] = rows[g] == 0;
    CK(cudaMalloc(&d_start, G * 8));
    CK(cudaMalloc(&d_rows, G * 8));
    CK(cudaMalloc(&d_empty, G));
    CK(cudaMemcpyAsync(d_start, start.data(), G * 8, cudaMemcpyHostToDevice, R.stream));
    CK(cudaMemcpyAsync(d_rows, rows.data(), G * 8, cudaMemcpyHostToDevice, R.stream));
    CK(cudaMemcpyAsync(d_empty, empty.data(), G, cudaMemcpyHostToDevice, R.stream));
    ref_outer<<<dim3((unsigned)((N + 127) / 128), (unsigned)K, (unsigned)G), 128, 0, R.stream>>>(
        lhs, rhs, d_start, d_rows, K, N, ref);
    CK(cudaGetLastError());
    wait_stream("reference", R.stream);
    auto call = [&]() {
      return CutlassGroupedOuter(lhs, M, K, rhs, N, G, d_sizes, static_cast<float*>(out), R.stream);
    };
    run_case(R, base + " var=C out=f32", call, out, true, out_elems, ref, INT64_MAX, d_empty, K * N,
             flops, d_st, h_st);
    wait_stream("outer cleanup", R.stream);
    CK(cudaFree(d_start));
    CK(cudaFree(d_rows));
    CK(cudaFree(d_empty));
  }
  wait_stream("cleanup", R.stream);
  CK(cudaFree(lhs));
  CK(cudaFree(rhs));
  if (rhsT) CK(cudaFree(rhsT));
  CK(cudaFree(d_sizes));
  CK(cudaFree(ref));
  CK(cudaFree(out));
  CK(cudaFree(d_st));
  CK(cudaFreeHost(h_st));
}

int main(int argc, char** argv) {
  std::vector<std::string> only;
  bool small_only = false;
  Runner R;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) { std::printf("missing value after %s\n", a.c_str()); std::exit(2); }
      return argv[++i];
    };
    if (a == "--only") only.push_back(next());
    else if (a == "--small") small_only = true;
    else if (a == "--iters") R.iters = std::atoi(next());
    else if (a == "--warmup") R.warmup = std::atoi(next());
    else if (a == "--timeout") g_timeout_s = std::atof(next());
    else { std::printf("unknown argument %s\n", a.c_str()); return 2; }
  }

  int dev = 0;
  cudaDeviceProp prop;
  CK(cudaGetDevice(&dev));
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device: %s (sm_%d%d, %d SMs)\nconfig: %s\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount, CutlassGroupedGemmConfig());
  if (prop.major != 9) {
    std::printf("FAIL: this probe needs an sm_90 (Hopper) GPU\n");
    return 2;
  }
  CK(cudaStreamCreateWithFlags(&R.stream, cudaStreamNonBlocking));
  CK(cudaEventCreate(&R.e0));
  CK(cudaEventCreate(&R.e1));

  std::vector<Shape> shapes = {
      {"small1", false, 300, 128, 192, {0, 130, 170}, true},
      {"tail", false, 300, 128, 192, {50, 0, 100}, true},
      {"clamp", false, 300, 128, 192, {200, -5, 200, 7}, true},  // sum > M, a negative size
      {"allempty", false, 64, 64, 64, {0, 0, 0}, true},
      {"bal8", false, 16384, 2048, 4096, balanced(16384, 8), false},
      {"skew8", false, 16384, 2048, 4096, skewed(16384, 8, 3), false},
      {"rand64", false, 16384, 2048, 4096, random_sizes(16384, 64, 42), false},
      {"ffn8", false, 16384, 4096, 14336, balanced(16384, 8), false},
      {"big32", false, 65536, 2048, 7168, balanced(65536, 32), false},
      {"outer_small1", true, 300, 128, 192, {0, 130, 170}, true},
      {"outer_tail", true, 300, 128, 192, {50, 0, 100}, true},
      {"outer_bal8", true, 16384, 2048, 4096, balanced(16384, 8), false},
      {"outer_skew8", true, 16384, 2048, 4096, [] { auto s = skewed(16384, 8, 5); s[6] += s[1]; s[1] = 0; return s; }(), false},
  };
  int ran = 0;
  for (const Shape& sh : shapes) {
    if (small_only && !sh.small) continue;
    if (!only.empty()) {
      bool hit = false;
      for (auto& o : only) hit |= sh.name == o;
      if (!hit) continue;
    }
    run_shape(R, sh);
    ++ran;
  }
  if (ran == 0) { std::printf("no case selected\n"); return 2; }
  std::printf("summary: %d cases passed, %d failed\n", R.passes, R.failures);
  return R.failures == 0 ? 0 : 1;
}
