// The resource manager's device side: the choice of the consumer CTA count C from the call's segment table, and
// gather_rs's C (DeviceChooseGatherConsumers, DeviceChooseGatherConsumersPrepared, GatherConsumersOfCall);
// ConsumerConfig, what ExpertKernel is told about C and about how its consumer pushes (used by ExpertKernel,
// expert_combine.cu, and by tools/decision_bench.cu); and dispatch_gemm's pusher count P (PusherConfig, at the end).
// Every function with a barrier is called by every thread of the CTA.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device/warp.cuh"
#include "cuda/schedule/segment_table.cuh"
#include "common/call_options.h"          // CallOptions, DefaultPushers
#include "cuda/workspace/workspace.h"      // kThreads, kMaxSegments, Segment, resource_model.h

namespace jmo::cuda {

// The resource manager on the device (resource_model.h): every CTA that C could make a consumer (ExpertKernel's
// choosers, CTAs [0, max_ctas)) evaluates the model on its own copy of the segment table and gets the same C (same
// inputs, same operations, no FMA contraction: see the header), then takes its role by block index. Lane c of a warp
// evaluates candidate C = c + 1 over some of the segments; a max over the warps and an argmin over the lanes
// (smallest C on ties, as ChooseConsumerCtas) finish it. Two forms, the same C:
//   chunked   (DeviceChooseConsumers) warp w takes the contiguous chunk of remote
//             segments [w * ch, (w + 1) * ch), sums the segments before it itself (strided loads, redux.sync) and
//             scans its chunk with one warp scan, so its prefixes stay warp-private: 1 barrier instead of 7, and per
//             (C, j) pair FP64 operations only (ceil(cum / P) times the tile time by ReadyUsFma: two fma, the same
//             double as RmMul(CeilDiv(cum, P), t); the scans' form paid a CeilDiv and three
//             int -> double conversions per pair, and cc 9.0 issues those at 16 results/clk/SM against 64 for
//             DMUL/DADD). Its shortcuts are exact when rows are in [1, 2^23), ceil(N / BN) < 2^19, N * eb < 2^32 and
//             the lanes' tile_us, seg_us and us_per_byte are finite and >= +0 (ChunkedIsExact): true of every real
//             call (calibrated times and rates are positive).
//   scans     (ChooseByScans) block scans of tiles and bytes to shared memory, lane c of warp w over segments w,
//             w + 8, ...: every other input, so both forms give the same C on every input.
// The divisions the chunked form needs are computed by the host (CandidateConsts) and each warp reduces the maxima
// itself (a tree of maxima), so a decision stays a small part of a call (tools/decision_bench.cu and
// tools/probes/decision_probe.cu time it); its cost grows with the chunk a warp scans (n / 8 segments).

static_assert(kMaxSegments <= kThreads, "one thread per segment for the prefix scan");
static_assert(kMaxModelCtas == 32, "one lane per candidate");
constexpr int kWarps = kThreads / 32;
static_assert(kMaxSegments <= 32 * kWarps, "a chunk of remote segments fits in a warp");
static_assert((kWarps & (kWarps - 1)) == 0, "the per-warp maxima reduce as a tree");

struct ChoiceScratch {
  union {
    ModelPrefix pre[kMaxSegments];  // ChooseByScans
    struct {                        // the chunked form: segment j's parts of its term that do not depend on C
      double ceil_arg[kMaxSegments];  // CeilArg(cum_tiles)
      double push_us[kMaxSegments];   // pushed_from * seg_us
      double bytes[kMaxSegments];     // (double)bytes_from
    } seg;                            // (the same 6 KB as pre[]: shared memory does not grow)
    struct {                          // DeviceChooseGatherConsumers (and its prepared form: chosen, cum..link_us)
      int64_t scan[2 * 32];           // BlockExclusiveScanN's warp totals
      int64_t cum_end[kMaxRanks];     // by source: tiles up to its last segment,
      int64_t rows_end[kMaxRanks];    // rows up to its last segment and before its first,
      int64_t rows_before[kMaxRanks];
      int32_t place[kMaxRanks];       // and its place among the sources with rows (producer order)
      uint32_t has_rows;              // the sources with rows
      int32_t chosen;
      int64_t cum[kMaxRanks];         // by place in the consumer's order (warp 0): cum_tiles,
      double ceil_arg[kMaxRanks];     // CeilArg(cum_tiles),
      double traffic[kMaxRanks];      // (double)GatherSourceTraffic,
      double link_us[kMaxRanks];      // its partial's link time (RmMul(link bytes, 1e-3 / link_gbps))
    } gather;
  };
  double us[2][kWarps][32];  // per-warp maxima by lane; the chunked form alternates halves by call parity
  int64_t warp_sums[32];
  int chosen;                // ChooseByScans
};

// The constants of the chunked form and of gather_rs's choice that need a division, computed by the host before the
// launch (FillCandidateConsts), so that no division sequence sits on the decision's critical path: per candidate,
// ModelUsPerByte's, 1 / P and gather_rs's 1e-3 / (C g) (GatherMakespanFromSources' us_per_traffic), per call
// gather_rs's 1e-3 / link_gbps (IEEE division and reciprocal are correctly rounded on both sides: the doubles the
// device would compute; entry c - 1 is candidate C = c, or C = 1's where c is infeasible), and the 32-bit magic of
// tile_m (MagicCeilDiv) and ceil(N / BN) (integers: the same on both sides).
struct CandidateConsts {
  double us_per_byte[kMaxModelCtas];
  double rcp_producers[kMaxModelCtas];
  double gather_us_per_traffic[kMaxModelCtas];
  double us_per_link_byte;
  uint32_t tile_m;        // max(p.tile_m, 1)
  uint32_t tile_m_magic;  // 0xffffffff / tile_m
  int64_t col_tiles;      // ceil(N / p.tile_n), -1 if p.tile_n <= 0 (ChunkedIsExact then falls back)
};

// Policy::cand for the model p, candidates 1..max_ctas and rows N wide (host).
inline CandidateConsts FillCandidateConsts(const ModelParams& p, int max_ctas, int64_t N) {
  CandidateConsts cc{};
  cc.tile_m = p.tile_m > 0 ? (uint32_t)p.tile_m : 1u;
  cc.tile_m_magic = 0xffffffffu / cc.tile_m;
  cc.col_tiles = p.tile_n > 0 ? CeilDiv(N, p.tile_n) : -1;
  for (int c = 1; c <= kMaxModelCtas; ++c) {
    const int cl = c <= max_ctas && ModelFeasible(p, c) ? c : 1;
    const int64_t producers = (int64_t)(p.sms - cl) * p.ctas_per_sm;
    cc.us_per_byte[c - 1] = ModelUsPerByte(p, cl);
    cc.rcp_producers[c - 1] = 1.0 / (double)(producers > 0 ? producers : 1);
    cc.gather_us_per_traffic[c - 1] = 1e-3 / RmMul((double)cl, GatherTrafficGbpsPerCta(p));
  }
  cc.us_per_link_byte = 1e-3 / p.link_gbps;
  return cc;
}

// The candidate with the smallest v over the warp, the smallest candidate on ties (lexicographic (v, cand), so any
// reduction order gives it): in lane 0 (the other lanes hold partial results). Called by a whole warp.
__device__ __forceinline__ int ShuffleArgminLane0(double v, int cand) {
  for (int d = 16; d > 0; d >>= 1) {
    const double ov = __shfl_down_sync(0xffffffffu, v, d);
    const int oc = __shfl_down_sync(0xffffffffu, cand, d);
    if (ov < v || (ov == v && oc < cand)) {
      v = ov;
      cand = oc;
    }
  }
  return cand;
}

// The scans form (see above). Called by every thread of the CTA (contains barriers).
__device__ inline int ChooseByScans(const SegTable& t, const ModelParams& p, int64_t N, int64_t K, int64_t eb,
                                    int max_ctas, ChoiceScratch* sc) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int mr = t.remote_segs;
  // Prefix sums of tiles (all segments) and pushed bytes (remote ones) in producer order.
  const int64_t own_bytes = tid < mr ? (int64_t)t.seg[tid].rows * N * eb : 0;
  int64_t total_tiles = 0, total_bytes = 0;
  const int64_t tiles = BlockInclusiveScan(tid < t.n ? ModelTiles(p, t.seg[tid].rows, N) : 0, sc->warp_sums,
                                           &total_tiles);
  const int64_t bytes = BlockInclusiveScan(own_bytes, sc->warp_sums, &total_bytes);
  if (tid < mr) sc->pre[tid] = ModelPrefix{tiles, mr - tid, total_bytes - (bytes - own_bytes)};
  __syncthreads();
  const bool active = warp < kWarps;  // a 384-thread CTA (wgmma engine): warps 8..11 only meet the barriers
  const int c = lane + 1;
  const bool feasible = c <= max_ctas && ModelFeasible(p, c);
  double us = 0.0;
  if (feasible && active) {
    const ModelEval e = ModelEvalFor(p, K, c);
    if (warp == 0) us = ModelProducerUs(e, total_tiles);
    for (int j = warp; j < mr; j += kWarps) us = RmMax(us, ModelTermUs(e, sc->pre[j]));
  }
  if (active) sc->us[0][warp][lane] = us;
  __syncthreads();
  if (warp == 0) {
    double v = sc->us[0][0][lane];
    for (int w = 1; w < kWarps; ++w) v = RmMax(v, sc->us[0][w][lane]);
    if (!feasible) v = 1e300;
    const int cand = ShuffleArgminLane0(v, c);
    if (lane == 0) sc->chosen = cand;
  }
  __syncthreads();
  return sc->chosen;
}

