// Grouped bf16 GEMMs for Hopper (sm_90a) on CUTLASS's sm90 ptr-array grouped GEMM
// (TMA + warp-specialized wgmma, persistent group tile scheduler).
//
// This header only declares the entry points, so that callers (e.g. an XLA FFI handler) need
// neither the CUTLASS headers nor nvcc's template work; the kernels live in
// cutlass_grouped_gemm.cu (variants A/B) and cutlass_grouped_outer.cu (variant C).
//
// Contract common to all entry points:
//   * group_sizes_dev is read on the DEVICE only (no host sync, graph-capture friendly except
//     for the first call / workspace growth, see CutlassGroupedGemmReserve). Groups are
//     consecutive row ranges starting at row 0; negative sizes count as 0 and the running sum is
//     clamped to M (rows past M are ignored).
//   * K % 8 == 0 and N % 8 == 0 (TMA needs 16-byte row pitches), all pointers 16-byte aligned,
//     0 <= G <= 1024 (one 1024-thread block builds the per-group arguments).
//   * Everything is stream-ordered on `stream`; a returned error is either a validation error
//     (cudaErrorInvalidValue, nothing launched) or the first failing CUDA/CUTLASS status.
//   * The per-group argument arrays and CUTLASS's workspace are cached per (device, stream) and
//     grown (never shrunk) when a larger G needs more room; two calls on the same stream are
//     ordered by the stream, calls on different streams get different buffers.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

// Variants A/B: out[r, :] = lhs[r, :] @ rhs[g(r)] for rows r of group g; rows >= min(sum, M)
// are set to zero.
//   lhs [M, K] row-major bf16.
//   rhs_k_major == false (A): rhs [G, K, N] row-major.
//   rhs_k_major == true  (B): rhs [G, N, K] row-major ("transposed weights").
//   out [M, N] row-major, bf16 (out_f32 == false) or float32; accumulation is fp32 either way.
cudaError_t CutlassGroupedGemm(const __nv_bfloat16* lhs, int64_t M, int64_t K,
                               const __nv_bfloat16* rhs, int64_t G, int64_t N, bool rhs_k_major,
                               const int32_t* group_sizes_dev, void* out, bool out_f32,
                               cudaStream_t stream);

// Variant C (weight gradient, "tgmm"): out[g] = lhs[rows of g]^T @ rhs2[rows of g], fp32.
//   lhs [M, K] row-major bf16, rhs2 [M, N] row-major bf16, out [G, K, N] row-major float32.
//   Groups with no rows get out[g] == 0.
cudaError_t CutlassGroupedOuter(const __nv_bfloat16* lhs, int64_t M, int64_t K,
                                const __nv_bfloat16* rhs2, int64_t N, int64_t G,
                                const int32_t* group_sizes_dev, float* out, cudaStream_t stream);

// Optional: allocate the cached buffers for up to max_groups groups on (current device, stream)
// ahead of time, e.g. before a CUDA-graph capture (cudaMalloc/cudaFree inside a capture are not
// allowed, and growth synchronizes the stream before freeing the old buffer).
cudaError_t CutlassGroupedGemmReserve(int64_t max_groups, cudaStream_t stream);

// Human-readable description of the compiled CUTLASS configuration (tile, cluster, schedule).
const char* CutlassGroupedGemmConfig();
