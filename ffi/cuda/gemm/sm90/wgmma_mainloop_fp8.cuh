// Hopper (sm_90a) e4m3 operands with DeepSeek-V3's scales for WgmmaLoop (wgmma_mainloop.cuh): the FP8 operand format
// Fp8Operands<AScales, BScales>, with B scaled per 128 x 128 block (Fp8BlockScaledOperands: the row GEMMs, forward
// and dgrad; Fp8PackedRowsOperands: the same on packed rows) or per (row, 128-wide K chunk) like A
// (Fp8Operands<Fp8MnMajorScalesA, Fp8RowScalesB>: the weight-gradient outer GEMM, "1D1D").
//
//   acc[r, c] = sum over 128-wide K chunks kc of
//               (sum_{k in kc} A[a_row + r, k] * B[b_idx][n(c), k]) * sa[kc][a_row + r] * sb(n(c), kc)
//   sb(n, kc) = sb[b_idx][n / 128][kc]     (block scales)
//             = sb[kc][n]                  (row scales)
//
// A [rows, K] e4m3 (K-major), B [G, N, K] e4m3 (K-major: FP8 wgmma reads both operands K-major only), sa the float32
// scale of each (row, 128-wide K chunk) of A stored MN-major ([K/128, lds]: one chunk's scales of consecutive rows
// contiguous); sb either the float32 scale of each 128 x 128 block of B ([G, N/128, K/128]: the layout of
// Fp8Weight.scales) or, like sa, of each (row of B, chunk) MN-major ([K/128, ldb], G = 1).
// n(c) = n0 + c for the tile's accumulator columns c < 128 and n_hi + c - 128 for the others (WgmmaTile::n_hi).
//
// ---- Stage (one 128-wide K chunk: kBK = 128 e4m3 = 128 bytes, the same byte geometry as a bf16 stage) ----------
//   A slot  128 rows x 128 B (16 KB), TMA box (128, 128) of a 2D map (K, rows), 128B swizzle, OOB zero fill;
//   B slot  two boxes of 128 rows x 128 B (32 KB): rows n0.. and n_hi.. of B[b_idx], box (128, 128, 1) of a 3D map
//           (K, N, G), 128B swizzle, OOB zero fill (a tile's second half past N is zeros);
//   extra   sa's floats of the chunk for rows a_row & ~3 .. (a_row & ~3) + 131 (528 B, TMA box (132, 1) of a 2D map
//           (rows, K/128), rows past the map's end zero): a TMA box's first element in the innermost dimension must
//           be 16-byte aligned, and a group's first row (a_row) is any row, so the box starts at the 4-row boundary
//           below it and the consumers read row r of the tile at r + (a_row & 3). Then B's scales of the chunk:
//           block scales: 2 floats (the block of each half; by cp.async, whose completion the full barrier counts
//             as one more pending arrival, so that the barrier's arrival count stays 1);
//           row scales: 256 floats from the next 128-byte boundary (two TMA boxes (128, 1), rows n0.. and n_hi..).
//   The full barrier's transaction bytes: 16 KB + 32 KB + 528 B (+ 1 KB with row scales).
//   Packed rows (Fp8RowTailScalesA: A's rows as fp8.pack_rows lays them out, values then scales, read where
//   dispatch_gemm's rows land): A by the same box from a map whose row stride is the packed row's; sa from a second
//   map over the rows' scale tails, box (4 chunks, 128 rows) = 2 KB at the extra slot's start instead of 528 B, the
//   block scales after it.
//
// ---- Promotion (DeepSeek-V3 section 3.3.2; as DeepGEMM's sm90 FP8 GEMMs do it) ------------------------------------
// FP8 wgmma (m64nNk32 .e4m3.e4m3 .f32) keeps only about 14 bits of its sum, so a chunk's partial sums leave the
// tensor core every 128 of K: per stage and per 128-column half h of the tile, a consumer warpgroup issues 4 x
// wgmma m64n128k32 into 64 partial registers (the first with scale-d = 0), waits for them, and adds
// part * (sa[row] * sb) into the 128 float32 accumulators, the scale product rounded to float32 first (one per
// row and half with block scales, one per element with row scales; acc[64 h ..] is the half's m64n128 layout, so acc
// is the m64n256 layout the epilogues take). 64 + 128 accumulator registers, within the consumers' 232. The two
// consumer warpgroups issue their halves' MMAs in turns (IssueTurns, wgmma_mainloop.cuh): one warpgroup's half queues
// behind the other's, so each promotes while the tensor cores run the other's MMAs. A stage is released
// (empty barrier) once its operands and scales have all been read: with block scales after its second half's wait
// (both scales are in registers), with row scales after the second half's promotion (which reads them from smem).
// An a_stage hook (the loop's; dispatch_gemm stores x_recv's packed rows from the stage) runs once per stage before
// its first half's MMAs are issued (the other warpgroup's MMAs keep the tensor cores busy meanwhile), before that
// release.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/gemm/sm90/wgmma_mainloop.cuh"

