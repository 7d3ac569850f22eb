// Standalone probe for wgmma_gemm.cuh: correctness against a naive fp32 GPU reference, then timing.
//   wgmma_probe [--small-only] [--no-timing]
// Exit codes: 0 all PASS, 1 some FAIL, 2 CUDA error, 3 watchdog timeout.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "wgmma_gemm.cuh"

#define CK(x)                                                                                        \
  do {                                                                                               \
    cudaError_t e_ = (x);                                                                            \
    if (e_ != cudaSuccess) {                                                                         \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
      exit(2);                                                                                       \
    }                                                                                                \
  } while (0)

static double g_watchdog_s = 10.0;

// The GEMM may spin forever on an mbarrier if something is wrong: never block in cudaStreamSynchronize.
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

// [G, K, N] -> [G, N, K]
__global__ void TransposeKernel(const __nv_bfloat16* in, __nv_bfloat16* out, int K, int N) {
  __shared__ __nv_bfloat16 t[32][33];
  const int64_t g = blockIdx.z;
  const int k0 = blockIdx.y * 32, n0 = blockIdx.x * 32;
  const __nv_bfloat16* src = in + g * K * (int64_t)N;
  __nv_bfloat16* dst = out + g * K * (int64_t)N;
  for (int i = threadIdx.y; i < 32; i += blockDim.y) t[i][threadIdx.x] = src[(int64_t)(k0 + i) * N + n0 + threadIdx.x];
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += blockDim.y) dst[(int64_t)(n0 + i) * K + k0 + threadIdx.x] = t[threadIdx.x][i];
}

// Naive reference: one thread per output element; row_start (host-computed, clamped, G + 1 entries).
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

struct CmpResult {
  unsigned int max_err_bits;  // non-negative floats compare like their bit patterns
  unsigned int max_ref_bits;
  unsigned long long bad_values;  // non-finite (leftover poison) in data rows
  unsigned long long bad_padding; // padding rows not exactly +0
};

