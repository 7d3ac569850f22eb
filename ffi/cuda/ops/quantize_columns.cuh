// The kernels of jmo_quantize_columns_fp8 on CUDA (quantize_columns.h), by the rules of common/fp8_columns.h, as
// templates over the input form (the launcher, ops/quantize_columns.cu, instantiates the library's; the probe
// tools/probes/quantize_columns_probe.cu times them all):
//   RowsF32, RowsBf16  x [M, C] float32 or bfloat16;
//   RowsE4m3           x given row-quantized: e4m3 values [M, C] and float32 power-of-two scales [M, C / 128]
//                      (fp8.quantize_rows(pow2=True)), dequantized in registers (value * scale, exact).
// A work item is one (128 x 1 tile t, block of kCh channels): 256 threads, warp w holding the tile's rows 16 w ..
// 16 w + 15, each lane kLaneCh consecutive channels of them (one 16- or 8-byte load per row). Per item:
//   1. amax per channel over the warp's rows, then over the 8 warps in row order (smem);
//   2. the scale (ColumnTileScale), written to s, and the channel's quantizer constants (QuantizerOf);
//   3. each value quantized (QuantizeFour) and 4 consecutive rows of a channel packed into a word of a channel-major
//      shared buffer (a channel's 32 words XOR-swizzled by its lane, free of bank conflicts both ways);
//   4. each channel's 128 bytes stored to q_t[c, 128 t ..] (a warp per channel: one 128-byte segment).
// The schedule: QuantizeColumnsLean, one CTA per item, rows loaded into registers (the probe keeps the others it
// measured slower: tools/probes/quantize_columns_persistent.cuh).
// Quantization: ops/e4m3.cuh's Quantizer and QuantizeFour (QuotientFast), bitwise RoundE4m3(x / s).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/fp8_columns.h"
#include "cuda/ops/e4m3.cuh"
#include "cuda/ops/grouped_gemm.h"

