// XLA:CUDA handlers of the workspace calls (dispatch, dispatch_gemm, expert_combine, gather_rs, exchange_counts): the
// same operands, results and attributes as the CPU handlers (ffi/cpu/handlers.cc), the same shape checks, then the
// launchers of api.h on XLA's stream.
//
// Rank mapping: the group/rank operands live in device memory, and reading them on the host would cost a stream
// synchronization per call. The handler instead finds its (group, rank) from the FFI device ordinal in the workspace
// table (one rank per device outside the loopback harness), and the first kernel of the call checks that the
// operands agree, reporting a mismatch as an error of the next call.
//
// CUDA graphs: each handler declares XLA's command-buffer trait (kCmdBufferCompatible). What a call launches depends
// only on its attributes, the operand shapes and addresses and the workspace, never on an earlier call (the epoch and
// every per-call counter live on the device), so XLA may trace it into a CUDA graph and replay that; docs/design.md
// ("CUDA graphs") says how a captured call fails.
#include <string>

#include "common/call_signature.h"
#include "cuda/api.h"
#include "cuda/handlers/call_counts.h"
#include "cuda/handlers/handlers.h"
#include "cuda/handlers/support.h"
#include "cuda/launch.h"
#include "cuda/workspace/workspace.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jmo::cuda {
namespace {

ffi::ErrorOr<CallSite> Resolve(cudaStream_t stream, int32_t ordinal, const CallAttrs& attrs) {
  Workspace* ws = LookupWorkspace(attrs.workspace);
  if (ws == nullptr)
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                                      "jax_moe_overlap: workspace handle " + std::to_string(attrs.workspace) +
                                          " is not a live CUDA workspace (released, created in another process, or "
                                          "a CPU workspace; a program compiled ahead of time before "
                                          "release_workspaces() must be compiled again)"));
  CallSite c{ws, 0, 0, stream, attrs.options};
  Status s = ws->FindByOrdinal(ordinal, &c.group, &c.rank);
  if (!s.ok()) return ffi::Unexpected(ToFfi(s));
  if (Status d = UseDevice(ordinal); !d.ok()) return ffi::Unexpected(ToFfi(d));
  return c;
}

ffi::Error DispatchImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer src, ffi::Buffer<ffi::S32> slot_src_row,
                        ffi::Buffer<ffi::S32> slot_dest_rank, ffi::Buffer<ffi::S32> slot_dest_row,
                        ffi::Buffer<ffi::S32> recv_rows_expected, ffi::Buffer<ffi::S32> slot_primary,
                        ffi::Buffer<ffi::F32> row_scale, ffi::Buffer<ffi::S32> group_op, ffi::Buffer<ffi::S32> rank_op,
                        ffi::Result<ffi::AnyBuffer> out, CallAttrs attrs) {
  NoteHandlerCall(HandlerOp::kDispatch, stream);
  auto shape = CheckDispatch(src, slot_src_row, slot_dest_rank, slot_dest_row, slot_primary, row_scale, *out);
  if (shape.has_error()) return shape.error();
  auto c = Resolve(stream, ordinal, attrs);
  if (c.has_error()) return c.error();
  const Status s = Dispatch(c.value(), shape->dtype, src.untyped_data(), shape->S, shape->D,
                            slot_src_row.typed_data(), slot_dest_rank.typed_data(), slot_dest_row.typed_data(),
                            shape->send_once ? slot_primary.typed_data() : nullptr,
                            shape->scaled ? row_scale.typed_data() : nullptr, shape->P,
                            recv_rows_expected.typed_data(), group_op.typed_data(), rank_op.typed_data(),
                            out->untyped_data(), shape->cap);
  return ToFfi(AbortIfOpened(c.value(), s));
}

