// The FP8 recipe's SwiGLU forward as a WgmmaLoop epilogue (SwiGluFp8TileOf): from a tile's float32 accumulators of
// GEMM1 (the gate's 128 columns and the up projection's), h = SwiGlu(gate, up) in float32 (common/swiglu.h), h and a
// quantized 1 x 128 by swiglu_forward_fp8's device steps (ops/fp8_rows.cuh). Its kernels: GroupedSwiGluFp8Kernel
// (wgmma_swiglu_fp8.cuh: grouped_matmul_swiglu_fp8; stores staged in shared memory) and dispatch_gemm's FP8 kernel
// (ops/dispatch_gemm.cu; direct stores).
//
// The epilogue (SwiGluFp8TileOf::Store): in the m64n256 accumulator layout (StoreAccTile's comment) a row's 128 columns
// of one half lie in the 4 lanes of a quad, 32 each (blocks j = 0..15, columns 8 j + 2 (lane % 4) and the next), so a
// tile's amax is each lane's over its 32 values, then two xor shuffles within the quad (LanesRowScaleOfResults<4>).
// Each lane quantizes its values 4 at a time (blocks j and j + 1 of a row: QuantizeWords, each byte
// RoundE4m3(x / s) whatever the grouping) into 2-byte pairs: stored directly (8 bytes of a row a quad, a quarter of
// each 32-byte sector a warp store writes) or staged per warp in shared memory and stored as whole 128-byte rows
// (kStaged: a quarter of the sectors); lane 0 of the quad stores the row's three scales.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/swiglu.h"
#include "cuda/gemm/sm90/wgmma_mainloop.cuh"
#include "cuda/ops/fp8_rows.cuh"
#include "cuda/ops/swiglu_sigmoid.cuh"

namespace wgmma_gemm {

constexpr int kSwiGluFp8Cols = kBN / 2;  // h's columns per tile: one 1 x 128 scale tile of h, of a's gate and its up

// Where SwiGluFp8TileOf<true> stages its stores, in the kernel's shared memory (16-byte aligned): per consumer warp
// one tensor's 8 rows of a row step, 128 bytes each, kSwiGluFp8StagePitch bytes apart: a multiple of 16 (the
// read-out's 16-byte loads) and 4 banks on per row, so the quads' 2-byte writes to 8 rows fall in distinct banks.
constexpr int kSwiGluFp8StagePitch = 144;
constexpr int kSwiGluFp8StageWarpBytes = 8 * kSwiGluFp8StagePitch;
constexpr int kSwiGluFp8StageBytes = 8 * kSwiGluFp8StageWarpBytes;  // the 8 consumer warps

// One tile of h's rows a_row .. a_row + rows - 1 and columns n0 .. n0 + 127 (n_hi = F + n0: the up projection's
// columns). The pointers are the tile's row 0 and first column (or scale) in each output.
// kStaged: the bytes go to global memory through `stage` (kSwiGluFp8StageBytes of shared memory), 16 bytes a lane and
// whole 128-byte rows a warp; else each lane stores its 2-byte pieces directly, 8 rows' 8 bytes a warp store (a
// quarter of each 32-byte sector: for kernels whose shared memory has no room, dispatch_gemm's).
struct SwiGluFp8Staging {
  uint32_t stage = 0;  // the staging's shared-memory address (above; 32 bits: the tile is live across the loop)
};
struct SwiGluFp8NoStaging {};
template <bool kStaged>
struct SwiGluFp8TileOf : EpilogueTile, std::conditional_t<kStaged, SwiGluFp8Staging, SwiGluFp8NoStaging> {
  uint8_t* h_q;  // h_q [M, F]: + a_row * F + n0
  float* h_s;    // h_s [M, F / 128]: + a_row * F / 128 + n0 / 128
  uint8_t* a_q;  // a_q [M, 2F]: + a_row * 2F + n0 (the gate's; the up's F columns right of it); nullptr: a not kept
                 // (dispatch_gemm's inference forward: neither a_q nor a_s written)
  float* a_s;    // a_s [M, 2F / 128]: + a_row * 2F / 128 + n0 / 128 (the gate's; the up's F / 128 right of it)
  int64_t F;

  // A row's 8 words of one tile held by this lane (QuantizeWords': word m of blocks 2m and 2m + 1, two columns
  // each) stored at dst (the row's tile, column 0) + 8 j + col, 2 bytes a block.
  __device__ __forceinline__ static void StoreWords(const uint32_t (&w)[8], int col, uint8_t* dst) {
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      *reinterpret_cast<uint16_t*>(dst + 16 * m + col) = static_cast<uint16_t>(w[m]);
      *reinterpret_cast<uint16_t*>(dst + 16 * m + 8 + col) = static_cast<uint16_t>(w[m] >> 16);
    }
  }

  // One tensor's 32 values of this lane's row (a row tile's in the quad) quantized with the tile's scale (every lane
  // of the warp calls it: the shuffles take all of them), the words in w. Returns the scale.
  __device__ __forceinline__ static float Quantize(const float (&v)[32], uint32_t (&w)[8]) {
    using namespace jmo::cuda;
    const float s = LanesRowScaleOfResults<4>(v);
    QuantizeWords(v, QuantizerOfTileScale(s), w);
    return s;
  }

