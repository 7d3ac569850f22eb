// Hopper (sm_90a) warp-specialized persistent wgmma + TMA mainloop as a reusable device function.
//
//   WgmmaTileLoop<kTransB, kOutF32>(a_map, b_map, K, first, stride, count, tile_of, tile_done, smem[, tile_wait])
//   WgmmaTileLoopNext<kTransB, kOutF32>(a_map, b_map, K, count, next_tile, tile_of, tile_done, smem[, tile_wait[,
//                                       a_stage]])
//   WgmmaLoop<Ops, kOutF32>(ops, K, count, next_tile, tile_of, tile_done, smem[, tile_wait[, a_stage]])
//
// The first two are the bf16 loop described below; WgmmaLoop is the same loop over an operand format Ops (what a
// stage holds, how the producer fills it, how a consumer multiplies over it: Bf16Operands here, the e4m3
// block-scaled Fp8BlockScaledOperands in wgmma_mainloop_fp8.cuh), with everything else of this comment unchanged.
//
// computes, for i = first, first + stride, ... < count (or for the indices next_tile hands out, below), the output
// tile t = tile_of(i):
//   out_t[r, c] = sum_k A[t.a_row + r, k] * B[t.b_idx][k, t.n0 + c]     r < t.rows, c < t.cols
// (fp32 accumulate, stored as bf16 or f32 to t.out[r * t.ldc + c]) and, when DoneFn is not NoTileDone, calls
// tile_done(t) once per tile after all of the tile's stores (contract below). The bare grouped GEMM
// (wgmma_grouped.cuh, GroupedGemmKernel), the expert_combine producer (expert_producer.cuh) and dispatch_gemm use it.
//
// ---- Caller requirements -------------------------------------------------------------------------------------
//   * Block of exactly kThreads = 384 threads (3 warpgroups), kernel declared __launch_bounds__(kThreads, 1), so
//     ptxas gives it kEntryRegs = 168 registers at entry (WG0 releases to 40, WG1/WG2 grow to 232 -- the operand
//     format's kProducerRegs / kConsumerRegs -- and all return to 168 before the function returns).
//     PrepareWgmmaKernel (wgmma_grouped.cuh) checks this on the host.
//   * All 384 threads call the function, uniformly (it contains __syncthreads() at entry and at exit); after it
//     returns the smem region may be reused and the function may be called again.
//   * smem: >= LoopSmemBytes<kNumStages, Ops::kExtraBytes>() bytes of dynamic shared memory (any alignment: the
//     function aligns up to 1024 inside, that is what the 1 KB slack is for). bf16, kNumStages = 4 (default):
//     197,712 bytes; 3: 148,492. e4m3 (4 stages): 200,296 bytes (MN-major A scales), 206,440 (packed rows).
//   * Named barriers 1 (256 consumer threads) and 2 (128 producer threads) are used; the caller must not have any
//     of its own in flight across the call.
//   * a_map: 2D bf16 tensor map of A ([rows, K] row-major), box (kBK = 64, kBM = 128), 128B swizzle, OOB zero fill.
//     b_map: 3D bf16 tensor map of B, 128B swizzle, OOB zero fill:
//       kTransB = 1 (B [G, K, N], N contiguous, "MN-major"): dims (N, K, G), box (64, 64, 1);
//       kTransB = 0 (B [G, N, K], K contiguous):               dims (K, N, G), box (64, 256, 1).
//     EncodeGemmMaps / CachedGemmMaps (wgmma_grouped.cuh) build exactly these. The maps must live in kernel-parameter
//     space (__grid_constant__ CUtensorMap kernel arguments, passed here by reference), or in global/const memory.
//   * K % 64 == 0, K > 0.
//
// ---- tile_of(i) -> Tile --------------------------------------------------------------------------------------
//   Tile is WgmmaTile or a struct derived from it (extra fields travel to tile_done untouched). Fields:
//     a_row : first row of the tile in A (TMA row coordinate). Rows a_row .. a_row + 127 are loaded; rows past
//             `rows` (the next segment, or past the end of A: zero filled) are multiplied but never stored.
//     b_idx : B matrix index (3rd coordinate of b_map: group / expert).
//     n0    : first column (B coordinate). Columns n0 .. n0 + 255 are loaded (OOB zero filled).
//     rows  : rows to store, 0..128. rows <= 64: the second consumer warpgroup skips its MMAs (it still follows
//             the barrier protocol); rows == 0 stores nothing (tile_done is still called).
//     cols  : columns to store, counted from n0: a multiple of 16 in 16..256.
//     out   : address of the tile's element (0, 0) in the row-major destination (bf16 or float per kOutF32);
//             8-byte (bf16) / 16-byte (f32) aligned.
//     ldc   : destination row stride in elements, a multiple of 4.
//     n_hi  : (kTransB = 1 and the e4m3 format only) B's first column for the tile's accumulator columns 128..255;
//             -1 = n0 + 128.
//   A SwiGluTile (derived from WgmmaTile) selects the SwiGLU epilogue (StoreSwiGluTile): out gets `cols` bf16
//   columns of silu(acc[:, :128]) * acc[:, 128:], and its `a`, when set, the float32 accumulators
//   (GroupedSwiGluKernel).
//   A tile derived from EpilogueTile stores through its own Store (the FP8 GEMM1's SwiGLU and quantization epilogue,
//   SwiGluFp8TileOf in swiglu_fp8_epilogue.cuh).
//   A KRangeTile reduces over its own k-steps k_first .. k_first + k_steps - 1 instead of all of K (the grouped
//   outer GEMM's tiles, whose reduction runs over their group's rows).
//   A SwiGluGradTile<AElem> selects the SwiGLU-gradient epilogue (StoreSwiGluGradTile): the accumulators are dh, and
//   out gets da = (d_gate, d_up) in bf16 from dh and the preactivation at `a` (float32 or bf16 elements), whose rows
//   the consumers prefetch to L2 before the tile's mainloop (PrefetchSwiGluGradRows; GroupedSwiGluGradKernel).
//   tile_of must be a pure function of i (every caller thread gets the same answer). It is called once per tile by
//   thread 0 (the TMA thread; only a_row, b_idx, n0, n_hi are used there, and that warp runs with kProducerRegs registers, so keep
//   it cheap: a binary search in smem is fine), with a tile_wait also by the 32 threads of warp 1 (the look-ahead,
//   same registers), and by each of the 256 consumer threads (128..383) before the tile's mainloop. Data it reads
//   (smem tables, ...) must be ready before the call (the entry __syncthreads() orders it for smem written by the CTA
//   before the call).
//
// ---- next_tile(prev) (WgmmaTileLoopNext) ------------------------------------------------------------------------
//   Called by one thread: the CTA's first tile index with prev = -1, then the next one after prev; an index
//   >= count ends the CTA's loop. The thread is thread 0 (the TMA thread), or with a tile_wait thread 32 (lane 0 of
//   the look-ahead warp, below). A static schedule (WgmmaTileLoop: first, first + stride, ...) or a dynamic one
//   (an atomicAdd on a per-call counter: CTAs that join late take what is left, dispatch_gemm's pushers). Thread 0
//   passes each index to the consumer warpgroups through shared memory, next to the tile's first stage.
//
// ---- tile_wait(tile) (optional) ---------------------------------------------------------------------------------
//   Called with tile_of(i)'s value before the first TMA load of the tile: it may block until the tile's operands
//   exist (dispatch_gemm: until the segment's source rank has pushed its rows). It runs on the 32 lanes of the
//   producer warpgroup's second warp together (kProducerRegs registers, the same tile on every lane), the look-ahead: lane 0
//   claims the tiles (next_tile), the warp waits for each while the TMA thread still loads the previous tile's
//   stages, and lane 0 hands the index over through shared memory (an mbarrier pair and one slot) once the previous
//   tile's last kAheadLoads loads remain; so neither the claim nor the checks of a tile whose operands are there
//   stall the loads, and a tile's several checks can run on several lanes at once (one memory round trip, not one
//   per check). Whatever it waits for was written through the generic proxy, and TMA reads through the async proxy:
//   every lane must end with fence.proxy.async.global after its acquires (FenceProxyAsyncGlobal, device/ptx.cuh; the
//   TMA thread fences again after the hand-over), and the lanes must have passed a __syncwarp (which orders their
//   memory accesses; a vote alone is not documented to) before it returns. It must return (a bounded wait) even on
//   failure. A tile_wait with a member Stalled(uint64_t ns, bool first) (HasStalled) also gets, once per tile, the
//   nanoseconds the TMA thread waited for the hand-over (first: the CTA's first tile, whose wait no earlier tile's
//   loads can cover).
//
// ---- a_stage(tile, c, a, x, kt) (optional) ----------------------------------------------------------------------
//   Called by every thread of consumer warpgroup c that multiplies the tile (64 c < tile.rows), once per k-step kt
//   (counted within all of K), with the stage's A slot `a` (kBM rows of 128 bytes, K-major, 128B swizzle:
//   StoreAStageRows reads it) and its extra slot `x` (the operand format's stage data: e4m3 A's scales), after the
//   stage's full barrier was waited for, before the warp's arrive on the stage's empty barrier (the format syncs the
//   warp between the two, so every lane's reads of the stage precede the release): bf16 after the k-step's MMAs were
//   issued (while they run), e4m3 before (while the other warpgroup's run: the FP8 format holds the partial sums
//   beside the accumulators). It may read the warpgroup's rows [64 c, 64 c + 64) of `a` and of `x` and store to
//   global memory (dispatch_gemm: x_recv from the A tiles); no CTA or named barrier. The consumer warpgroup that
//   multiplies a stage reads it rather than a warp of its own: its loads and stores issue while MMAs run (the
//   warpgroup otherwise waits on them), the empty barrier's arrival count stays the consumer warps', and the producer
//   warps keep their kProducerRegs registers. With AStageFn = NoAStage the call and the warp sync are compiled out.
//
// ---- tile_done(tile) --------------------------------------------------------------------------------------------
//   Called for every tile of this CTA with publish != 0, in the CTA's tile order, by exactly one thread: threadIdx.x == 128 (lane 0
//   of warp 4, the first consumer warp), with the Tile value that tile_of returned. At that point:
//     every consumer thread (128..383) has issued all its global stores of this tile, then executed
//     __threadfence() (fence.sc.gpu), then named barrier 1 (bar.sync 1, 256) was passed by all 256 consumers.
//   So the tile's stores are ordered before anything thread 128 does next at gpu scope: it can count the tile
//   (e.g. atomicAdd on a per-band counter) and the thread that completes a band can __threadfence() and
//   release-store the band's flag -- the same pattern as ExpertKernel's producer (__threadfence, __syncthreads,
//   thread 0 atomicAdd). tile_done runs in a consumer warp (kConsumerRegs registers) while the other consumer threads
//   already start the next tile; it must not use __syncthreads / named barriers, and it delays the next tile of
//   warp 4 by its own duration (a few atomics are fine).
//   With DoneFn = NoTileDone the fence, the barrier and the call are compiled out (the bare GEMM's fast path).
//
// ---- Schedule / pipeline (see README.md) ------------------------------------------------------------------------
//   CTA tile 128 x 256, BK = 64, kNumStages smem stages of (A 16 KB + B 32 KB), mbarrier full/empty pairs.
//   WG0 = producer (thread 0 issues TMA), WG1/WG2 = consumers, rows [64 c, 64 c + 64) of the tile each,
//   wgmma m64n256k16, one commit group in flight. Epilogue straight from registers (no smem), so it does not
//   overlap the next tile's MMAs of the same warpgroup (the producer does prefetch the next tile's stages).
//
// Compiles for any target: the sm_90a instructions are only emitted under WGMMA_SM90A (sm_90a device pass); other
// device passes (sm_80, compute_80 PTX) get __trap() bodies, and the host side refuses to launch there.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>  // std::declval

