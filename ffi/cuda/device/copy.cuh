// Block- and warp-wide copies of global memory (ld.global.cg loads: the source may have been written by another SM or
// GPU during the kernel), used by the dispatch and by the consumer's fallback path.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device/convert.cuh"

namespace jmo::cuda {

// Block-wide copy of `bytes` from src to dst: 16-byte vectors when both are 16-byte aligned, else 4 or 2 bytes.
// Loads bypass L1 (ld.global.cg): the source may have been written by another SM or GPU during this kernel.
__device__ inline void CopyBytes(char* dst, const char* src, int64_t bytes, int64_t tid, int64_t nthreads) {
  const uintptr_t align = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  if ((align & 15) == 0) {
    const int64_t n = bytes / 16;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t i = tid; i < n; i += nthreads) d[i] = __ldcg(s + i);
    for (int64_t i = n * 16 + tid; i < bytes; i += nthreads) dst[i] = src[i];
  } else if ((align & 3) == 0) {
    const int64_t n = bytes / 4;
    const unsigned* s = reinterpret_cast<const unsigned*>(src);
    unsigned* d = reinterpret_cast<unsigned*>(dst);
    for (int64_t i = tid; i < n; i += nthreads) d[i] = __ldcg(s + i);
    for (int64_t i = n * 4 + tid; i < bytes; i += nthreads) dst[i] = src[i];
  } else {
    const int64_t n = bytes / 2;
    const unsigned short* s = reinterpret_cast<const unsigned short*>(src);
    unsigned short* d = reinterpret_cast<unsigned short*>(dst);
    for (int64_t i = tid; i < n; i += nthreads) d[i] = __ldcg(s + i);
    for (int64_t i = n * 2 + tid; i < bytes; i += nthreads) dst[i] = src[i];
  }
}

// CopyBytes for big contiguous ranges (the consumer's bands, the dispatch's recv rows into its output): with 16-byte
// alignment, each thread first issues kUnroll independent 16-byte loads, then the stores, so an SM keeps
// 256 x 16 x 16 B = 64 KiB in flight (one load at a time per thread leaves a copy bound by load latency).
__device__ inline void CopyBand(char* dst, const char* src, int64_t bytes, int64_t tid, int64_t nthreads) {
  constexpr int kUnroll = 16;
  const uintptr_t align = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  if ((align & 15) != 0) {
    CopyBytes(dst, src, bytes, tid, nthreads);
    return;
  }
  const int64_t n = bytes / 16;
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  int64_t i = tid;
  for (; i + (kUnroll - 1) * nthreads < n; i += kUnroll * nthreads) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldcg(s + i + u * nthreads);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[i + u * nthreads] = v[u];
  }
  for (; i < n; i += nthreads) d[i] = __ldcg(s + i);
  for (int64_t j = n * 16 + tid; j < bytes; j += nthreads) dst[j] = src[j];
}

// The n 16-byte vectors of one row by one warp (every lane calls it): each lane first issues up to kUnroll independent
// 16-byte loads, then the stores, so a warp keeps 32 x 8 x 16 B = 4 KiB in flight (a 2048-wide bf16 row at once); each
// vector passes through f on its way (a copy: CopyVector). One load at a time per lane (CopyBytes) would leave the
// dispatch bound by load latency. The row is 16-byte aligned (the callers check).
struct CopyVector {
  __device__ uint4 operator()(uint4 v) const { return v; }
};
template <typename F>
__device__ inline void MoveVectorsWarp(uint4* d, const uint4* s, F f, int64_t n, int lane) {
  constexpr int kUnroll = 8;
  for (int64_t base = lane; base < n; base += 32 * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + 32 * u < n) v[u] = __ldcg(s + base + 32 * u);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + 32 * u < n) d[base + 32 * u] = f(v[u]);
  }
}

// One row by one warp (every lane calls it with its lane index), for the dispatch's row pushes: MoveVectorsWarp's copy
// with 16-byte alignment, CopyBytes without it.
__device__ inline void CopyRowWarp(char* dst, const char* src, int64_t bytes, int lane) {
  const uintptr_t align = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  if ((align & 15) != 0) {
    CopyBytes(dst, src, bytes, lane, 32);
    return;
  }
  const int64_t n = bytes / 16;
  MoveVectorsWarp(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src), CopyVector{}, n, lane);
  for (int64_t j = n * 16 + lane; j < bytes; j += 32) dst[j] = src[j];
}

