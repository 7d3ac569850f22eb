// Hopper (sm_90a) e4m3 grouped "outer" GEMM, the weight gradient of DeepSeek-V3's FP8 recipe (arXiv 2412.19437
// section 3.3): both operands scaled per 128 x 1 tile (per channel, per 128 rows of a group), "1D1D". WgmmaLoop
// (wgmma_mainloop.cuh) over the e4m3 operand format with row scales on both sides (Fp8Operands<Fp8MnMajorScalesA,
// Fp8RowScalesB>, wgmma_mainloop_fp8.cuh), on the bf16 outer GEMM's tile schedule (wgmma_outer.cuh).
//
//   out[g][m, n] = sum over the 128-row chunks kc of group g of
//                  (sum_{r in kc} lhs_t[m, r] * rhs_t[n, r]) * lhs_scales[kc][m] * rhs_scales[kc][n]
//   out[g] = 0 for a group without rows
//
// i.e. lhs[rows of g]^T @ rhs[rows of g] with both dequantized per 128 x 1 tile, written token-contiguous: FP8 wgmma
// reads both operands K-major only, so the reduction axis (the rows, tokens) is the contiguous one of both.
//   lhs_t        [K, Mp] e4m3: lhs transposed, each group's rows starting at a multiple of 128 ("padded"): group g's
//                rows are columns P_g .. P_g + size_g - 1, P_g = sum_{h<g} ceil(size_h / 128) * 128; the columns
//                P_g + size_g .. P_{g+1} - 1 (the padding of g's last chunk) must hold zeros (e4m3 +-0), those from
//                min(P_G, Mp) on are never read
//   lhs_scales   [Mp/128, lhs_scales_ld] float32: the scale of channel m in chunk kc at lhs_scales[kc * ld + m]
//                (fp8.quantize_columns' scales: [tiles, channels]); ld >= K, ld % 4 == 0 (16-byte TMA rows)
//   rhs_t        [N, Mp] e4m3, rhs_scales [Mp/128, rhs_scales_ld] float32 (ld >= N, ld % 4 == 0): the same for rhs
//   group_sizes  [G] int32 in device memory (the groups' real row counts; negative count as 0; the padded offsets
//                P_g are clipped at Mp)
//   out          [G, K, N] float32 or bfloat16
// Requires Mp, K, N positive multiples of 128 (Mp < 2^31 - 128), 16-byte aligned lhs_t, rhs_t, both scales and out,
// 1 <= G <= 1024; returns cudaErrorInvalidValue (after printing the rule) otherwise, cudaErrorNotSupported on a device
// that is not compute capability 9.x or a build without sm_90a code.
//
// ---- Design ----------------------------------------------------------------------------------------------------
//   * Tiles: (group g, 128 rows of out[g] = channels m0.. of lhs, 256 columns = channels n0.. of rhs); a tile
//     reduces over its group's chunks P_g / 128 .. P_{g+1} / 128 - 1 (KRangeTile: A's rows are lhs_t's, B is rhs_t
//     as a one-group [1, N, Mp]). One stage = one chunk = one scale tile of both operands, promoted per element
//     (part * float32(sa[m] * sb[n]) into the float32 accumulators) once per chunk.
//   * Schedule: the bf16 outer's: groups by descending chunk count (BuildOuterTables, kRowAlign = 128), m-tile
//     fastest inside a group, positions dealt "snake" style over the persistent CTAs (SnakeTiles). Only groups with
//     rows get tiles (a WgmmaLoop tile reduces over at least one chunk); the outputs of the others are zeroed by all
//     CTAs before the loop.
//   * Padding: a group's last chunk multiplies its padding columns, zeros in both operands (the caller writes them:
//     grouped_gemm.grouped_outer_fp8 pads in XLA), so no masking in the kernel.
//   * Registers and smem: the FP8 format's (producer 40, consumers 232); 4 stages of 48 KB + 1,664 B of scales (sa
//     528 B, sb 2 x 512 B) plus the group tables (static, 12 KB).
#pragma once

#include <cuda.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "cuda/gemm/sm90/wgmma_grouped_fp8.cuh"
#include "cuda/gemm/sm90/wgmma_mainloop_fp8.cuh"
#include "cuda/gemm/sm90/wgmma_outer.cuh"