#include "cuda/device/activation.cuh"
#include "cuda/device/ptx.cuh"

namespace wgmma_gemm {

using namespace jmo::ptx;  // mbarriers, TMA, register reallocation, named barriers

constexpr int kBM = 128;
constexpr int kBN = 256;
constexpr int kBK = 64;  // 64 bf16 = 128 bytes = one 128B swizzle row
constexpr int kStages = 4;
constexpr int kThreads = 384;
constexpr int kEntryRegs = 168;      // 65536 / 384 rounded down to a multiple of 8: what __launch_bounds__(384,1) gives
// 40 * 128 + 232 * 256 = 64512 = 168 * 384. The producer warpgroup's threads (TMA issue, the look-ahead's claims and
// checks) keep their loop state in registers at 40 (at 24 the TMA loop reloads it from local memory every stage); a
// consumer's 128 accumulators and its loop fit in 232.
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
constexpr int kConsumerBarrier = 1;  // named barrier of the 256 consumer threads
constexpr int kProducerBarrier = 2;  // named barrier of the 128 producer threads
constexpr int kIssueBarrier = 3;     // named barriers 3 and 4: the consumer warpgroups' turns (IssueTurns)
constexpr int kElemBytes = static_cast<int>(sizeof(__nv_bfloat16));  // the engine's operands (its TMA maps') are bf16
constexpr int kABytes = kBM * kBK * kElemBytes;  // 16384
constexpr int kBBytes = kBN * kBK * kElemBytes;  // 32768
constexpr int kStageBytes = kABytes + kBBytes;
static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= kEntryRegs * kThreads, "register budget");

// One output tile of the loop (see the header comment). Derive from it to carry caller data to tile_done.
struct WgmmaTile {
  int a_row;
  int b_idx;
  int n0;
  int rows;
  int cols;
  void* out;
  int64_t ldc;
  // With a tile_done: whether this tile is reported (fence + consumer barrier + tile_done). A tile nobody waits for
  // (expert_combine's tiles of the rank's own rows) skips all three. Must be the same in every consumer thread.
  int publish = 1;
  // B's columns of the tile's second 128 accumulator columns: n_hi .. n_hi + 127 (-1: n0 + 128, contiguous). MN-major
  // B (kTransB = 1) only: the SwiGLU tiles load the gate columns n0.. and the up columns F + n0.. side by side.
  int n_hi = -1;
};

// A tile whose epilogue is SwiGLU (the fused GEMM1 of the expert MLP, GroupedSwiGluKernel): the loop stores
// h = silu(acc[:, :128]) * acc[:, 128:] (bf16, `cols` columns to out) and, when `a` is set, the accumulators
// themselves (the preactivation the backward pass needs: columns n0.. to a + n0, n_hi.. to a + n_hi), in float32 or
// rounded once to bf16 (a_bf16).
struct SwiGluTile : WgmmaTile {
  void* a = nullptr;  // row 0 of the tile in the preactivation [rows, 2F] (column 0), or nullptr
  int64_t lda = 0;
  bool a_bf16 = false;  // a's elements are bf16 (else float32)
};

