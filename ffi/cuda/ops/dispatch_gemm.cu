// dispatch_gemm: the dispatch and GEMM1 of the expert MLP in one launch (the kernel, its launch and DispatchGemm in
// api.h; the FFI handler calls it).
#include <cuda.h>
#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "cuda/gemm/sm90/swiglu_fp8_epilogue.cuh"
#include "cuda/gemm/sm90/wgmma_grouped.cuh"
#include "cuda/gemm/sm90/wgmma_grouped_fp8.cuh"
#include "cuda/gemm/sm90/wgmma_mainloop_fp8.cuh"
#include "cuda/launch.h"
#include "cuda/ops/expert_producer.cuh"
#include "cuda/schedule/resource_manager.cuh"
#include "cuda/transport/row_push.cuh"

namespace jmo::cuda {
namespace {

// dispatch_gemm: the dispatch and GEMM1 in one launch, so that GEMM1 runs while the tokens are still in flight (the
// dispatch-side producer / consumer; expert_combine is the return side). Every CTA of every rank is resident (one per
// SM, as in ExpertKernel), so the waits below end. The pusher count P is the host's (pinned or fixed) or the resource
// model's choice, which every CTA's first warp computes from the call's routed counts (PusherConfig,
// resource_manager.cuh; docs/resource_manager.md). Roles by block index:
//   pushers  CTAs [0, P) push this rank's rows for the other ranks, a 128-row block of the send order
//            (SrcBlocks, protocol.h) at a time, in rounds: block i of every destination's rows before block i + 1,
//            each destination from the next rank on, so that every rank receives from every source at once and in
//            the order its GEMM consumes (a source's send order is sorted by expert); each warp adds its
//            count of a block's rows to the destination's recv_arrivals and then release-adds it to its
//            src_blocks[rank][J] (PushBlock). Then they take side work (below), then join the GEMM.
//   GEMM     CTAs [P, grid) copy the rows this rank keeps into its own recv (the same blocks and counters),
//            then run the grouped GEMM, then take what side work is left.
// The GEMM is the bare grouped GEMM's (DgSchedule): over the local experts' rows of recv (each expert's segments of
// every source, contiguous), 128-row m-tiles from each expert's first row, with A read by TMA straight from the
// workspace's recv rows. Its tiles are claimed one at a time from a per-call counter (CTAs that join late take what
// is left): first the m-tiles made of this rank's own rows alone, then the others expert by expert, each expert's in
// the order their rows arrive (DgSchedule), in bands of m-tiles. Before a tile's first load the loop's look-ahead
// thread (tile_wait, wgmma_mainloop.cuh), which claims each tile while the previous one still loads, waits until, for
// each source its rows come from, the blocks of that source holding them are complete. Epilogue: the float32 product
// (out [cap, N]), or with kSwiGlu GEMM1's SwiGLU (h [cap, N / 2] and optionally the preactivation a [cap, N]), as the
// bare grouped GEMMs store them, so the results are theirs bit for bit.
// Side work, claimed from a second per-call counter: the copy of the kept rows into x_recv (when kept), one m-tile's
// rows per unit after the same wait as its GEMM tiles. Memory-bound work thus runs on the pushers' SMs beside the
// compute-bound GEMM, and the GEMM CTAs that run out of tiles finish it. With x_recv_from_tiles (CallOptions) the
// GEMM stores x_recv instead, from the A tiles it holds in shared memory: each m-tile's first column tile (n0 == 0)
// stores every A stage's kept rows of the m-tile (the loop's a_stage hook, x_recv_stage below), and the side work is
// the send-once expansions alone. No result's rows past the kept ones are written: no consumer of the call reads them
// (docs/design.md, "Padding rows").
// Send once (slot_primary, protocol.h): the pushers move a token's row to another rank once, with every slot's
// recv_from entry; the rows of an m-tile that are not all this rank's own (phase B) are filled from their primaries by
// a side unit (the expansion: a local copy of the duplicated rows), which then publishes tile_ready[m] = epoch, and the
// m-tile's GEMM tiles wait for that flag instead of the blocks (with x_recv_from_tiles its first column tile, which
// reads the expanded rows from recv after that flag, stores them to x_recv: the unit copies nothing). Those units
// come first in the side work; the pushers build the schedule before pushing and take any of them whose rows are all
// in between two of their pushes (TryExpandUnit, which never waits), then the rest after their pushes, so the
// expansions keep ahead of the GEMM.
// The last CTA to finish zeroes the call's src_blocks and closes the call as a dispatch's end does (recv_expected,
// done_epoch): every read of recv is done by then.
struct DispatchGemmArgs {
  const char* src;       // x [S, D] bf16 or packed e4m3 rows (row_bytes = RowBytes(dt, D))
  int64_t S, row_bytes;
  const int32_t *src_row, *dst_rank, *dst_row;  // the dispatch plan's slots [P]
  const int32_t *send_order;                     // [P]: the slot at each send position
  const int32_t *send_start;                     // [R + 1]: first send position of each destination's rows
  int64_t P, cap;
  const int32_t *seg_rows, *seg_ret_off;  // [E_l * R] rows this rank receives per (expert, source), and their first
                                          // send position on the source
  const int32_t* recv_expected;           // [] rows this rank receives in all
  int E_l;
  PusherConfig pushers;  // P (see above)
  int64_t K, N;          // d_model, GEMM columns (2F with kSwiGlu)
  char* x_recv;          // [cap, row_bytes] (the recv rows as they landed), or null: not kept
  void* out;             // [cap, N] float32 (kOutBf16: bf16), or with kSwiGlu h [cap, N / 2] bf16 (kFp8: h_q e4m3)
  void* a;               // kSwiGlu: the preactivation [cap, N] float32 or bf16 (a_bf16; kFp8: a_q e4m3), or null
  float* h_scales;       // kFp8 with kSwiGlu: h's 1 x 128 scales [cap, N / 256]
  float* a_scales;       // kFp8 with kSwiGlu and a kept: a's 1 x 128 scales [cap, N / 128]
  const float* w_scales; // kFp8: w's 128 x 128 block scales [E_l, N / 128, K / 128]
  double link_bytes_per_ns;  // > 0: pushes to other ranks go over the emulated link (CallOptions, PaceLink)
  const int32_t* primary;    // send once: slot_primary [P] (protocol.h); nullptr: one row per slot
  const float* row_scale;    // [P]: slot p's bf16 row lands times row_scale[p] (ScaleVector); nullptr: moved as is
  bool x_recv_from_tiles;    // x_recv (kept) stored by the GEMM tiles, not the side units: the launch's
                             // kXRecvFromTiles (CallOptions::x_recv_from_tiles where x_recv is kept)
  int band_m;                // row blocks per raster band of the GEMM's tiles (BandRaster; CallOptions::producer_band_m)
  int order;                 // the GEMM's tile order: ExpertMajorDg's (CallOptions::producer_order)
  bool a_bf16;               // bf16 kSwiGlu: a is [cap, N] bf16 (DispatchGemmOut::a_bf16), else float32
};

// The x_recv the side units copy into (see the kernel's comment): nullptr where it is not kept or the GEMM tiles
// store it.
__device__ __forceinline__ char* SideXRecv(const DispatchGemmArgs& g) {
  return g.x_recv_from_tiles ? nullptr : g.x_recv;
}

// Moves the rows of send block J that go to rank d (send positions [128 J, 128 J + 128) within d's range) into d's
// recv rows, and signals them warp by warp. Every thread of the CTA calls it. Warp w moves positions w, w + warps, ...
// of the block: its lanes load the indices of up to 32 of them at once, then the warp moves two rows at a time
// (MoveSlotRowsWarp; scaled by g.row_scale where given); then
// lane 0 adds the warp's count of them to d's recv_arrivals and then release-adds it to d's src_blocks[rank][J] (a
// reader that acquires the block's count sees the arrivals of it too). The block is complete once every warp's count
// is in (the reader waits for the block's rows, from its plan). A warp's signal needs no CTA barrier and no fence of
// its own by each lane: __syncwarp orders the lanes' stores before lane 0's release, which is cumulative
// (protocol.cuh), so the warps of a pusher flow from block to block independently, each waiting only for its own
// stores. Each lane loads and checks its slot by CheckPushSlot (row_push.cuh), as PushRows does.
// Send once (g.primary): a slot routed to another rank moves its row only where it is its own primary (CheckPrimary;
// else reported as kBadPrimary and not moved), and every kept slot of the block stores its recv_from entry.
// Not inlined (nor ExpandRows): inside the kernel, whose code outside the tile loop runs on the launch's 168
// registers per thread, ptxas spills the row copies' loaded data to local memory; compiled as its own function
// PushBlock spills nothing and ExpandRows less (`ptxas -v`); one call per block (per side unit).
__device__ __noinline__ void PushBlock(const RankDev& rd, const DispatchGemmArgs& g, int d, int64_t J, uint64_t epoch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int64_t q0 = max(J * kSrcBlockRows, (int64_t)g.send_start[d]) + warp;
  const int64_t q1 = min((J + 1) * kSrcBlockRows, (int64_t)g.send_start[d + 1]);
  const int mine = q1 > q0 ? (int)((q1 - q0 + warps - 1) / warps) : 0;  // positions of this warp (<= 32)
  int sr = 0, row = -1, from = -1;  // lane i: the source row, recv row (-1: not moved) and recv row holding its bytes
  int p = -1;                       // lane i: its slot
  if (lane < mine) {
    int dr;
    p = g.send_order[q0 + (int64_t)lane * warps];
    row = CheckPushSlot(rd, g.src_row, g.dst_rank, g.dst_row, g.primary, g.P, g.S, g.cap, p, d, epoch, &dr, &sr,
                        &from);
  }
  const unsigned kept = __ballot_sync(0xffffffffu, row >= 0);
  const unsigned moves = __ballot_sync(0xffffffffu, row >= 0 && from == row);
  char* recv = View(rd, d).recv();
  // (bf16 rows, never sent once where scaled: CheckRowScale)
  const float sc = g.row_scale != nullptr && row >= 0 ? g.row_scale[p] : 0.f;
  MoveSlotRowsWarp(
      moves, RowScale{g.row_scale, true}, sc, g.row_bytes, lane,
      [&](int i) { return recv + (int64_t)__shfl_sync(0xffffffffu, row, i) * g.row_bytes; },
      [&](int i) { return g.src + (int64_t)__shfl_sync(0xffffffffu, sr, i) * g.row_bytes; });
  // The counts are the kept slots' (the receiver's plan counts slots), the link's bytes the rows moved.
  __syncwarp();
  if (lane == 0 && kept != 0) {
    const unsigned n = __popc(kept);
    uint64_t* block = &View(rd, d).src_blocks()[(int64_t)rd.rank * SrcBlocks(rd.sizes.ret_rows) + J];
    if (d != rd.rank && g.link_bytes_per_ns > 0)
      PaceLink(rd, (uint64_t)__popc(moves) * g.row_bytes + (g.primary != nullptr ? 8ull * n : 0),
               g.link_bytes_per_ns);
    AddRelaxedSys(&View(rd, d).control()->recv_arrivals.value, n);
    // (This rank's own blocks are read on this GPU only: a gpu-scope release orders them for its ld.acquire.sys.)
    if (d != rd.rank) AddReleaseSys(block, n); else AddReleaseGpu(block, n);
  }
}

// Send blocks of rank d's rows: [first, end).
__device__ __forceinline__ void DestBlocks(const DispatchGemmArgs& g, int d, int64_t* first, int64_t* end) {
  const int64_t q0 = g.send_start[d], q1 = g.send_start[d + 1];
  *first = q0 / kSrcBlockRows;
  *end = q1 > q0 ? (q1 - 1) / kSrcBlockRows + 1 : *first;
}

// Rows of source s's send block J that this rank keeps (from its plan: segment (e, s) holds s's send positions
// [seg_ret_off, seg_ret_off + seg_rows)).
__device__ __forceinline__ uint64_t BlockRows(const TableScratch& sc, int R, int E_l, int s, int64_t J) {
  const int64_t lo = J * kSrcBlockRows, hi = lo + kSrcBlockRows;
  uint64_t n = 0;
  for (int e = 0; e < E_l; ++e) {
    const Segment& x = sc.raw[e * R + s];
    const int64_t a = max(lo, (int64_t)x.ret_off), b = min(hi, (int64_t)x.ret_off + max(x.rows, 0));
    if (b > a) n += (uint64_t)(b - a);
  }
  return n;
}

// One thread: waits (acquire) until source s's send block J holds all the rows this rank keeps from it. False once the
// call failed (the error names the source and the counts).
__device__ inline bool WaitBlock(const RankDev& rd, const TableScratch& sc, int E_l, int s, int64_t J) {
  const uint64_t* blocks = View(rd, rd.rank).src_blocks() + (int64_t)s * SrcBlocks(rd.sizes.ret_rows);
  return WaitAtLeast(rd, &blocks[J], 0, BlockRows(sc, rd.ranks, E_l, s, J), s, kStageSrcBlock);
}

// The 32 lanes of one warp together: waits (acquire) until recv rows [r0, r0 + rows) of expert e have arrived, from
// each source they come from (segment (e, s) holds recv rows [recv_off, recv_off + rows), s's send positions from
// ret_off): every block of that source holding those positions has all the rows this rank keeps from it. The checks
// (one per source and block) are dealt to the lanes, which wait at once: one memory round trip for a tile's checks
// when its rows are there, not one per check. Every lane returns the same answer, after a warp barrier (which orders
// every lane's acquires before what any lane does next, such as lane 0's hand-over): false once the call failed (the
// error names the source and the counts).
__device__ inline bool WarpWaitRecvRows(const RankDev& rd, const TableScratch& sc, int E_l, int e, int64_t r0,
                                        int64_t rows) {
  const int lane = threadIdx.x % 32;
  bool ok = true;
  int k = 0;  // the check's index, over the sources' blocks in order
  for (int s = 0; s < rd.ranks; ++s) {
    const Segment& x = sc.raw[e * rd.ranks + s];
    const int64_t lo = max(r0, (int64_t)x.recv_off), hi = min(r0 + rows, (int64_t)x.recv_off + max(x.rows, 0));
    if (hi <= lo) continue;
    const int64_t pos0 = x.ret_off + (lo - x.recv_off);
    for (int64_t J = pos0 / kSrcBlockRows; J <= (pos0 + (hi - lo) - 1) / kSrcBlockRows; ++J, ++k)
      if (k % 32 == lane && ok) ok = WaitBlock(rd, sc, E_l, s, J);
  }
  const bool all = __all_sync(0xffffffffu, ok);
  __syncwarp();
  return all;
}

// Source s's first send position whose row this rank keeps (its segments' smallest ret_off), INT64_MAX if none.
__device__ inline int64_t FirstKeptPosition(const TableScratch& sc, int R, int E_l, int s) {
  int64_t first = INT64_MAX;
  for (int e = 0; e < E_l; ++e)
    if (sc.raw[e * R + s].rows > 0) first = min(first, (int64_t)sc.raw[e * R + s].ret_off);
  return first;
}

// The GEMM's tile order (see the kernel's comment), from the plan's segments. Per local expert e: its first recv
// row and rows (all sources), its m-tiles [own_lo, own_hi) made of this rank's own rows alone; then per phase (A: those
// own m-tiles, B: the others) the tiles of the experts before e (pre_a, pre_b, col_tiles tiles per m-tile).
// Phase B takes an expert's m-tiles in the order their rows arrive, not in recv order: recv holds an expert's rows
// source by source, while every source pushes block J of every destination's rows in round J (the pushers' rounds),
// so in recv order the GEMM would wait for the last block of the first source before it reaches the second. Per
// segment (e, s), index e * ranks + s: the m-tiles whose first row lies in it (the segments partition the expert's
// rows, so these ranges partition its m-tiles; the own segment's less phase A's), src_mt[i] .. src_mt[i] + src_cnt[i]
// - 1, and the round src_key[i] in which the first of them is complete (its last row of s in s's send block
// src_key[i] counted from s's first block for this rank; one more for each next m-tile, every m-tile but the
// segment's last holding 128 of its rows). Phase B of expert e is the merge of its sources' lists by round, ties in
// the order the sources push to this rank within a round (MergedMTile): source s pushes round J to rank d as its
// unit J (R - 1) + (d - s - 1 mod R), so within a round the rows of source d - 1 come first, then d - 2, ..., and the
// own rows (there from the start) lead them all.
// Expert-major (ExpertMajorDg): phase A is empty and phase B holds every m-tile, the own ones first (round 0), so
// that each expert's m-tiles run as one band and its weight slabs stream once instead of once per phase.
struct DgSchedule {
  int32_t row0[kMaxSegments], rows[kMaxSegments], own_lo[kMaxSegments], own_hi[kMaxSegments];
  int32_t pre_a[kMaxSegments + 1], pre_b[kMaxSegments + 1];
  int32_t src_mt[kMaxSegments], src_cnt[kMaxSegments], src_key[kMaxSegments];
  int32_t col_tiles, ranks, rank;
};

// Whether the GEMM goes expert-major (DgSchedule). order (CallOptions::producer_order): 2 pins it, 1 pins the phases;
// 0, the rule: where the phases stream the weights more often than expert-major order and their passes average
// under 4 m-tiles, counting a weight pass per band of band_m m-tiles (the phases: the sum over the experts of
// ceil(own m-tiles / band_m) + ceil(others / band_m); expert-major: ceil(m-tiles / band_m)). A pass over r rows
// does 2 r flops per 2-byte weight element: under 512 rows the bf16 GEMM is bound by its weight reads more than by its
// math on Hopper (about 200-300 flops per byte of HBM), and the pass it saves is time (the DeepSeek-like shape: 32
// experts of about one own m-tile and one of the peer's at R = 2); over it the passes cost little, and phase A keeps
// the GEMM busy while the first remote rows arrive. Send once keeps the phases (its side units expand phase B's
// m-tiles, which must not hold own rows alone). own_m, mt: this thread's expert's own m-tiles and m-tiles (0 past
// E_l). Every thread calls it; all get the same answer from the same plan.
__device__ inline bool ExpertMajorDg(int order, bool send_once, int band_m, int64_t own_m, int64_t mt,
                                     int64_t* warp_sums) {
  if (send_once || order == 1) return false;  // (uniform in the CTA, as order == 2)
  if (order == 2) return true;
  const auto bands = [&](int64_t m) { return (m + band_m - 1) / band_m; };
  // (Three sums in one scan, 21 bits each: a rank's m-tiles, cap / 128, stay far below 2^21.)
  constexpr int kBits = 21;
  constexpr int64_t kMask = (int64_t{1} << kBits) - 1;
  const int64_t v = ((bands(own_m) + bands(mt - own_m)) << (2 * kBits)) + (bands(mt) << kBits) + mt;
  int64_t total = 0;
  BlockInclusiveScan(v, warp_sums, &total);
  const int64_t phase_passes = total >> (2 * kBits), em_passes = (total >> kBits) & kMask, m_tiles = total & kMask;
  return phase_passes > em_passes && m_tiles < 4 * phase_passes;
}

// Every thread calls it (one per expert, and block scans). order, band_m, send_once: ExpertMajorDg's.
__device__ inline void BuildSchedule(const RankDev& rd, const TableScratch& sc, int E_l, int col_tiles, int order,
                                     int band_m, bool send_once, DgSchedule* d, int64_t* warp_sums) {
  const int e = threadIdx.x, R = rd.ranks;
  int64_t rows = 0, mt = 0, own_lo = 0, own_hi = 0;
  if (e < E_l) {
    for (int s = 0; s < R; ++s) rows += max(sc.raw[e * R + s].rows, 0);
    const Segment& own = sc.raw[e * R + rd.rank];
    const int64_t row0 = sc.raw[e * R].recv_off;
    mt = (rows + kWgBM - 1) / kWgBM;
    const int64_t lo = own.recv_off - row0, hi = lo + max(own.rows, 0);  // the own rows within the expert
    own_lo = (lo + kWgBM - 1) / kWgBM;
    own_hi = hi == rows ? mt : hi / kWgBM;
    if (own_hi < own_lo || own.rows <= 0) own_lo = own_hi = 0;
  }
  if (ExpertMajorDg(order, send_once, band_m, own_hi - own_lo, mt, warp_sums)) own_lo = own_hi = 0;
  int64_t a = 0, b = 0;
  if (e < E_l) {
    const int64_t row0 = sc.raw[e * R].recv_off;
    d->row0[e] = (int32_t)row0;
    d->rows[e] = (int32_t)rows;
    d->own_lo[e] = (int32_t)own_lo;
    d->own_hi[e] = (int32_t)own_hi;
    for (int s = 0; s < R; ++s) {
      const Segment& x = sc.raw[e * R + s];
      const int64_t o = x.recv_off - row0, n = max(x.rows, 0);
      int64_t first = (o + kWgBM - 1) / kWgBM;
      const int64_t end = n > 0 ? (o + n + kWgBM - 1) / kWgBM : first;
      int64_t key = 0;  // the own rows are here from the start
      if (s == rd.rank) {
        first = max(first, own_hi);  // (phase A's m-tiles lead the own segment's when there are any)
      } else if (end > first) {
        const int64_t base = FirstKeptPosition(sc, R, E_l, s);
        const int64_t last = x.ret_off + min(n, (first + 1) * kWgBM - o) - 1;  // the first m-tile's last row of s
        key = last / kSrcBlockRows - base / kSrcBlockRows;
      }
      d->src_mt[e * R + s] = (int32_t)first;
      d->src_cnt[e * R + s] = (int32_t)max(end - first, (int64_t)0);
      d->src_key[e * R + s] = (int32_t)key;
    }
    a = (own_hi - own_lo) * col_tiles;
    b = (mt - (own_hi - own_lo)) * col_tiles;
  }
  int64_t total_a = 0, total_b = 0;
  const int64_t ia = BlockInclusiveScan(a, warp_sums, &total_a);
  const int64_t ib = BlockInclusiveScan(b, warp_sums, &total_b);
  if (e < E_l) {
    d->pre_a[e] = (int32_t)(ia - a);
    d->pre_b[e] = (int32_t)(ib - b);
  }
  if (e == 0) {
    d->pre_a[E_l] = (int32_t)total_a;
    d->pre_b[E_l] = (int32_t)total_b;
    d->col_tiles = col_tiles;
    d->ranks = R;
    d->rank = rd.rank;
  }
  __syncthreads();
}

// Phase B's m-tile i of expert e (0 <= i < its phase-B m-tiles): the recv m-tile (from the expert's first row) at
// position i of the merge of its sources' lists by round (DgSchedule), ties in push order (this rank's own, then
// sources rank - 1, rank - 2, ...). The smallest round K whose count of m-tiles with a round <= K exceeds i, then the
// (i - count below K)-th list holding round K in that order.
__device__ inline int MergedMTile(const DgSchedule& d, int e, int i) {
  const int R = d.ranks;
  const int32_t *mt = d.src_mt + e * R, *cnt = d.src_cnt + e * R, *key = d.src_key + e * R;
  auto up_to = [&](int k) {  // m-tiles with a round <= k
    int n = 0;
    for (int s = 0; s < R; ++s) n += min(max(k + 1 - key[s], 0), cnt[s]);
    return n;
  };
  int lo = 0, hi = 0;  // the answer lies in [lo, hi]
  for (int s = 0; s < R; ++s)
    if (cnt[s] > 0) hi = max(hi, key[s] + cnt[s] - 1);
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (up_to(mid) > i) hi = mid; else lo = mid + 1;
  }
  int left = i - up_to(lo - 1);
  for (int o = 0; o < R; ++o) {
    const int s = (d.rank - o + R) % R;
    if (lo < key[s] || lo >= key[s] + cnt[s]) continue;
    if (left == 0) return mt[s] + (lo - key[s]);
    --left;
  }
  return -1;  // (unreachable for i in range)
}

struct MTile {
  int e, mt, nt;
  int m;     // the m-tile's index in the schedule's m-tile order (col_tiles 1): its tile_ready flag under send once
  bool own;  // made of this rank's own rows alone (phase A)
};

// Tile i of the schedule: its expert, m-tile and n-tile. `band_m` as BandRaster's (1: each m-tile's n-tiles in a row,
// as the side work's units take them with col_tiles = 1).
__device__ inline MTile TileAt(const DgSchedule& d, int E_l, int64_t i, int col_tiles, int band_m) {
  MTile t;
  const int64_t total_a = d.pre_a[E_l] / d.col_tiles * col_tiles;
  const bool own = i < total_a;
  const int32_t* pre = own ? d.pre_a : d.pre_b;
  const int64_t j = own ? i : i - total_a;
  // (pre counts d.col_tiles tiles per m-tile; in units of col_tiles: pre / d.col_tiles * col_tiles.)
  int lo = 0, hi = E_l - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if ((int64_t)pre[mid] / d.col_tiles * col_tiles <= j) lo = mid; else hi = mid - 1;
  }
  t.e = lo;
  const int own_m = d.own_hi[lo] - d.own_lo[lo];
  const int mt_e = (d.rows[lo] + kWgBM - 1) / kWgBM;
  int mt = 0;
  wgmma_gemm::BandRaster((int)(j - (int64_t)pre[lo] / d.col_tiles * col_tiles), own ? own_m : mt_e - own_m, col_tiles,
                         band_m, &mt, &t.nt);
  t.mt = own ? d.own_lo[lo] + mt : MergedMTile(d, lo, mt);
  t.own = own;
  t.m = own ? d.pre_a[lo] / d.col_tiles + mt : d.pre_a[E_l] / d.col_tiles + d.pre_b[lo] / d.col_tiles + mt;
  return t;
}