namespace wgmma_outer {

using Fp8OuterOperands = Fp8Operands<Fp8MnMajorScalesA, Fp8RowScalesB>;
constexpr int kOuterFp8SmemBytes = LoopSmemBytes<kStages, Fp8OuterOperands::kExtraBytes>();

template <bool kOutF32>
__global__ void __launch_bounds__(kThreads, 1)
    GroupedOuterFp8Kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                          const __grid_constant__ CUtensorMap tm_sa, const __grid_constant__ CUtensorMap tm_sb,
                          const int32_t* __restrict__ group_sizes, int G, int Mp, int K, int N,
                          void* __restrict__ out) {
  extern __shared__ __align__(1024) char smem_raw[];
  __shared__ int row_start[kOuterMaxGroups + 1];  // padded group row offsets P_g (clipped at Mp)
  __shared__ int order[kOuterMaxGroups + 1];      // groups by descending chunk count, those with rows first
  __shared__ int key[kOuterMaxGroups + 1];        // chunk count per group
  __shared__ int live;                            // groups with rows
  constexpr int64_t kOutBytes = kOutF32 ? 4 : 2;
  BuildOuterTables<kFp8BK, kFp8BK>(group_sizes, G, Mp, row_start, order, key, &live);
  const int n_live = live;

  // out[g] = 0 for the groups without rows (order[n_live..G)), 16-byte stores striped over the grid.
  const int64_t group_chunks = (int64_t)K * N * kOutBytes / 16;
  for (int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x; i < (G - n_live) * group_chunks;
       i += (int64_t)gridDim.x * kThreads) {
    const int64_t j = i / group_chunks;
    reinterpret_cast<int4*>(out)[order[n_live + j] * group_chunks + (i - j * group_chunks)] = make_int4(0, 0, 0, 0);
  }

  const OuterTables tables{row_start, order, K / kBM, (N + kBN - 1) / kBN};
  auto tile_of = [&](int p) {
    const OuterTile o = DecodeOuterTile(p, tables);
    KRangeTile t;
    t.a_row = o.m0;
    t.b_idx = 0;
    t.n0 = o.n0;
    t.rows = kBM;
    t.cols = min(kBN, N - o.n0);
    t.out = static_cast<unsigned char*>(out) + (((int64_t)o.g * K + o.m0) * N + o.n0) * kOutBytes;
    t.ldc = N;
    t.k_first = o.r0 / kFp8BK;
    t.k_steps = o.rows / kFp8BK;
    return t;
  };
  const Fp8OuterOperands ops{&tm_a, &tm_b, &tm_sa, {&tm_sb}};
  // (K of the loop: unused, every tile is a KRangeTile)
  WgmmaLoop<Fp8OuterOperands, kOutF32>(ops, kFp8BK, n_live * tables.m_tiles * tables.n_tiles,
                                       SnakeTiles{(int)blockIdx.x, (int)gridDim.x}, tile_of, NoTileDone{}, smem_raw);
}

// Why the FP8 outer GEMM does not take these operands (a constant sentence naming the rule), or nullptr.
inline const char* GroupedOuterFp8Refusal(int64_t Mp, int64_t K, int64_t N, int64_t G, int64_t lhs_scales_ld,
                                          int64_t rhs_scales_ld, const void* lhs_t, const void* lhs_scales,
                                          const void* rhs_t, const void* rhs_scales, const void* out) {
  if (Mp < kFp8BK || Mp % kFp8BK != 0 || Mp > 0x7fffffff - kFp8BK)
    return "Mp (the padded rows) must be a positive multiple of 128 below 2^31 - 128";
  if (K < kScaleChunk || K % kScaleChunk != 0 || K > 0x7fffffff)
    return "K (lhs's channels, out's rows) must be a positive multiple of 128";
  if (N < kScaleChunk || N % kScaleChunk != 0 || N > 0x7fffffff)
    return "N (rhs's channels, out's columns) must be a positive multiple of 128";
  if (G < 1 || G > kOuterMaxGroups) return "the group count must be in [1, 1024]";
  if (G * (K / kBM) * ((N + kBN - 1) / kBN) > 0x7fffffff - (1 << 16))
    return "the tile count G * K/128 * ceil(N/256) must be below 2^31 - 2^16";
  if (lhs_scales_ld < K || lhs_scales_ld % 4 != 0)
    return "lhs_scales_ld must be >= K and a multiple of 4 (lhs_scales [Mp/128, ld]: 16-byte rows for TMA)";
  if (rhs_scales_ld < N || rhs_scales_ld % 4 != 0)
    return "rhs_scales_ld must be >= N and a multiple of 4 (rhs_scales [Mp/128, ld]: 16-byte rows for TMA)";
  if ((reinterpret_cast<uintptr_t>(lhs_t) | reinterpret_cast<uintptr_t>(rhs_t) |
       reinterpret_cast<uintptr_t>(lhs_scales) | reinterpret_cast<uintptr_t>(rhs_scales) |
       reinterpret_cast<uintptr_t>(out)) % 16)
    return "lhs_t, rhs_t, lhs_scales, rhs_scales and out must be 16-byte aligned";
  return nullptr;
}

