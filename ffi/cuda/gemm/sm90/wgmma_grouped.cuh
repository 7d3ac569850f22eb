// Hopper (sm_90a) bf16 grouped GEMM: wgmma.mma_async + TMA + mbarriers, warp-specialized, persistent.
//
//   out[r, :] = lhs[r, :] @ rhs[g(r)]      for rows r of group g (groups: consecutive row ranges from row 0)
//   out[r, :] = 0                          for rows r >= min(sum(group_sizes), M)
//
// lhs [M, K] bf16 row-major; rhs [G, K, N] (rhs_k_major = false) or [G, N, K] (rhs_k_major = true) bf16;
// group_sizes [G] int32 in device memory (read by the kernel, no host sync); out [M, N] bf16 or f32.
// Requires: K % 64 == 0, N % 64 == 0, 16-byte aligned pointers (256 assumed), 1 <= G <= 1024, M < 2^31.
// The caller falls back to another path otherwise (WgmmaGroupedGemm returns cudaErrorInvalidValue), and on a
// device that is not compute capability 9.x or a build without sm_90a code (cudaErrorNotSupported).
//
// The mainloop is WgmmaLoop (wgmma_mainloop.cuh); this file adds the grouped-GEMM tile schedule and kernel body for
// any operand format (the e4m3 one: wgmma_grouped_fp8.cuh), the bf16 host launch, and host helpers shared with other
// users of the loop (tensor-map encoding + cache, per-device kernel preparation). Tile order: group-major, then bands
// of kBandM m-tiles, n-tile-major inside a band (L2 reuse).
#pragma once

#include <cuda.h>  // CUtensorMap and enums only: the driver function comes via cudaGetDriverEntryPointByVersion
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <utility>

#include "cuda/device/warp.cuh"
#include "cuda/gemm/sm90/wgmma_mainloop.cuh"

namespace wgmma_gemm {

using jmo::cuda::WarpInclusiveSum;

constexpr int kBandM = 8;  // m-tiles per raster band
constexpr int kMaxGroups = 1024;
// Dynamic smem of the grouped GEMM over the operand format Ops: the loop's + two int tables of kMaxGroups + 1.
template <class Ops>
constexpr int GroupedSmemBytes() {
  return LoopSmemBytes<kStages, Ops::kExtraBytes>() + 2 * (kMaxGroups + 1) * 4;
}
constexpr int kSmemBytes = GroupedSmemBytes<Bf16Operands<0>>();  // (either kTransB)

// ------------------------------------------------------------------------------------------------------------
// Grouped-GEMM tile schedule (identical in every thread of every CTA: derived from the smem tables)
// ------------------------------------------------------------------------------------------------------------
// A loop tile plus where it sits in its group (for callbacks that count per-group row bands).
struct GroupTile : WgmmaTile {
  int group_row;  // first row of the tile relative to the group's first row (a multiple of kBM)
};

// Tile `local` of a group of mt_g m-tiles x n_tiles n-tiles -> (mt, nt), in bands of band_m m-tiles, n-tile-major
// inside a band: the CTAs running at once share B's column slabs across band_m row blocks (L2 reuse; where N spans
// ~100 n-tiles, an m-tile-major order reads every weight from HBM again for each row block). band_m = 1 is plain
// row-block order: each row block's tiles finish together (expert_combine's producer, whose consumer ships rows per
// block as they finish).
__device__ __forceinline__ void BandRaster(int local, int mt_g, int n_tiles, int band_m, int* mt, int* nt) {
  const int band = local / (band_m * n_tiles);
  const int band_mt = min(band_m, mt_g - band * band_m);
  const int r = local - band * band_m * n_tiles;
  *nt = r / band_mt;
  *mt = band * band_m + r % band_mt;
}

// Where tile t of the schedule sits: group g, m-tile mt and n-tile nt of it, and the group's rows.
struct TilePlace {
  int g, mt, nt, rows_g;
};

// row_start[0..G]: clamped group row offsets (row_start[G] = min(sum, M)); tile_start[0..G]: tile offsets.
__device__ __forceinline__ TilePlace PlaceTile(int t, const int* row_start, const int* tile_start, int G,
                                               int n_tiles) {
  int lo = 0, hi = G - 1;  // largest g with tile_start[g] <= t (then tile_start[g + 1] > t: the group is non-empty)
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tile_start[mid] <= t) lo = mid; else hi = mid - 1;
  }
  TilePlace p;
  p.g = lo;
  p.rows_g = row_start[p.g + 1] - row_start[p.g];
  BandRaster(t - tile_start[p.g], (p.rows_g + kBM - 1) / kBM, n_tiles, kBandM, &p.mt, &p.nt);
  return p;
}

