// jmo_quantize_weight_fp8 on CUDA (quantize_weight.h): the 128 x 128 blocks of w [E, K, N], numbered (expert, block
// row, block column) with the block column fastest, by a persistent grid (as many CTAs of 512 threads as fit on the
// device: 2 per SM for bfloat16, 1 for float32), CTA c taking blocks c, c + grid, c + 2 grid, .. (the CTAs at work
// together read whole rows of w). A block goes global -> shared memory by 16-byte cp.async into a ring of kStages
// stages, issued kStages - 1 blocks ahead of the one being quantized, so that the loads of the next blocks are in
// flight while a CTA works on its current one (a load need not wait for the math, as it would in registers). Per block:
//   0. wait for its stage (cp.async.wait_group, then barrier A: every thread's copies landed, and every thread is
//      done with the stage the next load overwrites, the previous block's), issue the load kStages - 1 blocks ahead;
//   1. each thread reads its 32 values from the stage (ThreadValues: 8 rows x 4 columns transposed, 2 rows x 16
//      columns in w's layout), its amax, the warp's by shuffles, the 16 warps' through shared memory (barrier B);
//   2. the scale, ColumnTileScale (fp8.tile_scale), written by thread 0, and the quantizer (QuantizerOfTileScale);
//   3. the thread's 8 words of 4 values quantized (QuantizeFourFast: ops/e4m3.cuh's QuotientFast, bitwise
//      RoundE4m3 of the IEEE quotient x / s); where the block is not a fast tile (its scale not finite, or tiny),
//      PutWordsExact quantizes every word of the thread by QuantizeFour's exact path, its values read again from the
//      stage;
//   4. the words stored straight from registers: transposed ([E, N, K], fp8.quantize_weight's), a thread's 8 rows of
//      one column are 8 consecutive bytes of a row of W^T (an 8-byte store; 16 lanes write a row's 128 contiguous
//      bytes); in w's layout ([E, K, N]) a thread's 16 columns of a row are 16 consecutive bytes (a 16-byte store; 8
//      lanes write a row's 128 bytes);
//   5. with both layouts (kBoth: the forward's weights and the dgrads' from one read of w), steps 1 (the values
//      alone), 3 and 4 again in the other layout from the same stage, with the same scale.
// The stage holds the block row-major, each row's 16-byte chunks permuted (Slot) so that both the cp.async writes and
// both layouts' reads spread a warp's 16-byte accesses over all of shared memory's banks.
// The amax is the largest |x| whatever the order (a NaN makes it NaN, here the device's canonical NaN: the
// scale's payload is not the CPU handler's, its NaN-ness is), so the scale is the CPU handler's bit for bit.
#include "cuda/ops/quantize_weight.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <string>
#include <type_traits>

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
constexpr int kStages = 3;  // blocks in shared memory: the one being quantized and kStages - 1 in flight
constexpr int kWords = 8;   // a thread's e4m3 words: 32 values, 4 a word
static_assert(kThreads * 4 * kWords == kBlock * kBlock, "the CTA's threads cover a block, 32 values each");
// The most blocks a call takes: a CTA's block index plus kStages grids (grid < 2^22: CTAs per SM x SMs) fits an int.
constexpr int64_t kMaxBlocks = 0x7FFFFFFF - (int64_t{1} << 24);

// The stage of one block of element type T: kBlock rows of kRowBytes, row-major, each row's 16-byte chunks permuted.
template <class T>
struct Stage {
  static constexpr int kRowBytes = kBlock * static_cast<int>(sizeof(T));  // 256 (bfloat16) or 512 (float32)
  static constexpr int kChunks = kRowBytes / 16;                          // a row's 16-byte chunks: 16 or 32
  static constexpr int kBytes = kBlock * kRowBytes;
  static constexpr int kCopies = kBlock * kChunks / kThreads;  // a thread's cp.async of a block: 4 or 8
  static_assert(kChunks % 8 == 0 && kBlock * kChunks % kThreads == 0, "rows of whole 8-chunk bank rounds");