// A tile whose epilogue is the SwiGLU's gradient (the backward GEMM dh = d_out @ W2^T of the expert MLP,
// GroupedSwiGluGradKernel): the accumulators are dh's columns n0 .. n0 + cols - 1 (of F), and the loop stores, for
// each, da's d_gate and d_up in bf16 (StoreSwiGluGradTile), computed from dh and the preactivation's gate and up
// values (AElem: float, or __nv_bfloat16 for the layer's preactivation kept in bf16; taken to float32 either way);
// dh is never stored. out: da's element (tile row 0, column n0) in [rows, 2F] bf16; a: the preactivation's element
// (tile row 0, column n0) in [rows, 2F]; both have the row stride ldc (2F); the up columns lie `up` (F) columns right
// of the gate's, in both. SwiGluGradTileBase names the family for the loop's dispatch.
struct SwiGluGradTileBase : WgmmaTile {
  int64_t up = 0;
};
template <class AElem>
struct SwiGluGradTile : SwiGluGradTileBase {
  static_assert(std::is_same<AElem, float>::value || std::is_same<AElem, __nv_bfloat16>::value,
                "the preactivation is float32 or bf16");
  using Preact = AElem;
  const AElem* a = nullptr;
};

// A tile that brings its own epilogue: a struct derived from EpilogueTile with a const member
//   Store(const float* acc, int c, int wq, int lane)
// which the loop calls instead of StoreAccTile, by every thread of consumer warpgroup c (wq: its warp in the
// warpgroup, lane: its lane) with the warpgroup's 64 x 256 block of the tile in the m64n256 f32 layout (StoreAccTile's
// comment maps the registers; columns 0..127 are B's columns n0.., 128..255 its columns n_hi..). Every thread of the
// warpgroup calls it, so it may shuffle within a warp; no CTA or named barrier. It stores rows < rows only. It may use
// shared memory of the kernel's outside the loop's (LoopSmemBytes) as its own, per warp. (The FP8 GEMM1 with its
// SwiGLU and quantization epilogue: SwiGluFp8TileOf, swiglu_fp8_epilogue.cuh, which stages its stores so.)
struct EpilogueTile : WgmmaTile {};

// A tile that reduces over a range of K of its own instead of all of it: the k-steps (of Ops::kBK elements each)
// k_first .. k_first + k_steps - 1, k_steps >= 1 (the grouped outer GEMM of wgmma_outer_fp8.cuh: each group's rows).
// The loop's K argument is then unused; a tile that would reduce over nothing must not be scheduled (its output is
// the caller's to write: zeros).
struct KRangeTile : WgmmaTile {
  int k_first = 0;
  int k_steps = 1;
};

// The k-steps of a tile: its own range for a KRangeTile, else all of K (`all` = K / Ops::kBK).
template <class Tile>
__device__ __forceinline__ int TileKFirst(const Tile& t) {
  if constexpr (std::is_base_of<KRangeTile, Tile>::value) return t.k_first;
  else return 0;
}
template <class Tile>
__device__ __forceinline__ int TileKSteps(const Tile& t, int all) {
  if constexpr (std::is_base_of<KRangeTile, Tile>::value) return t.k_steps;
  else return all;
}

// tile_done that does nothing; selecting it removes the per-tile fence + consumer barrier.
struct NoTileDone {
  template <class T>
  __device__ __forceinline__ void operator()(const T&) const {}
};

// tile_wait that does nothing (every operand is ready before the loop starts).
struct NoTileWait {
  template <class T>
  __device__ __forceinline__ void operator()(const T&) const {}
};

// The look-ahead (WgmmaLoop with a tile_wait) claims tile i + 1 once tile i's last kAheadLoads loads remain, ~9 us of
// MMAs at 128 x 256 x 64 per load: early enough that its claim (an atomic) and checks (acquire loads), each a round
// trip to L2 that takes microseconds while the GEMM streams its operands, end before the consumers run dry; late
// enough that a claimed tile is not held for long (the dynamic schedule's balance at the end; at K = 2048 half a
// tile).
constexpr int kAheadLoads = 16;

// Whether a tile_wait takes the TMA thread's stall for each tile (a member Stalled(uint64_t ns, bool first)): the
// time from its wait for the look-ahead's hand-over until it holds the tile's index (%globaltimer), which is what the
// loads waited for the claim and the operands; the look-ahead's own wait overstates that by what the previous tile's
// loads covered.
template <class W, class = void>
struct HasStalled : std::false_type {};
template <class W>
struct HasStalled<W, decltype(std::declval<const W&>().Stalled(uint64_t{}, bool{}), void())> : std::true_type {};

// a_stage that does nothing (no reader of the A stages beside the MMAs); selecting it removes the call and its warp
// sync.
struct NoAStage {
  template <class... T>
  __device__ __forceinline__ void operator()(const T&...) const {}
};

// ------------------------------------------------------------------------------------------------------------
// PTX wrappers (sm_90a only; __trap() elsewhere)
// ------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ void WgmmaFence() {
#if WGMMA_SM90A
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void WgmmaCommit() {
#if WGMMA_SM90A
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#else
  __trap();
#endif
}
template <int N>
__device__ __forceinline__ void WgmmaWait() {
#if WGMMA_SM90A
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#else
  __trap();
#endif
}
// The accumulators are "+f" operands of the wgmma asm, but the compiler must also not move them across the
// wait: this no-op asm ties each register to a point after the wait_group.
template <int kCount = 128>
__device__ __forceinline__ void FenceRegs(float* d) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulator operands d[i .. i + 63] of a wgmma inline asm ("+f": read and written).
#define JMO_WGMMA_ACC8(d, i)                                                                                    \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define JMO_WGMMA_ACC64(d, i)                                                                                 \
  JMO_WGMMA_ACC8(d, i), JMO_WGMMA_ACC8(d, i + 8), JMO_WGMMA_ACC8(d, i + 16), JMO_WGMMA_ACC8(d, i + 24),       \
      JMO_WGMMA_ACC8(d, i + 32), JMO_WGMMA_ACC8(d, i + 40), JMO_WGMMA_ACC8(d, i + 48), JMO_WGMMA_ACC8(d, i + 56)

// wgmma shared-memory matrix descriptor (PTX ISA "matrix descriptor format"):
//   bits  0-13 start address >> 4, bits 16-29 leading byte offset >> 4, bits 32-45 stride byte offset >> 4,
//   bits 49-51 base offset (0: every swizzle atom starts 1024-aligned), bits 62-63 swizzle (1 = 128B).
__device__ __forceinline__ uint64_t MakeDesc(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  uint64_t d = 0;
  d |= (uint64_t)((smem_addr & 0x3FFFF) >> 4);
  d |= (uint64_t)((lbo_bytes & 0x3FFFF) >> 4) << 16;
  d |= (uint64_t)((sbo_bytes & 0x3FFFF) >> 4) << 32;
  d |= (uint64_t)1 << 62;
  return d;
}

// D[64 x 256] (+)= A[64 x 16] * B[16 x 256], both from smem. imm-trans-a = kTransA, imm-trans-b = kTransB: 0 = the
// operand is K-major, 1 = MN-major (legal for 16-bit types). scale_d = 0 ignores (zeroes) the old accumulator.
template <int kTransA, int kTransB>
__device__ __forceinline__ void Wgmma64x256(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
#if WGMMA_SM90A
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, %128, %129, p, 1, 1, %131, %132;\n}\n"
      : JMO_WGMMA_ACC64(d, 0), JMO_WGMMA_ACC64(d, 64)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));
