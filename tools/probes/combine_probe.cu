// Combine probe: how fast CombineKernel's gather + weighted sum (combine.cu, combine_gather.cuh) runs at the seed shape
// (T = 8192, k = 2, N = 4096 bf16: 134 MB of ret rows gathered + 67 MB of y written) against the copy ceiling of the
// same traffic, XLA's shape of the same fusion (58 us on the H200) and other shapes of kernel. Every variant computes
// y[t] = sum_j gates[t k + j] * ret[slot_ret_row[t k + j]] (rows of -1 dropped) in fp32 in the fixed order j = 0..k-1
// (one FFMA per term, as CombineKernel's `acc += g * x` compiles) and rounds once to bf16, so each must match the host
// reference bit for bit. None has CombineKernel's protocol (RankDev, arrival wait, CloseCall): the gather alone.
//   lib      CombineKernel's loop itself (GatherWeightedSum, bf16, V = 8): one warp per token, kU vectors x kJ choices
//            of 16-byte loads in flight per lane; "(a)" is what CombineKernel runs (512 threads, kU 4, kJ 2, one CTA
//            per SM). An item-per-thread loop (512 x 3 items x 2 choices) is slower: 81.7 us here, 170.4 us at
//            the DeepSeek-like shape.
//   flat     XLA's shape: one (token, 8 columns) item per thread, all k loads kJ at a time, a grid of T N / 8 / 256
//   bulk     per warp, a ring of S stages of k row chunks of 512 kU bytes each loaded by cp.async.bulk (TMA, one copy
//            per row by lanes 0..k-1, an mbarrier per stage), the next unit's rows prefetched in registers; the warp
//            sums from shared memory: bytes in flight are bounded by shared memory, not registers
// Loads: cg (ld.global.cg, what CombineKernel must use: ret rows are written by other SMs / GPUs while the call runs),
// nc (ld.global.nc.L1::no_allocate), ldg (ld.global.nc): the non-coherent path is only valid for data read-only for the
// whole kernel, so it is unsafe in CombineKernel; TMA reads go through L2 like cg (safe after the acquire).
// "x132" grids are one CTA per SM (the library's rule); "fill" grids are SMs x the CTAs per SM that fit.
// memcpy: cudaMemcpyAsync of (read + written) / 2 bytes, the same traffic: the ceiling.
// Median of --reps timed launches (CUDA events, one pair per launch) after a checked warm-up launch (y poisoned with
// 0xFFFF, a bf16 NaN, before it); --flush 1 overwrites a 256 MB buffer before each timed launch (cold L2).
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -I ffi -I ffi/include \
//     -o /tmp/combine_probe tools/probes/combine_probe.cu && /tmp/combine_probe
//   /tmp/combine_probe --tokens 4096 --k 8 --n 7168      (DeepSeek-like; also --reps R, --flush 1)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/ops/combine_gather.cuh"
#include "cuda/transport/bulk_push.cuh"
#include "probe_common.cuh"  // CK, FillKernel

namespace {
using bf16 = __nv_bfloat16;
enum Ld { kCg, kNc, kLdg };

template <Ld L>
__device__ __forceinline__ uint4 LoadG(const bf16* p) {
  const uint4* q = reinterpret_cast<const uint4*>(p);
  if constexpr (L == kCg) return __ldcg(q);
  if constexpr (L == kLdg) return __ldg(q);
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(q));
  return v;
}
// a[0..7] += g * the 8 bf16 of v (one FFMA each, fp32).
__device__ __forceinline__ void Acc8(float* a, float g, uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = __fmaf_rn(g, __uint_as_float(w[i] << 16), a[2 * i]);
    a[2 * i + 1] = __fmaf_rn(g, __uint_as_float(w[i] & 0xffff0000u), a[2 * i + 1]);
  }
}
__device__ __forceinline__ uint4 Pack8(const float* a) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a[2 * i], a[2 * i + 1]);
    memcpy(&w[i], &h, 4);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// CombineKernel's own loop (combine_gather.cuh, bf16, V = 8) without its protocol, with other shapes and loads;
// slot_out is nullptr as at the seed shape.
template <int kThreads, int kMinBlocks, int kU, int kJ, Ld L>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    LibKernel(const bf16* ret, int64_t ret_rows, const float* gates, const int32_t* slot_ret_row, int64_t T_,
              int64_t k, int64_t N, bf16* y, bf16* slot_out) {
  using jmo::cuda::Pack;
  jmo::cuda::GatherWeightedSum<bf16, 8, kU, kJ>(
      ret, ret_rows, gates, slot_ret_row, T_, k, N, y, slot_out,
      [](Pack<bf16, 8>& v, const bf16* p) { *reinterpret_cast<uint4*>(v.e) = LoadG<L>(p); }, [](int64_t, int32_t) {});
}

