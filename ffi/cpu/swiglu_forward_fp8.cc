// XLA:CPU handler of jmo_swiglu_forward_fp8 (ffi/common/grouped_gemm_signature.h): the FP8 recipe's SwiGLU forward
// by the rules the CUDA kernel shares (ops/swiglu_forward_fp8.cu): h = silu(gate) * up in float32 (common/swiglu.h)
// and the 1 x 128 quantizer (common/fp8_rows.h) of h and of a. Row by row, one read of a (SwiGluForwardFp8Rows, the
// loop the fused GEMM1's handler runs too).
#include <cstdint>

#include "common/grouped_gemm_signature.h"
#include "cpu/fp8_gemm_rows.h"
#include "cpu/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jmo::cpu {
namespace {

ffi::Error SwiGluForwardFp8Impl(ffi::AnyBuffer a, ffi::Result<ffi::AnyBuffer> h_q,
                                ffi::Result<ffi::Buffer<ffi::F32>> h_s, ffi::Result<ffi::AnyBuffer> a_q,
                                ffi::Result<ffi::Buffer<ffi::F32>> a_s) {
  auto shape = CheckSwiGluForwardFp8(a, *h_q, *h_s, *a_q, *a_s);
  if (shape.has_error()) return shape.error();
  SwiGluForwardFp8Rows(a.typed_data<float>(), shape->M, shape->F, static_cast<uint8_t*>(h_q->untyped_data()),
                       h_s->typed_data(), static_cast<uint8_t*>(a_q->untyped_data()), a_s->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jmo::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoSwiGluForwardFp8Cpu, jmo::cpu::SwiGluForwardFp8Impl,
                              jmo::BindSwiGluForwardFp8(ffi::Ffi::Bind()));
