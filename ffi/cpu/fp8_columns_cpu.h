// The CPU handlers' 128 x 1 column quantizer (fp8.quantize_columns in the token-contiguous layout, by the rules of
// common/fp8_columns.h): the group tables from host group sizes, checked, and the loop over the tiles, on rows in
// float32 or bfloat16 or row-quantized. Shared by
// jmo_quantize_columns_fp8 (quantize_columns.cc) and jmo_swiglu_backward_fp8 (swiglu_backward_fp8.cc).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/call_signature.h"
#include "common/e4m3.h"
#include "common/fp8_columns.h"
#include "common/fp8_rows.h"
#include "cpu/gemm_rows.h"
#include "xla/ffi/api/ffi.h"

namespace jmo::cpu {

// The group tables of common/fp8_columns.h (row_off, tile_off [G + 1]) from the group sizes, which are host data
// here: invalid ones (negative, or more rows than `rows_of` has) are reported naming `op`, not clipped as on the
// device.
struct ColumnGroups {
  std::vector<int32_t> row_off, tile_off;
};
inline xla::ffi::ErrorOr<ColumnGroups> ColumnGroupsOf(const char* op, const char* rows_of, const int32_t* sizes,
                                                      int64_t G, int64_t M) {
  ColumnGroups t{std::vector<int32_t>(G + 1, 0), std::vector<int32_t>(G + 1, 0)};
  for (int64_t g = 0; g < G; ++g) {
    const int64_t n = sizes[g];
    if (n < 0 || t.row_off[g] + n > M)
      return xla::ffi::Unexpected(InvalidCall(std::string(op) + ": group " + std::to_string(g) + " has " +
                                              std::to_string(n) + " rows; group sizes must be >= 0 and sum to at " +
                                              "most " + std::to_string(M) + " (the rows of " + rows_of + ")"));
    t.row_off[g + 1] = static_cast<int32_t>(t.row_off[g] + n);
    t.tile_off[g + 1] = static_cast<int32_t>(t.tile_off[g] + ColumnTilesOf(n));
  }
  return t;
}

// Rows given row-quantized (fp8.quantize_rows): e4m3 values [M, C] and their 1 x 128 scales [M, C / 128], element i
// dequantized by the shared rule (DequantizeE4m3). C is a multiple of 128, so element i's scale is s[i / 128].
struct RowsE4m3View {
  const uint8_t* q;
  const float* s;
  float operator[](int64_t i) const { return DequantizeE4m3(q[i], s[i / kRowTile]); }
};

// q_t [C, 128 tiles] and s [tiles, C] from the rows of `in` [M, C] (ElemView or RowsE4m3View): every byte of q_t
// written (0 where no row lands), every scale (2^-126 for an empty tile).
template <class Rows>
void QuantizeColumnTiles(Rows in, int64_t C, int64_t tiles, const ColumnGroups& groups, uint8_t* q_t,
                                float* s) {
  const int64_t Mp = kColumnTile * tiles;
  const int G = static_cast<int>(groups.row_off.size()) - 1;
  std::memset(q_t, 0, static_cast<size_t>(C * Mp));
  std::vector<float> amax(C);
  for (int64_t t = 0; t < tiles; ++t) {
    const ColumnTileRows tile = PlaceColumnTile(t, groups.row_off.data(), groups.tile_off.data(), G);
    std::fill(amax.begin(), amax.end(), 0.f);
    for (int i = 0; i < tile.rows; ++i)
      for (int64_t c = 0; c < C; ++c) amax[c] = AmaxStep(amax[c], in[(tile.first + i) * C + c]);
    for (int64_t c = 0; c < C; ++c) s[t * C + c] = ColumnTileScale(amax[c]);
    for (int i = 0; i < tile.rows; ++i)
      for (int64_t c = 0; c < C; ++c)
        q_t[c * Mp + kColumnTile * t + i] = QuantizeE4m3(in[(tile.first + i) * C + c], s[t * C + c]);
  }
}

}  // namespace jmo::cpu
