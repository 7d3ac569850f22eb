// jmo_quantize_weight_fp8 on CUDA (quantize_weight.h): one CTA of 256 threads per 128 x 128 block of w [E, K, N],
// numbered (expert, block row, block column) with the block column fastest, so that the CTAs at work together read
// whole rows of w. The block is read once, into registers: warp w takes the block's rows 16 w .. 16 w + 15, a lane 4
// consecutive columns of each (one 16-byte load of float32 or one 8-byte load of bfloat16 per row, the column
// quantizer's input forms RowsF32 and RowsBf16x4: a warp reads a row's 512 or 256 contiguous bytes). Then:
//   1. the block's amax: each lane's over its 64 values, the warp's by shuffles, the 8 warps' through shared memory;
//   2. its scale, ColumnTileScale (fp8.tile_scale), written by thread 0, and the quantizer (QuantizerOfTileScale);
//   3. every value quantized, four at a time (QuantizeFourFast: the bracketed conversion of ops/e4m3.cuh, bitwise
//      RoundE4m3 of the IEEE quotient x / s; QuantizeFour's exact path where a word's brackets differ or s is not
//      finite), one branch for the thread's 16 words;
//   4. the stores. In w's layout ([E, K, N]), a lane's word is its 4 columns of a row: a warp stores a row's 128
//      contiguous bytes. Transposed ([E, N, K], fp8.quantize_weight's), the word is 4 consecutive rows of one column
//      (a column of the block is a row of W^T), packed into a column-major shared buffer (the column quantizer's
//      swizzle, PackedWord: conflict-free both ways) and stored a column per warp instruction (StoreChannel: 128
//      contiguous bytes of a row of W^T).
// The amax is the largest |x| whatever the order (a NaN makes it NaN, here the device's canonical NaN: the
// scale's payload is not the CPU handler's, its NaN-ness is), so the scale is the CPU handler's bit for bit.
#include "cuda/ops/quantize_weight.h"

#include <string>

#include "common/fp8_columns.h"
#include "cuda/launch.h"
#include "cuda/ops/e4m3.cuh"
#include "cuda/ops/grouped_gemm.h"
#include "cuda/ops/quantize_columns.cuh"

