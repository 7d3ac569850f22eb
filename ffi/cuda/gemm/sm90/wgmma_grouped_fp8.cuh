// Hopper (sm_90a) e4m3 grouped GEMM with DeepSeek-V3's block scaling (arXiv 2412.19437 section 3.3): wgmma.mma_async
// .e4m3 + TMA + mbarriers, warp-specialized, persistent; the grouped GEMM of wgmma_grouped.cuh over the FP8 operand
// format (wgmma_mainloop_fp8.cuh).
//
//   out[r, n] = sum_kc (sum_{k in kc} lhs[r, k] * rhs[g(r)][n, k]) * lhs_scales[kc][r] * rhs_scales[g(r)][n/128][kc]
//                                                     for rows r of group g (groups: consecutive row ranges from row 0)
//   out[r, :] = 0                                     for rows r >= min(sum(group_sizes), M)
//
// i.e. (lhs dequantized per 1 x 128 tile) @ (rhs[g] dequantized per 128 x 128 block)^T, each 128-wide K chunk's
// partial sums promoted to float32 registers with its two scales (kc: the chunks k = 128 kc .. 128 kc + 127).
//   lhs         [M, K] e4m3 (float8_e4m3fn), row-major
//   lhs_scales  [K/128, lhs_scales_ld] float32: the scale of row r's chunk kc at lhs_scales[kc * ld + r] (MN-major,
//               the layout TMA loads one chunk's scales of 128 rows from; ld >= M, ld % 4 == 0: 16-byte rows)
//   rhs         [G, N, K] e4m3, K-major (Fp8Weight.values' layout: the only B layout of FP8 wgmma)
//   rhs_scales  [G, N/128, K/128] float32 (Fp8Weight.scales' layout)
//   group_sizes [G] int32 in device memory (read by the kernel, no host sync; negative sizes count as 0, the sum is
//               clipped at M); out [M, N] bfloat16 or float32.
// Requires K % 128 == 0, N % 128 == 0 (whole scale blocks), 16-byte aligned lhs, rhs, lhs_scales and out, 4-byte
// aligned rhs_scales, 1 <= G <= 1024, 1 <= M < 2^31 - 128; returns cudaErrorInvalidValue (after printing the rule)
// otherwise, cudaErrorNotSupported on a device that is not compute capability 9.x or a build without sm_90a code.
//
// Tiles, schedule and epilogue are the bf16 grouped GEMM's: 128 rows x 256 columns per tile, group-major, bands of
// kBandM m-tiles; rows of the next group that a group's last tile loads are multiplied (with their own scales) but
// never stored.
#pragma once

#include <cuda.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "cuda/gemm/sm90/wgmma_grouped.cuh"
#include "cuda/gemm/sm90/wgmma_mainloop_fp8.cuh"

namespace wgmma_gemm {

constexpr int kFp8SmemBytes = GroupedSmemBytes<Fp8BlockScaledOperands>();

template <bool kOutF32, class Done>
__global__ void __launch_bounds__(kThreads, 1)
    GroupedGemmFp8Kernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                         const __grid_constant__ CUtensorMap tm_sa, const float* __restrict__ sb,
                         const int32_t* __restrict__ group_sizes, int G, int M, int N, int K, void* __restrict__ out,
                         Done done) {
  extern __shared__ __align__(1024) char smem_raw[];
  const Fp8BlockScaledOperands ops{&tm_a, &tm_b, &tm_sa, {sb, N / kScaleChunk, K / kScaleChunk}};
  GroupedGemmBody<Fp8BlockScaledOperands, kOutF32>(ops, group_sizes, G, M, N, K, out, done, smem_raw);
}