// (e): XLA's shape, one item per thread, 32-bit index math.
template <int kJ, Ld L>
__global__ void __launch_bounds__(256) FlatKernel(const bf16* ret, int ret_rows, const float* gates,
                                                  const int32_t* slot_ret_row, int T_, int k, int N, bf16* y) {
  const int vecs = N / 8, item = blockIdx.x * 256 + threadIdx.x;
  if (item >= T_ * vecs) return;
  const int t = item / vecs, n = item - t * vecs;
  float acc[8] = {};
  for (int j0 = 0; j0 < k; j0 += kJ) {
    uint4 v[kJ];
    int r[kJ];
#pragma unroll
    for (int jj = 0; jj < kJ; ++jj) {
      r[jj] = j0 + jj < k ? slot_ret_row[t * k + j0 + jj] : -1;
      if (r[jj] >= ret_rows) r[jj] = -1;
      if (r[jj] >= 0) v[jj] = LoadG<L>(ret + (int64_t)r[jj] * N + n * 8);
    }
#pragma unroll
    for (int jj = 0; jj < kJ; ++jj)
      if (r[jj] >= 0) Acc8(acc, gates[t * k + j0 + jj], v[jj]);
  }
  *reinterpret_cast<uint4*>(y + (int64_t)t * N + n * 8) = Pack8(acc);
}

