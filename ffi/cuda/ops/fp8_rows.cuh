// The 1 x 128 row tiles of the FP8 recipe (fp8.quantize_rows, pow2=False) on a warp: a tile's 128 channels held 4
// consecutive ones per lane (one float4 per lane: a warp reads or writes the tile's row segment coalesced), its amax
// reduced across the lanes by shuffles. The rules are common/fp8_columns.h's (AmaxStep, ColumnTileScale,
// QuantizeE4m3, by ops/e4m3.cuh's conversion), those of the CPU handlers' loop (common/fp8_rows.h): the same bytes
// and scale. Shared by ops/swiglu_backward_fp8.cu (da), ops/swiglu_forward_fp8.cu (h and a) and the FP8 GEMM1's
// SwiGLU epilogue (gemm/sm90/swiglu_fp8_epilogue.cuh: a tile's row over the 4 lanes of a quad, LanesRowScale<4>).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/fp8_columns.h"
#include "cuda/ops/e4m3.cuh"

namespace jmo::cuda {

// The amax of a row tile spread over kLanes lanes (an aligned group of consecutive lanes, kLanes a power of two), each
// holding kN of its values (every lane of the group gets it; every lane of the warp calls it: the shuffles take the
// whole warp), by the step max(m, |x|) `step` (AmaxStep, or MaxAbsNaN where it gives AmaxStep's bits). max is exact
// and both steps keep a NaN, so neither the values' order nor the lanes' changes it.
template <int kLanes, int kN, class Step>
__device__ __forceinline__ float LanesRowAmaxBy(const float (&v)[kN], Step step) {
  static_assert(kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0, "a power-of-two group of lanes");
  float m = 0.f;
#pragma unroll
  for (int j = 0; j < kN; ++j) m = step(m, v[j]);
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) m = step(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
  return m;
}
template <int kLanes, int kN>
__device__ __forceinline__ float LanesRowAmax(const float (&v)[kN]) {
  return LanesRowAmaxBy<kLanes>(v, [](float m, float x) { return AmaxStep(m, x); });
}

// The row tile's scale (fp8.tile_scale of its amax) over kLanes lanes as LanesRowAmax's.
template <int kLanes, int kN>
__device__ __forceinline__ float LanesRowScale(const float (&v)[kN]) {
  return ColumnTileScale(LanesRowAmax<kLanes>(v));
}

// LanesRowScale of values that are float32 arithmetic results (their NaN, if any, the device's canonical one): the
// amax by MaxAbsNaN, one instruction a value instead of AmaxStep's three, AmaxStep's bit for bit over such values.
template <int kLanes, int kN>
__device__ __forceinline__ float LanesRowScaleOfResults(const float (&v)[kN]) {
  return ColumnTileScale(LanesRowAmaxBy<kLanes>(v, [](float m, float x) { return MaxAbsNaN(m, x); }));
}

// The amax of a row tile held 4 values per lane by a warp (every lane gets it).
__device__ __forceinline__ float WarpRowAmax(const float (&v)[4]) { return LanesRowAmax<32>(v); }

// A lane's 4 values quantized with the tile's scale s: their e4m3 bytes as one word, in channel order, each
// RoundE4m3(x / s) by ops/e4m3.cuh's QuantizeFour.
__device__ __forceinline__ uint32_t QuantizeWord(const float (&v)[4], float s) {
  return QuantizeFour(v, QuantizerOf(s));
}

// The row tile's scale (fp8.tile_scale of its amax); every lane gets it.
__device__ __forceinline__ float WarpRowScale(const float (&v)[4]) { return LanesRowScale<32>(v); }

// WarpRowScale of values that are float32 arithmetic results, whose NaN (if any) is the device's one canonical NaN
// (0x7FFFFFFF): the amax as the unsigned maximum of the values' absolute bits, by one redux.sync. Non-negative floats
// order as their bits, +inf above every finite one and the canonical NaN above +inf, so that maximum is AmaxStep's
// amax bit for bit. (Among NaNs of several payloads it would pick the largest, not AmaxStep's last: inputs read from
// memory take WarpRowScale.)
__device__ __forceinline__ float WarpRowScaleOfResults(const float (&v)[4]) {
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) m = max(m, __float_as_uint(v[j]) & 0x7FFFFFFFu);
  return ColumnTileScale(__uint_as_float(__reduce_max_sync(0xFFFFFFFFu, m)));
}

}  // namespace jmo::cuda
