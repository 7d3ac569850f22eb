// Hopper (sm_90a) bf16 grouped GEMM: wgmma.mma_async + TMA + mbarriers, warp-specialized, persistent.
//
//   out[r, :] = lhs[r, :] @ rhs[g(r)]      for rows r of group g (groups: consecutive row ranges from row 0)
//   out[r, :] = 0                          for rows r >= min(sum(group_sizes), M)
//
// lhs [M, K] bf16 row-major; rhs [G, K, N] (rhs_k_major = false) or [G, N, K] (rhs_k_major = true) bf16;
// group_sizes [G] int32 in device memory (read by the kernel, no host sync); out [M, N] bf16 or f32.
// Requires: K % 64 == 0, N % 64 == 0, 16-byte aligned pointers (256 assumed), 1 <= G <= 1024, M < 2^31.
// The caller falls back to another path otherwise (WgmmaGroupedGemm returns cudaErrorInvalidValue).
//
// Design (see README.md):
//   CTA tile 128 x 256 (BM x BN), BK = 64, kStages = 4 smem stages of (A 16 KB + B 32 KB).
//   384 threads = 3 warpgroups. WG0 = producer (one thread issues TMA), WG1/WG2 = consumers: each owns 64
//   rows of the tile and issues wgmma m64n256k16 (128 fp32 accumulators per thread).
//   setmaxnreg: producer 24, consumers 240 (24*128 + 240*256 = 64512 <= 65536).
//   Both operands land in smem in the TMA 128B-swizzle layout; the wgmma descriptors use swizzle mode 1 (128B).
//   Persistent grid (one CTA per SM), static round-robin over tiles; tile order is group-major, then bands of
//   kBandM m-tiles, n-tile-major inside a band (L2 reuse of both A rows and B columns).
#pragma once

#include <cuda.h>  // CUtensorMap and enums only: the driver function comes via cudaGetDriverEntryPointByVersion
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

namespace wgmma_gemm {

constexpr int kBM = 128;
constexpr int kBN = 256;
constexpr int kBK = 64;  // 64 bf16 = 128 bytes = one 128B swizzle row
constexpr int kStages = 4;
constexpr int kBandM = 8;  // m-tiles per raster band
constexpr int kThreads = 384;
constexpr int kMaxGroups = 1024;
constexpr int kABytes = kBM * kBK * 2;  // 16384
constexpr int kBBytes = kBN * kBK * 2;  // 32768
constexpr int kStageBytes = kABytes + kBBytes;
// Dynamic smem: 1 KB alignment slack + stages + 2*kStages mbarriers + two int tables of kMaxGroups + 1.
constexpr int kSmemBytes = 1024 + kStages * kStageBytes + 2 * kStages * 8 + 2 * (kMaxGroups + 1) * 4;

// ------------------------------------------------------------------------------------------------------------
// PTX wrappers
// ------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t SmemAddr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Producer: arm the barrier's transaction count for this phase (one arrival of the count-1 barrier).
__device__ __forceinline__ void MbarArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Spin until the phase with parity `parity` of the barrier has completed. A fresh barrier is in phase 0, so
// waiting on parity 1 returns at once (the "previous" phase counts as complete): that is how the producer's
// first pass over the empty barriers goes through.
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void TmaLoad2D(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void TmaLoad3D(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                          int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void PrefetchTensorMap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// The accumulators are "+f" operands of the wgmma asm, but the compiler must also not move them across the
// wait: this no-op asm ties each register to a point after the wait_group.
__device__ __forceinline__ void FenceRegs(float* d) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

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

// D[64 x 256] (+)= A[64 x 16] * B[16 x 256], both from smem. imm-trans-b = kTransB: 0 = B K-major, 1 = B
// MN-major (legal for 16-bit types). scale_d = 0 ignores (zeroes) the old accumulator.
template <int kTransB>
__device__ __forceinline__ void Wgmma64x256(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, %128, %129, p, 1, 1, 0, %131;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB));
}

// ------------------------------------------------------------------------------------------------------------
// Tile schedule (identical in every thread of every CTA: derived from the smem tables)
// ------------------------------------------------------------------------------------------------------------
struct Tile {
  int g;     // group (rhs slice)
  int row0;  // first lhs/out row of the tile
  int rows;  // valid rows of the tile (1..kBM): rows past it belong to the next group or to padding
  int n0;    // first column
};

// row_start[0..G]: clamped group row offsets (row_start[G] = min(sum, M)); tile_start[0..G]: tile offsets.
__device__ __forceinline__ Tile DecodeTile(int t, const int* row_start, const int* tile_start, int G, int n_tiles) {
  int lo = 0, hi = G - 1;  // largest g with tile_start[g] <= t (then tile_start[g + 1] > t: the group is non-empty)
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tile_start[mid] <= t) lo = mid; else hi = mid - 1;
  }
  const int g = lo;
  const int rows_g = row_start[g + 1] - row_start[g];
  const int mt_g = (rows_g + kBM - 1) / kBM;
  const int local = t - tile_start[g];
  const int band = local / (kBandM * n_tiles);
  const int band_mt = min(kBandM, mt_g - band * kBandM);
  const int r = local - band * kBandM * n_tiles;
  const int nt = r / band_mt;
  const int mt = band * kBandM + r % band_mt;
  Tile tile;
  tile.g = g;
  tile.row0 = row_start[g] + mt * kBM;
  tile.rows = min(kBM, rows_g - mt * kBM);
  tile.n0 = nt * kBN;
  return tile;
}