  // Where chunk ch of row r lies in the row: ch with its low 3 bits (which of the 8 16-byte bank groups) XORed by
  // bits of the row (r / 8) and of the chunk's high bits (ch / 8): a bijection of the row's chunks (the XOR mask
  // depends only on bits Slot leaves alone). Transposed, a warp instruction reads one chunk (or two neighbours) of
  // 16 rows 8 apart: the row term spreads them over the 8 groups; in w's layout, 8 lanes read chunks 2 c + h
  // (bfloat16) or 4 c + h (float32) of one row, c = 0 .. 7: the chunk term spreads them.
  __device__ __forceinline__ static int Slot(int r, int ch) { return ch ^ (((r >> 3) ^ (ch >> 3)) & 7); }

  // The address of column c (a whole number of elements into the row; a read of n <= 16 bytes from there stays in its
  // chunk: the callers read 4 or 16 / sizeof(T) values at columns that are multiples of that count).
  __device__ __forceinline__ static const unsigned char* At(const unsigned char* stage, int r, int c) {
    const int byte = c * static_cast<int>(sizeof(T));
    return stage + r * kRowBytes + Slot(r, byte >> 4) * 16 + (byte & 15);
  }

  // The block whose first element is src (rows N elements apart) into the stage, by 16-byte cp.async (a warp copies
  // 512 contiguous bytes of w), bypassing L1 (.cg: read once). Copy u of a thread is chunk ch = x % kChunks of row
  // r0 + u kRowsPerCopy (x the thread, r0 = x / kChunks): from src + Copies::from + u Copies::step, to byte
  // (Copies::to ^ Flip(u)) + u kRowsPerCopy kRowBytes of the stage. Since r0 < kRowsPerCopy, a power of two that 8
  // divides, r0 / 8 + u kRowsPerCopy / 8 adds no carries: Slot(r0 + u kRowsPerCopy, ch) = Slot(r0, ch) ^ Flip(u) / 16,
  // so one place per thread stays in a register and the copies' places are constants off it.
  static constexpr int kRowsPerCopy = kThreads / kChunks;
  static_assert((kRowsPerCopy & (kRowsPerCopy - 1)) == 0 && kRowsPerCopy % 8 == 0, "copy rows: 8 k, a power of 2");
  __device__ __forceinline__ static constexpr int Flip(int u) { return ((u * kRowsPerCopy / 8) & 7) * 16; }
  struct Copies {
    int64_t from, step;  // elements
    int to;              // copy 0's byte in the stage
    __device__ __forceinline__ Copies(int64_t N)
        : from(threadIdx.x / kChunks * N + threadIdx.x % kChunks * (16 / static_cast<int>(sizeof(T)))),
          step(kRowsPerCopy * N),
          to(threadIdx.x / kChunks * kRowBytes + Slot(threadIdx.x / kChunks, threadIdx.x % kChunks) * 16) {}
  };
  __device__ __forceinline__ static void Load(const T* src, const Copies& c, unsigned char* stage) {
    const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(stage));
#pragma unroll
    for (int u = 0; u < kCopies; ++u) {
      const unsigned dst = base + ((c.to ^ Flip(u)) + u * kRowsPerCopy * kRowBytes);
      const T* from = src + (c.from + u * c.step);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(from) : "memory");
    }
  }
};

// A block's place (expert e, block row kb, block column nb: block number (e kbs + kb) nbs + nb), advanced by a fixed
// count of blocks without a division: `step` holds that count as such a place (each part below its range).
struct BlockPlace {
  int e, kb, nb;
  __device__ __forceinline__ static BlockPlace Of(int b, int kbs, int nbs) {
    const int row_block = b / nbs;
    return {row_block / kbs, row_block % kbs, b % nbs};
  }
  __device__ __forceinline__ void Advance(const BlockPlace& step, int kbs, int nbs) {
    nb += step.nb;
    const int c1 = nb >= nbs;  // nb, step.nb < nbs: one carry at most
    nb -= c1 * nbs;
    kb += step.kb + c1;
    const int c2 = kb >= kbs;  // kb, step.kb < kbs and c1 <= 1: one carry at most
    kb -= c2 * kbs;
    e += step.e + c2;
  }
};

