// XLA:CUDA handlers of the two primitives: the same operands, results and attributes as the CPU handlers
// (ffi/cpu/handlers_cpu.cc), the same shape checks, then the kernels of kernels.cu on XLA's stream.
//
// Rank mapping: the group/rank operands live in device memory, and reading them on the host would cost a stream
// synchronization per call. The handler instead finds its (group, rank) from the FFI device ordinal in the workspace
// table (one rank per device outside the loopback harness), and the first kernel of the call checks that the
// operands agree, reporting a mismatch as an error of the next call.
#include <string>

#include "cuda/handlers_cuda.h"
#include "cuda/kernels.h"
#include "cuda/workspace_cuda.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jmo::cuda {
namespace {

ffi::Error Invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_moe_overlap: " + msg);
}

ffi::Error ToFfi(const Status& s) {
  if (s.ok()) return ffi::Error::Success();
  ffi::ErrorCode code = ffi::ErrorCode::kInternal;
  switch (s.code) {
    case kInvalidArgument: code = ffi::ErrorCode::kInvalidArgument; break;
    case kDeadlineExceeded: code = ffi::ErrorCode::kDeadlineExceeded; break;
    case kFailedPrecondition: code = ffi::ErrorCode::kFailedPrecondition; break;
    default: break;
  }
  return ffi::Error(code, s.msg);
}

bool SupportedFloat(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }
DType ToDType(ffi::DataType t) { return t == ffi::DataType::F32 ? DType::kF32 : DType::kBF16; }

ffi::ErrorOr<CallSite> Resolve(cudaStream_t stream, int32_t ordinal, int64_t handle, int64_t timeout_ms,
                               int32_t delay_rank, int64_t delay_us) {
  Workspace* ws = LookupWorkspace(handle);
  if (ws == nullptr)
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                                      "jax_moe_overlap: workspace handle " + std::to_string(handle) +
                                          " is not a live CUDA workspace (released, created in another process, or "
                                          "a CPU workspace)"));
  CallSite c{ws, 0, 0, stream, CallOptions{timeout_ms, delay_rank, delay_us}};
  Status s = ws->FindByOrdinal(ordinal, &c.group, &c.rank);
  if (!s.ok()) return ffi::Unexpected(ToFfi(s));
  // Launch on the device that owns XLA's stream (XLA makes its context current; be explicit anyway).
  int cur = -1;
  if (cudaGetDevice(&cur) != cudaSuccess || cur != ordinal) {
    cudaError_t e = cudaSetDevice(ordinal);
    if (e != cudaSuccess) return ffi::Unexpected(ToFfi(CudaStatus(e, "cudaSetDevice")));
  }
  return c;
}

ffi::Error DispatchImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer src, ffi::Buffer<ffi::S32> slot_src_row,
                        ffi::Buffer<ffi::S32> slot_dest_rank, ffi::Buffer<ffi::S32> slot_dest_row,
                        ffi::Buffer<ffi::S32> recv_rows_expected, ffi::Buffer<ffi::S32> group_op,
                        ffi::Buffer<ffi::S32> rank_op, ffi::Result<ffi::AnyBuffer> out, int64_t workspace,
                        int64_t timeout_ms, int32_t delay_rank, int64_t delay_us) {
  if (!SupportedFloat(src.element_type()) || out->element_type() != src.element_type())
    return Invalid("dispatch: rows must be float32 or bfloat16");
  auto sd = src.dimensions();
  auto od = out->dimensions();
  if (sd.size() != 2 || od.size() != 2 || sd[1] != od[1]) return Invalid("dispatch: src [S, D] and out [cap, D]");
  const int64_t P = slot_src_row.element_count();
  if (slot_dest_rank.element_count() != P || slot_dest_row.element_count() != P)
    return Invalid("dispatch: slot arrays must have equal length");
  auto c = Resolve(stream, ordinal, workspace, timeout_ms, delay_rank, delay_us);
  if (c.has_error()) return c.error();
  return ToFfi(Dispatch(c.value(), ToDType(src.element_type()), src.untyped_data(), sd[0], sd[1],
                        slot_src_row.typed_data(), slot_dest_rank.typed_data(), slot_dest_row.typed_data(), P,
                        recv_rows_expected.typed_data(), group_op.typed_data(), rank_op.typed_data(),
                        out->untyped_data(), od[0]));
}

