// float <-> element type conversions of the device code (float32 and bfloat16 operands, float32 accumulation).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace jmo::cuda {

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

}  // namespace jmo::cuda
