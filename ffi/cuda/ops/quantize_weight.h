// The expert weights' 128 x 128 block quantizer on CUDA (jmo_quantize_weight_fp8, ffi/common/grouped_gemm_signature.h):
// one pass over w [E, K, N], the e4m3 values out in Fp8Weight's layout (the blocks of W^T, [E, N, K]) or in w's own
// ([E, K, N], the dgrads'), with the block scales. It replaces XLA's transpose, amax reduction and quantization of
// fp8.quantize_weight, which read and wrote the weight several times.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/dtype.h"
#include "cuda/api.h"

namespace jmo::cuda {

// q and s from w [E, K, N] (dt: float32 or bfloat16; K and N positive multiples of 128): with transposed, q [E, N, K]
// and s [E, N / 128, K / 128] (fp8.quantize_weight), else q [E, K, N] and s [E, K / 128, N / 128]
// (fp8.quantize_blocks), by the tile rules of common/fp8_columns.h: bitwise what the CPU handler writes
// (ffi/cpu/quantize_weight.cc), a NaN's sign and payload aside (the device's float32 arithmetic returns its one
// canonical NaN). q2 and s2 (both or neither null): the other layout's, from the same read of w. Hopper only
// (Fp8DeviceCheck), like the GEMMs its output feeds.
Status QuantizeWeightFp8(cudaStream_t stream, DType dt, const void* w, int64_t E, int64_t K, int64_t N,
                         bool transposed, uint8_t* q, float* s, uint8_t* q2 = nullptr, float* s2 = nullptr);

}  // namespace jmo::cuda