// ModelTermUs's ready = RmMul((double)CeilDiv(cum, P), tile_us) in two FP64 operations, from ceil_arg = CeilArg(cum)
// and rp = the correctly rounded 1 / P. The exact product y = ceil_arg * rp is within ((cum - 0.5) / P) * 2^-53 of
// (cum - 0.5) / P, which lies >= 0.5 / P from every integer, so for cum < 2^52 y lies strictly between the same two
// integers, the upper one ceil(cum / P); fma rounding y + 2^52 up once (ulp 1 in [2^52, 2^53)) gives x = 2^52 +
// ceil(cum / P) exactly (y = 0 and x = 2^52 for cum = 0). With neg_shift = -2^52 t (ShiftOf: exact, a power-of-two
// multiple of t), fma(x, t, -2^52 t) = round(x t - 2^52 t) = round(ceil(cum / P) t), RmMul's double, for finite t
// (one rounding; at ceil = 0 it is x t - x t = +0, as RmMul(0, t) for t >= +0). Callers check that t is finite (an
// infinite t would give inf - inf) and cum < 2^50.
constexpr double kTwo52 = 4503599627370496.0;
__device__ __forceinline__ double ShiftOf(double tile_us) { return __dmul_rn(-kTwo52, tile_us); }
__device__ __forceinline__ double ReadyUsFma(double ceil_arg, double rp, double tile_us, double neg_shift) {
  return __fma_rn(__fma_ru(ceil_arg, rp, kTwo52), tile_us, neg_shift);
}

