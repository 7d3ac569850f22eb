// Bare grouped GEMMs (grouped_gemm.h): persistent kernels over a tile space that every CTA derives on the device
// from the group sizes (block scans into shared memory), then a tile engine of gemm/ (tile.cuh) per tile.
#include "cuda/ops/grouped_gemm.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "cuda/device/activation.cuh"
#include "cuda/gemm/engine.h"
#include "cuda/gemm/simt_tile.cuh"
#include "cuda/gemm/sm80/mma_tile.cuh"
#include "cuda/gemm/sm90/wgmma_grouped.cuh"
#include "cuda/gemm/sm90/wgmma_grouped_fp8.cuh"
#include "cuda/gemm/sm90/wgmma_outer.cuh"
#include "cuda/gemm/sm90/wgmma_outer_fp8.cuh"
#include "cuda/gemm/sm90/wgmma_swiglu_fp8.cuh"
#include "cuda/launch.h"
#include "cuda/ops/group_offsets.cuh"

namespace jmo::cuda {
namespace {

// Whether a wgmma launcher refused the operands before any launch (cudaErrorInvalidValue, cudaErrorNotSupported), so
// that another engine runs. A refusal that came from a runtime call (cudaFuncSetAttribute, ...) is also the thread's
// last error: it is cleared, else the other engine's launch check would report it as its own.
bool EngineRefused(cudaError_t e) {
  if (e != cudaErrorInvalidValue && e != cudaErrorNotSupported) return false;
  (void)cudaGetLastError();
  return true;
}

using bf16 = __nv_bfloat16;

constexpr int kTcBM = 128;   // rows of a tensor-core tile (bigger than the producer's one-band tile: more reuse)
constexpr int kSimtBM = 64;

template <typename OutT>
__device__ void ZeroRows(OutT* out, int64_t first, int64_t last, int64_t N) {
  const int64_t n = (last - first) * N;
  OutT* p = out + first * N;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = tid; i < n; i += stride) p[i] = FromFloat<OutT>(0.f);
}

template <int BM, bool kTransB, typename T, typename OutT, bool kTC>
__device__ __forceinline__ void Tile(const TileArgs<T, OutT>& t, char* smem) {
  if constexpr (kTC)
    TcTile<BM, false, kTransB, OutT>(t, smem);
  else
    SimtTile<BM, false, kTransB, T, OutT>(t, smem);
}

// Tiles in group order, the column tiles of one row block adjacent (they share the A rows in L2); within a group
// every row block streams the same weight matrix, which stays in L2 across the group's concurrent tiles.
template <int BM, bool kTransB, typename T, typename OutT, bool kTC>
__global__ void __launch_bounds__(kTileThreads) GroupedMatmulKernel(const T* __restrict__ lhs, int64_t M, int64_t K,
                                                                    const T* __restrict__ rhs, int G, int64_t N,
                                                                    const int32_t* sizes, OutT* __restrict__ out) {
  extern __shared__ __align__(16) char smem[];
  __shared__ int32_t row_off[kMaxGroups + 1];
  __shared__ int32_t tile_off[kMaxGroups + 1];
  const int col_tiles = (int)((N + kTileN - 1) / kTileN);
  BuildRowOffsets(sizes, G, M, row_off);
  BlockExclusiveScan(G, [&](int g) { return (row_off[g + 1] - row_off[g] + BM - 1) / BM * col_tiles; }, tile_off);
  const int32_t tiles = tile_off[G];
  for (int32_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int g = FindGroup(tile_off, G, t);
    const int local = t - tile_off[g];
    const int64_t row0 = row_off[g] + (int64_t)(local / col_tiles) * BM, n0 = (int64_t)(local % col_tiles) * kTileN;
    const T* b = kTransB ? rhs + (int64_t)g * N * K + n0 * K : rhs + (int64_t)g * K * N + n0;
    const TileArgs<T, OutT> args{lhs + row0 * K, K, b, kTransB ? K : N, out + row0 * N + n0, N,
                                 (int)min((int64_t)BM, row_off[g + 1] - row0), (int)min((int64_t)kTileN, N - n0),
                                 (int)K};
    Tile<BM, kTransB, T, OutT, kTC>(args, smem);
  }
  ZeroRows(out, row_off[G], M, N);
}

// One tile = (group, BM columns of lhs, kTileN columns of rhs), reducing over the group's rows.
template <int BM, typename T, typename OutT, bool kTC>
__global__ void __launch_bounds__(kTileThreads) GroupedOuterKernel(const T* __restrict__ lhs, int64_t M, int64_t K,
                                                                   const T* __restrict__ rhs, int64_t N, int G,
                                                                   const int32_t* sizes, OutT* __restrict__ out) {
  extern __shared__ __align__(16) char smem[];
  __shared__ int32_t row_off[kMaxGroups + 1];
  BuildRowOffsets(sizes, G, M, row_off);
  const int64_t m_tiles = (K + BM - 1) / BM, n_tiles = (N + kTileN - 1) / kTileN;
  const int64_t tiles = (int64_t)G * m_tiles * n_tiles;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int g = (int)(t / (m_tiles * n_tiles));
    const int64_t local = t % (m_tiles * n_tiles);
    const int64_t m0 = (local / n_tiles) * BM, n0 = (local % n_tiles) * kTileN;
    const int64_t r0 = row_off[g];
    const TileArgs<T, OutT> args{lhs + r0 * K + m0, K, rhs + r0 * N + n0, N, out + (int64_t)g * K * N + m0 * N + n0,
                                 N, (int)min((int64_t)BM, K - m0), (int)min((int64_t)kTileN, N - n0),
                                 row_off[g + 1] - row_off[g]};
    if constexpr (kTC)
      TcTile<BM, true, false, OutT>(args, smem);
    else
      SimtTile<BM, true, false, T, OutT>(args, smem);
  }
}

