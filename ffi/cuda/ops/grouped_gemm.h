// Bare grouped GEMMs on CUDA (no workspace, no peers): the expert GEMMs of the MoE layer that do not feed the
// return all-to-all (GEMM1 forward, and the backward pass), each on the engine SelectGemmEngine (gemm/engine.h) picks
// for its operands on the current device, as the producer of expert_combine does. Group sizes are device data (the
// routing inside jit): the kernels read them on the device, so a call never synchronizes with the host.
//
// A call with an empty output launches one empty kernel (LaunchEmpty), so that it can be traced into a CUDA graph.
//
// Groups are consecutive row blocks starting at row 0: group g owns rows [off_g, off_g + size_g), off_g the sum of
// the sizes before it. Negative sizes count as 0 and groups are clipped at M rows (the callers' plans never produce
// either; ragged_dot leaves them undefined).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/api.h"
#include "cuda/workspace/workspace.h"

namespace jmo::cuda {

// Largest group count (the group offsets live in shared memory).
constexpr int64_t kMaxGroups = 1024;

// out [M, N] = lhs [M, K] @ rhs[g]  for the rows of group g, with rhs [G, K, N] or, transpose_rhs, [G, N, K] read as
// its transpose (the input gradient dy @ W^T without a transposed copy of W). Rows past the last group are zero.
// out_f32: float32 output, else the input dtype. fp32 accumulation. sms > 0: the wgmma engine runs on at most that
// many SMs (the loopback harness's per-rank SM budget); 0: all of the device's.
Status GroupedMatmul(cudaStream_t stream, DType dt, bool out_f32, const void* lhs, int64_t M, int64_t K,
                     const void* rhs, int64_t G, int64_t N, bool transpose_rhs, const int32_t* group_sizes, void* out,
                     int sms = 0);

// out [G, K, N] = per group g: lhs[rows of g]^T @ rhs[rows of g], lhs [M, K], rhs [M, N] (the weight gradient);
// zero for empty groups. out_f32 as above.
Status GroupedOuter(cudaStream_t stream, DType dt, bool out_f32, const void* lhs, int64_t M, int64_t K,
                    const void* rhs, int64_t N, int64_t G, const int32_t* group_sizes, void* out);

// GEMM1 of the expert MLP with its SwiGLU epilogue: h [M, F] (lhs's dtype) = silu(lhs @ rhs[g][:, :F]) *
// (lhs @ rhs[g][:, F:]) for the rows of group g, rhs [G, K, 2F], computed in float32; a [M, 2F] = the preactivation
// lhs @ rhs[g] in a_dt (kF32, or dt: the float32 values rounded once), or nullptr when the caller does not keep it.
// Where an engine of the device has the SwiGLU epilogue for these operands (SelectGemmEngine with
// GemmEpilogue::kSwiGlu, gemm/engine.h: the wgmma engine) one kernel applies the SwiGLU to the accumulators;
// elsewhere GroupedMatmul writes a and a second kernel computes h from it, so a must be given there, in float32
// (InvalidArgument otherwise, naming the rule that refused). Rows past the last group are zero in h and a. sms as
// GroupedMatmul's.
Status GroupedMatmulSwiGlu(cudaStream_t stream, DType dt, const void* lhs, int64_t M, int64_t K, const void* rhs,
                           int64_t G, int64_t F, const int32_t* group_sizes, void* h, void* a, DType a_dt,
                           int sms = 0);

// The backward GEMM of the expert MLP with the SwiGLU's gradient in its epilogue: dh = lhs @ rhs[g] (rhs [G, K, F], or
// [G, F, K] read transposed with transpose_rhs: dh = d_out @ W2^T) for the rows of group g, computed in float32 tile
// by tile and never stored; da [M, 2F] (lhs's dtype) = (d_gate, d_up), the input gradient of silu(a[:, :F]) *
// a[:, F:] at the preactivation a [M, 2F] (a_dt: float32, or lhs's dtype; taken to float32; device/activation.cuh's
// SwiGluGrad). Rows past the last group are zero. Only where an engine of the device has the epilogue for these
// operands (SelectGemmEngine with GemmEpilogue::kSwiGluGrad: the wgmma engine); InvalidArgument elsewhere, naming the
// rule that refused (the caller asks first: jax_moe_overlap/engines.py). sms as GroupedMatmul's.
Status GroupedMatmulSwiGluGrad(cudaStream_t stream, DType dt, const void* lhs, int64_t M, int64_t K, const void* rhs,
                               int64_t G, int64_t F, bool transpose_rhs, const int32_t* group_sizes, const void* a,
                               DType a_dt, void* da, int sms = 0);

// The FP8 block-scaled grouped GEMM (DeepSeek-V3's recipe; ffi/common/grouped_gemm_signature.h states the math and
// the layouts): out [M, N] (bfloat16, or float32 with out_f32) from lhs [M, K] e4m3 with its 1 x 128 scales
// lhs_scales [K/128, scales_ld] (MN-major), rhs [G, N, K] e4m3 (K-major) with its 128 x 128 block scales
// rhs_scales [G, N/128, K/128]; rows past the last group are zero. Runs the e4m3 wgmma kernel of
// gemm/sm90/wgmma_grouped_fp8.cuh, on Hopper only (Fp8GroupedGemmDeviceRefusal, gemm/engine.h): elsewhere, and in a
// build without sm_90a code, a kFailedPrecondition error naming the requirement; operands the kernel does not take
// (K or N not multiples of 128, the scales' stride, alignment) are kInvalidArgument naming the rule. sms as
// GroupedMatmul's.
Status GroupedMatmulFp8(cudaStream_t stream, bool out_f32, const void* lhs, const float* lhs_scales,
                        int64_t scales_ld, int64_t M, int64_t K, const void* rhs, const float* rhs_scales, int64_t G,
                        int64_t N, const int32_t* group_sizes, void* out, int sms = 0);

// The FP8 GEMM1 with the recipe's SwiGLU forward in its epilogue (grouped_gemm_signature.h,
// jmo_grouped_matmul_swiglu_fp8): GroupedMatmulFp8's product a = lhs @ rhs[g]^T (N = 2F: rhs [G, 2F, K], the gate's F
// rows then the up projection's, rhs_scales [G, 2F/128, K/128]) kept in registers, and from it what
// SwiGluForwardFp8 (ops/swiglu_forward_fp8.h) writes, bit for bit: h_q [M, F] e4m3 and h_s [M, F/128] (h =
// SwiGLU(a) quantized 1 x 128), a_q [M, 2F] e4m3 and a_s [M, 2F/128] (a quantized 1 x 128; both null: not kept,
// not written); rows past the last group as those two calls leave them (zero bytes, scales 2^-126). Runs
// gemm/sm90/wgmma_swiglu_fp8.cuh, on Hopper only, with GroupedMatmulFp8's errors (F a positive multiple of 128
// besides its rules). sms as GroupedMatmul's.
Status GroupedMatmulSwiGluFp8(cudaStream_t stream, const void* lhs, const float* lhs_scales, int64_t scales_ld,
                              int64_t M, int64_t K, const void* rhs, const float* rhs_scales, int64_t G, int64_t F,
                              const int32_t* group_sizes, uint8_t* h_q, float* h_s, uint8_t* a_q, float* a_s,
                              int sms = 0);

// The FP8 weight-gradient GEMM (grouped_gemm_signature.h, jmo_grouped_outer_fp8): out [G, K, N] (bfloat16, or
// float32 with out_f32) from lhs_t [K, Mp] and rhs_t [N, Mp] e4m3, each group's rows from a multiple of 128 (padding
// zero), with their 128 x 1 scales [Mp/128, ld] (lhs_ld >= K, rhs_ld >= N). Runs the e4m3 wgmma kernel of
// gemm/sm90/wgmma_outer_fp8.cuh, on Hopper only, with GroupedMatmulFp8's errors (kFailedPrecondition naming the
// requirement elsewhere or without sm_90a code, kInvalidArgument naming the rule for operands it does not take).
Status GroupedOuterFp8(cudaStream_t stream, bool out_f32, const void* lhs_t, const float* lhs_scales, int64_t lhs_ld,
                       int64_t K, const void* rhs_t, const float* rhs_scales, int64_t rhs_ld, int64_t N, int64_t Mp,
                       int64_t G, const int32_t* group_sizes, void* out, int sms = 0);

// The group rules of the grouped calls: 1 .. kMaxGroups groups, fewer than 2^31 rows; kInvalidArgument naming `op`
// otherwise.
Status CheckSizes(const char* op, int64_t M, int64_t G);

// The FP8 calls' device rule: Hopper FP8 tensor cores (Fp8GroupedGemmDeviceRefusal, gemm/engine.h) on the current
// device (*dev: its facts), else kFailedPrecondition naming the requirement. Every FP8 call checks it, the
// quantizer of the wgrad operands (ops/quantize_columns.cu) too: its output feeds only the Hopper kernels.
Status Fp8DeviceCheck(const char* op, DeviceInfo* dev);

}  // namespace jmo::cuda