// x is +0 or a positive finite double (no sign bit, not inf or NaN).
__device__ __forceinline__ bool FiniteNonNegative(double x) {
  return (unsigned long long)__double_as_longlong(x) < 0x7ff0000000000000ull;
}

// The chunked form's shortcuts are exact (one answer on every thread: every warp has read the whole table, every
// lane's e is checked). Rows in [1, 2^23) (`rows_ok`, this lane's segments) and n <= 256: the sums of rows and of row
// tiles are < 2^31 (32-bit sums, a 64-bit scan of (row tiles << 32 | rows) without carries), and with ceil(N / BN) <
// 2^19 every cum_tiles is < 2^50 (ReadyUsFma); N * eb < 2^32: bytes_from < 2^63. Finite parts >= +0 make every term
// >= +0 and not NaN (no inf * 0, no -0): max is then exact in any grouping (the warps hold other segments than
// ChooseByScans's), and such doubles order like their bit patterns (ArgminC).
__device__ __forceinline__ bool ChunkedIsExact(bool rows_ok, const ModelEval& e, const ModelParams& p, int64_t nn,
                                               int64_t N, int64_t eb) {
  const bool lanes_ok = __all_sync(0xffffffffu, rows_ok && FiniteNonNegative(e.us_per_byte));
  return lanes_ok && p.tile_m > 0 && nn >= 0 && nn < (1 << 19) && (uint64_t)N < (1ull << 32) &&
         (uint64_t)eb < (1ull << 32) && (uint64_t)N * (uint64_t)eb < (1ull << 32) && FiniteNonNegative(e.tile_us) &&
         FiniteNonNegative(p.seg_us);
}

// 1 + the lowest lane with the smallest v, i.e. C (v >= +0 and not NaN: min of the high words, then of the low words
// among those; a ballot picks the smallest C on ties, as ChooseConsumerCtas). 2 redux.sync and a ballot instead of
// five rounds of three shuffles.
__device__ __forceinline__ int ArgminC(double v) {
  const unsigned long long bits = (unsigned long long)__double_as_longlong(v);
  const uint32_t hi = (uint32_t)(bits >> 32), lo = (uint32_t)bits;
  const uint32_t mhi = __reduce_min_sync(0xffffffffu, hi);
  const uint32_t mlo = __reduce_min_sync(0xffffffffu, hi == mhi ? lo : 0xffffffffu);
  return __ffs(__ballot_sync(0xffffffffu, hi == mhi && lo == mlo));
}

// RmMax(a, b) for a, b >= +0 and not NaN (no -0): such doubles order like their bit patterns, so an integer compare
// gives the same double and leaves the FP64 pipe, which bounds the chunked form's loop, to the terms.
__device__ __forceinline__ double MaxNonNegative(double a, double b) {
  return (unsigned long long)__double_as_longlong(b) > (unsigned long long)__double_as_longlong(a) ? b : a;
}

// The chunked forms' terms over this warp's chunk [beg, end) of seg[] for this lane's candidate (e, rp = 1 / P), and
// with `producer` (warp 0) the producer's term from all_ceil_arg = CeilArg(all tiles): ModelProducerUs and ModelTermUs,
// the same doubles per term (ReadyUsFma: e.tile_us is finite, ChunkedIsExact), their max (every term >= +0 and not
// NaN: MaxNonNegative).
__device__ __forceinline__ double ChunkMaxUs(const ChoiceScratch* sc, int beg, int end, bool producer,
                                             double all_ceil_arg, double rp, const ModelEval& e) {
  const double shift = ShiftOf(e.tile_us);
  double us = producer ? ReadyUsFma(all_ceil_arg, rp, e.tile_us, shift) : 0.0;
#pragma unroll 4
  for (int s = beg; s < end; ++s)
    us = MaxNonNegative(us, RmAdd(ReadyUsFma(sc->seg.ceil_arg[s], rp, e.tile_us, shift),
                                  RmAdd(sc->seg.push_us[s], RmMul(sc->seg.bytes[s], e.us_per_byte))));
  return us;
}

