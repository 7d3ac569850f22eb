// jmo_swiglu_backward_fp8 on CUDA (swiglu_backward_fp8.h): one CTA per (128-row column tile t, 128 channels of h),
// 256 threads. The CTA's block of channels cb covers h's channels [128 cb, 128 cb + 128), which are da's d_gate
// channels of the same index and its d_up channels F + those: whole 1 x 128 row tiles of da (two per row) and whole
// 128 x 1 column tiles of da (256 channels) and of h (128), so every output comes from one read of aq, a_s and dh.
// Each CTA derives the group tables (ops/group_offsets.cuh) and places its tile (common/fp8_columns.h), then
//   1. each warp loads 16 rows of the tile, a lane 4 consecutive channels of the gate, of the up projection and of
//      dh (a warp reads 128 + 128 bytes of aq and 512 of dh per row), keeping the aq words in shared memory and dh in
//      registers; it computes h, d_gate and d_up (common/swiglu.h), quantizes d_gate and d_up per row (the row amax
//      across the warp by shuffles) and writes those rows and their scales, and keeps each thread's column amaxes;
//   2. the warps' column amaxes are combined per channel: the 3 x 128 column scales, written contiguously;
//   3. each thread recomputes its rows' values from the kept inputs (the same operations: the same bits), quantizes
//      them with the column scales and packs 4 consecutive rows of a channel into a word of a channel-major shared
//      buffer (XOR-swizzled as in ops/quantize_columns.cu, free of bank conflicts);
//   4. each channel's 128 bytes go to its row of da_t or h_t at 128 t (a warp per channel row: one 128-byte segment).
// Rows of the tile past its group's (and every row of a tile past the groups' tiles) are zero bytes in da_t and h_t.
// The rows of da_q past the groups are written by the CTAs of their channel block in turn (CTA t: rows
// row_off[G] + 128 t ..): zero values, scales 2^-126, quantize_rows of a zero row.
#include "cuda/ops/swiglu_backward_fp8.h"

#include <string>

#include "common/e4m3.h"
#include "common/fp8_columns.h"
#include "common/swiglu.h"
#include "cuda/launch.h"
#include "cuda/ops/fp8_rows.cuh"
#include "cuda/ops/group_offsets.cuh"
#include "cuda/ops/grouped_gemm.h"

namespace jmo::cuda {
namespace {

constexpr int kCtaThreads = kTileThreads;  // BlockExclusiveScan's CTA size
constexpr int kCtaWarps = kCtaThreads / 32;
constexpr int kChannels = 128;                         // channels of h per CTA: 4 per lane
constexpr int kRowsPerWarp = kColumnTile / kCtaWarps;  // 16
constexpr int kWordsPerChannel = kColumnTile / 4;      // 32: a channel's 128 bytes as words
constexpr int kOutputs = 3;                            // the column-quantized outputs: d_gate, d_up, h
static_assert(kCtaThreads == 2 * kColumnTile, "one thread per row loads the gate's and the up's scales");
static_assert(kRowsPerWarp % 4 == 0 && kWordsPerChannel == 32, "a warp's rows pack into whole words; one per lane");

// Dynamic shared memory: the packed column outputs (whose first bytes hold the warps' column amaxes before the
// packing), then the aq words each thread keeps for step 3.
constexpr int kPackedWords = kOutputs * kChannels * kWordsPerChannel;
constexpr int kPackedBytes = kPackedWords * 4;                          // 48 KiB
constexpr int kKeptBytes = kRowsPerWarp * kCtaThreads * sizeof(uint2);  // 32 KiB
constexpr int kSmemBytes = kPackedBytes + kKeptBytes;
static_assert(kOutputs * kCtaWarps * kChannels * sizeof(float) <= kPackedBytes, "the amaxes fit the packed buffer");

__device__ __forceinline__ int PackedWord(int c, int w) { return c * kWordsPerChannel + (w ^ ((c >> 2) & 31)); }

// h, d_gate and d_up of a lane's 4 channels of one row: the gate's and the up's e4m3 bytes (a word each) dequantized
// with their row scales.
__device__ __forceinline__ void RowValues(uint2 a, float gate_scale, float up_scale, const float (&dh)[4],
                                          float (&h)[4], float (&d_gate)[4], float (&d_up)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float gate = DequantizeE4m3(static_cast<uint8_t>(a.x >> (8 * j)), gate_scale);
    const float up = DequantizeE4m3(static_cast<uint8_t>(a.y >> (8 * j)), up_scale);
    SwiGluAndGrad(gate, up, dh[j], &h[j], &d_gate[j], &d_up[j]);
  }
}

__global__ void __launch_bounds__(kCtaThreads, 2)
    SwiGluBackwardKernel(const uint8_t* __restrict__ aq, const float* __restrict__ a_s, const float* __restrict__ dh,
                         int64_t M, int64_t F, const int32_t* __restrict__ sizes, int G, int64_t Mp,
                         uint8_t* __restrict__ da_q, float* __restrict__ da_s, uint8_t* __restrict__ da_t,
                         float* __restrict__ da_ts, uint8_t* __restrict__ h_t, float* __restrict__ h_ts) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint32_t* packed = reinterpret_cast<uint32_t*>(smem);        // [kOutputs][kChannels * kWordsPerChannel]
  float* part = reinterpret_cast<float*>(smem);                // [kOutputs][kCtaWarps][kChannels], steps 1-2
  uint2* kept = reinterpret_cast<uint2*>(smem + kPackedBytes);  // [kRowsPerWarp][kCtaThreads]
  __shared__ int32_t row_off[kMaxGroups + 1];
  __shared__ int32_t tile_off[kMaxGroups + 1];
  __shared__ float row_scale[2][kColumnTile];  // a's gate and up scales of the tile's rows
  __shared__ float scale[kOutputs][kChannels];
  BuildRowOffsets(sizes, G, M, row_off);
  BlockExclusiveScan(G, [&](int g) { return (int32_t)ColumnTilesOf(row_off[g + 1] - row_off[g]); }, tile_off);
  const int64_t t = blockIdx.x, cb = blockIdx.y;
  const int64_t C = 2 * F, R = C / kColumnTile, blocks = F / kChannels;  // R: a row's scales
  const int64_t gate_c = kChannels * cb, up_c = F + kChannels * cb;     // the CTA's first channel of each half
  const ColumnTileRows tile = PlaceColumnTile(t, row_off, tile_off, G);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, row0 = warp * kRowsPerWarp;

