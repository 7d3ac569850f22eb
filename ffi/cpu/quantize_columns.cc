// XLA:CPU handler of jmo_quantize_columns_fp8 (ffi/common/grouped_gemm_signature.h): fp8.quantize_columns in the
// token-contiguous layout, of rows in float32 or bfloat16 or row-quantized (e4m3 values and scales, dequantized by
// the shared rule), by the rules of common/fp8_columns.h (the CUDA kernel's too, ops/quantize_columns.cu), the
// loop of cpu/fp8_columns_cpu.h. The group sizes are host data here, so invalid ones (negative, or more rows than x
// has) are reported instead of clipped as on the device.
#include <cstdint>

#include "common/grouped_gemm_signature.h"
#include "cpu/fp8_columns_cpu.h"
#include "cpu/gemm_rows.h"
#include "cpu/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jmo::cpu {
namespace {

ffi::Error QuantizeColumnsFp8Impl(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> x_scales, ffi::Buffer<ffi::S32> group_sizes,
                                  ffi::Result<ffi::AnyBuffer> q_t, ffi::Result<ffi::Buffer<ffi::F32>> s) {
  auto shape = CheckQuantizeColumnsFp8(x, x_scales, group_sizes, *q_t, *s);
  if (shape.has_error()) return shape.error();
  auto groups = ColumnGroupsOf("quantize_columns_fp8", "x", group_sizes.typed_data(), shape->G, shape->M);
  if (groups.has_error()) return groups.error();
  auto* q = static_cast<uint8_t*>(q_t->untyped_data());
  if (shape->rows_e4m3)
    QuantizeColumnTiles(RowsE4m3View{static_cast<const uint8_t*>(x.untyped_data()), x_scales.typed_data()}, shape->C,
                        shape->tiles, *groups, q, s->typed_data());
  else
    QuantizeColumnTiles(ElemView{x.untyped_data(), shape->dtype == DType::kBF16}, shape->C, shape->tiles, *groups, q,
                        s->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jmo::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoQuantizeColumnsFp8Cpu, jmo::cpu::QuantizeColumnsFp8Impl,
                              jmo::BindQuantizeColumnsFp8(ffi::Ffi::Bind()));