// The end of the chunked forms: each warp's maxima by lane to shared memory, then C on every thread (one barrier).
// Called by every thread of the CTA.
__device__ __forceinline__ int ArgminOverWarps(double us, bool feasible, ChoiceScratch* sc, int parity) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double(*us_half)[32] = sc->us[parity & 1];
  if (warp < kWarps) us_half[warp][lane] = us;
  __syncthreads();
  // One barrier: every warp reduces the per-warp maxima itself (no second barrier to publish warp 0's answer). Safe
  // with the same scratch across calls: this call's reads of its half come after its barrier, and the next call that
  // writes the same half (two calls on) does so only after the next call's barrier, which every warp reaches after
  // these reads; seg[] is read before the barrier, and written either by each warp for its own chunk
  // (DeviceChooseConsumers) or by BuildSegments<kPrepTerms> before its last barrier. (ChooseByScans uses us[0] between
  // barriers of its own.)
  // (A tree of maxima: exact in any grouping, the terms being >= +0 and not NaN.)
  double m[kWarps];
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m[w] = us_half[w][lane];
#pragma unroll
  for (int h = kWarps / 2; h > 0; h /= 2)
#pragma unroll
    for (int w = 0; w < h; ++w) m[w] = MaxNonNegative(m[w], m[w + h]);
  return ArgminC(feasible ? m[0] : 1e300);
}

// Called by every thread of the CTA (contains a barrier). The consumer pushes the remote segments [0, remote_segs)
// only (local ones are stored in place by the producer): resource_model.h ModelPrefixes with remote = src != rank.
// The chunked form (see above), or ChooseByScans where its shortcuts would not be exact. `parity`: 0 or 1, alternated
// by a caller that decides more than once with the same scratch (see the end), 0 for a single decision.
__device__ inline int DeviceChooseConsumers(const SegTable& t, const ModelParams& p, const CandidateConsts& cand,
                                            int64_t N, int64_t K, int64_t eb, int max_ctas, ChoiceScratch* sc,
                                            int parity = 0) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n = t.n, mr = t.remote_segs;
  // This lane's candidate and its constants (an infeasible lane gets C = 1's: checked by ChunkedIsExact, never used in
  // a term); the two that need a division come from the host (CandidateConsts).
  const int c = lane + 1;
  const bool feasible = c <= max_ctas && ModelFeasible(p, c);
  const ModelEval e = ModelEvalWith(p, K, feasible ? c : 1, cand.us_per_byte[lane]);
  const double rp = cand.rcp_producers[lane];
  const uint32_t tm = cand.tile_m, mtm = cand.tile_m_magic;
  const int64_t nn = cand.col_tiles;
  // Warp w's chunk (ch <= 32: one segment per lane). Warps 8..11 of a 384-thread CTA (wgmma engine) get none, they
  // only take the table pass (for ChunkedIsExact's common answer) and meet the barriers.
  const int ch = (mr + kWarps - 1) / kWarps, beg = warp * ch, end = min(beg + ch, mr);
  // This lane's share of: row tiles of all segments, rows of the remote ones, both of the segments before the chunk.
  uint32_t all_t = 0, rem_r = 0, pre_t = 0, pre_r = 0;
  bool rows_ok = true;
#pragma unroll
  for (int i = 0; i < kMaxSegments / 32; ++i) {
    const int j = lane + 32 * i;
    if (j >= n) break;
    const int32_t r = t.seg[j].rows;
    rows_ok = rows_ok && (uint32_t)r - 1u < (1u << 23) - 1u;
    const uint32_t mt = MagicCeilDiv((uint32_t)r, tm, mtm);
    all_t += mt;
    if (j < mr) rem_r += (uint32_t)r;
    if (j < beg) {
      pre_t += mt;
      pre_r += (uint32_t)r;
    }
  }
  if (!ChunkedIsExact(rows_ok, e, p, nn, N, eb)) return ChooseByScans(t, p, N, K, eb, max_ctas, sc);
  double us = 0.0;
  if (beg < end || warp == 0) {  // warp-uniform
    all_t = __reduce_add_sync(0xffffffffu, all_t);
    rem_r = __reduce_add_sync(0xffffffffu, rem_r);
    pre_t = __reduce_add_sync(0xffffffffu, pre_t);
    pre_r = __reduce_add_sync(0xffffffffu, pre_r);
    // Segment j = beg + lane: tiles up to j and rows from j to the end, as ModelPrefixes (exact integer reorderings:
    // (sum of row tiles) * ceil(N / BN), (sum of rows) * N * eb).
    const int j = beg + lane;
    const bool mine = j < end;
    const uint32_t r = mine ? (uint32_t)t.seg[j].rows : 0u;
    const uint64_t incl = (uint64_t)WarpInclusiveSum(
        (long long)((uint64_t)MagicCeilDiv(r, tm, mtm) << 32 | r), lane);
    if (mine) {
      sc->seg.ceil_arg[j] = CeilArg((int64_t)(pre_t + (uint32_t)(incl >> 32)) * nn);
      sc->seg.push_us[j] = RmMul((double)(mr - j), p.seg_us);
      sc->seg.bytes[j] = (double)((int64_t)(rem_r - pre_r - ((uint32_t)incl - r)) * (N * eb));
    }
    __syncwarp();  // the chunk is this warp's own: no barrier
    if (feasible) us = ChunkMaxUs(sc, beg, end, warp == 0, CeilArg((int64_t)all_t * nn), rp, e);
  }
  return ArgminOverWarps(us, feasible, sc, parity);
}

