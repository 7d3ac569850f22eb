// jmo_swiglu_backward_fp8 on CUDA (swiglu_backward_fp8.h): one CTA per item (128-row column tile t, block cb of 128
// of h's channels), the items numbered with the channel block fastest (the CTAs at work together read whole rows), 256
// threads, two CTAs per SM. The block covers h's channels [128 cb, 128 cb + 128), which are da's d_gate channels of
// the same index and its d_up channels F + those: whole 1 x 128 row tiles of da (two per row) and whole 128 x 1
// column tiles of da (256 channels) and of h (128), so every output comes from one read of aq, a_s and dh. Warp w
// takes the tile's rows 16 w .. 16 w + 15, a lane 4 consecutive channels of the gate, of the up projection and of dh.
// The CTA derives the group tables and places its tile (ops/quantize_columns.cuh's BuildTables, common/fp8_columns.h),
// then, by the column quantizer's steps (ops/quantize_columns.cuh) over the three column outputs:
//   1. each thread copies its rows' aq words into its own shared slots (cp.async) and loads their dh into registers
//      (every row's loads issued before any math); per row it computes h, d_gate and d_up (common/swiglu.h, the
//      gate and up dequantized by ops/e4m3.cuh, the logistic's reciprocal by RecipFour), quantizes d_gate and d_up
//      per row (ops/fp8_rows.cuh: the row amax across the warp by one redux.sync) and writes those rows and their
//      scales, and keeps its column amaxes;
//   2. the warps' column amaxes are combined per channel: the 3 x 128 column scales, written contiguously, and their
//      quantizers (ops/e4m3.cuh);
//   3. each thread recomputes its rows' values from the kept inputs (the same operations: the same bits), quantizes
//      them with the column quantizers and packs 4 consecutive rows of a channel into a word of a channel-major
//      shared buffer (PackFourRows, PackedWord's swizzle: free of bank conflicts);
//   4. each channel's 128 bytes go to its row of da_t or h_t at 128 t (StoreChannel: a warp, one 128-byte segment).
// Every byte is RoundE4m3 of its IEEE quotient by its scale (ops/e4m3.cuh's bracketed conversion), as in the CPU
// handler. Rows of the tile past its group's are zero bytes in da_t and h_t; a tile past the groups' tiles is an
// empty item (zero bytes, scales 2^-126). The rows of da_q past the groups are written by the CTAs of their channel
// block in turn (CTA t: rows row_off[G] + 128 t ..): zero values, scales 2^-126, quantize_rows of a zero row.
#include "cuda/ops/swiglu_backward_fp8.h"

#include <string>

#include "common/e4m3.h"
#include "common/fp8_columns.h"
#include "common/swiglu.h"
#include "cuda/launch.h"
#include "cuda/ops/e4m3.cuh"
#include "cuda/ops/fp8_rows.cuh"
#include "cuda/ops/grouped_gemm.h"
#include "cuda/ops/quantize_columns.cuh"