// Send once, every thread of the CTA: fills recv rows [r0, r0 + rows) of expert e whose recv_from entry names another
// row from that row (the expansion; a warp per row), after lane 0 has checked the entry and waited for the block of
// the same source that holds the named row. The rows' own blocks have been waited for (their entries are in).
__device__ __noinline__ void ExpandRows(const RankDev& rd, const DispatchGemmArgs& g, const TableScratch& sc, int e,
                                      int64_t r0, int64_t rows, uint64_t epoch) {
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32, R = rd.ranks;
  char* recv = View(rd, rd.rank).recv();
  for (int64_t r = r0 + threadIdx.x / 32; r < r0 + rows; r += warps) {
    int64_t f = -1;
    if (lane == 0 && (f = RecvFromChecked(rd, epoch, r)) >= 0 && f != r) {
      int s = 0;  // r's source: segment (e, s) holds recv rows [recv_off, recv_off + rows)
      while (s + 1 < R && r >= (int64_t)sc.raw[e * R + s].recv_off + max(sc.raw[e * R + s].rows, 0)) ++s;
      int64_t pos = -1;  // f's send position on s, if f lies in a segment of s
      for (int x = 0; x <= e; ++x) {
        const Segment& y = sc.raw[x * R + s];
        if (f >= y.recv_off && f < (int64_t)y.recv_off + max(y.rows, 0)) pos = y.ret_off + (f - y.recv_off);
      }
      if (pos < 0) {
        ReportBadInput(rd, kBadRecvFrom, r, (int64_t)RecvFrom(epoch, f), epoch);
        f = -1;
      } else if (!WaitBlock(rd, sc, g.E_l, s, pos / kSrcBlockRows)) {
        f = -1;
      }
    }
    f = __shfl_sync(0xffffffffu, f, 0);
    __syncwarp();  // lane 0's acquire before the other lanes' loads
    if (f >= 0 && f != r) CopyRowWarp(recv + r * g.row_bytes, recv + f * g.row_bytes, g.row_bytes, lane);
  }
}

