// Implementation details shared by cutlass_grouped_gemm.cu and cutlass_grouped_outer.cu.
// Not part of the public interface (see cutlass_grouped_gemm.cuh).
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "CUTLASS sm90 grouped GEMM needs CUDA >= 12.3 (modifiable TMA descriptors)"
#endif

// ---------------------------------------------------------------------------------------------
// Compile-time configuration. One configuration for every variant keeps the number of
// instantiations at 5 kernels (A/B x bf16/f32 out, plus C). Override with -D for tuning runs.
//   Cooperative: both consumer warpgroups work on one 128xN tile (64 rows each), so a 128-row
//   M tile wastes less on small/ragged groups than 256 rows; 256-wide N keeps the
//   wgmma N large (best smem-bandwidth/FLOP ratio) and the accumulator at 128 regs/thread.
//   Cluster 1x2: the two CTAs of a cluster share the A (token) tile through TMA multicast and
//   sit on the same group's M tile, so no M-rounding waste for ragged groups (cluster along M
//   would round every group's M-tile count up to even).
// ---------------------------------------------------------------------------------------------
#ifndef CGG_TILE_M
#define CGG_TILE_M 128
#endif
#ifndef CGG_TILE_N
#define CGG_TILE_N 256
#endif
#ifndef CGG_TILE_K
#define CGG_TILE_K 64
#endif
#ifndef CGG_CLUSTER_M
#define CGG_CLUSTER_M 1
#endif
#ifndef CGG_CLUSTER_N
#define CGG_CLUSTER_N 2
#endif
#ifndef CGG_PINGPONG
#define CGG_PINGPONG 0
#endif

#define CGG_STR2(x) #x
#define CGG_STR(x) CGG_STR2(x)
#define CGG_CONFIG_STRING                                                                    \
  "sm90 ptr-array grouped GEMM, " CGG_STR_SCHED " tile " CGG_STR(CGG_TILE_M) "x" CGG_STR( \
      CGG_TILE_N) "x" CGG_STR(CGG_TILE_K) " cluster " CGG_STR(CGG_CLUSTER_M) "x" CGG_STR(  \
      CGG_CLUSTER_N) "x1"
#if CGG_PINGPONG
#define CGG_STR_SCHED "KernelPtrArrayTmaWarpSpecializedPingpong"
#else
#define CGG_STR_SCHED "KernelPtrArrayTmaWarpSpecializedCooperative"
#endif