namespace jmo::cuda {
namespace {

using qcols::kRowsPerWarp;      // 16
using qcols::kWarps;            // 8
using qcols::kWordsPerChannel;  // 32
constexpr int kCtaThreads = qcols::kThreads;  // 256
constexpr int kLaneCh = 4;                 // channels of h per lane
constexpr int kChannels = 32 * kLaneCh;    // channels of h per item: one row tile
constexpr int kOutputs = 3;                // the column-quantized outputs: d_gate, d_up, h
static_assert(kCtaThreads == 2 * kColumnTile, "one thread per row loads the gate's or the up's scale");

struct Shared {
  union {
    alignas(16) float part[kOutputs][kWarps][kChannels];  // steps 1-2: each warp's column amaxes (float4 stores)
    uint32_t packed[kOutputs][kChannels * kWordsPerChannel];  // steps 3-4
  };
  uint2 kept[kRowsPerWarp][kCtaThreads];    // each thread's rows' aq words (gate, up), its own slots
  Quantizer quant[kOutputs][kLaneCh][32];   // channel 4 l + j at [o][j][l]: a warp's loads are conflict-free
  float row_scale[2][kColumnTile];          // a's gate and up scales of the tile's rows (0 past them)
  int32_t row_off[kMaxGroups + 1];
  int32_t tile_off[kMaxGroups + 1];
};
constexpr int kSmemBytes = static_cast<int>(sizeof(Shared));
static_assert(2 * (kSmemBytes + 1024) <= 228 * 1024, "two CTAs fit an SM's shared memory");

// 1 / x of four logistic denominators (SwiGluDenominator: x >= 1, +inf or NaN), each the correctly rounded
// reciprocal, so bitwise SwiGluSigmoid's IEEE quotient 1 / x: RecipInRange (ops/e4m3.cuh) for 1 <= x < 2^126. Where
// any of the four is not below 2^126 (a gate below about -87.3, whose logistic is subnormal or zero, or a NaN) all
// four take __frcp_rn: one rarely taken branch per four values, no branch region around each value's division (those
// kept the scheduler from interleaving the values' long-latency steps).
// (static: one copy per translation unit; out of line: inlined at each of its sites its code would crowd the
// instruction cache.)
static __device__ __noinline__ float4 RecipFourExact(float a, float b, float c, float d) {
  return make_float4(__frcp_rn(a), __frcp_rn(b), __frcp_rn(c), __frcp_rn(d));
}
__device__ __forceinline__ void RecipFour(const float (&x)[4], float (&r)[4]) {
  bool exact = false;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    r[j] = RecipInRange(x[j]);
    exact |= !(x[j] < 0x1p126f);
  }
  if (__builtin_expect(exact, 0)) {
    const float4 e = RecipFourExact(x[0], x[1], x[2], x[3]);
    r[0] = e.x, r[1] = e.y, r[2] = e.z, r[3] = e.w;
  }
}

// h, d_gate and d_up of a lane's 4 channels of one row: the gate's and the up's e4m3 bytes (a word each) dequantized
// with their row scales, and dh; SwiGluAndGrad's operations (common/swiglu.h), the logistic by RecipFour.
__device__ __forceinline__ void RowValues(uint2 a, float gate_scale, float up_scale, const float4& dh, float (&h)[4],
                                          float (&d_gate)[4], float (&d_up)[4]) {
  float gate[4], up[4], den[4], sig[4];
  DequantizeE4m3Pair(a.x, gate_scale, gate[0], gate[1]);
  DequantizeE4m3Pair(a.x >> 16, gate_scale, gate[2], gate[3]);
  DequantizeE4m3Pair(a.y, up_scale, up[0], up[1]);
  DequantizeE4m3Pair(a.y >> 16, up_scale, up[2], up[3]);
  const float d[4] = {dh.x, dh.y, dh.z, dh.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) den[j] = SwiGluDenominator(gate[j]);
  RecipFour(den, sig);
#pragma unroll
  for (int j = 0; j < 4; ++j) SwiGluAndGradOfSig(gate[j], sig[j], up[j], d[j], &h[j], &d_gate[j], &d_up[j]);
}

__global__ void __launch_bounds__(kCtaThreads, 2)
    SwiGluBackwardKernel(const uint8_t* __restrict__ aq, const float* __restrict__ a_s, const float* __restrict__ dh,
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

  // 1. Load (aq into the thread's own slots of `kept`, dh into registers; the rows past the tile's as zeros, whose
  // values are zeros), compute, quantize the rows of da, keep the column amaxes.
  const int valid = min(kRowsPerWarp, max(0, tile.rows - row0));  // the warp's rows in the tile
  {
    const int i = threadIdx.x % kColumnTile, half = threadIdx.x / kColumnTile;
    sm.row_scale[half][i] = i < tile.rows ? a_s[(tile.first + i) * R + half * blocks + cb] : 0.f;
  }
  float4 d[kRowsPerWarp];
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    if (k < valid) {
      const int64_t r = tile.first + row0 + k;
      qcols::CopyAsync4(&sm.kept[k][threadIdx.x].x, aq + r * C + gate_c + 4 * lane);
      qcols::CopyAsync4(&sm.kept[k][threadIdx.x].y, aq + r * C + up_c + 4 * lane);
      d[k] = *reinterpret_cast<const float4*>(dh + r * F + gate_c + 4 * lane);
    } else {
      sm.kept[k][threadIdx.x] = make_uint2(0u, 0u);
      d[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  qcols::CommitCopies();
  qcols::WaitCopies();  // this thread's copies: the only slots of `kept` it reads
  __syncthreads();      // row_scale
  float amax[kOutputs][4] = {};
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    // Every row, in the tile or not (its values then zeros, which change no amax), so that the warp's shuffles run
    // converged; only the tile's rows are stored.
    const int i = row0 + k;
    float h[4], dg[4], du[4];
    RowValues(sm.kept[k][threadIdx.x], sm.row_scale[0][i], sm.row_scale[1][i], d[k], h, dg, du);
    const float sg = WarpRowScaleOfResults(dg), su = WarpRowScaleOfResults(du);  // float32 results: canonical NaN
    // QuantizeWord of each, their rare exact paths behind one branch.
    const Quantizer qg = QuantizerOfTileScale(sg), qu = QuantizerOfTileScale(su);
    uint32_t wg, wu;
    const bool fast_g = QuantizeFourFast(dg, qg, wg), fast_u = QuantizeFourFast(du, qu, wu);
    if (__builtin_expect(!(fast_g && fast_u), 0)) {
      if (!fast_g) wg = QuantizeFourExact(dg[0], dg[1], dg[2], dg[3], sg);
      if (!fast_u) wu = QuantizeFourExact(du[0], du[1], du[2], du[3], su);
    }
    if (k < valid) {  // warp-uniform
      const int64_t r = tile.first + i;
      reinterpret_cast<uint32_t*>(da_q + r * C + gate_c)[lane] = wg;
      reinterpret_cast<uint32_t*>(da_q + r * C + up_c)[lane] = wu;
      if (lane == 0) {
        da_s[r * R + cb] = sg;
        da_s[r * R + blocks + cb] = su;
      }
    }
    // d_gate, d_up and h are float32 results, whose NaN is the device's one canonical NaN (positive): max.NaN's NaN,
    // so MaxAbsNaN is AmaxStep here.
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      amax[0][j] = qcols::MaxAbsNaN(amax[0][j], dg[j]);
      amax[1][j] = qcols::MaxAbsNaN(amax[1][j], du[j]);
      amax[2][j] = qcols::MaxAbsNaN(amax[2][j], h[j]);
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
    if (o == 2)
      h_ts[t * F + gate_c + c] = sc;
    else
      da_ts[t * C + (o ? up_c : gate_c) + c] = sc;
  }
  __syncthreads();  // quant; part is dead from here on (packed takes its bytes)

  // 3. The same values again, quantized per column, packed channel-major.
#pragma unroll
  for (int m = 0; m < kRowsPerWarp / 4; ++m) {
    float v[kOutputs][kLaneCh][4];  // [output][channel][row 4 m + b]
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int k = 4 * m + b, i = row0 + k;
      float h[4], dg[4], du[4];
      RowValues(sm.kept[k][threadIdx.x], sm.row_scale[0][i], sm.row_scale[1][i], d[k], h, dg, du);
#pragma unroll
      for (int j = 0; j < kLaneCh; ++j) v[0][j][b] = dg[j], v[1][j][b] = du[j], v[2][j][b] = h[j];
    }
    // PackFourRows of an output's 4 words, their rare exact paths behind one branch.
#pragma unroll
    for (int o = 0; o < kOutputs; ++o) {
      uint32_t word[kLaneCh], slow = 0;  // bit j: word j takes the exact path
#pragma unroll
      for (int j = 0; j < kLaneCh; ++j) slow |= uint32_t(!QuantizeFourFast(v[o][j], sm.quant[o][j][lane], word[j])) << j;
      if (__builtin_expect(slow != 0, 0))
#pragma unroll
        for (int j = 0; j < kLaneCh; ++j)
          if (slow >> j & 1u) word[j] = qcols::PackFourRowsExact(v[o][j], sm.quant[o][j][lane], m, valid);
#pragma unroll
      for (int j = 0; j < kLaneCh; ++j)
        sm.packed[o][qcols::PackedWord<kLaneCh>(kLaneCh * lane + j, warp * (kRowsPerWarp / 4) + m)] = word[j];
    }
  }
  __syncthreads();

  // 4. Each channel's 128 bytes to its token-contiguous row.
  for (int e = warp; e < kOutputs * kChannels; e += kWarps) {
    const int o = e / kChannels, c = e % kChannels;
    uint8_t* row = o == 2 ? h_t + (gate_c + c) * Mp : da_t + ((o ? up_c : gate_c) + c) * Mp;
    qcols::StoreChannel<kLaneCh>(sm.packed[o], c, row + t * kColumnTile);
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
  if (F < kChannels || F % kChannels != 0 || tiles < ColumnTilesNeeded(M, G) || tiles > 0x7FFFFFFF / (F / kChannels))
    return Status::Error(kInvalidArgument, "jax_moe_overlap: swiglu_backward_fp8: F must be a positive multiple of "
                                           "128, the tiles at least ceil(M / 128) + G and tiles * F / 128 below "
                                           "2^31, got F=" + std::to_string(F) + ", tiles=" + std::to_string(tiles));
  if (!(st = SetKernelSmem(reinterpret_cast<const void*>(SwiGluBackwardKernel), kSmemBytes, "SwiGluBackwardKernel"))
           .ok())
    return st;
  const int64_t items = tiles * (F / kChannels);
  SwiGluBackwardKernel<<<static_cast<unsigned>(items), kCtaThreads, kSmemBytes, stream>>>(
      aq, a_s, dh, M, F, group_sizes, static_cast<int>(G), kColumnTile * tiles, da_q, da_s, da_t, da_ts, h_t, h_ts);
  return CudaStatus(cudaGetLastError(), "launch of SwiGluBackwardKernel");
}

}  // namespace jmo::cuda
