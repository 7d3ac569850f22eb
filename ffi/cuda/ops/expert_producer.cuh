// The producer side of expert_combine: adapters from the segment table to the GEMM engines (mma.sync / SIMT tiles,
// the wgmma mainloop) that store each tile where the consumer or the combine reads it and publish finished bands.
// ExpertKernel (expert_combine.cu) runs them; the fused dispatch_gemm reuses the wgmma tile order.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/gemm/engine.h"
#include "cuda/gemm/simt_tile.cuh"
#include "cuda/gemm/sm80/mma_tile.cuh"
#include "cuda/gemm/sm90/wgmma_grouped.cuh"
#include "cuda/gemm/sm90/wgmma_mainloop.cuh"
#include "cuda/gemm/sm90/wgmma_mainloop_fp8.cuh"
#include "cuda/launch.h"
#include "cuda/schedule/segment_table.cuh"
#include "cuda/workspace/protocol.cuh"

namespace jmo::cuda {

using bf16 = __nv_bfloat16;

//
// kTransB (every engine): w is [E_l, N, K] and the producer reads w[e]^T in place (the input gradient dy @ W^T of
// the backward pass), else w is [E_l, K, N]. Meaning as in gemm/sm80/mma_tile.cuh: B[k, n] = kTransB ? w_e[n K + k]
// : w_e[k N + n].

// The engines (gemm/engine.h's GemmEngine) as int template arguments of the producer kernels, and the wgmma engine
// over the e4m3 block-scaled operand format (kWgmmaFp8: no GemmEngine, as the FP8 grouped GEMM is none; the call's
// e4m3 operands select it, gemm/engine.h's Fp8GroupedGemmDeviceRefusal says where it runs).
enum Engine : int {
  kSimt = static_cast<int>(GemmEngine::kSimt),
  kMmaSync = static_cast<int>(GemmEngine::kMmaSync),
  kWgmma = static_cast<int>(GemmEngine::kWgmma),
  kWgmmaFp8 = kGemmEngineCount,
};
template <int kEngine>
constexpr bool kWgmmaLoop = kEngine == kWgmma || kEngine == kWgmmaFp8;
template <int kEngine>
constexpr int kEngineThreads = kWgmmaLoop<kEngine> ? wgmma_gemm::kThreads : kThreads;

// How PrepareOneCtaPerSm prepares a kernel of the wgmma engine: wgmma_gemm::PrepareWgmmaKernel checks a Hopper device,
// the sm_90a build and the register budget, then sets the shared memory.
constexpr KernelSetup kWgmmaKernelSetup{"PrepareWgmmaKernel", wgmma_gemm::PrepareWgmmaKernel};

// A band counts one more stored tile of the `tiles` that complete it; the last one publishes the band through its
// tile_ready flag (the consumer pushes it).
__device__ __forceinline__ void CountBandTile(const RankDev& rd, uint64_t* flags, int flag, int tiles,
                                             uint64_t epoch) {
  if (atomicAdd(&rd.band_done[flag], 1u) == (unsigned)(tiles - 1)) {
    __threadfence();
    StoreReleaseGpu(&flags[flag], epoch);
  }
}

// Called by one thread after the tile's stores are fenced and every storing thread has passed a barrier: the tile
// counts in each of its `bands` bands from tile_ready index first_flag, each complete after col_tiles tiles. Tiles of
// local segments publish nothing: see CountLocalRows.
__device__ __forceinline__ void PublishTile(const RankDev& rd, uint64_t* flags, int first_flag, int bands,
                                            int col_tiles, uint64_t epoch) {
  for (int b = 0; b < bands; ++b) CountBandTile(rd, flags, first_flag + b, col_tiles, epoch);
}

// Every thread of every CTA of the launch calls this once: a producer CTA once it has stored all its tiles, a consumer
// CTA as soon as it knows its role. The rows of local segments (stored in place in this rank's ret rows; no consumer
// and no peer reads them, only this rank's CombineKernel, later on the stream) are counted into ret_arrivals once, by
// the last CTA to call it: each thread's fence and the CTA barrier order the CTA's stores before its producers_done
// add, so the last adder's count follows every store of the call. This keeps the per-tile fence and consumer barrier
// off local tiles (all tiles at EP = 1). Also what the serialized mode's consumer waits for (producers_done == the
// grid). The count is over the grid, not the producer CTAs, because a CTA that produces from the start does not know
// C (ExpertKernel). count_local = false (gather_rs, whose producer stores every tile in stage and whose ret rows
// count partial slices, not rows): producers_done only.
__device__ inline void CountLocalRows(const RankDev& rd, const SegTable& t, bool count_local = true) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (atomicAdd(reinterpret_cast<unsigned long long*>(rd.producers_done), 1ull) != (unsigned long long)(gridDim.x - 1))
    return;
  if (!count_local) return;
  uint64_t local_rows = 0;
  for (int i = t.remote_segs; i < t.n; ++i) local_rows += (uint64_t)t.seg[i].rows;
  __threadfence();
  if (local_rows > 0) AddReleaseSys(&View(rd, rd.rank).control()->ret_arrivals.value, local_rows);
}

