// The 128 x 1 column tiles of the FP8 recipe (fp8.py: column_tiles, tile_scale, quantize_columns) restated for the
// CPU handler and the CUDA kernel of jmo_quantize_columns_fp8, which share every rule here: where a tile's rows lie,
// its amax, its scale and each value's rounding (RoundE4m3, common/e4m3.h).
//
// Tiles: group g's rows [row_off[g], row_off[g + 1]) (consecutive groups from row 0) fill the tiles
// tile_off[g] .. tile_off[g + 1] - 1, tile_off[g] = sum over h < g of ceil(size_h / 128): tile t of group g holds
// its rows row_off[g] + 128 (t - tile_off[g]) + i for i < min(128, row_off[g + 1] - that first row). Tiles from
// tile_off[G] on hold no rows (an empty tile: amax 0, scale 2^-126).
// Scale: s = max(amax * float32(1 / 448), 2^-126) with amax the largest |x| of the tile (NaN if any x is NaN).
// Value: q = RoundE4m3(x / s) in float32.
#pragma once

#include <cstdint>

#include "common/e4m3.h"

namespace jmo {

constexpr int64_t kColumnTile = 128;          // rows of a column tile
constexpr float kE4m3MaxInv = 0x1.24924ap-9f;  // float32(1 / 448), fp8.E4M3_MAX_INV
constexpr float kScaleFloor = 0x1p-126f;       // the smallest normal float32, fp8.SCALE_FLOOR
// jmo_quantize_columns_fp8 on row-quantized rows (e4m3 values and 1 x 128 scales): C a multiple of this many channels,
// on every platform (the CUDA kernel's item, 32 lanes of 8 values: ops/quantize_columns.cu asserts it).
constexpr int64_t kRowsE4m3Channels = 256;

// The tiles of a group of `rows` rows.
JMO_E4M3_HD inline int64_t ColumnTilesOf(int64_t rows) { return (rows + kColumnTile - 1) / kColumnTile; }

// The tiles that hold M rows in any G groups (fp8.ColumnTiles.count): a tile per 128 rows, plus each group's partial
// last tile.
inline int64_t ColumnTilesNeeded(int64_t M, int64_t G) { return ColumnTilesOf(M) + G; }

// One step of a tile's amax: max(m, |x|), NaN once any x is NaN (XLA's max propagates NaN). Starts at 0: the amax of
// an empty tile is 0 (fp8.quantize_columns' maximum(segment max, 0)).
JMO_E4M3_HD inline float AmaxStep(float m, float x) {
  const float a = fabsf(x);  // a NaN's sign cleared too, as jnp.abs clears it
  return (a > m || a != a) ? a : m;
}

// fp8.tile_scale (not pow2) of a tile's amax.
JMO_E4M3_HD inline float ColumnTileScale(float amax) {
  const float s = amax * kE4m3MaxInv;
  return (s > kScaleFloor || s != s) ? s : kScaleFloor;
}

// fp8._quantize of one value with its tile's scale.
JMO_E4M3_HD inline uint8_t QuantizeE4m3(float x, float s) { return RoundE4m3(x / s); }

// Where tile t lies: its first row and its row count (0 for a tile past the groups' tiles). row_off and tile_off
// [G + 1] as above.
struct ColumnTileRows {
  int64_t first;
  int rows;
};
JMO_E4M3_HD inline ColumnTileRows PlaceColumnTile(int64_t t, const int32_t* row_off, const int32_t* tile_off, int G) {
  if (t >= tile_off[G]) return {row_off[G], 0};
  int lo = 0, hi = G - 1;  // the last g with tile_off[g] <= t: the group holding t (an empty group has no tile)
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile_off[mid] <= t) lo = mid; else hi = mid - 1;
  }
  const int64_t first = row_off[lo] + kColumnTile * (t - tile_off[lo]);
  const int64_t left = row_off[lo + 1] - first;
  return {first, static_cast<int>(left < kColumnTile ? left : kColumnTile)};
}

}  // namespace jmo