// Grid of a persistent kernel: every CTA the device holds at once (occupancy of the compiled kernel at its shared
// memory), never more than the work. The dynamic shared-memory limit is raised once per (kernel, device).
Status PersistentGrid(const void* kernel, int smem, int64_t work, int* grid) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> resident;  // (kernel, device) -> CTAs the device holds
  int dev = 0;
  Status s = CudaStatus(cudaGetDevice(&dev), "cudaGetDevice");
  if (!s.ok()) return s;
  std::lock_guard<std::mutex> lock(mu);
  auto it = resident.find({kernel, dev});
  if (it == resident.end()) {
    int per_sm = 0;
    DeviceInfo info;
    s = CudaStatus(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                   "cudaFuncSetAttribute(grouped GEMM)");
    if (s.ok()) s = GetDeviceInfo(dev, &info);
    if (s.ok())
      s = CudaStatus(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kTileThreads, smem),
                     "cudaOccupancyMaxActiveBlocksPerMultiprocessor(grouped GEMM)");
    if (!s.ok()) return s;
    if (per_sm < 1) return Status::Error(kInternal, "jax_moe_overlap: the grouped GEMM kernel does not fit an SM");
    it = resident.emplace(std::make_pair(kernel, dev), info.sms * per_sm).first;
  }
  *grid = (int)std::max<int64_t>(1, std::min<int64_t>(it->second, work));
  return Status{};
}

// The grid of a wgmma kernel: the device's SMs, or at most `sms` of them.
int WgmmaGrid(const DeviceInfo& dev, int sms) { return sms > 0 ? std::min(sms, dev.sms) : dev.sms; }

// The engine SelectGemmEngine picks on the current device (*dev: its facts).
Status SelectOnCurrentDevice(const GemmOperands& o, DeviceInfo* dev, std::optional<GemmEngine>* engine) {
  Status s = CurrentDeviceInfo(dev);
  if (s.ok()) *engine = SelectGemmEngine(dev->cc, o);
  return s;
}

template <int BM, bool kTransB, typename T, typename OutT, bool kTC>
Status LaunchMatmul(cudaStream_t stream, const void* lhs, int64_t M, int64_t K, const void* rhs, int64_t G, int64_t N,
                    const int32_t* sizes, void* out) {
  const auto kernel = GroupedMatmulKernel<BM, kTransB, T, OutT, kTC>;
  const int smem = kTC ? TcLayout<BM>::kSmemBytes : SimtSmemBytes<BM>();
  int grid = 0;
  // Work bound: every row block of every column tile, plus one per group for partial blocks.
  const int64_t work = ((M + BM - 1) / BM + G) * ((N + kTileN - 1) / kTileN);
  Status s = PersistentGrid(reinterpret_cast<const void*>(kernel), smem, work, &grid);
  if (!s.ok()) return s;
  kernel<<<grid, kTileThreads, smem, stream>>>(static_cast<const T*>(lhs), M, K, static_cast<const T*>(rhs), (int)G, N,
                                               sizes, static_cast<OutT*>(out));
  return CudaStatus(cudaGetLastError(), "launch of GroupedMatmulKernel");
}