ffi::Error DispatchGemmImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer src,
                            ffi::Buffer<ffi::S32> slot_src_row, ffi::Buffer<ffi::S32> slot_dest_rank,
                            ffi::Buffer<ffi::S32> slot_dest_row, ffi::Buffer<ffi::S32> recv_rows_expected,
                            ffi::Buffer<ffi::S32> slot_primary, ffi::Buffer<ffi::F32> row_scale,
                            ffi::Buffer<ffi::S32> send_order, ffi::Buffer<ffi::S32> send_start,
                            ffi::Buffer<ffi::S32> seg_rows, ffi::Buffer<ffi::S32> seg_ret_off, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::F32> w_scales, ffi::Buffer<ffi::S32> group_op,
                            ffi::Buffer<ffi::S32> rank_op, ffi::Result<ffi::AnyBuffer> x_recv,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> a,
                            ffi::Result<ffi::Buffer<ffi::F32>> h_scales, ffi::Result<ffi::Buffer<ffi::F32>> a_scales,
                            DispatchGemmAttrs attrs) {
  NoteHandlerCall(HandlerOp::kDispatchGemm, stream);
  const bool transpose_rhs = attrs.transpose_rhs, swiglu = attrs.swiglu;
  auto shape = CheckDispatchGemm(src, slot_src_row, slot_dest_rank, slot_dest_row, slot_primary, row_scale, w,
                                 w_scales, *x_recv, *out, *a, *h_scales, *a_scales, transpose_rhs, swiglu);
  if (shape.has_error()) return shape.error();
  auto c = Resolve(stream, ordinal, attrs.call);
  if (c.has_error()) return c.error();
  if (ffi::Error e = CheckDispatchGemmPlan(*shape, c.value().ws->ranks(), send_order, send_start, seg_rows,
                                           seg_ret_off);
      e.failure())
    return e;
  const cuda::DispatchSlots slots{slot_src_row.typed_data(), slot_dest_rank.typed_data(), slot_dest_row.typed_data(),
                                  send_order.typed_data(), send_start.typed_data(),
                                  shape->rows.send_once ? slot_primary.typed_data() : nullptr,
                                  shape->rows.scaled ? row_scale.typed_data() : nullptr, shape->rows.P};
  const cuda::DispatchGemmOut results{shape->keep_recv ? x_recv->untyped_data() : nullptr, out->untyped_data(),
                                      shape->keep_a ? a->untyped_data() : nullptr,
                                      shape->fp8 && swiglu ? h_scales->typed_data() : nullptr,
                                      shape->keep_a && shape->fp8 ? a_scales->typed_data() : nullptr,
                                      shape->keep_a && !shape->fp8 && a->element_type() != ffi::DataType::F32,
                                      shape->out_rounded};
  // (CheckDispatchGemm refused bf16 swiglu with transpose_rhs; e4m3 w is always K-major.)
  const Gemm1Form form = swiglu ? Gemm1Form::kSwiGlu : transpose_rhs ? Gemm1Form::kTransposedRhs : Gemm1Form::kPlain;
  const Status s = DispatchGemm(c.value(), shape->rows.dtype, src.untyped_data(), shape->rows.S, shape->rows.D, slots,
                                recv_rows_expected.typed_data(), seg_rows.typed_data(), seg_ret_off.typed_data(),
                                shape->E_local, w.untyped_data(), shape->fp8 ? w_scales.typed_data() : nullptr,
                                shape->N, form, group_op.typed_data(), rank_op.typed_data(), results, shape->rows.cap);
  return ToFfi(AbortIfOpened(c.value(), s));
}

ffi::Error ExpertCombineImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer lhs, ffi::AnyBuffer w,
                             ffi::Buffer<ffi::F32> lhs_scales, ffi::Buffer<ffi::F32> w_scales,
                             ffi::Buffer<ffi::F32> gates, ffi::Buffer<ffi::S32> seg_rows,
                             ffi::Buffer<ffi::S32> seg_ret_off, ffi::Buffer<ffi::S32> slot_ret_row,
                             ffi::Buffer<ffi::S32> ret_rows_expected, ffi::Buffer<ffi::S32> group_op,
                             ffi::Buffer<ffi::S32> rank_op, ffi::Result<ffi::AnyBuffer> y,
                             ffi::Result<ffi::AnyBuffer> slot_out, ExpertCombineAttrs attrs) {
  NoteHandlerCall(HandlerOp::kExpertCombine, stream);
  const bool transpose_rhs = attrs.transpose_rhs;
  auto shape = CheckExpertCombine(lhs, w, lhs_scales, w_scales, gates, seg_rows, seg_ret_off, slot_ret_row, *y,
                                  *slot_out, transpose_rhs);
  if (shape.has_error()) return shape.error();
  const Fp8ProducerArgs fp8{shape->fp8, lhs_scales.typed_data(), shape->scales_ld, w_scales.typed_data()};
  auto c = Resolve(stream, ordinal, attrs.call);
  if (c.has_error()) return c.error();
  if (ffi::Error e = CheckExpertCombinePlan(*shape, c.value().ws->ranks()); e.failure()) return e;
  const Status s = ExpertCombine(c.value(), shape->dtype, lhs.untyped_data(), shape->cap, shape->K,
                                 w.untyped_data(), shape->E_local, shape->N, transpose_rhs, gates.typed_data(),
                                 shape->T, shape->k, seg_rows.typed_data(), seg_ret_off.typed_data(),
                                 slot_ret_row.typed_data(), ret_rows_expected.typed_data(), group_op.typed_data(),
                                 rank_op.typed_data(), y->untyped_data(),
                                 shape->want_slots ? slot_out->untyped_data() : nullptr, fp8);
  return ToFfi(AbortIfOpened(c.value(), s));
}