// Why the FP8 grouped GEMM does not take these operands (a constant sentence naming the rule), or nullptr.
inline const char* GroupedGemmFp8Refusal(int64_t M, int64_t K, int64_t N, int64_t G, int64_t lhs_scales_ld,
                                         const void* lhs, const void* lhs_scales, const void* rhs,
                                         const void* rhs_scales, const void* out) {
  if (M < 1 || M > 0x7fffffff - kBM) return "M (rows) must be in [1, 2^31 - 128)";
  if (K < kScaleChunk || K % kScaleChunk != 0 || K > 0x7fffffff)
    return "K must be a positive multiple of 128 (whole 1 x 128 and 128 x 128 scale tiles)";
  if (N < kScaleChunk || N % kScaleChunk != 0 || N > 0x7fffffff)
    return "N must be a positive multiple of 128 (whole 128 x 128 weight blocks)";
  if (G < 1 || G > kMaxGroups) return "the group count must be in [1, 1024]";
  if (G * (N / kScaleChunk) * (K / kScaleChunk) > 0x7fffffff)
    return "rhs_scales must have fewer than 2^31 entries (G * N/128 * K/128)";
  if (lhs_scales_ld < M || lhs_scales_ld % 4 != 0)
    return "lhs_scales_ld must be >= M and a multiple of 4 (lhs_scales [K/128, ld]: 16-byte rows for TMA)";
  if ((reinterpret_cast<uintptr_t>(lhs) | reinterpret_cast<uintptr_t>(rhs) |
       reinterpret_cast<uintptr_t>(lhs_scales) | reinterpret_cast<uintptr_t>(out)) % 16)
    return "lhs, rhs, lhs_scales and out must be 16-byte aligned";
  if (reinterpret_cast<uintptr_t>(rhs_scales) % 4) return "rhs_scales must be 4-byte aligned";
  return nullptr;
}

// An e4m3 launch that refuses its operands (why: the Refusal's sentence, or nullptr where only the grid is wrong):
// prints the kernel's name, the extents (n_name: what the columns are called) and the rule, returns
// cudaErrorInvalidValue.
inline cudaError_t RefuseFp8Launch(const char* kernel, int64_t M, int64_t K, const char* n_name, int64_t n, int64_t G,
                                   int64_t lhs_scales_ld, int num_sms, const char* why) {
  fprintf(stderr, "%s: M=%lld K=%lld %s=%lld G=%lld lhs_scales_ld=%lld num_sms=%d: %s\n", kernel, (long long)M,
          (long long)K, n_name, (long long)n, (long long)G, (long long)lhs_scales_ld, num_sms,
          why != nullptr ? why : "num_sms must be positive");
  return cudaErrorInvalidValue;
}

// The e4m3 operands' tensor maps of every FP8 loop (Fp8Operands' a_map and b_map), 128B swizzled, OOB zero fill:
// A, `rows` rows of K e4m3 values `stride` bytes apart, as (K, rows) box (128, 128);
inline bool EncodeFp8AMap(CUtensorMap* m, const void* a, int64_t rows, int64_t K, int64_t stride, const char* what) {
  const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)stride};
  const cuuint32_t box[2] = {kFp8BK, kBM};
  return EncodeMap(m, a, 2, dims, strides, box, what, CU_TENSOR_MAP_DATA_TYPE_UINT8);
}
// B [G, N, K] e4m3 (K-major) as (K, N, G) box (128, 128, 1).
inline bool EncodeFp8BMap(CUtensorMap* m, const void* b, int64_t G, int64_t N, int64_t K, const char* what) {
  const cuuint64_t dims[3] = {(cuuint64_t)K, (cuuint64_t)N, (cuuint64_t)G};
  const cuuint64_t strides[2] = {(cuuint64_t)K, (cuuint64_t)N * K};
  const cuuint32_t box[3] = {kFp8BK, kBN / 2, 1};
  return EncodeMap(m, b, 3, dims, strides, box, what, CU_TENSOR_MAP_DATA_TYPE_UINT8);
}

