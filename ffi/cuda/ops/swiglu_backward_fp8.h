// The FP8 recipe's SwiGLU backward on CUDA (jmo_swiglu_backward_fp8, ffi/common/grouped_gemm_signature.h): from the
// kept preactivation (e4m3, 1 x 128 scales) and the dgrad's dh, the three quantized operands of the backward's GEMMs
// (da 1 x 128; da and h 128 x 1 per group, token-contiguous) in one pass.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/api.h"

namespace jmo::cuda {

// aq [M, 2F] e4m3 and a_s [M, 2F / 128] (the gate's F columns, then the up projection's), dh [M, F] float32 (or
// bfloat16 with dh_bf16: the compute dtype's dgrad, each value read exactly as its float32), grouped
// as group_sizes [G] (device data) -> da_q [M, 2F] e4m3 and da_s [M, 2F / 128] (1 x 128), da_t [2F, 128 tiles] e4m3
// and da_ts [tiles, 2F], h_t [F, 128 tiles] e4m3 and h_ts [tiles, F] (128 x 1, token-contiguous), by the rules of
// common/swiglu.h, common/e4m3.h and common/fp8_columns.h: what the CPU handler writes (ffi/cpu/swiglu_backward_fp8.cc)
// for valid sizes, bit for bit where the device's expf agrees with the host's; negative sizes count as 0 and groups
// are clipped at M rows, as in the grouped GEMMs. F a positive multiple of 128, tiles >= ceil(M / 128) + G. Hopper
// only (Fp8DeviceCheck), like the GEMMs its outputs feed.
Status SwiGluBackwardFp8(cudaStream_t stream, const uint8_t* aq, const float* a_s, const void* dh, bool dh_bf16,
                         int64_t M, int64_t F, int64_t G, const int32_t* group_sizes, int64_t tiles, uint8_t* da_q,
                         float* da_s, uint8_t* da_t, float* da_ts, uint8_t* h_t, float* h_ts);

}  // namespace jmo::cuda