// The serialized mode's start, for every thread of a consumer CTA that has passed CountLocalRows: once every CTA of the
// launch has (every producer CTA has stored all its tiles); false if the wait gave up.
__device__ inline bool WaitProducersDone(const RankDev& rd) {
  int ok = 1;
  if (threadIdx.x == 0) ok = WaitAtLeast(rd, rd.producers_done, 0, (uint64_t)gridDim.x, rd.rank, kStageTileReady);
  return __syncthreads_and(ok) != 0;
}

// The producer's tiles, handed out one at a time in producer order from the call's counter (RankDev::tile_claims,
// zeroed with the band counters before the launch), rather than striped over a producer count fixed at the start: a
// CTA that chose C before producing (ExpertKernel) takes what is left when it joins. next_tile(prev) of the wgmma loop
// (gemm/sm90/wgmma_mainloop.cuh); one thread calls it. A CTA's first claimed tile also enters the call's timeline
// (prod_t0: the first producer's start; prod_t0_last: the last) and sets *produced (thread 0's, which calls it).
struct TileClaims {
  const RankDev& rd;
  int64_t count;  // the call's tiles: an index >= count ends the CTA's loop
  bool* produced;
  __device__ __forceinline__ int operator()(int prev) const {
    const int i = (int)atomicAdd(rd.tile_claims, 1u);
    if (prev < 0 && i < count) {
      *produced = true;
      const unsigned long long now = GlobalTimer();
      atomicMin(reinterpret_cast<unsigned long long*>(&rd.priv->prod_t0), now);
      atomicMax(reinterpret_cast<unsigned long long*>(&rd.priv->prod_t0_last), now);
    }
    return i;
  }
};

// Where a producer tile of segment s goes: the stage rows the consumer pushes from, or for a local segment the
// rank's own ret rows (no push). all_stage (gather_rs): every segment's tiles go to stage, where its consumer reduces
// them. `row` is the tile's first row within the segment.
template <typename T>
__device__ __forceinline__ T* TileOut(const RankDev& rd, const Segment& s, int row, int64_t n0, int64_t N, T* stage,
                                      T* ret, bool all_stage) {
  return s.src == rd.rank && !all_stage ? ret + ((int64_t)s.ret_off + row) * N + n0
                                        : stage + ((int64_t)s.recv_off + row) * N + n0;
}

// mma.sync / SIMT engine (gemm/sm80/mma_tile.cuh, gemm/simt_tile.cuh): one band (64 rows) x kTileN columns per tile.
constexpr int kMmaBM = 64;
constexpr int kMmaBN = kTileN;
static_assert(kMmaBM == kBandRows, "a producer tile is one row band");
static_assert(kTileThreads == kThreads, "the tile engine assumes the kernels' CTA size");
constexpr int kTcSmemBytes = TcLayout<kMmaBM>::kSmemBytes;
constexpr int kSimtSmemBytes = SimtSmemBytes<kMmaBM>();

template <typename T, bool kTensorCores, bool kTransB>
__device__ inline void ProduceBands(const RankDev& rd, const SegTable& table, uint64_t epoch, const T* __restrict__ lhs,
                                    const T* __restrict__ w, int64_t K, int64_t N, T* stage, T* ret, uint64_t* flags,
                                    char* smem, bool gather, bool* produced) {
  const int64_t ntiles = (N + kMmaBN - 1) / kMmaBN;
  const int64_t tiles = (int64_t)table.bands * ntiles;
  const TileClaims claim{rd, tiles, produced};
  __shared__ int claimed;  // thread 0's claim; rewritten only after the tile's closing barrier, past every read
  for (int prev = -1;; ) {
    if (threadIdx.x == 0) claimed = claim(prev);
    __syncthreads();
    const int64_t t = claimed;
    if (t >= tiles) break;
    prev = (int)t;
    const int band = (int)(t / ntiles);
    const int64_t n0 = (t % ntiles) * kMmaBN;
    const Segment& s = table.seg[FindSegment(table, band)];
    const int b = band - table.band_prefix[&s - table.seg];
    const int64_t row0 = s.recv_off + (int64_t)b * kMmaBM;
    const int rows = min((int)kMmaBM, s.rows - b * (int)kMmaBM);
    const T* w_e = w + (int64_t)s.expert * K * N;
    // Column n0 of B: column n0 of row 0 of w_e [K, N], or row n0 of w_e [N, K].
    const TileArgs<T, T> tile{lhs + row0 * K, K, w_e + n0 * (kTransB ? K : 1), kTransB ? K : N,
                              TileOut(rd, s, b * kMmaBM, n0, N, stage, ret, gather), N, rows,
                              (int)min((int64_t)kMmaBN, N - n0), (int)K};
    if constexpr (kTensorCores)
      TcTile<kMmaBM, false, kTransB, T>(tile, smem);
    else
      SimtTile<kMmaBM, false, kTransB, T, T>(tile, smem);
    const bool publish = gather || s.src != rd.rank;  // (uniform in the CTA)
    if (publish) __threadfence();
    __syncthreads();
    if (publish && threadIdx.x == 0) PublishTile(rd, flags, s.band_base + b, 1, (int)ntiles, epoch);
  }
}

