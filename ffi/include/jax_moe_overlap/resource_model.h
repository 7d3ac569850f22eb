// The analytical resource manager (DESIGN §5; seed: "Analytical Resource Management for Fine-grained MoE
// Computation-Communication Overlap"): a wave-quantized model of one expert_combine call, and the choice of the
// consumer's CTA count C that minimises it. Host and device callable, no allocation, so that a kernel can evaluate
// it from the real routed counts at start without a host sync. Python mirror: jax_moe_overlap/resource.py.
//
// Model of one call with C consumer CTAs (each on its own SM):
//   producer CTAs resident  P = (sms - C) * ctas_per_sm            (occupancy of the compiled GEMM kernel)
//   tiles of segment i      n_i = ceil(rows_i / BM) * ceil(N / BN)  (segments in producer order, remote first)
//   tile time               t = tile_us_base + tile_us_per_k * K     (calibrated per GPU and kernel variant)
//   segment i ready         r_i = ceil((n_1 + ... + n_i) / P) * t    (its last tile finishes with the wave holding it)
//   consumer                c_i = max(c_{i-1}, r_i) + seg_us + bytes_i / min(C * cta_gbps, link_gbps)
//                           (remote segments only: the readiness coupling)
//   makespan(C)             max(ceil(n_total / P) * t, c_last)
#pragma once

#include <stdint.h>

#ifdef __CUDACC__
#define JMO_RM_HD __host__ __device__
#else
#define JMO_RM_HD
#endif

namespace jmo {

// Calibrated constants of one GPU + producer variant (benchmarks/ measures them; nothing here is a guess).
struct ModelParams {
  int32_t sms;            // multiprocessors of the device
  int32_t ctas_per_sm;    // resident producer CTAs per SM (occupancy API on the compiled kernel)
  int32_t tile_m;         // BM: rows per producer tile
  int32_t tile_n;         // BN: columns per producer tile
  double tile_us_base;    // per-tile time = tile_us_base + tile_us_per_k * K
  double tile_us_per_k;
  double cta_gbps;        // push bandwidth of one consumer CTA (GB/s = bytes/ns)
  double link_gbps;       // ceiling of the destination link(s)
  double seg_us;          // fixed cost per pushed segment (flag poll, arrival signal)
};

struct ModelSegment {
  int32_t rows;
  int32_t remote;  // 1: the rows travel to another rank; 0: stay local
};

JMO_RM_HD inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Modelled makespan in microseconds; a negative value means C is infeasible (C < 1 or no SM left to produce).
JMO_RM_HD inline double ModelMakespanUs(const ModelParams& p, const ModelSegment* segs, int n, int64_t N, int64_t K,
                                        int64_t elem_bytes, int consumer_ctas) {
  if (consumer_ctas < 1 || consumer_ctas >= p.sms) return -1.0;
  const int64_t producers = (int64_t)(p.sms - consumer_ctas) * p.ctas_per_sm;
  const int64_t col_tiles = CeilDiv(N, p.tile_n);
  const double tile_us = p.tile_us_base + p.tile_us_per_k * (double)K;
  double rate = consumer_ctas * p.cta_gbps;  // bytes per ns
  if (rate > p.link_gbps) rate = p.link_gbps;
  int64_t cum_tiles = 0;
  double consumer_us = 0.0;
  for (int i = 0; i < n; ++i) {
    if (segs[i].rows <= 0) continue;
    cum_tiles += CeilDiv(segs[i].rows, p.tile_m) * col_tiles;
    if (!segs[i].remote) continue;
    const double ready_us = (double)CeilDiv(cum_tiles, producers) * tile_us;
    const double bytes = (double)segs[i].rows * (double)N * (double)elem_bytes;
    const double start = consumer_us > ready_us ? consumer_us : ready_us;
    consumer_us = start + p.seg_us + bytes / rate * 1e-3;  // bytes / (bytes/ns) = ns -> us
  }
  const double producer_us = (double)CeilDiv(cum_tiles, producers) * tile_us;
  return producer_us > consumer_us ? producer_us : consumer_us;
}

// The C in [1, max_ctas] with the smallest modelled makespan (the smallest such C on ties).
JMO_RM_HD inline int ChooseConsumerCtas(const ModelParams& p, const ModelSegment* segs, int n, int64_t N, int64_t K,
                                        int64_t elem_bytes, int max_ctas) {
  if (max_ctas > p.sms - 1) max_ctas = p.sms - 1;
  int best = 1;
  double best_us = ModelMakespanUs(p, segs, n, N, K, elem_bytes, 1);
  for (int c = 2; c <= max_ctas; ++c) {
    const double us = ModelMakespanUs(p, segs, n, N, K, elem_bytes, c);
    if (us >= 0.0 && us < best_us) {
      best_us = us;
      best = c;
    }
  }
  return best;
}

}  // namespace jmo
