// XLA FFI handler symbols for XLA:CUDA (defined in collectives.cc and grouped_gemm.cc).
#pragma once
#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JmoDispatchCuda(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoExpertCombineCuda(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoDispatchGemmCuda(XLA_FFI_CallFrame* frame);  // Hopper only
XLA_FFI_Error* JmoExchangeCountsCuda(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoGatherRsCuda(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoGroupedMatmulCuda(XLA_FFI_CallFrame* frame);  // grouped_gemm.cc
XLA_FFI_Error* JmoGroupedOuterCuda(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoGroupedMatmulSwiGluCuda(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoGroupedMatmulSwiGluGradCuda(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoGroupedMatmulFp8Cuda(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoGroupedOuterFp8Cuda(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoQuantizeColumnsFp8Cuda(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoQuantizeWeightFp8Cuda(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoSwiGluBackwardFp8Cuda(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoSwiGluForwardFp8Cuda(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoGroupedMatmulSwiGluFp8Cuda(XLA_FFI_CallFrame* frame);
}