namespace wgmma_gemm {

constexpr int kFp8BK = 128;        // e4m3 K elements per stage (128 bytes, one 128B swizzle row)
constexpr int kScaleChunk = 128;   // K elements per scale (A's 1 x 128 tiles, B's 128 x 128 blocks)
constexpr int kFp8SaRows = kBM + 4;  // the tile's 128 rows from the 4-row boundary below them
constexpr int kFp8SaBytes = kFp8SaRows * 4;  // sa of those rows (a multiple of 16: a TMA box row)
constexpr int kFp8TailChunks = 4;  // packed rows: the chunks of one row-tail box (16 bytes, TMA's smallest row)
constexpr int kFp8TailBytes = kBM * kFp8TailChunks * 4;  // packed rows: the tile's rows' scales of 4 chunks
// The extra slot of a stage: A's scales (kABytes of the A-scale format), then B's (BScales::kOffset on).
constexpr int Fp8Round128(int bytes) { return (bytes + 127) / 128 * 128; }
constexpr int kFp8ExtraBytes = Fp8Round128(kFp8SaBytes + 8);  // MN-major sa + sb (2 floats), 128-byte slots
static_assert(kFp8BK * 1 == kBK * kElemBytes, "an e4m3 stage has the bf16 stage's byte geometry");
static_assert(kFp8SaBytes % 16 == 0, "sa is whole 16-byte TMA box rows (and sb after it 8-byte aligned)");
static_assert(kFp8TailBytes % 128 == 0, "the row-tail scales keep the extra slot's 128-byte alignment");
static_assert(kFp8BK == kScaleChunk, "one stage is one scale chunk: the promotion happens once per stage");
static_assert(kScaleChunk == 1 << 7, "LoadStage divides column indices by 128 with a shift");

// D[64 x 128] (+)= A[64 x 32] * B[32 x 128], e4m3 from smem, both K-major (the only FP8 layout), f32 accumulate.
// scale_d = 0 ignores (zeroes) the old accumulator.
__device__ __forceinline__ void Wgmma64x128E4m3(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
#if WGMMA_SM90A
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1;\n}\n"
      : JMO_WGMMA_ACC64(d, 0)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
#else
  __trap();
#endif
}

// B's scales of the row GEMMs: one per 128 x 128 block of B[g] ([G, N/128, K/128]), two per stage (the block of each
// column half), by cp.async after sa in the stage's extra slot. Both are in registers before the stage's halves, so
// the stage is released as soon as its second half's MMAs are done.
template <int kAfter>
struct Fp8BlockScalesAfter {
  const float* sb;  // sb [G, N/128, K/128] float32
  int n_blocks;     // N / 128
  int k_chunks;     // K / 128
  static constexpr int kOffset = kAfter;  // in the stage's extra slot, after A's scales
  static constexpr int kExtraBytes = Fp8Round128(kAfter + 8);
  static constexpr int kTxBytes = 0;  // not TMA: cp.async, counted as a pending arrival
  static constexpr bool kReleaseBeforePromote = true;
  using StageScales = float2;  // the two halves' block scales

  __device__ __forceinline__ void Prefetch() const {}

  // Before the stage's expect_tx arrival: their pending arrival must be on the phase before that arrival can complete
  // it. A second half past N (N % 256 == 128) multiplies zeros; its scale is read from the last block.
  // (32-bit indices: the host refuses G * N/128 * K/128 >= 2^31; the producer has few registers.)
  __device__ __forceinline__ void LoadBeforeArrive(uint32_t fb, uint32_t x, const TileCoords& t, int kt) const {
    const int blocks_g = t.b_idx * n_blocks;
    CpAsync4(x + kOffset, sb + ((blocks_g + (t.n0 >> 7)) * k_chunks + kt));
    CpAsync4(x + kOffset + 4, sb + ((blocks_g + min(t.n_hi >> 7, n_blocks - 1)) * k_chunks + kt));
    CpAsyncMbarArrive(fb);
  }
  __device__ __forceinline__ void LoadAfterArrive(uint32_t, uint32_t, const TileCoords&, int) const {}