// The consumer choice on a table built by BuildSegments<kPrepTerms> with TermPrepFor(p, cand, N, eb, sc) (the same p
// and cand): the chunked form without its own pass over the table (BuildSegments wrote seg[] and the total row tiles),
// the same C. Called by every thread of the CTA (contains a barrier); `parity` as DeviceChooseConsumers'.
__device__ inline int DeviceChooseConsumersPrepared(const SegTable& t, const TermPrepOut& prep, const ModelParams& p,
                                                    const CandidateConsts& cand, int64_t N, int64_t K, int64_t eb,
                                                    int max_ctas, ChoiceScratch* sc, int parity = 0) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, mr = t.remote_segs;
  const int c = lane + 1;
  const bool feasible = c <= max_ctas && ModelFeasible(p, c);
  const ModelEval e = ModelEvalWith(p, K, feasible ? c : 1, cand.us_per_byte[lane]);
  const double rp = cand.rcp_producers[lane];
  const int64_t nn = cand.col_tiles;
  if (!ChunkedIsExact(prep.rows_small, e, p, nn, N, eb)) return ChooseByScans(t, p, N, K, eb, max_ctas, sc);
  const int ch = (mr + kWarps - 1) / kWarps, beg = warp * ch, end = min(beg + ch, mr);
  double us = 0.0;
  if (feasible && (beg < end || warp == 0))
    us = ChunkMaxUs(sc, beg, end, warp == 0, CeilArg(prep.row_tiles * nn), rp, e);
  return ArgminOverWarps(us, feasible, sc, parity);
}

// The parts of the consumer choice's terms (TermPrepIn's arrays, as BuildSegments<kPrepTerms> writes them for the
// table's order) for expert_combine's expert-major producer (cuda/ops/expert_producer.cuh UseExpertMajor): the remote
// segments in the consumer's expert-major order (ExpertMajorBands'), each ready once its expert's tiles are, the
// tiles counted over the expert's rows (resource_model.h ModelSegment::tile_rows; the host mirror's ModelPrefixes on
// benchmarks/bench_resource.py's expert-major segments), and out->row_tiles the experts' row tiles. raw: the plan's
// segments (TableScratch::raw), E_l experts of R sources; order: ExpertMajorOrder's order of all segments (read only:
// a chooser that produces tiles them in it); expert_tiles ([E_l]): scratch. Every thread calls it (barriers) and gets
// the same out.
__device__ inline void ExpertMajorTermPrep(const SegTable& t, const Segment* raw, int E_l, int R, const TermPrepIn& in,
                                           TermPrepOut* out, const SegPlace* order, int32_t* expert_tiles,
                                           int64_t* warp_sums) {
  const int i = threadIdx.x;
  const int64_t mt = i < E_l ? (int64_t)MagicCeilDiv((uint32_t)ExpertRangeOf(raw, R, 0, i).rows, in.tile_m,
                                                     in.tile_m_magic)
                             : 0;
  int64_t total = 0;
  const int64_t through = BlockInclusiveScan(mt, warp_sums, &total);  // row tiles of experts 0..i
  if (i < E_l) expert_tiles[i] = (int32_t)through;
  // Place i among the remote places, and the remote rows before it (the scan's first barrier orders expert_tiles').
  const int64_t rows = i < t.n ? (int64_t)t.seg[order[i].seg].rows : 0;
  int64_t remote_rows = 0;
  const RemotePlace r = RemotePlaceOf(t, order, rows, &remote_rows, warp_sums);
  if (r.q >= 0) {
    in.ceil_arg[r.q] = CeilArg((int64_t)expert_tiles[t.seg[order[i].seg].expert] * in.col_tiles);
    in.push_us[r.q] = RmMul((double)(t.remote_segs - r.q), in.seg_us);
    in.bytes[r.q] = (double)((remote_rows - r.before) * in.row_bytes);
  }
  out->row_tiles = total;
  __syncthreads();
}

// BuildSegments<kPrepTerms>'s inputs for the consumer choice of model p (its seg_us), cand = FillCandidateConsts(p,
// ..., N), rows of N elements of eb bytes: the parts of the terms go to sc->seg.
__device__ inline TermPrepIn TermPrepFor(const ModelParams& p, const CandidateConsts& cand, int64_t N, int64_t eb,
                                         ChoiceScratch* sc) {
  return TermPrepIn{cand.tile_m, cand.tile_m_magic, cand.col_tiles, N * eb, p.seg_us,
                    sc->seg.ceil_arg, sc->seg.push_us, sc->seg.bytes};
}

// BuildSegments<kPrepGather>'s inputs for gather_rs's choice on rank `rank` (cand = FillCandidateConsts(p, max_ctas,
// sh.N)): the parts of the sources' terms go to sc->gather.
__device__ inline GatherPrepIn GatherPrepFor(const CandidateConsts& cand, const GatherModelShape& sh, int rank,
                                             ChoiceScratch* sc) {
  auto& g = sc->gather;
  return GatherPrepIn{cand.tile_m, cand.tile_m_magic, cand.col_tiles, sh, rank, cand.us_per_link_byte,
                      g.cum, g.ceil_arg, g.traffic, g.link_us};
}

