// The FP8 column quantizer's kernel of commit cb5e3ee (the first one checked bit for bit against the CPU handler on an
// H200), kept as the probe's baseline (quantize_columns_probe.cu): one CTA per (128 x 1 tile, 128 channels), 256
// threads; each CTA derives the group tables (BuildRowOffsets + BlockExclusiveScan), loads its tile's rows into
// registers (16 rows x 4 channels a thread), combines the warps' amaxes through shared memory, quantizes by IEEE
// division and RoundE4m3, packs 4 rows of a channel per word into a swizzled channel-major buffer and stores each
// channel's 128 bytes.
#pragma once

#include <cuda_bf16.h>

#include "common/fp8_columns.h"
#include "cuda/ops/group_offsets.cuh"
#include "cuda/ops/grouped_gemm.h"

namespace jmo::cuda::qcols_v0 {

constexpr int kCtaThreads = kTileThreads;  // BlockExclusiveScan's CTA size
constexpr int kCtaWarps = kCtaThreads / 32;
constexpr int kChannels = 128;                            // channels of a CTA: 4 per lane
constexpr int kRowsPerWarp = kColumnTile / kCtaWarps;        // 16
constexpr int kWordsPerChannel = kColumnTile / 4;         // 32: a channel's 128 bytes as words
static_assert(kRowsPerWarp % 4 == 0 && kWordsPerChannel == 32, "a warp's rows pack into whole words; one per lane");

// Four consecutive channels as float32 (exact from bfloat16).
__device__ __forceinline__ float4 Load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 Load4(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xFFFF0000u), __uint_as_float(u.y << 16),
                     __uint_as_float(u.y & 0xFFFF0000u));
}

// The place of word w of channel c's row in the packed buffer (c's row of 32 words, XOR-swizzled by c / 4).
__device__ __forceinline__ int PackedWord(int c, int w) { return c * kWordsPerChannel + (w ^ ((c >> 2) & 31)); }

// Three CTAs per SM (the register cap that sets; 31 KB of shared memory each): enough loads in flight for a kernel
// that only moves bytes.
template <typename T>
__global__ void __launch_bounds__(kCtaThreads, 3) QuantizeColumnsKernel(const T* __restrict__ x, int64_t M, int64_t C,
                                                                  const int32_t* __restrict__ sizes, int G,
                                                                  int64_t Mp, uint8_t* __restrict__ q_t,
                                                                  float* __restrict__ s) {
  __shared__ int32_t row_off[kMaxGroups + 1];
  __shared__ int32_t tile_off[kMaxGroups + 1];
  __shared__ float part[kCtaWarps][kChannels];  // each warp's amax per channel
  __shared__ float scale[kChannels];
  __shared__ uint32_t packed[kChannels * kWordsPerChannel];
  BuildRowOffsets(sizes, G, M, row_off);
  BlockExclusiveScan(G, [&](int g) { return (int32_t)ColumnTilesOf(row_off[g + 1] - row_off[g]); }, tile_off);
  const int64_t t = blockIdx.x;
  const int64_t c0 = (int64_t)blockIdx.y * kChannels;
  const ColumnTileRows tile = PlaceColumnTile(t, row_off, tile_off, G);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, row0 = warp * kRowsPerWarp;

  float v[kRowsPerWarp][4];
  float amax[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
    if (row0 + k < tile.rows) {
      f = Load4(x + (tile.first + row0 + k) * C + c0 + 4 * lane);
      amax[0] = AmaxStep(amax[0], f.x);
      amax[1] = AmaxStep(amax[1], f.y);
      amax[2] = AmaxStep(amax[2], f.z);
      amax[3] = AmaxStep(amax[3], f.w);
    }
    v[k][0] = f.x;
    v[k][1] = f.y;
    v[k][2] = f.z;
    v[k][3] = f.w;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) part[warp][4 * lane + j] = amax[j];
  __syncthreads();
  if (threadIdx.x < kChannels) {
    // The warps' amaxes are >= 0 or NaN, so AmaxStep over them is the tile's amax over all its rows.
    float m = 0.f;
#pragma unroll
    for (int w = 0; w < kCtaWarps; ++w) m = AmaxStep(m, part[w][threadIdx.x]);
    const float sc = ColumnTileScale(m);
    scale[threadIdx.x] = sc;
    s[t * C + c0 + threadIdx.x] = sc;
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int c = 4 * lane + j;
    const float sc = scale[c];
#pragma unroll
    for (int m = 0; m < kRowsPerWarp / 4; ++m) {
      uint32_t word = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int k = 4 * m + b;
        const uint32_t q = row0 + k < tile.rows ? QuantizeE4m3(v[k][j], sc) : 0u;
        word |= q << (8 * b);
      }
      packed[PackedWord(c, row0 / 4 + m)] = word;
    }
  }
  __syncthreads();
  for (int c = warp; c < kChannels; c += kCtaWarps)
    reinterpret_cast<uint32_t*>(q_t + (c0 + c) * Mp + t * kColumnTile)[lane] = packed[PackedWord(c, lane)];
}


inline cudaError_t Launch(cudaStream_t stream, DType dt, const void* x, int64_t M, int64_t C, int64_t G,
                          const int32_t* group_sizes, int64_t tiles, void* q_t, float* s) {
  const dim3 grid((unsigned)tiles, (unsigned)(C / kChannels));
  const int64_t Mp = kColumnTile * tiles;
  if (dt == DType::kF32)
    QuantizeColumnsKernel<float><<<grid, kCtaThreads, 0, stream>>>(static_cast<const float*>(x), M, C, group_sizes,
                                                                   (int)G, Mp, static_cast<uint8_t*>(q_t), s);
  else
    QuantizeColumnsKernel<__nv_bfloat16><<<grid, kCtaThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), M, C,
                                                                           group_sizes, (int)G, Mp,
                                                                           static_cast<uint8_t*>(q_t), s);
  return cudaGetLastError();
}

}  // namespace jmo::cuda::qcols_v0