  __device__ __forceinline__ StageScales Read(uint32_t x) const { return LdSharedF32x2(x + kOffset); }

  // acc (the half's 64 accumulators) += part * (sa * the half's block scale), rows `row` (sa_lo) and `row + 8`.
  __device__ __forceinline__ void Promote(float* acc, const float* part, float sa_lo, float sa_hi, StageScales st,
                                          uint32_t, int h, int) const {
    const float sb = h ? st.y : st.x;
    const float s_lo = sa_lo * sb, s_hi = sa_hi * sb;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      acc[4 * j + 0] = fmaf(part[4 * j + 0], s_lo, acc[4 * j + 0]);
      acc[4 * j + 1] = fmaf(part[4 * j + 1], s_lo, acc[4 * j + 1]);
      acc[4 * j + 2] = fmaf(part[4 * j + 2], s_hi, acc[4 * j + 2]);
      acc[4 * j + 3] = fmaf(part[4 * j + 3], s_hi, acc[4 * j + 3]);
    }
  }
};

using Fp8BlockScalesB = Fp8BlockScalesAfter<kFp8SaBytes>;  // after A's MN-major scales

// B's scales of the weight-gradient (outer) GEMM, "1D1D": one per (row n of B, 128-wide K chunk), stored MN-major
// ([K/128, ld]: one chunk's scales of consecutive rows contiguous), like sa. Per stage the tile's 256 (rows n0.. and
// n_hi.. of B: two TMA boxes (128, 1) of a 2D map (N, K/128), n0 and n_hi multiples of 4) at a 128-byte aligned offset
// of the extra slot. The promotion reads each column's scale from shared memory, so the stage is released after it.
struct Fp8RowScalesB {
  const CUtensorMap* sb_map;  // sb [K/128, ld] float32: 2D (N, K/128), box (128, 1), no swizzle
  static constexpr int kHalfBytes = (kBN / 2) * 4;
  static constexpr int kOffset = (kFp8SaBytes + 127) / 128 * 128;  // TMA destinations: 128-byte aligned
  static constexpr int kExtraBytes = kOffset + 2 * kHalfBytes;
  static constexpr int kTxBytes = 2 * kHalfBytes;
  static constexpr bool kReleaseBeforePromote = false;
  struct StageScales {};
  static_assert(kExtraBytes % 128 == 0, "the extra slots keep 128-byte alignment");

  __device__ __forceinline__ void Prefetch() const { PrefetchTensorMap(sb_map); }
  __device__ __forceinline__ void LoadBeforeArrive(uint32_t, uint32_t, const TileCoords&, int) const {}
  // (A half past N is a box wholly out of bounds: zeros, still counted.)
  __device__ __forceinline__ void LoadAfterArrive(uint32_t fb, uint32_t x, const TileCoords& t, int kt) const {
    TmaLoad2D(x + kOffset, sb_map, fb, t.n0, kt);
    TmaLoad2D(x + kOffset + kHalfBytes, sb_map, fb, t.n_hi, kt);
  }
  __device__ __forceinline__ StageScales Read(uint32_t) const { return {}; }

  // acc (the half's 64 accumulators) += part * (sa[row] * sb[column]) per element: the thread's columns of block j
  // of the m64n128 layout are 8 j + 2 (lane % 4) and the next one, one 8-byte load of the half's scales.
  __device__ __forceinline__ void Promote(float* acc, const float* part, float sa_lo, float sa_hi, StageScales,
                                          uint32_t x, int h, int lane) const {
    const uint32_t sb = x + kOffset + h * kHalfBytes + 8 * (lane % 4);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float2 b = LdSharedF32x2(sb + 32 * j);
      acc[4 * j + 0] = fmaf(part[4 * j + 0], sa_lo * b.x, acc[4 * j + 0]);
      acc[4 * j + 1] = fmaf(part[4 * j + 1], sa_lo * b.y, acc[4 * j + 1]);
      acc[4 * j + 2] = fmaf(part[4 * j + 2], sa_hi * b.x, acc[4 * j + 2]);
      acc[4 * j + 3] = fmaf(part[4 * j + 3], sa_hi * b.y, acc[4 * j + 3]);
    }
  }
};

