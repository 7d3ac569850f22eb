// jmo_swiglu_backward_fp8 on CUDA (swiglu_backward_fp8.h): one CTA per item (128-row column tile t, block cb of 128
// of h's channels), the items numbered with the channel block fastest (the CTAs at work together read whole rows), 256
// threads, three CTAs per SM. The block covers h's channels [128 cb, 128 cb + 128), which are da's d_gate channels of
// the same index and its d_up channels F + those: whole 1 x 128 row tiles of da (two per row) and whole 128 x 1
// column tiles of da (256 channels) and of h (128), so every output comes from the item's rows of aq, a_s and dh.
// Warp w takes the tile's rows 16 w .. 16 w + 15, a lane 4 consecutive channels of the gate, of the up projection and
// of dh (float32, or bfloat16 read exactly as float32: the kernel's DhT). The CTA derives the group tables and places
// its tile (ops/quantize_columns.cuh's BuildTables, common/fp8_columns.h), then, by the column quantizer's steps
// (ops/quantize_columns.cuh) over the three column outputs:
//   1. each warp loops over its rows 4 at a time (LoadFourRows: the four rows' loads before any math): per row it
//      computes h, d_gate and d_up (common/swiglu.h, the gate and up dequantized by ops/e4m3.cuh, the logistic's
//      reciprocal by SwiGluSigmoids), quantizes d_gate and d_up per row (ops/fp8_rows.cuh: the row amax across the warp
//      by one redux.sync) and writes those rows and their scales, and keeps its column amaxes;
//   2. the warps' column amaxes are combined per channel: the 3 x 128 column scales, written contiguously, and their
//      quantizers (ops/e4m3.cuh);
//   3. each warp loops over its rows again, reading them again (from L2), recomputes their values (the same
//      operations on the same inputs: the same bits), quantizes them with the column quantizers and packs 4
//      consecutive rows of a channel into a word of a channel-major shared buffer (PackFourRows, PackedWord's
//      swizzle: free of bank conflicts);
//   4. each channel's 128 bytes go to its row of da_t or h_t at 128 t (StoreChannel: a warp, one 128-byte segment).
// Nothing of the rows is held between steps 1 and 3 (80 registers, 63 KiB of shared memory: three CTAs per SM), and
// the row loops are not unrolled, so that the kernel's code fits the instruction cache.
// Every byte is RoundE4m3 of its IEEE quotient by its scale (ops/e4m3.cuh's QuotientFast), as in the CPU
// handler. Rows of the tile past its group's are zero bytes in da_t and h_t; a tile past the groups' tiles is an
// empty item (zero bytes, scales 2^-126). The rows of da_q past the groups are written by the CTAs of their channel
// block in turn (CTA t: rows row_off[G] + 128 t ..): zero values, scales 2^-126, quantize_rows of a zero row.
#include "cuda/ops/swiglu_backward_fp8.h"

#include <cuda_bf16.h>

#include <string>

#include "common/e4m3.h"
#include "common/fp8_columns.h"
#include "common/swiglu.h"
#include "cuda/launch.h"
#include "cuda/ops/e4m3.cuh"
#include "cuda/ops/fp8_rows.cuh"
#include "cuda/ops/grouped_gemm.h"
#include "cuda/ops/quantize_columns.cuh"
#include "cuda/ops/swiglu_sigmoid.cuh"

