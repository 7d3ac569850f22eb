// The FP8 weight gradient's operand quantizer on CUDA (jmo_quantize_columns_fp8, ffi/common/grouped_gemm_signature.h):
// rows in, the 128 x 1-tile e4m3 values out in the token-contiguous layout jmo_grouped_outer_fp8 reads, with their
// scales. One kernel writes every byte of both outputs, so XLA sees one custom call whose output layout it cannot
// change (an XLA scatter or gather of the rows followed by a transpose is what this replaces).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/api.h"
#include "cuda/workspace/workspace.h"

namespace jmo::cuda {

// q_t [C, 128 tiles] e4m3 and s [tiles, C] float32 from x [M, C] (dt: float32 or bfloat16, C a positive multiple of
// 128) grouped as group_sizes [G] (device data), by the rules of common/fp8_columns.h, bitwise what the CPU handler
// writes (ffi/cpu/quantize_columns.cc) for valid sizes; negative sizes count as 0 and groups are clipped at M rows, as
// in the grouped GEMMs. tiles >= ceil(M / 128) + G. Hopper only (Fp8DeviceCheck), like the GEMM its output feeds.
Status QuantizeColumnsFp8(cudaStream_t stream, DType dt, const void* x, int64_t M, int64_t C, int64_t G,
                          const int32_t* group_sizes, int64_t tiles, void* q_t, float* s);

// The same from rows given row-quantized: xq [M, C] e4m3 and their 1 x 128 scales xs [M, C / 128] (fp8.quantize_rows),
// each value dequantized in registers (value times scale, one float32 product: DequantizeE4m3's rule); bitwise the
// CPU handler's on these rows. C a positive multiple of kRowsE4m3Channels (256: the kernel's item).
Status QuantizeColumnsFp8FromRows(cudaStream_t stream, const void* xq, const float* xs, int64_t M, int64_t C, int64_t G,
                                  const int32_t* group_sizes, int64_t tiles, void* q_t, float* s);

}  // namespace jmo::cuda
