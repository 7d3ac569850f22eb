// The analytical resource manager (seed: "Analytical Resource Management for Fine-grained MoE
// Computation-Communication Overlap"): a wave-quantized model of one expert_combine call, and the choice of the
// consumer's CTA count C that minimises it. Host and device callable, no allocation, so that a kernel can evaluate
// it from the real routed counts at start without a host sync. Python calls these same functions through the
// extension (_jmo.model_makespan_us, _jmo.model_choose_consumer_ctas).
//
// Model of one call with C consumer CTAs (each on its own SM):
//   producer CTAs resident  P = (sms - C) * ctas_per_sm            (occupancy of the compiled GEMM kernel)
//   tiles of segment i      n_i = ceil(rows_i / BM) * ceil(N / BN)  (segments in producer order, remote first)
//   tile time               t = tile_us_base + tile_us_per_k * K     (calibrated per GPU and kernel variant)
//   segment i ready         r_i = ceil((n_1 + ... + n_i) / P) * t    (its last tile finishes with the wave holding it)
//   push of segment i       d_i = seg_us + bytes_i / min(C * cta_gbps, link_gbps)   (pushed segments only)
//   consumer                c_i = max(c_{i-1}, r_i) + d_i            (the readiness coupling)
//   makespan(C)             max(ceil(n_total / P) * t, c_last)
// with link_gbps the lower of the calibrated ceiling and the call's link where it has one (ModelWithLink), so that a
// call over a slower link gets more consumers only while C * cta_gbps is below the link's rate.
// The recurrence unrolls to c_last = max over pushed j of (r_j + d_j + ... + d_last), which is what is evaluated:
//   term_j = r_j + (pushed segments from j on) * seg_us + (their bytes) * (1e-3 / rate)
// Each term is independent of the others, so a CTA evaluates all (C, j) pairs in parallel and reduces with max
// (exact, order-free): the device and the host compute bit-identical makespans. Device code uses
// the explicitly rounded __dmul_rn/__dadd_rn so that nvcc cannot contract a multiply-add into an FMA (which would
// round differently from the host and could flip a near-tie).
#pragma once

#include <math.h>
#include <stdint.h>

#include "jax_moe_overlap/protocol.h"  // kSrcBlockRows: the pushers' blocks

#ifdef __CUDACC__
#define JMO_RM_HD __host__ __device__
#else
#define JMO_RM_HD
#endif