// wgmma engine (sm_90a, gemm/sm90/wgmma_mainloop.cuh): 128 rows (two bands) x 256 columns of one segment per tile,
// TMA-fed, warp-specialized (384 threads). tile_prefix[i] = tiles of the segments before segment i, in producer order.
constexpr int kWgBM = wgmma_gemm::kBM;
constexpr int kWgBN = wgmma_gemm::kBN;
static_assert(kWgBM % kBandRows == 0, "a wgmma tile covers whole bands");

static_assert(kMaxSegments <= wgmma_gemm::kThreads, "one thread per segment for the tile prefix scan");

// Whether expert_combine's wgmma producer goes expert-major (then order holds ExpertMajorOrder's order of all
// segments): producer_order 2 pins it, 1 the table's order; 0, the rule: where the table's order streams the weights
// at least twice as often (segments smaller than a band of band_m row blocks: many experts, few rows from each
// source). There the shared weight slabs win, and tiles over the expert's rows end no segment in a partial tile; where
// each segment already fills whole bands they save no pass and the table's remote-first order keeps the pushes early
// (docs/performance.md, "The producer's segment order"). Every thread of every CTA calls it once, after the table is
// built, and gets the same answer from the same table.
__device__ inline bool UseExpertMajor(const SegTable& table, int producer_order, int band_m, SegPlace* order) {
  if (producer_order == 1) return false;
  const bool pays = ExpertMajorOrder(table, kWgBM, band_m, order);
  return producer_order == 2 || pays;
}

// tile_prefix[p] = wgmma tiles before place p in producer order (tile_prefix[n] = all of them), col_tiles per 128-row
// block: in the table's order (order = nullptr) those of the segments before the p-th; expert-major, those of the
// experts before place p's, all of an expert's tiles counted at its first place (its rows are tiled as one range).
// One thread per segment and a block scan (kMaxSegments <= the CTA's threads), not one thread's loop over up to 256
// segments with a division each (microseconds at kernel start, on every CTA). Every thread calls it.
// (raw: BuildSegments' segments in plan order, R ranks, with an order.)
__device__ inline void WgmmaTilePrefix(const SegTable& table, const SegPlace* order, const Segment* raw, int R,
                                       int col_tiles, int32_t* tile_prefix, int64_t* warp_sums) {
  const int i = threadIdx.x;
  const int rows = i >= table.n          ? 0
                   : order == nullptr    ? table.seg[i].rows
                   : order[i].first == i ? ExpertRangeOf(raw, R, 0, table.seg[order[i].seg].expert).rows
                                         : 0;
  const int64_t tiles = (int64_t)((rows + kWgBM - 1) / kWgBM) * col_tiles;
  int64_t total = 0;
  const int64_t incl = BlockInclusiveScan(tiles, warp_sums, &total);
  if (i < table.n) tile_prefix[i] = (int32_t)(incl - tiles);
  if (i == 0) tile_prefix[table.n] = (int32_t)total;
  __syncthreads();
}

