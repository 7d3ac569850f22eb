// Begin and End of a call (protocol.h step 0 and the close of a dispatch): one-thread kernels on the caller's stream.
// Epoch state lives in device memory (RankControl::calls, RankPrivate), so no kernel depends on host values that
// change per call, and a call captured into a CUDA graph replays as it ran.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "cuda/launch.h"
#include "cuda/workspace/protocol.cuh"

namespace jmo::cuda {
namespace {

// captured: the call runs inside a CUDA graph (RankPrivate::captured).
__global__ void BeginKernel(RankDev rd, const int32_t* group_op, const int32_t* rank_op, int64_t timeout_ms,
                            int64_t first_call_timeout_ms, int64_t delay_ns, int captured) {
  RankPrivate* p = rd.priv;
  // A CUDA graph replayed after its workspace was released: stop before touching the freed blocks.
  if (LoadVolatile(&p->released) != 0) __trap();
  const uint64_t begin_t = GlobalTimer();
  if (delay_ns > 0) {  // the testing delay: hold this rank back on its device (bounded by itself)
    const uint64_t t0 = GlobalTimer();
    while (GlobalTimer() - t0 < static_cast<uint64_t>(delay_ns)) __nanosleep(1000);
  }
  RankControl* ctl = View(rd, rd.rank).control();
  const uint64_t epoch = LoadVolatile(&ctl->calls.value) + 1;  // only this rank writes `calls`
  *reinterpret_cast<volatile uint64_t*>(&ctl->calls.value) = epoch;
  p->epoch = epoch;
  p->captured = captured ? 1 : 0;
  const int64_t bound_ms = CallWaitBoundMs(timeout_ms, first_call_timeout_ms, epoch);
  p->deadline_ns = GlobalTimer() + static_cast<uint64_t>(bound_ms) * 1000000ull;
  p->timeout_ms = static_cast<uint64_t>(bound_ms);
  p->prod_t0 = p->cons_t0 = p->comb_t0 = ~0ull;
  p->prod_t1 = p->cons_t1 = p->prod_t0_last = p->comb_t1 = p->push_t1 = p->link_t0 = p->link_bytes = 0;
  p->gemm_wait_ns = p->gemm_wait_own_ns = p->gemm_stall_ns[0] = p->gemm_stall_ns[1] = p->ctas = 0;
  p->phase_b_t0 = p->entry_t = ~0ull;
  p->begin_t = begin_t;
  p->combine_done = 0;
  // An abort raised before this call began: do nothing; the next call's host side recovers and reports (inside a
  // CUDA graph there is no such call: stop the device).
  p->failed = LoadVolatile(&rd.shared->abort.value) != 0 ? 1 : 0;
  __threadfence();
  if (p->failed) StopIfCaptured(rd);
  if (rank_op != nullptr && group_op != nullptr && (rank_op[0] != rd.rank || group_op[0] != rd.group))
    ReportBadInput(rd, kBadRankOperands, static_cast<uint64_t>(group_op[0]), rank_op[0],
                   static_cast<uint64_t>(rd.group));
}

__global__ void EndKernel(RankDev rd, const int32_t* expected, int which) { CloseCall(rd, expected[0], which); }

}  // namespace

// Host part of protocol step 0: the options checked (before the epoch: a refusal leaves the group as it was), recover
// from an earlier failure (reported here), then Begin on the device; then the call's footprint is checked (once the
// epoch has begun, so that on a failure the peers give up too). A call being captured into a CUDA graph may not
// synchronize, so it does not recover: it reports the group's failure as recorded and the group stays aborted.
Status BeginCall(const CallSite& c, const char* op, const CallFootprint& need, const int32_t* group_op,
                 const int32_t* rank_op) {
  if (c.ws == nullptr) return Status::Error(kFailedPrecondition, "jax_moe_overlap: no workspace");
  if (c.rank < 0 || c.rank >= c.ws->ranks() || c.group < 0 || c.group >= c.ws->groups())
    return Status::Error(kInvalidArgument, "jax_moe_overlap: rank/group outside the workspace");
  if (std::string bad = CheckOptions(c.opts); !bad.empty())
    return Status::Error(kInvalidArgument, std::string("jax_moe_overlap: ") + op + ": " + bad);
  bool captured = false;
  Status s = StreamCaptured(c.stream, op, &captured);
  if (!s.ok()) return s;
  s = captured ? c.ws->RecordedFailure(c.group, c.rank, op, c.opts.timeout_ms)
               : c.ws->RecoverIfAborted(c.group, c.rank, c.stream, op, c.opts.timeout_ms);
  if (!s.ok()) return s;
  const int64_t delay_ns = (c.opts.delay_rank == c.rank && c.opts.delay_us > 0) ? c.opts.delay_us * 1000 : 0;
  BeginKernel<<<1, 1, 0, c.stream>>>(c.ws->Dev(c.group, c.rank), group_op, rank_op,
                                     std::max<int64_t>(1, c.opts.timeout_ms), c.opts.first_call_timeout_ms, delay_ns,
                                     captured ? 1 : 0);
  s = LaunchError("launch of BeginKernel");
  if (!s.ok()) return s;
  c.opened = true;
  std::string bad = CheckFits(need, c.ws->sizes(), c.ws->ranks(), kMaxSegments);
  return bad.empty() ? s : FailCall(c, op, bad);
}

Status StreamCaptured(cudaStream_t stream, const char* op, bool* captured) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  Status s = CudaStatus(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing");
  if (!s.ok()) {
    cudaGetLastError();  // reported here, not again by a later launch's error check
    return s;
  }
  if (status == cudaStreamCaptureStatusInvalidated)
    return Status::Error(kInternal, std::string("jax_moe_overlap: ") + op +
                                        ": the CUDA graph capture of XLA's stream was invalidated before this call");
  *captured = status == cudaStreamCaptureStatusActive;
  return Status{};
}

Status FailCall(const CallSite& c, const char* op, const std::string& why) {
  c.ws->RaiseAbort(c.group);
  return Status::Error(kInvalidArgument, std::string("jax_moe_overlap: ") + op + ": " + why);
}

Status AbortIfOpened(const CallSite& c, Status s) {
  if (!s.ok() && c.opened) c.ws->RaiseAbort(c.group);
  return s;
}

Status PrepareProtocolKernels(int dev) {
  cudaFuncAttributes attr;
  Status s = CudaStatus(cudaFuncGetAttributes(&attr, (const void*)BeginKernel), "cudaFuncGetAttributes");
  if (s.ok()) s = CudaStatus(cudaFuncGetAttributes(&attr, (const void*)EndKernel), "cudaFuncGetAttributes");
  return s;
}

Status LaunchEnd(const RankDev& rd, cudaStream_t stream, const int32_t* expected, int which) {
  EndKernel<<<1, 1, 0, stream>>>(rd, expected, which);
  return LaunchError("launch of EndKernel");
}

}  // namespace jmo::cuda
