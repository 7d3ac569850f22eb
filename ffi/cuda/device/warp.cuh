// Warp and block scans over 64-bit integers (exact in any order), shared by the segment table, the resource
// manager's device side and the grouped GEMM's group scans.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jmo::cuda {

// Inclusive prefix sum of v over the 32 lanes of a warp (all lanes call it).
__device__ __forceinline__ long long WarpInclusiveSum(long long v, int lane) {
  long long incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const long long y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  return incl;
}

// Inclusive prefix sum of v over the threads of the CTA (in thread order) and the total; every thread calls it.
// warp_sums: blockDim.x / 32 entries of shared memory (blockDim.x a multiple of 32). Integer sums: exact in any order.
__device__ inline int64_t BlockInclusiveScan(int64_t v, int64_t* warp_sums, int64_t* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = WarpInclusiveSum(v, lane);
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  int64_t before = 0, all = 0;
  for (int w = 0; w < warps; ++w) {
    if (w < warp) before += warp_sums[w];
    all += warp_sums[w];
  }
  __syncthreads();  // warp_sums is free for the next scan
  *total = all;
  return v + before;
}

// Exclusive prefix sums of K values per thread over the threads of the CTA (in thread order) and their totals, with
// one barrier: the warps' scans (the K values' shuffles interleaved; a warp whose values are all zero, such as the
// warps past the last segment, skips its shuffles), each warp's totals to `sums` (entry warp * K + k;
// K * 32 entries of shared memory), then every thread adds the totals of the warps before its own from shared memory
// (broadcast loads, independent of each other: no shuffle rounds after the barrier). Every thread calls it; `sums`
// must not be written again before a later barrier. Integer sums: exact in any order.
template <int K>
__device__ inline void BlockExclusiveScanN(const int64_t (&v)[K], int64_t* sums, int64_t (&before)[K],
                                           int64_t (&total)[K]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  int64_t incl[K];
#pragma unroll
  for (int k = 0; k < K; ++k) incl[k] = v[k];
  bool nonzero = false;
#pragma unroll
  for (int k = 0; k < K; ++k) nonzero = nonzero || v[k] != 0;
  if (__any_sync(0xffffffffu, nonzero)) {  // warp-uniform
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const long long y = __shfl_up_sync(0xffffffffu, (long long)incl[k], o);
        if (lane >= o) incl[k] += y;
      }
    }
  }
  if (lane == 31) {
#pragma unroll
    for (int k = 0; k < K; ++k) sums[warp * K + k] = incl[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    before[k] = incl[k] - v[k];
    total[k] = 0;
  }
#pragma unroll 4
  for (int w = 0; w < warps; ++w) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t s = sums[w * K + k];
      if (w < warp) before[k] += s;
      total[k] += s;
    }
  }
}

}  // namespace jmo::cuda