template <int BM, typename T, typename OutT, bool kTC>
Status LaunchOuter(cudaStream_t stream, const void* lhs, int64_t M, int64_t K, const void* rhs, int64_t N, int64_t G,
                   const int32_t* sizes, void* out) {
  const auto kernel = GroupedOuterKernel<BM, T, OutT, kTC>;
  const int smem = kTC ? TcLayout<BM>::kSmemBytes : SimtSmemBytes<BM>();
  int grid = 0;
  const int64_t work = G * ((K + BM - 1) / BM) * ((N + kTileN - 1) / kTileN);
  Status s = PersistentGrid(reinterpret_cast<const void*>(kernel), smem, work, &grid);
  if (!s.ok()) return s;
  kernel<<<grid, kTileThreads, smem, stream>>>(static_cast<const T*>(lhs), M, K, static_cast<const T*>(rhs), N, (int)G,
                                               sizes, static_cast<OutT*>(out));
  return CudaStatus(cudaGetLastError(), "launch of GroupedOuterKernel");
}

// The launch checks of the two SwiGLU kernels below, before their maps are encoded: lhs [M, K] x F columns per half,
// K a multiple of 64 and F of f_multiple, extents within the loop's 32-bit tile coordinates, every operand and output
// 16-byte aligned (`addresses`: their addresses or-ed), a grid. Prints why not (`what`: the launch).
inline bool FusedLaunchFits(const char* what, int64_t M, int64_t K, int64_t F, int64_t G, int64_t f_multiple,
                            uintptr_t addresses, int num_sms) {
  if (M > 0 && K > 0 && F > 0 && K % wgmma_gemm::kBK == 0 && F % f_multiple == 0 && G >= 1 &&
      G <= wgmma_gemm::kMaxGroups && M <= 0x7fffffff - wgmma_gemm::kBM && K <= 0x7fffffff && 2 * F <= 0x7fffffff &&
      addresses % 16 == 0 && num_sms > 0)
    return true;
  fprintf(stderr, "%s: unsupported shape/alignment M=%lld K=%lld F=%lld G=%lld num_sms=%d\n", what, (long long)M,
          (long long)K, (long long)F, (long long)G, num_sms);
  return false;
}

// The fused GEMM1 + SwiGLU on the wgmma engine (the grouped GEMM's schedule, gemm/sm90/wgmma_grouped.cuh, with
// SwiGluTile's epilogue).
namespace swiglu_wgmma {
using namespace wgmma_gemm;

// GEMM1 with its SwiGLU epilogue: h [M, F] bf16 = silu(lhs @ rhs[g][:, :F]) * (lhs @ rhs[g][:, F:]) per group's rows
// (rhs [G, K, 2F], MN-major), and the preactivation a [M, 2F] = lhs @ rhs[g] when a is not null (float32, or rounded
// to bf16 with a_bf16). Each tile
// is 128 rows x 128 columns of h, computed from the gate's 128 columns and the up projection's 128 (SwiGluTile).
// Rows past the groups are zero in h and a.
__global__ void __launch_bounds__(wgmma_gemm::kThreads, 1)
    GroupedSwiGluKernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                        const int32_t* __restrict__ group_sizes, int G, int M, int F, int K,
                        __nv_bfloat16* __restrict__ h, void* __restrict__ a, bool a_bf16) {
  extern __shared__ __align__(1024) char smem_raw[];
  int* row_start = reinterpret_cast<int*>(smem_raw + kLoopSmemBytes);  // G + 1
  int* tile_start = row_start + (kMaxGroups + 1);                      // G + 1
  constexpr int kHalf = kBN / 2;
  const int n_tiles = (F + kHalf - 1) / kHalf;
  BuildGroupTables(group_sizes, G, M, n_tiles, row_start, tile_start);
  ZeroPadRows(h, row_start[G], M, F, sizeof(__nv_bfloat16));
  const int64_t a_elem = a_bf16 ? sizeof(__nv_bfloat16) : sizeof(float);
  if (a != nullptr) ZeroPadRows(a, row_start[G], M, 2 * (int64_t)F, a_elem);
  auto tile_of = [&](int t) {
    SwiGluTile tile;
    PlaceSwiGluTile(t, row_start, tile_start, G, n_tiles, F, tile);
    tile.out = h + (int64_t)tile.a_row * F + tile.n0;
    tile.ldc = F;
    tile.a = a != nullptr ? static_cast<char*>(a) + (int64_t)tile.a_row * 2 * F * a_elem : nullptr;
    tile.lda = 2 * (int64_t)F;
    tile.a_bf16 = a_bf16;
    return tile;
  };
  WgmmaTileLoop</*kTransB=*/1, /*kOutF32=*/false>(tm_a, tm_b, K, (int)blockIdx.x, (int)gridDim.x, tile_start[G],
                                                   tile_of, NoTileDone{}, smem_raw);
}