namespace jmo::cuda {
namespace {

constexpr int kBlock = 128;  // a block's side
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kRows = kBlock / kWarps;  // a warp's rows of the block: 8
constexpr int kWords = kRows;           // a thread's e4m3 words: 8 rows x 4 columns, 4 values a word
static_assert(kRows % 4 == 0, "a warp's rows of one column pack into whole words");

// Where a thread's words go. Word i: in w's layout ([E, K, N]) row i of the warp's rows, the lane's 4 columns,
// stored to q; transposed ([E, N, K]), the lane's column j = i / kColumnWords, rows 4 m .. 4 m + 3 of the warp's
// (m = i % kColumnWords), a word of the column-major packed buffer (q is written from it after the barrier).
constexpr int kColumnWords = kRows / 4;
template <bool kTransposed>
struct Place {
  uint8_t* q;
  int64_t row0, col0, N;  // the warp's first row of w as [E K, N] rows; the lane's first column; w's columns
  uint32_t* packed;
  int lane, warp;
  __device__ __forceinline__ void Put(int i, uint32_t word) const {
    if constexpr (kTransposed)
      packed[qcols::PackedWord<4>(4 * lane + i / kColumnWords, warp * kColumnWords + i % kColumnWords)] = word;
    else
      *reinterpret_cast<uint32_t*>(q + (row0 + i) * N + col0) = word;
  }
};

// Word i's 4 values from the thread's x[row][column] (the warp's rows, the lane's 4 columns), as Place lays it.
template <bool kTransposed>
__device__ __forceinline__ void WordValues(const float (&x)[kRows][4], int i, float (&v)[4]) {
#pragma unroll
  for (int b = 0; b < 4; ++b) v[b] = kTransposed ? x[4 * (i % kColumnWords) + b][i / kColumnWords] : x[i][b];
}

// The exact path of a thread's words (rare: a word whose brackets differ, or a scale that is not finite), each word by
// QuantizeFour, its values read again from w. Out of line, so that across its calls of the exact division nothing
// but addresses lives (the kernel's values would not fit beside the calls' saved registers).
template <class In, bool kTransposed>
__device__ __noinline__ void PutWordsExact(In in, Place<kTransposed> place, Quantizer quant) {
  for (int i = 0; i < kWords; ++i) {
    float v[4];
    for (int b = 0; b < 4; ++b) {
      float all[4];
      In::Values(in.Load(place.row0 + (kTransposed ? 4 * (i % kColumnWords) + b : i), place.col0), all);
      v[b] = kTransposed ? all[i / kColumnWords] : all[b];
    }
    place.Put(i, QuantizeFour(v, quant));
  }
}

template <class In, bool kTransposed>
__global__ void __launch_bounds__(kThreads, 2)
    QuantizeWeightKernel(In in, int64_t K, int64_t N, uint8_t* __restrict__ q, float* __restrict__ s) {
  static_assert(In::kLaneCh == 4 && 32 * In::kLaneCh == kBlock, "a lane's 4 columns: a warp spans a block's row");
  __shared__ float warp_amax[kWarps];
  __shared__ __align__(16) uint32_t packed[kTransposed ? kBlock * qcols::kWordsPerChannel : 1];
  const int64_t kbs = K / kBlock, nbs = N / kBlock;
  const int64_t nb = blockIdx.x % nbs, kb = (blockIdx.x / nbs) % kbs, e = blockIdx.x / nbs / kbs;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const Place<kTransposed> place{q, e * K + kb * kBlock + warp * kRows, nb * kBlock + 4 * lane, N, packed, lane, warp};

  // Every load issued before any math; then the values as float32 (bfloat16's exactly).
  typename In::Raw raw[kRows];
#pragma unroll
  for (int k = 0; k < kRows; ++k) raw[k] = in.Load(place.row0 + k, place.col0);
  float x[kRows][4];
#pragma unroll
  for (int k = 0; k < kRows; ++k) In::Values(raw[k], x[k]);

  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < kRows; ++k)
#pragma unroll
    for (int j = 0; j < 4; ++j) amax = qcols::MaxAbsNaN(amax, x[k][j]);
#pragma unroll
  for (int d = 16; d > 0; d /= 2) amax = qcols::MaxAbsNaN(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, d));
  if (lane == 0) warp_amax[warp] = amax;
  __syncthreads();
  float block_amax = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) block_amax = AmaxStep(block_amax, warp_amax[w]);
  const float sc = ColumnTileScale(block_amax);
  const Quantizer quant = QuantizerOfTileScale(sc);
  if (threadIdx.x == 0) s[kTransposed ? (e * nbs + nb) * kbs + kb : (e * kbs + kb) * nbs + nb] = sc;

  uint32_t words[kWords];
  bool fast = true;
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    float v[4];
    WordValues<kTransposed>(x, i, v);
    fast &= QuantizeFourFast(v, quant, words[i]);
  }
  if (__builtin_expect(fast, 1)) {
#pragma unroll
    for (int i = 0; i < kWords; ++i) place.Put(i, words[i]);
  } else {
    PutWordsExact<In, kTransposed>(in, place, quant);
  }

  if constexpr (kTransposed) {
    __syncthreads();
    for (int c = warp; c < kBlock; c += kWarps)
      qcols::StoreChannel<4>(packed, c, q + (e * N + nb * kBlock + c) * K + kb * kBlock);
  }
}

template <class In>
Status Launch(cudaStream_t stream, In in, int64_t blocks, int64_t K, int64_t N, bool transposed, uint8_t* q,
              float* s) {
  const unsigned grid = static_cast<unsigned>(blocks);
  if (transposed)
    QuantizeWeightKernel<In, true><<<grid, kThreads, 0, stream>>>(in, K, N, q, s);
  else
    QuantizeWeightKernel<In, false><<<grid, kThreads, 0, stream>>>(in, K, N, q, s);
  return CudaStatus(cudaGetLastError(), "launch of QuantizeWeightKernel");
}

}  // namespace

Status QuantizeWeightFp8(cudaStream_t stream, DType dt, const void* w, int64_t E, int64_t K, int64_t N,
                         bool transposed, uint8_t* q, float* s) {
  DeviceInfo dev;
  Status st = Fp8DeviceCheck("quantize_weight_fp8", &dev);
  if (!st.ok()) return st;
  if (E < 0 || K < kBlock || K % kBlock != 0 || N < kBlock || N % kBlock != 0 ||
      E * (K / kBlock) > 0x7FFFFFFF / (N / kBlock))
    return Status::Error(kInvalidArgument, "jax_moe_overlap: quantize_weight_fp8: K and N must be positive multiples "
                                           "of 128 and the blocks E * K / 128 * N / 128 below 2^31, got E=" +
                                               std::to_string(E) + ", K=" + std::to_string(K) + ", N=" +
                                               std::to_string(N));
  const int64_t blocks = E * (K / kBlock) * (N / kBlock);
  if (blocks == 0) return Status{};
  if (dt == DType::kF32)
    return Launch(stream, qcols::RowsF32{static_cast<const float*>(w), N}, blocks, K, N, transposed, q, s);
  return Launch(stream, qcols::RowsBf16x4{static_cast<const __nv_bfloat16*>(w), N}, blocks, K, N, transposed, q, s);
}

}  // namespace jmo::cuda
