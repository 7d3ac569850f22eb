// common/swiglu.h's logistic, SwiGluSigmoid(gate) = 1 / (1 + exp(-gate)), of several gates on the device, bit for bit,
// without a branch region around each value's division (those keep the scheduler from interleaving the values'
// long-latency steps). Shared by the FP8 SwiGLU kernels: the backward (ops/swiglu_backward_fp8.cu), the forward
// (ops/swiglu_forward_fp8.cu) and GEMM1's SwiGLU epilogue (gemm/sm90/swiglu_fp8_epilogue.cuh).
//
// Each denominator x = SwiGluDenominator(gate) is >= 1, +inf (a gate below about -88.7) or NaN. For 1 <= x < 2^126
// RecipInRange (ops/e4m3.cuh) is the correctly rounded reciprocal, which is SwiGluSigmoid's IEEE quotient 1 / x. Where
// any of the kN is not below 2^126 (a gate below about -87.3, whose logistic is at most 2^-126, or a NaN) all kN take
// __frcp_rn, the correctly rounded reciprocal of every float: one rarely taken branch per kN values.
#pragma once

#include <cuda_runtime.h>

#include "common/swiglu.h"
#include "cuda/ops/e4m3.cuh"

namespace jmo::cuda {

// (static: one copy per translation unit; out of line: it is rare, and inlined at every site its code would crowd the
// kernels' instruction cache.)
static __device__ __noinline__ float RecipExact(float x) { return __frcp_rn(x); }

// sig[j] = SwiGluSigmoid(gate[j]), bitwise.
template <int kN>
__device__ __forceinline__ void SwiGluSigmoids(const float (&gate)[kN], float (&sig)[kN]) {
  float den[kN];
  bool exact = false;
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    den[j] = SwiGluDenominator(gate[j]);
    sig[j] = RecipInRange(den[j]);
    exact |= !(den[j] < 0x1p126f);
  }
  if (__builtin_expect(exact, 0)) {
#pragma unroll
    for (int j = 0; j < kN; ++j) sig[j] = RecipExact(den[j]);
  }
}

}  // namespace jmo::cuda
