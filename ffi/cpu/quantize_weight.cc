// XLA:CPU handler of jmo_quantize_weight_fp8 (ffi/common/grouped_gemm_signature.h): fp8.quantize_weight (transposed)
// or fp8.quantize_blocks (not transposed) of an expert weight w [E, K, N] in float32 or bfloat16, block by block, by
// the tile rules of common/fp8_columns.h that the CUDA kernel shares (ops/quantize_weight.cu): a block's amax by
// AmaxStep over its values (row by row), its scale by ColumnTileScale (fp8.tile_scale), each value by QuantizeE4m3.
#include <cstdint>

#include "common/fp8_columns.h"
#include "common/grouped_gemm_signature.h"
#include "cpu/gemm_rows.h"
#include "cpu/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jmo::cpu {
namespace {

ffi::Error QuantizeWeightFp8Impl(ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> q_out,
                                 ffi::Result<ffi::Buffer<ffi::F32>> s_out, bool transposed) {
  auto shape = CheckQuantizeWeightFp8(w, *q_out, *s_out, transposed);
  if (shape.has_error()) return shape.error();
  const int64_t E = shape->E, K = shape->K, N = shape->N, kb_n = K / kFp8Tile, nb_n = N / kFp8Tile;
  const ElemView in{w.untyped_data(), shape->dtype == DType::kBF16};
  auto* q = static_cast<uint8_t*>(q_out->untyped_data());
  float* s = s_out->typed_data();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t kb = 0; kb < kb_n; ++kb)
      for (int64_t nb = 0; nb < nb_n; ++nb) {
        const int64_t k0 = kb * kFp8Tile, n0 = nb * kFp8Tile;
        float amax = 0.f;
        for (int64_t k = k0; k < k0 + kFp8Tile; ++k)
          for (int64_t n = n0; n < n0 + kFp8Tile; ++n) amax = AmaxStep(amax, in[(e * K + k) * N + n]);
        const float sc = ColumnTileScale(amax);
        s[transposed ? (e * nb_n + nb) * kb_n + kb : (e * kb_n + kb) * nb_n + nb] = sc;
        for (int64_t k = k0; k < k0 + kFp8Tile; ++k)
          for (int64_t n = n0; n < n0 + kFp8Tile; ++n)
            q[transposed ? (e * N + n) * K + k : (e * K + k) * N + n] = QuantizeE4m3(in[(e * K + k) * N + n], sc);
      }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jmo::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoQuantizeWeightFp8Cpu, jmo::cpu::QuantizeWeightFp8Impl,
                              jmo::BindQuantizeWeightFp8(ffi::Ffi::Bind()));
