// Microbenchmark of the resource manager's device-side choice of the consumer CTA count (not part of the library).
#pragma once

#include <cstdint>

#include "cuda/api.h"

namespace jmo::tools {

// One CTA on c's device, on c's stream (synchronizes): loads this call's plan arrays and builds the segment table as
// ExpertKernel does under the model (with the choice's prepared parts), then evaluates the workspace's model (with
// c.opts' link) `iters` times by the prepared choice ExpertKernel runs. Reports the nanoseconds of one table build (the
// loads included), of one decision (the candidates' FP64 loop and the argmin), and the choice. gather_tokens > 0:
// the decision of a gather_rs call of gather_tokens tokens per rank and gather_slots slots per token
// (DeviceChooseGatherConsumersPrepared; the choice as GatherConsumersOfCall's, the workspace's fixed C where no band
// goes to another rank), else expert_combine's (DeviceChooseConsumersPrepared).
cuda::Status MeasureDecision(const cuda::CallSite& c, const int32_t* seg_rows, const int32_t* seg_ret_off,
                             int64_t E_l, int64_t cap, int64_t K, int64_t N, DType dt, int iters,
                             double* table_ns, double* decision_ns, int* choice, int64_t gather_tokens = 0,
                             int64_t gather_slots = 0);

}  // namespace jmo::tools