namespace jmo::cuda::qcols {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerWarp = static_cast<int>(kColumnTile) / kWarps;  // 16
constexpr int kWordsPerChannel = static_cast<int>(kColumnTile) / 4;   // a channel's 128 bytes as 32 words
static_assert(kRowsPerWarp == 16 && kWordsPerChannel == 32, "a warp's rows pack into 4 words; a word per lane");

// ---- input forms: a lane's kLaneCh channels of one row (Raw), loaded from global ----

__device__ __forceinline__ float Bf16Lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float Bf16Hi(uint32_t u) { return __uint_as_float(u & 0xFFFF0000u); }

struct RowsF32 {
  static constexpr int kLaneCh = 4;
  using Raw = float4;
  const float* x;
  int64_t C;
  __device__ __forceinline__ Raw Load(int64_t row, int64_t c) const {
    return *reinterpret_cast<const float4*>(x + row * C + c);
  }
  __device__ __forceinline__ static void Values(const Raw& r, float (&v)[kLaneCh]) {
    v[0] = r.x, v[1] = r.y, v[2] = r.z, v[3] = r.w;
  }
};

// bfloat16 rows, kN channels a lane: 8 by 16-byte loads (an item of 256 channels), or 4 by 8-byte loads (128
// channels an item, for C not a multiple of 256 and a smaller stage).
template <int kN>
struct RowsBf16N {
  static_assert(kN == 4 || kN == 8, "8 or 16 bytes a lane");
  static constexpr int kLaneCh = kN;
  using Raw = std::conditional_t<kN == 8, uint4, uint2>;
  const __nv_bfloat16* x;
  int64_t C;
  __device__ __forceinline__ Raw Load(int64_t row, int64_t c) const {
    return *reinterpret_cast<const Raw*>(x + row * C + c);
  }
  __device__ __forceinline__ static void Values(const Raw& r, float (&v)[kLaneCh]) {
    v[0] = Bf16Lo(r.x), v[1] = Bf16Hi(r.x), v[2] = Bf16Lo(r.y), v[3] = Bf16Hi(r.y);
    if constexpr (kN == 8) v[4] = Bf16Lo(r.z), v[5] = Bf16Hi(r.z), v[6] = Bf16Lo(r.w), v[7] = Bf16Hi(r.w);
  }
};
using RowsBf16 = RowsBf16N<8>;
using RowsBf16x4 = RowsBf16N<4>;

// Row-quantized input: 8 e4m3 values and their row block's scale (8 channels never straddle a 128-channel block).
struct E4m3Row8 {
  uint2 q;
  float s;
};
struct RowsE4m3 {
  static constexpr int kLaneCh = 8;
  using Raw = E4m3Row8;
  const uint8_t* x;      // [M, C] e4m3
  const float* scales;   // [M, C / 128]
  int64_t C;
  __device__ __forceinline__ Raw Load(int64_t row, int64_t c) const {
    return {*reinterpret_cast<const uint2*>(x + row * C + c), scales[row * (C / 128) + c / 128]};
  }
  __device__ __forceinline__ static void Values(const Raw& r, float (&v)[kLaneCh]) {
    // DequantizeE4m3Pair's product by a power of two is exact.
    DequantizeE4m3Pair(r.q.x, r.s, v[0], v[1]);
    DequantizeE4m3Pair(r.q.x >> 16, r.s, v[2], v[3]);
    DequantizeE4m3Pair(r.q.y, r.s, v[4], v[5]);
    DequantizeE4m3Pair(r.q.y >> 16, r.s, v[6], v[7]);
  }
};

// ---- the shared rules, restated for speed (bitwise the same results) ----

// MaxAbsNaN (ops/e4m3.cuh) over values read from memory: the NaN itself is redone by AmaxStep where it matters
// (AmaxNaNRedo).

// ---- group tables ----

// row_off[0..G] (clipped to [0, M], negative sizes as 0) and tile_off[0..G] of common/fp8_columns.h, by warp 0 with
// shuffle scans over chunks of 32 groups; the caller synchronizes the CTA before reading them.
__device__ inline void BuildTables(const int32_t* sizes, int G, int64_t M, int32_t* row_off, int32_t* tile_off) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  int64_t rows_before = 0;  // unclipped rows of the groups before this chunk
  int32_t tiles_before = 0;
  for (int g0 = 0; g0 < G; g0 += 32) {
    const int g = g0 + lane;
    const int64_t n = g < G ? max(0, sizes[g]) : 0;
    int64_t incl = n;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int64_t o = __shfl_up_sync(0xFFFFFFFFu, incl, d);
      if (lane >= d) incl += o;
    }
    const int64_t first = min(M, rows_before + incl - n), end = min(M, rows_before + incl);
    const int32_t tiles = g < G ? static_cast<int32_t>(ColumnTilesOf(end - first)) : 0;
    int32_t tincl = tiles;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int32_t o = __shfl_up_sync(0xFFFFFFFFu, tincl, d);
      if (lane >= d) tincl += o;
    }
    if (g < G) {
      row_off[g] = static_cast<int32_t>(first);
      tile_off[g] = tiles_before + tincl - tiles;
      if (g == G - 1) {
        row_off[G] = static_cast<int32_t>(end);
        tile_off[G] = tiles_before + tincl;
      }
    }
    rows_before += __shfl_sync(0xFFFFFFFFu, incl, 31);
    tiles_before += __shfl_sync(0xFFFFFFFFu, tincl, 31);
  }
}

// ---- one item ----

// 16-byte aligned in size: the probe's persistent schedule puts its stage (16-byte cp.async slots) after it.
template <class In>
struct alignas(16) Shared {
  static constexpr int kCh = 32 * In::kLaneCh;  // channels of an item
  int32_t row_off[kMaxGroups + 1];
  int32_t tile_off[kMaxGroups + 1];
  float part[kWarps][kCh];  // each warp's amax per channel
  Quantizer quant[kCh];
  uint32_t packed[kCh * kWordsPerChannel];
};

