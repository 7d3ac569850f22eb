// float8_e4m3fn (the e4m3 of the FP8 recipe, fp8.py): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no
// infinities, NaN at exponent 15 with mantissa 7; subnormals at exponent 0. Decoding is exact in float32.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace jmo {

inline float E4m3ToFloat(uint8_t b) {
  const int exponent = (b >> 3) & 0xF, mantissa = b & 0x7;
  float v;
  if (exponent == 0xF && mantissa == 0x7)
    v = std::numeric_limits<float>::quiet_NaN();
  else if (exponent == 0)
    v = std::ldexp(static_cast<float>(mantissa), -9);          // mantissa * 2^-3 * 2^(1 - 7)
  else
    v = std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);  // (1 + mantissa / 8) * 2^(exponent - 7)
  return (b & 0x80) ? -v : v;
}

// The 256 values, indexed by the byte.
struct E4m3Table {
  float value[256];
  E4m3Table() {
    for (int b = 0; b < 256; ++b) value[b] = E4m3ToFloat(static_cast<uint8_t>(b));
  }
};

}  // namespace jmo