__device__ __forceinline__ GroupTile DecodeTile(int t, const int* row_start, const int* tile_start, int G,
                                                int n_tiles, int N, void* out, bool out_f32) {
  const TilePlace p = PlaceTile(t, row_start, tile_start, G, n_tiles);
  const int g = p.g, mt = p.mt, nt = p.nt, rows_g = p.rows_g;
  GroupTile tile;
  tile.a_row = row_start[g] + mt * kBM;
  tile.b_idx = g;
  tile.n0 = nt * kBN;
  tile.rows = min(kBM, rows_g - mt * kBM);
  tile.cols = min(kBN, N - tile.n0);
  tile.out = static_cast<unsigned char*>(out) + ((int64_t)tile.a_row * N + tile.n0) * (out_f32 ? 4 : 2);
  tile.ldc = N;
  tile.group_row = mt * kBM;
  return tile;
}

// Tile t of a GEMM1 with a SwiGLU epilogue (PlaceTile's schedule over n_tiles = ceil(F / 128) column tiles per
// 128-row block): 128 rows by 128 columns of h, n0 = 128 nt, computed from B's gate columns n0.. and up columns
// F + n0.. (n_hi). Sets tile's loop coordinates (a_row, b_idx, n0, n_hi, rows, cols; its outputs are the caller's)
// and returns the place. Tile: SwiGluTile (ops/grouped_gemm.cu) or SwiGluFp8TileOf (swiglu_fp8_epilogue.cuh).
template <class Tile>
__device__ __forceinline__ TilePlace PlaceSwiGluTile(int t, const int* row_start, const int* tile_start, int G,
                                                     int n_tiles, int F, Tile& tile) {
  constexpr int kHalf = kBN / 2;
  const TilePlace p = PlaceTile(t, row_start, tile_start, G, n_tiles);
  tile.a_row = row_start[p.g] + p.mt * kBM;
  tile.b_idx = p.g;
  tile.n0 = p.nt * kHalf;
  tile.n_hi = F + tile.n0;
  tile.rows = min(kBM, p.rows_g - p.mt * kBM);
  tile.cols = min(kHalf, F - tile.n0);
  return p;
}

