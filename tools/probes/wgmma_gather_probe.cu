// Standalone probe: the grouped GEMM (wgmma_grouped.cuh) with its A operand gathered row by row against A read by TMA.
//   wgmma_gather_probe [--small-only] [--no-timing] [--rows-only]
// Exit codes: 0 all PASS, 1 some FAIL, 2 CUDA error, 3 watchdog timeout.
//
// The same GEMM runs two ways on the same data:
//   TMA A     the library's grouped GEMM (WgmmaGroupedGemm) over recv [M, K], its rows in GEMM order;
//   gathered  GatherGemmKernel below: GEMM row r read from x + src[r] * K (src[r] >= 0: a row of x, scattered) or from
//             recv + r * K (src[r] < 0), by 16-byte cp.async copies of the producer warpgroup's gather warps; B by TMA;
//   TMA rows  RowTmaGemmKernel below: the same rows by one 2D TMA load of a {64, 1} box per row and k-step, issued by
//             the producer warpgroup's row warps (--rows-only: these and TMA A alone).
// Source layouts: "all-x" (every row from x, src a random permutation) and "half-x" (the first half of each group's
// rows from x, the rest from recv, as dispatch_gemm has them with two ranks). The rows the gathered kernel must not
// read (x's rows no GEMM row maps to, recv's rows that come from x) are NaN, so a wrong source shows. Both
// results are compared with a float32 reference, and the gathered result must equal the TMA one bit for bit (the same
// MMAs on the same operands in the same order). Gathered variants (GatherVariant): the producer warps that gather
// (2-3, 1-3, 0-3) and 2-3 without the consumers' proxy fence; TMA rows from warps 2-3 and 0-3. The full-size cases
// are timed (median of 20 launches after 3 warm-ups, each launch timed by its own events) and end in one table: TMA A
// us, gathered A us, their ratio, TFLOP/s of both.
#include <random>

#include "cuda/gemm/sm90/wgmma_grouped.cuh"
#include "probe_common.cuh"