namespace jmo::cuda {
namespace {

using qcols::kRowsPerWarp;      // 16
using qcols::kWarps;            // 8
using qcols::kWordsPerChannel;  // 32
constexpr int kCtaThreads = qcols::kThreads;  // 256
constexpr int kLaneCh = 4;                 // channels of h per lane
constexpr int kChannels = 32 * kLaneCh;    // channels of h per item: one row tile
constexpr int kOutputs = 3;                // the column-quantized outputs: d_gate, d_up, h
constexpr int kDGate = 0, kDUp = 1, kH = 2;  // their indices
static_assert(kCtaThreads == 2 * kColumnTile, "one thread per row loads the gate's or the up's scale");

struct Shared {
  union {
    alignas(16) float part[kOutputs][kWarps][kChannels];  // steps 1-2: each warp's column amaxes (float4 stores)
    uint32_t packed[kOutputs][kChannels * kWordsPerChannel];  // steps 3-4
  };
  Quantizer quant[kOutputs][kLaneCh][32];   // channel 4 l + j at [o][j][l]: a warp loads 32 consecutive ones
  float row_scale[2][kColumnTile];          // a's gate and up scales of the tile's rows (0 past them)
  int32_t row_off[kMaxGroups + 1];
  int32_t tile_off[kMaxGroups + 1];
};
constexpr int kSmemBytes = static_cast<int>(sizeof(Shared));
constexpr int kCtasPerSm = 3;
static_assert(kCtasPerSm * (kSmemBytes + 1024) <= 228 * 1024, "kCtasPerSm CTAs fit an SM's shared memory");

// A lane's inputs of one row: its 4 channels of the gate and of the up projection (e4m3 bytes, a word each) and of dh.
struct RowIn {
  uint32_t gate, up;
  float4 dh;
};

// h, d_gate and d_up of a lane's 4 channels of one row: the gate and the up dequantized with their row scales, and
// dh; SwiGluAndGrad's operations (common/swiglu.h), the logistic by SwiGluSigmoids (ops/swiglu_sigmoid.cuh).
__device__ __forceinline__ void RowValues(const RowIn& in, float gate_scale, float up_scale, float (&h)[4],
                                          float (&d_gate)[4], float (&d_up)[4]) {
  float gate[4], up[4], sig[4];
  DequantizeE4m3Pair(in.gate, gate_scale, gate[0], gate[1]);
  DequantizeE4m3Pair(in.gate >> 16, gate_scale, gate[2], gate[3]);
  DequantizeE4m3Pair(in.up, up_scale, up[0], up[1]);
  DequantizeE4m3Pair(in.up >> 16, up_scale, up[2], up[3]);
  const float d[4] = {in.dh.x, in.dh.y, in.dh.z, in.dh.w};
  SwiGluSigmoids(gate, sig);
#pragma unroll
  for (int j = 0; j < 4; ++j) SwiGluAndGradOfSig(gate[j], sig[j], up[j], d[j], &h[j], &d_gate[j], &d_up[j]);
}

// Where a lane reads the warp's rows 4 m .. 4 m + 3 and writes their da_q words: row 4 m + b's 4 gate bytes at
// a + b C (the up's F bytes on), its dh at d + b F, its da_q words at q + b C (and F bytes on); Next moves to m + 1.
template <class DhT>
struct LaneRows {
  const uint8_t* a;
  const DhT* d;
  uint8_t* q;
  int64_t C, F;
  __device__ __forceinline__ void Next() { a += 4 * C, d += 4 * F, q += 4 * C; }
};

// A lane's 4 channels of dh at p (16 bytes of float32, or 8 of bfloat16) as float32, by ld.global.cs (kLastRead:
// evicted first) or ld.global.nc.
template <bool kLastRead>
__device__ __forceinline__ float4 LoadDh(const float* p) {
  return kLastRead ? __ldcs(reinterpret_cast<const float4*>(p)) : __ldg(reinterpret_cast<const float4*>(p));
}
template <bool kLastRead>
__device__ __forceinline__ float4 LoadDh(const __nv_bfloat16* p) {
  const uint2 u = kLastRead ? __ldcs(reinterpret_cast<const uint2*>(p)) : __ldg(reinterpret_cast<const uint2*>(p));
  return make_float4(qcols::Bf16Lo(u.x), qcols::Bf16Hi(u.x), qcols::Bf16Lo(u.y), qcols::Bf16Hi(u.y));
}

// The inputs of the warp's rows 4 m .. 4 m + 3, zeros from row b = n on (past the tile's rows: their values are
// zeros). The four rows' loads all issue before any is used. Step 1 reads the rows from HBM with the default policy,
// which keeps them in L2 for step 3's read, their last (ld.global.cs: evicted first): re-reading them costs L2
// traffic only, where holding them in registers and shared memory would halve the CTAs an SM holds.
template <bool kLastRead, class DhT>
__device__ __forceinline__ void LoadFourRows(const LaneRows<DhT>& at, int n, RowIn (&in)[4]) {
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    in[b] = {0u, 0u, make_float4(0.f, 0.f, 0.f, 0.f)};
    if (b < n) {  // warp-uniform
      const uint32_t* g = reinterpret_cast<const uint32_t*>(at.a + b * at.C);
      const uint32_t* u = reinterpret_cast<const uint32_t*>(at.a + b * at.C + at.F);
      if constexpr (kLastRead)
        in[b] = {__ldcs(g), __ldcs(u), LoadDh<true>(at.d + b * at.F)};
      else
        in[b] = {__ldg(g), __ldg(u), LoadDh<false>(at.d + b * at.F)};
    }
  }
}

template <class DhT>
__global__ void __launch_bounds__(kCtaThreads, kCtasPerSm)
    SwiGluBackwardKernel(const uint8_t* __restrict__ aq, const float* __restrict__ a_s, const DhT* __restrict__ dh,
                         int64_t M, int64_t F, const int32_t* __restrict__ sizes, int G, int64_t Mp,
                         uint8_t* __restrict__ da_q, float* __restrict__ da_s, uint8_t* __restrict__ da_t,
                         float* __restrict__ da_ts, uint8_t* __restrict__ h_t, float* __restrict__ h_ts) {
  extern __shared__ __align__(16) unsigned char smem[];
  Shared& sm = *reinterpret_cast<Shared*>(smem);
  const int64_t C = 2 * F, R = C / kColumnTile, blocks = F / kChannels;  // R: a row's scales
  const int64_t t = blockIdx.x / blocks, cb = blockIdx.x % blocks;
  const int64_t gate_c = kChannels * cb, up_c = F + gate_c;  // the item's first channel of each half
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, row0 = warp * kRowsPerWarp;
  qcols::BuildTables(sizes, G, M, sm.row_off, sm.tile_off);
  __syncthreads();
  const ColumnTileRows tile = PlaceColumnTile(t, sm.row_off, sm.tile_off, G);

  // The rows past the groups that fall to this CTA: quantize_rows of a zero row.
#pragma unroll 1
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int64_t r = sm.row_off[G] + kColumnTile * t + row0 + k;
    if (r >= M) break;
    reinterpret_cast<uint32_t*>(da_q + r * C + gate_c)[lane] = 0u;
    reinterpret_cast<uint32_t*>(da_q + r * C + up_c)[lane] = 0u;
    if (lane == 0) {
      da_s[r * R + cb] = kScaleFloor;
      da_s[r * R + blocks + cb] = kScaleFloor;
    }
  }
  if (tile.rows == 0) {  // a tile past the groups' tiles (CTA-uniform)
    qcols::EmptyItem<kChannels>(t, gate_c, C, Mp, da_t, da_ts);
    qcols::EmptyItem<kChannels>(t, up_c, C, Mp, da_t, da_ts);
    qcols::EmptyItem<kChannels>(t, gate_c, F, Mp, h_t, h_ts);
    return;
  }