#else
  __trap();
#endif
}

// ------------------------------------------------------------------------------------------------------------
// Building blocks of the warp-specialized loops (WgmmaTileLoop below, GroupedOuterKernel in wgmma_outer.cuh)
// (each one inlines to exactly the code the loops had written out)
// ------------------------------------------------------------------------------------------------------------
// setmaxnreg rule: the warps of a warpgroup synchronize between two setmaxnreg. The producer's increase back to
// the entry count waits until the consumers have released their extra registers at their end (ConsumerExit).
__device__ __forceinline__ void ProducerExit() {
  __syncwarp();
  NamedBarSync(kProducerBarrier, 128);
  SetMaxNRegInc<kEntryRegs>();
}
__device__ __forceinline__ void ConsumerExit() {
  NamedBarSync(kConsumerBarrier, 256);
  SetMaxNRegDec<kEntryRegs>();
}

// One BK = 64 k-step of a consumer warpgroup: 4 x wgmma m64n256k16 on the stage's operands at smem addresses a_base
// (this warpgroup's 64 rows of A) and b_base, committed as one group; then waits until only this group is in flight.
// Descriptor steps along K by 16 elements per wgmma:
//   K-major (kTrans = 0; 128B rows of K): +32 bytes inside the swizzled row (the hardware applies the XOR on the
//     final address, so advancing the start address by 32 B selects the next 16 k), SBO = 1024 (8 rows), LBO unused.
//   MN-major (kTrans = 1): +16 k-rows of 128 B = 2048 bytes; LBO = 8192 (next 64-wide chunk), SBO = 1024 (next 8 k).
template <int kTransA, int kTransB>
__device__ __forceinline__ void MmaKStep(float* acc, uint32_t a_base, uint32_t b_base) {
  const uint32_t a_lbo = kTransA ? 8192 : 16, a_kstep = kTransA ? 2048 : 32;
  const uint32_t b_lbo = kTransB ? 8192 : 16, b_kstep = kTransB ? 2048 : 32;
  FenceRegs(acc);
  WgmmaFence();
#pragma unroll
  for (int kk = 0; kk < kBK / 16; ++kk) {
    const uint64_t da = MakeDesc(a_base + kk * a_kstep, a_lbo, 1024);
    const uint64_t db = MakeDesc(b_base + kk * b_kstep, b_lbo, 1024);
    Wgmma64x256<kTransA, kTransB>(acc, da, db, 1);
  }
  WgmmaCommit();
  WgmmaWait<1>();
  FenceRegs(acc);
}

// The bf16 store of StoreAccTile (below): a lane's pair of columns of block j (v0) and of block j + 1 (v1), rounded to
// bf16; lanes l and l^1 exchange one pair so that each stores 4 consecutive columns at dst (the even lane block j's
// four, the odd lane block j + 1's). Every lane of the warp calls it (the exchange is a shuffle); `store`: whether
// this lane's 4 columns are stored (the same in lanes l and l^1).
__device__ __forceinline__ void StoreBf16Quad(float2 v0, float2 v1, bool odd, bool store, __nv_bfloat16* dst) {
  __nv_bfloat162 p0 = __floats2bfloat162_rn(v0.x, v0.y), p1 = __floats2bfloat162_rn(v1.x, v1.y);
  const uint32_t u0 = *reinterpret_cast<uint32_t*>(&p0), u1 = *reinterpret_cast<uint32_t*>(&p1);
  const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? u0 : u1, 1);
  const uint2 v = odd ? make_uint2(got, u1) : make_uint2(u0, got);
  if (store) *reinterpret_cast<uint2*>(dst) = v;
}

// Epilogue of a consumer warpgroup c (rows [64 c, 64 c + 64) of a 128-row tile), straight from registers:
// m64nNk16 f32 accumulator layout. Thread (warp wq, lane l) holds, for j = 0..31:
//   acc[4j + 0/1] -> row 16 wq + l/4,     cols 8 j + 2 (l%4) + 0/1
//   acc[4j + 2/3] -> row 16 wq + l/4 + 8, same cols
// Lanes l and l^1 swap one pair per (j, j+1) so that each lane stores 4 consecutive columns: the even lane
// cols 8 j + 2 (l%4) .. +3, the odd lane cols 8 (j+1) + 2 (l%4 - 1) .. +3. A warp store then covers 32
// (bf16) or 64 (f32) contiguous bytes per row. cols % 16 == 0: blocks j and j+1 are both in or both out.
// row_out(r): the address of the tile row r's element (r, 0) (bf16 or float per kOutF32), for r < rows; rows / cols:
// stored extent. kBlocks: the accumulator's 8-column blocks to store (32: all 256 columns; 16: the first 128 of acc,
// which may point into the middle of the array at a multiple of 64, the SwiGLU epilogue's halves).
template <bool kOutF32, int kBlocks = 32, class RowOut>
__device__ __forceinline__ void StoreAccRows(const float* acc, int c, int wq, int lane, int rows, int cols,
                                             RowOut row_out) {
  const int r_lo = c * 64 + wq * 16 + lane / 4;
  const bool odd = lane & 1;
  const int col_even = 2 * (lane % 4);           // for even lanes, block j
  const int col_odd = 8 + 2 * (lane % 4 - 1);    // for odd lanes, block j + 1
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r_lo + 8 * h;
    const bool row_ok = r < rows;
    void* const out_row = row_out(row_ok ? r : 0);
#pragma unroll
    for (int j = 0; j < kBlocks; j += 2) {
      const float* a0 = &acc[4 * j + 2 * h];        // block j, this row
      const float* a1 = &acc[4 * (j + 1) + 2 * h];  // block j + 1, this row
      const int col = (odd ? col_odd : col_even) + 8 * j;
      if (kOutF32) {
        const float s0 = odd ? a0[0] : a1[0], s1 = odd ? a0[1] : a1[1];
        const float r0 = __shfl_xor_sync(0xffffffffu, s0, 1), r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
        const float4 v = odd ? make_float4(r0, r1, a1[0], a1[1]) : make_float4(a0[0], a0[1], r0, r1);
        if (row_ok && col < cols) *reinterpret_cast<float4*>(static_cast<float*>(out_row) + col) = v;
      } else {
        StoreBf16Quad(make_float2(a0[0], a0[1]), make_float2(a1[0], a1[1]), odd, row_ok && col < cols,
                      static_cast<__nv_bfloat16*>(out_row) + col);
      }
    }
  }
}

// StoreAccRows into one row-major destination: out is the tile's element (0, 0), ldc the row stride.
template <bool kOutF32, int kBlocks = 32>
__device__ __forceinline__ void StoreAccTile(const float* acc, int c, int wq, int lane, int rows, int cols, void* out,
                                             int64_t ldc) {
  StoreAccRows<kOutF32, kBlocks>(acc, c, wq, lane, rows, cols, [&](int r) -> void* {
    return static_cast<unsigned char*>(out) + (int64_t)r * ldc * (kOutF32 ? 4 : 2);
  });
}