// ------------------------------------------------------------------------------------------------------------
// Kernel
// ------------------------------------------------------------------------------------------------------------
// tm_a: lhs as 2D (K, M), box (64, 128), 128B swizzle -> smem A stage = 128 rows x 128 B, K-major.
// tm_b, kTransB == 0 (rhs [G, N, K]): 3D (K, N, G), box (64, 256, 1) -> 256 rows (n) x 128 B, K-major.
// tm_b, kTransB == 1 (rhs [G, K, N]): 3D (N, K, G), box (64, 64, 1), loaded 4 times (n0 + 64 j) -> 4 chunks of
//   8 KB, each 64 rows (k) x 128 B (64 n), MN-major.
template <int kTransB, bool kOutF32>
__global__ void __launch_bounds__(kThreads, 1)
    GroupedGemmKernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                      const int32_t* __restrict__ group_sizes, int G, int M, int N, int K, void* __restrict__ out) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // 128B swizzle atoms must start 1024-aligned (the descriptor base offset field is left 0).
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~(uintptr_t)1023);
  unsigned char* sA = smem;                                 // kStages x kABytes
  unsigned char* sB = smem + kStages * kABytes;             // kStages x kBBytes
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  int* row_start = reinterpret_cast<int*>(empty + kStages);  // G + 1
  int* tile_start = row_start + (kMaxGroups + 1);            // G + 1

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int n_tiles = (N + kBN - 1) / kBN;

  // ---- group tables: row_start[g] = min(sum_{h<g} size_h, M); tile_start = prefix of ceil(rows/128)*n_tiles.
  for (int g = tid; g < G; g += kThreads) row_start[g] = max(0, group_sizes[g]);
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      MbarInit(SmemAddr(&full[s]), 1);   // one arrive.expect_tx by the producer; the TMA bytes complete it
      MbarInit(SmemAddr(&empty[s]), 8);  // one arrive per consumer warp (2 warpgroups x 4 warps)
    }
    // Make the initialized barriers visible to the async proxy (TMA complete_tx) and to the other threads.
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();
  if (warp == 0) {
    long long rows_carry = 0, tiles_carry = 0;
    for (int base = 0; base < G; base += 32) {
      const int g = base + lane;
      const long long v = g < G ? row_start[g] : 0;
      long long incl = v;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const long long y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
      }
      const long long beg = rows_carry + incl - v, end = rows_carry + incl;
      const long long beg_c = beg < M ? beg : M, end_c = end < M ? end : M;
      const long long t = ((end_c - beg_c + kBM - 1) / kBM) * n_tiles;
      long long tincl = t;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const long long y = __shfl_up_sync(0xffffffffu, tincl, o);
        if (lane >= o) tincl += y;
      }
      __syncwarp();  // every lane has read its size before anyone overwrites row_start
      if (g < G) {
        row_start[g] = (int)beg_c;
        tile_start[g] = (int)(tiles_carry + tincl - t);
      }
      rows_carry = __shfl_sync(0xffffffffu, end, 31);
      tiles_carry += __shfl_sync(0xffffffffu, tincl, 31);
    }
    if (lane == 0) {
      row_start[G] = (int)(rows_carry < M ? rows_carry : M);
      tile_start[G] = (int)tiles_carry;
    }
  }
  __syncthreads();
  const int total_tiles = tile_start[G];
  const int ktiles = K / kBK;

  if (warp < 4) {
    // ================= producer warpgroup =================
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (tid == 0) {
      PrefetchTensorMap(&tm_a);
      PrefetchTensorMap(&tm_b);
      int stage = 0;
      uint32_t phase = 0;
      for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
        const Tile tile = DecodeTile(t, row_start, tile_start, G, n_tiles);
        for (int kt = 0; kt < ktiles; ++kt) {
          const uint32_t fb = SmemAddr(&full[stage]);
          MbarWait(SmemAddr(&empty[stage]), phase ^ 1);  // consumers released this slot (first pass: free)
          MbarArriveExpectTx(fb, kStageBytes);           // OOB parts of a box are zero-filled and still counted
          const uint32_t a_dst = SmemAddr(sA + stage * kABytes);
          const uint32_t b_dst = SmemAddr(sB + stage * kBBytes);
          TmaLoad2D(a_dst, &tm_a, fb, kt * kBK, tile.row0);
          if (kTransB) {
#pragma unroll
            for (int j = 0; j < kBN / 64; ++j) TmaLoad3D(b_dst + j * 8192, &tm_b, fb, tile.n0 + 64 * j, kt * kBK, tile.g);
          } else {
            TmaLoad3D(b_dst, &tm_b, fb, kt * kBK, tile.n0, tile.g);
          }
          if (++stage == kStages) { stage = 0; phase ^= 1; }
        }
      }
    }
  } else {
    // ================= consumer warpgroups =================
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
    const int c = warp / 4 - 1;        // consumer index: rows [64 c, 64 c + 64) of the tile
    const int wq = warp % 4;           // warp within the warpgroup: rows 16 wq .. 16 wq + 15 of its 64
    const int ctid = tid - 128;        // 0..255

    // Padding rows [min(sum, M), M) -> 0, striped over all consumer threads of the grid (16-byte stores).
    {
      const int64_t esize = kOutF32 ? 4 : 2;
      const int64_t pad_begin = row_start[G];
      const int64_t chunks = (int64_t)(M - pad_begin) * N * esize / 16;
      int4* base = reinterpret_cast<int4*>(reinterpret_cast<unsigned char*>(out) + pad_begin * N * esize);
      for (int64_t i = (int64_t)blockIdx.x * 256 + ctid; i < chunks; i += (int64_t)gridDim.x * 256)
        base[i] = make_int4(0, 0, 0, 0);
    }

    float acc[128];
    int stage = 0;
    uint32_t phase = 0;
    // The B descriptor steps along K by 16 elements per wgmma:
    //   K-major (128B rows of K): +32 bytes inside the swizzled row (the hardware applies the XOR on the
    //     final address, so advancing the start address by 32 B selects the next 16 k), SBO = 1024 (8 rows).
    //   MN-major: +16 k-rows of 128 B = 2048 bytes; LBO = 8192 (next 64-column chunk), SBO = 1024 (next 8 k).
    const uint32_t b_lbo = kTransB ? 8192 : 16;
    const uint32_t b_kstep = kTransB ? 2048 : 32;
    for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
      const Tile tile = DecodeTile(t, row_start, tile_start, G, n_tiles);
      // A group's last m-tile may have <= 64 valid rows: then consumer 1 has no valid row and skips the MMAs
      // (warpgroup-uniform), but it still waits on every full barrier and arrives on every empty barrier so that
      // the barrier phases stay in step.
      if (c * 64 >= tile.rows) {
        for (int kt = 0; kt < ktiles; ++kt) {
          MbarWait(SmemAddr(&full[stage]), phase);
          __syncwarp();
          if (lane == 0) MbarArrive(SmemAddr(&empty[stage]));
          if (++stage == kStages) { stage = 0; phase ^= 1; }
        }
        continue;
      }
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.f;
      int prev_stage = -1;
      for (int kt = 0; kt < ktiles; ++kt) {
        MbarWait(SmemAddr(&full[stage]), phase);
        const uint32_t a_base = SmemAddr(sA + stage * kABytes) + c * (64 * 128);  // this WG's 64 rows
        const uint32_t b_base = SmemAddr(sB + stage * kBBytes);
        FenceRegs(acc);
        WgmmaFence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          const uint64_t da = MakeDesc(a_base + kk * 32, 16, 1024);
          const uint64_t db = MakeDesc(b_base + kk * b_kstep, b_lbo, 1024);
          Wgmma64x256<kTransB>(acc, da, db, 1);
        }
        WgmmaCommit();
        // Keep this k-step's group in flight; the previous one is done -> release its slot.
        WgmmaWait<1>();
        FenceRegs(acc);
        if (prev_stage >= 0 && lane == 0) MbarArrive(SmemAddr(&empty[prev_stage]));
        prev_stage = stage;
        if (++stage == kStages) { stage = 0; phase ^= 1; }
      }
      WgmmaWait<0>();
      FenceRegs(acc);
      if (prev_stage >= 0 && lane == 0) MbarArrive(SmemAddr(&empty[prev_stage]));

      // ---- epilogue: m64nNk16 f32 accumulator layout. Thread (warp wq, lane l) holds, for j = 0..31:
      //   acc[4j + 0/1] -> row 16 wq + l/4,     cols 8 j + 2 (l%4) + 0/1
      //   acc[4j + 2/3] -> row 16 wq + l/4 + 8, same cols
      // Lanes l and l^1 swap one pair per (j, j+1) so that each lane stores 4 consecutive columns: the even lane
      // cols 8 j + 2 (l%4) .. +3, the odd lane cols 8 (j+1) + 2 (l%4 - 1) .. +3. A warp store then covers 32
      // (bf16) or 64 (f32) contiguous bytes per row. N % 64 == 0, so blocks j and j+1 are both in or both out.
      const int r_lo = c * 64 + wq * 16 + lane / 4;
      const bool odd = lane & 1;
      const int col_even = tile.n0 + 2 * (lane % 4);       // for even lanes, block j
      const int col_odd = tile.n0 + 8 + 2 * (lane % 4 - 1);  // for odd lanes, block j + 1
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r_lo + 8 * h;
        const bool row_ok = r < tile.rows;
        const int64_t orow = (int64_t)(tile.row0 + (row_ok ? r : 0)) * N;
