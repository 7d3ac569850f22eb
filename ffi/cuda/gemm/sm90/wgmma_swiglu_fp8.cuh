// Hopper (sm_90a) FP8 GEMM1 of the expert MLP with the recipe's SwiGLU forward in its epilogue
// (jmo_grouped_matmul_swiglu_fp8): the e4m3 grouped GEMM of wgmma_grouped_fp8.cuh (the same mainloop, operand format
// and promotion, so each float32 accumulator is bit for bit the one grouped_matmul_fp8 stores) over tiles of 128 rows
// x 128 columns of h, each computed from the gate's 128 columns n0.. and the up projection's F + n0.. (n_hi), and
// instead of a [M, 2F] float32 the epilogue writes what jmo_swiglu_forward_fp8 makes of it (ops/swiglu_forward_fp8.cu):
//
//   h = SwiGlu(gate, up) in float32 (common/swiglu.h)
//   (h_q [M, F] e4m3, h_s [M, F/128])  = fp8.quantize_rows(h)   1 x 128: GEMM2's operand
//   (a_q [M, 2F] e4m3, a_s [M, 2F/128]) = fp8.quantize_rows(a)  1 x 128: what the backward keeps
//
// by steps that give that kernel's results bit for bit (its logistic by SwiGluSigmoids, the amax by MaxAbsNaN over
// float32 results instead of AmaxStep, ColumnTileScale, the quantizer by QuantizerOfTileScale instead of QuantizerOf,
// the words by QuantizeWords: swiglu_fp8_epilogue.cuh), so the outputs are bitwise those of
// swiglu_forward_fp8(grouped_matmul_fp8(...)) on the device. Rows past the groups (min(sum(group_sizes), M) .. M - 1)
// get what those two calls give a zero row: zero bytes and scales ColumnTileScale(0) = 2^-126.
//
// The epilogue: SwiGluFp8TileOf<true> (swiglu_fp8_epilogue.cuh), its stores staged in kSwiGluFp8StageBytes of shared
// memory after the group tables (kSwiGluFp8SmemBytes in all: 217,712 bytes of the 232,448 an sm_90 CTA may have).
#pragma once

#include <cuda.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/swiglu.h"
#include "cuda/gemm/sm90/swiglu_fp8_epilogue.cuh"
#include "cuda/gemm/sm90/wgmma_grouped_fp8.cuh"
#include "cuda/ops/fp8_rows.cuh"

namespace wgmma_gemm {

// Rows [first, M) of a [M, width] float32 scale array -> ColumnTileScale(0) (the scale of a zero row tile), striped
// over every thread of the grid.
__device__ __forceinline__ void ZeroRowScales(float* s, int64_t first, int64_t M, int64_t width) {
  const float zero_scale = jmo::ColumnTileScale(0.f);
  for (int64_t i = first * width + (int64_t)blockIdx.x * kThreads + threadIdx.x; i < M * width;
       i += (int64_t)gridDim.x * kThreads)
    s[i] = zero_scale;
}

// The dynamic shared memory of GroupedSwiGluFp8Kernel: the FP8 grouped GEMM's (the loop's and the group tables), then
// the epilogue's staging from the next 16-byte boundary.
constexpr int kSwiGluFp8StageOffset = (GroupedSmemBytes<Fp8BlockScaledOperands>() + 15) / 16 * 16;
constexpr int kSwiGluFp8SmemBytes = kSwiGluFp8StageOffset + kSwiGluFp8StageBytes;
static_assert(kSwiGluFp8SmemBytes <= 232448, "an sm_90 CTA's shared memory (227 KiB) holds the loop and the staging");

// The kernel: group tables, rows past the groups, the grouped schedule over F / 128 column tiles per 128-row block
// (PlaceSwiGluTile's, GroupedSwiGluKernel's), the loop over the e4m3 operands with SwiGluFp8TileOf<true>'s epilogue.
__global__ void __launch_bounds__(kThreads, 1)
    GroupedSwiGluFp8Kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                           const __grid_constant__ CUtensorMap tm_sa, const float* __restrict__ sb,
                           const int32_t* __restrict__ group_sizes, int G, int M, int F, int K,
                           uint8_t* __restrict__ h_q, float* __restrict__ h_s, uint8_t* __restrict__ a_q,
                           float* __restrict__ a_s) {
  extern __shared__ __align__(1024) char smem_raw[];
  const Fp8BlockScaledOperands ops{&tm_a, &tm_b, &tm_sa, {sb, 2 * F / kScaleChunk, K / kScaleChunk}};
  int* row_start = reinterpret_cast<int*>(smem_raw + LoopSmemBytes<kStages, Fp8BlockScaledOperands::kExtraBytes>());
  int* tile_start = row_start + (kMaxGroups + 1);
  const int n_tiles = F / kSwiGluFp8Cols;
  const int64_t C = 2 * (int64_t)F;
  BuildGroupTables(group_sizes, G, M, n_tiles, row_start, tile_start);
  ZeroPadRows(h_q, row_start[G], M, F, 1);
  ZeroRowScales(h_s, row_start[G], M, n_tiles);
  if (a_q != nullptr) {
    ZeroPadRows(a_q, row_start[G], M, C, 1);
    ZeroRowScales(a_s, row_start[G], M, 2 * n_tiles);
  }
  auto tile_of = [&](int t) {
    SwiGluFp8TileOf<true> tile;
    const TilePlace p = PlaceSwiGluTile(t, row_start, tile_start, G, n_tiles, F, tile);
    tile.out = nullptr;
    tile.ldc = 0;
    tile.h_q = h_q + (int64_t)tile.a_row * F + tile.n0;
    tile.h_s = h_s + (int64_t)tile.a_row * n_tiles + p.nt;
    tile.a_q = a_q != nullptr ? a_q + (int64_t)tile.a_row * C + tile.n0 : nullptr;  // (a not kept: not written)
    tile.a_s = a_q != nullptr ? a_s + (int64_t)tile.a_row * 2 * n_tiles + p.nt : nullptr;
    tile.F = F;
    tile.stage = SmemAddr(smem_raw + kSwiGluFp8StageOffset);
    return tile;
  };
  WgmmaLoop<Fp8BlockScaledOperands, /*kOutF32=*/true>(ops, K, tile_start[G], StaticTiles{(int)blockIdx.x,
                                                      (int)gridDim.x}, tile_of, NoTileDone{}, smem_raw);
}