// The SwiGLU epilogue of a consumer warpgroup (see SwiGluTile): acc's columns 0..127 are the gate's, 128..255 the
// up projection's, for the same output columns (the thread's block j and block j + 16 hold the same columns of the
// two halves). Stores the preactivation first when asked for, then h = silu(gate) * up in float32, rounded to bf16.
template <class Tile>
__device__ __forceinline__ void StoreSwiGluTile(float* acc, int c, int wq, int lane, const Tile& t) {
  if (t.a != nullptr && t.a_bf16) {
    __nv_bfloat16* a = static_cast<__nv_bfloat16*>(t.a);
    StoreAccTile<false, 16>(acc, c, wq, lane, t.rows, t.cols, a + t.n0, t.lda);
    StoreAccTile<false, 16>(acc + 64, c, wq, lane, t.rows, t.cols, a + t.n_hi, t.lda);
  } else if (t.a != nullptr) {
    float* a = static_cast<float*>(t.a);
    StoreAccTile<true, 16>(acc, c, wq, lane, t.rows, t.cols, a + t.n0, t.lda);
    StoreAccTile<true, 16>(acc + 64, c, wq, lane, t.rows, t.cols, a + t.n_hi, t.lda);
  }
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = jmo::cuda::SiluMul(acc[i], acc[i + 64]);
  StoreAccTile<false, 16>(acc, c, wq, lane, t.rows, t.cols, t.out, t.ldc);
}

// The preactivation's gate and up values of one thread's two columns (c, c + 1) of a row, as float32: a float2 load
// of each (float a) or one 32-bit load of a bf16 pair.
__device__ __forceinline__ void LoadPreactPair(const float* row, int64_t up, int col, float2* g, float2* u) {
  *g = *reinterpret_cast<const float2*>(row + col);
  *u = *reinterpret_cast<const float2*>(row + up + col);
}
__device__ __forceinline__ void LoadPreactPair(const __nv_bfloat16* row, int64_t up, int col, float2* g, float2* u) {
  *g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(row + col));
  *u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(row + up + col));
}

// Before a SwiGluGradTile's mainloop: every consumer thread asks L2 for its share of the preactivation rows its
// epilogue will read (the thread's two rows of the m64n256 layout, gate and up, `cols` columns each; the four lanes
// of a row take a quarter of its 128-byte lines each), so that the epilogue's loads, issued while the tensor cores
// of the warpgroup wait, hit L2 instead of HBM. A hint only: nothing waits for it.
template <class Tile>
__device__ __forceinline__ void PrefetchSwiGluGradRows(int c, int wq, int lane, const Tile& t) {
  using AElem = typename Tile::Preact;
  constexpr int kLineElems = 128 / static_cast<int>(sizeof(AElem));
  const int lines = (t.cols + kLineElems - 1) / kLineElems;  // per half-row
  const int r_lo = c * 64 + wq * 16 + lane / 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r_lo + 8 * h;
    if (r >= t.rows) continue;
    const AElem* row = t.a + (int64_t)r * t.ldc;
    for (int l = lane % 4; l < lines; l += 4) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(row + l * kLineElems));
      asm volatile("prefetch.global.L2 [%0];" ::"l"(row + t.up + l * kLineElems));
    }
  }
}