// The place of word w of channel c = kLaneCh lane + j in the packed buffer: the packing (a warp writes one word of
// 32 channels kLaneCh apart) and the read-out (a warp reads a channel's 32 words) are both conflict-free.
template <int kLaneCh>
__device__ __forceinline__ int PackedWord(int c, int w) {
  return c * kWordsPerChannel + (w ^ ((c / kLaneCh) & 31));
}

// Step 2 of a channel: the tile's amax from the warps' amaxes part[0], part[stride], .. (kWarps of them, each >= 0 or
// NaN, so AmaxStep over them in warp order is the tile's amax by the rules).
__device__ __forceinline__ float WarpsAmax(const float* part, int stride) {
  float m = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m = AmaxStep(m, part[w * stride]);
  return m;
}

// Step 3 of a channel: its values of the warp's rows 4 m .. 4 m + 3 (v[b] of row 4 m + b) quantized with q, as their
// packed word; the warp's rows from `valid` on (past the tile's) hold 0, whose byte is 0 on the fast path, and are
// zero bytes on the exact path too (which quantizes 0 with a non-finite scale to NaN's byte: ClearRowsPastValid).
__device__ __forceinline__ uint32_t ClearRowsPastValid(uint32_t word, const Quantizer& q, int m, int valid) {
  if (!q.fast)
#pragma unroll
    for (int b = 0; b < 4; ++b)
      if (4 * m + b >= valid) word &= ~(0xFFu << (8 * b));
  return word;
}
__device__ __forceinline__ uint32_t PackFourRows(const float (&v)[4], const Quantizer& q, int m, int valid) {
  return ClearRowsPastValid(QuantizeFour(v, q), q, m, valid);
}

// Step 4 of a channel: its 128 bytes from the packed buffer to dst, by a warp (a word per lane: one 128-byte segment).
template <int kLaneCh>
__device__ __forceinline__ void StoreChannel(const uint32_t* packed, int c, uint8_t* dst) {
  const int lane = threadIdx.x & 31;
  reinterpret_cast<uint32_t*>(dst)[lane] = packed[PackedWord<kLaneCh>(c, lane)];
}

// Where a warp's amax of channel j turned NaN: redo it by AmaxStep over the warp's rows in order, so that the NaN
// (its payload) is the one the rules pick (the last NaN in row order).
template <class In>
__device__ __forceinline__ float AmaxNaNRedo(const typename In::Raw (&raw)[kRowsPerWarp], int j, int valid) {
  float m = 0.f;
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    float v[In::kLaneCh];
    In::Values(raw[k], v);
#pragma unroll
    for (int i = 0; i < In::kLaneCh; ++i)
      if (i == j && k < valid) m = AmaxStep(m, v[i]);
  }
  return m;
}