namespace cgg {

constexpr int kMaxGroups = 1024;  // one block of 1024 threads scans the group sizes

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // per group <M,N,K>
using UnderlyingShape = ProblemShape::UnderlyingProblemShape;
using BF16 = cutlass::bfloat16_t;

// ---------------------------------------------------------------------------------------------
// Error plumbing: every CUDA / CUTLASS status is checked; the first failure is printed once
// with its location and returned as a cudaError_t.
// ---------------------------------------------------------------------------------------------
inline cudaError_t report(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "[cutlass_grouped_gemm] %s failed at %s:%d: %s\n", what, file, line,
                 cudaGetErrorString(e));
  }
  return e;
}
inline cudaError_t report_cutlass(cutlass::Status s, const char* what, const char* file, int line) {
  if (s == cutlass::Status::kSuccess) return cudaSuccess;
  cudaError_t last = cudaGetLastError();  // a launch failure leaves the CUDA error here
  std::fprintf(stderr, "[cutlass_grouped_gemm] %s failed at %s:%d: cutlass status '%s'%s%s\n", what,
               file, line, cutlassGetStatusString(s), last != cudaSuccess ? ", cuda: " : "",
               last != cudaSuccess ? cudaGetErrorString(last) : "");
  if (last != cudaSuccess) return last;
  return s == cutlass::Status::kErrorNotSupported || s == cutlass::Status::kErrorMisalignedOperand ||
                 s == cutlass::Status::kErrorInvalidProblem
             ? cudaErrorInvalidValue
             : cudaErrorUnknown;
}
#define CGG_CUDA(x)                                                    \
  do {                                                                 \
    cudaError_t cgg_e_ = ::cgg::report((x), #x, __FILE__, __LINE__);   \
    if (cgg_e_ != cudaSuccess) return cgg_e_;                          \
  } while (0)
#define CGG_CUTLASS(x)                                                                 \
  do {                                                                                 \
    cutlass::Status cgg_s_ = (x);                                                      \
    if (cgg_s_ != cutlass::Status::kSuccess)                                           \
      return ::cgg::report_cutlass(cgg_s_, #x, __FILE__, __LINE__);                    \
  } while (0)
#define CGG_REQUIRE(cond, msg)                                                            \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "[cutlass_grouped_gemm] invalid argument: %s (%s)\n", msg, #cond); \
      return cudaErrorInvalidValue;                                                       \
    }                                                                                     \
  } while (0)

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ---------------------------------------------------------------------------------------------
// The CUTLASS kernel for one (A layout, B layout, D element) combination.
// Layout tags are CUTLASS's BLAS convention for an (M,K) A and a (K,N) B:
//   A RowMajor    = K contiguous (lhs rows)           A ColumnMajor = M contiguous (lhs^T)
//   B RowMajor    = N contiguous (rhs [K,N])          B ColumnMajor = K contiguous (rhs [N,K])
// D is always row-major. C is void (no source read; beta must be 0).
// ---------------------------------------------------------------------------------------------
template <class LayoutA, class LayoutB, class ElementD>
struct GroupedGemm {
  using ElementAcc = float;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<BF16>::value;       // 8 elements
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;    // 8 or 4
  using TileShape = cute::Shape<cute::Int<CGG_TILE_M>, cute::Int<CGG_TILE_N>, cute::Int<CGG_TILE_K>>;
  using ClusterShape = cute::Shape<cute::Int<CGG_CLUSTER_M>, cute::Int<CGG_CLUSTER_N>, cute::_1>;
#if CGG_PINGPONG
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
#else
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
#endif

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementAcc,
      void, LayoutD*, kAlignD,           // C: none
      ElementD, LayoutD*, kAlignD,       // D
      EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAcc, void, ElementAcc>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      BF16, LayoutA*, kAlignAB,
      BF16, LayoutB*, kAlignAB,
      ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using DPtr = typename CollectiveEpilogue::ElementD*;  // cutlass::bfloat16_t* or float*
};

// Set the one dynamic (leading-dimension) stride of a rank-3 ptr-array stride.
__host__ __device__ inline void set_ld(cute::Stride<int64_t, cute::_1, cute::_0>& s, int64_t ld) {
  cute::get<0>(s) = ld;
}
__host__ __device__ inline void set_ld(cute::Stride<cute::_1, int64_t, cute::_0>& s, int64_t ld) {
  cute::get<1>(s) = ld;
}

// ---------------------------------------------------------------------------------------------
// Device-side group bookkeeping: exclusive scan of up to 1024 clamped group sizes in one block.
// Every block of the prep kernels runs it (it is 4 KiB of reads), so that all blocks know the
// total without a second launch; block 0 additionally writes CUTLASS's per-group arrays.
// ---------------------------------------------------------------------------------------------
struct GroupScan {
  int64_t start[kMaxGroups];  // first row of group g (clamped to M)
  int64_t rows[kMaxGroups];   // rows of group g after clamping to M
  int64_t total;              // min(sum, M)
  int64_t warp_sums[32];
};

__device__ inline void scan_groups(const int32_t* __restrict__ sizes, int G, int64_t M, GroupScan& s) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  int64_t v = (t < G) ? (int64_t)max(sizes[t], 0) : 0;
  int64_t inc = v;  // inclusive warp scan
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    int64_t n = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += n;
  }
  if (lane == 31) s.warp_sums[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    int64_t w = (lane < (int)(blockDim.x >> 5)) ? s.warp_sums[lane] : 0;
    int64_t winc = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      int64_t n = __shfl_up_sync(0xffffffffu, winc, o);
      if (lane >= o) winc += n;
    }
    s.warp_sums[lane] = winc - w;  // exclusive prefix of warp totals
    if (lane == 31) s.total = min(winc, M);
  }
  __syncthreads();
  if (t < G) {
    int64_t excl = s.warp_sums[warp] + inc - v;
    int64_t b = min(excl, M), e = min(excl + v, M);
    s.start[t] = b;
    s.rows[t] = e - b;
  }
  __syncthreads();
}