// GroupedSwiGluKernel's launch: lhs [M, K], rhs [G, K, 2F] bf16, h [M, F] bf16, a [M, 2F] float32 (bf16 with a_bf16)
// or nullptr.
// Requires K % 64 == 0 and F % 32 == 0 (2F a multiple of 64, and whole 16-column stores); cudaErrorInvalidValue
// otherwise, cudaErrorNotSupported where the wgmma kernels cannot run.
inline cudaError_t GroupedSwiGlu(const __nv_bfloat16* lhs, int64_t M, int64_t K, const __nv_bfloat16* rhs, int64_t G,
                                 int64_t F, const int32_t* group_sizes_dev, __nv_bfloat16* h, void* a, bool a_bf16,
                                 int num_sms, cudaStream_t stream) {
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(lhs) | reinterpret_cast<uintptr_t>(rhs) |
                              reinterpret_cast<uintptr_t>(h) | reinterpret_cast<uintptr_t>(a);
  if (!FusedLaunchFits("GroupedSwiGlu", M, K, F, G, 32, addresses, num_sms)) return cudaErrorInvalidValue;
  CUtensorMap ta, tb;
  const cudaError_t e = CachedGemmMaps(lhs, M, K, rhs, G, 2 * F, /*b_k_major=*/false, &ta, &tb);
  if (e != cudaSuccess) return e;
  return LaunchWgmmaKernel(GroupedSwiGluKernel, num_sms, kSmemBytes, stream, ta, tb, group_sizes_dev, (int)G, (int)M,
                           (int)F, (int)K, h, a, a_bf16);
}

}  // namespace swiglu_wgmma

// The backward GEMM dh = d_out @ W2^T with the SwiGLU's gradient in its epilogue on the wgmma engine (the grouped
// GEMM's schedule, gemm/sm90/wgmma_grouped.cuh, with SwiGluGradTile's epilogue).
namespace swiglu_grad_wgmma {
using namespace wgmma_gemm;

// da [M, 2F] bf16 = the input gradient of silu(a[:, :F]) * a[:, F:] for dh = lhs @ rhs[g] per group's rows (rhs
// [G, K, F] MN-major with kTransB = 1, [G, F, K] K-major with kTransB = 0), a [M, 2F] in AElem (float or bf16). Each
// tile is 128 rows x 256 columns of dh: d_gate's 256 columns and d_up's 256 of da. Rows past the groups are zero in
// da.
template <int kTransB, class AElem>
__global__ void __launch_bounds__(wgmma_gemm::kThreads, 1)
    GroupedSwiGluGradKernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
                            const int32_t* __restrict__ group_sizes, int G, int M, int F, int K,
                            const AElem* __restrict__ a, __nv_bfloat16* __restrict__ da) {
  extern __shared__ __align__(1024) char smem_raw[];
  int* row_start = reinterpret_cast<int*>(smem_raw + kLoopSmemBytes);  // G + 1
  int* tile_start = row_start + (kMaxGroups + 1);                      // G + 1
  const int n_tiles = (F + kBN - 1) / kBN;
  BuildGroupTables(group_sizes, G, M, n_tiles, row_start, tile_start);
  ZeroPadRows(da, row_start[G], M, 2 * (int64_t)F, sizeof(__nv_bfloat16));
  auto tile_of = [&](int t) {
    const TilePlace p = PlaceTile(t, row_start, tile_start, G, n_tiles);
    SwiGluGradTile<AElem> tile;
    tile.a_row = row_start[p.g] + p.mt * kBM;
    tile.b_idx = p.g;
    tile.n0 = p.nt * kBN;
    tile.rows = min(kBM, p.rows_g - p.mt * kBM);
    tile.cols = min(kBN, F - tile.n0);
    tile.ldc = 2 * (int64_t)F;
    tile.out = da + (int64_t)tile.a_row * tile.ldc + tile.n0;
    tile.a = a + (int64_t)tile.a_row * tile.ldc + tile.n0;
    tile.up = F;
    return tile;
  };
  WgmmaTileLoop<kTransB, /*kOutF32=*/false>(tm_a, tm_b, K, (int)blockIdx.x, (int)gridDim.x, tile_start[G], tile_of,
                                            NoTileDone{}, smem_raw);
}