// The four tensor maps of Fp8OuterOperands, behind CachedMapSet (16 entries): A = lhs_t [K, Mp] e4m3 as (Mp, K) box
// (128, 128); B = rhs_t [N, Mp] e4m3 as (Mp, N, 1) box (128, 128, 1), both 128B swizzled; the scales [Mp/128, ld]
// float32 as (K, Mp/128) box (kFp8SaRows = 132, 1) and (N, Mp/128) box (128, 1), unswizzled. All with OOB zero fill.
inline cudaError_t CachedOuterFp8Maps(const void* a, const float* sa, int64_t sa_ld, int64_t K, const void* b,
                                      const float* sb, int64_t sb_ld, int64_t N, int64_t Mp, CUtensorMap* maps) {
  struct Key {
    const void* a;
    const void* sa;
    const void* b;
    const void* sb;
    int64_t sa_ld, sb_ld, K, N, Mp;
    bool operator==(const Key& o) const {
      return a == o.a && sa == o.sa && b == o.b && sb == o.sb && sa_ld == o.sa_ld && sb_ld == o.sb_ld && K == o.K &&
             N == o.N && Mp == o.Mp;
    }
  };
  return CachedMapSet<Key, 16, 4>(Key{a, sa, b, sb, sa_ld, sb_ld, K, N, Mp}, maps, [&](CUtensorMap* m) {
    const cuuint64_t chunks = (cuuint64_t)(Mp / kFp8BK);
    const cuuint64_t sa_dims[2] = {(cuuint64_t)K, chunks}, sa_strides[1] = {(cuuint64_t)sa_ld * sizeof(float)};
    const cuuint32_t sa_box[2] = {kFp8SaRows, 1};
    const cuuint64_t sb_dims[2] = {(cuuint64_t)N, chunks}, sb_strides[1] = {(cuuint64_t)sb_ld * sizeof(float)};
    const cuuint32_t sb_box[2] = {kBN / 2, 1};
    if (!EncodeFp8AMap(&m[0], a, K, Mp, Mp, "e4m3 lhs_t [K, Mp]") ||
        !EncodeFp8BMap(&m[1], b, 1, N, Mp, "e4m3 rhs_t [N, Mp]") ||
        !EncodeMap(&m[2], sa, 2, sa_dims, sa_strides, sa_box, "lhs scales [Mp/128, ld]",
                   CU_TENSOR_MAP_DATA_TYPE_FLOAT32, CU_TENSOR_MAP_SWIZZLE_NONE) ||
        !EncodeMap(&m[3], sb, 2, sb_dims, sb_strides, sb_box, "rhs scales [Mp/128, ld]",
                   CU_TENSOR_MAP_DATA_TYPE_FLOAT32, CU_TENSOR_MAP_SWIZZLE_NONE))
      return cudaErrorInvalidValue;
    return cudaSuccess;
  });
}

}  // namespace wgmma_outer

// out [G, K, N] = per group g: (lhs_t dequantized)[:, rows of g] @ (rhs_t dequantized)[:, rows of g]^T (the header
// comment). Returns cudaErrorInvalidValue (and prints the rule) for operands it does not take, cudaErrorNotSupported
// on a device or build without sm_90a support.
inline cudaError_t WgmmaGroupedOuterFp8(const __nv_fp8_e4m3* lhs_t, const float* lhs_scales, int64_t lhs_scales_ld,
                                        int64_t K, const __nv_fp8_e4m3* rhs_t, const float* rhs_scales,
                                        int64_t rhs_scales_ld, int64_t N, int64_t Mp, int64_t G,
                                        const int32_t* group_sizes_dev, void* out, bool out_f32, int num_sms,
                                        cudaStream_t stream) {
  using namespace wgmma_outer;
  const char* why = GroupedOuterFp8Refusal(Mp, K, N, G, lhs_scales_ld, rhs_scales_ld, lhs_t, lhs_scales, rhs_t,
                                           rhs_scales, out);
  if (why == nullptr && num_sms <= 0) why = "num_sms must be positive";
  if (why != nullptr) {
    fprintf(stderr, "WgmmaGroupedOuterFp8: Mp=%lld K=%lld N=%lld G=%lld lhs_scales_ld=%lld rhs_scales_ld=%lld: %s\n",
            (long long)Mp, (long long)K, (long long)N, (long long)G, (long long)lhs_scales_ld,
            (long long)rhs_scales_ld, why);
    return cudaErrorInvalidValue;
  }
  CUtensorMap maps[4];
  const cudaError_t e =
      CachedOuterFp8Maps(lhs_t, lhs_scales, lhs_scales_ld, K, rhs_t, rhs_scales, rhs_scales_ld, N, Mp, maps);
  if (e != cudaSuccess) return e;
  const int64_t tiles = G * (K / kBM) * ((N + kBN - 1) / kBN);
  const int grid = (int)(tiles < num_sms ? tiles : num_sms);
  const int g = (int)G, mp = (int)Mp, k = (int)K, n = (int)N;
  return LaunchWgmmaKernel(out_f32 ? GroupedOuterFp8Kernel<true> : GroupedOuterFp8Kernel<false>, grid,
                           kOuterFp8SmemBytes, stream, maps[0], maps[1], maps[2], maps[3], group_sizes_dev, g, mp, k,
                           n, out);
}
