// Hopper (sm_90a) bf16 "grouped outer" GEMM (the weight gradient, tgmm): wgmma.mma_async + TMA, warp-specialized,
// persistent.
//
//   out[g] = lhs[rows of g]^T @ rhs[rows of g]        g = 0 .. G-1   (zero for empty groups)
//
// lhs [M, K] bf16 row-major, rhs [M, N] bf16 row-major, group_sizes [G] int32 in DEVICE memory (read by the kernel,
// no host sync; groups are consecutive row ranges from row 0, negative sizes count as 0, clipped at M), out
// [G, K, N] bf16 or f32 (fp32 accumulation). Per group it is a GEMM with rows of out = K (the "m" of the MMA),
// columns = N, and the reduction over the group's rows (any count, 0 included).
//
//   WgmmaGroupedOuter(lhs, M, K, rhs, N, G, group_sizes_dev, out, out_f32, num_sms, stream)
// Requires K % 64 == 0, N % 64 == 0, 16-byte aligned pointers, 1 <= G <= 1024, 1 <= M < 2^31 - 64; returns
// cudaErrorInvalidValue otherwise, cudaErrorNotSupported on a device that is not compute capability 9.x or a build
// without sm_90a code (the caller falls back).
//
// ---- Design ----------------------------------------------------------------------------------------------------
//   * Tiles: (group g, 128 rows of K = m0, 256 columns of N = n0); every group has the same
//     m_tiles * n_tiles tiles (empty groups too: their tiles just store zeros), each reducing over the group's rows
//     in chunks of kBK = 64 rows, ceil(rows_g / 64) chunks.
//   * Schedule: persistent grid (<= num_sms CTAs, 1 CTA/SM, 384 threads). Every CTA reads group_sizes, builds the
//     clamped row offsets (warp scan) and sorts the groups by chunk count, descending (rank sort in smem, G <= 256;
//     above, the groups with rows first), so the tile list is in descending work (BuildOuterTables); tile positions are dealt out "snake" style
//     (round j: CTA b takes position j * grid + b for even j, j * grid + grid - 1 - b for odd j): greedy-ish
//     balance for skewed groups without an atomic counter. Inside a group: m-tile fastest, so the CTAs running the
//     same group at the same time share the lhs / rhs row chunks in L2.
//   * Operands (both "MN-major": the MMA's m / n index is the contiguous one in memory):
//       A[m][r] = lhs[r][m0 + m]: lhs as a 2D map (K, M), box (64 k-cols, 64 rows), 128B swizzle; two boxes per
//         stage (m 0..63, 64..127), 8 KB each, one per consumer warpgroup. wgmma with imm-trans-a = 1.
//       B[r][n] = rhs[r][n0 + n]: rhs as a 2D map (N, M), box (64, 64), 128B swizzle; four boxes per stage
//         (n 0..255), exactly like the [G, K, N] B of wgmma_grouped.cuh. imm-trans-b = 1.
//     Stage = 16 KB A + 32 KB B, 4 stages, full/empty mbarriers; boxes past K / N / M are zero-filled by TMA (and
//     counted in the transaction bytes).
//   * Descriptors (canonical MN-major SW128: ((8,8,m),(8,k)) : ((1,8,LBO),(64,SBO)) elements): 128 B lines of 64
//     m (or n) values, one line per reduction row; SBO = 1024 (next 8 rows), LBO = 8192 (next 64-wide chunk; for A
//     with m = 64 per warpgroup it is never used), +2048 B (16 rows) per k16 step. Chunks are 1024-aligned.
//   * The reduction tail: the last chunk of a group starts at row r0 + 64 (nch - 1) and has valid = rows_g -
//     64 (nch - 1) rows (1..64); its rows >= valid belong to the next group (or past the data: anything, even NaN)
//     and must contribute nothing. With the 128B swizzle, smem byte address bits [4:6] are XORed with bits [7:9]:
//     only the 16-byte pieces inside a 128-byte line move, the line (bits >= 7) does not, and a line of these
//     boxes is exactly one row r (64 bf16 of one row). So after the full barrier of that stage, each consumer
//     warpgroup c zeroes lines [valid, 64) of its A chunk c and of the B chunks 2c, 2c+1 (16-byte generic st.shared),
//     executes fence.proxy.async.shared::cta (generic writes -> visible to the async proxy that wgmma reads
//     through) and both consumer warpgroups pass named barrier 1 (each warpgroup reads all four B chunks) before
//     wgmma.fence + the MMAs. Both operands are zeroed so that 0 * NaN/Inf in the foreign rows cannot leak.
//     The same fence also orders these generic writes before the next TMA write into the slot (the empty-barrier
//     arrive comes after it). The TMA writes themselves are visible to the zeroing threads through the full
//     barrier's wait (complete_tx).
//   * Consumers: WG1 / WG2 own rows m 0..63 / 64..127 of the tile (wgmma m64n256k16, 128 fp32 accumulators per
//     thread, one commit group in flight, the previous slot released after wait_group 1). A warpgroup whose 64
//     rows are all >= K (last m-tile when K % 128 == 64) still issues its MMAs on the TMA zero fill (a branch
//     around the wgmma makes ptxas serialize all of them) and skips only the epilogue.
//     Epilogue straight from registers as in WgmmaTileLoop (pair-swapped 8 B / 16 B stores, rows >= K - m0 and
//     columns >= N - n0 masked).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

