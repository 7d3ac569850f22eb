// XLA:CPU handler of jmo_swiglu_forward_fp8 (ffi/common/grouped_gemm_signature.h): the FP8 recipe's SwiGLU forward
// by the rules the CUDA kernel shares (ops/swiglu_forward_fp8.cu): h = silu(gate) * up in float32 (common/swiglu.h)
// and the 1 x 128 quantizer (common/fp8_rows.h) of h and of a. Row by row, one read of a.
#include <cstdint>
#include <vector>

#include "common/fp8_rows.h"
#include "common/grouped_gemm_signature.h"
#include "common/swiglu.h"
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
  const int64_t M = shape->M, F = shape->F, C = 2 * F;
  const float* in = a.typed_data<float>();
  auto* hq = static_cast<uint8_t*>(h_q->untyped_data());
  auto* aq = static_cast<uint8_t*>(a_q->untyped_data());
  float* hs = h_s->typed_data();
  float* as = a_s->typed_data();
  std::vector<float> h(F);
  for (int64_t r = 0; r < M; ++r) {
    const float* row = in + r * C;
    for (int64_t c = 0; c < F; ++c) h[c] = SwiGlu(row[c], row[F + c]);
    for (int64_t k = 0; k < F / kRowTile; ++k)
      hs[r * (F / kRowTile) + k] = QuantizeRowTile(h.data() + k * kRowTile, hq + r * F + k * kRowTile);
    for (int64_t k = 0; k < C / kRowTile; ++k)
      as[r * (C / kRowTile) + k] = QuantizeRowTile(row + k * kRowTile, aq + r * C + k * kRowTile);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jmo::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoSwiGluForwardFp8Cpu, jmo::cpu::SwiGluForwardFp8Impl,
                              jmo::BindSwiGluForwardFp8(ffi::Ffi::Bind()));