// Wgmma tile j of the producer in the table's order (WgmmaTilePrefix without an order): its segment, its 128-row
// block within the segment (mt), and the tile's A row, expert, columns and rows; out, ldc and publish are the
// caller's. Inside a segment the tiles go in bands of band_m row blocks (wgmma_gemm::BandRaster).
struct SegmentTile {
  const Segment* s;
  int mt;
  wgmma_gemm::WgmmaTile t;
};
__device__ __forceinline__ SegmentTile WgmmaTileAt(const SegTable& table, const int32_t* tile_prefix, int col_tiles,
                                                   int64_t N, int j, int band_m) {
  const int p = LastAtMost(tile_prefix, table.n, j);  // the segment holding tile j
  const Segment& s = table.seg[p];
  int mt, nt;
  wgmma_gemm::BandRaster(j - tile_prefix[p], (s.rows + kWgBM - 1) / kWgBM, col_tiles, band_m, &mt, &nt);
  SegmentTile at{&s, mt, {}};
  at.t.a_row = s.recv_off + mt * kWgBM;
  at.t.b_idx = s.expert;
  at.t.n0 = nt * kWgBN;
  at.t.rows = min(kWgBM, s.rows - mt * kWgBM);
  at.t.cols = (int)min((int64_t)kWgBN, N - at.t.n0);
  return at;
}

// Wgmma tile j of the expert-major producer (WgmmaTilePrefix with ExpertMajorOrder's order): 128-row blocks over the
// expert's rows in recv, across its segments, in bands of band_m row blocks. Returns the expert's range.
__device__ __forceinline__ ExpertRange ExpertTileAt(const SegTable& table, const SegPlace* order, const Segment* raw,
                                                    int R, int rank, const int32_t* tile_prefix, int col_tiles,
                                                    int64_t N, int j, int band_m, wgmma_gemm::WgmmaTile* t) {
  // The last place whose prefix is <= j: the expert's first (its other places add no tiles, so their prefix is past
  // the expert's tiles).
  const int p = LastAtMost(tile_prefix, table.n, j);
  const int e = table.seg[order[p].seg].expert;
  const ExpertRange x = ExpertRangeOf(raw, R, rank, e);
  int mt, nt;
  wgmma_gemm::BandRaster(j - tile_prefix[p], (x.rows + kWgBM - 1) / kWgBM, col_tiles, band_m, &mt, &nt);
  t->a_row = x.start + mt * kWgBM;
  t->b_idx = e;
  t->n0 = nt * kWgBN;
  t->rows = min(kWgBM, x.rows - mt * kWgBM);
  t->cols = (int)min((int64_t)kWgBN, N - t->n0);
  return x;
}

// A producer tile as the wgmma loop stores and reports it (its own epilogue: EpilogueTile). Rows [0, local_lo) and
// [local_hi, rows) go to out + r ldc (stage rows, or a local segment's ret rows in the table's order); rows
// [local_lo, local_hi) of an expert-major tile, its expert's local segment, to local_out + (r - local_lo) ldc (the
// rank's own ret rows). The report: in the table's order the `bands` bands from tile_ready index `flag`; expert-major,
// every band of the expert's remote segments the tile's rows touch (expert >= 0).
template <typename T>
struct WgTile : wgmma_gemm::EpilogueTile {
  T* local_out;
  int local_lo, local_hi;
  int flag;   // the table's order: tile_ready index of the tile's first band
  int bands;  // the table's order: bands the tile covers (1 or 2)
  int expert;  // expert-major: the tile's expert (-1: the table's order)
  __device__ __forceinline__ void Store(const float* acc, int c, int wq, int lane) const {
    wgmma_gemm::StoreAccRows<std::is_same<T, float>::value>(acc, c, wq, lane, rows, cols, [&](int r) -> void* {
      return r >= local_lo && r < local_hi ? local_out + (int64_t)(r - local_lo) * ldc
                                           : static_cast<T*>(out) + (int64_t)r * ldc;
    });
  }
};

// Called by one thread for an expert-major tile once its stores are fenced (the loop's tile_done): every band of the
// expert's remote segments that the tile's rows [a_row, a_row + rows) touch counts the tile; a band completes (its
// flag is published) after col_tiles times the row blocks of the expert's tiling that cover it, as many tile stores.
template <typename T>
__device__ inline void PublishExpertTile(const RankDev& rd, const Segment* raw, uint64_t* flags, const WgTile<T>& t,
                                         int col_tiles, uint64_t epoch) {
  const int R = rd.ranks, start = raw[t.expert * R].recv_off;
  const int lo = t.a_row, hi = t.a_row + t.rows;
  for (int src = 0; src < R; ++src) {
    const Segment& s = raw[t.expert * R + src];
    if (src == rd.rank || s.rows <= 0) continue;
    const int s_lo = max(lo, s.recv_off), s_hi = min(hi, s.recv_off + s.rows);
    if (s_lo >= s_hi) continue;
    for (int b = (s_lo - s.recv_off) / (int)kBandRows; b <= (s_hi - 1 - s.recv_off) / (int)kBandRows; ++b) {
      const int b_lo = s.recv_off + b * (int)kBandRows, b_hi = min(b_lo + (int)kBandRows, s.recv_off + s.rows);
      const int covers = (b_hi - 1 - start) / kWgBM - (b_lo - start) / kWgBM + 1;
      CountBandTile(rd, flags, s.band_base + b, col_tiles * covers, epoch);
    }
  }
}