// A's scales, one per (row, 128-wide K chunk), in the layout of the FP8 GEMMs' lhs_scales: MN-major [K/128, lds],
// per stage the chunk's 132 floats from the 4-row boundary below the tile's first row (kFp8SaRows: the header), TMA at
// the start of the stage's extra slot.
struct Fp8MnMajorScalesA {
  const CUtensorMap* sa_map;  // sa [K/128, lds] float32: 2D (rows, K/128), box (kFp8SaRows, 1), no swizzle
  static constexpr int kBytes = kFp8SaBytes;
  __device__ __forceinline__ void Prefetch() const { PrefetchTensorMap(sa_map); }
  __device__ __forceinline__ void Load(uint32_t fb, uint32_t x, const TileCoords& t, int kt) const {
    TmaLoad2D(x, sa_map, fb, t.a_row & ~3, kt);  // (the 16-byte aligned box start: header)
  }
  // Row r of the tile's scale in the stage at x (kt: the stage within the tile).
  __device__ __forceinline__ float Read(uint32_t x, const TileCoords& t, int r, int) const {
    return LdSharedF32(x + (r + (t.a_row & 3)) * 4);
  }
};

// A's scales where packed e4m3 rows carry them (fp8.pack_rows: a row's K values, then its K/128 float32 scales; the
// rows as dispatch_gemm's GEMM reads them where they land): a 2D map over the rows' tails (base: the first row's
// scales, inner extent K/128 floats, the rows' stride), per stage box (4 chunks, 128 rows) from chunk kt & ~3 and row
// a_row (the rows are the outer dimension: no alignment of a_row needed), 2 KiB at the start of the extra slot; row r
// of the tile's chunk kt at (4 r + kt % 4) floats. A stage loads the 4-chunk box holding its chunk (K/128 a multiple
// of 4: whole boxes, as the kernel's D % 512 rule gives).
struct Fp8RowTailScalesA {
  const CUtensorMap* sa_map;  // the rows' scale tails: 2D (K/128, rows) float32, box (4, 128), no swizzle
  static constexpr int kBytes = kFp8TailBytes;
  __device__ __forceinline__ void Prefetch() const { PrefetchTensorMap(sa_map); }
  __device__ __forceinline__ void Load(uint32_t fb, uint32_t x, const TileCoords& t, int kt) const {
    TmaLoad2D(x, sa_map, fb, kt & ~(kFp8TailChunks - 1), t.a_row);
  }
  __device__ __forceinline__ float Read(uint32_t x, const TileCoords& t, int r, int kt) const {
    return LdSharedF32(x + (r * kFp8TailChunks + ((t.k_first + kt) & (kFp8TailChunks - 1))) * 4);
  }
  // For an a_stage hook: stores consumer warpgroup c's rows of the stage's scale box (extra slot x: the 4 chunks'
  // scales of each of the tile's rows, 16 bytes a row) to global memory, row r (64 c <= r < 64 c + 64, r < rows) to
  // dst + r * ld_bytes (16-byte aligned): the rows' tails as they were packed. t: the thread's index in the
  // warpgroup; threads 0..63 store a row each.
  __device__ __forceinline__ static void StoreStageRows(const unsigned char* x, int c, int t, int rows, char* dst,
                                                        int64_t ld_bytes) {
    const int r = c * 64 + t;
    if (t < 64 && r < rows)
      *reinterpret_cast<uint4*>(dst + r * ld_bytes) = LdSharedV4(SmemAddr(x) + r * kFp8TailChunks * 4);
  }
};

// The e4m3 operand format of WgmmaLoop (the header comment; the members' contract is Bf16Operands'), over A's scale
// format AScales (Fp8MnMajorScalesA: the FP8 GEMMs' operands; Fp8RowTailScalesA: packed rows) and B's BScales
// (Fp8BlockScalesAfter: the row GEMMs; Fp8RowScalesB: the outer GEMM), B's after A's in the stage's extra slot.
template <class AScales, class BScales>
struct Fp8Operands {
  const CUtensorMap* a_map;   // A [rows, K] e4m3: 2D (K, rows), box (128, 128), 128B swizzle (rows at any stride)
  const CUtensorMap* b_map;   // B [G, N, K] e4m3: 3D (K, N, G), box (128, 128, 1), 128B swizzle
  AScales a_scales;
  BScales b_scales;
  static_assert(BScales::kOffset >= AScales::kBytes, "B's scales lie after A's in the extra slot");
  static constexpr int kBK = kFp8BK;
  static constexpr int kExtraBytes = BScales::kExtraBytes;
  // The bf16 split (DeepGEMM's): the producer computes the scale addresses besides the TMA coordinates, a consumer
  // holds 192 accumulators (part and acc).
  static constexpr int kProducerRegs = wgmma_gemm::kProducerRegs;
  static constexpr int kConsumerRegs = wgmma_gemm::kConsumerRegs;
  // Each half of a stage is one batch of MMAs waited for and then promoted: the warpgroups take turns (IssueTurns).
  static constexpr int kIssueTurnsPerStage = 2;

