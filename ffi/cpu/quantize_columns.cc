// XLA:CPU handler of jmo_quantize_columns_fp8 (ffi/common/grouped_gemm_signature.h): fp8.quantize_columns in the
// token-contiguous layout, by the rules of common/fp8_columns.h (the CUDA kernel's too, ops/quantize_columns.cu). The
// group sizes are host data here, so invalid ones (negative, or more rows than x has) are reported instead of
// clipped as on the device.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/fp8_columns.h"
#include "common/grouped_gemm_signature.h"
#include "cpu/gemm_rows.h"
#include "cpu/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jmo::cpu {
namespace {

ffi::Error QuantizeColumnsFp8Impl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> q_t,
                                  ffi::Result<ffi::Buffer<ffi::F32>> s) {
  auto shape = CheckQuantizeColumnsFp8(x, group_sizes, *q_t, *s);
  if (shape.has_error()) return shape.error();
  const int64_t M = shape->M, C = shape->C, G = shape->G, tiles = shape->tiles, Mp = kColumnTile * tiles;
  std::vector<int32_t> row_off(G + 1, 0), tile_off(G + 1, 0);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t n = group_sizes.typed_data()[g];
    if (n < 0 || row_off[g] + n > M)
      return InvalidCall("quantize_columns_fp8: group " + std::to_string(g) + " has " + std::to_string(n) +
                         " rows; group sizes must be >= 0 and sum to at most " + std::to_string(M) +
                         " (the rows of x)");
    row_off[g + 1] = static_cast<int32_t>(row_off[g] + n);
    tile_off[g + 1] = static_cast<int32_t>(tile_off[g] + ColumnTilesOf(n));
  }
  const ElemView in{x.untyped_data(), shape->dtype == DType::kBF16};
  auto* q = static_cast<uint8_t*>(q_t->untyped_data());
  float* scales = s->typed_data();
  std::memset(q, 0, static_cast<size_t>(C * Mp));  // the places no row takes
  std::vector<float> amax(C);
  for (int64_t t = 0; t < tiles; ++t) {
    const ColumnTileRows tile = PlaceColumnTile(t, row_off.data(), tile_off.data(), static_cast<int>(G));
    std::fill(amax.begin(), amax.end(), 0.f);
    for (int i = 0; i < tile.rows; ++i)
      for (int64_t c = 0; c < C; ++c) amax[c] = AmaxStep(amax[c], in[(tile.first + i) * C + c]);
    for (int64_t c = 0; c < C; ++c) scales[t * C + c] = ColumnTileScale(amax[c]);
    for (int i = 0; i < tile.rows; ++i)
      for (int64_t c = 0; c < C; ++c)
        q[c * Mp + kColumnTile * t + i] = QuantizeE4m3(in[(tile.first + i) * C + c], scales[t * C + c]);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jmo::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoQuantizeColumnsFp8Cpu, jmo::cpu::QuantizeColumnsFp8Impl,
                              jmo::BindQuantizeColumnsFp8(ffi::Ffi::Bind()));