  // The rows past the groups that fall to this CTA: quantize_rows of a zero row.
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int64_t r = row_off[G] + kColumnTile * t + row0 + k;
    if (r >= M) break;
    reinterpret_cast<uint32_t*>(da_q + r * C + gate_c)[lane] = 0u;
    reinterpret_cast<uint32_t*>(da_q + r * C + up_c)[lane] = 0u;
    if (lane == 0) {
      da_s[r * R + cb] = kScaleFloor;
      da_s[r * R + blocks + cb] = kScaleFloor;
    }
  }

  {
    const int i = threadIdx.x % kColumnTile, half = threadIdx.x / kColumnTile;
    row_scale[half][i] = i < tile.rows ? a_s[(tile.first + i) * R + (half ? blocks : 0) + cb] : 0.f;
  }

  // 1. Load (every row's loads issued before any math; the aq words go to `kept`, each thread's own slots, dh stays
  // in registers), compute, quantize the rows of da, keep the column amaxes.
  float d[kRowsPerWarp][4];
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    uint2 a = make_uint2(0u, 0u);
    float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
    if (row0 + k < tile.rows) {
      const int64_t r = tile.first + row0 + k;
      a.x = *reinterpret_cast<const uint32_t*>(aq + r * C + gate_c + 4 * lane);
      a.y = *reinterpret_cast<const uint32_t*>(aq + r * C + up_c + 4 * lane);
      f = *reinterpret_cast<const float4*>(dh + r * F + gate_c + 4 * lane);
    }
    kept[k * kCtaThreads + threadIdx.x] = a;
    d[k][0] = f.x;
    d[k][1] = f.y;
    d[k][2] = f.z;
    d[k][3] = f.w;
  }
  __syncthreads();  // row_scale
  float amax[kOutputs][4] = {};
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int i = row0 + k;
    if (i >= tile.rows) continue;  // the warp's rows are in or out together
    float h[4], dg[4], du[4];
    RowValues(kept[k * kCtaThreads + threadIdx.x], row_scale[0][i], row_scale[1][i], d[k], h, dg, du);
    const float sg = WarpRowScale(dg), su = WarpRowScale(du);
    const int64_t r = tile.first + i;
    reinterpret_cast<uint32_t*>(da_q + r * C + gate_c)[lane] = QuantizeWord(dg, sg);
    reinterpret_cast<uint32_t*>(da_q + r * C + up_c)[lane] = QuantizeWord(du, su);
    if (lane == 0) {
      da_s[r * R + cb] = sg;
      da_s[r * R + blocks + cb] = su;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      amax[0][j] = AmaxStep(amax[0][j], dg[j]);
      amax[1][j] = AmaxStep(amax[1][j], du[j]);
      amax[2][j] = AmaxStep(amax[2][j], h[j]);
    }
  }

  // 2. The column scales: the warps' amaxes (>= 0 or NaN, so AmaxStep over them is the tile's amax).