// The 16-byte vectors of two rows of n vectors each by one warp (every lane calls it), both rows' loads issued before
// any store, so a warp keeps 8 KiB in flight for 4 KiB rows; each vector passes through f0 (row 0) or f1 (row 1) on
// its way (a copy: CopyVector). The rows are 16-byte aligned (the callers check).
template <typename F0, typename F1>
__device__ inline void MoveVectorPairWarp(uint4* d0, const uint4* s0, F0 f0, uint4* d1, const uint4* s1, F1 f1,
                                          int64_t n, int lane) {
  constexpr int kUnroll = 8;
  for (int64_t base = lane; base < n; base += 32 * kUnroll) {
    uint4 v0[kUnroll], v1[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + 32 * u < n) {
        v0[u] = __ldcg(s0 + base + 32 * u);
        v1[u] = __ldcg(s1 + base + 32 * u);
      }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + 32 * u < n) {
        d0[base + 32 * u] = f0(v0[u]);
        d1[base + 32 * u] = f1(v1[u]);
      }
  }
}

// Two rows of `bytes` each by one warp (every lane calls it): MoveVectorPairWarp's copy. Falls back to two
// CopyRowWarp calls without 16-byte alignment.
__device__ inline void CopyRowPairWarp(char* dst0, const char* src0, char* dst1, const char* src1, int64_t bytes,
                                       int lane) {
  const uintptr_t align = reinterpret_cast<uintptr_t>(dst0) | reinterpret_cast<uintptr_t>(src0) |
                          reinterpret_cast<uintptr_t>(dst1) | reinterpret_cast<uintptr_t>(src1) | (uintptr_t)bytes;
  if ((align & 15) != 0) {
    CopyRowWarp(dst0, src0, bytes, lane);
    CopyRowWarp(dst1, src1, bytes, lane);
    return;
  }
  MoveVectorPairWarp(reinterpret_cast<uint4*>(dst0), reinterpret_cast<const uint4*>(src0), CopyVector{},
                     reinterpret_cast<uint4*>(dst1), reinterpret_cast<const uint4*>(src1), CopyVector{}, bytes / 16,
                     lane);
}

// A 16-byte vector of T (float or __nv_bfloat16) times s: each element in float32, rounded once to T (round to
// nearest even), as XLA computes (s * src.astype(f32)).astype(T).
template <typename T>
struct ScaleVector {
  float s;
  __device__ uint4 operator()(uint4 v) const {
    T* e = reinterpret_cast<T*>(&v);
#pragma unroll
    for (int i = 0; i < (int)(16 / sizeof(T)); ++i) e[i] = FromFloat<T>(ToFloat(e[i]) * s);
    return v;
  }
};

// One row of `cols` elements of T by one warp, each element times s (ScaleVector's rule): dst = src * s. With
// 16-byte alignment MoveVectorsWarp's scaled vectors, the elements past the last whole vector (and without it every
// element) one by one.
template <typename T>
__device__ inline void ScaleRowWarp(char* dst, const char* src, int64_t cols, float s, int lane) {
  constexpr int V = 16 / sizeof(T);
  const T* sp = reinterpret_cast<const T*>(src);
  T* dp = reinterpret_cast<T*>(dst);
  const uintptr_t align = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  const int64_t n = (align & 15) == 0 ? cols / V : 0;
  MoveVectorsWarp(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src), ScaleVector<T>{s}, n, lane);
  for (int64_t j = n * V + lane; j < cols; j += 32) dp[j] = FromFloat<T>(ToFloat(__ldcg(sp + j)) * s);
}

// Two rows of `cols` elements of T by one warp, row i times s_i (ScaleVector's rule), both rows' loads in flight
// before any store (MoveVectorPairWarp). Falls back to two ScaleRowWarp calls unless both rows are whole 16-byte
// vectors at 16-byte aligned addresses.
template <typename T>
__device__ inline void ScaleRowPairWarp(char* dst0, const char* src0, float s0, char* dst1, const char* src1, float s1,
                                        int64_t cols, int lane) {
  const uintptr_t align = reinterpret_cast<uintptr_t>(dst0) | reinterpret_cast<uintptr_t>(src0) |
                          reinterpret_cast<uintptr_t>(dst1) | reinterpret_cast<uintptr_t>(src1) |
                          (uintptr_t)(cols * (int64_t)sizeof(T));
  if ((align & 15) != 0) {
    ScaleRowWarp<T>(dst0, src0, cols, s0, lane);
    ScaleRowWarp<T>(dst1, src1, cols, s1, lane);
    return;
  }
  MoveVectorPairWarp(reinterpret_cast<uint4*>(dst0), reinterpret_cast<const uint4*>(src0), ScaleVector<T>{s0},
                     reinterpret_cast<uint4*>(dst1), reinterpret_cast<const uint4*>(src1), ScaleVector<T>{s1},
                     cols * (int64_t)sizeof(T) / 16, lane);
}

__device__ inline void ZeroBytes(char* dst, int64_t bytes, int64_t tid, int64_t nthreads) {
  if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    const int64_t n = bytes / 16;
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t i = tid; i < n; i += nthreads) d[i] = make_uint4(0, 0, 0, 0);
    for (int64_t i = n * 16 + tid; i < bytes; i += nthreads) dst[i] = 0;
  } else {
    for (int64_t i = tid; i < bytes; i += nthreads) dst[i] = 0;
  }
}

}  // namespace jmo::cuda
