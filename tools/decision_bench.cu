// The decision microbenchmark: the library's segment table and device-side choice (segment_table.cuh,
// resource_manager.cuh), timed in one CTA with %globaltimer.
#include "decision_bench.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/launch.h"
#include "cuda/schedule/resource_manager.cuh"
#include "cuda/schedule/segment_table.cuh"

namespace jmo::tools {
namespace {

using namespace jmo::cuda;

// The decision microbenchmark: one CTA loads the plan's entries and builds the table as ExpertKernel does under the
// model (with the choice's prepared parts: BuildSegmentsFrom<kPrepTerms> for expert_combine, <kPrepGather> for
// gather_rs), then runs the prepared choice ExpertKernel runs `iters` times. out[0] = table build ns (the plan's loads
// included), out[1] = ns of `iters` decisions, out[2] = the choice (ConsumersOfCall / GatherConsumersOfCall, as the
// kernel calls them).
__global__ void __launch_bounds__(kThreads)
    DecisionBenchKernel(RankDev rd, const int32_t* seg_rows, const int32_t* seg_ret_off, int E_l, int64_t cap,
                        int64_t K, int64_t N, const __grid_constant__ ConsumerConfig pol, GatherModelShape gather,
                        int iters, unsigned long long* out) {
  __shared__ SegTable table;
  __shared__ TableScratch scratch;
  __shared__ ChoiceScratch choice;
  __shared__ unsigned long long t0;
  if (threadIdx.x == 0) t0 = GlobalTimer();
  __syncthreads();
  const PlanEntries plan = LoadPlanEntries(seg_rows, seg_ret_off, E_l, rd.ranks);
  TermPrepOut prep{};
  bool ok;
  if (gather.T > 0) {
    const GatherPrepIn in = GatherPrepFor(pol.cand, gather, rd.rank, &choice);
    ok = BuildSegmentsFrom<kPrepGather>(rd, plan, E_l, cap, &table, &scratch, &in, &prep);
  } else {
    const TermPrepIn in = TermPrepFor(pol.model, pol.cand, N, pol.elem_bytes, &choice);
    ok = BuildSegmentsFrom<kPrepTerms>(rd, plan, E_l, cap, &table, &scratch, &in, &prep);
  }
  if (threadIdx.x == 0) out[0] = GlobalTimer() - t0;
  if (!ok) return;
  __syncthreads();
  if (threadIdx.x == 0) t0 = GlobalTimer();
  __syncthreads();
  int acc = 0;
  for (int i = 0; i < iters; ++i) {
    ModelParams p = pol.model;
    p.seg_us += (double)(i & 1) * 1e-12;  // vary an input so no iteration can be folded into another
    acc += gather.T > 0 ? DeviceChooseGatherConsumersPrepared(table, prep, p, pol.cand, gather, rd.rank, rd.ranks,
                                                              pol.max_ctas, &choice)
                        : DeviceChooseConsumersPrepared(table, prep, p, pol.cand, N, K, pol.elem_bytes, pol.max_ctas,
                                                        &choice, i & 1);
  }
  if (threadIdx.x == 0) out[1] = GlobalTimer() - t0;
  const int final_choice = gather.T > 0 ? GatherConsumersOfCall(table, prep, pol, gather, rd.rank, rd.ranks, &choice)
                                        : ConsumersOfCall(table, prep, pol, N, K, &choice);
  if (threadIdx.x == 0) {
    out[2] = (unsigned long long)final_choice;
    out[3] = (unsigned long long)acc;
  }
}

}  // namespace

using namespace jmo::cuda;

Status MeasureDecision(const CallSite& c, const int32_t* seg_rows, const int32_t* seg_ret_off, int64_t E_l,
                       int64_t cap, int64_t K, int64_t N, DType dt, int iters, double* table_ns, double* decision_ns,
                       int* choice, int64_t gather_tokens, int64_t gather_slots) {
  if (c.ws == nullptr || !c.ws->has_model())
    return Status::Error(kFailedPrecondition, "MeasureDecision needs a workspace with a model");
  if (E_l * c.ws->ranks() > kMaxSegments || iters < 1)
    return Status::Error(kInvalidArgument, "MeasureDecision: too many segments or iters < 1");
  ConsumerConfig pol{};
  pol.use_model = 1;
  pol.model = ModelWithLink(c.ws->model(), c.opts.emulated_link_gbps);  // as the launches (the call's link)
  pol.model.sms = c.ws->budget(c.group, c.rank);
  pol.model.ctas_per_sm = 1;
  pol.max_ctas = ModelMaxCtas(pol.model.sms);
  pol.cand = FillCandidateConsts(pol.model, pol.max_ctas, N);
  pol.elem_bytes = Traits(dt).elem_bytes;
  pol.consumers = gather_tokens > 0 ? std::max(1, std::min(c.ws->consumer_ctas(), pol.model.sms - 1)) : 0;
  const GatherModelShape gather{gather_tokens, gather_slots, N, K, pol.elem_bytes};
  unsigned long long* out = nullptr;
  Status s = CudaStatus(cudaMalloc(&out, 4 * sizeof(unsigned long long)), "cudaMalloc");
  if (!s.ok()) return s;
  DecisionBenchKernel<<<1, kThreads, 0, c.stream>>>(c.ws->Dev(c.group, c.rank), seg_rows, seg_ret_off, (int)E_l, cap,
                                                    K, N, pol, gather, iters, out);
  unsigned long long h[4] = {0, 0, 0, 0};
  s = LaunchError("launch of DecisionBenchKernel");
  if (s.ok()) s = CudaStatus(cudaStreamSynchronize(c.stream), "cudaStreamSynchronize");
  if (s.ok()) s = CudaStatus(cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost), "cudaMemcpy");
  cudaFree(out);
  if (!s.ok()) return s;
  *table_ns = (double)h[0];
  *decision_ns = (double)h[1] / iters;
  *choice = (int)h[2];
  return Status{};
}

}  // namespace jmo::tools