// Why GroupedSwiGluFp8 does not take these operands (a constant sentence naming the rule), or nullptr: the FP8
// grouped GEMM's rules for N = 2F (GroupedGemmFp8Refusal), F a positive multiple of 128, the outputs 16-byte aligned.
inline const char* GroupedSwiGluFp8Refusal(int64_t M, int64_t K, int64_t F, int64_t G, int64_t lhs_scales_ld,
                                           const void* lhs, const void* lhs_scales, const void* rhs,
                                           const void* rhs_scales, const void* h_q, const void* h_s, const void* a_q,
                                           const void* a_s) {
  if (F < kSwiGluFp8Cols || F % kSwiGluFp8Cols != 0 || F > 0x3fffffff)
    return "F must be a positive multiple of 128 (whole 1 x 128 tiles of h and of each half of a), 2F below 2^31";
  if (const char* why = GroupedGemmFp8Refusal(M, K, 2 * F, G, lhs_scales_ld, lhs, lhs_scales, rhs, rhs_scales, h_q))
    return why;
  if ((reinterpret_cast<uintptr_t>(h_q) | reinterpret_cast<uintptr_t>(h_s) | reinterpret_cast<uintptr_t>(a_q) |
       reinterpret_cast<uintptr_t>(a_s)) % 16)
    return "h_q, h_s, a_q and a_s must be 16-byte aligned";
  if ((a_q == nullptr) != (a_s == nullptr)) return "a_q and a_s are both given (a kept) or both null";
  return nullptr;
}

// Host launch: lhs [M, K] e4m3 with lhs_scales [K/128, ld] (MN-major), rhs [G, 2F, K] e4m3 (K-major: the gate's F
// rows, then the up projection's) with rhs_scales [G, 2F/128, K/128]; h_q [M, F], h_s [M, F/128], a_q [M, 2F],
// a_s [M, 2F/128] (both null: a not kept, the epilogue quantizes h alone). Returns cudaErrorInvalidValue (after
// printing the rule) for operands it does not take, cudaErrorNotSupported on a device or build without sm_90a code.
inline cudaError_t GroupedSwiGluFp8(const __nv_fp8_e4m3* lhs, const float* lhs_scales, int64_t lhs_scales_ld,
                                    int64_t M, int64_t K, const __nv_fp8_e4m3* rhs, const float* rhs_scales, int64_t G,
                                    int64_t F, const int32_t* group_sizes_dev, uint8_t* h_q, float* h_s,
                                    uint8_t* a_q, float* a_s, int num_sms, cudaStream_t stream) {
  const char* why = GroupedSwiGluFp8Refusal(M, K, F, G, lhs_scales_ld, lhs, lhs_scales, rhs, rhs_scales, h_q, h_s,
                                            a_q, a_s);
  if (why != nullptr || num_sms <= 0)
    return RefuseFp8Launch("GroupedSwiGluFp8", M, K, "F", F, G, lhs_scales_ld, num_sms, why);
  CUtensorMap maps[3];
  const cudaError_t e = CachedFp8Maps(lhs, lhs_scales, lhs_scales_ld, M, K, rhs, G, 2 * F, maps);
  if (e != cudaSuccess) return e;
  return LaunchWgmmaKernel(GroupedSwiGluFp8Kernel, num_sms, kSwiGluFp8SmemBytes, stream, maps[0], maps[1], maps[2],
                           rhs_scales, group_sizes_dev, (int)G, (int)M, (int)F, (int)K, h_q, h_s, a_q, a_s);
}

}  // namespace wgmma_gemm