__device__ __forceinline__ void CommitLoads() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Every group of this thread's cp.async but the newest n complete.
template <int n>
__device__ __forceinline__ void WaitLoads() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(n) : "memory");
}

// n consecutive values of T as float32 (bfloat16's exactly) from 4 n bytes (float32) or 2 n bytes (bfloat16) at p
// (aligned to its size: 8 or 16 bytes).
template <class T, int n>
__device__ __forceinline__ void ReadValues(const unsigned char* p, float* v) {
  constexpr int kWordsRead = n * static_cast<int>(sizeof(T)) / 4;
  static_assert(kWordsRead == 2 || kWordsRead == 4, "one 8- or 16-byte shared memory read");
  uint32_t u[kWordsRead];
  if constexpr (kWordsRead == 4) {
    const uint4 r = *reinterpret_cast<const uint4*>(p);
    u[0] = r.x, u[1] = r.y, u[2] = r.z, u[3] = r.w;
  } else {
    const uint2 r = *reinterpret_cast<const uint2*>(p);
    u[0] = r.x, u[1] = r.y;
  }
#pragma unroll
  for (int k = 0; k < kWordsRead; ++k) {
    if constexpr (std::is_same_v<T, float>) {
      v[k] = __uint_as_float(u[k]);
    } else {
      v[2 * k] = qcols::Bf16Lo(u[k]);
      v[2 * k + 1] = qcols::Bf16Hi(u[k]);
    }
  }
}

// A thread's 32 values of a block, x[a][b] = the block's (Row(a), Col(b)), and its 8 words, word i of the 4 values
// x[A(i, t)][B(i, t)], t = 0 .. 3 (t's in the low byte first), at Dst(i) in q. Transposed: rows 8 g + a (a < 8, g =
// lane % 16), columns 4 cg + b (b < 4, cg = 2 warp + lane / 16); word i is column i / 2's rows 4 (i % 2) .. + 3, bytes
// 4 (i % 2) .. of the thread's 8 in the row of W^T that is that column. In w's layout: rows 4 warp + lane / 8 + 64 a
// (a < 2), columns 16 c + b (b < 16, c = lane % 8); word i is row i / 4's columns 4 (i % 4) .. + 3, bytes 4 (i % 4) ..
// of the thread's 16 in that row of q.
template <class T, bool kTransposed>
struct ThreadValues {
  static constexpr int kRowsA = kTransposed ? 8 : 2, kColsB = kTransposed ? 4 : 16;
  static_assert(kRowsA * kColsB == 4 * kWords, "32 values");
  static constexpr int kRun = kTransposed ? 4 : 16 / static_cast<int>(sizeof(T));  // values a shared read gives
  int row0, col0;  // Row(a) = row0 + kRowStep a, Col(b) = col0 + b
  static constexpr int kRowStep = kTransposed ? 1 : 64;
  uint8_t* q;      // where the thread's first byte goes (word 0)
  int64_t q_step;  // transposed: from one column's row of W^T to the next (K); in w's layout from row a to a + 1
                   // (64 N)