// Called by warp 0 after group_sizes is in row_start[0..G): turns it into clamped row offsets and tile offsets
// (warp scan). row_start[g] = min(sum_{h<g} size_h, M); tile_start = prefix of ceil(rows/128) * n_tiles.
__device__ __forceinline__ void ScanGroups(int* row_start, int* tile_start, int G, int M, int n_tiles, int lane) {
  long long rows_carry = 0, tiles_carry = 0;
  for (int base = 0; base < G; base += 32) {
    const int g = base + lane;
    const long long v = g < G ? row_start[g] : 0;
    const long long incl = WarpInclusiveSum(v, lane);
    const long long beg = rows_carry + incl - v, end = rows_carry + incl;
    const long long beg_c = beg < M ? beg : M, end_c = end < M ? end : M;
    const long long t = ((end_c - beg_c + kBM - 1) / kBM) * n_tiles;
    const long long tincl = WarpInclusiveSum(t, lane);
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

// The group tables of a grouped kernel, by all its threads: group_sizes -> row_start[0..G] and tile_start[0..G]
// (ScanGroups, n_tiles column tiles per 128-row block), ready in every thread on return.
__device__ __forceinline__ void BuildGroupTables(const int32_t* __restrict__ group_sizes, int G, int M, int n_tiles,
                                                 int* row_start, int* tile_start) {
  for (int g = threadIdx.x; g < G; g += kThreads) row_start[g] = max(0, group_sizes[g]);
  __syncthreads();
  if (threadIdx.x < 32) ScanGroups(row_start, tile_start, G, M, n_tiles, threadIdx.x);
  __syncthreads();
}

// Padding rows [first, M) of a row-major [M, width] array of `esize`-byte elements -> 0, striped over every thread of
// the grid (16-byte stores: width * esize is a multiple of 16).
__device__ __forceinline__ void ZeroPadRows(void* out, int64_t first, int64_t M, int64_t width, int64_t esize) {
  const int64_t chunks = (M - first) * width * esize / 16;
  int4* base = reinterpret_cast<int4*>(static_cast<unsigned char*>(out) + first * width * esize);
  for (int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x; i < chunks; i += (int64_t)gridDim.x * kThreads)
    base[i] = make_int4(0, 0, 0, 0);
}

// ------------------------------------------------------------------------------------------------------------
// Kernel: one user of WgmmaLoop. `done` is passed through as the loop's tile_done (NoTileDone for the plain GEMM;
// the probe passes a band counter), called with a GroupTile.
// ------------------------------------------------------------------------------------------------------------
// The kernel body, any operand format: group tables, padding rows, the tile schedule, the loop.
template <class Ops, bool kOutF32, class Done>
__device__ __forceinline__ void GroupedGemmBody(const Ops& ops, const int32_t* __restrict__ group_sizes, int G, int M,
                                                int N, int K, void* __restrict__ out, Done done, char* smem_raw) {
  int* row_start = reinterpret_cast<int*>(smem_raw + LoopSmemBytes<kStages, Ops::kExtraBytes>());  // G + 1
  int* tile_start = row_start + (kMaxGroups + 1);                                                   // G + 1
  const int n_tiles = (N + kBN - 1) / kBN;
  BuildGroupTables(group_sizes, G, M, n_tiles, row_start, tile_start);

  ZeroPadRows(out, row_start[G], M, N, kOutF32 ? sizeof(float) : kElemBytes);  // rows [min(sum, M), M)

  const int total_tiles = tile_start[G];
  auto tile_of = [&](int t) { return DecodeTile(t, row_start, tile_start, G, n_tiles, N, out, kOutF32); };
  WgmmaLoop<Ops, kOutF32>(ops, K, total_tiles, StaticTiles{(int)blockIdx.x, (int)gridDim.x}, tile_of, done,
                          smem_raw);
}

// tm_a: lhs as 2D (K, M), box (64, 128); tm_b: rhs 3D, see wgmma_mainloop.cuh.
template <int kTransB, bool kOutF32, class Done>
__global__ void __launch_bounds__(kThreads, 1)
    GroupedGemmKernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                      const int32_t* __restrict__ group_sizes, int G, int M, int N, int K, void* __restrict__ out,
                      Done done) {
  extern __shared__ __align__(1024) char smem_raw[];
  GroupedGemmBody<Bf16Operands<kTransB>, kOutF32>(Bf16Operands<kTransB>{&tm_a, &tm_b}, group_sizes, G, M, N, K, out,
                                                  done, smem_raw);
}

// ------------------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------------------
inline PFN_cuTensorMapEncodeTiled_v12000 GetEncodeTiled() {
  static std::once_flag once;
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !p) {
      fprintf(stderr, "wgmma_gemm: cannot get cuTensorMapEncodeTiled (%s, query result %d)\n",
              cudaGetErrorString(e), (int)q);
      return;
    }
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  });
  return fn;
}