// The three tensor maps of Fp8BlockScaledOperands, behind CachedMapSet (32 entries): A [M, K] e4m3 as (K, M) box
// (128, 128); B [G, N, K] e4m3 as (K, N, G) box (128, 128, 1), both 128B swizzled; the A scales [K/128, ld] float32
// as (M, K/128) box (kFp8SaRows = 132, 1), unswizzled. All with OOB zero fill.
inline cudaError_t CachedFp8Maps(const void* a, const float* sa, int64_t sa_ld, int64_t M, int64_t K, const void* b,
                                 int64_t G, int64_t N, CUtensorMap* maps) {
  struct Key {
    const void* a;
    const void* sa;
    const void* b;
    int64_t sa_ld, M, K, G, N;
    bool operator==(const Key& o) const {
      return a == o.a && sa == o.sa && b == o.b && sa_ld == o.sa_ld && M == o.M && K == o.K && G == o.G && N == o.N;
    }
  };
  return CachedMapSet<Key, 32, 3>(Key{a, sa, b, sa_ld, M, K, G, N}, maps, [&](CUtensorMap* m) {
    const cuuint64_t s_dims[2] = {(cuuint64_t)M, (cuuint64_t)(K / kScaleChunk)};
    const cuuint64_t s_strides[1] = {(cuuint64_t)sa_ld * sizeof(float)};
    const cuuint32_t s_box[2] = {kFp8SaRows, 1};
    if (!EncodeFp8AMap(&m[0], a, M, K, K, "e4m3 A [M, K]") || !EncodeFp8BMap(&m[1], b, G, N, K, "e4m3 B [G, N, K]") ||
        !EncodeMap(&m[2], sa, 2, s_dims, s_strides, s_box, "A scales [K/128, ld]", CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
                   CU_TENSOR_MAP_SWIZZLE_NONE))
      return cudaErrorInvalidValue;
    return cudaSuccess;
  });
}

// WgmmaGroupedGemmFp8 with a tile_done callback (called with a GroupTile; see wgmma_mainloop.cuh for the contract).
template <class Done>
inline cudaError_t GroupedGemmFp8WithDone(const __nv_fp8_e4m3* lhs, const float* lhs_scales, int64_t lhs_scales_ld,
                                          int64_t M, int64_t K, const __nv_fp8_e4m3* rhs, const float* rhs_scales,
                                          int64_t G, int64_t N, const int32_t* group_sizes_dev, void* out,
                                          bool out_f32, int num_sms, Done done, cudaStream_t stream) {
  const char* why = GroupedGemmFp8Refusal(M, K, N, G, lhs_scales_ld, lhs, lhs_scales, rhs, rhs_scales, out);
  if (why != nullptr || num_sms <= 0)
    return RefuseFp8Launch("WgmmaGroupedGemmFp8", M, K, "N", N, G, lhs_scales_ld, num_sms, why);
  CUtensorMap maps[3];
  const cudaError_t e = CachedFp8Maps(lhs, lhs_scales, lhs_scales_ld, M, K, rhs, G, N, maps);
  if (e != cudaSuccess) return e;
  const int g = (int)G, m = (int)M, n = (int)N, k = (int)K;
  return out_f32 ? LaunchWgmmaKernel(GroupedGemmFp8Kernel<true, Done>, num_sms, kFp8SmemBytes, stream, maps[0],
                                     maps[1], maps[2], rhs_scales, group_sizes_dev, g, m, n, k, out, done)
                 : LaunchWgmmaKernel(GroupedGemmFp8Kernel<false, Done>, num_sms, kFp8SmemBytes, stream, maps[0],
                                     maps[1], maps[2], rhs_scales, group_sizes_dev, g, m, n, k, out, done);
}

}  // namespace wgmma_gemm

// Host launch (see the header comment). Returns cudaErrorInvalidValue (and prints the rule) for operands it does not
// take, cudaErrorNotSupported on a device or build without sm_90a support.
inline cudaError_t WgmmaGroupedGemmFp8(const __nv_fp8_e4m3* lhs, const float* lhs_scales, int64_t lhs_scales_ld,
                                       int64_t M, int64_t K, const __nv_fp8_e4m3* rhs, const float* rhs_scales,
                                       int64_t G, int64_t N, const int32_t* group_sizes_dev, void* out, bool out_f32,
                                       int num_sms, cudaStream_t stream) {
  return wgmma_gemm::GroupedGemmFp8WithDone(lhs, lhs_scales, lhs_scales_ld, M, K, rhs, rhs_scales, G, N,
                                            group_sizes_dev, out, out_f32, num_sms, wgmma_gemm::NoTileDone{},
                                            stream);
}