// Steps 1-4 of an item whose raw rows (valid of them: rows row0 + k < rows) are in registers. The CTA's threads all
// call it; it synchronizes them 3 times (and leaves smem free for the next item's step 1).
template <class In>
__device__ __forceinline__ void QuantizeItem(const typename In::Raw (&raw)[kRowsPerWarp], int rows, int64_t t,
                                             int64_t c0, int64_t C, int64_t Mp, Shared<In>& sm,
                                             uint8_t* __restrict__ q_t, float* __restrict__ s) {
  constexpr int L = In::kLaneCh, kCh = Shared<In>::kCh;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int valid = min(kRowsPerWarp, max(0, rows - warp * kRowsPerWarp));
  float amax[L];
#pragma unroll
  for (int j = 0; j < L; ++j) amax[j] = 0.f;
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    if (k < valid) {
      float v[L];
      In::Values(raw[k], v);
#pragma unroll
      for (int j = 0; j < L; ++j) amax[j] = MaxAbsNaN(amax[j], v[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < L; ++j) {
    if (__builtin_expect(amax[j] != amax[j], 0)) amax[j] = AmaxNaNRedo<In>(raw, j, valid);
    sm.part[warp][L * lane + j] = amax[j];
  }
  __syncthreads();
  for (int c = threadIdx.x; c < kCh; c += kThreads) {
    const float sc = ColumnTileScale(WarpsAmax(&sm.part[0][c], kCh));
    sm.quant[c] = QuantizerOf(sc);
    s[t * C + c0 + c] = sc;
  }
  __syncthreads();
  // Four rows at a time, each row's values decoded once (In::Values), then a word per channel.
#pragma unroll
  for (int m = 0; m < kRowsPerWarp / 4; ++m) {
    float all[4][L];
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      In::Values(raw[4 * m + b], all[b]);
#pragma unroll
      for (int j = 0; j < L; ++j)
        if (4 * m + b >= valid) all[b][j] = 0.f;  // rows past the tile's: 0, whose byte is 0 on the fast path
    }
#pragma unroll
    for (int j = 0; j < L; ++j) {
      const float v[4] = {all[0][j], all[1][j], all[2][j], all[3][j]};
      sm.packed[PackedWord<L>(L * lane + j, warp * (kRowsPerWarp / 4) + m)] =
          PackFourRows(v, sm.quant[L * lane + j], m, valid);
    }
  }
  __syncthreads();
  for (int c = warp; c < kCh; c += kWarps)
    StoreChannel<L>(sm.packed, c, q_t + (c0 + c) * Mp + t * kColumnTile);
}

// An item of a tile that holds no rows: scales 2^-126 (ColumnTileScale(0)) and zero bytes; no synchronization.
template <int kCh>
__device__ __forceinline__ void EmptyItem(int64_t t, int64_t c0, int64_t C, int64_t Mp, uint8_t* __restrict__ q_t,
                                          float* __restrict__ s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int c = threadIdx.x; c < kCh; c += kThreads) s[t * C + c0 + c] = ColumnTileScale(0.f);
  for (int c = warp; c < kCh; c += kWarps) reinterpret_cast<uint32_t*>(q_t + (c0 + c) * Mp + t * kColumnTile)[lane] = 0;
}

// ---- schedules ----

// Items in the order (tile, channel block), channel blocks fastest: the CTAs at work together read whole rows.
// One CTA per item; dynamic shared memory: LeanSmem<In>().
template <class In>
constexpr int LeanSmem() {
  return static_cast<int>(sizeof(Shared<In>));
}
template <class In>
__global__ void __launch_bounds__(kThreads, 3)
    QuantizeColumnsLean(In in, int64_t M, int64_t C, const int32_t* __restrict__ sizes, int G, int64_t Mp,
                        uint8_t* __restrict__ q_t, float* __restrict__ s) {
  extern __shared__ __align__(16) unsigned char smem[];
  Shared<In>& sm = *reinterpret_cast<Shared<In>*>(smem);
  constexpr int kCh = Shared<In>::kCh;
  const int64_t blocks = C / kCh, t = blockIdx.x / blocks, c0 = (blockIdx.x % blocks) * kCh;
  BuildTables(sizes, G, M, sm.row_off, sm.tile_off);
  __syncthreads();
  const ColumnTileRows tile = PlaceColumnTile(t, sm.row_off, sm.tile_off, G);
  if (tile.rows == 0) return EmptyItem<kCh>(t, c0, C, Mp, q_t, s);
  const int lane = threadIdx.x & 31, row0 = (threadIdx.x >> 5) * kRowsPerWarp;
  typename In::Raw raw[kRowsPerWarp];
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k)
    if (row0 + k < tile.rows) raw[k] = in.Load(tile.first + row0 + k, c0 + In::kLaneCh * lane);
  QuantizeItem<In>(raw, tile.rows, t, c0, C, Mp, sm, q_t, s);
}

}  // namespace jmo::cuda::qcols