// gather_rs's choice from the sources' parts in sc->gather (cum, ceil_arg, traffic, link_us: the `ranks` sources in
// the consumer's order, WriteGatherSource) and the tiles of all segments: GatherMakespanFromSources for C = lane + 1
// (the host's operations in the host's order: the same doubles; ready times by ReadyUsFma where every cum_tiles <
// 2^50 and the tile time is finite, the exact CeilDiv otherwise) and the argmin (smallest C on ties, as
// ChooseGatherConsumerCtasFromSources), written to sc->gather.chosen by lane 0. Called by warp 0 alone; its divisions
// (1 / P, 1e-3 / (C g)) from the host (cand).
__device__ __forceinline__ void GatherArgminWarp(const ChoiceScratch* sc, int64_t total_tiles, const ModelParams& p,
                                                 const CandidateConsts& cand, const GatherModelShape& sh, int ranks,
                                                 int max_ctas, int* chosen) {
  const auto& g = sc->gather;
  const int lane = threadIdx.x & 31, c = lane + 1;
  double us_c = 1e300;
  if (c <= max_ctas && ModelFeasible(p, c)) {
    // GatherMakespanFromSources for C = c, its operations in its order.
    const int64_t producers = (int64_t)(p.sms - c) * p.ctas_per_sm;
    const double tile_us = RmAdd(p.tile_us_base, RmMul(p.tile_us_per_k, (double)sh.K));
    const double us_per_traffic = cand.gather_us_per_traffic[lane];  // 1e-3 / RmMul(c, g), c feasible
    // ReadyUsFma exact: every cum <= total below 2^50, and tile_us finite.
    const bool fast = total_tiles >= 0 && total_tiles < (1ll << 50) &&
                      ((unsigned long long)__double_as_longlong(tile_us) << 1) < (0x7ffull << 53);
    const double rp = cand.rcp_producers[lane];  // 1.0 / producers, c feasible
    const double shift = ShiftOf(tile_us);
    auto ready = [&](int64_t cum, double ceil_arg) {
      return fast ? ReadyUsFma(ceil_arg, rp, tile_us, shift) : RmMul((double)CeilDiv(cum, producers), tile_us);
    };
    double us = ready(total_tiles, CeilArg(total_tiles)), rest = 0.0;
#pragma unroll 4
    for (int j = ranks - 1; j >= 0; --j) {
      rest = RmAdd(rest, RmAdd(p.seg_us, RmMax(RmMul(g.traffic[j], us_per_traffic), g.link_us[j])));
      us = RmMax(us, RmAdd(ready(g.cum[j], g.ceil_arg[j]), rest));
    }
    us_c = us;
  }
  // ArgminC where every lane's time is finite and >= +0 (every calibrated call: they order like their bits), else
  // the lexicographic shuffle argmin: both the smallest C among the smallest times, as the host's ModelArgmin.
  const int best = __all_sync(0xffffffffu, FiniteNonNegative(us_c)) ? ArgminC(us_c) : ShuffleArgminLane0(us_c, c);
  if (lane == 0) *chosen = best;
}

// gather_rs's C from the call's segment table (resource_model.h, "gather_rs's consumer CTAs"), the general form.
// Every thread takes one segment: one block scan (tiles; rows and first segments of a source, packed) gives each
// source its tiles up to its last segment, its rows and its place among the sources with rows (GatherModelSources'
// integers, exact in any order), written by its first and last segment; then warp 0 alone puts the sources in the
// consumer's order with the parts of their terms that do not depend on C (WriteGatherSource) and takes the argmin
// (GatherArgminWarp), which a barrier hands to every thread. Three barriers; one warp's FP64 work instead of every
// warp's; its divisions (1 / P, 1e-3 / (C g), 1e-3 / link_gbps) and the tiles' magic from the host (cand =
// FillCandidateConsts(p, max_ctas, sh.N)). Called by every thread of the CTA (blockDim.x >= t.n); consecutive calls
// may share the scratch (each reads what it wrote before its last barrier). t.seg holds the non-empty segments in
// producer order, a source's consecutive. DeviceChooseGatherConsumersPrepared gives the same C without the scan.
__device__ inline int DeviceChooseGatherConsumers(const SegTable& t, const ModelParams& p, const CandidateConsts& cand,
                                                  const GatherModelShape& sh, int rank, int ranks, int max_ctas,
                                                  ChoiceScratch* sc) {
  const int tid = threadIdx.x, lane = tid & 31, n = t.n;
  auto& g = sc->gather;
  if (tid == 0) g.has_rows = 0u;
  const bool mine = tid < n;
  const int src = mine ? t.seg[tid].src : 0;
  const int64_t rows = mine ? t.seg[tid].rows : 0;
  const bool first = mine && (tid == 0 || t.seg[tid - 1].src != src);
  const bool last = mine && (tid == n - 1 || t.seg[tid + 1].src != src);
  // (rows < 2^31 a segment, so rows * 2^9 summed over <= 2^8 segments stays below 2^48.) ModelTiles without its two
  // divisions where cand describes the model's tile (MagicCeilDiv; cand.col_tiles = ceil(N / BN) for this N).
  const bool magic = p.tile_m > 0 && (uint32_t)p.tile_m == cand.tile_m && cand.col_tiles >= 0;
  const int64_t tiles = !mine || rows <= 0 ? 0
                        : magic ? (int64_t)MagicCeilDiv((uint32_t)rows, cand.tile_m, cand.tile_m_magic) * cand.col_tiles
                                : ModelTiles(p, rows, sh.N);
  const int64_t v[2] = {tiles, rows * 512 + (first ? 1 : 0)};
  int64_t pre[2], total[2];
  BlockExclusiveScanN<2>(v, g.scan, pre, total);
  const uint32_t has = __reduce_or_sync(0xffffffffu, mine ? 1u << src : 0u);
  if (lane == 0 && has != 0u) atomicOr(&g.has_rows, has);
  if (first) {
    g.place[src] = (int32_t)(pre[1] & 511);
    g.rows_before[src] = pre[1] >> 9;
  }
  if (last) {
    g.cum_end[src] = pre[0] + v[0];
    g.rows_end[src] = (pre[1] + v[1]) >> 9;
  }
  __syncthreads();
  if (tid < 32) {
    const uint32_t has_rows = g.has_rows, below = (1u << lane) - 1u;
    if (lane < ranks) {
      const int s = lane;
      const bool with_rows = (has_rows >> s) & 1u;
      const int k = GatherConsumerPlace(ranks, __popc(has_rows), with_rows, g.place[s], __popc(~has_rows & below));
      WriteGatherSource(GatherPrepFor(cand, sh, rank, sc), k, s, with_rows ? g.cum_end[s] : 0,
                        with_rows ? g.rows_end[s] - g.rows_before[s] : 0);
    }
    __syncwarp();
    GatherArgminWarp(sc, total[0], p, cand, sh, ranks, max_ctas, &g.chosen);
  }
  __syncthreads();
  return g.chosen;
}