// Zero bytes [begin, end) of buf with 16-byte stores, grid-stride (begin/end multiples of 16).
__device__ inline void zero_range16(void* buf, int64_t begin, int64_t end) {
  uint4* p = reinterpret_cast<uint4*>(buf);
  const uint4 z = make_uint4(0, 0, 0, 0);
  for (int64_t i = begin / 16 + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < end / 16;
       i += (int64_t)gridDim.x * blockDim.x) {
    p[i] = z;
  }
}

// ---------------------------------------------------------------------------------------------
// Cached device buffers, one per (device, stream): [ per-group arrays | CUTLASS workspace ].
// ---------------------------------------------------------------------------------------------
struct ArgArrays {
  // Byte offsets of each per-group array inside the cached buffer (capacity = cap groups).
  static constexpr size_t kAlign = 256;
  static size_t up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }
  size_t shapes = 0, ptr_a = 0, ptr_b = 0, ptr_d = 0, stride_a = 0, stride_b = 0, stride_d = 0, end = 0;
  template <class Cfg>
  static ArgArrays layout(int cap) {
    ArgArrays l;
    size_t o = 0;
    l.shapes = o;   o = up(o + sizeof(UnderlyingShape) * cap);
    l.ptr_a = o;    o = up(o + sizeof(void*) * cap);
    l.ptr_b = o;    o = up(o + sizeof(void*) * cap);
    l.ptr_d = o;    o = up(o + sizeof(void*) * cap);
    l.stride_a = o; o = up(o + sizeof(typename Cfg::StrideA) * cap);
    l.stride_b = o; o = up(o + sizeof(typename Cfg::StrideB) * cap);
    l.stride_d = o; o = up(o + sizeof(typename Cfg::StrideD) * cap);
    l.end = o;
    return l;
  }
};

// Per-call arrays need at most this many bytes per group (all strides are one int64).
constexpr size_t kArgBytesPerGroup = sizeof(UnderlyingShape) + 3 * sizeof(void*) + 3 * 16;
constexpr size_t kArgSlack = 8 * ArgArrays::kAlign;
// CUTLASS's workspace here is a few TMA descriptors per SM (128 B each); reserve generously so
// that one buffer serves every variant; the actual size is checked on every call.
inline size_t cutlass_ws_reserve(int sm_count) { return (size_t)sm_count * 8 * 128 + 4096; }

struct Buffer {
  void* base = nullptr;
  size_t bytes = 0;
};

inline std::mutex& cache_mutex() {
  static std::mutex m;
  return m;
}
inline std::map<std::pair<int, cudaStream_t>, Buffer>& cache_map() {
  static std::map<std::pair<int, cudaStream_t>, Buffer> m;
  return m;
}

inline cudaError_t sm_count_for(int device, int* out) {
  static std::mutex m;
  static std::map<int, int> counts;
  std::lock_guard<std::mutex> g(m);
  auto it = counts.find(device);
  if (it == counts.end()) {
    int c = 0;
    CGG_CUDA(cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, device));
    it = counts.emplace(device, c).first;
  }
  *out = it->second;
  return cudaSuccess;
}