// The loop's building blocks (wgmma_mainloop.cuh), EncodeMap, CachedMapPair, LaunchWgmmaKernel.
#include "cuda/gemm/sm90/wgmma_grouped.cuh"

namespace wgmma_outer {

using namespace wgmma_gemm;  // kBM, kBN, kBK, kThreads, register budget, PTX wrappers

constexpr int kOuterStages = 4;
constexpr int kOuterMaxGroups = 1024;
constexpr int kSortMaxGroups = 256;  // rank sort is O(G^2 / 384) per CTA; above this, a partition
constexpr int kChunkBytes = 64 * 128;  // one TMA box: 64 rows x 128 B
// Dynamic smem: stages + barriers + 1 KB alignment slack (196,672 + 1,024). The group tables are static smem
// (3 x 1025 ints = 12,300 B): 32-bit shared addresses keep the 24-register producer free of spills.
constexpr int kOuterSmemBytes = LoopSmemBytes<kOuterStages>();

struct OuterTile {
  int g;      // group
  int m0;     // first row of out[g] (= first column of lhs)
  int n0;     // first column
  int r0;     // first row of the group in lhs / rhs
  int rows;   // rows of the group (clamped), the reduction length
};

// Tables in smem, identical in every CTA.
struct OuterTables {
  const int* row_start;  // [G + 1] clamped group row offsets
  const int* order;      // [G] groups by descending chunk count
  int m_tiles, n_tiles;
};

__device__ __forceinline__ OuterTile DecodeOuterTile(int p, const OuterTables& t) {
  const int tpg = t.m_tiles * t.n_tiles;
  const int j = p / tpg;
  const int local = p - j * tpg;
  OuterTile tile;
  tile.g = t.order[j];
  tile.m0 = (local % t.m_tiles) * kBM;
  tile.n0 = (local / t.m_tiles) * kBN;
  tile.r0 = t.row_start[tile.g];
  tile.rows = t.row_start[tile.g + 1] - tile.r0;
  return tile;
}

// The snake deal as WgmmaLoop's next_tile (the FP8 outer GEMM; the bf16 kernel below walks the same positions with
// its two alternating steps): CTA b of `grid` takes position j * grid + b in round j even, j * grid + grid - 1 - b in
// round j odd.
struct SnakeTiles {
  int b, grid;
  __device__ __forceinline__ int operator()(int prev) const {
    if (prev < 0) return b;
    return prev + (((prev / grid) & 1) ? 2 * b + 1 : 2 * (grid - 1 - b) + 1);
  }
};

// The group tables of the outer schedule, by all the CTA's threads (ready in every thread on return), from
// group_sizes [G] (device; negative sizes count as 0):
//   row_start[0..G]  the groups' row offsets, each group's size rounded up to a multiple of kRowAlign (1: none; 128:
//                    the FP8 outer's padded groups), clamped at M;
//   key[0..G)        each group's reduction steps, ceil(rows / kStepRows);
//   order[0..G)      the groups by descending key (rank sort, stable; G <= kSortMaxGroups), or above that the groups
//                    with rows first, each part in natural order;
//   *live            (when not null) the number of groups with rows: order's first *live entries.
template <int kRowAlign, int kStepRows>
__device__ __forceinline__ void BuildOuterTables(const int32_t* __restrict__ group_sizes, int G, int M, int* row_start,
                                                 int* order, int* key, int* live) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  for (int g = tid; g < G; g += kThreads) row_start[g] = max(0, group_sizes[g]);
  __syncthreads();
  if (warp == 0) {
    long long carry = 0;
    int live_carry = 0;
    for (int base = 0; base < G; base += 32) {
      const int g = base + lane;
      const long long v = g < G ? ((long long)row_start[g] + kRowAlign - 1) / kRowAlign * kRowAlign : 0;
      const long long incl = WarpInclusiveSum(v, lane);
      const long long beg = carry + incl - v, end = carry + incl;
      const int rows = (int)((end < M ? end : M) - (beg < M ? beg : M));
      const int has_rows = (int)WarpInclusiveSum(rows > 0, lane);
      __syncwarp();
      if (g < G) {
        row_start[g] = (int)(beg < M ? beg : M);
        key[g] = (rows + kStepRows - 1) / kStepRows;
      }
      carry = __shfl_sync(0xffffffffu, end, 31);
      live_carry += __shfl_sync(0xffffffffu, has_rows, 31);
    }
    if (lane == 0) {
      row_start[G] = (int)(carry < M ? carry : M);
      if (live != nullptr) *live = live_carry;
    }
    if (G > kSortMaxGroups) {
      // Stable partition: a group with rows goes after the groups with rows before it, one without after all
      // live_carry groups with rows and the groups without before it.
      __syncwarp();
      int before = 0;  // groups with rows below `base`
      for (int base = 0; base < G; base += 32) {
        const int g = base + lane;
        const int has = g < G && key[g] > 0;
        const int incl = (int)WarpInclusiveSum(has, lane);
        if (g < G) order[has ? before + incl - 1 : live_carry + g - (before + incl)] = g;
        before += __shfl_sync(0xffffffffu, incl, 31);
      }
    }
  }
  __syncthreads();
  if (G <= kSortMaxGroups) {
    for (int g = tid; g < G; g += kThreads) {
      const int kg = key[g];
      int rank = 0;
      for (int h = 0; h < G; ++h) {
        const int kh = key[h];
        rank += (kh > kg) | ((kh == kg) & (h < g));
      }
      order[rank] = g;
    }
  }
  __syncthreads();
}