  __device__ __forceinline__ ThreadValues(int e, int kb, int nb, int64_t K, int64_t N, uint8_t* q_all) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if constexpr (kTransposed) {
      row0 = 8 * (lane & 15), col0 = 4 * (2 * warp + (lane >> 4));
      q = q_all + (e * N + nb * kBlock + col0) * K + kb * kBlock + row0;  // int64 N, K: no int overflow
      q_step = K;
    } else {
      row0 = 4 * warp + (lane >> 3), col0 = 16 * (lane & 7);
      q = q_all + (e * K + kb * kBlock + row0) * N + nb * kBlock + col0;
      q_step = kRowStep * N;
    }
  }
  __device__ __forceinline__ int Row(int a) const { return row0 + kRowStep * a; }
  __device__ __forceinline__ static int A(int i, int t) { return kTransposed ? 4 * (i % 2) + t : i / 4; }
  __device__ __forceinline__ static int B(int i, int t) { return kTransposed ? i / 2 : 4 * (i % 4) + t; }
  __device__ __forceinline__ uint8_t* Dst(int i) const {
    return kTransposed ? q + (i / 2) * q_step + 4 * (i % 2) : q + (i / 4) * q_step + 4 * (i % 4);
  }

  __device__ __forceinline__ void Read(const unsigned char* stage, float (&x)[kRowsA][kColsB]) const {
#pragma unroll
    for (int a = 0; a < kRowsA; ++a)
#pragma unroll
      for (int b = 0; b < kColsB; b += kRun) ReadValues<T, kRun>(Stage<T>::At(stage, Row(a), col0 + b), &x[a][b]);
  }
  // The 8 words by 4 stores of a column's 2 words (transposed: 8 bytes) or 2 of a row's 4 (w's layout: 16 bytes).
  static constexpr int kWordsPerStore = kTransposed ? 2 : 4;
  __device__ __forceinline__ void Store(const uint32_t (&w)[kWords]) const {
#pragma unroll
    for (int k = 0; k < kWords / kWordsPerStore; ++k) {
      if constexpr (kTransposed)
        *reinterpret_cast<uint2*>(Dst(2 * k)) = make_uint2(w[2 * k], w[2 * k + 1]);
      else
        *reinterpret_cast<uint4*>(Dst(4 * k)) = make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
    }
  }
};

// The exact path of a thread's words (rare: a block that is not a fast tile, ops/e4m3.cuh): each word by
// QuantizeFour, its values read again from the stage one by one, stored as a 4-byte word. Out of line, so that
// across its calls of the exact division nothing but addresses lives.
template <class T, bool kTransposed>
__device__ __noinline__ void PutWordsExact(const unsigned char* stage, ThreadValues<T, kTransposed> th,
                                           Quantizer quant) {
  using Th = ThreadValues<T, kTransposed>;
  for (int i = 0; i < kWords; ++i) {
    float v[4];
    for (int t = 0; t < 4; ++t) {
      const unsigned char* p = Stage<T>::At(stage, th.Row(Th::A(i, t)), th.col0 + Th::B(i, t));
      if constexpr (std::is_same_v<T, float>)
        v[t] = *reinterpret_cast<const float*>(p);
      else
        v[t] = __uint_as_float(static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16);
    }
    *reinterpret_cast<uint32_t*>(th.Dst(i)) = QuantizeFour(v, quant);
  }
}

// Steps 3 and 4 of a block in one layout: the thread's values x (th's, read from the stage st) quantized by `quant`
// (the block's) and stored, by the exact path where a word needs it.
template <class T, bool kTransposed>
__device__ __forceinline__ void PutBlockWords(const unsigned char* st, const ThreadValues<T, kTransposed>& th,
                                              const float (&x)[ThreadValues<T, kTransposed>::kRowsA]
                                                              [ThreadValues<T, kTransposed>::kColsB],
                                              Quantizer quant) {
  using Th = ThreadValues<T, kTransposed>;
  uint32_t words[kWords];
  bool fast = true;
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    float v[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) v[t] = x[Th::A(i, t)][Th::B(i, t)];
    fast &= QuantizeFourFast(v, quant, words[i]);
  }
  if (__builtin_expect(fast, 1))
    th.Store(words);
  else
    PutWordsExact<T, kTransposed>(st, th, quant);
}

// The scale's index of block b = (e kbs + kb) nbs + nb: [E, N / 128, K / 128] transposed, else b.
template <bool kTransposed>
__device__ __forceinline__ int ScaleIndex(int b, int e, int kb, int nb, int kbs, int nbs) {
  return kTransposed ? (e * nbs + nb) * kbs + kb : b;  // < blocks: int
}

// Registers: 64 a thread at 2 CTAs of 512 per SM (bfloat16: 3 stages of 32 KB each fit twice), 128 at 1 (float32's
// 3 stages of 64 KB).
template <class T>
constexpr int kCtasPerSm = sizeof(T) == 2 ? 2 : 1;