// Returns a buffer of at least `bytes` bytes for (current device, stream). Growing it
// synchronizes the stream first (the old buffer may still be read by queued kernels), so grow
// rarely: capacity is rounded up to a power of two number of groups by the callers.
inline cudaError_t get_buffer(cudaStream_t stream, size_t bytes, void** out) {
  int device = 0;
  CGG_CUDA(cudaGetDevice(&device));
  std::lock_guard<std::mutex> g(cache_mutex());
  Buffer& b = cache_map()[{device, stream}];
  if (b.bytes < bytes) {
    if (b.base != nullptr) {
      CGG_CUDA(cudaStreamSynchronize(stream));
      CGG_CUDA(cudaFree(b.base));
      b.base = nullptr;
      b.bytes = 0;
    }
    CGG_CUDA(cudaMalloc(&b.base, bytes));
    b.bytes = bytes;
  }
  *out = b.base;
  return cudaSuccess;
}

inline int round_cap(int64_t G) {
  int cap = 64;
  while (cap < G) cap <<= 1;
  return cap;
}

inline size_t buffer_bytes_for(int64_t G, int sm_count) {
  return (size_t)round_cap(G) * kArgBytesPerGroup + kArgSlack + cutlass_ws_reserve(sm_count);
}

// Hardware info (SM count, max active clusters) queried once per (device, kernel).
template <class Kernel>
inline cudaError_t hw_info_for(int device, cutlass::KernelHardwareInfo* out) {
  static std::mutex m;
  static std::map<int, cutlass::KernelHardwareInfo> infos;
  std::lock_guard<std::mutex> g(m);
  auto it = infos.find(device);
  if (it == infos.end()) {
    int sms = 0;
    cudaError_t e = sm_count_for(device, &sms);
    if (e != cudaSuccess) return e;
    cutlass::KernelHardwareInfo hw =
        cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(device, sms);
    // make_kernel_hardware_info swallows a failing occupancy query (-> 0, CUTLASS then uses a
    // heuristic grid); clear its (non-sticky) error so that it is not blamed on a later call.
    (void)cudaGetLastError();
    it = infos.emplace(device, hw).first;
  }
  *out = it->second;
  return cudaSuccess;
}

// Runs one CUTLASS grouped GEMM whose per-group arrays already are (or will be, stream-ordered)
// on the device. No host problem shapes: the persistent group scheduler launches one CTA per SM
// and walks the device problem shapes itself; groups with M == 0 have no tiles.
template <class Cfg>
cudaError_t run_cutlass(int G, const ArgArrays& l, char* base, void* cutlass_ws, size_t ws_room,
                        cudaStream_t stream) {
  using Gemm = typename Cfg::Gemm;
  int device = 0;
  CGG_CUDA(cudaGetDevice(&device));
  cutlass::KernelHardwareInfo hw;
  CGG_CUDA(hw_info_for<typename Cfg::Kernel>(device, &hw));

  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = ProblemShape{G, reinterpret_cast<UnderlyingShape*>(base + l.shapes), nullptr};
  args.mainloop.ptr_A = reinterpret_cast<const BF16**>(base + l.ptr_a);
  args.mainloop.dA = reinterpret_cast<typename Cfg::StrideA*>(base + l.stride_a);
  args.mainloop.ptr_B = reinterpret_cast<const BF16**>(base + l.ptr_b);
  args.mainloop.dB = reinterpret_cast<typename Cfg::StrideB*>(base + l.stride_b);
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = reinterpret_cast<typename Cfg::DPtr*>(base + l.ptr_d);
  args.epilogue.dD = reinterpret_cast<typename Cfg::StrideD*>(base + l.stride_d);
  args.hw_info = hw;
  // Default group scheduler arguments: raster along M, no swizzle.

  Gemm gemm;
  CGG_CUTLASS(gemm.can_implement(args));
  const size_t ws = Gemm::get_workspace_size(args);
  if (ws > ws_room) {
    std::fprintf(stderr, "[cutlass_grouped_gemm] CUTLASS workspace %zu B exceeds reserved %zu B\n", ws,
                 ws_room);
    return cudaErrorMemoryAllocation;
  }
  CGG_CUTLASS(gemm.initialize(args, cutlass_ws, stream));
  CGG_CUTLASS(gemm.run(stream));
  return cudaSuccess;
}

}  // namespace cgg