// dims/strides innermost first; strides[i] is the byte stride of dim i + 1. bf16 elements and the 128B swizzle unless
// told otherwise (the e4m3 operands are UINT8 maps; scale vectors are unswizzled FLOAT32).
inline bool EncodeMap(CUtensorMap* map, const void* ptr, int rank, const cuuint64_t* dims, const cuuint64_t* strides,
                      const cuuint32_t* box, const char* what,
                      CUtensorMapDataType dtype = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                      CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
  PFN_cuTensorMapEncodeTiled_v12000 enc = GetEncodeTiled();
  if (!enc) return false;
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = enc(map, dtype, (cuuint32_t)rank, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                         CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE /* zeros */);
  if (r != CUDA_SUCCESS) {
    fprintf(stderr, "wgmma_gemm: cuTensorMapEncodeTiled(%s) failed with CUresult %d\n", what, (int)r);
    return false;
  }
  return true;
}

// The two maps WgmmaTileLoop expects:
//   ta: A = a [a_rows, K] bf16 row-major (2D, box 64 x 128);
//   tb: B = b [G, K, N] (b_k_major = false: MN-major, use kTransB = 1) or [G, N, K] (b_k_major = true, kTransB = 0).
// Requires K % 64 == 0, N % 64 == 0, 16-byte aligned pointers, all extents >= 1. Returns cudaErrorInvalidValue
// (after printing why) otherwise or if the encoding fails.
inline cudaError_t EncodeGemmMaps(const void* a, int64_t a_rows, int64_t K, const void* b, int64_t G, int64_t N,
                                  bool b_k_major, CUtensorMap* ta, CUtensorMap* tb) {
  if (a_rows <= 0 || K <= 0 || N <= 0 || G <= 0 || K % kBK != 0 || N % 64 != 0 || a_rows > 0x7fffffff ||
      K > 0x7fffffff || N > 0x7fffffff || G > 0x7fffffff ||
      (reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) % 16) {
    fprintf(stderr, "wgmma_gemm: EncodeGemmMaps: unsupported rows=%lld K=%lld N=%lld G=%lld or alignment\n",
            (long long)a_rows, (long long)K, (long long)N, (long long)G);
    return cudaErrorInvalidValue;
  }
  {
    const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)a_rows};
    const cuuint64_t strides[1] = {(cuuint64_t)K * kElemBytes};
    const cuuint32_t box[2] = {kBK, kBM};
    if (!EncodeMap(ta, a, 2, dims, strides, box, "A [rows, K]")) return cudaErrorInvalidValue;
  }
  if (b_k_major) {  // [G, N, K]
    const cuuint64_t dims[3] = {(cuuint64_t)K, (cuuint64_t)N, (cuuint64_t)G};
    const cuuint64_t strides[2] = {(cuuint64_t)K * kElemBytes, (cuuint64_t)N * K * kElemBytes};
    const cuuint32_t box[3] = {kBK, kBN, 1};
    if (!EncodeMap(tb, b, 3, dims, strides, box, "B [G, N, K]")) return cudaErrorInvalidValue;
  } else {  // [G, K, N]
    const cuuint64_t dims[3] = {(cuuint64_t)N, (cuuint64_t)K, (cuuint64_t)G};
    const cuuint64_t strides[2] = {(cuuint64_t)N * kElemBytes, (cuuint64_t)K * N * kElemBytes};
    const cuuint32_t box[3] = {64, kBK, 1};
    if (!EncodeMap(tb, b, 3, dims, strides, box, "B [G, K, N]")) return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

// A small thread-safe cache of sets of kMaps tensor maps keyed by Key (pointers + extents + layout; Key needs ==): XLA
// reuses buffers, so the same maps come back call after call. A map only encodes address, extents and strides, so a
// hit is exact even if the buffer was freed and reallocated in between. kEntries slots, round-robin replacement.
// encode(maps) builds the maps on a miss (returns cudaSuccess or the error to pass on). One cache per Key type.
template <class Key, int kEntries, int kMaps, class Encode>
inline cudaError_t CachedMapSet(const Key& key, CUtensorMap* maps, Encode encode) {
  struct Entry {
    Key key;
    bool valid;
    CUtensorMap maps[kMaps];
  };
  static std::mutex mu;
  static Entry cache[kEntries];
  static int next = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const Entry& e : cache) {
      if (e.valid && e.key == key) {
        for (int i = 0; i < kMaps; ++i) maps[i] = e.maps[i];
        return cudaSuccess;
      }
    }
  }
  const cudaError_t err = encode(maps);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(mu);
  Entry& e = cache[next];
  next = (next + 1) % kEntries;
  e.key = key;
  for (int i = 0; i < kMaps; ++i) e.maps[i] = maps[i];
  e.valid = true;
  return cudaSuccess;
}

