// e4m3 on CUDA devices: common/e4m3.h's dequantization and common/fp8_columns.h's quantization (QuantizeE4m3) by the
// hardware's conversions, bitwise the same results; shared by the column quantizer (ops/quantize_columns.cuh), the
// warp's row quantizer (ops/fp8_rows.cuh) and the SwiGLU kernels.
//
// Dequantization, DequantizeE4m3(b, s) = float32(b) * s, of two bytes at once: e4m3 -> half is exact (every e4m3 is a
// half), half -> float exact, then one rounded product. A NaN byte decodes to a NaN other than E4m3ToFloat's, but
// the device's float32 arithmetic returns its one canonical NaN for any NaN operand, so the products agree.
//
// Quantization, bitwise RoundE4m3(x / s) of the IEEE quotient: with r = 1 / s (IEEE), the quotient by one
// correction of q0 = x r: t = q0 s - x (exact by the fma), q = q0 - t r (rounded once). That is the sequence CUDA's
// own __fdiv_rn (div.rn.f32) takes where its range check passes (Markstein's theorem: r correctly rounded and q0
// within an ulp of x / s make q the correctly rounded quotient, given that t is exact and nothing underflows), and
// the tiles it serves keep inside that range:
//   - s >= 2^-62 (and finite): |x| <= 448 s (1 + 2^-23) bounds the quotients; where x / s >= 2^-11 in magnitude,
//     |x| >= 2^-73, so t is a multiple of 2^-149 that the fma holds exactly and q0, q are normal; where it is
//     smaller, e4m3 rounds x / s to a signed zero, as it does q (within a few ulps of it, or a subnormal
//     multiple of 2^-149 below 2^-10);
//   - s = 2^-126 (kScaleFloor: a tile of zeros, or of values below 448 * 2^-126): r = 2^126, so q0 = x 2^126 is
//     exact, t = 0 and q = q0.
// The signs of zero follow x: q0 = x r keeps x's, t = fma(q0, s, -x) is +0 for x = +-0, and q = fma(-t, r, q0) adds
// -t r = -0 to q0 (-0 + +-0 is q0 itself), so x = -0 gives -0.
// e4m3 rounding of q (the hardware's cvt.rn.satfinite.e4m3x2.f32) is RoundE4m3's rule (saturate, then nearest
// even). Other tiles (a scale that is not finite: an inf or NaN in the tile; a nonzero tile whose scale is below
// 2^-62) take x / s by IEEE division and RoundE4m3 as the CPU handlers do: the quantizer says which (fast), the same
// for every value of a tile, so a warp never splits over it.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/e4m3.h"
#include "common/fp8_columns.h"

namespace jmo::cuda {

// max(m, |x|) by max.NaN (one instruction, the magnitude an operand modifier): the canonical NaN once m or x is a
// NaN. Over float32 arithmetic results, whose NaN is that canonical one, it is AmaxStep's amax bit for bit (the
// largest magnitude, or that NaN); over values read from memory a NaN's payload may differ from AmaxStep's.
__device__ __forceinline__ float MaxAbsNaN(float m, float x) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(fabsf(x)));
  return r;
}

// The two e4m3 bytes in the low 16 bits of `two` (the first in the low byte), each dequantized with the scale s.
__device__ __forceinline__ void DequantizeE4m3Pair(uint32_t two, float s, float& a, float& b) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two & 0xFFFFu), __NV_E4M3);
  a = __fmul_rn(__half2float(__half(__half_raw{h.x})), s);
  b = __fmul_rn(__half2float(__half(__half_raw{h.y})), s);
}

// A tile's quantizer: r = 1 / s (IEEE), its scale s, and whether its values take the fast path (the top's ranges).
// 16-byte aligned with r and s first: the fast path's pair is one 8-byte load from shared memory.
struct alignas(16) Quantizer {
  float r, s;
  bool fast;
};
constexpr float kFastScaleMin = 0x1p-62f;  // the fast path's smallest scale but kScaleFloor
__device__ __forceinline__ Quantizer QuantizerOfRecip(float s, float r) {  // r = 1 / s (IEEE) where s is finite
  return {r, s, isfinite(s) && (s >= kFastScaleMin || s == kScaleFloor)};
}
__device__ __forceinline__ Quantizer QuantizerOf(float s) { return QuantizerOfRecip(s, 1.f / s); }