namespace gather {

using namespace wgmma_gemm;

constexpr int kRowBytes = kBK * kElemBytes;  // one 128B swizzle row of a stage's A slot
constexpr int kChunks = kRowBytes / 16;      // 16-byte cp.async chunks per row
constexpr int kGatherBarrier = 3;            // named barrier of the gather warps (the loop's helpers use 1 and 2)
static_assert(kRowBytes == 128 && kChunks == 8, "the 128B swizzle: chunk j of row r at chunk j ^ (r % 8)");

// Counts this thread's cp.async copies issued so far on an mbarrier without raising its pending count: the arrival
// happens once the copies have landed, and it is one of the arrivals the barrier was initialized to expect.
__device__ __forceinline__ void CpAsyncMbarArriveNoInc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// The loop's stage ring whose full-barrier wait also orders the gathered A rows for the MMAs (kProxyFence): cp.async
// writes shared memory through the generic proxy, wgmma reads its operands through the async proxy, so each consumer
// thread fences between observing a stage's completion and its MMAs on the stage (Bf16Operands::Multiply waits
// through this). kProxyFence = false leaves the fence out, as CUTLASS's cp.async GMMA mainloop does
// (sm90_mma_multistage_gmma_ss_warpspecialized.hpp): the probe times what the fence costs.
template <int kNumStages, bool kProxyFence>
struct GatherRing : StageRing<kNumStages, 0> {
  __device__ __forceinline__ void WaitFull() const {
    StageRing<kNumStages, 0>::WaitFull();
    if (kProxyFence) FenceProxyAsyncShared();
  }
};

// Dynamic smem: the loop's ring, the group tables (GroupedGemmBody's), then two tables of kBM row source addresses
// (one per tile, alternating: see the gather warps' loop).
constexpr int kTableOffset = (LoopSmemBytes<kStages>() + 2 * (kMaxGroups + 1) * 4 + 7) / 8 * 8;
constexpr int kSmemBytes = kTableOffset + 2 * kBM * 8;

// The TMA thread's part of a k-step: the stage's tile id on its first k-step, the arrival expecting `bytes` (B's, and
// A's where A also comes by TMA), B's four 64-column boxes (B [G, K, N], MN-major).
template <class Ring>
__device__ __forceinline__ void IssueB(Ring& ring, const CUtensorMap& b_map, const TileCoords& coords, int i, int kt,
                                       uint32_t bytes) {
  const int s = ring.stage;
  const uint32_t fb = SmemAddr(ring.Full(s));
  if (kt == 0) ring.Ids()[s] = i;
  MbarArriveExpectTx(fb, bytes);
#pragma unroll
  for (int j = 0; j < kBN / 64; ++j)
    TmaLoad3D(SmemAddr(ring.B(s)) + j * 8192, &b_map, fb, j < 2 ? coords.n0 + 64 * j : coords.n_hi + 64 * (j - 2),
              kt * kBK, coords.b_idx);
}

// A tile's k-steps on the producer side: wait for the stage to be free, fill it (fn(kt, stage, its full barrier)),
// advance.
template <class Ring, class Fn>
__device__ __forceinline__ void ForEachKStep(Ring& ring, int K, Fn fn) {
  for (int kt = 0; kt < K / kBK; ++kt) {
    const int s = ring.stage;
    MbarWait(SmemAddr(ring.Empty(s)), ring.phase ^ 1);
    fn(kt, s, SmemAddr(ring.Full(s)));
    ring.Advance();
  }
}

// A producer thread's walk over the CTA's tiles (GatherLoop's comment, below): as the TMA thread (kMayTma and thread
// 0: B, the stage ids, the end marker) and/or as a gather thread (kGather; gt its index among the kGatherThreads).
template <bool kMayTma, bool kGather, int kGatherThreads, class Ring, class TileFn>
__device__ __forceinline__ void Produce(Ring& ring, const CUtensorMap& b_map, const __nv_bfloat16* x,
                                        const __nv_bfloat16* recv, const int* src, int K, int count, TileFn tile_of,
                                        uint64_t* table, int gt) {
  constexpr int kRowStep = kGatherThreads / kChunks;
  const bool tma = kMayTma && threadIdx.x == 0;
  volatile int* ids = ring.Ids();  // the tile whose first k-step a stage holds (WgmmaLoop's protocol)
  if (tma) PrefetchTensorMap(&b_map);
  for (int i = blockIdx.x, buf = 0;; i += gridDim.x, buf ^= 1) {
    if (i >= count) {
      // The end: a stage that carries no operands, only ids = -1, completed by plain arrivals.
      MbarWait(SmemAddr(ring.Empty(ring.stage)), ring.phase ^ 1);
      if (tma) {
        ids[ring.stage] = -1;
        MbarArrive(SmemAddr(ring.Full(ring.stage)));
      }
      if (kGather) MbarArrive(SmemAddr(ring.Full(ring.stage)));
      break;
    }
    const auto tile = tile_of(i);
    const uint64_t* rows_src = table + buf * kBM;
    if (kGather) {
      for (int r = gt; r < kBM; r += kGatherThreads) {
        const int row = tile.a_row + (r < tile.rows ? r : 0);
        const int s = src[row];
        table[buf * kBM + r] = reinterpret_cast<uint64_t>(s >= 0 ? x + (int64_t)s * K : recv + (int64_t)row * K);
      }
      __syncwarp();  // (bar.sync is .aligned: the warp converged)
      NamedBarSync(kGatherBarrier, kGatherThreads);
    }
    const TileCoords coords = TileCoords::Of(tile);
    ForEachKStep(ring, K, [&](int kt, int s, uint32_t fb) {
      if (tma) IssueB(ring, b_map, coords, i, kt, kBBytes);
      if (kGather) {
        // (32-bit shared addresses: a generic pointer to the slot would hold two of the 24 registers)
        const int j = gt % kChunks;
        const uint32_t a = SmemAddr(ring.A(s));
        const uint32_t off = kt * kRowBytes + j * 16;  // (K * 2 bytes < 2^31)
#pragma unroll 1  // (unrolled, the addresses computed ahead of the copies outgrow the 24 registers)
        for (int r = gt / kChunks; r < kBM; r += kRowStep) {
          void* dst = reinterpret_cast<void*>(__cvta_shared_to_generic(a + r * kRowBytes + (j ^ (r % 8)) * 16));
          CpAsync16(dst, reinterpret_cast<const char*>(rows_src[r]) + off, 16);
        }
        CpAsyncMbarArriveNoInc(fb);
      }
    });
  }
}

// The warp-specialized loop of WgmmaLoop (wgmma_mainloop.cuh) with the stages filled by `produce(ring, warp, tid)`,
// which every producer thread (warps 0-3) calls and which fills each stage's A and B slots and completes its full
// barrier, initialized to expect full_arrivals arrivals. The consumer warpgroups are the loop's
// (Bf16Operands<1>::Multiply over a GatherRing, StoreAccTile).
template <bool kProxyFence, class TileFn, class ProduceFn>
__device__ __forceinline__ void SpecializedLoop(int K, int full_arrivals, TileFn tile_of, char* smem,
                                                ProduceFn produce) {
  using Ring = GatherRing<kStages, kProxyFence>;
  Ring ring;
  ring.base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem) + 1023) & ~(uintptr_t)1023);
  volatile int* ids = ring.Ids();
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int ktiles = K / kBK;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      MbarInit(SmemAddr(ring.Full(s)), full_arrivals);
      MbarInit(SmemAddr(ring.Empty(s)), 8);  // one arrive per consumer warp
    }
    MbarInitFence();
  }
  __syncthreads();

  if (warp < 4) {
    SetMaxNRegDec<kProducerRegs>();
    produce(ring, warp, tid);
    ProducerExit();
  } else {
    SetMaxNRegInc<kConsumerRegs>();
    const int c = warp / 4 - 1, wq = warp % 4;
    float acc[128];
    for (;;) {
      ring.WaitFull();
      const int i = ids[ring.stage];
      if (i < 0) break;
      const auto tile = tile_of(i);
      if (c * 64 >= tile.rows) {
        // No row of this warpgroup in the tile: follow the barriers without MMAs.
        for (int kt = 0; kt < ktiles; ++kt, ring.Advance()) {
          if (kt > 0) ring.WaitFull();
          __syncwarp();
          if (ElectOne()) MbarArrive(SmemAddr(ring.Empty(ring.stage)));
        }
      } else {
        Bf16Operands<1>{}.Multiply(acc, ring, TileCoords::Of(tile), c, wq, lane, ktiles);
        StoreAccTile<false>(acc, c, wq, lane, tile.rows, tile.cols, tile.out, tile.ldc);
      }
    }
    ConsumerExit();
  }
  __syncthreads();
}

