// The expert MLP's activation in the device code: SwiGLU's silu(gate) * up in float32, one formula for the GEMM's
// fused epilogue (gemm/sm90/wgmma_mainloop.cuh) and the unfused kernel after a plain GEMM (ops/grouped_gemm.cu), so
// that the two paths give the same h from the same preactivation; and its input gradient, the backward GEMM's
// SwiGLU-gradient epilogue.
#pragma once

#include <cuda_runtime.h>

#include "common/swiglu.h"

namespace jmo::cuda {

// The quotient by __fdividef (the hardware reciprocal and a product: within 2 ulp of gate / den for den below 2^126;
// 0 above it, where |silu(gate)| < 2^-126 |gate|; -inf / inf a NaN, as in IEEE), not the IEEE division, whose range
// check and slow path are a branch region per value in an epilogue the tensor cores wait for. h is rounded to bf16
// (or compared within float32 tolerances), far coarser than 2 ulp.
__device__ __forceinline__ float SiluMul(float gate, float up) { return __fdividef(gate, 1.0f + expf(-gate)) * up; }

// The input gradient of silu(gate) * up for the output gradient dh, in float32: the shared formula of the host and
// the device (common/swiglu.h), the expressions of jax.vjp of the layer's swiglu with each operation rounded on its own.
using jmo::SwiGluGrad;

}  // namespace jmo::cuda