// The side units (see the kernel's comment). One row per slot: unit v is m-tile v of the schedule, the copy of its
// kept rows into x_recv (none where the side units copy no x_recv: SideXRecv). Send once: first the m-tiles not made
// of own rows alone (phase B), each expanded (ExpandRows), published (tile_ready[m] = epoch: its GEMM tiles wait for
// it) and then copied into x_recv; then, where the side units copy x_recv, the own m-tiles' copies.
__device__ inline int64_t SideUnits(const DispatchGemmArgs& g, const DgSchedule& d) {
  const int64_t na = d.pre_a[g.E_l] / d.col_tiles, nb = d.pre_b[g.E_l] / d.col_tiles;
  return (g.primary != nullptr ? nb : 0) + (SideXRecv(g) != nullptr ? na + (g.primary != nullptr ? 0 : nb) : 0);
}
__device__ inline MTile SideUnit(const DispatchGemmArgs& g, const DgSchedule& d, int64_t v) {
  if (g.primary == nullptr) return TileAt(d, g.E_l, v, 1, 1);
  const int64_t na = d.pre_a[g.E_l] / d.col_tiles, nb = d.pre_b[g.E_l] / d.col_tiles;
  return TileAt(d, g.E_l, v < nb ? na + v : v - nb, 1, 1);
}