// gather_rs (GEMM2 + GatherRS): the CPU handler's shape checks and its rule on R; token_rows' entries are device data,
// checked by the kernel (kBadRoute, reported by the next call).
ffi::Error GatherRsImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer lhs, ffi::AnyBuffer w,
                        ffi::Buffer<ffi::F32> row_gate, ffi::Buffer<ffi::S32> token_rows,
                        ffi::Buffer<ffi::S32> seg_rows, ffi::Buffer<ffi::S32> seg_ret_off,
                        ffi::Buffer<ffi::S32> group_op, ffi::Buffer<ffi::S32> rank_op, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::AnyBuffer> rows, ExpertCombineAttrs attrs) {
  NoteHandlerCall(HandlerOp::kGatherRs, stream);
  const bool transpose_rhs = attrs.transpose_rhs;
  auto shape = CheckGatherRs(lhs, w, row_gate, token_rows, seg_rows, seg_ret_off, *y, *rows, transpose_rhs);
  if (shape.has_error()) return shape.error();
  auto c = Resolve(stream, ordinal, attrs.call);
  if (c.has_error()) return c.error();
  if (ffi::Error e = CheckGatherRsPlan(*shape, c.value().ws->ranks()); e.failure()) return e;
  const Status s = GatherRs(c.value(), shape->dtype, lhs.untyped_data(), shape->cap, shape->K, w.untyped_data(),
                            shape->E_local, shape->N, transpose_rhs, row_gate.typed_data(), token_rows.typed_data(),
                            shape->T, shape->Q, seg_rows.typed_data(), seg_ret_off.typed_data(), group_op.typed_data(),
                            rank_op.typed_data(), y->untyped_data(), shape->want_rows ? rows->untyped_data() : nullptr);
  return ToFfi(AbortIfOpened(c.value(), s));
}

// exchange_counts (the routing counts of groups spanning processes): the same checks as the CPU handler's.
ffi::Error ExchangeCountsImpl(cudaStream_t stream, int32_t ordinal, ffi::Buffer<ffi::S32> counts,
                              ffi::Buffer<ffi::S32> group_op, ffi::Buffer<ffi::S32> rank_op,
                              ffi::Result<ffi::Buffer<ffi::S32>> counts_all, CallAttrs attrs) {
  NoteHandlerCall(HandlerOp::kExchangeCounts, stream);
  auto shape = CheckExchangeCounts(counts, *counts_all);
  if (shape.has_error()) return shape.error();
  auto c = Resolve(stream, ordinal, attrs);
  if (c.has_error()) return c.error();
  const Status s = ExchangeCounts(c.value(), counts.typed_data(), shape->R_src, shape->R_dst, shape->E_local,
                                  group_op.typed_data(), rank_op.typed_data(), counts_all->typed_data());
  return ToFfi(AbortIfOpened(c.value(), s));
}

}  // namespace
}  // namespace jmo::cuda

// XLA's stream and the device ordinal first, then the operands shared with the CPU handlers; each may be traced
// into a CUDA graph (XLA's command buffers).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoDispatchCuda, jmo::cuda::DispatchImpl,
                              jmo::BindDispatch(ffi::Ffi::Bind()
                                                    .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                    .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoDispatchGemmCuda, jmo::cuda::DispatchGemmImpl,
                              jmo::BindDispatchGemm(ffi::Ffi::Bind()
                                                        .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                        .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoExpertCombineCuda, jmo::cuda::ExpertCombineImpl,
                              jmo::BindExpertCombine(ffi::Ffi::Bind()
                                                         .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                         .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoGatherRsCuda, jmo::cuda::GatherRsImpl,
                              jmo::BindGatherRs(ffi::Ffi::Bind()
                                                    .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                    .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoExchangeCountsCuda, jmo::cuda::ExchangeCountsImpl,
                              jmo::BindExchangeCounts(ffi::Ffi::Bind()
                                                          .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                          .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});
