// The tensor-core tile engine (sm80+: mma.sync bf16): one output tile per CTA, as gemm/tile.cuh describes it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device/ptx.cuh"
#include "cuda/gemm/tile.cuh"

namespace jmo::cuda {

// Tensor-core path (sm80+: mma.sync m16n8k16 bf16, cp.async multi-stage pipeline, ldmatrix). 8 warps as 2 (M) x 4
// (N), each a (BM/2) x 32 warp tile. Needs lda, ldb % 8 == 0 and 16-byte aligned a, b: every 8-element chunk is one
// 16-byte cp.async, and a chunk that crosses a valid extent is zero-filled past it by cp.async's src-size. Which
// operands and devices it takes is gemm/engine.cc's mma.sync rule.

constexpr int kTcBK = 32;
constexpr int kTcStages = 4;
constexpr int kTcElemBytes = static_cast<int>(sizeof(__nv_bfloat16));

template <int BM>
struct TcLayout {
  // Shared rows padded by 16 bytes: the 8 rows an ldmatrix reads fall in 8 different 16-byte bank groups.
  static constexpr int kARows = BM > kTcBK ? BM : kTcBK;  // as stored: [BM][BK+8] or, transposed, [BK][BM+8]
  static constexpr int kAElems = (BM * (kTcBK + 8) > kTcBK * (BM + 8)) ? BM * (kTcBK + 8) : kTcBK * (BM + 8);
  static constexpr int kBElems = (kTileN * (kTcBK + 8) > kTcBK * (kTileN + 8)) ? kTileN * (kTcBK + 8)
                                                                               : kTcBK * (kTileN + 8);
  static constexpr int kSmemBytes = kTcStages * (kAElems + kBElems) * kTcElemBytes;
};

using ptx::CpAsync16;
using ptx::CpAsyncCommit;
using ptx::CpAsyncWait;
using ptx::LdMatrixX4;
using ptx::LdMatrixX4Trans;

__device__ __forceinline__ void MmaBf16(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Bytes of the 8-element chunk starting at `first` (of `valid` elements) that lie inside the valid extent.
__device__ __forceinline__ int ChunkBytes(int first, int valid) {
  const int left = valid - first;
  return left <= 0 ? 0 : (left >= 8 ? 16 : left * kTcElemBytes);
}

template <int BM, bool kTransA, bool kTransB, typename OutT>
__device__ void TcTile(const TileArgs<__nv_bfloat16, OutT>& t, char* smem) {
  using bf16 = __nv_bfloat16;
  using L = TcLayout<BM>;
  constexpr int AS = kTransA ? BM + 8 : kTcBK + 8;       // A row stride in shared memory
  constexpr int BS = kTransB ? kTcBK + 8 : kTileN + 8;   // B row stride
  constexpr int MI = BM / 32;                            // m16 fragments per warp
  bf16* sA = reinterpret_cast<bf16*>(smem);
  bf16* sB = sA + kTcStages * L::kAElems;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = (warp / 4) * (BM / 2), wn = (warp % 4) * 32;
  float acc[MI][4][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;
  const int ktiles = (t.k + kTcBK - 1) / kTcBK;
  auto load = [&](int buf, int kt) {
    const int k0 = kt * kTcBK;
    bf16* a_s = sA + buf * L::kAElems;
    bf16* b_s = sB + buf * L::kBElems;
#pragma unroll
    for (int i = 0; i < BM * kTcBK / 8 / kTileThreads; ++i) {
      const int idx = tid + i * kTileThreads;
      if constexpr (!kTransA) {  // [BM][BK]: 4 chunks per row
        const int r = idx / (kTcBK / 8), c = (idx % (kTcBK / 8)) * 8;
        const int bytes = r < t.m ? ChunkBytes(k0 + c, t.k) : 0;
        CpAsync16(a_s + r * AS + c, bytes ? t.a + (int64_t)r * t.lda + k0 + c : t.a, bytes);
      } else {  // [BK][BM]: BM/8 chunks per k row
        const int r = idx / (BM / 8), c = (idx % (BM / 8)) * 8;
        const int bytes = k0 + r < t.k ? ChunkBytes(c, t.m) : 0;
        CpAsync16(a_s + r * AS + c, bytes ? t.a + (int64_t)(k0 + r) * t.lda + c : t.a, bytes);
      }
    }
#pragma unroll
    for (int i = 0; i < kTileN * kTcBK / 8 / kTileThreads; ++i) {
      const int idx = tid + i * kTileThreads;
      if constexpr (!kTransB) {  // [BK][BN]: 16 chunks per k row
        const int r = idx / (kTileN / 8), c = (idx % (kTileN / 8)) * 8;
        const int bytes = k0 + r < t.k ? ChunkBytes(c, t.n) : 0;
        CpAsync16(b_s + r * BS + c, bytes ? t.b + (int64_t)(k0 + r) * t.ldb + c : t.b, bytes);
      } else {  // [BN][BK]: 4 chunks per n row
        const int r = idx / (kTcBK / 8), c = (idx % (kTcBK / 8)) * 8;
        const int bytes = r < t.n ? ChunkBytes(k0 + c, t.k) : 0;
        CpAsync16(b_s + r * BS + c, bytes ? t.b + (int64_t)r * t.ldb + k0 + c : t.b, bytes);
      }
    }
  };
#pragma unroll
  for (int s = 0; s < kTcStages - 1; ++s) {
    if (s < ktiles) load(s, s);
    CpAsyncCommit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    CpAsyncWait<kTcStages - 2>();
    __syncthreads();
    const int nk = kt + kTcStages - 1;
    if (nk < ktiles) load(nk % kTcStages, nk);
    CpAsyncCommit();
    const bf16* a = sA + (kt % kTcStages) * L::kAElems;
    const bf16* b = sB + (kt % kTcStages) * L::kBElems;
#pragma unroll
    for (int ks = 0; ks < kTcBK / 16; ++ks) {
      uint32_t af[MI][4], bfr[4][2];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        if constexpr (!kTransA)  // matrices (m 0-7 | 8-15) x (k 0-7 | 8-15), row-major in shared memory
          LdMatrixX4(af[mi], a + (wm + mi * 16 + (lane % 16)) * AS + ks * 16 + (lane / 16) * 8);
        else  // stored [k][m]: the transposing load yields the same fragments
          LdMatrixX4Trans(af[mi], a + (ks * 16 + (lane % 8) + (lane / 16) * 8) * AS + wm + mi * 16 +
                                      ((lane / 8) % 2) * 8);
      }
#pragma unroll
      for (int nj = 0; nj < 2; ++nj) {
        uint32_t r[4];
        if constexpr (!kTransB)
          LdMatrixX4Trans(r, b + (ks * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * BS + wn + nj * 16 + (lane / 16) * 8);
        else  // stored [n][k]: column-major B, exactly the mma's B fragment order without transposing
          LdMatrixX4(r, b + (wn + nj * 16 + (lane % 8) + (lane / 16) * 8) * BS + ks * 16 + ((lane / 8) % 2) * 8);
        bfr[2 * nj][0] = r[0];
        bfr[2 * nj][1] = r[1];
        bfr[2 * nj + 1][0] = r[2];
        bfr[2 * nj + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) MmaBf16(acc[mi][ni], af[mi], bfr[ni]);
    }
  }
  CpAsyncWait<0>();
  __syncthreads();  // shared memory is free for the next tile
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const int r = wm + mi * 16 + lane / 4, c = wn + ni * 8 + (lane % 4) * 2;
      StorePair(t.c, t.ldc, r, c, t.m, t.n, acc[mi][ni][0], acc[mi][ni][1]);
      StorePair(t.c, t.ldc, r + 8, c, t.m, t.n, acc[mi][ni][2], acc[mi][ni][3]);
    }
}

}  // namespace jmo::cuda
