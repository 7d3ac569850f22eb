// XLA:CUDA handlers of the bare grouped GEMMs, of the FP8 quantizers (the wgrad operands', the weights') and of the
// FP8 SwiGLU calls: the shape checks shared with the CPU handlers (ffi/common/grouped_gemm_signature.h), then the
// kernels of ops/grouped_gemm.cu, ops/quantize_columns.cu, ops/quantize_weight.cu and ops/swiglu_*_fp8.cu on XLA's
// stream. They keep no state between calls and launch what the shapes and addresses decide (group sizes are read on
// the device), so each declares XLA's command-buffer trait: XLA may trace it into a CUDA graph and replay it.
#include "common/grouped_gemm_signature.h"
#include "cuda/handlers/call_counts.h"
#include "cuda/handlers/handlers.h"
#include "cuda/handlers/support.h"
#include "cuda/ops/grouped_gemm.h"
#include "cuda/ops/quantize_columns.h"
#include "cuda/ops/quantize_weight.h"
#include "cuda/ops/swiglu_backward_fp8.h"
#include "cuda/ops/swiglu_forward_fp8.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jmo::cuda {
namespace {

ffi::Error GroupedMatmulImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                             ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out, bool transpose_rhs) {
  NoteHandlerCall(HandlerOp::kGroupedMatmul, stream);
  auto s = CheckGroupedMatmul(lhs, rhs, group_sizes, *out, transpose_rhs);
  if (s.has_error()) return s.error();
  if (Status d = UseDevice(ordinal); !d.ok()) return ToFfi(d);
  return ToFfi(GroupedMatmul(stream, s->dtype, s->out_f32, lhs.untyped_data(), s->M, s->K,
                         rhs.untyped_data(), s->G, s->N, transpose_rhs, group_sizes.typed_data(),
                         out->untyped_data()));
}

ffi::Error GroupedOuterImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                            ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out) {
  NoteHandlerCall(HandlerOp::kGroupedOuter, stream);
  auto s = CheckGroupedOuter(lhs, rhs, group_sizes, *out);
  if (s.has_error()) return s.error();
  if (Status d = UseDevice(ordinal); !d.ok()) return ToFfi(d);
  return ToFfi(GroupedOuter(stream, s->dtype, s->out_f32, lhs.untyped_data(), s->M, s->K,
                         rhs.untyped_data(), s->N, s->G, group_sizes.typed_data(), out->untyped_data()));
}

ffi::Error GroupedMatmulSwiGluImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                                   ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> h,
                                   ffi::Result<ffi::AnyBuffer> a) {
  NoteHandlerCall(HandlerOp::kGroupedMatmulSwiGlu, stream);
  bool keep_a = false;
  auto s = CheckGroupedSwiGlu(lhs, rhs, group_sizes, *h, *a, &keep_a);
  if (s.has_error()) return s.error();
  if (Status d = UseDevice(ordinal); !d.ok()) return ToFfi(d);
  return ToFfi(GroupedMatmulSwiGlu(stream, s->dtype, lhs.untyped_data(), s->M, s->K, rhs.untyped_data(),
                                   s->G, s->N, group_sizes.typed_data(), h->untyped_data(),
                                   keep_a ? a->untyped_data() : nullptr,
                                   a->element_type() == ffi::DataType::F32 ? DType::kF32 : s->dtype));
}

ffi::Error GroupedMatmulSwiGluGradImpl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                                       ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer a,
                                       ffi::Result<ffi::AnyBuffer> da, bool transpose_rhs) {
  NoteHandlerCall(HandlerOp::kGroupedMatmulSwiGluGrad, stream);
  bool a_f32 = true;
  auto s = CheckGroupedSwiGluGrad(lhs, rhs, group_sizes, a, *da, transpose_rhs, &a_f32);
  if (s.has_error()) return s.error();
  if (Status d = UseDevice(ordinal); !d.ok()) return ToFfi(d);
  return ToFfi(GroupedMatmulSwiGluGrad(stream, s->dtype, lhs.untyped_data(), s->M, s->K, rhs.untyped_data(), s->G,
                                       s->N, transpose_rhs, group_sizes.typed_data(), a.untyped_data(),
                                       a_f32 ? DType::kF32 : s->dtype, da->untyped_data()));
}

ffi::Error GroupedMatmulFp8Impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer lhs,
                                ffi::Buffer<ffi::F32> lhs_scales, ffi::AnyBuffer rhs, ffi::Buffer<ffi::F32> rhs_scales,
                                ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out) {
  NoteHandlerCall(HandlerOp::kGroupedMatmulFp8, stream);
  auto s = CheckGroupedMatmulFp8(lhs, lhs_scales, rhs, rhs_scales, group_sizes, *out);
  if (s.has_error()) return s.error();
  if (Status d = UseDevice(ordinal); !d.ok()) return ToFfi(d);
  return ToFfi(GroupedMatmulFp8(stream, s->out_f32, lhs.untyped_data(), lhs_scales.typed_data(), s->scales_ld, s->M,
                                s->K, rhs.untyped_data(), rhs_scales.typed_data(), s->G, s->N,
                                group_sizes.typed_data(), out->untyped_data()));
}