// The loop with A gathered by cp.async: thread 0 loads B by TMA (arrive.expect_tx of kBBytes on the stage's full
// barrier), the kGatherWarps last warps of the producer warpgroup copy A (warps 4 - kGatherWarps .. 3; with 4, thread 0
// does both; with 2, warps 2-3 alone, the ones dispatch_gemm's producer warpgroup has free beside its TMA thread and
// its look-ahead warp 1). The full barrier expects 1 + 32 kGatherWarps arrivals: thread 0's expect_tx arrive and one
// cp.async noinc arrive per gather thread, so a stage completes when B's bytes and every gather thread's copies have
// landed. Static schedule: tiles blockIdx.x, + gridDim.x, ... Per tile the gather threads first write the source
// address of each of its kBM rows to a table (rows past tile.rows, which are multiplied but never stored, read row 0's
// source), pass their named barrier, then per k-step copy chunk gt % 8 of rows gt / 8, + 4 kGatherWarps, ... (gt: the
// thread's index among them): each warp instruction reads 4 whole 128-byte row segments, and writes chunk j of row r
// at chunk j ^ (r % 8) of the row's 128-byte line of the 1024-aligned slot, where the 128B-swizzle TMA box would put
// it (StoreAStageRows reads the TMA's slots so). The tables alternate between tiles: a thread writes tile j + 1's table
// after passing tile j's barrier, which every thread reaches only after issuing all of tile j - 1's copies, the last
// reads of that table.
template <int kGatherWarps, bool kProxyFence, class TileFn>
__device__ __forceinline__ void GatherLoop(const CUtensorMap& b_map, const __nv_bfloat16* x, const __nv_bfloat16* recv,
                                           const int* src, int K, int count, TileFn tile_of, uint64_t* table,
                                           char* smem) {
  static_assert(kGatherWarps >= 1 && kGatherWarps <= 4, "gather warps are producer warps");
  constexpr int kGatherThreads = 32 * kGatherWarps, kFirstGatherWarp = 4 - kGatherWarps;
  SpecializedLoop<kProxyFence>(K, 1 + kGatherThreads, tile_of, smem, [&](auto& ring, int warp, int tid) {
    const int gt = tid - 32 * kFirstGatherWarp;
    if (kFirstGatherWarp == 0) {
      Produce<true, true, kGatherThreads>(ring, b_map, x, recv, src, K, count, tile_of, table, gt);
    } else if (tid == 0) {
      Produce<true, false, kGatherThreads>(ring, b_map, x, recv, src, K, count, tile_of, table, gt);
    } else if (warp >= kFirstGatherWarp) {
      Produce<false, true, kGatherThreads>(ring, b_map, x, recv, src, K, count, tile_of, table, gt);
    }
  });
}