#pragma unroll
  for (int o = 0; o < kOutputs; ++o)
#pragma unroll
    for (int j = 0; j < 4; ++j) part[(o * kCtaWarps + warp) * kChannels + 4 * lane + j] = amax[o][j];
  __syncthreads();
  for (int e = threadIdx.x; e < kOutputs * kChannels; e += kCtaThreads) {
    const int o = e / kChannels, c = e % kChannels;
    float m = 0.f;
#pragma unroll
    for (int w = 0; w < kCtaWarps; ++w) m = AmaxStep(m, part[(o * kCtaWarps + w) * kChannels + c]);
    const float sc = ColumnTileScale(m);
    scale[o][c] = sc;
    if (o == 2)
      h_ts[t * F + gate_c + c] = sc;
    else
      da_ts[t * C + (o ? up_c : gate_c) + c] = sc;
  }
  __syncthreads();  // scale; part is dead from here on (packed takes its bytes)

  // 3. The same values again, quantized per column, packed channel-major.
#pragma unroll
  for (int m = 0; m < kRowsPerWarp / 4; ++m) {
    uint32_t word[kOutputs][4] = {};
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int k = 4 * m + b, i = row0 + k;
      if (i >= tile.rows) continue;
      float h[4], dg[4], du[4];
      RowValues(kept[k * kCtaThreads + threadIdx.x], row_scale[0][i], row_scale[1][i], d[k], h, dg, du);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = 4 * lane + j;
        word[0][j] |= static_cast<uint32_t>(QuantizeE4m3(dg[j], scale[0][c])) << (8 * b);
        word[1][j] |= static_cast<uint32_t>(QuantizeE4m3(du[j], scale[1][c])) << (8 * b);
        word[2][j] |= static_cast<uint32_t>(QuantizeE4m3(h[j], scale[2][c])) << (8 * b);
      }
    }
#pragma unroll
    for (int o = 0; o < kOutputs; ++o)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        packed[o * kChannels * kWordsPerChannel + PackedWord(4 * lane + j, row0 / 4 + m)] = word[o][j];
  }
  __syncthreads();

  // 4. Each channel's 128 bytes to its token-contiguous row.
  for (int e = warp; e < kOutputs * kChannels; e += kCtaWarps) {
    const int o = e / kChannels, c = e % kChannels;
    uint8_t* row = o == 2 ? h_t + (gate_c + c) * Mp : da_t + ((o ? up_c : gate_c) + c) * Mp;
    reinterpret_cast<uint32_t*>(row + t * kColumnTile)[lane] = packed[o * kChannels * kWordsPerChannel +
                                                                      PackedWord(c, lane)];
  }
}

}  // namespace

Status SwiGluBackwardFp8(cudaStream_t stream, const uint8_t* aq, const float* a_s, const float* dh, int64_t M,
                         int64_t F, int64_t G, const int32_t* group_sizes, int64_t tiles, uint8_t* da_q, float* da_s,
                         uint8_t* da_t, float* da_ts, uint8_t* h_t, float* h_ts) {
  Status st = CheckSizes("swiglu_backward_fp8", M, G);
  if (!st.ok()) return st;
  DeviceInfo dev;
  if (!(st = Fp8DeviceCheck("swiglu_backward_fp8", &dev)).ok()) return st;
  if (F < kChannels || F % kChannels != 0 || F / kChannels > 65535 || tiles < ColumnTilesNeeded(M, G) ||
      tiles > 0x7FFFFFFF)
    return Status::Error(kInvalidArgument, "jax_moe_overlap: swiglu_backward_fp8: F must be a positive multiple of "
                                           "128 (at most 128 * 65535) and the tiles at least ceil(M / 128) + G, got "
                                           "F=" + std::to_string(F) + ", tiles=" + std::to_string(tiles));
  if (!(st = SetKernelSmem(reinterpret_cast<const void*>(SwiGluBackwardKernel), kSmemBytes, "SwiGluBackwardKernel"))
           .ok())
    return st;
  const dim3 grid((unsigned)tiles, (unsigned)(F / kChannels));
  SwiGluBackwardKernel<<<grid, kCtaThreads, kSmemBytes, stream>>>(aq, a_s, dh, M, F, group_sizes, (int)G,
                                                                  kColumnTile * tiles, da_q, da_s, da_t, da_ts, h_t,
                                                                  h_ts);
  return CudaStatus(cudaGetLastError(), "launch of SwiGluBackwardKernel");
}

}  // namespace jmo::cuda
