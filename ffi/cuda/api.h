// The launchers of the CUDA library (jmo_cuda): the host entry points of the primitives and what the handlers, the
// workspace and the tools need to know about the kernels. Plain C++: the XLA FFI handlers (handlers/) and the
// tools (the loopback harness) call the same functions.
//
// All pointers are device pointers (operands of the custom call); every call only enqueues work on `stream`,
// except after a failure (RecoverIfAborted synchronizes). A failure inside the kernels (a timed-out wait, an invalid
// routing input found on the device) is reported by the *next* call of the same rank, with rank, peer, stage and
// counts: the kernels run asynchronously, so the call that fails cannot know yet.
//
// CUDA graphs: every call launches the same device work whatever happened before it (per-call state lives on the
// device), so XLA may capture it into a command buffer (a CUDA graph) and replay it without calling the host side
// again. `stream` may then be capturing: a call detects that (cudaStreamIsCapturing), never synchronizes, reports an
// earlier failure without recovering from it, and tells its kernels, which stop the device on a failure instead of
// leaving it to the next call (StopIfCaptured, workspace/protocol.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/call_options.h"
#include "common/dtype.h"
#include "cuda/gemm/engine.h"
#include "cuda/workspace/workspace.h"

namespace jmo::cuda {

// One call of a rank: where it runs, and its options (jmo::CallOptions, common/call_options.h: one struct for both
// platforms).
struct CallSite {
  Workspace* ws;
  int group, rank;
  cudaStream_t stream;
  CallOptions opts;
  // Set by BeginCall once it has launched BeginKernel: the call's epoch is open, and a failure of this rank's host
  // from then on must raise the group's abort (AbortIfOpened), or the peers would wait the timeout for it.
  mutable bool opened = false;
};

// dispatch: rows src[slot_src_row[p]] -> peer slot_dest_rank[p]'s recv row slot_dest_row[p] (-1: dropped); waits for
// this rank's *expected rows, then writes out [cap, D] (rows past *expected are zero). slot_primary [P] (send once,
// protocol.h): a row crosses to each other rank once, with every slot's recv_from entry, and the copy out gathers
// each row from the row its entry names; nullptr: one row per slot. row_scale [P] (not with slot_primary): slot p's
// row lands as the float32 product src row * row_scale[p] rounded once to dt (float32 or bfloat16); nullptr: moved.
Status Dispatch(const CallSite& c, DType dt, const void* src, int64_t S, int64_t D, const int32_t* slot_src_row,
                const int32_t* slot_dest_rank, const int32_t* slot_dest_row, const int32_t* slot_primary,
                const float* row_scale, int64_t P, const int32_t* recv_expected, const int32_t* group_op,
                const int32_t* rank_op, void* out, int64_t cap);

// The sender side of a dispatch_gemm's plan (plan.py): per slot [P] the source row, destination rank and recv row;
// the slot at each send position [P]; the first send position of each destination's rows [R + 1]; per slot [P] its
// primary (send once, protocol.h), or nullptr: one row per slot; per slot [P] the factor its row lands scaled by (as
// Dispatch's row_scale), or nullptr: rows moved unchanged.
struct DispatchSlots {
  const int32_t *src_row, *dest_rank, *dest_row, *send_order, *send_start, *primary;
  const float* row_scale;
  int64_t P;
};

// What dispatch_gemm's GEMM1 computes: pre = recv[segment] @ w[expert] with w [E_l, D, N] (kPlain) or [E_l, N, D]
// read transposed in place (kTransposedRhs), or GEMM1 of the expert MLP with its SwiGLU epilogue (kSwiGlu: w
// [E_l, D, 2F]; the epilogue has no transposed form).
enum class Gemm1Form { kPlain, kTransposedRhs, kSwiGlu };

// dispatch_gemm's results (all device pointers; rows past *recv_expected are left unwritten in each: no consumer
// reads them, docs/design.md "Padding rows").
struct DispatchGemmOut {
  void* x_recv;  // [cap, D]: the recv rows as Dispatch returns them; nullptr: not kept
  void* out;     // kSwiGlu: h [cap, N / 2] in src's dtype = silu(pre[:, :N/2]) * pre[:, N/2:]; else [cap, N] float32
                 // or bf16 (out_bf16) (FP8 kSwiGlu: h_q [cap, N / 2] e4m3)
  void* a;       // kSwiGlu: pre [cap, N] float32 or bf16 (a_bf16; FP8: a_q [cap, N] e4m3), or nullptr: not kept
                 // (must be nullptr in the other forms)
  float* h_scales = nullptr;  // FP8 kSwiGlu: h's 1 x 128 scales [cap, N / 256]
  float* a_scales = nullptr;  // FP8 kSwiGlu with a kept: a's 1 x 128 scales [cap, N / 128]
  bool a_bf16 = false;        // bf16 kSwiGlu: a holds pre rounded once to bf16 (else float32)
  bool out_bf16 = false;      // bf16 rows without the SwiGLU: out holds pre rounded once to bf16 (else float32)
};

// dispatch_gemm: the dispatch (as Dispatch) and GEMM1 (w in src's dtype, in `form`) in one launch, each GEMM1 tile
// starting once the 128-row blocks of its source that hold its rows have arrived; the results as DispatchGemmOut says,
// in the kept rows bitwise those of Dispatch + GroupedMatmul (f32 or bf16 out) or GroupedMatmulSwiGlu. c.opts.pushers
// CTAs push the rows for other ranks, then copy x_recv beside the GEMM (c.opts.x_recv_from_tiles: the GEMM's tiles
// store it instead), then join it (1 .. SM budget - 1). The wgmma engine only: an InvalidArgument error naming its rule
// where it does not run the device or take the operands.
// FP8 (dt kE4M3Rows: packed e4m3 rows, w e4m3 [E_l, N, D] K-major with w_scales [E_l, N/128, D/128]; form kSwiGlu
// or kTransposedRhs): the GEMM is the FP8 grouped GEMM's loop reading A's values and scales from the packed rows
// where they land (Fp8PackedRowsOperands), its results those of GroupedMatmulFp8 (f32) or GroupedMatmulSwiGluFp8 on
// the unpacked rows; D a multiple of 512 (the rows' stride for TMA); x_recv as for bf16 rows (the packed rows' bytes).
Status DispatchGemm(const CallSite& c, DType dt, const void* src, int64_t S, int64_t D, const DispatchSlots& slots,
                    const int32_t* recv_expected, const int32_t* seg_rows, const int32_t* seg_ret_off, int64_t E_l,
                    const void* w, const float* w_scales, int64_t N, Gemm1Form form, const int32_t* group_op,
                    const int32_t* rank_op, const DispatchGemmOut& out, int64_t cap);

// expert_combine's e4m3 producer operands besides lhs and w (device pointers; BindExpertCombine's rule): absent for
// float32 and bfloat16 operands.
struct Fp8ProducerArgs {
  bool active = false;
  const float* lhs_scales = nullptr;  // [K/128, scales_ld] (MN-major)
  int64_t scales_ld = 0;
  const float* w_scales = nullptr;  // [E_l, N/128, K/128]
};

// expert_combine: producer = grouped GEMM lhs[segment] @ w[expert] over the (expert, source) segments in
// SegmentBefore order, storing remote segments' tiles in stage and local ones straight into the own ret rows;
// consumer = C CTAs pushing each finished remote band to its source's ret rows (TMA bulk copies on sm_90); then
// y[t] = sum_j gates[t, j] * ret[slot_ret_row[t*k + j]] (fixed order j = 0..k-1), slot_out[p] = ret[...] if given.
// w is [E_l, K, N], or with transpose_rhs [E_l, N, K], read as w[expert]^T in place (no transposed copy). With
// fp8.active, lhs and w are e4m3 with their scales (the FP8 grouped GEMM's operands, w [E_l, N, K]) and dt is the
// rows' and outputs' dtype (Hopper only: LaunchExpertOperator).
Status ExpertCombine(const CallSite& c, DType dt, const void* lhs, int64_t cap, int64_t K, const void* w, int64_t E_l,
                     int64_t N, bool transpose_rhs, const float* gates, int64_t T, int64_t k, const int32_t* seg_rows,
                     const int32_t* seg_ret_off, const int32_t* slot_ret_row, const int32_t* ret_expected,
                     const int32_t* group_op, const int32_t* rank_op, void* y, void* slot_out,
                     const Fp8ProducerArgs& fp8 = {});

// gather_rs (GEMM2 + GatherRS, docs/design.md "GatherRS"): the producer as ExpertCombine's (every tile into stage);
// consumer = C CTAs that reduce, once every band of a source's segments is ready, each of that source's tokens here
// (row_gate[i] * row i for i = token_rows[s, t, q] >= 0, q = 0..Q-1 in order, float32) into slice `rank` of the
// source's ret rows (float32 [R, T, N]); then y[t] = the R slices summed in rank order in float32, rounded once to
// dt, and rows_out [cap, N] (or null) = the GEMM's rows, zero past the call's segment rows. token_rows entries outside
// [-1, cap) fail the call (kBadRoute). Bitwise the CPU handler's sums of the same GEMM rows.
Status GatherRs(const CallSite& c, DType dt, const void* lhs, int64_t cap, int64_t K, const void* w, int64_t E_l,
                int64_t N, bool transpose_rhs, const float* row_gate, const int32_t* token_rows, int64_t T, int64_t Q,
                const int32_t* seg_rows, const int32_t* seg_ret_off, const int32_t* group_op, const int32_t* rank_op,
                void* y, void* rows_out);

// exchange_counts: counts [R_dst * E_local] of this rank -> out [R_src, R_dst, E_local], every rank's, through the
// group's count board (protocol.h); R_src and R_dst must be the workspace's ranks, R_dst * E_local <= kMaxSegments.
Status ExchangeCounts(const CallSite& c, const int32_t* counts, int64_t R_src, int64_t R_dst, int64_t E_local,
                      const int32_t* group_op, const int32_t* rank_op, int32_t* out);

// What the host needs of a device (cached per ordinal, thread-safe): SMs, shared memory per SM, compute capability.
struct DeviceInfo {
  int sms = 0;
  int smem_per_sm = 0;
  ComputeCapability cc;
};
Status GetDeviceInfo(int dev, DeviceInfo* info);
Status CurrentDeviceInfo(DeviceInfo* info);  // of the current device (cudaGetDevice)

// Loads every kernel on device `dev` and sets the expert kernel's shared memory (once per device). Workspace::Create
// calls it: with CUDA's lazy module loading, a kernel loaded at its first launch can wait for kernels already running,
// and ours spin on each other across ranks sharing a device.
Status PrepareKernels(int dev);

// ExpertCombine's producer runs the engine SelectGemmEngine (gemm/engine.h) picks for the GEMM lhs [cap, K] @ w[e]
// (GemmForm::kRows, no epilogue) on the rank's device.

// Columns of one mma.sync / SIMT producer tile (a tile is kBandRows x this).
int ProducerTileN();

// Rows and columns of one tile of a producer engine (wgmma: 128 x 256, two bands per tile; the others: 64 x 128).
void ProducerTile(GemmEngine engine, int* tile_m, int* tile_n);

// Empty if `p` can drive the device-side choice (tile shape of the compiled kernels, one CTA per SM, finite positive
// rates), else what is wrong.
std::string CheckModelParams(const ModelParams& p);

// How the resource manager picks a call's consumer CTA count C: pinned by the call, the workspace's model evaluated
// on the device (when it describes the call's producer engine), or the workspace's fixed count.
enum class ConsumerPolicy { kPinned, kModel, kFixed };
ConsumerPolicy SelectConsumerPolicy(const Workspace& ws, const CallOptions& o, GemmEngine producer);
const char* ConsumerPolicyName(ConsumerPolicy p);  // "pinned", "model", "fixed"
// The fixed C of a call on a rank of `budget` CTAs (>= 2): the workspace's count (CallConfig.consumer_ctas's default,
// SMs / 8), at most budget - 1; a gather_rs call (`gathers`) whose producer is the SIMT engine takes 1: that producer
// (float32 FMA, a small fraction of the tensor cores' rate) bounds the call and its partials trickle out, so every
// consumer CTA beyond one is an SM taken from it (docs/performance.md, "Resource manager regret": C = 1 the fastest
// of the sweep on all three float32 cases, the workspace's count 6-12% slower).
int FixedConsumerCtas(const Workspace& ws, int budget, GemmEngine producer, bool gathers);

}  // namespace jmo::cuda