// A producer thread's walk over the CTA's tiles with A loaded row by row by TMA: as the TMA thread (kMayTma and thread
// 0: B, the stage ids, the end marker, and the expect_tx of the whole stage, A's rows included) and/or as a row thread
// (kRows; rt its index among the kRowThreads), which issues one 2D TMA load of a {64 columns, 1 row} box per row and
// k-step for rows rt, rt + kRowThreads, ... of the tile: from x_map at row src[row] (src[row] >= 0) or from recv_map at
// row `row`. The 128B swizzle of a one-row box placed at row r's 128-byte line of the 1024-aligned slot: the probe
// checks (bitwise against the TMA A) that the TMA unit swizzles by shared-memory address, as wgmma reads. The row
// loads complete on the full barrier by their bytes alone (no arrival): the tx-count may go below zero until thread
// 0's expect_tx, and the phase cannot complete before thread 0's arrival.
template <bool kMayTma, bool kRows, int kRowThreads, class Ring, class TileFn>
__device__ __forceinline__ void ProduceRows(Ring& ring, const CUtensorMap& b_map, const CUtensorMap& x_map,
                                            const CUtensorMap& recv_map, const int* src, int K, int count,
                                            TileFn tile_of, int rt) {
  constexpr int kRowsPerThread = kBM / kRowThreads;
  static_assert(kBM % kRowThreads == 0, "rows dealt evenly");
  const bool tma = kMayTma && threadIdx.x == 0;
  volatile int* ids = ring.Ids();
  if (tma) PrefetchTensorMap(&b_map);
  if (kRows && rt == 0) {
    PrefetchTensorMap(&x_map);
    PrefetchTensorMap(&recv_map);
  }
  for (int i = blockIdx.x;; i += gridDim.x) {
    if (i >= count) {
      if (tma) {
        MbarWait(SmemAddr(ring.Empty(ring.stage)), ring.phase ^ 1);
        ids[ring.stage] = -1;
        MbarArrive(SmemAddr(ring.Full(ring.stage)));
      }
      break;
    }
    const auto tile = tile_of(i);
    int coord[kRowsPerThread];  // x's row (>= 0) or ~recv's row
    if (kRows) {
#pragma unroll
      for (int q = 0; q < kRowsPerThread; ++q) {
        const int r = rt + q * kRowThreads;
        const int row = tile.a_row + (r < tile.rows ? r : 0);
        const int s = src[row];
        coord[q] = s >= 0 ? s : ~row;
      }
    }
    const TileCoords coords = TileCoords::Of(tile);
    ForEachKStep(ring, K, [&](int kt, int s, uint32_t fb) {
      if (tma) IssueB(ring, b_map, coords, i, kt, kStageBytes);
      if (kRows) {
        const uint32_t a = SmemAddr(ring.A(s));
#pragma unroll
        for (int q = 0; q < kRowsPerThread; ++q) {
          const int c = coord[q];
          TmaLoad2D(a + (rt + q * kRowThreads) * kRowBytes, c >= 0 ? &x_map : &recv_map, fb, kt * kBK, c >= 0 ? c : ~c);
        }
      }
    });
  }
}

// The loop with A by one-row TMA boxes (ProduceRows): the kRowWarps last producer warps issue the rows, thread 0 B;
// the full barrier expects thread 0's arrival alone.
template <int kRowWarps, class TileFn>
__device__ __forceinline__ void RowTmaLoop(const CUtensorMap& b_map, const CUtensorMap& x_map,
                                           const CUtensorMap& recv_map, const int* src, int K, int count,
                                           TileFn tile_of, char* smem) {
  static_assert(kRowWarps >= 1 && kRowWarps <= 4, "row warps are producer warps");
  constexpr int kRowThreads = 32 * kRowWarps, kFirstRowWarp = 4 - kRowWarps;
  SpecializedLoop<false>(K, 1, tile_of, smem, [&](auto& ring, int warp, int tid) {
    const int rt = tid - 32 * kFirstRowWarp;
    if (kFirstRowWarp == 0) {
      ProduceRows<true, true, kRowThreads>(ring, b_map, x_map, recv_map, src, K, count, tile_of, rt);
    } else if (tid == 0) {
      ProduceRows<true, false, kRowThreads>(ring, b_map, x_map, recv_map, src, K, count, tile_of, rt);
    } else if (warp >= kFirstRowWarp) {
      ProduceRows<false, true, kRowThreads>(ring, b_map, x_map, recv_map, src, K, count, tile_of, rt);
    }
  });
}