// One side unit (SideUnit), by every thread of the CTA: waits for its rows' blocks, then as SideUnits says.
__device__ inline void DoSideUnit(const RankDev& rd, const DispatchGemmArgs& g, const DgSchedule& d,
                                  const TableScratch& sc, const MTile& t, uint64_t epoch) {
  __shared__ int ok;
  const int64_t tid = threadIdx.x, nt = blockDim.x;
  const int64_t r0 = d.row0[t.e] + (int64_t)t.mt * kWgBM;
  const int64_t rows = min((int64_t)kWgBM, (int64_t)d.rows[t.e] - (int64_t)t.mt * kWgBM);
  if (threadIdx.x < 32) {
    const bool arrived = WarpWaitRecvRows(rd, sc, g.E_l, t.e, r0, rows);
    if (threadIdx.x == 0) ok = arrived;
  }
  __syncthreads();
  if (ok && g.primary != nullptr && !t.own) {
    ExpandRows(rd, g, sc, t.e, r0, rows, epoch);
    __syncthreads();  // (then thread 0's release orders every thread's copies: protocol.cuh)
    if (threadIdx.x == 0 && LoadVolatile(&rd.priv->failed) == 0)
      StoreReleaseGpu(&View(rd, rd.rank).tile_ready()[t.m], epoch);
  }
  if (char* x_recv = SideXRecv(g); ok && x_recv != nullptr)
    CopyBand(x_recv + r0 * g.row_bytes, View(rd, rd.rank).recv() + r0 * g.row_bytes, rows * g.row_bytes, tid, nt);
  __syncthreads();
}

// Claims and does side units until none is left. Every thread of the CTA calls it.
__device__ inline void DoSideWork(const RankDev& rd, const DispatchGemmArgs& g, const DgSchedule& d,
                                  const TableScratch& sc, uint64_t epoch, int64_t* claim) {
  const int64_t units = SideUnits(g, d);
  for (;;) {
    if (threadIdx.x == 0) *claim = (int64_t)atomicAdd(rd.side_claims, 1u);
    __syncthreads();
    const int64_t v = *claim;
    __syncthreads();
    if (v >= units) return;
    DoSideUnit(rd, g, d, sc, SideUnit(g, d, v), epoch);
  }
}

