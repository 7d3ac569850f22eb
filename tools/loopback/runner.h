// The loopback runner: R ranks of the library's kernels on ONE GPU, concurrently (one host thread, one stream and one
// workspace block per rank, the SMs split between the ranks), so the multi-rank protocol runs without several GPUs.
//
// It only runs and records: the plans and data come from the caller (tools/loopback/cases.py, plans by
// jax_moe_overlap.plan), and the caller judges what comes back (tools/loopback/check.py). Per call it records a
// digest of every output, and the whole outputs of the first call on each data set; outputs are poisoned (all bits
// set: NaN in bf16 and float32) before every checked call, so rows a kernel fails to write show.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/api.h"
#include "cuda/workspace/workspace.h"
#include "jax_moe_overlap/resource_model.h"

namespace jmo::loopback {

// Host bytes owned by the caller, alive for the whole run.
struct Bytes {
  const void* p = nullptr;
  size_t n = 0;
};

// One rank's operands of one data set, in the layouts of the calls (int32 index arrays, bf16 or float32 values).
struct RankInputs {
  Bytes x;                                      // [T, D] dispatch rows
  Bytes slot_src_row, slot_dest_rank, slot_dest_row, slot_ret_row;  // [P] int32
  int32_t recv_rows = 0, ret_rows = 0;          // rows this rank receives in dispatch / gets back in expert_combine
  Bytes lhs;                                    // [recv_rows, K] expert_combine's input (on the device [cap, K],
                                                // the rows past recv_rows NaN: never read, so a read shows)
  Bytes w;                                      // [E_l, K, N], or [E_l, N, K] with transpose_rhs (fp8: e4m3
                                                // [E_l, N, K], and lhs e4m3 [recv_rows, K])
  Bytes lhs_scales, w_scales;                   // fp8: [K/128, ld] float32 (MN-major, ld >= cap; NaN past
                                                // recv_rows), [E_l, N/128, K/128] float32
  Bytes gates;                                  // [P] float32
  Bytes seg_rows, seg_ret_off;                  // [E_l * R] int32, (expert, source) order
  Bytes send_order, send_start;                 // dispatch_gemm: [P], [R + 1] int32 (plan.py)
  Bytes slot_primary;                           // [P] int32 (send once, plan.py), or empty: one row per slot
  Bytes w1;                                     // dispatch_gemm: [E_l, D, K] bf16 (fp8: e4m3 [E_l, K, D] and x
                                                // packed e4m3 rows [T, D + D / 32])
  Bytes w1_scales;                              // dispatch_gemm fp8: [E_l, K/128, D/128] float32
  Bytes x_recv_q, x_recv_s;                     // dispatch_gemm fp8: the recv rows unpacked (e4m3 [recv_rows, D],
                                                // scales [D/128, ld] MN-major), the two calls' GEMM1 operands
  Bytes expert_rows;                            // [E_l] int32 rows per local expert in recv (the GEMMs' groups)
  Bytes row_gate, token_rows;                   // gather_rs: [cap] float32 gate of each recv row, [R, T, Q] int32
};

struct Variant {  // one timed configuration of expert_combine
  int consumers = 0;  // 0: the manager
  bool serialize = false;
};

struct Spec {
  int ranks = 2, tokens = 128, top_k = 2, experts_per_rank = 4, d_model = 128, k_dim = 200, n_dim = 136;
  int cap = 0;                       // recv rows of every rank (plan.recv_capacity)
  bool f32 = false, transpose_rhs = false;
  bool fp8 = false;                  // expert_combine's producer on e4m3 operands (RankInputs' lhs, w and their
                                     // scales; its rows and outputs bfloat16, or float32 with f32); with
                                     // dispatch_gemm its FP8 form too (packed rows, e4m3 w1; the SwiGLU's h and a
                                     // e4m3, each followed by its scales in the result's buffer)
  int iters = 20;                    // iterations of (dispatch, expert_combine), data set = iteration % data sets
  int timeout_at = -1;               // at this iteration the last rank skips its dispatch (a forced timeout)
  int64_t timeout_ms = 5000, short_timeout_ms = 200;
  int64_t stuck_stream_ms = 0;       // > 0 with timeout_at: before the call that reports the forced timeout, rank
                                     // 0's stream is held this long by a host function (work that the library's
                                     // timeout does not bound): that call of every rank must give up within
                                     // short_timeout_ms (rank 0 on its stream, the others at the recovery barrier)
  int delay_rank = -1;
  int64_t delay_us = 0;
  int consumers = 2;                 // CallOptions::consumer_ctas (0: the manager)
  bool serialize = false;
  ConsumerTuning tuning{};           // CallOptions::tuning of every expert_combine call (the consumer's push)
  bool has_model = false;            // the workspace gets `model` (else the fixed C = SMs / 8)
  ModelParams model{};
  int sm_budget = 0, device = 0;
  int dispatch_gemm_pushers = 0;     // != 0: every dispatch is a DispatchGemm with this many pushing CTAs (> 0), or
                                     // the library's choice (< 0: CallOptions::pushers = 0, the model's P on the
                                     // device where the workspace has a model with a pusher rate, else DefaultPushers)
  int dg_mode = 0;                   // its results: 0 plain (GEMM1 [cap, K] float32, x_recv), 1 training (SwiGLU: h,
                                     // the preactivation and x_recv), 2 inference (SwiGLU: h alone)
  bool dg_out_bf16 = false;          // plain: GEMM1's product rounded once to bf16 (DispatchGemmOut::out_bf16; the
                                     // layer's backward dh), in dispatch_gemm and its two calls alike
  bool row_scale = false;            // every dispatch (and dispatch_gemm, and its two calls) scales slot p's row by
                                     // gates[p] (the calls' row_scale: the backward's gates * dy)
  double emulated_link_gbps = 0;     // CallOptions::emulated_link_gbps of every call (0: pushes at HBM speed)
  int producer_band_m = 0;           // CallOptions::producer_band_m of every call (0: the library's rule)
  int producer_order = 0;            // CallOptions::producer_order of every call (0: the library's rule)
  bool x_recv_from_tiles = false;    // CallOptions::x_recv_from_tiles of every call (dispatch_gemm's x_recv by its tiles)
  bool gather_rs = false;            // GatherRs in expert_combine's place (Q = top_k slots per token); its y, and its
                                     // GEMM rows [cap, N] in the slot output's place
  // Timing, after the checked iterations, on data set 0: expert_combine alone per variant (or, with dispatch_gemm,
  // dispatch + GEMM1 as two calls and as one), `warmup` calls then `reps` timed ones.
  bool time = false;
  std::vector<Variant> variants;
  int warmup = 3, reps = 20;
  bool per_call_stats = false;       // every timed call started together on every rank (its stream drained, a host
                                     // barrier) and timed from its start; expert_combine's also read its device record
  // With dispatch_gemm timing: after its fixed variants, the fused call once per entry as CallOptions::pushers (> 0:
  // pinned P, 0: the library's choice), `warmup` then `reps` timed calls each (the regret sweep of the P choice).
  std::vector<int> dg_sweep;
  // Also time the GEMM alone after the calls: the bare grouped GEMM over the rank's kept rows (M = recv rows: no
  // padding rows zeroed) on its SM budget, all ranks at once: dispatch_gemm's GEMM1 in its mode's form, or
  // expert_combine's GEMM2.
  bool gemm_alone = false;
  int decision_iters = 0;            // > 0: MeasureDecision on rank 0's plan of data set 0
};

struct CallDigest {  // one checked iteration of one rank
  int iter = 0, rank = 0, dataset = 0;
  // Digests of the outputs (a: dispatch_gemm's GEMM1 output, its float32 product or h; pre: its preactivation; 0
  // where the call has no such output).
  uint64_t recv = 0, y = 0, slot = 0, a = 0, pre = 0;
};

struct FirstOutputs {  // the first call of a rank on a data set, whole
  std::vector<char> recv, y, slot, a, pre;
  // dispatch_gemm: the same dispatch + GEMM1 as two calls (Dispatch, then GroupedMatmul or GroupedMatmulSwiGlu).
  std::vector<char> recv2, a2, pre2;
};

struct TimeoutReport {  // the call after the forced timeout, per rank
  bool reported = false;
  int code = 0;
  std::string msg;
  // With stuck_stream_ms: the call made while rank 0's stream was held (it must fail: reported), before the above.
  bool stuck_reported = false;
  int stuck_code = 0;
  std::string stuck_msg;
  double stuck_ms = 0;  // how long it took
};

struct RankTiming {  // one variant, one rank
  std::vector<double> call_us;
  std::vector<cuda::RankPrivate> device;  // per timed call (per_call_stats) or of the last call
  uint64_t y_after = 0;                   // digest of y after the variant's calls
};

struct Result {
  std::vector<std::string> errors;        // host-side failures; the run stops at the first
  int64_t calls = 0;                      // successful dispatch + expert_combine calls (2 per rank and iteration)
  std::vector<CallDigest> digests;
  std::vector<std::vector<FirstOutputs>> first;   // [data set][rank]
  std::vector<TimeoutReport> timeout;             // [rank]
  std::vector<std::vector<RankTiming>> timed;     // [variant][rank]
  std::vector<std::vector<double>> dg_us[3];      // dispatch_gemm timing: [two calls, one launch, the dispatch alone][rank] us per call
  std::vector<cuda::RankPrivate> dg_device;       // [rank]: the timeline of its last timed dispatch_gemm
  std::vector<std::vector<double>> gemm_us;       // [rank]: us per call of the GEMM alone (Spec::gemm_alone)
  int pushers = 0;                                // dispatch_gemm's pushing CTAs per rank as pinned (0: the
                                                  // library's choice per call: the device records say which)
  std::vector<std::vector<std::vector<double>>> dg_sweep_us;  // [Spec::dg_sweep entry][rank]: us per fused call
  std::vector<std::vector<int>> dg_sweep_pushers;             // [entry][rank]: the P its last call used (device)
  double table_ns = 0, decision_ns = 0;
  int decision_choice = 0;
  int budget = 0;                          // CTAs per rank
  std::string producer;                    // GemmEngineName of the case's expert_combine engine
  std::string consumer_policy;             // ConsumerPolicyName of its calls where C is the library's (consumers 0)
  int fixed_consumers = 0;                 // the workspace's fixed C on a rank (min(its C, budget - 1))
  double seconds = 0;
};

// 64-bit digest of n bytes (equal bytes, equal digests; a different output collides with chance 2^-64).
uint64_t Digest(const void* p, size_t n);

// Runs the iterations and the timing of `spec` over `data` ([data set][rank]). Never throws: failures go to errors.
Result RunRanks(const Spec& spec, const std::vector<std::vector<RankInputs>>& data);

// Median microseconds of cudaMemcpyAsync device-to-device of `bytes` on `device` (reps timed calls after warm-up).
double CopyCeilingUs(int device, int64_t bytes, int reps);

}  // namespace jmo::loopback