// The SwiGLU-gradient epilogue of a consumer warpgroup (see SwiGluGradTile): acc is dh's 64 x 256 block in the
// m64n256 layout (StoreAccTile's). For each of its elements the thread reads the preactivation's gate and up values
// of the same row and column (one load of a warp covers 32 (float) or 16 (bf16) contiguous bytes of each of 8 rows),
// computes (d_gate, d_up) in float32 (SwiGluGrad) and stores both in bf16 with StoreAccTile's pair exchange, d_gate
// at the column, d_up `up` columns right of it. dh itself is never stored. The loads of kChunk block pairs are issued
// together before any of them is used, so their latency is paid once per chunk rather than once per pair (per chunk
// 16 float2 loads of float a, or 32 loads of bf16 pairs, each widened to a float2 as it is loaded).
template <class Tile>
__device__ __forceinline__ void StoreSwiGluGradTile(const float* acc, int c, int wq, int lane, const Tile& t) {
  using AElem = typename Tile::Preact;
  constexpr int kChunk = sizeof(AElem) == 4 ? 4 : 8;  // block pairs per chunk
  const int r_lo = c * 64 + wq * 16 + lane / 4;
  const bool odd = lane & 1;
  const int own = 2 * (lane % 4);                  // the thread's first column in each 8-column block
  const int swapped = odd ? 8 + 2 * (lane % 4 - 1) : own;  // its first stored column of each block pair
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r_lo + 8 * h;
    const bool row_ok = r < t.rows;
    const int64_t orow = (int64_t)(row_ok ? r : 0) * t.ldc;
    const AElem* a_row = t.a + orow;
    __nv_bfloat16* d_row = static_cast<__nv_bfloat16*>(t.out) + orow;
#pragma unroll
    for (int j0 = 0; j0 < 32; j0 += 2 * kChunk) {
      float2 g[2 * kChunk], u[2 * kChunk];  // blocks j0 .. j0 + 2 kChunk - 1
#pragma unroll
      for (int p = 0; p < kChunk; ++p) {
        const int j = j0 + 2 * p;
        const int c0 = 8 * j + own;              // the thread's columns of blocks j and j + 1: c0, c0 + 8
        g[2 * p] = g[2 * p + 1] = u[2 * p] = u[2 * p + 1] = make_float2(0.f, 0.f);
        if (row_ok && c0 < t.cols) {             // cols % 16 == 0: blocks j and j + 1 are both in or both out
          LoadPreactPair(a_row, t.up, c0, &g[2 * p], &u[2 * p]);
          LoadPreactPair(a_row, t.up, c0 + 8, &g[2 * p + 1], &u[2 * p + 1]);
        }
      }
#pragma unroll
      for (int p = 0; p < kChunk; ++p) {
        const int j = j0 + 2 * p;
        const bool ok = row_ok && 8 * j + own < t.cols;
        const float* d0 = &acc[4 * j + 2 * h];        // dh, block j, this row
        const float* d1 = &acc[4 * (j + 1) + 2 * h];  // block j + 1
        float2 dg0, du0, dg1, du1;
        jmo::cuda::SwiGluGrad(g[2 * p].x, u[2 * p].x, d0[0], &dg0.x, &du0.x);
        jmo::cuda::SwiGluGrad(g[2 * p].y, u[2 * p].y, d0[1], &dg0.y, &du0.y);
        jmo::cuda::SwiGluGrad(g[2 * p + 1].x, u[2 * p + 1].x, d1[0], &dg1.x, &du1.x);
        jmo::cuda::SwiGluGrad(g[2 * p + 1].y, u[2 * p + 1].y, d1[1], &dg1.y, &du1.y);
        const int col = swapped + 8 * j;
        StoreBf16Quad(dg0, dg1, odd, ok, d_row + col);
        StoreBf16Quad(du0, du1, odd, ok, d_row + t.up + col);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------------------
// The stage ring and the operand formats
// ------------------------------------------------------------------------------------------------------------
// The loop's shared memory, from a 1024-aligned base: kNumStages A slots (kABytes), kNumStages B slots (kBBytes),
// kNumStages slots of the format's extra data (kExtraBytes: 0 for bf16; the FP8 scales), the full and the empty
// mbarrier of each stage, the look-ahead's two mbarriers and tile index (WgmmaLoop with a tile_wait), then the tile
// index of each stage (ids, see WgmmaLoop). stage / phase: the slot a role (the producer, or a consumer warpgroup)
// works on next and the parity of its barriers' current phase; both roles walk the slots in the same order, tile after
// tile.
template <int kNumStages, int kExtraBytes>
struct StageRing {
  unsigned char* base;
  int stage = 0;
  uint32_t phase = 0;

  __device__ __forceinline__ unsigned char* A(int s) const { return base + s * kABytes; }
  __device__ __forceinline__ unsigned char* B(int s) const { return base + kNumStages * kABytes + s * kBBytes; }
  __device__ __forceinline__ unsigned char* X(int s) const { return base + kNumStages * kStageBytes + s * kExtraBytes; }
  __device__ __forceinline__ uint64_t* Full(int s) const {
    return reinterpret_cast<uint64_t*>(base + kNumStages * (kStageBytes + kExtraBytes)) + s;
  }
  __device__ __forceinline__ uint64_t* Empty(int s) const { return Full(kNumStages + s); }
  __device__ __forceinline__ uint64_t* AheadFull() const { return Full(2 * kNumStages); }
  __device__ __forceinline__ uint64_t* AheadEmpty() const { return Full(2 * kNumStages + 1); }
  __device__ __forceinline__ volatile int* AheadId() const {
    return reinterpret_cast<volatile int*>(Full(2 * kNumStages + 2));
  }
  __device__ __forceinline__ volatile int* Ids() const {
    return reinterpret_cast<volatile int*>(Full(2 * kNumStages + 3));
  }
  __device__ __forceinline__ void WaitFull() const { MbarWait(SmemAddr(Full(stage)), phase); }
  __device__ __forceinline__ void Advance() {
    if (++stage == kNumStages) { stage = 0; phase ^= 1; }
  }
};

// Dynamic smem the loop needs: 1 KB alignment slack + the ring (stages, their extra data, 2 * stages mbarriers, the
// look-ahead's two mbarriers and tile index (an 8-byte slot), the tile index of each stage).
template <int kNumStages = kStages, int kExtraBytes = 0>
constexpr int LoopSmemBytes() {
  return 1024 + kNumStages * (kStageBytes + kExtraBytes) + (2 * kNumStages + 3) * 8 + kNumStages * 4;
}
constexpr int kLoopSmemBytes = LoopSmemBytes<kStages>();

// For an a_stage hook: stores consumer warpgroup c's rows of a stage's A slot `a` (kBM rows of 128 bytes: kBK bf16 or
// kFp8BK e4m3, as TMA writes them with the 128B swizzle into a 1024-aligned slot: the 16-byte chunk j of row r at
// chunk j ^ (r % 8) of the row) to global memory: row r (64 c <= r < 64 c + 64, r < rows) to dst + r * ld_bytes, its
// 128 bytes (dst and ld_bytes 16-byte aligned). t: the thread's index in the warpgroup (0..127). Thread t copies the
// warpgroup's chunks t, t + 128, t + 256, t + 384: each warp stores 4 whole rows per step (128-byte lines), each 8
// lanes read one row's 8 chunks (every bank once: no conflict). kBatch chunks are loaded before they are stored (4:
// all; fewer where the caller's registers are scarce, as beside the FP8 format's 192 accumulators).
template <int kBatch = 4>
__device__ __forceinline__ void StoreAStageRows(const unsigned char* a, int c, int t, int rows, char* dst,
                                                int64_t ld_bytes) {
  constexpr int kRowBytes = 128, kChunks = kRowBytes / 16, kSteps = 64 * kChunks / 128;
  static_assert(kBK * kElemBytes == kRowBytes, "one 128B swizzle row per tile row");
  static_assert(kSteps % kBatch == 0, "whole batches");
  const uint32_t base = SmemAddr(a);
#pragma unroll
  for (int i0 = 0; i0 < kSteps; i0 += kBatch) {
    uint4 v[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int r = c * 64 + ((i0 + i) * 128 + t) / kChunks, j = t % kChunks;
      if (r < rows) v[i] = LdSharedV4(base + r * kRowBytes + ((j ^ (r % 8)) * 16));
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int r = c * 64 + ((i0 + i) * 128 + t) / kChunks, j = t % kChunks;
      if (r < rows) *reinterpret_cast<uint4*>(dst + r * ld_bytes + j * 16) = v[i];
    }
  }
}

// Where a tile's operands lie, as the producer loads them: A's first row, B's index (group) and first column, B's
// first column for the tile's accumulator columns 128..255 (WgmmaTile::n_hi resolved), and the tile's first k-step
// (TileKFirst: a format whose stage data depends on the k-step within all of K reads it in Multiply).
struct TileCoords {
  int a_row, b_idx, n0, n_hi, k_first;
  template <class Tile>
  __device__ __forceinline__ static TileCoords Of(const Tile& t) {
    return {t.a_row, t.b_idx, t.n0, t.n_hi < 0 ? t.n0 + kBN / 2 : t.n_hi, TileKFirst(t)};
  }
};

// The consumer warpgroups' turns at issuing MMAs, for operand formats whose warpgroups wait for their MMAs and then
// work on the results before the next batch (kIssueTurnsPerStage > 0: the FP8 promotion). Warpgroup c issues a batch
// only once the other has issued its previous one, then hands the turn over: the tensor cores get the two warpgroups'
// batches one after the other, so one warpgroup's work between batches overlaps the other's MMAs, where warpgroups
// issuing together finish their batches together and then leave the tensor cores idle together. Warpgroup c's turn is
// named barrier kIssueBarrier + c: the other warpgroup's 128 threads arrive on it, c's 128 sync on it. Warpgroup 0 goes
// first (Start); Finish takes the last turn warpgroup 1 hands over, so every barrier generation completes. Every
// consumer thread calls each of them; each warpgroup takes and passes the same number of turns (a warpgroup with no
// rows in a tile takes and passes its turns without MMAs: WgmmaLoop).
struct IssueTurns {
  __device__ static __forceinline__ void Start(int c) {
    if (c == 1) NamedBarArrive(kIssueBarrier, 256);
  }
  __device__ static __forceinline__ void Take(int c) { NamedBarSync(kIssueBarrier + c, 256); }
  __device__ static __forceinline__ void Pass(int c) { NamedBarArrive(kIssueBarrier + (c ^ 1), 256); }
  __device__ static __forceinline__ void Finish(int c) {
    if (c == 0) NamedBarSync(kIssueBarrier, 256);
  }
};

// An operand format of WgmmaLoop: what a stage holds, how the producer fills it and how a consumer warpgroup
// multiplies a tile over the stages. Members:
//   kBK            K elements per stage (each stage holds a 128-byte-wide K slice of A's 128 rows and B's 256 rows)
//   kExtraBytes    smem per stage beside the A and B slots (a multiple of 128)
//   kProducerRegs, kConsumerRegs   the registers of a producer / consumer thread (setmaxnreg; within the entry budget)
//   kIssueTurnsPerStage            0, or the IssueTurns each consumer warpgroup takes per stage in Multiply (the loop
//                                  starts and finishes the turns and takes them for a warpgroup without rows)
//   Prefetch()                                         the TMA thread, before its first load
//   LoadStage(fb, a_dst, b_dst, x, coords, kt)         the TMA thread, once the stage's slot is free: arms the full
//                                                      barrier fb with the stage's bytes and issues its loads (kt:
//                                                      the k-step within all of K, KRangeTile's k_first counted)
//   Multiply(acc, ring, coords, c, wq, lane, ktiles)   a consumer warpgroup (c: rows [64 c, 64 c + 64) of the tile):
//                                                      acc = the tile's 64 x 256 block in the m64n256 f32 layout,
//                                                      over the tile's ktiles stages from ring.stage on (the first
//                                                      one's full barrier already waited for); waits on each later
//                                                      stage's full barrier, arrives (one lane of each warp) on each
//                                                      stage's empty barrier once it is done with it, and leaves
//                                                      ring.stage / ring.phase after the tile's last stage. Both
//                                                      formats take an a_stage(a, x, kt) too (the loop's hook, bound
//                                                      to the tile and c; kt within the tile's stages).
// bf16 (this file): A [rows, K] K-major, B K-major (kTransB = 0) or MN-major (kTransB = 1), wgmma m64n256k16, one
// commit group kept in flight. e4m3 with block scales: wgmma_mainloop_fp8.cuh.
template <int kTransB>
struct Bf16Operands {
  const CUtensorMap* a_map;
  const CUtensorMap* b_map;
  static constexpr int kBK = wgmma_gemm::kBK;
  static constexpr int kExtraBytes = 0;
  static constexpr int kProducerRegs = wgmma_gemm::kProducerRegs;
  static constexpr int kConsumerRegs = wgmma_gemm::kConsumerRegs;
  static constexpr int kIssueTurnsPerStage = 0;  // (IssueTurns: the warpgroups issue freely)

  __device__ __forceinline__ void Prefetch() const {
    PrefetchTensorMap(a_map);
    PrefetchTensorMap(b_map);
  }

  __device__ __forceinline__ void LoadStage(uint32_t fb, uint32_t a_dst, uint32_t b_dst, unsigned char*,
                                            const TileCoords& t, int kt) const {
    MbarArriveExpectTx(fb, kStageBytes);  // OOB parts of a box are zero-filled and still counted
    TmaLoad2D(a_dst, a_map, fb, kt * kBK, t.a_row);
    if (kTransB) {
#pragma unroll
      for (int j = 0; j < kBN / 64; ++j)
        TmaLoad3D(b_dst + j * 8192, b_map, fb, j < 2 ? t.n0 + 64 * j : t.n_hi + 64 * (j - 2), kt * kBK, t.b_idx);
    } else {
      TmaLoad3D(b_dst, b_map, fb, kt * kBK, t.n0, t.b_idx);
    }
  }

  template <class Ring, class AStage = NoAStage>
  __device__ __forceinline__ void Multiply(float* acc, Ring& ring, const TileCoords&, int c, int, int,
                                           int ktiles, const AStage& a_stage = {}) const {
#pragma unroll
    for (int j = 0; j < 128; ++j) acc[j] = 0.f;
    int prev_stage = -1;
    for (int kt = 0; kt < ktiles; ++kt) {
      if (kt > 0) ring.WaitFull();
      const uint32_t a_base = SmemAddr(ring.A(ring.stage)) + c * (64 * 128);  // this WG's 64 rows
      const uint32_t b_base = SmemAddr(ring.B(ring.stage));
      MmaKStep<0, kTransB>(acc, a_base, b_base);
      // Keep this k-step's group in flight; the previous one is done -> release its slot (one lane of the warp, by
      // ElectOne: the lane index would stay live across the loop, and beside the 128 accumulators it is spilled).
      if (prev_stage >= 0 && ElectOne()) MbarArrive(SmemAddr(ring.Empty(prev_stage)));
      if constexpr (!std::is_same<AStage, NoAStage>::value) {
        a_stage(ring.A(ring.stage), ring.X(ring.stage), kt);  // (while this k-step's MMAs run)
        __syncwarp();  // every lane's reads of the slot before one lane releases it (next k-step, or below)
      }
      prev_stage = ring.stage;
      ring.Advance();
    }
    WgmmaWait<0>();
    FenceRegs(acc);
    if (prev_stage >= 0 && ElectOne()) MbarArrive(SmemAddr(ring.Empty(prev_stage)));
  }
};

// ------------------------------------------------------------------------------------------------------------
// The loop
// ------------------------------------------------------------------------------------------------------------
// WgmmaLoop<Ops, kOutF32, kNumStages>(ops, K, count, next_tile, tile_of, tile_done, smem[, tile_wait]): the loop of
// the header comment over the operand format Ops (K % Ops::kBK == 0; smem >= LoopSmemBytes<kNumStages,
// Ops::kExtraBytes>()). WgmmaTileLoopNext / WgmmaTileLoop below are its bf16 instances.
template <class Ops, bool kOutF32, int kNumStages = kStages, class NextFn, class TileFn, class DoneFn,
          class WaitFn = NoTileWait, class AStageFn = NoAStage>
__device__ __forceinline__ void WgmmaLoop(const Ops& ops, int K, int count, NextFn next_tile, TileFn tile_of,
                                          DoneFn tile_done, char* smem, WaitFn tile_wait = {},
                                          AStageFn a_stage = {}) {
  static_assert(kNumStages >= 2, "at least two stages (one wgmma group is kept in flight)");
  static_assert(Ops::kExtraBytes % 128 == 0, "the extra slots keep 128-byte alignment (TMA destinations)");
  static_assert(Ops::kProducerRegs * 128 + Ops::kConsumerRegs * 256 <= kEntryRegs * kThreads, "register budget");
  constexpr bool kHasDone = !std::is_same<typename std::decay<DoneFn>::type, NoTileDone>::value;
  constexpr bool kHasAStage = !std::is_same<typename std::decay<AStageFn>::type, NoAStage>::value;
  // With a tile_wait the look-ahead warp claims and waits for each tile (see the header comment).
  constexpr bool kAhead = !std::is_same<typename std::decay<WaitFn>::type, NoTileWait>::value;
  using Ring = StageRing<kNumStages, Ops::kExtraBytes>;
  // 128B swizzle atoms must start 1024-aligned (the descriptor base offset field is left 0).
  Ring ring{reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem) + 1023) & ~(uintptr_t)1023)};
  // ids[s]: the tile whose first k-step stage s holds, or -1: no more tiles. Written by thread 0 before the stage's
  // full-barrier arrive (release), read by the consumers after their wait on it (acquire); rewritten only after the
  // stage's empty barrier completes, which every consumer warp arrives on after its read.
  volatile int* ids = ring.Ids();

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int ktiles = K / Ops::kBK;

  if (tid == 0) {
    for (int s = 0; s < kNumStages; ++s) {
      MbarInit(SmemAddr(ring.Full(s)), 1);   // one arrive.expect_tx by the producer; the TMA bytes complete it
      MbarInit(SmemAddr(ring.Empty(s)), 8);  // one arrive per consumer warp (2 warpgroups x 4 warps)
    }
    if (kAhead) {
      MbarInit(SmemAddr(ring.AheadFull()), 1);   // the look-ahead lane 0's arrive with the next tile's index
      MbarInit(SmemAddr(ring.AheadEmpty()), 1);  // the TMA thread's arrive: claim the one after
    }
    MbarInitFence();
  }
  __syncthreads();

  if (warp < 4) {
    // ================= producer warpgroup =================
    SetMaxNRegDec<Ops::kProducerRegs>();
    if (tid == 0) {
      ops.Prefetch();
      int popped = 0;  // tiles taken from the look-ahead
      auto take = [&](int prev) {
        if constexpr (!kAhead) {
          return next_tile(prev);
        } else {
          const uint64_t t0 = HasStalled<WaitFn>::value ? GlobalTimer() : 0;
          MbarWait(SmemAddr(ring.AheadFull()), popped++ & 1);
          if constexpr (HasStalled<WaitFn>::value) tile_wait.Stalled(GlobalTimer() - t0, popped == 1);
          const int i = *ring.AheadId();
          FenceProxyAsyncGlobal();  // (the look-ahead's acquire of the operands, then this thread's TMA reads)
          return i;
        }
      };
      for (int i = take(-1);; i = take(i)) {
        if (i >= count) {
          // The end: a stage that carries no operands, only ids = -1 (a plain arrive completes its full phase).
          MbarWait(SmemAddr(ring.Empty(ring.stage)), ring.phase ^ 1);
          ids[ring.stage] = -1;
          MbarArrive(SmemAddr(ring.Full(ring.stage)));
          break;
        }
        const auto tile = tile_of(i);
        const TileCoords coords = TileCoords::Of(tile);
        const int k_first = TileKFirst(tile), k_steps = TileKSteps(tile, ktiles);
        // The look-ahead claims the next tile once this one's last kAheadLoads loads remain (see kAheadLoads).
        const int ahead_kt = k_steps > kAheadLoads ? k_steps - kAheadLoads : 0;
        for (int kt = 0; kt < k_steps; ++kt) {
          const int s = ring.stage;
          const uint32_t fb = SmemAddr(ring.Full(s));
          MbarWait(SmemAddr(ring.Empty(s)), ring.phase ^ 1);  // consumers released this slot (first pass: free)
          if (kt == 0) ids[s] = i;
          ops.LoadStage(fb, SmemAddr(ring.A(s)), SmemAddr(ring.B(s)), ring.X(s), coords, k_first + kt);
          ring.Advance();
          if (kAhead && kt == ahead_kt) MbarArrive(SmemAddr(ring.AheadEmpty()));
        }
      }
    } else if (kAhead && warp == 1) {
      // The look-ahead warp: lane 0 claims each tile, the warp waits for its operands while the TMA thread still loads
      // the previous one, lane 0 hands its index over (-> take above); an index >= count ends both.
      for (int prev = -1, n = 0;; ++n) {
        MbarWait(SmemAddr(ring.AheadEmpty()), (n & 1) ^ 1);  // (the first pass goes through)
        const int i = __shfl_sync(0xffffffffu, lane == 0 ? next_tile(prev) : 0, 0);
        if (i < count) tile_wait(tile_of(i));
        if (lane == 0) {
          *ring.AheadId() = i;
          MbarArrive(SmemAddr(ring.AheadFull()));
        }
        if (i >= count) break;
        prev = i;
      }
    }
    // setmaxnreg rule: the warps of a warpgroup synchronize between two setmaxnreg. The increase waits until the
    // consumers have released their extra registers at their end.
    ProducerExit();
  } else {
    // ================= consumer warpgroups =================
    SetMaxNRegInc<Ops::kConsumerRegs>();
    const int c = warp / 4 - 1;  // consumer index: rows [64 c, 64 c + 64) of the tile
    const int wq = warp % 4;     // warp within the warpgroup: rows 16 wq .. 16 wq + 15 of its 64

    float acc[128];
    constexpr int kTurns = Ops::kIssueTurnsPerStage;
    if (kTurns > 0) IssueTurns::Start(c);
    for (;;) {
      ring.WaitFull();  // the next tile's first stage (or the end)
      const int i = ids[ring.stage];
      if (i < 0) break;
      const auto tile = tile_of(i);
      const int k_steps = TileKSteps(tile, ktiles);
      if (c * 64 >= tile.rows) {
        // No valid row for this warpgroup (a segment's last m-tile with <= 64 rows): skip the MMAs
        // (warpgroup-uniform) but wait on every full barrier and arrive on every empty barrier so that the
        // barrier phases stay in step, and take and pass the stage's issue turns.
        for (int kt = 0; kt < k_steps; ++kt) {
          if (kt > 0) ring.WaitFull();
          for (int t = 0; t < kTurns; ++t) {
            IssueTurns::Take(c);
            IssueTurns::Pass(c);
          }
          __syncwarp();
          if (lane == 0) MbarArrive(SmemAddr(ring.Empty(ring.stage)));
          ring.Advance();
        }
      } else {
        if constexpr (std::is_base_of<SwiGluGradTileBase, decltype(tile)>::value)
          PrefetchSwiGluGradRows(c, wq, lane, tile);
        if constexpr (kHasAStage) {
          const int k_first = TileKFirst(tile);
          ops.Multiply(acc, ring, TileCoords::Of(tile), c, wq, lane, k_steps,
                       [&](const unsigned char* a, const unsigned char* x, int kt) {
                         a_stage(tile, c, a, x, k_first + kt);
                       });
        } else {
          ops.Multiply(acc, ring, TileCoords::Of(tile), c, wq, lane, k_steps);
        }
        if constexpr (std::is_base_of<SwiGluTile, decltype(tile)>::value)
          StoreSwiGluTile(acc, c, wq, lane, tile);
        else if constexpr (std::is_base_of<SwiGluGradTileBase, decltype(tile)>::value)
          StoreSwiGluGradTile(acc, c, wq, lane, tile);
        else if constexpr (std::is_base_of<EpilogueTile, decltype(tile)>::value)
          tile.Store(acc, c, wq, lane);
        else
          StoreAccTile<kOutF32>(acc, c, wq, lane, tile.rows, tile.cols, tile.out, tile.ldc);
      }
      if constexpr (kHasDone) {
        // Every consumer thread: its stores of this tile, then a gpu-scope fence, then the consumer barrier; then
        // one thread reports the tile (contract in the header comment).
        if (tile.publish) {
          __threadfence();
          NamedBarSync(kConsumerBarrier, 256);
          if (tid == 128) tile_done(tile);
          __syncwarp();
        }
      }
    }
    if (kTurns > 0) IssueTurns::Finish(c);
    // Back to the entry register count (frees the registers the producer's increase waits for). setmaxnreg rule:
    // the warps of each warpgroup synchronize between two setmaxnreg.
    ConsumerExit();
  }
  __syncthreads();
}