// (e): TMA gather. Units (token, chunk of 512 kU bytes of the row) go round-robin to the grid's warps; each warp has
// S stages of k chunks in shared memory, an mbarrier per stage, and the stage's gates / valid-row mask. k <= 32.
template <int kWarps, int kU>
__global__ void __launch_bounds__(kWarps * 32) BulkKernel(const bf16* ret, int ret_rows, const float* gates,
                                                          const int32_t* slot_ret_row, int T_, int k, int N, bf16* y,
                                                          int S) {
  using namespace jmo::ptx;
  constexpr int kCB = 512 * kU;
  extern __shared__ __align__(128) char smem[];
  const int lane = threadIdx.x & 31, w = threadIdx.x / 32, stage = k * kCB, chunks = N * 2 / kCB;
  char* data = smem + w * S * stage;
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + kWarps * S * stage) + w * S;
  float* gs = reinterpret_cast<float*>(smem + kWarps * S * (stage + 8)) + w * S * k;
  uint32_t* mask = reinterpret_cast<uint32_t*>(smem + kWarps * S * (stage + 8 + 4 * k)) + w * S;
  if (lane < S) MbarInit(SmemAddr(&bar[lane]), 1);
  MbarInitFence();
  __syncwarp();
  const int units = T_ * chunks, W = gridDim.x * kWarps, gw = blockIdx.x * kWarps + w;
  const int count = gw < units ? (units - 1 - gw) / W + 1 : 0;
  int row = -1;
  float g = 0.f;
  auto fetch = [&](int i, int& r, float& gg) {  // this lane's row / gate of unit i (lane j: choice j)
    const int t = (gw + i * W) / chunks;
    r = -1;
    if (i < count && lane < k) r = slot_ret_row[t * k + lane], gg = gates[t * k + lane];
  };
  auto issue = [&](int i) {  // unit i into stage i % S, from row / g
    const int s = i % S, u = gw + i * W, c = u % chunks;
    const uint32_t valid = __ballot_sync(~0u, lane < k && row >= 0 && row < ret_rows);
    if (lane < k) gs[s * k + lane] = g;
    if (lane == 0) mask[s] = valid, MbarArriveExpectTx(SmemAddr(&bar[s]), __popc(valid) * kCB);
    __syncwarp();
    if (valid >> lane & 1)
      bulk::Load(SmemAddr(data + s * stage + lane * kCB), ret + (int64_t)row * N + c * (kCB / 2), kCB,
                 SmemAddr(&bar[s]));
  };
  int pr[8];  // the first S units' rows / gates: loaded together (one latency), then issued
  float pg[8] = {};
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (i < S) fetch(i, pr[i], pg[i]);
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (i < S && i < count) row = pr[i], g = pg[i], issue(i);
  fetch(S, row, g);
  for (int i = 0; i < count; ++i) {
    const int s = i % S, u = gw + i * W, t = u / chunks, c = u % chunks;
    MbarWait(SmemAddr(&bar[s]), (uint32_t)(i / S) & 1);
    const uint32_t valid = mask[s];
    float acc[kU][8] = {};
    for (int j = 0; j < k; ++j) {
      if (!(valid >> j & 1)) continue;
      const float gj = gs[s * k + j];
#pragma unroll
      for (int q = 0; q < kU; ++q)
        Acc8(acc[q], gj, *reinterpret_cast<const uint4*>(data + s * stage + j * kCB + (q * 32 + lane) * 16));
    }
#pragma unroll
    for (int q = 0; q < kU; ++q)
      *reinterpret_cast<uint4*>(y + (int64_t)t * N + c * (kCB / 2) + (q * 32 + lane) * 8) = Pack8(acc[q]);
    __syncwarp();  // every lane has read stage s: it may be refilled
    if (i + S < count) issue(i + S), fetch(i + S + 1, row, g);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int T = 8192, k = 2, N = 4096, reps = 25, flush = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--tokens")) T = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--k")) k = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--n")) N = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--flush")) flush = atoi(argv[i + 1]);
    else { fprintf(stderr, "usage: %s [--tokens T] [--k K] [--n N] [--reps R] [--flush 0|1]\n", argv[0]); return 2; }
  }
  if (T < 1 || k < 1 || k > 32 || N < 8 || N % 8 || reps < 1 || (int64_t)T * N >= (1ll << 31)) {
    fprintf(stderr, "needs 1 <= k <= 32, N a multiple of 8, T N < 2^31\n");
    return 2;
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int rows = T * k;  // ret_rows
  bf16 *ret, *y;
  float* gates;
  int32_t* srr;
  char* scratch;
  const int64_t ret_elems = (int64_t)rows * N, y_elems = (int64_t)T * N;
  CK(cudaMalloc(&ret, ret_elems * 2));
  CK(cudaMalloc(&y, y_elems * 2));
  CK(cudaMalloc(&gates, rows * 4));
  CK(cudaMalloc(&srr, rows * 4));
  FillKernel<<<1024, 256>>>(ret, ret_elems, 1234);
  CK(cudaGetLastError());
  std::vector<bf16> h_ret(ret_elems);
  std::vector<uint16_t> ref(y_elems), back(y_elems);
  CK(cudaMemcpy(h_ret.data(), ret, ret_elems * 2, cudaMemcpyDeviceToHost));
  std::mt19937_64 rng(42);
  std::vector<int32_t> h_srr(rows);
  std::vector<float> h_g(rows);
  for (int i = 0; i < rows; ++i) h_srr[i] = i;
  std::shuffle(h_srr.begin(), h_srr.end(), rng);
  int64_t valid = 0;
  for (int i = 0; i < rows; ++i) {
    if (i < k || rng() % 128 == 0) h_srr[i] = -1;  // token 0 entirely dropped, ~1% of the other slots
    h_g[i] = 0.01f + 0.99f * (float)(rng() >> 40) / (float)(1ull << 24);
    valid += h_srr[i] >= 0;
  }
  CK(cudaMemcpy(srr, h_srr.data(), rows * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(gates, h_g.data(), rows * 4, cudaMemcpyHostToDevice));
  for (int t = 0; t < T; ++t) {  // the reference: fp32, j = 0..k-1, one FMA per term, one rounding
    std::vector<float> acc(N, 0.f);
    for (int j = 0; j < k; ++j) {
      const int r = h_srr[t * k + j];
      if (r < 0) continue;
      const bf16* src = &h_ret[(int64_t)r * N];
      for (int n = 0; n < N; ++n) acc[n] = fmaf(h_g[t * k + j], __bfloat162float(src[n]), acc[n]);
    }
    for (int n = 0; n < N; ++n) ref[(int64_t)t * N + n] = __bfloat16_as_ushort(__float2bfloat16_rn(acc[n]));
  }
  const int64_t bytes = valid * N * 2 + y_elems * 2 + (int64_t)rows * 8;
  const int64_t flush_bytes = 256ll << 20, copy_bytes = std::max<int64_t>(bytes / 2 / 16 * 16, 16);
  CK(cudaMalloc(&scratch, std::max(flush_bytes, copy_bytes)));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("combine probe on %s (%d SMs): T=%d k=%d N=%d bf16, %lld of %d slots dropped, %.1f MB moved, median of %d%s\n",
         prop.name, sms, T, k, N, (long long)(rows - valid), rows, bytes / 1e6, reps, flush ? ", cold L2" : "");
  printf("| variant | grid x threads | regs / local B | us | GB/s | check |\n|---|---|---|---|---|---|\n");
  // One row: poison y, checked warm-up launch, then the median of `reps` launches (fn: the kernel, for its attributes).
  auto time = [&](const char* name, const void* fn, int grid, int threads, auto launch) {
    const bool check = fn != nullptr;
    if (check) CK(cudaMemsetAsync(y, 0xFF, y_elems * 2, st));
    launch();
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(st));
    int64_t bad = 0;
    if (check) {
      CK(cudaMemcpy(back.data(), y, y_elems * 2, cudaMemcpyDeviceToHost));
      for (int64_t i = 0; i < y_elems; ++i) bad += back[i] != ref[i];
    }
    const double us = 1e3 * MedianLaunchMs(st, reps, launch, [&](int r) {
      if (flush) CK(cudaMemsetAsync(scratch, r & 0xFF, flush_bytes, st));
    });
    char regs[32] = "-", chk[40] = "n/a";
    if (check) {
      cudaFuncAttributes a;
      CK(cudaFuncGetAttributes(&a, fn));
      snprintf(regs, sizeof regs, "%d / %zu", a.numRegs, a.localSizeBytes);
      snprintf(chk, sizeof chk, bad ? "WRONG (%lld bad)" : "ok", (long long)bad);
    }
    printf("| %-34s | %6d x %4d | %-9s | %7.1f | %6.0f | %s |\n", name, grid, threads, regs, us, bytes / us / 1e3, chk);
    fflush(stdout);
  };
  time("memcpy (same traffic, ceiling)", nullptr, 0, 0,
       [&] { CK(cudaMemcpyAsync(scratch, ret, copy_bytes, cudaMemcpyDeviceToDevice, st)); });
  // One kernel variant: grid 0 = one CTA per SM ("x132"), -1 = SMs x the CTAs per SM that fit ("fill"), else as given.
  auto run = [&](const char* tag, auto kern, int threads, int grid, int smem, auto... extra) {
    char name[80];
    if (grid <= 0) {
      int b = 1;
      if (grid < 0) CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kern, threads, smem));
      snprintf(name, sizeof name, "%s %s", tag, grid < 0 ? "fill" : "x132");
      grid = std::max(b, 1) * sms;
    } else {
      snprintf(name, sizeof name, "%s", tag);
    }
    time(name, (const void*)kern, grid, threads,
         [&] { kern<<<grid, threads, smem, st>>>(ret, rows, gates, srr, T, k, N, y, extra...); });
  };
  const int flat_grid = (int)((y_elems / 8 + 255) / 256);
  // TMA: S stages per warp, as many as `budget` bytes of shared memory per CTA allow (at most 8, at least 2).
  auto tma = [&](const char* tag, auto kern, int warps, int kU, int budget) {
    const int cb = 512 * kU, per_stage = k * cb + 8 + 4 * k + 4, S = std::min(8, budget / (warps * per_stage));
    char name[80];
    snprintf(name, sizeof name, "%s S=%d (%d KiB)", tag, S, warps * S * per_stage / 1024);
    if ((N * 2) % cb || S < 2) return (void)printf("| %-34s | skipped: N * 2 %% %d != 0 or S < 2 |\n", name, cb);
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, warps * S * per_stage));
    run(name, kern, warps * 32, -1, warps * S * per_stage, S);
  };
  bf16* no_slot_out = nullptr;  // as at the seed shape
  run("(a) lib 512 u4 j2 cg", LibKernel<512, 1, 4, 2, kCg>, 512, 0, 0, no_slot_out);
  run("lib 1024 u2 j2 cg", LibKernel<1024, 1, 2, 2, kCg>, 1024, 0, 0, no_slot_out);
  run("lib 256x4 u2 j2 cg", LibKernel<256, 4, 2, 2, kCg>, 256, -1, 0, no_slot_out);
  run("lib 512 u2 j4 cg", LibKernel<512, 1, 2, 4, kCg>, 512, 0, 0, no_slot_out);
  run("lib 512 u8 j1 cg", LibKernel<512, 1, 8, 1, kCg>, 512, 0, 0, no_slot_out);
  run("lib 512 u4 j2 ldg", LibKernel<512, 1, 4, 2, kLdg>, 512, 0, 0, no_slot_out);
  run("lib 512 u4 j2 nc", LibKernel<512, 1, 4, 2, kNc>, 512, 0, 0, no_slot_out);
  run("e flat j2 cg (XLA's shape)", FlatKernel<2, kCg>, 256, flat_grid, 0);
  run("e flat j4 cg", FlatKernel<4, kCg>, 256, flat_grid, 0);
  run("d flat j2 ldg", FlatKernel<2, kLdg>, 256, flat_grid, 0);
  tma("e tma 8 warps 1 KiB", BulkKernel<8, 2>, 8, 2, 200 * 1024);
  tma("e tma 4 warps 2 KiB", BulkKernel<4, 4>, 4, 4, 100 * 1024);
  tma("e tma 8 warps 2 KiB", BulkKernel<8, 4>, 8, 4, 200 * 1024);
  return 0;
}