template <bool kF32>
__global__ void CompareKernel(const void* out, const float* ref, int64_t total_rows, int64_t M, int64_t N,
                              CmpResult* res) {
  float my_err = 0.f, my_ref = 0.f;
  unsigned long long bad_v = 0, bad_p = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < M * N; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / N;
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
    if (r >= total_rows) {
      bad_p += bits != 0;
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
  if (bad_p) atomicAdd(&res->bad_padding, bad_p);
}

// tile_done of the callback variants: counts every 64-row band of every group once per finished tile that covers
// it (a 128-row tile covers 1 or 2 bands of its group), and checks that two far corners of the tile, stored by
// other consumer threads, are already visible (not the NaN poison) to the calling thread.
struct BandCounter {
  unsigned* band_count;   // [total bands]
  const int* band_base;   // [G] index of group g's first band
  unsigned* stats;        // [0] tiles seen, [1] tiles whose corners were still poison, [2] calls by a thread != 128
  bool out_f32;
  __device__ void operator()(const wgmma_gemm::GroupTile& t) const {
    atomicAdd(&stats[0], 1u);
    if (threadIdx.x != 128) atomicAdd(&stats[2], 1u);
    const int b0 = t.group_row / 64, nb = (t.rows + 63) / 64;
    for (int j = 0; j < nb; ++j) atomicAdd(&band_count[band_base[t.b_idx] + b0 + j], 1u);
    if (t.rows > 0) {
      bool bad = false;
      const int64_t far = (int64_t)(t.rows - 1) * t.ldc + t.cols - 1, mid = (int64_t)(t.rows / 2) * t.ldc + t.cols / 2;
      if (out_f32) {
        const unsigned* o = static_cast<const unsigned*>(t.out);
        bad = __ldcg(o + far) == 0xFFFFFFFFu || __ldcg(o + mid) == 0xFFFFFFFFu;
      } else {
        const unsigned short* o = static_cast<const unsigned short*>(t.out);
        bad = __ldcg(o + far) == 0xFFFFu || __ldcg(o + mid) == 0xFFFFu;
      }
      if (bad) atomicAdd(&stats[1], 1u);
    }
  }
};

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
  const int64_t b = (int64_t)(M * frac) + 37;  // deliberately not a multiple of 128
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
         num_sms, prop.sharedMemPerBlockOptin, wgmma_gemm::kSmemBytes);
  if (prop.major != 9) {
    fprintf(stderr, "needs a Hopper (sm_90) GPU\n");
    return 2;
  }
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  std::vector<Case> cases = {
      {"small_M300_K128_N192_G3", 300, 128, 192, {0, 130, 170}, true},
      {"small_pad_M300_K128_N64_G4", 300, 128, 64, {7, 0, 100, 93}, true},
      {"small_clamp_M300_K192_N320_G2", 300, 192, 320, {250, 250}, true},
      {"small_many_M1000_K64_N128_G40", 1000, 64, 128, RandomSizes(1000, 40, 7, 0.8), true},
      {"small_rows1_M5_K64_N64_G3", 5, 64, 64, {1, 0, 3}, true},
      {"M16384_K2048_N4096_G8_balanced", 16384, 2048, 4096, Balanced(16384, 8), false},
      {"M16384_K2048_N4096_G8_skew60", 16384, 2048, 4096, Skewed(16384, 8, 2, 0.6), false},
      {"M16384_K2048_N4096_G64_random", 16384, 2048, 4096, RandomSizes(16384, 64, 11, 1.0), false},
      {"M16384_K2048_N4096_G64_pad90", 16384, 2048, 4096, RandomSizes(16384, 64, 13, 0.9), false},
      {"M16384_K4096_N14336_G8_balanced", 16384, 4096, 14336, Balanced(16384, 8), false},
      {"M65536_K2048_N7168_G32_balanced", 65536, 2048, 7168, Balanced(65536, 32), false},
      {"dense_ref_M8192_K8192_N8192_G1", 8192, 8192, 8192, {8192}, false},
  };

  int failures = 0;
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

    __nv_bfloat16 *lhs, *rhs_kn, *rhs_nk;
    float* ref;
    void* out;
    int32_t* d_sizes;
    int* d_row_start;
    CmpResult* d_res;
    CK(cudaMalloc(&lhs, M * K * 2));
    CK(cudaMalloc(&rhs_kn, G * K * N * 2));
    CK(cudaMalloc(&rhs_nk, G * K * N * 2));
    CK(cudaMalloc(&ref, M * N * 4));
    CK(cudaMalloc(&out, M * N * 4));
    CK(cudaMalloc(&d_sizes, G * 4));
    CK(cudaMalloc(&d_row_start, (G + 1) * 4));
    CK(cudaMalloc(&d_res, sizeof(CmpResult)));
    // Bands of 64 rows per group (clamped sizes), for the callback variants.
    std::vector<int> band_base(G, 0);
    int total_bands = 0;
    for (int64_t g = 0; g < G; ++g) {
      band_base[g] = total_bands;
      total_bands += (row_start[g + 1] - row_start[g] + 63) / 64;
    }
    const unsigned n_tiles = (unsigned)((N + wgmma_gemm::kBN - 1) / wgmma_gemm::kBN);
    unsigned *d_band_count, *d_stats;
    int* d_band_base;
    CK(cudaMalloc(&d_band_count, std::max(total_bands, 1) * sizeof(unsigned)));
    CK(cudaMalloc(&d_stats, 3 * sizeof(unsigned)));
    CK(cudaMalloc(&d_band_base, G * sizeof(int)));
    CK(cudaMemcpyAsync(d_band_base, band_base.data(), G * sizeof(int), cudaMemcpyHostToDevice, stream));
    CK(cudaMemcpyAsync(d_sizes, c.sizes.data(), G * 4, cudaMemcpyHostToDevice, stream));
    CK(cudaMemcpyAsync(d_row_start, row_start.data(), (G + 1) * 4, cudaMemcpyHostToDevice, stream));
    FillKernel<<<1024, 256, 0, stream>>>(lhs, M * K, 1);
    FillKernel<<<1024, 256, 0, stream>>>(rhs_kn, G * K * N, 2);
    CK(cudaGetLastError());
    TransposeKernel<<<dim3(N / 32, K / 32, G), dim3(32, 8), 0, stream>>>(rhs_kn, rhs_nk, (int)K, (int)N);
    CK(cudaGetLastError());
    RefKernel<<<dim3((N + 31) / 32, (M + 7) / 8), dim3(32, 8), 0, stream>>>(lhs, rhs_kn, d_row_start, (int)G, (int)M,
                                                                              (int)K, (int)N, ref);
    CK(cudaGetLastError());
    WaitOrDie(stream, c.name + " (reference)");

    // Variants 0-3: {rhs[G,K,N], rhs[G,N,K]} x {bf16, f32} out, plain. 4: rhs[G,K,N] bf16 (the expert_combine
    // configuration) and 5: rhs[G,N,K] f32 through the tile_done callback (BandCounter).
    for (int variant = 0; variant < 6; ++variant) {
      const bool cb = variant >= 4;
      const bool k_major = cb ? variant == 5 : variant >= 2, f32 = cb ? variant == 5 : variant % 2;
      const std::string vname = c.name + (k_major ? " rhs[G,N,K]" : " rhs[G,K,N]") + (f32 ? " out=f32" : " out=bf16") +
                                (cb ? " callback" : "");
      const __nv_bfloat16* rhs = k_major ? rhs_nk : rhs_kn;
      const BandCounter counter{d_band_count, d_band_base, d_stats, f32};
      if (cb) {
        CK(cudaMemsetAsync(d_band_count, 0, std::max(total_bands, 1) * sizeof(unsigned), stream));
        CK(cudaMemsetAsync(d_stats, 0, 3 * sizeof(unsigned), stream));
      }
      auto call = [&]() {
        const cudaError_t e =
            cb ? wgmma_gemm::GroupedGemmWithDone(lhs, M, K, rhs, G, N, k_major, d_sizes, out, f32, num_sms, counter,
                                                 stream)
               : WgmmaGroupedGemm(lhs, M, K, rhs, G, N, k_major, d_sizes, out, f32, num_sms, stream);
        if (e != cudaSuccess) {
          printf("case %s FAIL launch error: %s\n", vname.c_str(), cudaGetErrorString(e));
          exit(2);
        }
      };
      // Poison: 0xFF bytes are NaN in bf16 (0xFFFF) and in f32 (0xFFFFFFFF).
      CK(cudaMemsetAsync(out, 0xFF, M * N * (f32 ? 4 : 2), stream));
      call();
      WaitOrDie(stream, vname);
      CK(cudaMemsetAsync(d_res, 0, sizeof(CmpResult), stream));
      if (f32)
        CompareKernel<true><<<1024, 256, 0, stream>>>(out, ref, total_rows, M, N, d_res);
      else
        CompareKernel<false><<<1024, 256, 0, stream>>>(out, ref, total_rows, M, N, d_res);
      CK(cudaGetLastError());
      CmpResult res;
      CK(cudaMemcpyAsync(&res, d_res, sizeof(res), cudaMemcpyDeviceToHost, stream));
      WaitOrDie(stream, vname + " (compare)");
      float max_err, max_ref;
      memcpy(&max_err, &res.max_err_bits, 4);
      memcpy(&max_ref, &res.max_ref_bits, 4);
      const double rel = max_ref > 0 ? max_err / max_ref : max_err;
      const double tol = f32 ? 2e-3 : 1e-2;
      bool pass = res.bad_values == 0 && res.bad_padding == 0 && rel < tol && (total_rows == 0 || max_ref > 0);
      std::string cb_note;
      if (cb) {
        // Right after the first call: every band counted exactly n_tiles times, one call per tile, by thread 128.
        std::vector<unsigned> counts(std::max(total_bands, 1));
        unsigned stats[3];
        CK(cudaMemcpyAsync(counts.data(), d_band_count, counts.size() * sizeof(unsigned), cudaMemcpyDeviceToHost,
                           stream));
        CK(cudaMemcpyAsync(stats, d_stats, sizeof(stats), cudaMemcpyDeviceToHost, stream));
        WaitOrDie(stream, vname + " (band counts)");
        int wrong = 0;
        for (int b = 0; b < total_bands; ++b) wrong += counts[b] != n_tiles;
        unsigned long long exp_tiles = 0;
        for (int64_t g = 0; g < G; ++g) exp_tiles += (unsigned long long)((row_start[g + 1] - row_start[g] + 127) / 128) * n_tiles;
        const bool cb_ok = wrong == 0 && stats[0] == exp_tiles && stats[1] == 0 && stats[2] == 0;
        char buf[200];
        snprintf(buf, sizeof(buf), " bands=%d wrong_bands=%d tiles=%u/%llu not_visible=%u wrong_thread=%u", total_bands,
                 wrong, stats[0], exp_tiles, stats[1], stats[2]);
        cb_note = buf;
        pass = pass && cb_ok;
      }
      if (!pass) ++failures;

      double ms = 0;
      if (timing) {
        for (int i = 0; i < 5; ++i) call();
        WaitOrDie(stream, vname + " (warm-up)");
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        CK(cudaEventRecord(e0, stream));
        for (int i = 0; i < 20; ++i) call();
        CK(cudaEventRecord(e1, stream));
        WaitOrDie(stream, vname + " (timing)");
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        ms = t / 20;
        CK(cudaEventDestroy(e0));
        CK(cudaEventDestroy(e1));
      }
      printf("case %-34s %-12s %-9s%s %s err=%.3e (max_err=%.3e max_ref=%.3e nonfinite=%llu badpad=%llu) ms=%.4f "
             "TFLOP/s=%.1f%s\n",
             c.name.c_str(), k_major ? "rhs[G,N,K]" : "rhs[G,K,N]", f32 ? "out=f32" : "out=bf16", cb ? " cb" : "",
             pass ? "PASS" : "FAIL", rel, max_err, max_ref, res.bad_values, res.bad_padding, ms,
             ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0, cb_note.c_str());
      fflush(stdout);
    }
    CK(cudaFree(lhs));
    CK(cudaFree(rhs_kn));
    CK(cudaFree(rhs_nk));
    CK(cudaFree(ref));
    CK(cudaFree(out));
    CK(cudaFree(d_sizes));
    CK(cudaFree(d_row_start));
    CK(cudaFree(d_res));
    CK(cudaFree(d_band_count));
    CK(cudaFree(d_stats));
    CK(cudaFree(d_band_base));
  }
  printf("%s: %d failing variant(s)\n", failures ? "FAILED" : "ALL PASS", failures);
  return failures ? 1 : 0;
}