// DeviceChooseGatherConsumers out of line: the prepared form's fallback (tables whose packed sums would not be exact,
// which a real call's capacity rules out), kept out of the kernel's register allocation.
static __device__ __noinline__ int GatherChoiceFallback(const SegTable& t, const ModelParams& p,
                                                        const CandidateConsts& cand, const GatherModelShape& sh,
                                                        int rank, int ranks, int max_ctas, ChoiceScratch* sc) {
  return DeviceChooseGatherConsumers(t, p, cand, sh, rank, ranks, max_ctas, sc);
}

// gather_rs's C from a table built by BuildSegments<kPrepGather> with GatherPrepFor(cand, sh, rank, sc) (the same
// cand, sh, rank and scratch; prep its output): the sources' parts are in sc->gather already, so warp 0 starts at
// GatherArgminWarp and one barrier hands its answer to every thread; DeviceChooseGatherConsumers' C. The table's sums
// are those integers where the tiles' magic describes p's tile (cand = FillCandidateConsts(p, max_ctas, sh.N)) and
// prep.rows_small (row tiles below 2^31, so with ceil(N / BN) < 2^32 every cum_tiles fits: (sum of row tiles) *
// ceil(N / BN), the host's sum of ModelTiles reordered exactly); elsewhere DeviceChooseGatherConsumers on the table.
// Called by every thread of the CTA; consecutive calls may share the scratch (the table build writes the parts after
// its second barrier, which every thread reaches after the previous choice's reads).
__device__ inline int DeviceChooseGatherConsumersPrepared(const SegTable& t, const TermPrepOut& prep,
                                                          const ModelParams& p, const CandidateConsts& cand,
                                                          const GatherModelShape& sh, int rank, int ranks,
                                                          int max_ctas, ChoiceScratch* sc) {
  const bool exact = p.tile_m > 0 && (uint32_t)p.tile_m == cand.tile_m && cand.col_tiles >= 0 &&
                     cand.col_tiles < (1ll << 32) && prep.rows_small;
  if (!exact) return GatherChoiceFallback(t, p, cand, sh, rank, ranks, max_ctas, sc);
  if (threadIdx.x < 32)
    GatherArgminWarp(sc, prep.row_tiles * cand.col_tiles, p, cand, sh, ranks, max_ctas, &sc->gather.chosen);
  __syncthreads();
  return sc->gather.chosen;
}

// What ExpertKernel is told about C and about how its consumer pushes.
struct ConsumerConfig {
  ModelParams model;  // sms = the rank's SM budget, ctas_per_sm = 1
  int32_t use_model;  // 1: choose on the device; 0: `consumers`
  int32_t consumers;  // pinned or fixed C
  int32_t max_ctas;   // candidates 1..max_ctas (ModelMaxCtas(budget))
  int32_t serialize;
  int32_t smem_bytes;  // dynamic shared memory of the launch (a consumer CTA's bulk-copy ring lives there)
  // The call's ConsumerTuning (api.h):
  int32_t bulk_copy;      // 1: TMA bulk copies on sm_90 (transport/bulk_push.cuh); 0: CopyBand
  int32_t push_slots;     // bulk copies: ring slots per issuer
  int32_t push_read_lag;  // bulk copies: stores allowed to be reading their slot
  int32_t push_issuers;   // bulk copies: issuing threads per consumer CTA, one ring each
  int64_t elem_bytes;
  // The call's emulated link (CallOptions::emulated_link_gbps; 0: none): each band is paced through it
  // (transport/emulated_link.cuh) before its arrival count is added.
  double link_bytes_per_ns;
  // The wgmma producer's tile order inside a segment: row blocks per raster band (wgmma_gemm::BandRaster; 1: each row
  // block's tiles in a row, so that its flags complete together).
  int32_t band_m;
  // expert_combine's wgmma producer's segment order (CallOptions::producer_order; UseExpertMajor): 0 the rule, 1 the
  // table's, 2 expert-major.
  int32_t producer_order;
  CandidateConsts cand;  // use_model: FillCandidateConsts(model, max_ctas, N)
};