// Send once, a pusher between two of its pushes (every thread of the CTA): claims and does the next side unit if it
// is an expansion whose rows can be filled without waiting: for each source its rows come from, every block of that
// source's rows for this rank up to the last block holding them is complete (so are the blocks of their primaries,
// which come earlier in the source's send order). Never waits: a pusher that waited here on a peer whose pushers
// wait on it would stall both.
__device__ inline void TryExpandUnit(const RankDev& rd, const DispatchGemmArgs& g, const DgSchedule& d,
                                     const TableScratch& sc, uint64_t epoch, int64_t* claim) {
  const int64_t nb = d.pre_b[g.E_l] / d.col_tiles;
  if (threadIdx.x == 0) {
    *claim = -1;
    const unsigned v = *reinterpret_cast<volatile unsigned*>(rd.side_claims);
    if ((int64_t)v < nb) {
      const MTile t = SideUnit(g, d, v);
      const int64_t r0 = d.row0[t.e] + (int64_t)t.mt * kWgBM;
      const int64_t r1 = r0 + min((int64_t)kWgBM, (int64_t)d.rows[t.e] - (int64_t)t.mt * kWgBM);
      const int R = rd.ranks;
      const uint64_t* blocks = View(rd, rd.rank).src_blocks();
      const int64_t per_src = SrcBlocks(rd.sizes.ret_rows);
      bool ready = true;
      for (int s = 0; s < R && ready; ++s) {
        const Segment& x = sc.raw[t.e * R + s];
        const int64_t lo = max(r0, (int64_t)x.recv_off), hi = min(r1, (int64_t)x.recv_off + max(x.rows, 0));
        if (hi <= lo) continue;
        const int64_t first = FirstKeptPosition(sc, R, g.E_l, s);
        const int64_t last = x.ret_off + (hi - 1 - x.recv_off);
        for (int64_t J = first / kSrcBlockRows; ready && J <= last / kSrcBlockRows; ++J)
          ready = LoadAcquireSys(&blocks[s * per_src + J]) >= BlockRows(sc, R, g.E_l, s, J);
      }
      if (ready && atomicCAS(rd.side_claims, v, v + 1) == v) *claim = v;
    }
  }
  __syncthreads();
  const int64_t v = *claim;
  __syncthreads();
  if (v >= 0) DoSideUnit(rd, g, d, sc, SideUnit(g, d, v), epoch);
}

// The GEMM loop's tile_wait `wait` that also sums the TMA thread's stalls for each tile into stall_ns[1] for the CTA's
// first tile and stall_ns[0] for the others (the loopback timeline's; wgmma_gemm::HasStalled).
template <class F>
struct StallTimedWait {
  F wait;
  uint64_t* stall_ns;
  template <class T>
  __device__ __forceinline__ void operator()(const T& t) const { wait(t); }
  __device__ __forceinline__ void Stalled(uint64_t ns, bool first) const {
    atomicAdd(reinterpret_cast<unsigned long long*>(&stall_ns[first ? 1 : 0]), (unsigned long long)ns);
  }
};

// The GEMM's tile type of a kernel: bf16 the bare GEMMs' (WgmmaTile: float32 out; SwiGluTile), FP8 those of the FP8
// grouped GEMMs (WgmmaTile: float32 out; SwiGluFp8Tile: h and a quantized 1 x 128).
template <bool kFp8, bool kSwiGlu>
using DgTileBase = typename std::conditional<
    kSwiGlu, typename std::conditional<kFp8, wgmma_gemm::SwiGluFp8Tile, wgmma_gemm::SwiGluTile>::type,
    wgmma_gemm::WgmmaTile>::type;

