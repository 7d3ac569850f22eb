// Warp and block scans over integers (exact in any order), shared by the segment table, the resource
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
// warps past the last segment, skips its shuffles), each warp's totals to `sums` (entry k * 32 + warp: a value's
// totals contiguous, read as vectors; K * 32 entries of shared memory), then every thread adds the totals of the warps
// before its own from shared memory (broadcast loads, independent of each other: no shuffle rounds after the
// barrier; 32-bit words: one load per lane and two redux.sync per value instead). Every thread calls it; `sums` must
// not be written again before a later barrier. T: int64_t, or uint32_t where the caller bounds every sum below 2^32
// (half the shuffles and adds, no loop over the warps). Integer sums: exact in any order (mod 2^32 for uint32_t).
template <int K, class T = int64_t>
__device__ inline void BlockExclusiveScanN(const T (&v)[K], T* sums, T (&before)[K], T (&total)[K]) {
  static_assert(sizeof(T) == 8 || sizeof(T) == 4, "64- or 32-bit words");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  T incl[K];
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
        T y;
        if constexpr (sizeof(T) == 8)
          y = (T)__shfl_up_sync(0xffffffffu, (long long)incl[k], o);
        else
          y = (T)__shfl_up_sync(0xffffffffu, (unsigned)incl[k], o);
        if (lane >= o) incl[k] += y;
      }
    }
  }
  if (lane == 31) {
#pragma unroll
    for (int k = 0; k < K; ++k) sums[k * 32 + warp] = incl[k];
  }
  __syncthreads();
  if constexpr (sizeof(T) == 4) {
    // Lane w holds warp w's totals; two redux.sync give the sum over the warps before this one and over all.
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const unsigned s = lane < warps ? (unsigned)sums[k * 32 + lane] : 0u;
      total[k] = (T)__reduce_add_sync(0xffffffffu, s);
      before[k] = incl[k] - v[k] + (T)__reduce_add_sync(0xffffffffu, lane < warp ? s : 0u);
    }
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      before[k] = incl[k] - v[k];
      total[k] = 0;
    }
#pragma unroll 4
    for (int w = 0; w < warps; ++w) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const T s = sums[k * 32 + w];
        if (w < warp) before[k] += s;
        total[k] += s;
      }
    }
  }
}

}  // namespace jmo::cuda
