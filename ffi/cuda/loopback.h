// Loopback test harness: R ranks of the real kernels on ONE GPU, concurrently (one host thread, one stream and one
// workspace block per rank, the SMs split between the ranks), so the multi-rank protocol runs without several GPUs.
// Every call's outputs are checked: the first call on each data set against a float32 host reference (exact for
// dispatch, relative error for expert_combine), every later call bit-for-bit against the first (the kernels are
// deterministic). Outputs are poisoned before every call, so unwritten rows show.
#pragma once

#include <cstdint>
#include <string>

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
  int routing = 0;         // 0 balanced, 1 moderate skew (Zipf), 2 extreme skew (every token's first choice = expert 0)
  double capacity_factor = 0;  // 0: dropless, else rows per expert = ceil(cf * T * R * k / E)
  bool f32 = false;        // float32 operands (SIMT producer) instead of bfloat16 (tensor cores)
  int delay_rank = -1;     // this rank is held back delay_us at the start of every call
  int64_t delay_us = 0;
  int timeout_at = -1;     // at this iteration the last rank skips its dispatch: the others must time out, the next
                           // call of every rank must report it, and the calls after it must be correct again
  int64_t timeout_ms = 5000;
  int64_t short_timeout_ms = 200;
  int datasets = 3;
  uint64_t seed = 1;
  int consumers = 2;       // consumer CTAs per rank
  int sm_budget = 0;       // CTAs per rank (0: SMs / ranks)
  int device = 0;
};

struct LoopbackResult {
  bool pass = false;
  std::string summary;  // one line
  std::string log;      // failures, the reported timeout error
};

LoopbackResult RunLoopback(const LoopbackConfig& cfg);

}  // namespace jmo::cuda