// kXRecvFromTiles: the GEMM tiles store x_recv (x_recv_stage below). A kernel of its own: the kernels whose side units
// copy x_recv run the tile loop without the hook (nor the registers it takes in the consumer warpgroups).
// kFp8: the rows are packed e4m3 rows and the GEMM the FP8 grouped GEMM's loop over Fp8PackedRowsOperands (A's values
// by a_map and their scales by sa_map, both over recv at the rows' stride; B e4m3 K-major with w_scales), the epilogue
// SwiGluFp8Tile's or the float32 product. Its A stages hold a 128-byte slice of the rows' values and the scale box of
// 4 chunks holding the slice's (Fp8RowTailScalesA): with kXRecvFromTiles a stage stores its slice of the packed rows,
// and the first stage of each 4 chunks their scales too.
// kOutBf16 (bf16 rows without the SwiGLU): out is the product rounded once to bf16, as the bare grouped GEMM's bf16
// output (the loop's bf16 store), instead of float32.
template <bool kTransB, bool kSwiGlu, bool kXRecvFromTiles, bool kFp8, bool kOutBf16>
__global__ void __launch_bounds__(wgmma_gemm::kThreads, 1)
    DispatchGemmKernel(RankDev rd, const __grid_constant__ DispatchGemmArgs g,
                       const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                       const __grid_constant__ CUtensorMap sa_map) {
  static_assert(!(kTransB && kSwiGlu && !kFp8), "the bf16 SwiGLU epilogue is GEMM1's (B MN-major)");
  static_assert(!kFp8 || kTransB, "FP8 wgmma reads B K-major only");
  static_assert(!kOutBf16 || (!kSwiGlu && !kFp8), "a bf16 product is the bf16 rows' plain form's");
  extern __shared__ __align__(16) char smem[];
  __shared__ CallState st;
  __shared__ unsigned sent[kMaxRanks];
  __shared__ SegTable table;
  __shared__ TableScratch scratch;
  __shared__ DgSchedule sched;
  __shared__ int64_t claim;
  __shared__ int last_cta;
  LoadCallState(rd, &st);
  if (!st.ok) return;
  const int R = rd.ranks;
  __shared__ int chosen_pushers;
  if (threadIdx.x < 32) {
    const int64_t model_k = kFp8 ? Fp8ModelK(g.K) : g.K;  // (the model's tile time is the bf16 engine's)
    const int p = !g.pushers.use_model ? g.pushers.pushers
                  : WarpChooseDispatchPushers(g.pushers, PusherInputsFromPlan(g.send_start, rd.rank, R,
                                                                              g.recv_expected[0], g.row_bytes,
                                                                              model_k, g.N));
    if (threadIdx.x == 0) {
      chosen_pushers = p;
      if (blockIdx.x == 0) {
        rd.priv->pushers = (uint64_t)p;
        rd.priv->ctas = gridDim.x;
      }
    }
  }
  __syncthreads();
  const int pushers = chosen_pushers;
  const bool pusher = (int)blockIdx.x < pushers;

  // n-tiles: 256 columns of out, or with kSwiGlu 128 columns of h (the gate's 128 and the up projection's 128).
  const int64_t n_out = kSwiGlu ? g.N / 2 : g.N;
  constexpr int kTileCols = kSwiGlu ? kWgBN / 2 : kWgBN;
  // Send once: the pushers take expansions between their pushes (TryExpandUnit), so they need the schedule first.
  const bool early_table = pusher && g.primary != nullptr;
  if (early_table) {
    if (!BuildSegments(rd, g.seg_rows, g.seg_ret_off, g.E_l, g.cap, &table, &scratch)) return;
    BuildSchedule(rd, scratch, g.E_l, (int)((n_out + kTileCols - 1) / kTileCols), g.order, g.band_m,
                  g.primary != nullptr, &sched, scratch.warp_sums);
  }
  if (pusher) {
    // The rows for the other ranks, in rounds (see above). Unit u: round u / (R - 1), destination rank + 1 +
    // u % (R - 1).
    if (!BeginPush(rd, &st, sent)) return;
    if (threadIdx.x == 0)
      atomicMin(reinterpret_cast<unsigned long long*>(&rd.priv->cons_t0), (unsigned long long)GlobalTimer());
    int64_t rounds = 0;
    for (int d = 0; d < R; ++d) {
      int64_t f, e;
      DestBlocks(g, d, &f, &e);
      if (d != rd.rank) rounds = max(rounds, e - f);
    }
    for (int64_t u = blockIdx.x; R > 1 && u < rounds * (R - 1); u += pushers) {
      const int d = (rd.rank + 1 + (int)(u % (R - 1))) % R;
      int64_t f, e;
      DestBlocks(g, d, &f, &e);
      if (f + u / (R - 1) < e) PushBlock(rd, g, d, f + u / (R - 1), st.epoch);
      if (early_table) TryExpandUnit(rd, g, sched, scratch, st.epoch, &claim);
    }
    __syncthreads();  // (every warp's pushes: the end of the CTA's push span)
    if (threadIdx.x == 0)
      atomicMax(reinterpret_cast<unsigned long long*>(&rd.priv->push_t1), (unsigned long long)GlobalTimer());
  } else {
    // The rows this rank keeps, spread over the GEMM CTAs (step 1 holds for the own recv by stream order).
    int64_t f, e;
    DestBlocks(g, rd.rank, &f, &e);
    for (int64_t J = f + blockIdx.x - pushers; J < e; J += gridDim.x - pushers) PushBlock(rd, g, rd.rank, J, st.epoch);
  }

  if (!early_table) {
    if (!BuildSegments(rd, g.seg_rows, g.seg_ret_off, g.E_l, g.cap, &table, &scratch)) return;
    BuildSchedule(rd, scratch, g.E_l, (int)((n_out + kTileCols - 1) / kTileCols), g.order, g.band_m,
                  g.primary != nullptr, &sched, scratch.warp_sums);
  }
  // (Recomputed from shared memory where needed rather than kept live across the tile loop, whose producer warps run
  // with wgmma_gemm::kProducerRegs registers.)
  auto kept = [&]() {
    int64_t n = 0;  // recv is packed from row 0
    for (int s = 0; s < R; ++s) n += scratch.rows_to_rank[s];
    return n;
  };
  auto side_work = [&]() { DoSideWork(rd, g, sched, scratch, st.epoch, &claim); };
  if (pusher) {
    side_work();
    if (threadIdx.x == 0)
      atomicMax(reinterpret_cast<unsigned long long*>(&rd.priv->cons_t1), (unsigned long long)GlobalTimer());
  }

  using Base = DgTileBase<kFp8, kSwiGlu>;
  struct DgTile : Base {
    int e;           // the tile's local expert
    int expand;      // send once: the m-tile's tile_ready index (its rows filled by a side unit), else -1
    bool own;        // made of this rank's own rows alone (phase A)
    char* x_recv;    // x_recv_from_tiles, the m-tile's first column tile: x_recv's row a_row; else nullptr
  };
  auto tile_of = [&](int i) {
    // Bands of row blocks within an expert (nothing reads the output's rows during the call): GEMM1's N = 2 * d_ff
    // spans up to ~100 n-tiles.
    const MTile m = TileAt(sched, g.E_l, i, sched.col_tiles, g.band_m);
    DgTile t;
    t.e = m.e;
    t.expand = g.primary != nullptr && !m.own ? m.m : -1;
    t.own = m.own;
    t.b_idx = m.e;
    t.a_row = sched.row0[m.e] + m.mt * kWgBM;
    t.rows = min(kWgBM, sched.rows[m.e] - m.mt * kWgBM);
    t.n0 = m.nt * kTileCols;
    t.cols = (int)min((int64_t)kTileCols, n_out - t.n0);
    if constexpr (kSwiGlu && kFp8) {
      // (h's scales per row: n_out / 128, a's twice as many; the tile's first at column tile n0 / 128.)
      const int64_t h_tiles = n_out / wgmma_gemm::kSwiGluFp8Cols, nt = t.n0 / wgmma_gemm::kSwiGluFp8Cols;
      t.n_hi = (int)(n_out + t.n0);
      t.out = nullptr;
      t.ldc = 0;
      t.h_q = static_cast<uint8_t*>(g.out) + (int64_t)t.a_row * n_out + t.n0;
      t.h_s = g.h_scales + (int64_t)t.a_row * h_tiles + nt;
      t.a_q = g.a != nullptr ? static_cast<uint8_t*>(g.a) + (int64_t)t.a_row * g.N + t.n0 : nullptr;
      t.a_s = g.a != nullptr ? g.a_scales + (int64_t)t.a_row * 2 * h_tiles + nt : nullptr;
      t.F = n_out;
    } else if constexpr (kSwiGlu) {
      t.n_hi = (int)(n_out + t.n0);
      t.out = static_cast<__nv_bfloat16*>(g.out) + (int64_t)t.a_row * n_out + t.n0;
      t.ldc = n_out;
      t.a = g.a != nullptr ? static_cast<char*>(g.a) + (int64_t)t.a_row * g.N * (g.a_bf16 ? 2 : 4) : nullptr;
      t.lda = g.N;
      t.a_bf16 = g.a_bf16;
    } else {
      t.out = static_cast<char*>(g.out) + ((int64_t)t.a_row * g.N + t.n0) * (kOutBf16 ? 2 : 4);
      t.ldc = g.N;
    }
    t.publish = 0;
    t.x_recv = kXRecvFromTiles && t.n0 == 0 ? g.x_recv + (int64_t)t.a_row * g.row_bytes : nullptr;
    return t;
  };
  auto tile_wait = [&](const DgTile& t) {
    // On failure the call is failed (the error names source and counts); the loop runs on rather than hang. Send
    // once: an m-tile with other ranks' rows waits for its side unit, which waited for its blocks and filled its rows.
    // (The 32 lanes of the look-ahead warp.)
    const uint64_t t0 = GlobalTimer();
    if (t.expand >= 0) {
      if (threadIdx.x % 32 == 0)
        WaitAtLeast(rd, &View(rd, rd.rank).tile_ready()[t.expand], 0, st.epoch, (uint64_t)t.expand, kStageExpand);
      __syncwarp();
    } else {
      WarpWaitRecvRows(rd, scratch, g.E_l, t.e, t.a_row, t.rows);
    }
    if (threadIdx.x % 32 == 0)
      atomicAdd(reinterpret_cast<unsigned long long*>(t.own ? &rd.priv->gemm_wait_own_ns : &rd.priv->gemm_wait_ns),
                (unsigned long long)(GlobalTimer() - t0));
    ptx::FenceProxyAsyncGlobal();  // the rows were stored by the generic proxy; TMA reads by the async one
  };
  auto next_tile = [&](int) {
    const int i = (int)atomicAdd(rd.tile_claims, 1u);
    if (i == sched.pre_a[g.E_l]) rd.priv->phase_b_t0 = GlobalTimer();  // (the loopback timeline's)
    return i;
  };
  // x_recv_from_tiles: the tile's A stages are its m-tile's rows of recv, which it waited for (tile_wait), in the
  // kept rows the same bytes the side units copy; the consumer warpgroup that multiplies a stage stores its kept rows
  // (r < t.rows: the rows after them are another expert's), bytes [128 kt, 128 kt + 128) of each (64 bf16 or 128
  // e4m3 values; e4m3 two chunks at a time, beside the promotion's accumulators). FP8: the first stage of
  // each 4 chunks also stores the rows' scales of those chunks from its scale box, at byte D + 4 kt of the row (kt
  // counts within all of K: a DgTile multiplies all of it, its first stage chunk 0).
  auto x_recv_stage = [&](const DgTile& t, int c, const unsigned char* a, const unsigned char* x, int kt) {
    if (t.x_recv == nullptr) return;
    const int tc = (int)threadIdx.x % 128;
    static_assert(wgmma_gemm::kBK * wgmma_gemm::kElemBytes == wgmma_gemm::kFp8BK, "128 bytes of a row per stage");
    static_assert(!std::is_base_of<wgmma_gemm::KRangeTile, DgTile>::value,
                  "every 4-chunk scale box is stored by its first stage: a tile multiplies all of K");
    wgmma_gemm::StoreAStageRows<kFp8 ? 2 : 4>(a, c, tc, t.rows, t.x_recv + (int64_t)kt * wgmma_gemm::kFp8BK,
                                              g.row_bytes);
    if (kFp8 && kt % wgmma_gemm::kFp8TailChunks == 0)
      wgmma_gemm::Fp8RowTailScalesA::StoreStageRows(x, c, tc, t.rows, t.x_recv + g.K + (int64_t)kt * 4, g.row_bytes);
  };
  const int tiles = sched.pre_a[g.E_l] + sched.pre_b[g.E_l];
  const StallTimedWait<decltype(tile_wait)> timed_wait{tile_wait, rd.priv->gemm_stall_ns};
  auto tile_loop = [&](auto a_stage) {
    if constexpr (kFp8) {
      const wgmma_gemm::Fp8PackedRowsOperands ops{
          &a_map, &b_map, &sa_map,
          {g.w_scales, (int)(g.N / wgmma_gemm::kScaleChunk), (int)(g.K / wgmma_gemm::kScaleChunk)}};
      wgmma_gemm::WgmmaLoop<wgmma_gemm::Fp8PackedRowsOperands, /*kOutF32=*/true>(
          ops, (int)g.K, tiles, next_tile, tile_of, wgmma_gemm::NoTileDone{}, smem, timed_wait, a_stage);
    } else {
      wgmma_gemm::WgmmaTileLoopNext<kTransB ? 0 : 1, !kSwiGlu && !kOutBf16>(
          a_map, b_map, (int)g.K, tiles, next_tile, tile_of, wgmma_gemm::NoTileDone{}, smem, timed_wait, a_stage);
    }
  };
  if (threadIdx.x == 0)
    atomicMin(reinterpret_cast<unsigned long long*>(&rd.priv->prod_t0), (unsigned long long)GlobalTimer());
  if constexpr (kXRecvFromTiles) tile_loop(x_recv_stage); else tile_loop(wgmma_gemm::NoAStage{});
  if (threadIdx.x == 0)
    atomicMax(reinterpret_cast<unsigned long long*>(&rd.priv->prod_t1), (unsigned long long)GlobalTimer());
  if (!pusher) side_work();

  // The last CTA to finish: every tile and copy unit has waited for its blocks, so every add of the call has landed,
  // and every read of recv is done. It zeroes the call's src_blocks (no source adds again before this rank's
  // done_epoch of this call) and closes the call. (Thread 0's fences after the barrier order the CTA's accesses
  // before its count, and the last CTA's stores after every count: protocol.cuh.)
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last_cta = atomicAdd(reinterpret_cast<unsigned long long*>(rd.producers_done), 1ull) == gridDim.x - 1ull;
    if (last_cta) __threadfence();
  }
  __syncthreads();
  if (!last_cta) return;
  uint64_t* own = View(rd, rd.rank).src_blocks();
  const int64_t nb = SrcBlocks(rd.sizes.ret_rows);
  for (int s = 0; s < R; ++s) {
    int64_t lo = INT64_MAX, hi = 0;  // s's send positions kept here: [lo, hi)
    for (int e = 0; e < g.E_l; ++e) {
      const Segment& x = scratch.raw[e * R + s];
      if (x.rows > 0) {
        lo = min(lo, (int64_t)x.ret_off);
        hi = max(hi, (int64_t)x.ret_off + x.rows);
      }
    }
    for (int64_t J = (hi > lo ? lo / kSrcBlockRows : 0) + threadIdx.x; hi > lo && J <= (hi - 1) / kSrcBlockRows;
         J += blockDim.x)
      own[s * nb + J] = 0;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // The plan's count of the rows this rank receives must be its segments' (a dispatch's recv_arrivals account).
    const int64_t expected = g.recv_expected[0];
    const int64_t kept_rows = kept();
    if (expected != kept_rows) ReportBadInput(rd, kBadKeptRows, 0, expected, (uint64_t)kept_rows);
    CloseCall(rd, kept_rows, 0);
  }
}

