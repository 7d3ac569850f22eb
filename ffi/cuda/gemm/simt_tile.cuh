// The SIMT tile engine (any architecture): one output tile per CTA, as gemm/tile.cuh describes it, for float32
// operands or operands the tensor-core tile does not take. Each thread: BM/16 rows x 8 columns.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device/convert.cuh"
#include "cuda/gemm/tile.cuh"

namespace jmo::cuda {

constexpr int kSimtBK = 16;

template <int BM>
constexpr int SimtSmemBytes() { return kSimtBK * (BM + kTileN) * 4; }

template <int BM, bool kTransA, bool kTransB, typename T, typename OutT>
__device__ void SimtTile(const TileArgs<T, OutT>& t, char* smem) {
  constexpr int RM = BM / 16;
  float* As = reinterpret_cast<float*>(smem);  // [BK][BM]
  float* Bs = As + kSimtBK * BM;               // [BK][BN]
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  float acc[RM][8];
#pragma unroll
  for (int i = 0; i < RM; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
  for (int k0 = 0; k0 < t.k; k0 += kSimtBK) {
#pragma unroll
    for (int i = 0; i < BM * kSimtBK / kTileThreads; ++i) {
      const int idx = tid + i * kTileThreads;
      // The contiguous dimension of the stored operand varies fastest across threads (coalesced loads).
      const int r = kTransA ? idx % BM : idx / kSimtBK, kk = kTransA ? idx / BM : idx % kSimtBK;
      const bool ok = r < t.m && k0 + kk < t.k;
      As[kk * BM + r] = ok ? ToFloat(kTransA ? t.a[(int64_t)(k0 + kk) * t.lda + r] : t.a[(int64_t)r * t.lda + k0 + kk])
                           : 0.f;
    }
#pragma unroll
    for (int i = 0; i < kTileN * kSimtBK / kTileThreads; ++i) {
      const int idx = tid + i * kTileThreads;
      const int c = kTransB ? idx / kSimtBK : idx % kTileN, kk = kTransB ? idx % kSimtBK : idx / kTileN;
      const bool ok = k0 + kk < t.k && c < t.n;
      Bs[kk * kTileN + c] =
          ok ? ToFloat(kTransB ? t.b[(int64_t)c * t.ldb + k0 + kk] : t.b[(int64_t)(k0 + kk) * t.ldb + c]) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kSimtBK; ++kk) {
      float a[RM], b[8];
#pragma unroll
      for (int i = 0; i < RM; ++i) a[i] = As[kk * BM + ty * RM + i];
#pragma unroll
      for (int j = 0; j < 8; ++j) b[j] = Bs[kk * kTileN + tx + 16 * j];
#pragma unroll
      for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < RM; ++i) {
    const int r = ty * RM + i;
    if (r >= t.m) continue;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int c = tx + 16 * j;
      if (c < t.n) t.c[(int64_t)r * t.ldc + c] = FromFloat<OutT>(acc[i][j]);
    }
  }
}

}  // namespace jmo::cuda