#pragma unroll
        for (int j = 0; j < 32; j += 2) {
          const float* a0 = &acc[4 * j + 2 * h];        // block j, this row
          const float* a1 = &acc[4 * (j + 1) + 2 * h];  // block j + 1, this row
          const int col = (odd ? col_odd : col_even) + 8 * j;
          if (kOutF32) {
            const float s0 = odd ? a0[0] : a1[0], s1 = odd ? a0[1] : a1[1];
            const float r0 = __shfl_xor_sync(0xffffffffu, s0, 1), r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
            const float4 v = odd ? make_float4(r0, r1, a1[0], a1[1]) : make_float4(a0[0], a0[1], r0, r1);
            if (row_ok && col < N) *reinterpret_cast<float4*>(reinterpret_cast<float*>(out) + orow + col) = v;
          } else {
            __nv_bfloat162 p0 = __floats2bfloat162_rn(a0[0], a0[1]), p1 = __floats2bfloat162_rn(a1[0], a1[1]);
            const uint32_t u0 = *reinterpret_cast<uint32_t*>(&p0), u1 = *reinterpret_cast<uint32_t*>(&p1);
            const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? u0 : u1, 1);
            const uint2 v = odd ? make_uint2(got, u1) : make_uint2(u0, got);
            if (row_ok && col < N)
              *reinterpret_cast<uint2*>(reinterpret_cast<__nv_bfloat16*>(out) + orow + col) = v;
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------------------
inline PFN_cuTensorMapEncodeTiled_v12000 GetEncodeTiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (!fn) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !p) {
      fprintf(stderr, "WgmmaGroupedGemm: cannot get cuTensorMapEncodeTiled (%s, query result %d)\n",
              cudaGetErrorString(e), (int)q);
      return nullptr;
    }
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }
  return fn;
}