// The kernels' common start: the group tables (GroupedGemmBody's) in shared memory past the loop's ring, the padding
// rows of out zeroed, then loop(tile_of, tile count) with tile_of decoding a tile index as WgmmaGroupedGemm does.
template <class Loop>
__device__ __forceinline__ void OverGroupTiles(const int32_t* group_sizes, int G, int M, int N, void* out, char* smem,
                                               Loop loop) {
  int* row_start = reinterpret_cast<int*>(smem + LoopSmemBytes<kStages>());  // G + 1
  int* tile_start = row_start + (kMaxGroups + 1);                              // G + 1
  const int n_tiles = (N + kBN - 1) / kBN;
  BuildGroupTables(group_sizes, G, M, n_tiles, row_start, tile_start);
  ZeroPadRows(out, row_start[G], M, N, kElemBytes);
  // n_tiles recomputed from the parameter N at each call (the volatile asm keeps it from being hoisted): a value kept
  // from here would stay live through the producer threads' 24 registers.
  auto tile_of = [&](int t) {
    int n;
    asm volatile("mov.b32 %0, %1;" : "=r"(n) : "r"(N));
    return DecodeTile(t, row_start, tile_start, G, (n + kBN - 1) / kBN, N, out, false);
  };
  loop(tile_of, tile_start[G]);
}

// out [M, N] bf16 = rows of (x | recv) per src @ rhs [G, K, N], grouped as WgmmaGroupedGemm (same tile schedule over
// a grid of the same size: the same tiles in the same CTAs).
template <int kGatherWarps, bool kProxyFence>
__global__ void __launch_bounds__(kThreads, 1)
    GatherGemmKernel(const __grid_constant__ CUtensorMap tm_b, const __nv_bfloat16* __restrict__ x,
                     const __nv_bfloat16* __restrict__ recv, const int* __restrict__ src,
                     const int32_t* __restrict__ group_sizes, int G, int M, int N, int K, void* __restrict__ out) {
  extern __shared__ __align__(1024) char smem_raw[];
  uint64_t* table = reinterpret_cast<uint64_t*>(smem_raw + kTableOffset);
  OverGroupTiles(group_sizes, G, M, N, out, smem_raw, [&](auto tile_of, int count) {
    GatherLoop<kGatherWarps, kProxyFence>(tm_b, x, recv, src, K, count, tile_of, table, smem_raw);
  });
}

// The same GEMM with A by one-row TMA boxes from x_map / recv_map ({64, 1} boxes, 128B swizzle) per src.
template <int kRowWarps>
__global__ void __launch_bounds__(kThreads, 1)
    RowTmaGemmKernel(const __grid_constant__ CUtensorMap tm_b, const __grid_constant__ CUtensorMap tm_x,
                     const __grid_constant__ CUtensorMap tm_recv, const int* __restrict__ src,
                     const int32_t* __restrict__ group_sizes, int G, int M, int N, int K, void* __restrict__ out) {
  extern __shared__ __align__(1024) char smem_raw[];
  OverGroupTiles(group_sizes, G, M, N, out, smem_raw, [&](auto tile_of, int count) {
    RowTmaLoop<kRowWarps>(tm_b, tm_x, tm_recv, src, K, count, tile_of, smem_raw);
  });
}

}  // namespace gather

// x[src[r]] = recv[r] for the rows read from x (src[r] >= 0), whose rows of recv_part stay NaN; recv_part[r] = recv[r]
// for the others. x and recv_part come in poisoned (0xFF bytes).
__global__ void SplitRowsKernel(const __nv_bfloat16* recv, const int* src, int64_t rows, int K, __nv_bfloat16* x,
                                __nv_bfloat16* recv_part) {
  const int64_t chunks = (int64_t)K / 8;  // 16-byte chunks per row
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows * chunks;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / chunks, j = i % chunks;
    const int s = src[r];
    const uint4 v = reinterpret_cast<const uint4*>(recv + r * K)[j];
    reinterpret_cast<uint4*>(s >= 0 ? x + (int64_t)s * K : recv_part + r * K)[j] = v;
  }
}

