// XLA FFI handler symbols for XLA:CPU (defined in handlers.cc unless noted).
#pragma once
#include "xla/ffi/api/c_api.h"

extern "C" {
// The workspace calls as registered with XLA (async_call.cc): each runs its synchronous handler below off XLA's
// threads (async_call.h says why).
XLA_FFI_Error* JmoDispatchCpu(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoExpertCombineCpu(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoDispatchGemmCpu(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoExchangeCountsCpu(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoGatherRsCpu(XLA_FFI_CallFrame* frame);
// Their synchronous handlers, which wait for the peers on the calling thread.
XLA_FFI_Error* JmoDispatchCpuBody(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoExpertCombineCpuBody(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoDispatchGemmCpuBody(XLA_FFI_CallFrame* frame);  // dispatch_gemm.cc
XLA_FFI_Error* JmoExchangeCountsCpuBody(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoGatherRsCpuBody(XLA_FFI_CallFrame* frame);  // gather_rs.cc
XLA_FFI_Error* JmoGroupedMatmulCpu(XLA_FFI_CallFrame* frame);  // grouped_gemm.cc
XLA_FFI_Error* JmoGroupedOuterCpu(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoGroupedMatmulSwiGluCpu(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoGroupedMatmulSwiGluGradCpu(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoGroupedMatmulFp8Cpu(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoGroupedMatmulSwiGluFp8Cpu(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoGroupedOuterFp8Cpu(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JmoQuantizeColumnsFp8Cpu(XLA_FFI_CallFrame* frame);  // quantize_columns.cc
XLA_FFI_Error* JmoQuantizeWeightFp8Cpu(XLA_FFI_CallFrame* frame);   // quantize_weight.cc
XLA_FFI_Error* JmoSwiGluBackwardFp8Cpu(XLA_FFI_CallFrame* frame);  // swiglu_backward_fp8.cc
XLA_FFI_Error* JmoSwiGluForwardFp8Cpu(XLA_FFI_CallFrame* frame);   // swiglu_forward_fp8.cc
}