template <class T, bool kTransposed, bool kBoth>
__global__ void __launch_bounds__(kThreads, kCtasPerSm<T>)
    QuantizeWeightKernel(const T* __restrict__ w, int blocks, int kbs, int nbs, int64_t K, int64_t N,
                         uint8_t* __restrict__ q, float* __restrict__ s, uint8_t* __restrict__ q2,
                         float* __restrict__ s2) {
  using Th = ThreadValues<T, kTransposed>;
  extern __shared__ __align__(16) unsigned char stages[];  // kStages x Stage<T>::kBytes
  __shared__ float warp_amax[kWarps];
  const int grid = gridDim.x;
  const auto first = [&](const BlockPlace& p) {  // the block's first element
    return w + (static_cast<int64_t>(p.e * kbs + p.kb) * kBlock * N + p.nb * kBlock);
  };
  const auto stage = [&](int j) { return stages + (j % kStages) * Stage<T>::kBytes; };
  const typename Stage<T>::Copies copies(N);
  const BlockPlace step = BlockPlace::Of(grid, kbs, nbs);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  // The first kStages - 1 blocks' loads, a group each (an empty group past the last block: the count of groups
  // after block j's is then always kStages - 2 when it is waited for).
  BlockPlace ahead = BlockPlace::Of(blockIdx.x, kbs, nbs);
#pragma unroll
  for (int j = 0; j < kStages - 1; ++j) {
    if (blockIdx.x + j * grid < blocks) Stage<T>::Load(first(ahead), copies, stage(j));
    CommitLoads();
    ahead.Advance(step, kbs, nbs);
  }
  BlockPlace at = BlockPlace::Of(blockIdx.x, kbs, nbs);  // block b's
  int j = 0;  // the CTA's block count: block b's stage is stage(j)
  // b + kStages grid stays below 2^31: blocks < 2^31 - 2^24 (QuantizeWeightFp8) and grid < 2^22.
  for (int b = blockIdx.x; b < blocks; b += grid, ++j, at.Advance(step, kbs, nbs), ahead.Advance(step, kbs, nbs)) {
    WaitLoads<kStages - 2>();
    __syncthreads();  // A: block b's stage complete for every thread; every thread done with block b - grid's
    // Block b + (kStages - 1) grid (ahead's) into block b - grid's stage.
    if (b + (kStages - 1) * grid < blocks) Stage<T>::Load(first(ahead), copies, stage(j + kStages - 1));
    CommitLoads();

    const int e = at.e, kb = at.kb, nb = at.nb;
    const Th th(e, kb, nb, K, N, q);
    const unsigned char* st = stage(j);
    float x[Th::kRowsA][Th::kColsB];
    th.Read(st, x);

    float amax = 0.f;
#pragma unroll
    for (int a = 0; a < Th::kRowsA; ++a)
#pragma unroll
      for (int c = 0; c < Th::kColsB; ++c) amax = MaxAbsNaN(amax, x[a][c]);
#pragma unroll
    for (int d = 16; d > 0; d /= 2) amax = MaxAbsNaN(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, d));
    if (lane == 0) warp_amax[warp] = amax;
    __syncthreads();  // B (warp_amax is written again only after the next block's barrier A)
    // The warps' amaxes are >= 0 or the canonical NaN (max.NaN's): MaxAbsNaN over them is AmaxStep's result bit for
    // bit (the largest, or that NaN), in one instruction a warp instead of AmaxStep's three.
    float block_amax = 0.f;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) block_amax = MaxAbsNaN(block_amax, warp_amax[v]);
    const float sc = ColumnTileScale(block_amax);
    const Quantizer quant = QuantizerOfTileScale(sc);
    if (threadIdx.x == 0) {
      s[ScaleIndex<kTransposed>(b, e, kb, nb, kbs, nbs)] = sc;
      if constexpr (kBoth) s2[ScaleIndex<!kTransposed>(b, e, kb, nb, kbs, nbs)] = sc;
    }
    PutBlockWords<T, kTransposed>(st, th, x, quant);
    if constexpr (kBoth) {  // step 5: the other layout's values read again from the stage
      using Th2 = ThreadValues<T, !kTransposed>;
      const Th2 th2(e, kb, nb, K, N, q2);
      float x2[Th2::kRowsA][Th2::kColsB];
      th2.Read(st, x2);
      PutBlockWords<T, !kTransposed>(st, th2, x2, quant);
    }
  }
}