// dims/strides innermost first; strides[i] is the byte stride of dim i + 1.
inline bool EncodeMap(CUtensorMap* map, const void* ptr, int rank, const cuuint64_t* dims, const cuuint64_t* strides,
                      const cuuint32_t* box, const char* what) {
  PFN_cuTensorMapEncodeTiled_v12000 enc = GetEncodeTiled();
  if (!enc) return false;
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = enc(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)rank, const_cast<void*>(ptr), dims, strides,
                         box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                         CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE /* zeros */);
  if (r != CUDA_SUCCESS) {
    fprintf(stderr, "WgmmaGroupedGemm: cuTensorMapEncodeTiled(%s) failed with CUresult %d\n", what, (int)r);
    return false;
  }
  return true;
}

template <int kTransB, bool kOutF32>
inline cudaError_t LaunchOne(const CUtensorMap& ta, const CUtensorMap& tb, const int32_t* gs, int G, int M, int N,
                             int K, void* out, int grid, cudaStream_t stream) {
  static bool attr_done = false;  // per instantiation; set once per process (single device assumed)
  auto kernel = GroupedGemmKernel<kTransB, kOutF32>;
  if (!attr_done) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (e != cudaSuccess) {
      fprintf(stderr, "WgmmaGroupedGemm: cudaFuncSetAttribute(%d bytes smem) failed: %s\n", kSmemBytes,
              cudaGetErrorString(e));
      return e;
    }
    attr_done = true;
  }
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(ta, tb, gs, G, M, N, K, out);
  return cudaGetLastError();
}

}  // namespace wgmma_gemm