// ------------------------------------------------------------------------------------------------------------
// Kernel
// ------------------------------------------------------------------------------------------------------------
template <bool kOutF32>
__global__ void __launch_bounds__(kThreads, 1)
    GroupedOuterKernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                       const int32_t* __restrict__ group_sizes, int G, int M, int K, int N, int total, void* __restrict__ out) {
  extern __shared__ __align__(1024) char smem_raw[];
  __shared__ int row_start[kOuterMaxGroups + 1];  // clamped group row offsets
  __shared__ int order[kOuterMaxGroups + 1];      // groups by descending chunk count
  __shared__ int key[kOuterMaxGroups + 1];        // chunk count per group (sort key)
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;

  BuildOuterTables<1, kBK>(group_sizes, G, M, row_start, order, key, nullptr);

  // total = G * m_tiles * n_tiles comes as a kernel parameter (constant bank: no register across the loops).
  OuterTables tables{row_start, order, (K + kBM - 1) / kBM, (N + kBN - 1) / kBN};
  // Snake order: round j takes position j * grid + b (j even) or j * grid + grid - 1 - b (j odd), i.e. the first
  // position is b and the steps alternate 2 (grid - 1 - b) + 1, 2 b + 1. Positions only grow: stop at >= total.
  const int first = (int)blockIdx.x;
  const int step_even = 2 * ((int)gridDim.x - 1 - first) + 1, step_odd = 2 * first + 1;

  // ---- the loop (structure of WgmmaTileLoop; see wgmma_mainloop.cuh for the barrier / register protocol) ----
  unsigned char* base =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~(uintptr_t)1023);
  unsigned char* sA = base;                               // stages x 16 KB (2 chunks)
  unsigned char* sB = base + kOuterStages * kABytes;      // stages x 32 KB (4 chunks)
  uint64_t* full = reinterpret_cast<uint64_t*>(base + kOuterStages * kStageBytes);
  uint64_t* empty = full + kOuterStages;

  if (tid == 0) {
    for (int s = 0; s < kOuterStages; ++s) {
      MbarInit(SmemAddr(&full[s]), 1);
      MbarInit(SmemAddr(&empty[s]), 8);
    }
    MbarInitFence();
  }
  __syncthreads();

  if (warp < 4) {
    // ================= producer warpgroup =================
    SetMaxNRegDec<kProducerRegs>();
    if (tid == 0) {
      PrefetchTensorMap(&tm_a);
      PrefetchTensorMap(&tm_b);
      int stage = 0;
      uint32_t phase = 0;
      for (int p = first, s0 = step_even, s1 = step_odd; p < total; p += s0, s0 ^= s1, s1 ^= s0, s0 ^= s1) {
        const OuterTile tile = DecodeOuterTile(p, tables);
        const int nch = (tile.rows + kBK - 1) / kBK;
        for (int kc = 0; kc < nch; ++kc) {
          const uint32_t fb = SmemAddr(&full[stage]);
          MbarWait(SmemAddr(&empty[stage]), phase ^ 1);
          MbarArriveExpectTx(fb, kStageBytes);  // fully / partly OOB boxes are zero-filled and still counted
          const uint32_t a_dst = SmemAddr(sA + stage * kABytes);
          const uint32_t b_dst = SmemAddr(sB + stage * kBBytes);
          const int r = tile.r0 + kc * kBK;
#pragma unroll
          for (int q = 0; q < kBM / 64; ++q) TmaLoad2D(a_dst + q * kChunkBytes, &tm_a, fb, tile.m0 + 64 * q, r);
#pragma unroll
          for (int q = 0; q < kBN / 64; ++q) TmaLoad2D(b_dst + q * kChunkBytes, &tm_b, fb, tile.n0 + 64 * q, r);
          if (++stage == kOuterStages) { stage = 0; phase ^= 1; }
        }
      }
    }
    ProducerExit();
  } else {
    // ================= consumer warpgroups =================
    SetMaxNRegInc<kConsumerRegs>();
    const int c = warp / 4 - 1;   // rows m [64 c, 64 c + 64) of the tile; A chunk c
    const int wq = warp % 4;
    const int ctid = tid % 128;   // thread within the warpgroup

    float acc[128];
    int stage = 0;
    uint32_t phase = 0;
    for (int p = first, s0 = step_even, s1 = step_odd; p < total; p += s0, s0 ^= s1, s1 ^= s0, s0 ^= s1) {
      const OuterTile tile = DecodeOuterTile(p, tables);
      const int nch = (tile.rows + kBK - 1) / kBK;
      const int last_valid = tile.rows - (nch - 1) * kBK;  // rows of the last chunk (1..64) when nch > 0
      const bool active = tile.m0 + 64 * c < K;           // warpgroup-uniform
#pragma unroll
      for (int q = 0; q < 128; ++q) acc[q] = 0.f;
      int prev_stage = -1;
      for (int kc = 0; kc < nch; ++kc) {
        MbarWait(SmemAddr(&full[stage]), phase);
        unsigned char* a_chunk = sA + stage * kABytes + c * kChunkBytes;
        unsigned char* b_stage = sB + stage * kBBytes;
        if (kc == nch - 1 && last_valid < kBK) {
          // Zero lines [last_valid, 64) of A chunk c and B chunks 2c, 2c+1 (one 128-B line = one row r, see
          // the header comment), then make them visible to the async proxy and to the other warpgroup's MMAs.
          const int per_chunk = (kBK - last_valid) * 8;  // 16-byte pieces per chunk
          const int4 z = make_int4(0, 0, 0, 0);
          for (int idx = ctid; idx < 3 * per_chunk; idx += 128) {
            const int which = idx / per_chunk, off = idx - which * per_chunk;
            unsigned char* chunk = which == 0 ? a_chunk : b_stage + (2 * c + which - 1) * kChunkBytes;
            *reinterpret_cast<int4*>(chunk + last_valid * 128 + off * 16) = z;
          }
          FenceProxyAsyncShared();
          NamedBarSync(kConsumerBarrier, 256);
        }
        // (Issued also by a warpgroup whose rows are all >= K: its A chunk is TMA zero fill, nothing is stored;
        // a branch around the MMAs makes ptxas serialize every wgmma of the kernel.)
        MmaKStep<1, 1>(acc, SmemAddr(a_chunk), SmemAddr(b_stage));
        if (prev_stage >= 0 && lane == 0) MbarArrive(SmemAddr(&empty[prev_stage]));
        prev_stage = stage;
        if (++stage == kOuterStages) { stage = 0; phase ^= 1; }
      }
      WgmmaWait<0>();
      FenceRegs(acc);
      if (prev_stage >= 0 && lane == 0) MbarArrive(SmemAddr(&empty[prev_stage]));

      // ---- epilogue (StoreAccTile): rows m0 + r of out[g], r < K - m0; columns n0 + col, col < N - n0 ----
      if (active) {
        const int rows = min(kBM, K - tile.m0), cols = min(kBN, N - tile.n0);
        const int64_t off0 = ((int64_t)tile.g * K + tile.m0) * N + tile.n0;
        void* const tile_out = kOutF32 ? static_cast<void*>(static_cast<float*>(out) + off0)
                                       : static_cast<void*>(static_cast<__nv_bfloat16*>(out) + off0);
        StoreAccTile<kOutF32>(acc, c, wq, lane, rows, cols, tile_out, N);
      }
    }
    ConsumerExit();
  }
  __syncthreads();
}