ffi::Error GroupedOuterFp8Impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer lhs_t,
                               ffi::Buffer<ffi::F32> lhs_scales, ffi::AnyBuffer rhs_t,
                               ffi::Buffer<ffi::F32> rhs_scales, ffi::Buffer<ffi::S32> group_sizes,
                               ffi::Result<ffi::AnyBuffer> out) {
  NoteHandlerCall(HandlerOp::kGroupedOuterFp8, stream);
  auto s = CheckGroupedOuterFp8(lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes, *out);
  if (s.has_error()) return s.error();
  if (Status d = UseDevice(ordinal); !d.ok()) return ToFfi(d);
  return ToFfi(GroupedOuterFp8(stream, s->out_f32, lhs_t.untyped_data(), lhs_scales.typed_data(), s->lhs_ld, s->K,
                               rhs_t.untyped_data(), rhs_scales.typed_data(), s->rhs_ld, s->N, s->Mp, s->G,
                               group_sizes.typed_data(), out->untyped_data()));
}

ffi::Error QuantizeColumnsFp8Impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                                  ffi::Buffer<ffi::F32> x_scales, ffi::Buffer<ffi::S32> group_sizes,
                                  ffi::Result<ffi::AnyBuffer> q_t, ffi::Result<ffi::Buffer<ffi::F32>> s) {
  NoteHandlerCall(HandlerOp::kQuantizeColumnsFp8, stream);
  auto shape = CheckQuantizeColumnsFp8(x, x_scales, group_sizes, *q_t, *s);
  if (shape.has_error()) return shape.error();
  if (Status d = UseDevice(ordinal); !d.ok()) return ToFfi(d);
  if (shape->rows_e4m3)
    return ToFfi(QuantizeColumnsFp8FromRows(stream, x.untyped_data(), x_scales.typed_data(), shape->M, shape->C,
                                            shape->G, group_sizes.typed_data(), shape->tiles, q_t->untyped_data(),
                                            s->typed_data()));
  return ToFfi(QuantizeColumnsFp8(stream, shape->dtype, x.untyped_data(), shape->M, shape->C, shape->G,
                                  group_sizes.typed_data(), shape->tiles, q_t->untyped_data(), s->typed_data()));
}

ffi::Error QuantizeWeightFp8Impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> q,
                                 ffi::Result<ffi::Buffer<ffi::F32>> s, ffi::Result<ffi::AnyBuffer> q2,
                                 ffi::Result<ffi::Buffer<ffi::F32>> s2, bool transposed, bool both) {
  NoteHandlerCall(HandlerOp::kQuantizeWeightFp8, stream);
  auto shape = CheckQuantizeWeightFp8(w, *q, *s, *q2, *s2, transposed, both);
  if (shape.has_error()) return shape.error();
  if (Status d = UseDevice(ordinal); !d.ok()) return ToFfi(d);
  return ToFfi(QuantizeWeightFp8(stream, shape->dtype, w.untyped_data(), shape->E, shape->K, shape->N, transposed,
                                 static_cast<uint8_t*>(q->untyped_data()), s->typed_data(),
                                 both ? static_cast<uint8_t*>(q2->untyped_data()) : nullptr,
                                 both ? s2->typed_data() : nullptr));
}

ffi::Error SwiGluBackwardFp8Impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer aq, ffi::Buffer<ffi::F32> a_s,
                                 ffi::AnyBuffer dh, ffi::Buffer<ffi::S32> group_sizes,
                                 ffi::Result<ffi::AnyBuffer> da_q, ffi::Result<ffi::Buffer<ffi::F32>> da_s,
                                 ffi::Result<ffi::AnyBuffer> da_t, ffi::Result<ffi::Buffer<ffi::F32>> da_ts,
                                 ffi::Result<ffi::AnyBuffer> h_t, ffi::Result<ffi::Buffer<ffi::F32>> h_ts) {
  NoteHandlerCall(HandlerOp::kSwiGluBackwardFp8, stream);
  auto shape = CheckSwiGluBackwardFp8(aq, a_s, dh, group_sizes, *da_q, *da_s, *da_t, *da_ts, *h_t, *h_ts);
  if (shape.has_error()) return shape.error();
  if (Status d = UseDevice(ordinal); !d.ok()) return ToFfi(d);
  return ToFfi(SwiGluBackwardFp8(stream, static_cast<const uint8_t*>(aq.untyped_data()), a_s.typed_data(),
                                 dh.untyped_data(), shape->dh_bf16, shape->M, shape->F, shape->G,
                                 group_sizes.typed_data(), shape->tiles,
                                 static_cast<uint8_t*>(da_q->untyped_data()), da_s->typed_data(),
                                 static_cast<uint8_t*>(da_t->untyped_data()), da_ts->typed_data(),
                                 static_cast<uint8_t*>(h_t->untyped_data()), h_ts->typed_data()));
}