// src of a source layout: all-x: a random permutation of [0, M); half-x: the same, but -1 (recv) for the second half
// of each group's rows and for the padding rows.
static std::vector<int> MakeSrc(const std::vector<int>& row_start, int64_t M, bool half, uint64_t seed) {
  std::vector<int> perm(M);
  for (int64_t r = 0; r < M; ++r) perm[r] = (int)r;
  std::mt19937_64 rng(seed);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int> src(M, -1);
  const int G = (int)row_start.size() - 1;
  for (int g = 0; g < G; ++g) {
    const int lo = row_start[g], hi = row_start[g + 1];
    const int own_hi = half ? lo + (hi - lo + 1) / 2 : hi;
    for (int r = lo; r < own_hi; ++r) src[r] = perm[r];
  }
  return src;
}

// A variant of A's loads: cp.async gathers (GatherGemmKernel: kGatherWarps = warps, kProxyFence = fence) or one-row TMA
// boxes (rows: RowTmaGemmKernel, kRowWarps = warps). Name: the warps that load A, "first-3", then "no fence" without
// the fence, or "tma rows" before them.
struct GatherVariant {
  int warps;
  bool fence;
  bool rows = false;
  std::string Name() const {
    return (rows ? "tma rows " : "") + std::to_string(4 - warps) + "-3" + (fence || rows ? "" : " no fence");
  }
};