// GroupedSwiGluGradKernel's launch: lhs [M, K], rhs [G, F, K] (transpose_rhs) or [G, K, F] bf16, a [M, 2F] float32
// or bf16 (a_bf16), da [M, 2F] bf16. Requires K % 64 == 0 and F % 64 == 0 (GemmEngineOperandRefusal's wgmma rule);
// cudaErrorInvalidValue otherwise, cudaErrorNotSupported where the wgmma kernels cannot run.
inline cudaError_t GroupedSwiGluGrad(const __nv_bfloat16* lhs, int64_t M, int64_t K, const __nv_bfloat16* rhs,
                                     int64_t G, int64_t F, bool transpose_rhs, const int32_t* group_sizes_dev,
                                     const void* a, bool a_bf16, __nv_bfloat16* da, int num_sms,
                                     cudaStream_t stream) {
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(lhs) | reinterpret_cast<uintptr_t>(rhs) |
                              reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(da);
  if (!FusedLaunchFits("GroupedSwiGluGrad", M, K, F, G, 64, addresses, num_sms)) return cudaErrorInvalidValue;
  CUtensorMap ta, tb;
  const cudaError_t e = CachedGemmMaps(lhs, M, K, rhs, G, F, /*b_k_major=*/transpose_rhs, &ta, &tb);
  if (e != cudaSuccess) return e;
  auto launch = [&](auto kernel, const auto* a_typed) {
    return LaunchWgmmaKernel(kernel, num_sms, kSmemBytes, stream, ta, tb, group_sizes_dev, (int)G, (int)M, (int)F,
                             (int)K, a_typed, da);
  };
  const float* a_f32 = static_cast<const float*>(a);
  const __nv_bfloat16* a_b16 = static_cast<const __nv_bfloat16*>(a);
  if (transpose_rhs)
    return a_bf16 ? launch(GroupedSwiGluGradKernel<0, __nv_bfloat16>, a_b16)
                  : launch(GroupedSwiGluGradKernel<0, float>, a_f32);
  return a_bf16 ? launch(GroupedSwiGluGradKernel<1, __nv_bfloat16>, a_b16)
                : launch(GroupedSwiGluGradKernel<1, float>, a_f32);
}

}  // namespace swiglu_grad_wgmma

// h[r, j] = silu(a[r, j]) * a[r, F + j] over every row (GroupedMatmulSwiGlu's unfused path; a's zero rows give zero).
template <typename OutT>
__global__ void SwiGluRowsKernel(const float* __restrict__ a, int64_t M, int64_t F, OutT* __restrict__ h) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < M * F; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / F, j = i - r * F;
    h[i] = FromFloat<OutT>(SiluMul(a[r * 2 * F + j], a[r * 2 * F + F + j]));
  }
}

}  // namespace

Status GroupedMatmulSwiGlu(cudaStream_t stream, DType dt, const void* lhs, int64_t M, int64_t K, const void* rhs,
                           int64_t G, int64_t F, const int32_t* group_sizes, void* h, void* a, DType a_dt,
                           int sms) {
  Status s = CheckSizes("grouped_matmul_swiglu", M, G);
  if (!s.ok()) return s;
  const bool a_bf16 = a != nullptr && a_dt == DType::kBF16;
  if (a != nullptr && a_dt != DType::kF32 && !(a_bf16 && dt == DType::kBF16))
    return Status::Error(kInvalidArgument, "jax_moe_overlap: grouped_matmul_swiglu: a must be float32 or lhs's dtype");
  if (M == 0 || F == 0) return LaunchEmpty(stream);
  // The fused kernel where an engine has the SwiGLU epilogue for these operands (the wgmma engine); it falls back
  // to the two kernels below where its launch refuses the call after all (an output's alignment, the build).
  const GemmOperands fused{dt, GemmForm::kRows, M, K, 2 * F, false, GemmEpilogue::kSwiGlu, lhs, rhs};
  DeviceInfo dev;
  std::optional<GemmEngine> engine;
  if (!(s = SelectOnCurrentDevice(fused, &dev, &engine)).ok()) return s;
  if (engine == GemmEngine::kWgmma) {
    const cudaError_t e = swiglu_wgmma::GroupedSwiGlu(static_cast<const bf16*>(lhs), M, K,
                                                      static_cast<const bf16*>(rhs), G, F, group_sizes,
                                                      static_cast<bf16*>(h), a, a_bf16, WgmmaGrid(dev, sms),
                                                      stream);
    if (!EngineRefused(e)) return CudaStatus(e, "grouped_matmul_swiglu (wgmma)");
  }
  if (a == nullptr || a_bf16) {
    const char* why = GemmEngineRefusal(GemmEngine::kWgmma, dev.cc, fused);
    return Status::Error(kInvalidArgument,
                         std::string("jax_moe_overlap: grouped_matmul_swiglu: the fused kernel does not run here (") +
                             (why != nullptr ? why : "its launch refused the operands") +
                             (a == nullptr ? "); ask for the preactivation output"
                                           : "); ask for the preactivation in float32 (only the fused epilogue "
                                             "rounds it to bf16; the layer: jax_moe_overlap.expert_gemms."
                                             "PREACTIVATION_IN_COMPUTE_DTYPE = False)"));
  }
  float* pre = static_cast<float*>(a);
  s = GroupedMatmul(stream, dt, /*out_f32=*/true, lhs, M, K, rhs, G, 2 * F, /*transpose_rhs=*/false, group_sizes, pre,
                    sms);
  if (!s.ok()) return s;
  const int grid = (int)std::min<int64_t>(4096, (M * F + 255) / 256);
  if (dt == DType::kF32)
    SwiGluRowsKernel<float><<<grid, 256, 0, stream>>>(pre, M, F, static_cast<float*>(h));
  else
    SwiGluRowsKernel<bf16><<<grid, 256, 0, stream>>>(pre, M, F, static_cast<bf16*>(h));
  return CudaStatus(cudaGetLastError(), "launch of SwiGluRowsKernel");
}