ffi::Error ExpertCombineImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer lhs, ffi::AnyBuffer w,
                             ffi::Buffer<ffi::F32> gates, ffi::Buffer<ffi::S32> seg_rows,
                             ffi::Buffer<ffi::S32> seg_ret_off, ffi::Buffer<ffi::S32> slot_ret_row,
                             ffi::Buffer<ffi::S32> ret_rows_expected, ffi::Buffer<ffi::S32> group_op,
                             ffi::Buffer<ffi::S32> rank_op, ffi::Result<ffi::AnyBuffer> y,
                             ffi::Result<ffi::AnyBuffer> slot_out, int64_t workspace, int64_t timeout_ms,
                             int32_t delay_rank, int64_t delay_us) {
  const ffi::DataType dt = lhs.element_type();
  if (!SupportedFloat(dt) || w.element_type() != dt || y->element_type() != dt || slot_out->element_type() != dt)
    return Invalid("expert_combine: lhs, w and outputs must share one dtype, float32 or bfloat16");
  auto ld = lhs.dimensions(), wd = w.dimensions(), gd = gates.dimensions(), yd = y->dimensions(),
       sd = seg_rows.dimensions();
  if (ld.size() != 2 || wd.size() != 3 || gd.size() != 2 || yd.size() != 2 || sd.size() != 2)
    return Invalid("expert_combine: expected lhs [cap, K], w [E_local, K, N], gates [T, k], seg_rows [E_local, R]");
  const int64_t cap = ld[0], K = ld[1], E_l = wd[0], N = wd[2], T = gd[0], k = gd[1];
  if (wd[1] != K || yd[0] != T || yd[1] != N || sd[0] != E_l) return Invalid("expert_combine: inconsistent shapes");
  const int64_t P = T * k;
  const auto so = slot_out->dimensions();
  const bool want_slots = so.size() == 2 && so[0] != 0;
  if (so.size() != 2 || (want_slots && (so[0] != P || so[1] != N)) || slot_ret_row.element_count() != P ||
      seg_ret_off.element_count() != seg_rows.element_count())
    return Invalid("expert_combine: slot arrays must have T*k rows");
  auto c = Resolve(stream, ordinal, workspace, timeout_ms, delay_rank, delay_us);
  if (c.has_error()) return c.error();
  if (sd[1] != c.value().ws->ranks())
    return Invalid("expert_combine: seg_rows must be [E_local, R] with R = workspace ranks");
  return ToFfi(ExpertCombine(c.value(), ToDType(dt), lhs.untyped_data(), cap, K, w.untyped_data(), E_l, N,
                             gates.typed_data(), T, k, seg_rows.typed_data(), seg_ret_off.typed_data(),
                             slot_ret_row.typed_data(), ret_rows_expected.typed_data(), group_op.typed_data(),
                             rank_op.typed_data(), y->untyped_data(),
                             want_slots ? slot_out->untyped_data() : nullptr));
}

}  // namespace
}  // namespace jmo::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoDispatchCuda, jmo::cuda::DispatchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()         // src [S, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_src_row [P]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_dest_rank [P]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_dest_row [P] (-1: dropped)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // recv_rows_expected []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                                  .Ret<ffi::AnyBuffer>()         // recv [cap, D]
                                  .Attr<int64_t>("workspace")
                                  .Attr<int64_t>("timeout_ms")
                                  .Attr<int32_t>("delay_rank")
                                  .Attr<int64_t>("delay_us"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoExpertCombineCuda, jmo::cuda::ExpertCombineImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()         // lhs [cap, K]
                                  .Arg<ffi::AnyBuffer>()         // w [E_local, K, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gates [T, k]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seg_rows [E_local, R]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seg_ret_off [E_local, R]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_ret_row [T*k] (-1: dropped)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ret_rows_expected []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rank []
                                  .Ret<ffi::AnyBuffer>()         // y [T, N]
                                  .Ret<ffi::AnyBuffer>()         // slot_out [T*k, N] or [0, N]
                                  .Attr<int64_t>("workspace")
                                  .Attr<int64_t>("timeout_ms")
                                  .Attr<int32_t>("delay_rank")
                                  .Attr<int64_t>("delay_us"));