// ------------------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------------------
// lhs as (K, M) and rhs as (N, M) 2D maps, box (64, 64), 128B swizzle, OOB zero fill, behind CachedMapPair (16
// entries, keyed by pointers and extents).
inline cudaError_t CachedOuterMaps(const void* lhs, int64_t M, int64_t K, const void* rhs, int64_t N, CUtensorMap* ta,
                                   CUtensorMap* tb) {
  struct Key {
    const void* a;
    const void* b;
    int64_t M, K, N;
    bool operator==(const Key& o) const { return a == o.a && b == o.b && M == o.M && K == o.K && N == o.N; }
  };
  return CachedMapPair<Key, 16>(Key{lhs, rhs, M, K, N}, ta, tb, [&](CUtensorMap* ma, CUtensorMap* mb) {
    const cuuint32_t box[2] = {64, 64};
    const cuuint64_t a_dims[2] = {(cuuint64_t)K, (cuuint64_t)M}, a_strides[1] = {(cuuint64_t)K * kElemBytes};
    const cuuint64_t b_dims[2] = {(cuuint64_t)N, (cuuint64_t)M}, b_strides[1] = {(cuuint64_t)N * kElemBytes};
    if (!EncodeMap(ma, lhs, 2, a_dims, a_strides, box, "outer lhs [M, K]") ||
        !EncodeMap(mb, rhs, 2, b_dims, b_strides, box, "outer rhs [M, N]"))
      return cudaErrorInvalidValue;
    return cudaSuccess;
  });
}

}  // namespace wgmma_outer