namespace jmo {

// Calibrated constants of one GPU + producer variant (benchmarks/calibrate.py measures them; nothing here is a guess).
struct ModelParams {
  int32_t sms;            // multiprocessors available to the rank (the kernels use the rank's SM budget)
  int32_t ctas_per_sm;    // resident producer CTAs per SM (occupancy API on the compiled kernel)
  int32_t tile_m;         // BM: rows per producer tile
  int32_t tile_n;         // BN: columns per producer tile
  double tile_us_base;    // per-tile time = tile_us_base + tile_us_per_k * K
  double tile_us_per_k;
  double cta_gbps;        // push bandwidth of one consumer CTA while the producer runs (GB/s = bytes/ns; calibrate.py)
  double link_gbps;       // ceiling of the destination link(s)
  double seg_us;          // fixed cost per pushed segment (flag poll, arrival signal)
  // Push bandwidth of one dispatch_gemm pushing CTA while the GEMM runs on the others (GB/s; calibrate.py's
  // pusher_gbps, docs/performance.md). 0: not calibrated (the pushers' count is then the fixed rule, DefaultPushers).
  double pusher_gbps;
  // Memory traffic of one gather_rs consumer CTA while the GEMM runs on the others (GB/s of the traffic a_s that
  // GatherMakespanFromSources counts; calibrate.py's gather_gbps). 0: not calibrated (the gather consumer's rate is
  // then 2 cta_gbps: GatherTrafficGbpsPerCta).
  double gather_gbps;
};

// The model of a call whose pushes to other ranks cross a link of `link_gbps` (CallOptions::emulated_link_gbps; 0:
// none): the link ceiling is the lower of the calibrated one and it. Used by every launch that evaluates the model,
// and by the host mirrors, so that both see the same constants.
JMO_RM_HD inline ModelParams ModelWithLink(ModelParams p, double link_gbps) {
  if (link_gbps > 0.0 && link_gbps < p.link_gbps) p.link_gbps = link_gbps;
  return p;
}

struct ModelSegment {
  int32_t rows;
  int32_t remote;  // 1: the consumer pushes the rows (to another rank); 0: they need no push
  // The rows whose tiles the producer finishes at this segment, in producer order: -1, its own (each segment tiled
  // apart, the segment table's order). expert_combine's expert-major producer tiles an expert's rows as one range
  // (cuda/ops/expert_producer.cuh UseExpertMajor): its first segment carries the expert's rows and the others 0, so
  // every segment of the expert is ready once the expert's tiles are.
  int32_t tile_rows = -1;
};

// What the terms need of segment j (in producer order), independent of C: tiles up to and including j, and the
// pushed segments and bytes from j to the end.
struct ModelPrefix {
  int64_t cum_tiles;
  int64_t pushed_from;  // pushed segments j..last (including j)
  int64_t bytes_from;   // their bytes (exact: an integer below 2^53 as a double)
};

// Per-C constants of the terms.
struct ModelEval {
  int64_t producers;
  double tile_us;
  double seg_us;
  double us_per_byte;  // 1e-3 / min(C * cta_gbps, link_gbps)
};

// (32-bit division when both fit: the same integer, several times cheaper on the device.)
JMO_RM_HD inline int64_t CeilDiv(int64_t a, int64_t b) {
  if (a >= 0 && b > 0 && a <= 0x3fffffff && b <= 0x3fffffff)
    return (int64_t)(((uint32_t)a + (uint32_t)b - 1u) / (uint32_t)b);
  return (a + b - 1) / b;
}

JMO_RM_HD inline double RmMul(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
JMO_RM_HD inline double RmAdd(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
JMO_RM_HD inline double RmMax(double a, double b) { return a > b ? a : b; }

// Tiles of one segment.
JMO_RM_HD inline int64_t ModelTiles(const ModelParams& p, int64_t rows, int64_t N) {
  return rows <= 0 ? 0 : CeilDiv(rows, p.tile_m) * CeilDiv(N, p.tile_n);
}

// The per-C constants; C must be feasible (ModelFeasible).
JMO_RM_HD inline bool ModelFeasible(const ModelParams& p, int consumer_ctas) {
  return consumer_ctas >= 1 && consumer_ctas < p.sms;
}
// 1e-3 / min(C cta_gbps, link_gbps): microseconds per pushed byte (a correctly rounded division on host and device,
// so the kernel may take it from the host: resource_manager.cuh CandidateConsts).
JMO_RM_HD inline double ModelUsPerByte(const ModelParams& p, int consumer_ctas) {
  double rate = RmMul((double)consumer_ctas, p.cta_gbps);  // bytes per ns
  if (rate > p.link_gbps) rate = p.link_gbps;
  return 1e-3 / rate;
}
JMO_RM_HD inline ModelEval ModelEvalWith(const ModelParams& p, int64_t K, int consumer_ctas, double us_per_byte) {
  ModelEval e;
  e.producers = (int64_t)(p.sms - consumer_ctas) * p.ctas_per_sm;
  e.tile_us = RmAdd(p.tile_us_base, RmMul(p.tile_us_per_k, (double)K));
  e.us_per_byte = us_per_byte;
  e.seg_us = p.seg_us;
  return e;
}
JMO_RM_HD inline ModelEval ModelEvalFor(const ModelParams& p, int64_t K, int consumer_ctas) {
  return ModelEvalWith(p, K, consumer_ctas, ModelUsPerByte(p, consumer_ctas));
}

// r_j + the pushes of segments j..last.
JMO_RM_HD inline double ModelTermUs(const ModelEval& e, const ModelPrefix& s) {
  const double ready = RmMul((double)CeilDiv(s.cum_tiles, e.producers), e.tile_us);
  return RmAdd(ready, RmAdd(RmMul((double)s.pushed_from, e.seg_us), RmMul((double)s.bytes_from, e.us_per_byte)));
}

JMO_RM_HD inline double ModelProducerUs(const ModelEval& e, int64_t total_tiles) {
  return RmMul((double)CeilDiv(total_tiles, e.producers), e.tile_us);
}

// Fills pre[] for the pushed, non-empty segments (in order) and returns how many; *total_tiles gets all tiles.
JMO_RM_HD inline int ModelPrefixes(const ModelParams& p, const ModelSegment* segs, int n, int64_t N,
                                   int64_t elem_bytes, ModelPrefix* pre, int64_t* total_tiles) {
  int64_t cum = 0, pushed = 0, bytes = 0;
  int m = 0;
  for (int i = 0; i < n; ++i) {
    if (segs[i].rows <= 0) continue;
    cum += ModelTiles(p, segs[i].tile_rows < 0 ? segs[i].rows : segs[i].tile_rows, N);
    if (!segs[i].remote) continue;
    pre[m].cum_tiles = cum;
    pre[m].pushed_from = pushed;                          // pushed before j, turned into "from j" below
    pre[m].bytes_from = bytes;
    ++pushed;
    bytes += (int64_t)segs[i].rows * N * elem_bytes;
    ++m;
  }
  for (int j = 0; j < m; ++j) {
    pre[j].pushed_from = pushed - pre[j].pushed_from;
    pre[j].bytes_from = bytes - pre[j].bytes_from;
  }
  *total_tiles = cum;
  return m;
}

// Modelled makespan from prepared prefixes; negative when C is infeasible.
JMO_RM_HD inline double ModelMakespanFromPrefixes(const ModelParams& p, const ModelPrefix* pre, int m,
                                                  int64_t total_tiles, int64_t K, int consumer_ctas) {
  if (!ModelFeasible(p, consumer_ctas)) return -1.0;
  const ModelEval e = ModelEvalFor(p, K, consumer_ctas);
  double us = ModelProducerUs(e, total_tiles);
  for (int j = 0; j < m; ++j) us = RmMax(us, ModelTermUs(e, pre[j]));
  return us;
}

// The K at which the model (its tile time the bf16 wgmma engine's per K, calibrated on it) times an e4m3 tile of K:
// the FP8 grouped GEMM runs a tile of the same shape 1.45-1.68x as fast as the bf16 one (docs/performance.md, "FP8
// grouped GEMM"), so its K counts two thirds. The one rule for every FP8 call the model sizes (dispatch_gemm's
// pushers, expert_combine's consumers) until the model has an FP8 calibration of its own.
JMO_RM_HD constexpr int64_t Fp8ModelK(int64_t K) { return K * 2 / 3; }

// The largest C the manager considers on a rank with `budget` CTAs: min(32, budget - 1) (one warp of candidates).
constexpr int kMaxModelCtas = 32;
JMO_RM_HD inline int ModelMaxCtas(int budget) { return budget - 1 < kMaxModelCtas ? budget - 1 : kMaxModelCtas; }

// Modelled makespan in microseconds; a negative value means C is infeasible (C < 1 or no SM left to produce).
// `scratch` holds n entries.
JMO_RM_HD inline double ModelMakespanUs(const ModelParams& p, const ModelSegment* segs, int n, int64_t N, int64_t K,
                                        int64_t elem_bytes, int consumer_ctas, ModelPrefix* scratch) {
  int64_t total = 0;
  const int m = ModelPrefixes(p, segs, n, N, elem_bytes, scratch, &total);
  return ModelMakespanFromPrefixes(p, scratch, m, total, K, consumer_ctas);
}

// The count c in [1, min(max_count, sms - 1)] with the smallest modelled time us(c) (the smallest such c on ties;
// us(c) < 0: infeasible, skipped; c = 1 must be feasible). Every choice of the model takes its count by it.
template <class F>
JMO_RM_HD inline int ModelArgmin(const ModelParams& p, int max_count, F us) {
  if (max_count > p.sms - 1) max_count = p.sms - 1;
  int best = 1;
  double best_us = us(1);
  for (int c = 2; c <= max_count; ++c) {
    const double v = us(c);
    if (v >= 0.0 && v < best_us) {
      best_us = v;
      best = c;
    }
  }
  return best;
}

// The C in [1, min(max_ctas, sms - 1)] with the smallest modelled makespan (the smallest such C on ties).
JMO_RM_HD inline int ChooseConsumerCtasFromPrefixes(const ModelParams& p, const ModelPrefix* pre, int m,
                                                    int64_t total_tiles, int64_t K, int max_ctas) {
  return ModelArgmin(p, max_ctas, [&](int c) { return ModelMakespanFromPrefixes(p, pre, m, total_tiles, K, c); });
}

JMO_RM_HD inline int ChooseConsumerCtas(const ModelParams& p, const ModelSegment* segs, int n, int64_t N, int64_t K,
                                        int64_t elem_bytes, int max_ctas, ModelPrefix* scratch) {
  int64_t total = 0;
  const int m = ModelPrefixes(p, segs, n, N, elem_bytes, scratch, &total);
  return ChooseConsumerCtasFromPrefixes(p, scratch, m, total, K, max_ctas);
}

// ---------------------------------------------------------------------------------------------------------------------
// gather_rs's consumer CTAs C (GEMM2 + GatherRS, gather_consumer.cuh): the same producer, in the same order, with
// another consumer. Every source s of the group (R of them, this rank too) gets a float32 partial of its T tokens,
// which the consumer reduces here (per token, its Q slots' rows here times their gates) and stores into slice `rank`
// of s's ret rows, once every band of s's segments is flagged; a source with no row here gets zeros, ready at once.
// In the consumer's order (the sources with no row here first, by index; then the others in producer order: remote,
// the most rows first, this rank last):
//   ready          r_s = ceil((n_1 + ... + n_last(s)) / P) * t      (tiles up to s's last segment; 0: no row here)
//   traffic        a_s = T N 4 + T Q 4 + rows_s (N eb + 4)          (the partial stored; its token_rows, its rows here
//                                                                     and their gates read)
//   link bytes     l_s = T N 4 if s is another rank, else 0          (the partial crosses the link; its own stays)
//   work           d_s = seg_us + max(a_s * 1e-3 / (C g), l_s * 1e-3 / link_gbps)
//   consumer       c_s = max(c_{s-1}, r_s) + d_s
//   makespan(C)    max(ceil(n_total / P) * t, c_last)
// g is one consumer CTA's traffic rate beside the GEMM (GatherTrafficGbpsPerCta): the calibrated gather_gbps (the
// gather consumer's own loads and stores, measured as this model counts them), else 2 cta_gbps (cta_gbps is a bulk-copy
// consumer CTA's rate beside the GEMM, each byte read once and stored once: 2 cta_gbps bytes of traffic per ns).
// The link carries only the partials for other ranks. The recurrence unrolls as the combine's, c_last = max over
// s of (r_s + d_s + ... + d_last), evaluated per C by one reverse pass over the R sources (GatherMakespanFromSources):
// the same operations in the same order on the host and on the device (resource_manager.cuh
// DeviceChooseGatherConsumers: one lane per C), so both get the same doubles and the same C.

// One segment of the call in producer order, as gather_rs's model takes it: its rows and its source.
struct GatherModelSegment {
  int32_t rows;
  int32_t src;
};

// One source of the group in the consumer's order: what its terms need, independent of C.
struct GatherModelSource {
  int64_t cum_tiles;  // tiles up to its last segment in producer order (0: no row here)
  int64_t rows;       // its rows here
  int32_t src;
  int32_t remote;     // 1: another rank (its partial crosses the link)
};

// The call's shape as the consumer's work depends on it.
struct GatherModelShape {
  int64_t T;           // tokens of every source
  int64_t Q;           // slots per token (k TP)
  int64_t N;           // the GEMM's N (columns of a row and of a partial)
  int64_t K;           // the GEMM's K
  int64_t elem_bytes;  // of the GEMM's rows
};

// The sources in the consumer's order (gather_consumer.cuh OrderGatherSources) from the non-empty segments of the
// call in producer order (a source's segments are consecutive there: SegmentBefore orders by source first); out holds
// `ranks` entries. Returns the tiles of all segments, or -1 where the segments are not such a list (a source out of
// [0, ranks), or its segments apart). The device builds the same integers in parallel (resource_manager.cuh).
JMO_RM_HD inline int64_t GatherModelSources(const ModelParams& p, const GatherModelSegment* segs, int n, int ranks,
                                            int rank, int64_t N, GatherModelSource* out) {
  uint32_t has_rows = 0;
  for (int i = 0; i < n; ++i) {
    if (segs[i].src < 0 || segs[i].src >= ranks || segs[i].src >= 32) return -1;
    if (segs[i].rows > 0) has_rows |= 1u << segs[i].src;
  }
  int m = 0;
  for (int s = 0; s < ranks; ++s)
    if (!((has_rows >> s) & 1u)) out[m++] = GatherModelSource{0, 0, s, s != rank ? 1 : 0};
  const int first_with_rows = m;
  uint32_t seen = 0;
  int64_t cum = 0;
  for (int i = 0; i < n; ++i) {
    const GatherModelSegment& g = segs[i];
    if (g.rows <= 0) continue;
    cum += ModelTiles(p, g.rows, N);
    if (m > first_with_rows && out[m - 1].src == g.src) {
      out[m - 1].cum_tiles = cum;
      out[m - 1].rows += g.rows;
      continue;
    }
    if ((seen >> g.src) & 1u) return -1;  // the source's segments are apart
    seen |= 1u << g.src;
    out[m++] = GatherModelSource{cum, g.rows, g.src, g.src != rank ? 1 : 0};
  }
  return cum;
}

// The traffic a_s of one source with `rows` rows here, in bytes: its partial stored (T N float32), its token_rows
// read (T Q int32), its rows here and their gates read (N elements + a float32 gate each).
JMO_RM_HD inline int64_t GatherSourceTraffic(const GatherModelShape& sh, int64_t rows) {
  return sh.T * sh.N * 4 + sh.T * sh.Q * 4 + rows * (sh.N * sh.elem_bytes + 4);
}

// The traffic of all the call's sources (GatherModelSources' m entries): what gather_gbps is measured against.
JMO_RM_HD inline int64_t GatherModelTraffic(const GatherModelSource* src, int m, const GatherModelShape& sh) {
  int64_t bytes = 0;
  for (int j = 0; j < m; ++j) bytes += GatherSourceTraffic(sh, src[j].rows);
  return bytes;
}

// g: one consumer CTA's traffic rate beside the GEMM in bytes per ns (the calibrated gather_gbps, else 2 cta_gbps).
JMO_RM_HD inline double GatherTrafficGbpsPerCta(const ModelParams& p) {
  return p.gather_gbps > 0.0 ? p.gather_gbps : RmMul(2.0, p.cta_gbps);
}

// Modelled time of a gather_rs call with C consumer CTAs in microseconds from its sources in the consumer's order
// (GatherModelSources); negative when C is infeasible.
JMO_RM_HD inline double GatherMakespanFromSources(const ModelParams& p, const GatherModelSource* src, int m,
                                                  int64_t total_tiles, const GatherModelShape& sh,
                                                  int consumer_ctas) {
  if (!ModelFeasible(p, consumer_ctas)) return -1.0;
  const int64_t producers = (int64_t)(p.sms - consumer_ctas) * p.ctas_per_sm;
  const double tile_us = RmAdd(p.tile_us_base, RmMul(p.tile_us_per_k, (double)sh.K));
  // (IEEE division: the same doubles on host and device.)
  const double us_per_traffic = 1e-3 / RmMul((double)consumer_ctas, GatherTrafficGbpsPerCta(p));
  const double us_per_link_byte = 1e-3 / p.link_gbps;
  const int64_t partial = sh.T * sh.N * 4;
  double us = RmMul((double)CeilDiv(total_tiles, producers), tile_us);
  double rest = 0.0;  // d_j + ... + d_last
  for (int j = m - 1; j >= 0; --j) {
    const double traffic = (double)GatherSourceTraffic(sh, src[j].rows);
    const double link = src[j].remote ? (double)partial : 0.0;
    rest = RmAdd(rest, RmAdd(p.seg_us, RmMax(RmMul(traffic, us_per_traffic), RmMul(link, us_per_link_byte))));
    const double ready = RmMul((double)CeilDiv(src[j].cum_tiles, producers), tile_us);
    us = RmMax(us, RmAdd(ready, rest));
  }
  return us;
}

// The C in [1, min(max_ctas, sms - 1)] with the smallest modelled time (the smallest such C on ties).
JMO_RM_HD inline int ChooseGatherConsumerCtasFromSources(const ModelParams& p, const GatherModelSource* src, int m,
                                                         int64_t total_tiles, const GatherModelShape& sh,
                                                         int max_ctas) {
  return ModelArgmin(p, max_ctas, [&](int c) { return GatherMakespanFromSources(p, src, m, total_tiles, sh, c); });
}

// ---------------------------------------------------------------------------------------------------------------------
// dispatch_gemm's pushing CTAs P (the dispatch side of the same model). P CTAs push this rank's rows for the other
// ranks at min(P * pusher_gbps, link_gbps), then join the GEMM; the other SMs start on the GEMM at once (the tiles
// of the rank's own rows first, then the others as they arrive). With
//   push(P)     = seg_us + push_bytes / min(P * pusher_gbps, link_gbps)       (0 without rows to push)
//   work(P)     = ceil((n * t + P * push(P)) / (sms * t)) * t                 (the GEMM's n tiles of time t and the
//                                                                               pushers' time, on every SM, in waves)
//   ready(P)    = push(P) + ceil(n_round / sms) * t                           (the tiles of the last round's rows, at
//                                                                               least one wave)
//   lag(P)      = max(0, (push(P) - seg_us) / rounds - t)                     (a round's push beyond one tile time)
//   makespan(P) = max(work(P), ready(P)) + lag(P)
// The pushers move one 128-row block of every destination's rows per round (dispatch_gemm.cu), so a receiver's rows
// arrive round by round, one block per source, and the GEMM's tiles of the last round (n_round: the tiles of
// round_rows rows, a round's share of the pushed rows) can start only once the push is over. With few rounds (few
// rows per destination: many ranks, or few tokens) that tail is a large part of the remote work, and more pushers
// shorten it. And the GEMM's remote tiles trail the arrivals by a round: a 128-row block is signalled only once all of
// it has landed and its tiles wait for that, so each round's rows show up a round's push after they started; a round
// that lands within one tile time is covered by the tiles in flight and the look-ahead, a longer one costs its excess
// (lag: with few rounds, EP = 8 at 2048 tokens per rank, one pusher's round is ~6 tile times). Below the link's rate
// P * push(P) is push_bytes / pusher_gbps whatever P is, so more pushers cost the GEMM only their start and what they
// take above the link. The choice is the smallest P with the smallest makespan.
// Rows arrive as the sources push them (every rank pushes at once, in the order the GEMM takes them), so the own rows
// and the earlier rounds keep the GEMM's SMs busy whenever the end points do. The pushed rows stand for the received
// ones (symmetric routing): the rank's pushers are what P sizes.
struct PusherInputs {
  int64_t push_bytes;  // bytes this rank pushes to the other ranks (its rows for them x row bytes)
  int64_t gemm_rows;   // rows of the GEMM (the rows this rank receives, its own included)
  int64_t K;           // the GEMM's K (d_model)
  int64_t N;           // the GEMM's N (columns of the product; 2F with the SwiGLU epilogue)
  int64_t round_rows;  // rows pushed per round: the pushed rows / the pushers' rounds (PusherInputsFromPlan)
  int64_t rounds;      // the pushers' rounds (the most 128-row send blocks of one destination); 0: no lag term
};

// The inputs of one call from its plan: send_start [ranks + 1] (the first send position of each destination's rows;
// the pushers' block J of destination d holds send positions [128 J, 128 J + 128) within d's range, so d's rows take
// the blocks from send_start[d] / 128 to (send_start[d + 1] - 1) / 128 and the rounds are the most blocks of one
// destination), the rows this rank receives, the row bytes, K and N.
JMO_RM_HD inline PusherInputs PusherInputsFromPlan(const int32_t* send_start, int rank, int ranks, int64_t recv_rows,
                                                   int64_t row_bytes, int64_t K, int64_t N) {
  int64_t rows = 0, rounds = 0;
  for (int d = 0; d < ranks; ++d) {
    const int64_t q0 = send_start[d], q1 = send_start[d + 1];
    if (d == rank || q1 <= q0) continue;
    rows += q1 - q0;
    const int64_t blocks = (q1 - 1) / kSrcBlockRows + 1 - q0 / kSrcBlockRows;
    if (blocks > rounds) rounds = blocks;
  }
  return PusherInputs{rows * row_bytes, recv_rows > 0 ? recv_rows : 0, K, N, rounds > 0 ? CeilDiv(rows, rounds) : 0,
                      rounds};
}

// The largest P the model considers on a rank of `budget` CTAs: min(32, budget - 1) (one warp of candidates).
JMO_RM_HD inline int PusherMaxCtas(int budget) { return ModelMaxCtas(budget); }

// Modelled time of dispatch_gemm with P pushing CTAs in microseconds; negative when P is infeasible or the model has
// no pusher rate.
JMO_RM_HD inline double PushersMakespanUs(const ModelParams& p, const PusherInputs& in, int pushers) {
  if (pushers < 1 || pushers >= p.sms || !(p.pusher_gbps > 0.0)) return -1.0;
  const double t = RmAdd(p.tile_us_base, RmMul(p.tile_us_per_k, (double)in.K));
  const double tiles = (double)ModelTiles(p, in.gemm_rows, in.N);
  double push = 0.0;
  if (in.push_bytes > 0) {
    double rate = RmMul((double)pushers, p.pusher_gbps);  // bytes per ns
    if (rate > p.link_gbps) rate = p.link_gbps;
    push = RmAdd(p.seg_us, RmMul((double)in.push_bytes, 1e-3 / rate));
  }
  // (IEEE division and ceil are correctly rounded on host and device: the same doubles.)
  const double waves = ceil(RmAdd(tiles, RmMul((double)pushers, push) / t) / (double)p.sms);
  const double work = RmMul(waves, t);
  const int64_t tail_waves = CeilDiv(ModelTiles(p, in.round_rows, in.N), p.sms);
  const double ready = RmAdd(push, RmMul((double)(tail_waves > 1 ? tail_waves : 1), t));
  if (!(in.push_bytes > 0)) return work;
  const double round = in.rounds > 0 ? RmAdd(push, -p.seg_us) / (double)in.rounds : 0.0;
  return RmAdd(RmMax(work, ready), RmMax(RmAdd(round, -t), 0.0));
}

// The P in [1, min(max_pushers, sms - 1)] with the smallest modelled time (the smallest such P on ties); 0 when the
// model has no pusher rate (the caller then uses DefaultPushers).
JMO_RM_HD inline int ChooseDispatchPushers(const ModelParams& p, const PusherInputs& in, int max_pushers) {
  if (!(p.pusher_gbps > 0.0) || p.sms < 2) return 0;
  return ModelArgmin(p, max_pushers, [&](int q) { return PushersMakespanUs(p, in, q); });
}

}  // namespace jmo