// The tile loop over the operand format Ops (wgmma_gemm::Bf16Operands, or Fp8BlockScaledOperands: e4m3 lhs [cap, K]
// and w [E_l, N, K] with their scales), storing T rows (bfloat16; float32 with the e4m3 operands only). order: the
// segments' order (ExpertMajorOrder), nullptr for the table's.
template <class Ops, typename T>
__device__ inline void ProduceWgmma(const RankDev& rd, const SegTable& table, uint64_t epoch, const Ops& ops,
                                    int64_t K, int64_t N, T* stage, T* ret, uint64_t* flags, int32_t* tile_prefix,
                                    int64_t* warp_sums, char* smem, bool gather, int band_m, const SegPlace* order,
                                    const Segment* raw, bool* produced) {
  const int col_tiles = (int)((N + kWgBN - 1) / kWgBN);
  WgmmaTilePrefix(table, order, raw, rd.ranks, col_tiles, tile_prefix, warp_sums);
  auto tile_of = [&](int i) {
    WgTile<T> t;
    t.ldc = N;
    if (order != nullptr) {
      const ExpertRange x =
          ExpertTileAt(table, order, raw, rd.ranks, rd.rank, tile_prefix, col_tiles, N, i, band_m, &t);
      t.expert = t.b_idx;
      t.out = stage + (int64_t)t.a_row * N + t.n0;
      // The expert's local rows in this tile, if any, go to the rank's own ret rows.
      const Segment* l = x.local;
      t.local_lo = l ? min(max(l->recv_off - t.a_row, 0), t.rows) : 0;
      t.local_hi = l ? min(max(l->recv_off + l->rows - t.a_row, 0), t.rows) : 0;
      t.local_out = t.local_lo < t.local_hi
                        ? ret + ((int64_t)l->ret_off + (t.a_row + t.local_lo - l->recv_off)) * N + t.n0 : nullptr;
      t.publish = t.local_hi - t.local_lo < t.rows;  // rows of another rank's (CountLocalRows counts the local ones)
      return t;
    }
    // band_m = 1 (row-block order): a row block's flags complete together, so the consumer can ship it early; larger
    // bands share B's column slabs in L2 across band_m row blocks (ConsumerConfig::band_m).
    const SegmentTile at = WgmmaTileAt(table, tile_prefix, col_tiles, N, i, band_m);
    static_cast<wgmma_gemm::WgmmaTile&>(t) = at.t;
    t.ldc = N;
    t.out = TileOut(rd, *at.s, at.mt * kWgBM, t.n0, N, stage, ret, gather);
    t.local_out = nullptr;
    t.local_lo = t.local_hi = 0;
    t.expert = -1;
    t.flag = at.s->band_base + at.mt * (kWgBM / (int)kBandRows);
    t.bands = (t.rows + (int)kBandRows - 1) / (int)kBandRows;
    // Local tiles: no fence, no barrier, no flag (CountLocalRows); gather_rs's consumer waits for every tile.
    t.publish = gather || at.s->src != rd.rank;
    return t;
  };
  auto tile_done = [&](const WgTile<T>& t) {
    if (t.expert >= 0)
      PublishExpertTile(rd, raw, flags, t, col_tiles, epoch);
    else
      PublishTile(rd, flags, t.flag, t.bands, col_tiles, epoch);
  };
  const int tiles = tile_prefix[table.n];
  wgmma_gemm::WgmmaLoop<Ops, std::is_same<T, float>::value>(ops, (int)K, tiles, TileClaims{rd, tiles, produced},
                                                            tile_of, tile_done, smem);
}

// The bf16 operands: the loop's kTransB is the wgmma instruction's operand layout, the opposite sense of ours: 1 = B
// MN-major (w [E_l, K, N], b_map built with b_k_major = false), 0 = B K-major (w [E_l, N, K], b_k_major = true), as
// the bare grouped GEMM's transpose_rhs (gemm/sm90/wgmma_grouped.cuh, GroupedGemmWithDone).
template <bool kTransB>
__device__ __forceinline__ wgmma_gemm::Bf16Operands<kTransB ? 0 : 1> WgmmaBf16Operands(const CUtensorMap& a_map,
                                                                                       const CUtensorMap& b_map) {
  return {&a_map, &b_map};
}

}  // namespace jmo::cuda
