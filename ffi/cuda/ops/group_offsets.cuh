// The group tables the bare grouped-GEMM kernels (ops/grouped_gemm.cu) and the FP8 column quantizer
// (ops/quantize_columns.cu) derive on the device from the group sizes, each CTA for itself (no host synchronization):
// block scans of per-group values into shared memory, and the search of a scanned table.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/gemm/tile.cuh"

namespace jmo::cuda {

__device__ __forceinline__ int32_t SaturateInt32(int64_t x) { return static_cast<int32_t>(min(x, (int64_t)INT32_MAX)); }

// out[0..G] = exclusive prefix sums of value(g) >= 0 over g < G (out[G] = total), computed by the whole CTA of
// kTileThreads threads: each thread sums a contiguous chunk, a Hillis-Steele scan combines the chunk sums, then each
// thread writes its chunk's prefixes. The sums saturate at INT32_MAX: group sizes are a public op's operand, and
// garbage ones must not wrap to negative row offsets (the callers clip to the rows there are).
template <typename ValueFn>
__device__ inline void BlockExclusiveScan(int G, ValueFn value, int32_t* out) {
  __shared__ int32_t part[kTileThreads];
  const int tid = threadIdx.x;
  const int per = (G + kTileThreads - 1) / kTileThreads;
  const int lo = min(G, tid * per), hi = min(G, lo + per);
  int64_t sum = 0;
  for (int g = lo; g < hi; ++g) sum += value(g);
  part[tid] = SaturateInt32(sum);
  __syncthreads();
  for (int off = 1; off < kTileThreads; off *= 2) {
    const int32_t v = tid >= off ? part[tid - off] : 0;
    __syncthreads();
    part[tid] = SaturateInt32((int64_t)part[tid] + v);
    __syncthreads();
  }
  int64_t run = tid ? part[tid - 1] : 0;
  for (int g = lo; g < hi; ++g) {
    out[g] = SaturateInt32(run);
    run += value(g);
  }
  if (tid == kTileThreads - 1) out[G] = part[tid];
  __syncthreads();
}

// Row offsets of the groups, clipped to [0, M]: row_off[g] = min(M, sizes[0] + ... + sizes[g-1]) (negatives as 0).
__device__ inline void BuildRowOffsets(const int32_t* sizes, int G, int64_t M, int32_t* row_off) {
  BlockExclusiveScan(G, [&](int g) { return max(0, sizes[g]); }, row_off);
  for (int g = threadIdx.x; g <= G; g += blockDim.x) row_off[g] = (int32_t)min((int64_t)row_off[g], M);
  __syncthreads();
}

__device__ __forceinline__ int FindGroup(const int32_t* off, int G, int32_t x) {  // last g with off[g] <= x
  int lo = 0, hi = G - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (off[mid] <= x) lo = mid; else hi = mid - 1;
  }
  return lo;
}

}  // namespace jmo::cuda
