// XLA:CPU handler of jmo_swiglu_backward_fp8 (ffi/common/grouped_gemm_signature.h): the FP8 recipe's SwiGLU backward
// by the rules the CUDA kernel shares (ops/swiglu_backward_fp8.cu): the dequantization of a (e4m3 value times its
// scale, one float32 product), the SwiGLU and its gradient (common/swiglu.h), the 1 x 128 and 128 x 1 quantizers
// (common/fp8_rows.h, common/fp8_columns.h: AmaxStep, ColumnTileScale, which is fp8.tile_scale's rule for any tile,
// QuantizeE4m3).
// Plain loops; the group sizes are host data, so invalid ones are reported (cpu/fp8_columns_cpu.h).
#include <cstdint>
#include <vector>

#include "common/bf16.h"
#include "common/e4m3.h"
#include "common/fp8_columns.h"
#include "common/fp8_rows.h"
#include "common/grouped_gemm_signature.h"
#include "common/swiglu.h"
#include "cpu/fp8_columns_cpu.h"
#include "cpu/gemm_rows.h"
#include "cpu/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jmo::cpu {
namespace {

ffi::Error SwiGluBackwardFp8Impl(ffi::AnyBuffer aq, ffi::Buffer<ffi::F32> a_s, ffi::AnyBuffer dh,
                                 ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> da_q,
                                 ffi::Result<ffi::Buffer<ffi::F32>> da_s, ffi::Result<ffi::AnyBuffer> da_t,
                                 ffi::Result<ffi::Buffer<ffi::F32>> da_ts, ffi::Result<ffi::AnyBuffer> h_t,
                                 ffi::Result<ffi::Buffer<ffi::F32>> h_ts) {
  auto shape = CheckSwiGluBackwardFp8(aq, a_s, dh, group_sizes, *da_q, *da_s, *da_t, *da_ts, *h_t, *h_ts);
  if (shape.has_error()) return shape.error();
  auto groups = ColumnGroupsOf("swiglu_backward_fp8", "aq", group_sizes.typed_data(), shape->G, shape->M);
  if (groups.has_error()) return groups.error();
  const int64_t M = shape->M, F = shape->F, C = 2 * F, R = C / kRowTile;  // R: scales per row
  const int64_t rows = groups->row_off.back();                               // the rows of the groups
  const auto* a = static_cast<const uint8_t*>(aq.untyped_data());
  const float* as = a_s.typed_data();
  // dh's value at i in float32 (a bfloat16 dh exactly).
  const auto* d32 = static_cast<const float*>(dh.untyped_data());
  const auto* d16 = static_cast<const uint16_t*>(dh.untyped_data());
  const bool bf16 = shape->dh_bf16;
  auto d_at = [&](int64_t i) { return bf16 ? Bf16ToFloat(d16[i]) : d32[i]; };

  // da [rows, 2F] (d_gate | d_up) and h [rows, F] in float32.
  std::vector<float> da(rows * C), h(rows * F);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < F; ++c) {
      const float gate = DequantizeE4m3(a[r * C + c], as[r * R + c / kRowTile]);
      const float up = DequantizeE4m3(a[r * C + F + c], as[r * R + (F + c) / kRowTile]);
      SwiGluAndGrad(gate, up, d_at(r * F + c), &h[r * F + c], &da[r * C + c], &da[r * C + F + c]);
    }

  // da 1 x 128 (fp8.quantize_rows); a row past the groups as a zero row.
  auto* q = static_cast<uint8_t*>(da_q->untyped_data());
  float* qs = da_s->typed_data();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < R; ++k) {
      uint8_t* out = q + r * C + k * kRowTile;
      qs[r * R + k] = r < rows ? QuantizeRowTile(da.data() + r * C + k * kRowTile, out) : ZeroRowTile(out);
    }

  // da and h 128 x 1 per group, token-contiguous (jmo_quantize_columns_fp8's loop).
  QuantizeColumnTiles(ElemView{da.data(), false}, C, shape->tiles, *groups,
                      static_cast<uint8_t*>(da_t->untyped_data()), da_ts->typed_data());
  QuantizeColumnTiles(ElemView{h.data(), false}, F, shape->tiles, *groups, static_cast<uint8_t*>(h_t->untyped_data()),
                      h_ts->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jmo::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoSwiGluBackwardFp8Cpu, jmo::cpu::SwiGluBackwardFp8Impl,
                              jmo::BindSwiGluBackwardFp8(ffi::Ffi::Bind()));
