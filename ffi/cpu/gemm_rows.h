// The CPU's one row loop of a grouped GEMM with float32 accumulation, and its one SwiGLU: the bare grouped GEMM
// handlers (grouped_gemm.cc) and dispatch_gemm's GEMM and epilogue (dispatch_gemm.cc) all call them, so the fused call
// gives the two calls' bits (each output row is summed over k in order 0..K-1, and each h element is one function of
// its row's preactivation, whatever range of rows one call covers).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/bf16.h"
#include "common/swiglu.h"

namespace jmo::cpu {

// Element access in either dtype, as float.
struct ElemView {
  const void* p;
  bool bf16;
  float operator[](int64_t i) const {
    return bf16 ? Bf16ToFloat(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
  }
};

inline void StoreElem(void* p, bool bf16, int64_t i, float v) {
  if (bf16)
    static_cast<uint16_t*>(p)[i] = FloatToBf16(v);
  else
    static_cast<float*>(p)[i] = v;
}

// out[r] = a[r] @ w for the rows r in [r0, r1): a [*, K]; w the K x N matrix at element w_off of b, [K, N], or with
// transpose_rhs [N, K] read as its transpose; out [*, N] (bfloat16 when out_bf16, else float32). `acc` is scratch of
// N floats.
inline void MatmulRows(ElemView a, ElemView b, int64_t w_off, int64_t r0, int64_t r1, int64_t K, int64_t N,
                       bool transpose_rhs, void* out, bool out_bf16, std::vector<float>& acc) {
  acc.resize(N);
  for (int64_t r = r0; r < r1; ++r) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t k = 0; k < K; ++k) {
      const float x = a[r * K + k];
      if (transpose_rhs)
        for (int64_t n = 0; n < N; ++n) acc[n] += x * b[w_off + n * K + k];
      else
        for (int64_t n = 0; n < N; ++n) acc[n] += x * b[w_off + k * N + n];
    }
    for (int64_t n = 0; n < N; ++n) StoreElem(out, out_bf16, r * N + n, acc[n]);
  }
}

// h[r] = silu(pre[r, :F]) * pre[r, F:] in float32 for the rows r in [r0, r1): pre [*, 2F] float32 (the gate's F
// columns, then the up projection's), h [*, F] (bfloat16 when h_bf16, else float32), rounded once at the store.
inline void SwiGluRows(const float* pre, int64_t r0, int64_t r1, int64_t F, void* h, bool h_bf16) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t j = 0; j < F; ++j) {
      const float gate = pre[r * 2 * F + j];
      StoreElem(h, h_bf16, r * F + j, gate / (1.0f + std::exp(-gate)) * pre[r * 2 * F + F + j]);
    }
}

// The input gradient of SwiGLU for the rows r in [r0, r1): dh [*, F] float32 (the output gradient of h), pre [*, 2F]
// (float32, or bfloat16 taken to float32 value by value) -> da [*, 2F] (d_gate's F columns, then d_up's; bfloat16
// when da_bf16), rounded once at the store. The formula the CUDA epilogue shares (common/swiglu.h, SwiGluGrad): the
// expressions of jax.vjp of the layer's swiglu.
inline void SwiGluGradRows(const float* dh, ElemView pre, int64_t r0, int64_t r1, int64_t F, void* da,
                           bool da_bf16) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = 0; c < F; ++c) {
      float d_gate, d_up;
      SwiGluGrad(pre[r * 2 * F + c], pre[r * 2 * F + F + c], dh[r * F + c], &d_gate, &d_up);
      StoreElem(da, da_bf16, r * 2 * F + c, d_gate);
      StoreElem(da, da_bf16, r * 2 * F + F + c, d_up);
    }
}

}  // namespace jmo::cpu