int main(int argc, char** argv) {
  // --rows-only: the TMA A and the one-row TMA variants alone (this probe's own flag; the rest are ParseProbeArgs's).
  bool rows_only = false;
  std::vector<char*> rest = {argv[0]};
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--rows-only")) rows_only = true;
    else rest.push_back(argv[i]);
  }
  const ProbeArgs args = ParseProbeArgs((int)rest.size(), rest.data());
  const int num_sms = ProbeDevice(gather::kSmemBytes);
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  const std::vector<Case> cases = {
      {"small_M300_K128_N256_G3", 300, 128, 256, {0, 130, 170}, true},
      {"small_M700_K192_N512_G4", 700, 192, 512, {200, 63, 0, 410}, true},
      {"M16384_K2048_N4096_G4_balanced", 16384, 2048, 4096, Balanced(16384, 4), false},
      {"M16384_K2048_N4096_G4_skew40", 16384, 2048, 4096, Skewed(16384, 4, 1, 0.4), false},
      {"M16384_K2048_N4096_G16_random_pad90", 16384, 2048, 4096, RandomSizes(16384, 16, 11, 0.9), false},
  };
  struct Row {
    std::string name;
    const char* layout;
    GatherVariant v;
    float tma_ms, gather_ms;
    double flops;
  };
  std::vector<Row> table;

  int failures = 0;
  for (const Case& c : cases) {
    if (args.small_only && !c.small) continue;
    const CaseShape shape(c);
    const int64_t M = shape.M, K = shape.K, N = shape.N, G = shape.G, total_rows = shape.total_rows;
    const std::vector<int>& row_start = shape.row_start;
    const double flops = shape.flops;
    const int64_t out_bytes = M * N * 2;  // bf16 out

    __nv_bfloat16 *recv, *x, *recv_part, *rhs;
    float* ref;
    void *out_tma, *out;
    int32_t* d_sizes;
    int *d_row_start, *d_src;
    CmpResult* d_res;
    unsigned long long* d_diff;
    CK(cudaMalloc(&recv, M * K * 2));
    CK(cudaMalloc(&x, M * K * 2));
    CK(cudaMalloc(&recv_part, M * K * 2));
    CK(cudaMalloc(&rhs, G * K * N * 2));
    CK(cudaMalloc(&ref, M * N * 4));
    CK(cudaMalloc(&out_tma, out_bytes));
    CK(cudaMalloc(&out, out_bytes));
    CK(cudaMalloc(&d_sizes, G * 4));
    CK(cudaMalloc(&d_row_start, (G + 1) * 4));
    CK(cudaMalloc(&d_src, M * 4));
    CK(cudaMalloc(&d_res, sizeof(CmpResult)));
    CK(cudaMalloc(&d_diff, sizeof(unsigned long long)));
    CK(cudaMemcpyAsync(d_sizes, c.sizes.data(), G * 4, cudaMemcpyHostToDevice, stream));
    CK(cudaMemcpyAsync(d_row_start, row_start.data(), (G + 1) * 4, cudaMemcpyHostToDevice, stream));
    FillKernel<<<1024, 256, 0, stream>>>(recv, M * K, 1);
    FillKernel<<<1024, 256, 0, stream>>>(rhs, G * K * N, 2);
    CK(cudaGetLastError());
    RefKernel<<<dim3((N + 31) / 32, (M + 7) / 8), dim3(32, 8), 0, stream>>>(recv, rhs, d_row_start, (int)G, (int)M,
                                                                              (int)K, (int)N, ref);
    CK(cudaGetLastError());
    WaitOrDie(stream, c.name + " (reference)");

    CUtensorMap ta, tb;  // ta (A over recv) is the TMA path's; the gathered kernel takes tb alone
    CK(wgmma_gemm::EncodeGemmMaps(recv, M, K, rhs, G, N, /*b_k_major=*/false, &ta, &tb));
    // One-row boxes over x and recv_part ([M, K] each), for the row-TMA variants.
    CUtensorMap tx_rows, trecv_rows;
    {
      const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)M};
      const cuuint64_t strides[1] = {(cuuint64_t)K * 2};
      const cuuint32_t box[2] = {64, 1};
      if (!wgmma_gemm::EncodeMap(&tx_rows, x, 2, dims, strides, box, "x rows") ||
          !wgmma_gemm::EncodeMap(&trecv_rows, recv_part, 2, dims, strides, box, "recv rows")) {
        printf("case %s FAIL: the one-row tensor maps\n", c.name.c_str());
        exit(2);
      }
    }

    // One variant: the checked call (out poisoned, compared with the reference), then `after` on its result, then
    // (with timing) 3 warm-ups and the median of 20 launches.
    auto check = [&](auto call, auto after, const std::string& what, float* ms) {
      const CmpSummary cmp = CheckGroupedCall(call, out, ref, total_rows, M, N, false, d_res, stream, what);
      after();
      *ms = 0.f;
      if (args.timing && !c.small) {
        for (int i = 0; i < 3; ++i) call();
        WaitOrDie(stream, what + " (warm-up)");
        *ms = MedianLaunchMs(stream, 20, call, [](int) {});
      }
      return cmp;
    };
    auto report = [&](const std::string& what, const CmpSummary& cmp, bool pass, const char* extra, float ms) {
      printf("case %-44s %s err=%.3e (max_err=%.3e max_ref=%.3e nonfinite=%llu badpad=%llu)%s us=%.1f TFLOP/s=%.1f\n",
             what.c_str(), pass ? "PASS" : "FAIL", cmp.rel, cmp.max_err, cmp.max_ref, cmp.res.bad_values,
             cmp.res.bad_zero, extra, ms * 1e3, Tflops(flops, ms));
      fflush(stdout);
    };

    // TMA A: the library's grouped GEMM over recv.
    float tma_ms = 0.f;
    {
      const std::string what = c.name + " A=tma";
      auto call = [&]() {
        const cudaError_t e = WgmmaGroupedGemm(recv, M, K, rhs, G, N, false, d_sizes, out, false, num_sms, stream);
        if (e != cudaSuccess) {
          printf("case %s FAIL launch error: %s\n", what.c_str(), cudaGetErrorString(e));
          exit(2);
        }
      };
      // Its checked result is what the gathered results are held to.
      auto keep = [&]() { CK(cudaMemcpyAsync(out_tma, out, out_bytes, cudaMemcpyDeviceToDevice, stream)); };
      const CmpSummary cmp = check(call, keep, what, &tma_ms);
      failures += !cmp.ok;
      report(what, cmp, cmp.ok, "", tma_ms);
    }

    for (const bool half : {false, true}) {
      const char* layout = half ? "half-x" : "all-x";
      const std::vector<int> src = MakeSrc(row_start, M, half, 3 + half);
      CK(cudaMemcpyAsync(d_src, src.data(), M * 4, cudaMemcpyHostToDevice, stream));
      CK(cudaMemsetAsync(x, 0xFF, M * K * 2, stream));
      CK(cudaMemsetAsync(recv_part, 0xFF, M * K * 2, stream));
      SplitRowsKernel<<<1024, 256, 0, stream>>>(recv, d_src, M, (int)K, x, recv_part);
      CK(cudaGetLastError());
      WaitOrDie(stream, c.name + " (split rows)");

      // Gather warps 2-3 (the warps dispatch_gemm's producer warpgroup has free beside the TMA thread and the
      // look-ahead warp), 1-3, 0-3 (thread 0 gathers too); and 2-3 without the consumers' proxy fence.
      // One-row TMA boxes from warps 2-3 (two rows per thread) and 0-3 (one row per thread, thread 0 B too).
      std::vector<GatherVariant> variants = {GatherVariant{2, false, true}, GatherVariant{4, false, true}};
      if (!rows_only)
        variants.insert(variants.end(), {GatherVariant{2, true}, GatherVariant{3, true}, GatherVariant{4, true},
                                         GatherVariant{2, false}});
      for (const GatherVariant v : variants) {
        const std::string what = c.name + " A=gather src=" + layout + " warps=" + v.Name();
        auto call = [&]() {
          cudaError_t e;
          if (v.rows) {
            auto kernel = v.warps == 2 ? gather::RowTmaGemmKernel<2> : gather::RowTmaGemmKernel<4>;
            e = wgmma_gemm::LaunchWgmmaKernel(kernel, num_sms, gather::kSmemBytes, stream, tb, tx_rows, trecv_rows,
                                              (const int*)d_src, d_sizes, (int)G, (int)M, (int)N, (int)K, out);
          } else {
            auto kernel = !v.fence       ? gather::GatherGemmKernel<2, false>
                          : v.warps == 2 ? gather::GatherGemmKernel<2, true>
                          : v.warps == 3 ? gather::GatherGemmKernel<3, true>
                                         : gather::GatherGemmKernel<4, true>;
            e = wgmma_gemm::LaunchWgmmaKernel(kernel, num_sms, gather::kSmemBytes, stream, tb, x, recv_part, d_src,
                                              d_sizes, (int)G, (int)M, (int)N, (int)K, out);
          }
          if (e != cudaSuccess) {
            printf("case %s FAIL launch error: %s\n", what.c_str(), cudaGetErrorString(e));
            exit(2);
          }
        };
        // The checked result against the TMA one, bit for bit.
        unsigned long long diff = 0;
        auto bitwise = [&]() {
          CK(cudaMemsetAsync(d_diff, 0, sizeof(diff), stream));
          DiffWordsKernel<<<1024, 256, 0, stream>>>(static_cast<const uint32_t*>(out_tma),
                                                    static_cast<const uint32_t*>(out), out_bytes / 4, d_diff);
          CK(cudaGetLastError());
          CK(cudaMemcpyAsync(&diff, d_diff, sizeof(diff), cudaMemcpyDeviceToHost, stream));
          WaitOrDie(stream, what + " (bitwise)");
        };
        float ms = 0.f;
        const CmpSummary cmp = check(call, bitwise, what, &ms);
        const bool pass = cmp.ok && diff == 0;
        failures += !pass;
        char extra[64];
        snprintf(extra, sizeof(extra), " words_differing_from_tma=%llu", diff);
        report(what, cmp, pass, extra, ms);
        if (ms > 0) table.push_back({c.name, layout, v, tma_ms, ms, flops});
      }
    }
    FreeAll(recv, x, recv_part, rhs, ref, out_tma, out, d_sizes, d_row_start, d_src, d_res, d_diff);
  }

  if (!table.empty()) {
    printf("\nmedian of 20 launches each; ratio = gathered A / TMA A\n");
    printf("%-36s %-7s %-13s %10s %13s %7s %12s %15s\n", "case", "src", "gather warps", "TMA A us", "gathered A us",
           "ratio", "TMA TFLOP/s", "gather TFLOP/s");
    for (const Row& r : table)
      printf("%-36s %-7s %-13s %10.1f %13.1f %7.3f %12.1f %15.1f\n", r.name.c_str(), r.layout,
             r.v.Name().c_str(), r.tma_ms * 1e3, r.gather_ms * 1e3,
             r.tma_ms > 0 ? r.gather_ms / r.tma_ms : 0.0, Tflops(r.flops, r.tma_ms), Tflops(r.flops, r.gather_ms));
  }
  printf("%s: %d failing variant(s)\n", failures ? "FAILED" : "ALL PASS", failures);
  return failures ? 1 : 0;
}