Status GroupedMatmulSwiGluGrad(cudaStream_t stream, DType dt, const void* lhs, int64_t M, int64_t K, const void* rhs,
                               int64_t G, int64_t F, bool transpose_rhs, const int32_t* group_sizes, const void* a,
                               DType a_dtype, void* da, int sms) {
  Status s = CheckSizes("grouped_matmul_swiglu_grad", M, G);
  if (!s.ok()) return s;
  if (M == 0 || F == 0) return LaunchEmpty(stream);
  const GemmOperands gemm{dt, GemmForm::kRows, M, K, F, transpose_rhs, GemmEpilogue::kSwiGluGrad, lhs, rhs};
  DeviceInfo dev;
  std::optional<GemmEngine> engine;
  if (!(s = SelectOnCurrentDevice(gemm, &dev, &engine)).ok()) return s;
  if (engine == GemmEngine::kWgmma) {
    const cudaError_t e = swiglu_grad_wgmma::GroupedSwiGluGrad(
        static_cast<const bf16*>(lhs), M, K, static_cast<const bf16*>(rhs), G, F, transpose_rhs, group_sizes, a,
        a_dtype == DType::kBF16, static_cast<bf16*>(da), WgmmaGrid(dev, sms), stream);
    if (!EngineRefused(e))
      return CudaStatus(e, "grouped_matmul_swiglu_grad (wgmma)");
  }
  // No engine of this device has the epilogue for these operands: the caller runs grouped_matmul and the SwiGLU's
  // gradient apart (engines.swiglu_grad_fused answers before it traces this call).
  const char* why = GemmEngineRefusal(GemmEngine::kWgmma, dev.cc, gemm);
  return Status::Error(kInvalidArgument,
                       std::string("jax_moe_overlap: grouped_matmul_swiglu_grad: the fused kernel does not run here (") +
                           (why != nullptr ? why : "its launch refused the operands") +
                           "); run grouped_matmul and the SwiGLU's gradient apart");
}

Status GroupedMatmul(cudaStream_t stream, DType dt, bool out_f32, const void* lhs, int64_t M, int64_t K,
                     const void* rhs, int64_t G, int64_t N, bool transpose_rhs, const int32_t* group_sizes, void* out,
                     int sms) {
  Status s = CheckSizes("grouped_matmul", M, G);
  if (!s.ok()) return s;
  if (M == 0 || N == 0) return LaunchEmpty(stream);
  DeviceInfo dev;
  std::optional<GemmEngine> engine;
  s = SelectOnCurrentDevice({dt, GemmForm::kRows, M, K, N, transpose_rhs, GemmEpilogue::kNone, lhs, rhs}, &dev,
                            &engine);
  if (!s.ok()) return s;
  if (engine == GemmEngine::kWgmma)
    return CudaStatus(WgmmaGroupedGemm(static_cast<const bf16*>(lhs), M, K, static_cast<const bf16*>(rhs), G, N,
                                       transpose_rhs, group_sizes, out, out_f32, WgmmaGrid(dev, sms), stream),
                      "grouped_matmul (wgmma)");
  const bool tc = engine == GemmEngine::kMmaSync;
#define JMO_MATMUL(BM, TB, T, OUT, TC) \
  return LaunchMatmul<BM, TB, T, OUT, TC>(stream, lhs, M, K, rhs, G, N, group_sizes, out)
  if (dt == DType::kF32) {
    if (transpose_rhs) JMO_MATMUL(kSimtBM, true, float, float, false);
    JMO_MATMUL(kSimtBM, false, float, float, false);
  }
  if (tc) {
    if (transpose_rhs) {
      if (out_f32) JMO_MATMUL(kTcBM, true, bf16, float, true);
      JMO_MATMUL(kTcBM, true, bf16, bf16, true);
    }
    if (out_f32) JMO_MATMUL(kTcBM, false, bf16, float, true);
    JMO_MATMUL(kTcBM, false, bf16, bf16, true);
  }
  if (transpose_rhs) {
    if (out_f32) JMO_MATMUL(kSimtBM, true, bf16, float, false);
    JMO_MATMUL(kSimtBM, true, bf16, bf16, false);
  }
  if (out_f32) JMO_MATMUL(kSimtBM, false, bf16, float, false);
  JMO_MATMUL(kSimtBM, false, bf16, bf16, false);
#undef JMO_MATMUL
}

