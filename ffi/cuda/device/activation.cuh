// The expert MLP's activation in the device code: SwiGLU's silu(gate) * up in float32, one formula for the GEMM's
// fused epilogue (gemm/sm90/wgmma_mainloop.cuh) and the unfused kernel after a plain GEMM (ops/grouped_gemm.cu), so
// that the two paths give the same h from the same preactivation; and its input gradient, the backward GEMM's
// SwiGLU-gradient epilogue.
#pragma once

#include <cuda_runtime.h>

namespace jmo::cuda {

__device__ __forceinline__ float SiluMul(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

// The input gradient of silu(gate) * up for the output gradient dh, in float32: the expressions of jax.vjp of the
// layer's swiglu (expert_gemms.swiglu: JAX's jvp rules of mul and logistic, transposed) with the same operands
// grouped the same way, the logistic as XLA expands it, 1 / (1 + exp(-gate)), and each operation rounded on its own
// (the __f*_rn intrinsics: no contraction into FMAs), so that the result is the float32 math of the unfused path
// wherever XLA's elementwise code rounds each operation and its exp agrees with expf:
//   sig = logistic(gate), d_up = (gate * sig) * dh, j = dh * up,
//   d_gate = j * sig + (gate * j) * (sig * (1 - sig)).
__device__ __forceinline__ void SwiGluGrad(float gate, float up, float dh, float* d_gate, float* d_up) {
  const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-gate)));
  const float j = __fmul_rn(dh, up);
  *d_up = __fmul_rn(__fmul_rn(gate, sig), dh);
  *d_gate = __fadd_rn(__fmul_rn(j, sig), __fmul_rn(__fmul_rn(gate, j), __fmul_rn(sig, __fsub_rn(1.0f, sig))));
}

}  // namespace jmo::cuda