// The kernel of a layout (transposed) and of one or both (both).
template <class T, bool kTransposed>
const void* KernelOf(bool both) {
  return both ? reinterpret_cast<const void*>(&QuantizeWeightKernel<T, kTransposed, true>)
              : reinterpret_cast<const void*>(&QuantizeWeightKernel<T, kTransposed, false>);
}

template <class T>
Status Launch(cudaStream_t stream, const DeviceInfo& dev, const T* w, int64_t blocks, int64_t K, int64_t N,
              bool transposed, uint8_t* q, float* s, uint8_t* q2, float* s2) {
  const bool both = q2 != nullptr;
  const void* kernel = transposed ? KernelOf<T, true>(both) : KernelOf<T, false>(both);
  constexpr int kSmem = kStages * Stage<T>::kBytes;
  Status st = SetKernelSmem(kernel, kSmem, "QuantizeWeightKernel");
  if (!st.ok()) return st;
  int per_sm = 0;
  st = CudaStatus(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, kSmem),
                  "cudaOccupancyMaxActiveBlocksPerMultiprocessor(QuantizeWeightKernel)");
  if (!st.ok()) return st;
  if (per_sm < 1)
    return Status::Error(kInternal, "jax_moe_overlap: quantize_weight_fp8: no CTA of QuantizeWeightKernel fits an SM");
  const int grid = static_cast<int>(std::min<int64_t>(blocks, static_cast<int64_t>(per_sm) * dev.sms));
  int kbs = static_cast<int>(K / kBlock), nbs = static_cast<int>(N / kBlock), n = static_cast<int>(blocks);
  void* args[] = {&w, &n, &kbs, &nbs, &K, &N, &q, &s, &q2, &s2};
  return CudaStatus(cudaLaunchKernel(kernel, dim3(grid), dim3(kThreads), args, kSmem, stream),
                    "launch of QuantizeWeightKernel");
}

}  // namespace

Status QuantizeWeightFp8(cudaStream_t stream, DType dt, const void* w, int64_t E, int64_t K, int64_t N,
                         bool transposed, uint8_t* q, float* s, uint8_t* q2, float* s2) {
  DeviceInfo dev;
  Status st = Fp8DeviceCheck("quantize_weight_fp8", &dev);
  if (!st.ok()) return st;
  if (E < 0 || K < kBlock || K % kBlock != 0 || N < kBlock || N % kBlock != 0 ||
      E * (K / kBlock) > kMaxBlocks / (N / kBlock))
    return Status::Error(kInvalidArgument, "jax_moe_overlap: quantize_weight_fp8: K and N must be positive multiples "
                                           "of 128 and the blocks E * K / 128 * N / 128 below 2^31 - 2^24, got E=" +
                                               std::to_string(E) + ", K=" + std::to_string(K) + ", N=" +
                                               std::to_string(N));
  const int64_t blocks = E * (K / kBlock) * (N / kBlock);
  if (blocks == 0) return LaunchEmpty(stream);  // (a call inside a CUDA graph must launch something)
  if ((q2 == nullptr) != (s2 == nullptr))
    return Status::Error(kInvalidArgument, "jax_moe_overlap: quantize_weight_fp8: q2 and s2 go together");
  if (dt == DType::kF32)
    return Launch(stream, dev, static_cast<const float*>(w), blocks, K, N, transposed, q, s, q2, s2);
  return Launch(stream, dev, static_cast<const __nv_bfloat16*>(w), blocks, K, N, transposed, q, s, q2, s2);
}

}  // namespace jmo::cuda