// C of one call (every thread calls it): none when the call has no remote band (EP = 1, or nothing routed to other
// ranks; every CTA then produces), else the pinned or fixed C, or the model's choice, from a table built by
// BuildSegments<kPrepTerms> with TermPrepFor(pol.model, pol.cand, N, pol.elem_bytes, sc) where pol.use_model
// (ExpertKernel's form; DeviceChooseConsumers' C). Its host twin, for the benchmarks' check of the device's pick:
// benchmarks/bench_resource.py's kernel_consumer_ctas.
__device__ inline int ConsumersOfCall(const SegTable& t, const TermPrepOut& prep, const ConsumerConfig& pol, int64_t N,
                                      int64_t K, ChoiceScratch* sc) {
  if (t.remote_bands == 0) return 0;
  return pol.use_model ? DeviceChooseConsumersPrepared(t, prep, pol.model, pol.cand, N, K, pol.elem_bytes,
                                                       pol.max_ctas, sc)
                       : pol.consumers;
}

// C of one gather_rs call (every thread calls it): the pinned or fixed C (pol.consumers, >= 1: every source needs
// its partial, so the consumer runs even where no band goes to another rank, and there with the fixed C), or the
// model's choice where some band goes to another rank, from a table built by BuildSegments<kPrepGather> with
// GatherPrepFor(pol.cand, sh, rank, sc) where pol.use_model (ExpertKernel<kGather>'s form;
// DeviceChooseGatherConsumers' C). Its host twin, for the loopback harness's check of the device's pick:
// benchmarks/bench_resource.py's kernel_gather_consumer_ctas.
__device__ inline int GatherConsumersOfCall(const SegTable& t, const TermPrepOut& prep, const ConsumerConfig& pol,
                                            const GatherModelShape& sh, int rank, int ranks, ChoiceScratch* sc) {
  if (!pol.use_model || t.remote_bands == 0) return pol.consumers;
  return DeviceChooseGatherConsumersPrepared(t, prep, pol.model, pol.cand, sh, rank, ranks, pol.max_ctas, sc);
}

// What dispatch_gemm is told about its pushing CTAs P: pinned or fixed (the host's), or the model's choice on the
// device from the call's routed counts (resource_model.h ChooseDispatchPushers, evaluated as below).
struct PusherConfig {
  ModelParams model;    // use_model: sms = the rank's SM budget, ctas_per_sm = 1, the call's link (ModelWithLink)
  int32_t use_model;    // 1: choose on the device; 0: `pushers`
  int32_t pushers;      // pinned or fixed P
  int32_t max_pushers;  // use_model: candidates 1..max_pushers (PusherMaxCtas(budget))
};

// P of a dispatch_gemm launch (host) on a rank of `budget` >= 2 CTAs whose GEMM has tile_m x tile_n tiles: pinned
// (o.pushers > 0), else the model's choice on the device where the workspace's model has a pusher rate and describes
// that tile (the calibration's engine), with the call's link in it, else the fixed rule (DefaultPushers,
// call_options.h). The one place the library decides P.
inline PusherConfig DispatchPushersPolicy(const Workspace& ws, const CallOptions& o, int budget, int tile_m,
                                          int tile_n) {
  PusherConfig pc{};
  pc.max_pushers = PusherMaxCtas(budget);
  if (o.pushers > 0) {
    pc.pushers = o.pushers;
    return pc;
  }
  const ModelParams& m = ws.model();
  if (ws.has_model() && m.pusher_gbps > 0.0 && m.tile_m == tile_m && m.tile_n == tile_n && budget >= 2) {
    pc.use_model = 1;
    pc.model = ModelWithLink(m, o.emulated_link_gbps);
    pc.model.sms = budget;  // one CTA per SM (the launch checks it)
    pc.model.ctas_per_sm = 1;
    return pc;
  }
  pc.pushers = DefaultPushers(budget);
  return pc;
}

// P of one dispatch_gemm call, on every lane of the calling warp (called by one whole warp): the pinned or fixed
// count, or the model's choice, lane q evaluating candidate q + 1 (PushersMakespanUs: the host's operations, so the
// same doubles) and a shuffle argmin keeping the smallest P on ties, as ChooseDispatchPushers.
__device__ inline int WarpChooseDispatchPushers(const PusherConfig& pc, const PusherInputs& in) {
  if (!pc.use_model) return pc.pushers;
  const int lane = threadIdx.x & 31, q = lane + 1;
  const int max_q = pc.max_pushers < pc.model.sms - 1 ? pc.max_pushers : pc.model.sms - 1;
  double v = q <= max_q ? PushersMakespanUs(pc.model, in, q) : -1.0;
  if (v < 0.0) v = 1e300;  // infeasible (candidate 1 is feasible: the launch checks sms >= 2 and pusher_gbps > 0)
  return __shfl_sync(0xffffffffu, ShuffleArgminLane0(v, q), 0);
}

}  // namespace jmo::cuda