Status CheckSizes(const char* op, int64_t M, int64_t G) {
  if (G < 1 || G > kMaxGroups)
    return Status::Error(kInvalidArgument, std::string("jax_moe_overlap: ") + op + ": " + std::to_string(G) +
                                               " groups; supported: 1.." + std::to_string(kMaxGroups));
  if (M >= (int64_t(1) << 31))
    return Status::Error(kInvalidArgument, std::string("jax_moe_overlap: ") + op + ": more than 2^31 rows");
  return Status{};
}

Status Fp8DeviceCheck(const char* op, DeviceInfo* dev) {
  Status s = CurrentDeviceInfo(dev);
  if (!s.ok()) return s;
  if (const char* why = Fp8GroupedGemmDeviceRefusal(dev->cc))
    return Status::Error(kFailedPrecondition, std::string("jax_moe_overlap: ") + op + ": " + why +
                                                  "; this device is compute capability " +
                                                  std::to_string(dev->cc.major) + "." + std::to_string(dev->cc.minor));
  return Status{};
}

// An e4m3 wgmma launch's result as the FP8 calls report it: cudaErrorNotSupported on a Hopper device means the build
// lacks the sm_90a code (the kernel printed why).
Status Fp8LaunchStatus(const char* op, cudaError_t e) {
  if (e == cudaErrorNotSupported)
    return Status::Error(kFailedPrecondition, std::string("jax_moe_overlap: ") + op +
                                                  ": this build has no sm_90a code for the e4m3 wgmma kernel (build "
                                                  "with JMO_CUDA_ARCHS including 90a)");
  return CudaStatus(e, (std::string(op) + " (wgmma e4m3)").c_str());
}

Status GroupedMatmulFp8(cudaStream_t stream, bool out_f32, const void* lhs, const float* lhs_scales,
                        int64_t scales_ld, int64_t M, int64_t K, const void* rhs, const float* rhs_scales, int64_t G,
                        int64_t N, const int32_t* group_sizes, void* out, int sms) {
  Status s = CheckSizes("grouped_matmul_fp8", M, G);
  if (!s.ok()) return s;
  DeviceInfo dev;
  if (!(s = Fp8DeviceCheck("grouped_matmul_fp8", &dev)).ok()) return s;
  if (M == 0) return LaunchEmpty(stream);
  if (const char* why = wgmma_gemm::GroupedGemmFp8Refusal(M, K, N, G, scales_ld, lhs, lhs_scales, rhs, rhs_scales,
                                                          out))
    return Status::Error(kInvalidArgument, std::string("jax_moe_overlap: grouped_matmul_fp8: ") + why);
  return Fp8LaunchStatus("grouped_matmul_fp8",
                         WgmmaGroupedGemmFp8(static_cast<const __nv_fp8_e4m3*>(lhs), lhs_scales, scales_ld, M, K,
                                             static_cast<const __nv_fp8_e4m3*>(rhs), rhs_scales, G, N, group_sizes,
                                             out, out_f32, WgmmaGrid(dev, sms), stream));
}