// CachedMapSet of (ta, tb) pairs: encode(ta, tb).
template <class Key, int kEntries, class Encode>
inline cudaError_t CachedMapPair(const Key& key, CUtensorMap* ta, CUtensorMap* tb, Encode encode) {
  CUtensorMap maps[2];
  const cudaError_t err =
      CachedMapSet<Key, kEntries, 2>(key, maps, [&](CUtensorMap* m) { return encode(&m[0], &m[1]); });
  if (err != cudaSuccess) return err;
  *ta = maps[0];
  *tb = maps[1];
  return cudaSuccess;
}

// EncodeGemmMaps behind CachedMapPair (32 entries).
inline cudaError_t CachedGemmMaps(const void* a, int64_t a_rows, int64_t K, const void* b, int64_t G, int64_t N,
                                  bool b_k_major, CUtensorMap* ta, CUtensorMap* tb) {
  struct Key {
    const void* a;
    const void* b;
    int64_t a_rows, K, G, N;
    bool b_k_major;
    bool operator==(const Key& o) const {
      return a == o.a && b == o.b && a_rows == o.a_rows && K == o.K && G == o.G && N == o.N && b_k_major == o.b_k_major;
    }
  };
  return CachedMapPair<Key, 32>(Key{a, b, a_rows, K, G, N, b_k_major}, ta, tb, [&](CUtensorMap* ma, CUtensorMap* mb) {
    return EncodeGemmMaps(a, a_rows, K, b, G, N, b_k_major, ma, mb);
  });
}

// Once per (kernel, device), thread-safe: checks that a kernel built on WgmmaTileLoop can run on the current
// device -- compute capability 9.x, code from the sm_90a pass (ptxVersion >= 90, not the compute_80 PTX
// JIT-compiled; and exactly kEntryRegs registers per thread, which is both the setmaxnreg budget and what only the
// real sm_90a body gets: the __trap() bodies need far fewer), 384 threads allowed -- and sets its dynamic smem limit
// to smem_bytes. Returns cudaErrorNotSupported (after printing why) when the kernel cannot run here, so the caller
// can fall back; the answer is cached per (kernel, device), a failure is re-checked on the next call.
inline cudaError_t PrepareWgmmaKernel(const void* kernel, int smem_bytes) {
  static std::mutex mu;
  static std::set<std::pair<const void*, int>> ready;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu);
  if (ready.count({kernel, dev})) return cudaSuccess;
  int major = 0;
  e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (e != cudaSuccess) return e;
  if (major != 9) {
    fprintf(stderr, "wgmma_gemm: device %d is compute capability %d.x, the wgmma kernels need 9.x (Hopper)\n", dev,
            major);
    return cudaErrorNotSupported;
  }
  cudaFuncAttributes attr;
  e = cudaFuncGetAttributes(&attr, kernel);
  if (e != cudaSuccess) return e;
  if (attr.ptxVersion < 90 || attr.numRegs != kEntryRegs ||
      attr.maxThreadsPerBlock < kThreads) {
    fprintf(stderr,
            "wgmma_gemm: kernel not usable on device %d (ptxVersion %d, binaryVersion %d, %d registers, max %d "
            "threads; need sm_90a code with %d registers and %d threads)\n",
            dev, attr.ptxVersion, attr.binaryVersion, attr.numRegs, attr.maxThreadsPerBlock, kEntryRegs, kThreads);
    return cudaErrorNotSupported;
  }
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (e != cudaSuccess) {
    fprintf(stderr, "wgmma_gemm: cudaFuncSetAttribute(%d bytes smem) failed on device %d: %s\n", smem_bytes, dev,
            cudaGetErrorString(e));
    return e;
  }
  ready.insert({kernel, dev});
  return cudaSuccess;
}