  // 1. The rows' values, 4 rows at a time; each row of da quantized and stored, the column amaxes kept.
  const int valid = min(kRowsPerWarp, max(0, tile.rows - row0));  // the warp's rows in the tile
  {
    const int i = threadIdx.x % kColumnTile, half = threadIdx.x / kColumnTile;
    sm.row_scale[half][i] = i < tile.rows ? a_s[(tile.first + i) * R + half * blocks + cb] : 0.f;
  }
  const int64_t first = tile.first + row0;  // the warp's first row
  const LaneRows<DhT> rows{aq + first * C + gate_c + kLaneCh * lane, dh + first * F + gate_c + kLaneCh * lane,
                           da_q + first * C + gate_c + kLaneCh * lane, C, F};
  float* row_s = da_s + first * R + cb;  // the warp's first row's d_gate scale (its d_up scale: blocks on)
  __syncthreads();  // row_scale
  float amax[kOutputs][kLaneCh] = {};
  LaneRows<DhT> at = rows;
#pragma unroll 1
  for (int m = 0; m < kRowsPerWarp / 4; ++m, at.Next(), row_s += 4 * R) {
    RowIn in[4];
    LoadFourRows<false>(at, valid - 4 * m, in);
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      // Every row, in the tile or not (its values then zeros, which change no amax), so that the warp's reductions
      // run converged; only the tile's rows are stored.
      const int i = row0 + 4 * m + b;
      float h[kLaneCh], dg[kLaneCh], du[kLaneCh];
      RowValues(in[b], sm.row_scale[0][i], sm.row_scale[1][i], h, dg, du);
      const float sg = WarpRowScaleOfResults(dg), su = WarpRowScaleOfResults(du);  // float32 results: canonical NaN
      // QuantizeWord of each, their rare exact paths behind one branch.
      const Quantizer qg = QuantizerOfTileScale(sg), qu = QuantizerOfTileScale(su);
      uint32_t wg, wu;
      const bool fast_g = QuantizeFourFast(dg, qg, wg), fast_u = QuantizeFourFast(du, qu, wu);
      if (__builtin_expect(!(fast_g & fast_u), 0)) {
        if (!fast_g) wg = QuantizeFourExact(dg[0], dg[1], dg[2], dg[3], sg);
        if (!fast_u) wu = QuantizeFourExact(du[0], du[1], du[2], du[3], su);
      }
      if (4 * m + b < valid) {  // warp-uniform
        *reinterpret_cast<uint32_t*>(at.q + b * C) = wg;
        *reinterpret_cast<uint32_t*>(at.q + b * C + F) = wu;
        if (lane == 0) {
          row_s[b * R] = sg;
          row_s[b * R + blocks] = su;
        }
      }
      // d_gate, d_up and h are float32 results, whose NaN is the device's one canonical NaN (positive): max.NaN's
      // NaN, so MaxAbsNaN is AmaxStep here.
#pragma unroll
      for (int j = 0; j < kLaneCh; ++j) {
        amax[kDGate][j] = MaxAbsNaN(amax[kDGate][j], dg[j]);
        amax[kDUp][j] = MaxAbsNaN(amax[kDUp][j], du[j]);
        amax[kH][j] = MaxAbsNaN(amax[kH][j], h[j]);
      }
    }
  }