// Host launch. Returns cudaErrorInvalidValue (and prints why) for unsupported shapes, so the caller can fall back.
inline cudaError_t WgmmaGroupedGemm(const __nv_bfloat16* lhs, int64_t M, int64_t K, const __nv_bfloat16* rhs,
                                    int64_t G, int64_t N, bool rhs_k_major, const int32_t* group_sizes_dev,
                                    void* out, bool out_f32, int num_sms, cudaStream_t stream) {
  using namespace wgmma_gemm;
  if (M <= 0 || K <= 0 || N <= 0 || K % kBK != 0 || N % 64 != 0 || G < 1 || G > kMaxGroups ||
      M > 0x7fffffff - kBM || K > 0x7fffffff || N > 0x7fffffff ||
      (reinterpret_cast<uintptr_t>(lhs) | reinterpret_cast<uintptr_t>(rhs) | reinterpret_cast<uintptr_t>(out)) % 16 ||
      num_sms <= 0) {
    fprintf(stderr, "WgmmaGroupedGemm: unsupported shape/alignment M=%lld K=%lld N=%lld G=%lld num_sms=%d\n",
            (long long)M, (long long)K, (long long)N, (long long)G, num_sms);
    return cudaErrorInvalidValue;
  }
  CUtensorMap ta, tb;
  {
    const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)M};
    const cuuint64_t strides[1] = {(cuuint64_t)K * 2};
    const cuuint32_t box[2] = {kBK, kBM};
    if (!EncodeMap(&ta, lhs, 2, dims, strides, box, "lhs")) return cudaErrorInvalidValue;
  }
  if (rhs_k_major) {  // [G, N, K]
    const cuuint64_t dims[3] = {(cuuint64_t)K, (cuuint64_t)N, (cuuint64_t)G};
    const cuuint64_t strides[2] = {(cuuint64_t)K * 2, (cuuint64_t)N * K * 2};
    const cuuint32_t box[3] = {kBK, kBN, 1};
    if (!EncodeMap(&tb, rhs, 3, dims, strides, box, "rhs [G,N,K]")) return cudaErrorInvalidValue;
  } else {  // [G, K, N]
    const cuuint64_t dims[3] = {(cuuint64_t)N, (cuuint64_t)K, (cuuint64_t)G};
    const cuuint64_t strides[2] = {(cuuint64_t)N * 2, (cuuint64_t)K * N * 2};
    const cuuint32_t box[3] = {64, kBK, 1};
    if (!EncodeMap(&tb, rhs, 3, dims, strides, box, "rhs [G,K,N]")) return cudaErrorInvalidValue;
  }
  const int g = (int)G, m = (int)M, n = (int)N, k = (int)K;
  if (rhs_k_major) {
    return out_f32 ? LaunchOne<0, true>(ta, tb, group_sizes_dev, g, m, n, k, out, num_sms, stream)
                   : LaunchOne<0, false>(ta, tb, group_sizes_dev, g, m, n, k, out, num_sms, stream);
  }
  return out_f32 ? LaunchOne<1, true>(ta, tb, group_sizes_dev, g, m, n, k, out, num_sms, stream)
                 : LaunchOne<1, false>(ta, tb, group_sizes_dev, g, m, n, k, out, num_sms, stream);
}