template <bool kTransB, bool kSwiGlu, bool kXRecvFromTiles, bool kFp8 = false, bool kOutBf16 = false>
const void* Kernel() {
  return reinterpret_cast<const void*>(DispatchGemmKernel<kTransB, kSwiGlu, kXRecvFromTiles, kFp8, kOutBf16>);
}
// bf16 rows: GEMM1 with its SwiGLU, or the product (w MN- or K-major) in float32 or rounded to bf16 (out_bf16).
template <bool kXRecvFromTiles>
const void* Kernel(bool transpose_rhs, bool swiglu, bool out_bf16) {
  if (swiglu) return Kernel<false, true, kXRecvFromTiles>();
  if (out_bf16)
    return transpose_rhs ? Kernel<true, false, kXRecvFromTiles, false, true>()
                         : Kernel<false, false, kXRecvFromTiles, false, true>();
  return transpose_rhs ? Kernel<true, false, kXRecvFromTiles>() : Kernel<false, false, kXRecvFromTiles>();
}
// FP8 (B K-major always): GEMM1 with the recipe's SwiGLU forward, or the float32 product.
template <bool kXRecvFromTiles>
const void* Fp8Kernel(bool swiglu) {
  return swiglu ? Kernel<true, true, kXRecvFromTiles, true>() : Kernel<true, false, kXRecvFromTiles, true>();
}

// The tensor maps of the FP8 kernel, behind CachedMapSet: A the packed rows' values [cap, D] e4m3 at their stride
// row_bytes, as (D, cap) box (128, 128), 128B swizzle; B [E_l, N, D] e4m3 as (D, N, E_l) box (128, 128, 1), 128B
// swizzle; A's scales the rows' tails (from recv + D) as (D / 128, cap) float32 at the same stride, box (4, 128),
// unswizzled (Fp8RowTailScalesA). All with OOB zero fill.
cudaError_t CachedFp8PackedRowsMaps(const void* recv, int64_t cap, int64_t D, int64_t row_bytes, const void* w,
                                    int64_t E_l, int64_t N, CUtensorMap* maps) {
  struct Key {
    const void* recv;
    const void* w;
    int64_t cap, D, E_l, N;
    bool operator==(const Key& o) const {
      return recv == o.recv && w == o.w && cap == o.cap && D == o.D && E_l == o.E_l && N == o.N;
    }
  };
  return wgmma_gemm::CachedMapSet<Key, 32, 3>(Key{recv, w, cap, D, E_l, N}, maps, [&](CUtensorMap* m) {
    const cuuint64_t s_dims[2] = {(cuuint64_t)(D / wgmma_gemm::kScaleChunk), (cuuint64_t)cap};
    const cuuint64_t strides[1] = {(cuuint64_t)row_bytes};
    const cuuint32_t s_box[2] = {wgmma_gemm::kFp8TailChunks, wgmma_gemm::kBM};
    if (!wgmma_gemm::EncodeFp8AMap(&m[0], recv, cap, D, row_bytes, "packed e4m3 rows [cap, D]") ||
        !wgmma_gemm::EncodeFp8BMap(&m[1], w, E_l, N, D, "e4m3 w [E_l, N, D]") ||
        !wgmma_gemm::EncodeMap(&m[2], static_cast<const char*>(recv) + D, 2, s_dims, strides, s_box,
                               "packed rows' scales", CU_TENSOR_MAP_DATA_TYPE_FLOAT32, CU_TENSOR_MAP_SWIZZLE_NONE))
      return cudaErrorInvalidValue;
    return cudaSuccess;
  });
}

}  // namespace