// PrepareWgmmaKernel, then launch `kernel` (kThreads threads, smem_bytes dynamic smem) with `args`.
template <class... Params, class... Args>
inline cudaError_t LaunchWgmmaKernel(void (*kernel)(Params...), int grid, int smem_bytes, cudaStream_t stream,
                                     const Args&... args) {
  const cudaError_t e = PrepareWgmmaKernel(reinterpret_cast<const void*>(kernel), smem_bytes);
  if (e != cudaSuccess) return e;
  kernel<<<grid, kThreads, smem_bytes, stream>>>(args...);
  return cudaGetLastError();
}

template <int kTransB, bool kOutF32, class Done>
inline cudaError_t LaunchOne(const CUtensorMap& ta, const CUtensorMap& tb, const int32_t* gs, int G, int M, int N,
                             int K, void* out, int grid, Done done, cudaStream_t stream) {
  return LaunchWgmmaKernel(GroupedGemmKernel<kTransB, kOutF32, Done>, grid, kSmemBytes, stream, ta, tb, gs, G, M, N,
                           K, out, done);
}

// WgmmaGroupedGemm with a tile_done callback (called with a GroupTile; see wgmma_mainloop.cuh for the contract).
template <class Done>
inline cudaError_t GroupedGemmWithDone(const __nv_bfloat16* lhs, int64_t M, int64_t K, const __nv_bfloat16* rhs,
                                       int64_t G, int64_t N, bool rhs_k_major, const int32_t* group_sizes_dev,
                                       void* out, bool out_f32, int num_sms, Done done, cudaStream_t stream) {
  if (M <= 0 || K <= 0 || N <= 0 || K % kBK != 0 || N % 64 != 0 || G < 1 || G > kMaxGroups ||
      M > 0x7fffffff - kBM || K > 0x7fffffff || N > 0x7fffffff ||
      (reinterpret_cast<uintptr_t>(lhs) | reinterpret_cast<uintptr_t>(rhs) | reinterpret_cast<uintptr_t>(out)) % 16 ||
      num_sms <= 0) {
    fprintf(stderr, "WgmmaGroupedGemm: unsupported shape/alignment M=%lld K=%lld N=%lld G=%lld num_sms=%d\n",
            (long long)M, (long long)K, (long long)N, (long long)G, num_sms);
    return cudaErrorInvalidValue;
  }
  CUtensorMap ta, tb;
  const cudaError_t e = CachedGemmMaps(lhs, M, K, rhs, G, N, rhs_k_major, &ta, &tb);
  if (e != cudaSuccess) return e;
  const int g = (int)G, m = (int)M, n = (int)N, k = (int)K;
  if (rhs_k_major) {
    return out_f32 ? LaunchOne<0, true>(ta, tb, group_sizes_dev, g, m, n, k, out, num_sms, done, stream)
                   : LaunchOne<0, false>(ta, tb, group_sizes_dev, g, m, n, k, out, num_sms, done, stream);
  }
  return out_f32 ? LaunchOne<1, true>(ta, tb, group_sizes_dev, g, m, n, k, out, num_sms, done, stream)
                 : LaunchOne<1, false>(ta, tb, group_sizes_dev, g, m, n, k, out, num_sms, done, stream);
}


}  // namespace wgmma_gemm

// Host launch. Returns cudaErrorInvalidValue (and prints why) for unsupported shapes, cudaErrorNotSupported on a
// device or build without sm_90a support, so the caller can fall back.
inline cudaError_t WgmmaGroupedGemm(const __nv_bfloat16* lhs, int64_t M, int64_t K, const __nv_bfloat16* rhs,
                                    int64_t G, int64_t N, bool rhs_k_major, const int32_t* group_sizes_dev,
                                    void* out, bool out_f32, int num_sms, cudaStream_t stream) {
  return wgmma_gemm::GroupedGemmWithDone(lhs, M, K, rhs, G, N, rhs_k_major, group_sizes_dev, out, out_f32, num_sms,
                                         wgmma_gemm::NoTileDone{}, stream);
}
