// The row-copy kernels of the push probes (row_push_probe.cu alone on the GPU, push_beside_gemm_probe.cu beside a
// running grouped GEMM): rows of `row` bytes from src row r to dst row dst_row[r], by C CTAs, by 16-byte warp copies
// (the dispatch's CopyRowWarp / CopyRowPairWarp), by StreamBands (expert_combine's consumer, each row a band) and by a
// lean ring of bulk copies (one bulk load and one bulk store per row).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/device/copy.cuh"
#include "cuda/device/ptx.cuh"
#include "cuda/transport/bulk_push.cuh"
#include "probe_common.cuh"  // CK

namespace row_copy {
using namespace jmo::cuda;


// Warp copies: warp w of CTA b takes rows b * W + w, + C * W, ...; pair = two rows per step (CopyRowPairWarp).
template <bool kPair>
__global__ void WarpRowsKernel(const char* src, char* dst, const int32_t* dst_row, int64_t rows, int64_t row) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
  int64_t r = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if constexpr (kPair) {
    for (; r + warps < rows; r += 2 * warps)
      CopyRowPairWarp(dst + (int64_t)dst_row[r] * row, src + r * row, dst + (int64_t)dst_row[r + warps] * row,
                      src + (r + warps) * row, row, lane);
  }
  for (; r < rows; r += (kPair ? 2 : 1) * warps) CopyRowWarp(dst + (int64_t)dst_row[r] * row, src + r * row, row, lane);
}

// Bulk copies: issuer i (lane 0 of warp i) of CTA b streams rows b + (i + j * I) * C, j = 0, 1, ... through its own
// ring of `slots` slots of kChunk bytes.
template <int kChunk>
__global__ void BulkRowsKernel(const char* src, char* dst, const int32_t* dst_row, int64_t rows, int64_t row,
                               int issuers, int slots) {
  extern __shared__ __align__(128) char smem[];
  const int w = threadIdx.x / 32;
  if (threadIdx.x % 32 != 0 || w >= issuers) return;
  const int64_t step = (int64_t)issuers * gridDim.x, first = blockIdx.x + (int64_t)w * gridDim.x;
  const int count = first < rows ? (int)((rows - 1 - first) / step + 1) : 0;
  if (count == 0) return;
  auto ready = [](int, bool) { return true; };
  auto band_of = [&](int i) {
    const int64_t r = first + (int64_t)i * step;
    return PushBand{src + r * row, dst + (int64_t)dst_row[r] * row, row};
  };
  auto done = [](int) {};
  StreamBands<kChunk>(count, ready, band_of, done, smem + (int64_t)w * PushRingBytes<kChunk>(slots), slots,
                      slots - 1 < kPushReadLag ? slots - 1 : kPushReadLag);
}
// An issuer's shared memory for LeanBulkRowsKernel: its slots' mbarriers (128-aligned), then the slots (128-aligned
// rows).
__host__ __device__ constexpr int64_t LeanBarBytes(int slots) { return (slots * 8 + 127) / 128 * 128; }
__host__ __device__ constexpr int64_t LeanRingBytes(int slots, int64_t row) {
  return LeanBarBytes(slots) + slots * ((row + 127) / 128 * 128);
}

