// The FP8 recipe's SwiGLU forward on CUDA (jmo_swiglu_forward_fp8, ffi/common/grouped_gemm_signature.h): from GEMM1's
// float32 output a, h = swiglu(a) quantized 1 x 128 (GEMM2's operand) and a quantized 1 x 128 (what the backward
// keeps), in one pass over a.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/api.h"

namespace jmo::cuda {

// a [M, 2F] float32 (the gate's F columns, then the up projection's) -> h_q [M, F] e4m3 and h_s [M, F / 128],
// a_q [M, 2F] e4m3 and a_s [M, 2F / 128] (fp8.quantize_rows of h and of a), by the rules of common/swiglu.h,
// common/e4m3.h and common/fp8_columns.h: what the CPU handler writes (ffi/cpu/swiglu_forward_fp8.cc), bit for bit
// where the device's expf agrees with the host's (a_q and a_s everywhere). F a positive multiple of 128. Hopper only
// (Fp8DeviceCheck), like the GEMM its output feeds.
Status SwiGluForwardFp8(cudaStream_t stream, const float* a, int64_t M, int64_t F, uint8_t* h_q, float* h_s,
                        uint8_t* a_q, float* a_s);

}  // namespace jmo::cuda