  __device__ __forceinline__ void Prefetch() const {
    PrefetchTensorMap(a_map);
    PrefetchTensorMap(b_map);
    a_scales.Prefetch();
    b_scales.Prefetch();
  }

  __device__ __forceinline__ void LoadStage(uint32_t fb, uint32_t a_dst, uint32_t b_dst, unsigned char* x,
                                            const TileCoords& t, int kt) const {
    const uint32_t x_addr = SmemAddr(x);
    b_scales.LoadBeforeArrive(fb, x_addr, t, kt);
    // OOB parts of a box are zero-filled and still counted.
    MbarArriveExpectTx(fb, kABytes + kBBytes + AScales::kBytes + BScales::kTxBytes);
    TmaLoad2D(a_dst, a_map, fb, kt * kBK, t.a_row);
    a_scales.Load(fb, x_addr, t, kt);
    b_scales.LoadAfterArrive(fb, x_addr, t, kt);
    TmaLoad3D(b_dst, b_map, fb, kt * kBK, t.n0, t.b_idx);
    TmaLoad3D(b_dst + kBBytes / 2, b_map, fb, kt * kBK, t.n_hi, t.b_idx);
  }

  template <class Ring, class AStage = NoAStage>
  __device__ __forceinline__ void Multiply(float* acc, Ring& ring, const TileCoords& t, int c, int wq, int lane,
                                           int ktiles, const AStage& a_stage = {}) const {
    float part[64];
    const int row = c * 64 + wq * 16 + lane / 4;  // the thread's rows of the tile: row and row + 8
#pragma unroll
    for (int j = 0; j < 128; ++j) acc[j] = 0.f;
    for (int kt = 0; kt < ktiles; ++kt) {
      if (kt > 0) ring.WaitFull();
      const int s = ring.stage;
      if constexpr (!std::is_same<AStage, NoAStage>::value) {
        // Before the stage's MMAs are issued, while the other warpgroup's run (the format's register pressure is
        // lowest here: ptxas spills least with the hook at this point).
        a_stage(ring.A(s), ring.X(s), kt);
        __syncwarp();  // every lane's reads of the stage before one lane releases it (below)
      }
      const uint32_t x = SmemAddr(ring.X(s));
      const float sa_lo = a_scales.Read(x, t, row, kt), sa_hi = a_scales.Read(x, t, row + 8, kt);
      const typename BScales::StageScales sb = b_scales.Read(x);
      const uint32_t a_base = SmemAddr(ring.A(s)) + c * (64 * 128);  // this WG's 64 rows
      const uint32_t b_base = SmemAddr(ring.B(s));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        FenceRegs<64>(part);
        IssueTurns::Take(c);
        WgmmaFence();
#pragma unroll
        for (int kk = 0; kk < kBK / 32; ++kk) {
          // K-major, 128B swizzle: +32 bytes (32 e4m3) per k32 inside the swizzled row, SBO = 1024 (8 rows).
          const uint64_t da = MakeDesc(a_base + kk * 32, 16, 1024);
          const uint64_t db = MakeDesc(b_base + h * (kBBytes / 2) + kk * 32, 16, 1024);
          Wgmma64x128E4m3(part, da, db, kk > 0);
        }
        WgmmaCommit();
        IssueTurns::Pass(c);
        WgmmaWait<0>();
        FenceRegs<64>(part);
        if (BScales::kReleaseBeforePromote && h == 1 && lane == 0) MbarArrive(SmemAddr(ring.Empty(s)));
        // m64n128 f32 layout: part[4j + 0/1] is row `row`, part[4j + 2/3] row `row + 8`.
        b_scales.Promote(acc + 64 * h, part, sa_lo, sa_hi, sb, x, h, lane);
      }
      if (!BScales::kReleaseBeforePromote) {
        __syncwarp();  // every lane's reads of the stage's scales before the warp's release
        if (lane == 0) MbarArrive(SmemAddr(ring.Empty(s)));
      }
      ring.Advance();
    }
  }
};

// The row GEMMs' format (wgmma_grouped_fp8.cuh).
using Fp8BlockScaledOperands = Fp8Operands<Fp8MnMajorScalesA, Fp8BlockScalesB>;
// The row GEMM on packed e4m3 rows (dispatch_gemm's FP8 kernel): A's values and scales where the rows landed.
using Fp8PackedRowsOperands = Fp8Operands<Fp8RowTailScalesA, Fp8BlockScalesAfter<kFp8TailBytes>>;

}  // namespace wgmma_gemm
