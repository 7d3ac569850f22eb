// The 1 x 128 row tiles of the FP8 recipe (fp8.quantize_rows, pow2=False): one row's 128 consecutive channels share
// a scale. The rules are common/fp8_columns.h's for any tile (AmaxStep, ColumnTileScale: fp8.tile_scale,
// QuantizeE4m3); this is their loop over one row tile, shared by the CPU handlers that quantize rows
// (cpu/swiglu_backward_fp8.cc, cpu/swiglu_forward_fp8.cc). The kernels split a tile over a warp's lanes and take the
// same rules there (cuda/ops/fp8_rows.cuh).
#pragma once

#include <cstdint>

#include "common/e4m3.h"
#include "common/fp8_columns.h"

namespace jmo {

constexpr int64_t kRowTile = 128;  // channels of a row tile

// fp8.quantize_rows of one row tile v[0 .. 127]: its 128 e4m3 bytes to q; returns its scale.
JMO_E4M3_HD inline float QuantizeRowTile(const float* v, uint8_t* q) {
  float amax = 0.f;
  for (int64_t i = 0; i < kRowTile; ++i) amax = AmaxStep(amax, v[i]);
  const float s = ColumnTileScale(amax);
  for (int64_t i = 0; i < kRowTile; ++i) q[i] = QuantizeE4m3(v[i], s);
  return s;
}

// A row tile that is all zeros (a row past the groups, as quantize_rows gives it): zero bytes; returns its scale,
// 2^-126.
JMO_E4M3_HD inline float ZeroRowTile(uint8_t* q) {
  for (int64_t i = 0; i < kRowTile; ++i) q[i] = 0;
  return ColumnTileScale(0.f);
}

}  // namespace jmo
