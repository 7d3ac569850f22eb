// XLA:CPU handler of jmo_quantize_weight_fp8 (ffi/common/grouped_gemm_signature.h): fp8.quantize_weight (transposed)
// or fp8.quantize_blocks (not transposed) of an expert weight w [E, K, N] in float32 or bfloat16, and with both the
// other layout too, block by block, by the tile rules of common/fp8_columns.h that the CUDA kernel shares
// (ops/quantize_weight.cu): a block's amax by AmaxStep over its values (row by row), its scale by ColumnTileScale
// (fp8.tile_scale), each value by QuantizeE4m3, block by block with the block copied in float32 once.
#include <cstdint>
#include <vector>

#include "common/bf16.h"
#include "common/fp8_columns.h"
#include "common/grouped_gemm_signature.h"
#include "cpu/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jmo::cpu {
namespace {

// The blocks of w [E, K, N] (elements in float32 by `at`), each copied into `block` as float32 once, then its amax,
// scale and values: q and s in W^T's layout (transposed) or in w's; q2 and s2 (where not null) in the other.
template <typename At>
void QuantizeBlocks(At at, int64_t E, int64_t K, int64_t N, bool transposed, uint8_t* q, float* s, uint8_t* q2,
                    float* s2) {
  const int64_t kbs = K / kFp8Tile, nbs = N / kFp8Tile;
  std::vector<float> block(kFp8Tile * kFp8Tile);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t kb = 0; kb < kbs; ++kb)
      for (int64_t nb = 0; nb < nbs; ++nb) {
        const int64_t first = (e * K + kb * kFp8Tile) * N + nb * kFp8Tile;  // the block's element (0, 0) in w
        float amax = 0.f;
        for (int64_t i = 0; i < kFp8Tile; ++i)
          for (int64_t j = 0; j < kFp8Tile; ++j) {
            const float x = at(first + i * N + j);
            block[i * kFp8Tile + j] = x;
            amax = AmaxStep(amax, x);
          }
        const float sc = ColumnTileScale(amax);
        auto put = [&](bool t, uint8_t* qo, float* so) {
          if (t) {
            so[(e * nbs + nb) * kbs + kb] = sc;
            uint8_t* out = qo + (e * N + nb * kFp8Tile) * K + kb * kFp8Tile;  // W^T's row n, column k
            for (int64_t j = 0; j < kFp8Tile; ++j)
              for (int64_t i = 0; i < kFp8Tile; ++i) out[j * K + i] = QuantizeE4m3(block[i * kFp8Tile + j], sc);
          } else {
            so[(e * kbs + kb) * nbs + nb] = sc;
            uint8_t* out = qo + first;
            for (int64_t i = 0; i < kFp8Tile; ++i)
              for (int64_t j = 0; j < kFp8Tile; ++j) out[i * N + j] = QuantizeE4m3(block[i * kFp8Tile + j], sc);
          }
        };
        put(transposed, q, s);
        if (q2 != nullptr) put(!transposed, q2, s2);
      }
}

ffi::Error QuantizeWeightFp8Impl(ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> q_out,
                                 ffi::Result<ffi::Buffer<ffi::F32>> s_out, ffi::Result<ffi::AnyBuffer> q2_out,
                                 ffi::Result<ffi::Buffer<ffi::F32>> s2_out, bool transposed, bool both) {
  auto shape = CheckQuantizeWeightFp8(w, *q_out, *s_out, *q2_out, *s2_out, transposed, both);
  if (shape.has_error()) return shape.error();
  auto* q = static_cast<uint8_t*>(q_out->untyped_data());
  float* s = s_out->typed_data();
  auto* q2 = both ? static_cast<uint8_t*>(q2_out->untyped_data()) : nullptr;
  float* s2 = both ? s2_out->typed_data() : nullptr;
  const int64_t E = shape->E, K = shape->K, N = shape->N;
  if (shape->dtype == DType::kBF16) {
    const auto* in = static_cast<const uint16_t*>(w.untyped_data());
    QuantizeBlocks([in](int64_t i) { return Bf16ToFloat(in[i]); }, E, K, N, transposed, q, s, q2, s2);
  } else {
    const auto* in = static_cast<const float*>(w.untyped_data());
    QuantizeBlocks([in](int64_t i) { return in[i]; }, E, K, N, transposed, q, s, q2, s2);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jmo::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoQuantizeWeightFp8Cpu, jmo::cpu::QuantizeWeightFp8Impl,
                              jmo::BindQuantizeWeightFp8(ffi::Ffi::Bind()));