// The bf16 loop (the header comment) with tile indices from next_tile.
template <int kTransB, bool kOutF32, int kNumStages = kStages, class NextFn, class TileFn, class DoneFn,
          class WaitFn = NoTileWait, class AStageFn = NoAStage>
__device__ __forceinline__ void WgmmaTileLoopNext(const CUtensorMap& a_map, const CUtensorMap& b_map, int K,
                                                  int count, NextFn next_tile, TileFn tile_of, DoneFn tile_done,
                                                  char* smem, WaitFn tile_wait = {}, AStageFn a_stage = {}) {
  WgmmaLoop<Bf16Operands<kTransB>, kOutF32, kNumStages>(Bf16Operands<kTransB>{&a_map, &b_map}, K, count, next_tile,
                                                        tile_of, tile_done, smem, tile_wait, a_stage);
}

// The static schedule: tiles first, first + stride, ... < count.
struct StaticTiles {
  int first, stride;
  __device__ __forceinline__ int operator()(int prev) const { return prev < 0 ? first : prev + stride; }
};

template <int kTransB, bool kOutF32, int kNumStages = kStages, class TileFn, class DoneFn, class WaitFn = NoTileWait>
__device__ __forceinline__ void WgmmaTileLoop(const CUtensorMap& a_map, const CUtensorMap& b_map, int K, int first,
                                              int stride, int count, TileFn tile_of, DoneFn tile_done, char* smem,
                                              WaitFn tile_wait = {}) {
  WgmmaTileLoopNext<kTransB, kOutF32, kNumStages>(a_map, b_map, K, count, StaticTiles{first, stride}, tile_of,
                                                  tile_done, smem, tile_wait);
}

}  // namespace wgmma_gemm