// Lean bulk copies: issuer i (lane 0 of warp i) of CTA b copies rows b + (i + j * I) * C, j = 0, 1, ..., each row one
// bulk load into a slot of its own ring of kSlots row-sized slots and one bulk store from it, with no bookkeeping but
// the pipeline: the load of row j is issued kAhead rows before its store, and a slot is reloaded once the store that
// read it kSlots rows earlier has finished reading (stores committed before load j: j - kAhead, so at most
// kSlots - kAhead - 1 may still read). What one issuing thread can move per SM when each row costs two instructions.
template <int kSlots, int kAhead>
__global__ void LeanBulkRowsKernel(const char* src, char* dst, const int32_t* dst_row, int64_t rows, int64_t row,
                                   int issuers) {
  static_assert(kAhead >= 1 && kAhead < kSlots, "loads ahead of stores, within the ring");
  using namespace jmo::ptx;
  extern __shared__ __align__(128) char smem[];
  const int w = threadIdx.x / 32;
  if (threadIdx.x % 32 != 0 || w >= issuers) return;
  const int64_t slot_bytes = (row + 127) / 128 * 128;
  char* base = smem + (int64_t)w * LeanRingBytes(kSlots, row);
  uint64_t* bars = reinterpret_cast<uint64_t*>(base);
  char* ring = base + LeanBarBytes(kSlots);
  for (int s = 0; s < kSlots; ++s) MbarInit(SmemAddr(&bars[s]), 1);
  MbarInitFence();
  const int64_t step = (int64_t)issuers * gridDim.x, first = blockIdx.x + (int64_t)w * gridDim.x;
  const int count = first < rows ? (int)((rows - 1 - first) / step + 1) : 0;
  for (int j = 0; j < count + kAhead; ++j) {
    if (j < count) {
      const int s = j % kSlots;
      if (j >= kSlots) bulk::WaitStoresRead<kSlots - kAhead - 1>();
      MbarArriveExpectTx(SmemAddr(&bars[s]), (uint32_t)row);
      bulk::Load(SmemAddr(ring + s * slot_bytes), src + (first + (int64_t)j * step) * row, (uint32_t)row,
                 SmemAddr(&bars[s]));
    }
    const int k = j - kAhead;
    if (k >= 0) {
      const int s = k % kSlots;
      MbarWait(SmemAddr(&bars[s]), (uint32_t)((k / kSlots) & 1));
      bulk::Store(dst + (int64_t)dst_row[first + (int64_t)k * step] * row, SmemAddr(ring + s * slot_bytes),
                  (uint32_t)row);
    }
  }
  bulk::WaitStores<0>();
}
// LeanBulkRowsKernel<kSlots, kAhead> prepared for `issuers` rings of `row`-byte slots: the launch's dynamic shared
// memory, or 0 where the rings do not fit one SM (227 KiB).
template <int kSlots, int kAhead>
inline int PrepareLeanBulkRows(int issuers, int64_t row) {
  const int smem = issuers * (int)LeanRingBytes(kSlots, row);
  if (smem > 227 * 1024) return 0;
  CK(cudaFuncSetAttribute((const void*)LeanBulkRowsKernel<kSlots, kAhead>,
                          cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  return smem;
}

// The probes' rows on the host side (CK from probe_common.cuh): `bytes` of a fixed pattern in src, dst to copy into
// (both device buffers: src on the current device, dst there too or, with dst_device >= 0, on that device, which the
// current one must reach by peer access), and per row size the destination row of each source row (a fixed random
// permutation, on the device) with the bytes dst must hold after the copy.
struct RowBuffers {
  char *src, *dst;
  std::vector<unsigned char> host;  // src's bytes
};
inline RowBuffers MakeRowBuffers(int64_t bytes, int dst_device = -1) {
  RowBuffers b{nullptr, nullptr, std::vector<unsigned char>(bytes)};
  CK(cudaMalloc(&b.src, bytes));
  int here = 0;
  CK(cudaGetDevice(&here));
  if (dst_device >= 0) CK(cudaSetDevice(dst_device));
  CK(cudaMalloc(&b.dst, bytes));
  CK(cudaSetDevice(here));
  for (int64_t i = 0; i < bytes; ++i) b.host[i] = (unsigned char)((i * 2654435761ull) >> 13);
  CK(cudaMemcpy(b.src, b.host.data(), bytes, cudaMemcpyHostToDevice));
  return b;
}
struct RowPerm {
  int32_t* dst_row;                 // [rows], device
  std::vector<unsigned char> want;  // dst after the copy: rows * row bytes
};
inline RowPerm MakeRowPerm(const RowBuffers& b, int64_t rows, int64_t row) {
  std::vector<int32_t> perm(rows);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(1234));
  RowPerm p{nullptr, std::vector<unsigned char>(rows * row)};
  CK(cudaMalloc(&p.dst_row, rows * sizeof(int32_t)));
  CK(cudaMemcpy(p.dst_row, perm.data(), rows * sizeof(int32_t), cudaMemcpyHostToDevice));
  for (int64_t r = 0; r < rows; ++r) memcpy(&p.want[(int64_t)perm[r] * row], &b.host[r * row], row);
  return p;
}

}  // namespace row_copy
