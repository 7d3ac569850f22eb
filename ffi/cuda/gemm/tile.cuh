// One output tile of a matrix product, computed by one CTA of kTileThreads threads: what the tile engines share
// (the tensor-core tile, gemm/sm80/mma_tile.cuh, and the SIMT tile, gemm/simt_tile.cuh), the inner engines of the
// producer of expert_combine (ops/expert_producer.cuh) and of the bare grouped GEMMs (ops/grouped_gemm.cu).
//
//   C[m, n] = sum_k A[m, k] * B[k, n]     for m < tile.m, n < tile.n, fp32 accumulation,
//
// where A and B are read through row-major storage with a leading dimension, either as stored or transposed:
//   A:  kTransA ? a[k * lda + m] : a[m * lda + k]
//   B:  kTransB ? b[n * ldb + k] : b[k * ldb + n]
// so one engine covers x @ W (forward), dy @ W^T (input gradient: no transposed copy of W) and x^T @ dy (weight
// gradient: the rows of a group are the reduction). Rows/columns past the valid extents are neither read nor written.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device/convert.cuh"

namespace jmo::cuda {

template <typename T, typename OutT>
struct TileArgs {
  const T* a;
  int64_t lda;
  const T* b;
  int64_t ldb;
  OutT* c;
  int64_t ldc;
  int m, n, k;  // valid extents: m <= BM, n <= kTileN, k >= 0 (k == 0 gives zeros)
};

constexpr int kTileN = 128;  // columns of every tile
constexpr int kTileThreads = 256;

// Stores the element pair (v0, v1) at columns (col, col + 1) of row `row`, each only if inside the valid extents.
template <typename OutT>
__device__ __forceinline__ void StorePair(OutT* c, int64_t ldc, int row, int col, int m, int n, float v0, float v1) {
  if (row >= m || col >= n) return;
  OutT* p = c + (int64_t)row * ldc + col;
  if (col + 1 < n && (reinterpret_cast<uintptr_t>(p) % (2 * sizeof(OutT))) == 0) {
    if constexpr (sizeof(OutT) == 4)
      *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
    else
      *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
  } else {
    p[0] = FromFloat<OutT>(v0);
    if (col + 1 < n) p[1] = FromFloat<OutT>(v1);
  }
}

}  // namespace jmo::cuda
