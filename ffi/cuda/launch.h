// Host helpers the kernel files share to launch their kernels (internal to the library: api.h is the interface).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/workspace_fit.h"
#include "cuda/api.h"
#include "cuda/workspace/workspace.h"

namespace jmo::cuda {

// The launch error of the last kernel launch on this thread, if any, as a Status naming `what`.
Status LaunchError(const char* what);

// One empty kernel on `stream`: what a call with nothing to compute launches, so that XLA's trace of it into a CUDA
// graph is not empty (XLA refuses an empty traced graph).
Status LaunchEmpty(cudaStream_t stream);

// How a kernel's dynamic shared memory limit is set on a device: cudaFuncSetAttribute (set_smem = nullptr), or a GEMM
// engine's own preparation, which also checks that the kernel can run there (ops/expert_producer.cuh:
// kWgmmaKernelSetup, the wgmma engine's: a Hopper device, the sm_90a build and the register budget). `name` words
// its errors.
struct KernelSetup {
  const char* name = "cudaFuncSetAttribute";
  cudaError_t (*set_smem)(const void* kernel, int smem_bytes) = nullptr;
};

// Raises `kernel`'s dynamic shared memory limit to `bytes` on the current device, once per (kernel, device): a launch
// need not repeat the host call. `name` words its error.
Status SetKernelSmem(const void* kernel, int bytes, const char* name);

// Dynamic shared memory of a kernel whose CTAs wait on each other and on peers, so every CTA must be resident:
// `need` bytes, at least half an SM's (one CTA per SM). Set on the kernel once per device by `setup` and checked with
// the occupancy API. *smem_bytes = the launch's dynamic shared memory.
Status PrepareOneCtaPerSm(const void* kernel, int threads, int need, const KernelSetup& setup, const char* name,
                          int dev, int* smem_bytes);

// Protocol step 0 on the host: check the call's options (CheckOptions; a refusal before the epoch leaves the group as
// it was), recover from an earlier failure (reported here; a call being captured into a CUDA graph only reports it:
// Workspace::RecordedFailure), then BeginKernel on the device, told whether the call is captured; then check that
// `need` fits the workspace (CheckFits, at most kMaxSegments segments), failing the call as FailCall does if not.
Status BeginCall(const CallSite& c, const char* op, const CallFootprint& need, const int32_t* group_op,
                 const int32_t* rank_op);

// Whether `stream` is being captured into a CUDA graph (XLA's command buffers trace a custom call on a capturing
// stream); an error naming `op` when its capture was already invalidated.
Status StreamCaptured(cudaStream_t stream, const char* op, bool* captured);

// A call refused after BeginCall: raises the group's abort (the peers give up at once instead of waiting for this
// rank's rows) and returns InvalidArgument "jax_moe_overlap: <op>: <why>".
Status FailCall(const CallSite& c, const char* op, const std::string& why);

// The status of a call, with the group's abort raised where it failed after BeginCall opened its epoch (a runtime
// call or a launch of this rank's host that failed: CallSite::opened), as FailCall does for a refusal there: the peers
// then fail at once on the abort word instead of waiting out the timeout for this rank. Not where BeginCall itself
// failed: its report of an earlier call's failure comes after the group's reset, and raising the abort again would
// fail the next call too.
Status AbortIfOpened(const CallSite& c, Status s);

// EndKernel: closes the call (which = 0: a dispatch's recv rows, 1: expert_combine's ret rows).
Status LaunchEnd(const RankDev& rd, cudaStream_t stream, const int32_t* expected, int which);

// The end of a dispatch: RecvKernel (wait for this rank's *expected rows, copy recv -> out [cap rows], zero the rest;
// with rows_in_out the rows are already in out and only the rest is zeroed; with gather, send once: each row copied
// from the recv row its recv_from entry names) on `grid` CTAs, then EndKernel (frees recv for the peers' next call).
Status LaunchRecvAndEnd(const RankDev& rd, int grid, cudaStream_t stream, const int32_t* expected, char* out,
                        int64_t cap, int64_t row_bytes, bool rows_in_out, bool gather);

// Each kernel file loads its kernels on a device (and sets their shared memory): PrepareKernels calls them all.
Status PrepareProtocolKernels(int dev);
Status PrepareDispatchKernels(int dev);
Status PrepareExpertKernels(int dev);
Status PrepareCombineKernels(int dev);
Status PrepareCountsKernels(int dev);
Status PrepareGatherSumKernels(int dev);

// What gather_rs's consumer reads beside expert_combine's operands (device pointers). docs/design.md, "GatherRS".
struct GatherArgs {
  bool active = false;                  // false: expert_combine
  const float* row_gate = nullptr;      // [cap]: the gate of each recv row
  const int32_t* token_rows = nullptr;  // [R, T, Q]: the recv row of slot q of source s's token t here (-1: none)
  int64_t T = 0, Q = 0;
};

// The overlapped GEMM of expert_combine and gather_rs after BeginCall: the band counters zeroed, the GEMM engine and
// the consumer policy chosen, then ExpertKernel (producer and consumer CTAs of one launch) on the rank's SM budget.
// With gather.active, every tile goes to stage and the consumer is gather_rs's (ops/gather_consumer.cuh): it
// reduces each source's tokens into a float32 partial and stores it into slice `rank` of the source's ret rows.
// With fp8.active, lhs and w are e4m3 (w [E_l, N, K], transpose_rhs set) and dt is the rows' dtype; the producer is
// the FP8 grouped GEMM's loop on Hopper, an InvalidArgument error naming the requirement elsewhere, and C the pinned
// or the workspace's fixed count (the resource model's calibration describes the bf16 engine). `op` names the call
// in errors.
Status LaunchExpertOperator(const CallSite& c, const char* op, DType dt, const void* lhs, int64_t cap, int64_t K,
                            const void* w, int64_t E_l, int64_t N, bool transpose_rhs, const int32_t* seg_rows,
                            const int32_t* seg_ret_off, const GatherArgs& gather, const Fp8ProducerArgs& fp8 = {});

// The combine of expert_combine: y = sum_j gates * ret rows (CombineKernel, which closes the call).
Status LaunchCombine(const RankDev& rd, int grid, cudaStream_t stream, DType dt, const float* gates,
                     const int32_t* slot_ret_row, const int32_t* ret_expected, int64_t T, int64_t k, int64_t N,
                     int64_t row_bytes, void* y, void* slot_out);

}  // namespace jmo::cuda