// out [G, K, N] = per group g: lhs[rows of g]^T @ rhs[rows of g] (see the header comment). Returns
// cudaErrorInvalidValue (and prints why) for unsupported shapes, cudaErrorNotSupported on a device or build without
// sm_90a support, so the caller can fall back.
inline cudaError_t WgmmaGroupedOuter(const __nv_bfloat16* lhs, int64_t M, int64_t K, const __nv_bfloat16* rhs,
                                     int64_t N, int64_t G, const int32_t* group_sizes_dev, void* out, bool out_f32,
                                     int num_sms, cudaStream_t stream) {
  using namespace wgmma_outer;
  const int64_t tiles = G * ((K + kBM - 1) / kBM) * ((N + kBN - 1) / kBN);
  if (M <= 0 || K <= 0 || N <= 0 || K % 64 != 0 || N % 64 != 0 || G < 1 || G > kOuterMaxGroups ||
      M > 0x7fffffff - kBK || K > 0x7fffffff || N > 0x7fffffff || tiles > 0x7fffffff - 2 * 1024 ||
      (reinterpret_cast<uintptr_t>(lhs) | reinterpret_cast<uintptr_t>(rhs) | reinterpret_cast<uintptr_t>(out)) % 16 ||
      num_sms <= 0) {
    fprintf(stderr, "WgmmaGroupedOuter: unsupported shape/alignment M=%lld K=%lld N=%lld G=%lld num_sms=%d\n",
            (long long)M, (long long)K, (long long)N, (long long)G, num_sms);
    return cudaErrorInvalidValue;
  }
  CUtensorMap ta, tb;
  const cudaError_t e = CachedOuterMaps(lhs, M, K, rhs, N, &ta, &tb);
  if (e != cudaSuccess) return e;
  const int grid = (int)(tiles < num_sms ? tiles : num_sms);
  const int g = (int)G, m = (int)M, k = (int)K, n = (int)N, t = (int)tiles;
  return LaunchWgmmaKernel(out_f32 ? GroupedOuterKernel<true> : GroupedOuterKernel<false>, grid, kOuterSmemBytes, stream,
                           ta, tb, group_sizes_dev, g, m, k, n, t, out);
}
