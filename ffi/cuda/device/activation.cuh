// The expert MLP's activation in the device code: SwiGLU's silu(gate) * up in float32, one formula for the GEMM's
// fused epilogue (gemm/sm90/wgmma_mainloop.cuh) and the unfused kernel after a plain GEMM (ops/grouped_gemm.cu), so
// that the two paths give the same h from the same preactivation.
#pragma once

#include <cuda_runtime.h>

namespace jmo::cuda {

__device__ __forceinline__ float SiluMul(float gate, float up) { return gate / (1.0f + expf(-gate)) * up; }

}  // namespace jmo::cuda