ffi::Error SwiGluForwardFp8Impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer a,
                                ffi::Result<ffi::AnyBuffer> h_q, ffi::Result<ffi::Buffer<ffi::F32>> h_s,
                                ffi::Result<ffi::AnyBuffer> a_q, ffi::Result<ffi::Buffer<ffi::F32>> a_s) {
  NoteHandlerCall(HandlerOp::kSwiGluForwardFp8, stream);
  auto shape = CheckSwiGluForwardFp8(a, *h_q, *h_s, *a_q, *a_s);
  if (shape.has_error()) return shape.error();
  if (Status d = UseDevice(ordinal); !d.ok()) return ToFfi(d);
  return ToFfi(SwiGluForwardFp8(stream, a.typed_data<float>(), shape->M, shape->F,
                                static_cast<uint8_t*>(h_q->untyped_data()), h_s->typed_data(),
                                static_cast<uint8_t*>(a_q->untyped_data()), a_s->typed_data()));
}

ffi::Error GroupedMatmulSwiGluFp8Impl(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer lhs,
                                      ffi::Buffer<ffi::F32> lhs_scales, ffi::AnyBuffer rhs,
                                      ffi::Buffer<ffi::F32> rhs_scales, ffi::Buffer<ffi::S32> group_sizes,
                                      ffi::Result<ffi::AnyBuffer> h_q, ffi::Result<ffi::Buffer<ffi::F32>> h_s,
                                      ffi::Result<ffi::AnyBuffer> a_q, ffi::Result<ffi::Buffer<ffi::F32>> a_s) {
  NoteHandlerCall(HandlerOp::kGroupedMatmulSwiGluFp8, stream);
  auto s = CheckGroupedMatmulSwiGluFp8(lhs, lhs_scales, rhs, rhs_scales, group_sizes, *h_q, *h_s, *a_q, *a_s);
  if (s.has_error()) return s.error();
  if (Status d = UseDevice(ordinal); !d.ok()) return ToFfi(d);
  return ToFfi(GroupedMatmulSwiGluFp8(stream, lhs.untyped_data(), lhs_scales.typed_data(), s->scales_ld, s->M, s->K,
                                      rhs.untyped_data(), rhs_scales.typed_data(), s->G, s->N / 2,
                                      group_sizes.typed_data(), static_cast<uint8_t*>(h_q->untyped_data()),
                                      h_s->typed_data(),
                                      s->keep_a ? static_cast<uint8_t*>(a_q->untyped_data()) : nullptr,
                                      s->keep_a ? a_s->typed_data() : nullptr));
}

}  // namespace
}  // namespace jmo::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoGroupedMatmulCuda, jmo::cuda::GroupedMatmulImpl,
                              jmo::BindGroupedMatmul(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                                      .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoGroupedOuterCuda, jmo::cuda::GroupedOuterImpl,
                              jmo::BindGroupedOuter(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                                      .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoGroupedMatmulSwiGluCuda, jmo::cuda::GroupedMatmulSwiGluImpl,
                              jmo::BindGroupedSwiGlu(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                                       .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoGroupedMatmulSwiGluGradCuda, jmo::cuda::GroupedMatmulSwiGluGradImpl,
                              jmo::BindGroupedSwiGluGrad(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                                           .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoGroupedMatmulFp8Cuda, jmo::cuda::GroupedMatmulFp8Impl,
                              jmo::BindGroupedMatmulFp8(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                                         .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoGroupedMatmulSwiGluFp8Cuda, jmo::cuda::GroupedMatmulSwiGluFp8Impl,
                              jmo::BindGroupedMatmulSwiGluFp8(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                                               .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoGroupedOuterFp8Cuda, jmo::cuda::GroupedOuterFp8Impl,
                              jmo::BindGroupedMatmulFp8(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                                         .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoQuantizeColumnsFp8Cuda, jmo::cuda::QuantizeColumnsFp8Impl,
                              jmo::BindQuantizeColumnsFp8(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                                          .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoQuantizeWeightFp8Cuda, jmo::cuda::QuantizeWeightFp8Impl,
                              jmo::BindQuantizeWeightFp8(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                                         .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoSwiGluBackwardFp8Cuda, jmo::cuda::SwiGluBackwardFp8Impl,
                              jmo::BindSwiGluBackwardFp8(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                                          .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoSwiGluForwardFp8Cuda, jmo::cuda::SwiGluForwardFp8Impl,
                              jmo::BindSwiGluForwardFp8(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                                         .Ctx<ffi::DeviceOrdinal>()),
                              {ffi::Traits::kCmdBufferCompatible});
