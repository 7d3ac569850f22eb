// The CPU's FP8 row GEMM (the emulation of the Hopper e4m3 kernel) and its SwiGLU forward quantizer, each one loop that
// every handler computing it calls: grouped_matmul_fp8 and grouped_matmul_swiglu_fp8 (grouped_gemm.cc),
// swiglu_forward_fp8 (swiglu_forward_fp8.cc). So the fused GEMM1 gives the two calls' bits: it runs the first loop
// into float32 rows, then the second over them.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/e4m3.h"
#include "common/fp8_rows.h"
#include "common/grouped_gemm_signature.h"
#include "common/swiglu.h"
#include "cpu/gemm_rows.h"

namespace jmo::cpu {

// An e4m3 lhs as the FP8 row GEMM reads it: row r's K values at q + r * q_ld, the float32 scale of its 128-wide K
// chunk kc at s + r * s_row + kc * s_chunk (bytes). Two layouts: the FP8 GEMMs' operand (values [M, K], scales
// [K/128, ld] MN-major) and packed rows (fp8.pack_rows: each row its K values, then its K/128 scales; what
// dispatch_gemm's GEMM reads where the rows land).
struct Fp8Lhs {
  const uint8_t* q;
  int64_t q_ld;
  const uint8_t* s;
  int64_t s_row, s_chunk;

  static Fp8Lhs MnMajor(const uint8_t* q, int64_t K, const float* sa, int64_t ld) {
    return {q, K, reinterpret_cast<const uint8_t*>(sa), 4, 4 * ld};
  }
  static Fp8Lhs PackedRows(const uint8_t* rows, int64_t K) {
    const int64_t row_bytes = K + K / kFp8Tile * 4;
    return {rows, row_bytes, rows + K, row_bytes, 4};
  }
  // The view from row r0 on (r0 is its row 0).
  Fp8Lhs From(int64_t r0) const { return {q + r0 * q_ld, q_ld, s + r0 * s_row, s_row, s_chunk}; }
  const uint8_t* Row(int64_t r) const { return q + r * q_ld; }
  float Scale(int64_t r, int64_t kc) const {
    float v;
    std::memcpy(&v, s + r * s_row + kc * s_chunk, sizeof v);  // (packed rows: bytes of an XLA uint8 buffer)
    return v;
  }
};

// The FP8 block-scaled grouped GEMM's rows of the groups (off [G + 1]: their row offsets) into o [M, N] (bfloat16
// with out_bf16, else float32): a [M, K] e4m3 with its 1 x 128 scales (Fp8Lhs), b [G, N, K] e4m3 and sb
// [G, N/128, K/128] float32. Per row r of group g, column n and 128-wide K chunk kc (in K order):
//   part = sum_{k in kc} float(a[r, k]) * float(b[g][n, k])   in float64, then rounded once to float32: exact
//          before that rounding (a product of two e4m3 values is a multiple of 2^-18 below 2^18, so 128 of them sum
//          exactly in float64's 53 bits): the correctly rounded chunk sum, which the tensor core approximates (it
//          keeps about 14 bits inside a chunk)
//   acc  = fmaf(part, sa(r, kc) * sb[g][n / 128][kc], acc)   float32, the scale product rounded first, acc starting
//          at 0: the kernel's promotion, operation for operation
// then o[r, n] = acc rounded to the output dtype (to nearest even). Rows past the groups are not written.
inline void MatmulFp8Rows(const Fp8Lhs& a, const uint8_t* b, const float* sb, const std::vector<int64_t>& off,
                          int64_t K, int64_t N, void* o, bool out_bf16) {
  static const E4m3Table e4m3;
  const int64_t chunks = K / kFp8Tile;
  std::vector<float> sa(chunks);
  for (int64_t g = 0; g + 1 < static_cast<int64_t>(off.size()); ++g)
    for (int64_t r = off[g]; r < off[g + 1]; ++r) {
      const uint8_t* ar = a.Row(r);
      for (int64_t kc = 0; kc < chunks; ++kc) sa[kc] = a.Scale(r, kc);
      for (int64_t n = 0; n < N; ++n) {
        const uint8_t* bn = b + (g * N + n) * K;
        float acc = 0.f;
        for (int64_t kc = 0; kc < chunks; ++kc) {
          double part = 0.0;
          for (int64_t k = kc * kFp8Tile; k < (kc + 1) * kFp8Tile; ++k)
            part += static_cast<double>(e4m3.value[ar[k]]) * static_cast<double>(e4m3.value[bn[k]]);
          const float scale = sa[kc] * sb[(g * (N / kFp8Tile) + n / kFp8Tile) * chunks + kc];
          acc = std::fma(static_cast<float>(part), scale, acc);
        }
        StoreElem(o, out_bf16, r * N + n, acc);
      }
    }
}

// The FP8 recipe's SwiGLU forward of rows a [M, 2F] float32 (the gate's F columns, then the up projection's), row by
// row: h = SwiGlu(gate, up) in float32 (common/swiglu.h) quantized 1 x 128 to hq [M, F] and hs [M, F/128], a quantized
// 1 x 128 to aq [M, 2F] and as [M, 2F/128] (QuantizeRowTile, common/fp8_rows.h), or not where aq is null (a not
// kept).
inline void SwiGluForwardFp8Rows(const float* in, int64_t M, int64_t F, uint8_t* hq, float* hs, uint8_t* aq,
                                 float* as) {
  const int64_t C = 2 * F;
  std::vector<float> h(F);
  for (int64_t r = 0; r < M; ++r) {
    const float* row = in + r * C;
    for (int64_t c = 0; c < F; ++c) h[c] = SwiGlu(row[c], row[F + c]);
    for (int64_t k = 0; k < F / kRowTile; ++k)
      hs[r * (F / kRowTile) + k] = QuantizeRowTile(h.data() + k * kRowTile, hq + r * F + k * kRowTile);
    for (int64_t k = 0; aq != nullptr && k < C / kRowTile; ++k)
      as[r * (C / kRowTile) + k] = QuantizeRowTile(row + k * kRowTile, aq + r * C + k * kRowTile);
  }
}

}  // namespace jmo::cpu