  // kStaged: the warp's words of rows r0 .. r0 + 7 (this lane's: row r0 + lane / 4) stored to dst0 + i ld for row
  // r0 + i (dst0: row r0's tile, column 0), rows below `rows` only, through the warp's staging: 2-byte writes to
  // shared memory, then 16-byte reads and global stores of whole 128-byte rows. (Plain C++ accesses through a generic
  // pointer to shared memory, which ptxas makes shared loads and stores: asm volatile's ordering would keep it from
  // interleaving the rows' steps around them.)
  __device__ __forceinline__ void StoreStaged(const uint32_t (&w)[8], int warp, int r0, uint8_t* dst0,
                                              int64_t ld) const {
    const int lane = threadIdx.x % 32;  // (from threadIdx: not a register held across the loop for the caller)
    unsigned char* st =
        static_cast<unsigned char*>(__cvta_shared_to_generic(this->stage + warp * kSwiGluFp8StageWarpBytes));
    StoreWords(w, 2 * (lane % 4), st + lane / 4 * kSwiGluFp8StagePitch);
    __syncwarp();  // the warp's rows staged before any lane reads them
#pragma unroll
    for (int t = 0; t < 2; ++t) {  // rows lane / 8 and lane / 8 + 4, 16-byte chunk lane % 8 of each
      const int i = lane / 8 + 4 * t, chunk = lane % 8;
      const uint4 x = *reinterpret_cast<const uint4*>(st + i * kSwiGluFp8StagePitch + 16 * chunk);
      if (r0 + i < rows) *reinterpret_cast<uint4*>(dst0 + i * ld + 16 * chunk) = x;
    }
    __syncwarp();  // every lane's reads before the next tensor's writes
  }

  // One tensor of this lane's row r (r < rows: `store`; warp `warp` of the consumers holds rows r - lane / 4 ..
  // r - lane / 4 + 7) quantized and stored at dst (row r's tile, column 0; ld the tensor's row stride). Returns the
  // scale.
  __device__ __forceinline__ float QuantizeAndStore(const float (&v)[32], bool store, int col, uint8_t* dst,
                                                    int64_t ld, int r, int warp, int lane) const {
    uint32_t w[8];
    const float s = Quantize(v, w);
    if constexpr (kStaged) {
      StoreStaged(w, warp, r - lane / 4, dst - lane / 4 * ld, ld);
    } else {
      if (store) StoreWords(w, col, dst);
    }
    return s;
  }

  // The epilogue (EpilogueTile's contract): acc[0..63] are the gate's columns, acc[64..127] the up projection's.
  // Per row: the 32 logistics with one rarely taken branch (SwiGluSigmoids), each tensor's amax by MaxAbsNaN (the
  // values are float32 results: LanesRowScaleOfResults), its quantizer by RecipInRange (QuantizerOfTileScale: the
  // scales are ColumnTileScale's) and its 8 words with one rarely taken branch to their exact path (QuantizeWords):
  // the bytes and scales of LanesRowScale, QuantizerOf and QuantizeFour (swiglu_forward_fp8.cu's), without a branch
  // region per value or word to keep ptxas from interleaving their long-latency steps.
  __device__ __forceinline__ void Store(const float* acc, int c, int wq, int lane) const {
    const int r_lo = c * 64 + wq * 16 + lane / 4, col = 2 * (lane % 4), warp = c * 4 + wq;
    const int64_t C = 2 * F, scales = F / kSwiGluFp8Cols;  // a's row; h's scales per row (a's: twice as many)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {  // rows r_lo and r_lo + 8: acc[4 j + 2 hr + e], e = 0, 1
      float gate[32], up[32], sig[32], h[32];
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          gate[2 * j + e] = acc[4 * j + 2 * hr + e];
          up[2 * j + e] = acc[64 + 4 * j + 2 * hr + e];
        }
      jmo::cuda::SwiGluSigmoids(gate, sig);
#pragma unroll
      for (int j = 0; j < 32; ++j) h[j] = jmo::SwiGluOfSig(gate[j], sig[j], up[j]);
      const int r = r_lo + 8 * hr;
      const bool store = r < rows;  // (rows past `rows` are computed, not stored)
      const float sh = QuantizeAndStore(h, store, col, h_q + r * F, F, r, warp, lane);
      if (store && col == 0) h_s[r * scales] = sh;
      if (a_q != nullptr) {  // (uniform)
        const float sg = QuantizeAndStore(gate, store, col, a_q + r * C, C, r, warp, lane);
        const float su = QuantizeAndStore(up, store, col, a_q + r * C + F, C, r, warp, lane);
        if (store && col == 0) {
          a_s[r * 2 * scales] = sg;
          a_s[r * 2 * scales + scales] = su;
        }
      }
    }
  }
};

// dispatch_gemm's FP8 kernel (its shared memory has no room for the staging).
using SwiGluFp8Tile = SwiGluFp8TileOf<false>;

}  // namespace wgmma_gemm