// 1 / x for 2^-126 <= x < 2^126, correctly rounded (bitwise the IEEE quotient 1 / x): the hardware estimate refined
// by one Newton step, r + r (1 - x r), each fma rounded once. It is the sequence CUDA's own rcp.rn and __fdiv_rn take
// for divisors of that range (their exact path serves only extreme exponents, +-inf, NaN and 0), without their branch
// region per quotient. Outside that range it is not the quotient: the callers check the range.
__device__ __forceinline__ float RecipInRange(float x) {
  float e;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x));
  return __fmaf_rn(e, __fmaf_rn(-x, e, 1.0f), e);
}

// QuantizerOf a tile scale (ColumnTileScale's: >= 2^-126 and below 2^120 where finite) with RecipInRange: the same
// quantizer where s is finite; where it is not, every value takes the exact path, which reads s only.
__device__ __forceinline__ Quantizer QuantizerOfTileScale(float s) { return QuantizerOfRecip(s, RecipInRange(s)); }

// The exact path of four values: QuantizeE4m3 of each (an IEEE division and RoundE4m3), as a word. Out of line: it
// is rare, and inlined at every call site its code would crowd the kernels' instruction cache (static: one copy
// per translation unit).
static __device__ __noinline__ uint32_t QuantizeFourExact(float a, float b, float c, float d, float s) {
  return QuantizeE4m3(a, s) | static_cast<uint32_t>(QuantizeE4m3(b, s)) << 8 |
         static_cast<uint32_t>(QuantizeE4m3(c, s)) << 16 | static_cast<uint32_t>(QuantizeE4m3(d, s)) << 24;
}

// The e4m3 bytes of two products (the hardware's cvt.rn.satfinite.e4m3x2.f32), a's in the low byte.
__device__ __forceinline__ uint32_t E4m3Pair(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}

// The IEEE quotient x / s of a fast tile's value (the top): q0 = x r, t = q0 s - x, q0 - t r, each rounded once.
__device__ __forceinline__ float QuotientFast(float x, const Quantizer& q) {
  const float q0 = __fmul_rn(x, q.r);
  const float t = __fmaf_rn(q0, q.s, -x);
  return __fmaf_rn(-t, q.r, q0);
}

// QuantizeFour's fast path: *word = the values' word by QuotientFast, and whether the tile is fast (else
// QuantizeFourExact's word is the values'). A caller quantizing several words can check them all with one branch
// (each branch is a region ptxas does not schedule across); the answer is the same for all words of one tile.
__device__ __forceinline__ bool QuantizeFourFast(const float (&v)[4], const Quantizer& q, uint32_t& word) {
  word = E4m3Pair(QuotientFast(v[0], q), QuotientFast(v[1], q)) |
         E4m3Pair(QuotientFast(v[2], q), QuotientFast(v[3], q)) << 16;
  return q.fast;
}

// kN values of one tile (kN a multiple of 4) -> kN / 4 words, word m of values 4 m .. 4 m + 3 (QuantizeFourFast's),
// and whether every word is its values' word. Where not, QuantizeWordsExact gives them all (QuantizeWords: one rarely
// taken branch for kN values instead of one per word).
template <int kN>
__device__ __forceinline__ bool QuantizeWordsFast(const float (&v)[kN], const Quantizer& q, uint32_t (&w)[kN / 4]) {
  static_assert(kN % 4 == 0, "whole words of four values");
  bool fast = true;
#pragma unroll
  for (int m = 0; m < kN / 4; ++m) {
    const float four[4] = {v[4 * m], v[4 * m + 1], v[4 * m + 2], v[4 * m + 3]};
    fast &= QuantizeFourFast(four, q, w[m]);
  }
  return fast;
}
template <int kN>
__device__ __forceinline__ void QuantizeWordsExact(const float (&v)[kN], float s, uint32_t (&w)[kN / 4]) {
#pragma unroll
  for (int m = 0; m < kN / 4; ++m) w[m] = QuantizeFourExact(v[4 * m], v[4 * m + 1], v[4 * m + 2], v[4 * m + 3], s);
}

template <int kN>
__device__ __forceinline__ void QuantizeWords(const float (&v)[kN], const Quantizer& q, uint32_t (&w)[kN / 4]) {
  if (__builtin_expect(!QuantizeWordsFast(v, q, w), 0)) QuantizeWordsExact(v, q.s, w);
}

// Four values of one tile -> their four e4m3 bytes as a word (v[0] in the low byte), each RoundE4m3(x / s) (see the
// top): by QuotientFast, or by the exact path where the tile is not fast.
__device__ __forceinline__ uint32_t QuantizeFour(const float (&v)[4], const Quantizer& q) {
  uint32_t word;
  if (__builtin_expect(QuantizeFourFast(v, q, word), 1)) return word;
  return QuantizeFourExact(v[0], v[1], v[2], v[3], q.s);
}

}  // namespace jmo::cuda