// dispatch_gemm (see DispatchGemmKernel): Begin, the per-call counters zeroed, the fused kernel (which closes the
// call).
Status DispatchGemm(const CallSite& c, DType dt, const void* src, int64_t S, int64_t D, const DispatchSlots& slots,
                    const int32_t* recv_expected, const int32_t* seg_rows, const int32_t* seg_ret_off, int64_t E_l,
                    const void* w, const float* w_scales, int64_t N, Gemm1Form form, const int32_t* group_op,
                    const int32_t* rank_op, const DispatchGemmOut& out, int64_t cap) {
  const int64_t row_bytes = RowBytes(dt, D);
  const bool transpose_rhs = form == Gemm1Form::kTransposedRhs, swiglu = form == Gemm1Form::kSwiGlu;
  const bool fp8 = dt == DType::kE4M3Rows;  // packed e4m3 rows, e4m3 w (K-major) with w_scales
  const bool from_tiles = c.opts.x_recv_from_tiles && out.x_recv != nullptr;  // DispatchGemmArgs::x_recv_from_tiles
  Status s = BeginCall(c, "dispatch_gemm", CallFootprint{row_bytes, cap, slots.P, E_l}, group_op, rank_op);
  if (!s.ok()) return s;
  Workspace& ws = *c.ws;
  const int budget = ws.budget(c.group, c.rank);
  const int dev = ws.device(c.group, c.rank);
  const int pushers = c.opts.pushers;  // 0: the library's choice (DispatchPushersPolicy)
  DeviceInfo info;
  if (!(s = GetDeviceInfo(dev, &info)).ok()) return s;
  const std::string got = std::string(" (got ") + Traits(dt).name + ", d_model " + std::to_string(D) + ", N " +
                          std::to_string(N) + (transpose_rhs ? ", w transposed" : "") +
                          (swiglu ? ", the SwiGLU epilogue" : "") + ", rows " + std::to_string(cap) +
                          ", compute capability " + std::to_string(info.cc.major) + "." +
                          std::to_string(info.cc.minor) + ")";
  std::string bad;
  if (fp8) {
    // The FP8 grouped GEMM's device rule, then the packed rows' own (the call's shape rules are CheckDispatchGemm's).
    const char* why = Fp8GroupedGemmDeviceRefusal(info.cc);
    if (why == nullptr) why = Fp8DispatchGemmOperandRefusal(D, N);
    // (The call's shape rules, CheckDispatchGemmFp8's, restated where the kernel's indexing needs them.)
    if (why == nullptr && swiglu && N % (2 * wgmma_gemm::kSwiGluFp8Cols) != 0)
      why = "the SwiGLU epilogue takes N = 2F with F a multiple of 128 (whole 1 x 128 tiles of h)";
    const uintptr_t outs = reinterpret_cast<uintptr_t>(out.out) | reinterpret_cast<uintptr_t>(out.a) |
                           reinterpret_cast<uintptr_t>(out.h_scales) | reinterpret_cast<uintptr_t>(out.a_scales);
    if (why == nullptr && (outs % 16 != 0 || reinterpret_cast<uintptr_t>(w_scales) % 4 != 0 ||
                           (swiglu && out.h_scales == nullptr) || (out.a != nullptr) != (out.a_scales != nullptr)))
      why = "the results must be 16-byte aligned (w_scales 4), with the SwiGLU h's scales given and a's with a";
    if (why != nullptr) bad = std::string("packed e4m3 rows: ") + why + got;
  } else {
    // The GEMM of the recv rows, which arrive as src's rows are laid out (its alignment stands for theirs), on the
    // wgmma engine, the one whose tile loop waits for its rows.
    const GemmOperands gemm{dt, GemmForm::kRows, cap, D, N, transpose_rhs,
                            swiglu ? GemmEpilogue::kSwiGlu : GemmEpilogue::kNone, src, w};
    if (const char* why = GemmEngineRefusal(GemmEngine::kWgmma, info.cc, gemm))
      bad = std::string("runs on the wgmma engine only: ") + why + got;
  }
  if (bad.empty() && pushers > budget - 1)  // (>= 1: CheckOptions)
    bad = "pushers=" + std::to_string(pushers) + " but rank " + std::to_string(c.rank) + " has an SM budget of " +
          std::to_string(budget) + " CTAs: use 1 .. " + std::to_string(budget - 1);
  else if (bad.empty() && out.a != nullptr && !swiglu)
    bad = "the preactivation a is a result of the SwiGLU epilogue only";
  else if (bad.empty() && out.out_bf16 && (swiglu || fp8))
    bad = "a bf16 product (out_bf16) is the plain form's of bf16 rows";
  else if (bad.empty() && from_tiles && reinterpret_cast<uintptr_t>(out.x_recv) % 16 != 0)
    bad = "x_recv must be 16-byte aligned where the GEMM tiles store it (CallConfig.x_recv_from_tiles)";
  if (!bad.empty()) return FailCall(c, "dispatch_gemm", bad);
  const RankDev rd = ws.Dev(c.group, c.rank);
  // producers_done counts the CTAs done (the last one closes the call); tile_claims and side_claims hand out GEMM
  // tiles and side units.
  if (!(s = CudaStatus(cudaMemsetAsync(rd.producers_done, 0, kCallCounterBytes, c.stream),
                       "cudaMemsetAsync(call counters)")).ok())
    return s;
  CUtensorMap maps[3];  // A, B, and FP8: A's scales (bf16: unused, a copy of A's)
  const void* recv = RankView{rd.peers.base[c.rank], rd.layout}.recv();  // A: where the peers' pushes land
  if (fp8) {
    s = CudaStatus(CachedFp8PackedRowsMaps(recv, cap, D, row_bytes, w, E_l, N, maps), "tensor maps of dispatch_gemm");
  } else {
    s = CudaStatus(wgmma_gemm::CachedGemmMaps(recv, cap, D, w, E_l, N, /*b_k_major=*/transpose_rhs, &maps[0],
                                              &maps[1]),
                   "tensor maps of dispatch_gemm");
    maps[2] = maps[0];
  }
  if (!s.ok()) return s;
  const void* kernel = fp8 ? (from_tiles ? Fp8Kernel<true>(swiglu) : Fp8Kernel<false>(swiglu))
                           : (from_tiles ? Kernel<true>(transpose_rhs, swiglu, out.out_bf16)
                                         : Kernel<false>(transpose_rhs, swiglu, out.out_bf16));
  const int loop_smem =
      fp8 ? wgmma_gemm::LoopSmemBytes<wgmma_gemm::kStages, wgmma_gemm::Fp8PackedRowsOperands::kExtraBytes>()
          : wgmma_gemm::kLoopSmemBytes;
  int smem = 0;
  if (!(s = PrepareOneCtaPerSm(kernel, wgmma_gemm::kThreads, loop_smem, kWgmmaKernelSetup, "DispatchGemmKernel", dev,
                               &smem)).ok())
    return s;
  const DispatchGemmArgs args{static_cast<const char*>(src), S, row_bytes, slots.src_row, slots.dest_rank,
                              slots.dest_row, slots.send_order, slots.send_start, slots.P, cap, seg_rows, seg_ret_off,
                              recv_expected, (int)E_l, DispatchPushersPolicy(ws, c.opts, budget, kWgBM, kWgBN), D, N,
                              static_cast<char*>(out.x_recv), out.out, out.a, out.h_scales, out.a_scales, w_scales,
                              c.opts.emulated_link_gbps, slots.primary, slots.row_scale, from_tiles,
                              c.opts.producer_band_m > 0 ? c.opts.producer_band_m : wgmma_gemm::kBandM,
                              c.opts.producer_order, out.a_bf16 && !fp8};
  void* params[] = {const_cast<RankDev*>(&rd), const_cast<DispatchGemmArgs*>(&args), &maps[0], &maps[1], &maps[2]};
  return CudaStatus(cudaLaunchKernel(kernel, budget, wgmma_gemm::kThreads, params, smem, c.stream),
                    "launch of DispatchGemmKernel");
}

}  // namespace jmo::cuda