#pragma unroll
  for (int o = 0; o < kOutputs; ++o)
    *reinterpret_cast<float4*>(&sm.part[o][warp][kLaneCh * lane]) =
        make_float4(amax[o][0], amax[o][1], amax[o][2], amax[o][3]);
  __syncthreads();

  // 2. The column scales and quantizers.
  for (int e = threadIdx.x; e < kOutputs * kChannels; e += kCtaThreads) {
    const int o = e / kChannels, c = e % kChannels;
    const float sc = ColumnTileScale(qcols::WarpsAmax(&sm.part[o][0][c], kChannels));
    sm.quant[o][c % kLaneCh][c / kLaneCh] = QuantizerOfTileScale(sc);
    if (o == kH)
      h_ts[t * F + gate_c + c] = sc;
    else
      da_ts[t * C + (o == kDUp ? up_c : gate_c) + c] = sc;
  }
  __syncthreads();  // quant; part is dead from here on (packed takes its bytes)

  // 3. The same values again (the same operations on the same inputs, read again: the same bits), quantized per
  // column, 4 consecutive rows of a channel packed into a word of the channel-major buffer.
  at = rows;
#pragma unroll 1
  for (int m = 0; m < kRowsPerWarp / 4; ++m, at.Next()) {
    RowIn in[4];
    LoadFourRows<true>(at, valid - 4 * m, in);
    float v[kOutputs][kLaneCh][4];  // [output][channel][row 4 m + b]
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int i = row0 + 4 * m + b;
      float h[kLaneCh], dg[kLaneCh], du[kLaneCh];
      RowValues(in[b], sm.row_scale[0][i], sm.row_scale[1][i], h, dg, du);
#pragma unroll
      for (int j = 0; j < kLaneCh; ++j) v[kDGate][j][b] = dg[j], v[kDUp][j][b] = du[j], v[kH][j][b] = h[j];
    }
    // PackFourRows of the 12 words, their rare exact paths behind one branch: each word's fast path into its place,
    // then, where any of them is not the values' word, every word again by PackFourRows (the thread's own places;
    // nothing reads them before the barrier).
    bool fast = true;
