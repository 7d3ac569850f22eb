// float8_e4m3fn (the e4m3 of the FP8 recipe, fp8.py): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no
// infinities, NaN at exponent 15 with mantissa 7; subnormals at exponent 0. Decoding is exact in float32; encoding
// (RoundE4m3) is fp8.round_e4m3: saturation to [-448, 448], then one rounding to nearest, ties to even. The encoder
// compiles for the host and for CUDA devices, so the CPU handlers and the kernels share it.
#pragma once

#include <math.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#ifdef __CUDACC__
#define JMO_E4M3_HD __host__ __device__
#else
#define JMO_E4M3_HD
#endif

namespace jmo {

constexpr float kE4m3Max = 448.f;  // the largest finite e4m3

// The float32 value of an e4m3 byte, exact, built from its bits (host and device).
JMO_E4M3_HD inline float E4m3ToFloat(uint8_t b) {
  const uint32_t exponent = (b >> 3) & 0xF, mantissa = b & 0x7;
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24;
  uint32_t u;
  if (exponent == 0xF && mantissa == 0x7) {
    u = sign | 0x7FC00000u;  // NaN
  } else if (exponent == 0) {
    const float v = static_cast<float>(mantissa) * 0x1p-9f;  // mantissa * 2^-3 * 2^(1 - 7): exact
    memcpy(&u, &v, sizeof u);
    u |= sign;
  } else {
    u = sign | ((exponent + 127u - 7u) << 23) | (mantissa << 20);  // (1 + mantissa / 8) * 2^(exponent - 7)
  }
  float v;
  memcpy(&v, &u, sizeof v);
  return v;
}

// fp8.py's dequantization of one value: float32(q) * s, one float32 product (on the device never contracted into an
// FMA with a later sum).
JMO_E4M3_HD inline float DequantizeE4m3(uint8_t b, float s) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(E4m3ToFloat(b), s);
#else
  return E4m3ToFloat(b) * s;
#endif
}

// The 256 values, indexed by the byte.
struct E4m3Table {
  float value[256];
  E4m3Table() {
    for (int b = 0; b < 256; ++b) value[b] = E4m3ToFloat(static_cast<uint8_t>(b));
  }
};

// fp8.round_e4m3 of one float32: clipped to [-448, 448] (a NaN stays NaN, its sign kept), then rounded to the
// nearest e4m3, ties to even. A NaN becomes sign | 0x7F, as XLA's and ml_dtypes' conversions make it.
JMO_E4M3_HD inline uint8_t RoundE4m3(float v) {
  v = v > kE4m3Max ? kE4m3Max : (v < -kE4m3Max ? -kE4m3Max : v);
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7F;
  if (a < 0x3C800000u) {
    // Below 2^-6, e4m3's smallest normal: the multiples of 2^-9 (subnormals, and 8 * 2^-9 = 2^-6 itself, whose byte
    // is 8). |v| * 512 is exact; rintf rounds to nearest even (the default rounding mode, which nothing here changes).
    float m;
    const uint32_t abs_bits = a;
    memcpy(&m, &abs_bits, sizeof m);
    return sign | static_cast<uint8_t>(rintf(m * 512.f));
  }
  // Normal: keep 3 of float32's 23 mantissa bits, rounded to nearest even on the 20 dropped (a carry moves into the
  // exponent); rebias the exponent from 127 to 7. |v| <= 448 keeps the result at most 0x7E.
  const uint32_t r = (a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  return sign | static_cast<uint8_t>(r - ((127u - 7u) << 3));
}

}  // namespace jmo
