// Loopback test harness: R ranks of the real kernels on ONE GPU, concurrently (one host thread, one stream and one
// workspace block per rank, the SMs split between the ranks), so the multi-rank protocol runs without several GPUs.
// Every call's outputs are checked: the first call on each data set against a float32 host reference (exact for
// dispatch, relative error for expert_combine), every later call bit-for-bit against the first (the kernels are
// deterministic). Outputs are poisoned before every call, so unwritten rows show.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "jax_moe_overlap/resource_model.h"

namespace jmo::cuda {

struct LoopbackConfig {
  int ranks = 2;
  int tokens = 128;        // per rank
  int top_k = 2;
  int experts = 8;         // total, divisible by ranks
  int d_model = 128;       // dispatch row width
  int k_dim = 200;         // expert_combine K
  int n_dim = 136;         // expert_combine N
  int iters = 20;          // iterations of (dispatch, expert_combine): 2 epochs each
  int routing = 0;         // 0 balanced, 1 skewed (Zipf with exponent `zipf`), 2 extreme skew (every token's first
                           // choice = expert 0), 3 exact round robin (slot p -> expert p mod E: equal segments),
                           // 4 next rank (rank r's slots round robin over rank r+1's experts: every row is pushed)
  double zipf = 1.0;       // routing 1: expert e has weight 1 / (1 + e)^zipf
  double capacity_factor = 0;  // 0: dropless, else rows per expert = ceil(cf * T * R * k / E)
  bool f32 = false;        // float32 operands (SIMT producer) instead of bfloat16 (tensor cores)
  bool transpose_rhs = false;  // expert_combine's w stored [E_l, N, K] and read transposed in place (the backward
                               // pass's layout); the reference is the same product
  int delay_rank = -1;     // this rank is held back delay_us at the start of every call
  int64_t delay_us = 0;
  int timeout_at = -1;     // at this iteration the last rank skips its dispatch: the others must time out, the next
                           // call of every rank must report it, and the calls after it must be correct again
  int64_t timeout_ms = 5000;
  int64_t short_timeout_ms = 200;
  int datasets = 3;
  uint64_t seed = 1;
  int consumers = 2;       // consumer CTAs per rank, per call (CallOptions::consumer_ctas; 0: the manager's choice)
  bool serialize = false;  // CallOptions::serialize for every expert_combine
  bool has_model = false;  // the workspace gets `model` (else the manager's fixed fallback C = SMs / 8)
  ModelParams model{};
  int sm_budget = 0;       // CTAs per rank (0: SMs / ranks)
  int device = 0;
  // Timing (after the checked iterations, on data set 0; outputs compared bit for bit with the checked call after
  // every variant): for each C of `sweep` (or just `consumers` when empty), then the manager (C = 0) and the manager
  // serialized when `sweep` is given, `warmup` calls then `reps` timed calls of expert_combine alone.
  bool time = false;
  std::vector<int> sweep;
  int warmup = 3;
  int reps = 20;
  bool per_call_stats = false;  // synchronize after every timed call and read the device spans (else: the last call)
  int decision_iters = 0;       // > 0: also time the device-side choice (MeasureDecision) on rank 0's plan
  int check_tokens = 0;         // > 0: check the expert_combine reference on about this many tokens per rank only
  // > 0: every dispatch is a dispatch_gemm (DispatchGemm) with this many pushing CTAs, GEMM1 a [cap, K] float32 =
  // x_recv @ w1[expert] (w1 [E_l, D, K] bf16) checked against the host and bit for bit across repeated calls.
  // bf16, D and K multiples of 64, a Hopper GPU.
  int dispatch_gemm_pushers = 0;
};

// One timed variant of RunLoopback (one line of output per variant).
struct TimedVariant {
  int consumers = 0;            // as asked (0: manager)
  bool serialize = false;
  std::vector<int> chosen;      // per rank: C the kernel used (the device's pick for the manager)
  double median_us = 0, mean_us = 0, p10_us = 0, p90_us = 0;  // per call of the whole group
  double prod_span_us = 0, cons_span_us = 0;  // medians over calls (per_call_stats) or of the last call; max over ranks
  double pushed_bytes = 0;      // bytes the consumers of all ranks push per call
  bool identical = true;        // outputs after the variant equal the checked call's, bit for bit
  std::string timeline;         // the median call's per-rank device timeline (us from the earliest BeginKernel)
};

struct LoopbackResult {
  bool pass = false;
  std::string summary;  // one line
  std::string log;      // failures, the reported timeout error
  std::vector<TimedVariant> timed;
  std::vector<std::vector<int32_t>> seg_rows;  // data set 0, per rank: [E_local * R] (for the Python mirror)
  double table_ns = 0, decision_ns = 0;        // MeasureDecision on rank 0 (decision_iters > 0)
  int decision_choice = 0;
  int budget = 0;                              // CTAs per rank
};

LoopbackResult RunLoopback(const LoopbackConfig& cfg);

// Median microseconds of cudaMemcpyAsync device-to-device of `bytes` on `device` (reps timed calls after warm-up).
double CopyCeilingUs(int device, int64_t bytes, int reps);

}  // namespace jmo::cuda