Status GroupedMatmulSwiGluFp8(cudaStream_t stream, const void* lhs, const float* lhs_scales, int64_t scales_ld,
                              int64_t M, int64_t K, const void* rhs, const float* rhs_scales, int64_t G, int64_t F,
                              const int32_t* group_sizes, uint8_t* h_q, float* h_s, uint8_t* a_q, float* a_s,
                              int sms) {
  Status s = CheckSizes("grouped_matmul_swiglu_fp8", M, G);
  if (!s.ok()) return s;
  DeviceInfo dev;
  if (!(s = Fp8DeviceCheck("grouped_matmul_swiglu_fp8", &dev)).ok()) return s;
  if (M == 0) return LaunchEmpty(stream);
  if (const char* why = wgmma_gemm::GroupedSwiGluFp8Refusal(M, K, F, G, scales_ld, lhs, lhs_scales, rhs, rhs_scales,
                                                            h_q, h_s, a_q, a_s))
    return Status::Error(kInvalidArgument, std::string("jax_moe_overlap: grouped_matmul_swiglu_fp8: ") + why);
  return Fp8LaunchStatus("grouped_matmul_swiglu_fp8",
                         wgmma_gemm::GroupedSwiGluFp8(static_cast<const __nv_fp8_e4m3*>(lhs), lhs_scales, scales_ld,
                                                      M, K, static_cast<const __nv_fp8_e4m3*>(rhs), rhs_scales, G, F,
                                                      group_sizes, h_q, h_s, a_q, a_s, WgmmaGrid(dev, sms), stream));
}

Status GroupedOuterFp8(cudaStream_t stream, bool out_f32, const void* lhs_t, const float* lhs_scales, int64_t lhs_ld,
                       int64_t K, const void* rhs_t, const float* rhs_scales, int64_t rhs_ld, int64_t N, int64_t Mp,
                       int64_t G, const int32_t* group_sizes, void* out, int sms) {
  Status s = CheckSizes("grouped_outer_fp8", Mp, G);
  if (!s.ok()) return s;
  DeviceInfo dev;
  if (!(s = Fp8DeviceCheck("grouped_outer_fp8", &dev)).ok()) return s;
  if (const char* why = wgmma_outer::GroupedOuterFp8Refusal(Mp, K, N, G, lhs_ld, rhs_ld, lhs_t, lhs_scales, rhs_t,
                                                            rhs_scales, out))
    return Status::Error(kInvalidArgument, std::string("jax_moe_overlap: grouped_outer_fp8: ") + why);
  return Fp8LaunchStatus("grouped_outer_fp8",
                         WgmmaGroupedOuterFp8(static_cast<const __nv_fp8_e4m3*>(lhs_t), lhs_scales, lhs_ld, K,
                                              static_cast<const __nv_fp8_e4m3*>(rhs_t), rhs_scales, rhs_ld, N, Mp, G,
                                              group_sizes, out, out_f32, WgmmaGrid(dev, sms), stream));
}

Status GroupedOuter(cudaStream_t stream, DType dt, bool out_f32, const void* lhs, int64_t M, int64_t K,
                    const void* rhs, int64_t N, int64_t G, const int32_t* group_sizes, void* out) {
  Status s = CheckSizes("grouped_outer", M, G);
  if (!s.ok()) return s;
  if (K == 0 || N == 0) return LaunchEmpty(stream);
  const GemmOperands gemm{dt, GemmForm::kOuter, M, K, N, false, GemmEpilogue::kNone, lhs, rhs};
  DeviceInfo dev;
  std::optional<GemmEngine> engine;
  if (!(s = SelectOnCurrentDevice(gemm, &dev, &engine)).ok()) return s;
  // The wgmma kernel (gemm/sm90/wgmma_outer.cuh) refuses, before any launch, what the rule does not know of (the
  // group count's tile budget, the build: cudaErrorInvalidValue / cudaErrorNotSupported): mma.sync runs then.
  if (engine == GemmEngine::kWgmma) {
    const cudaError_t e = WgmmaGroupedOuter(static_cast<const bf16*>(lhs), M, K, static_cast<const bf16*>(rhs), N, G,
                                            group_sizes, out, out_f32, dev.sms, stream);
    if (!EngineRefused(e)) return CudaStatus(e, "grouped_outer (wgmma)");
    engine = SelectGemmEngine(dev.cc, gemm, GemmEngine::kWgmma);
  }
  const bool tc = engine == GemmEngine::kMmaSync;
  if (dt == DType::kF32) return LaunchOuter<kSimtBM, float, float, false>(stream, lhs, M, K, rhs, N, G, group_sizes, out);
  if (tc) {
    if (out_f32) return LaunchOuter<kTcBM, bf16, float, true>(stream, lhs, M, K, rhs, N, G, group_sizes, out);
    return LaunchOuter<kTcBM, bf16, bf16, true>(stream, lhs, M, K, rhs, N, G, group_sizes, out);
  }
  if (out_f32) return LaunchOuter<kSimtBM, bf16, float, false>(stream, lhs, M, K, rhs, N, G, group_sizes, out);
  return LaunchOuter<kSimtBM, bf16, bf16, false>(stream, lhs, M, K, rhs, N, G, group_sizes, out);
}

}  // namespace jmo::cuda