#pragma unroll
    for (int o = 0; o < kOutputs; ++o)
#pragma unroll
      for (int j = 0; j < kLaneCh; ++j) {
        uint32_t word;
        fast &= QuantizeFourFast(v[o][j], sm.quant[o][j][lane], word);
        sm.packed[o][qcols::PackedWord<kLaneCh>(kLaneCh * lane + j, warp * (kRowsPerWarp / 4) + m)] = word;
      }
    if (__builtin_expect(!fast, 0))
#pragma unroll
      for (int o = 0; o < kOutputs; ++o)
#pragma unroll
        for (int j = 0; j < kLaneCh; ++j)
          sm.packed[o][qcols::PackedWord<kLaneCh>(kLaneCh * lane + j, warp * (kRowsPerWarp / 4) + m)] =
              qcols::PackFourRows(v[o][j], sm.quant[o][j][lane], m, valid);
  }
  __syncthreads();

  // 4. Each channel's 128 bytes to its token-contiguous row.
  for (int e = warp; e < kOutputs * kChannels; e += kWarps) {
    const int o = e / kChannels, c = e % kChannels;
    uint8_t* row = o == kH ? h_t + (gate_c + c) * Mp : da_t + ((o == kDUp ? up_c : gate_c) + c) * Mp;
    qcols::StoreChannel<kLaneCh>(sm.packed[o], c, row + t * kColumnTile);
  }
}

template <class DhT>
Status LaunchSwiGluBackward(cudaStream_t stream, const uint8_t* aq, const float* a_s, const DhT* dh, int64_t M,
                            int64_t F, int64_t G, const int32_t* group_sizes, int64_t tiles, uint8_t* da_q, float* da_s,
                            uint8_t* da_t, float* da_ts, uint8_t* h_t, float* h_ts) {
  const auto kernel = SwiGluBackwardKernel<DhT>;
  Status st = SetKernelSmem(reinterpret_cast<const void*>(kernel), kSmemBytes, "SwiGluBackwardKernel");
  if (!st.ok()) return st;
  const int64_t items = tiles * (F / kChannels);
  kernel<<<static_cast<unsigned>(items), kCtaThreads, kSmemBytes, stream>>>(
      aq, a_s, dh, M, F, group_sizes, static_cast<int>(G), kColumnTile * tiles, da_q, da_s, da_t, da_ts, h_t, h_ts);
  return CudaStatus(cudaGetLastError(), "launch of SwiGluBackwardKernel");
}

}  // namespace

Status SwiGluBackwardFp8(cudaStream_t stream, const uint8_t* aq, const float* a_s, const void* dh, bool dh_bf16,
                         int64_t M, int64_t F, int64_t G, const int32_t* group_sizes, int64_t tiles, uint8_t* da_q,
                         float* da_s, uint8_t* da_t, float* da_ts, uint8_t* h_t, float* h_ts) {
  Status st = CheckSizes("swiglu_backward_fp8", M, G);
  if (!st.ok()) return st;
  DeviceInfo dev;
  if (!(st = Fp8DeviceCheck("swiglu_backward_fp8", &dev)).ok()) return st;
  if (F < kChannels || F % kChannels != 0 || tiles < ColumnTilesNeeded(M, G) || tiles > 0x7FFFFFFF / (F / kChannels))
    return Status::Error(kInvalidArgument, "jax_moe_overlap: swiglu_backward_fp8: F must be a positive multiple of "
                                           "128, the tiles at least ceil(M / 128) + G and tiles * F / 128 below "
                                           "2^31, got F=" + std::to_string(F) + ", tiles=" + std::to_string(tiles));
  if (dh_bf16)
    return LaunchSwiGluBackward(stream, aq, a_s, static_cast<const __nv_bfloat16*>(dh), M, F, G, group_sizes, tiles,
                                da_q, da_s, da_t, da_ts, h_t, h_ts);
  return LaunchSwiGluBackward(stream, aq, a_s, static_cast<const float*>(dh), M, F, G, group_sizes, tiles, da_q, da_s,
                              da_t, da_ts, h_t, h_ts);
}

}  // namespace jmo::cuda
