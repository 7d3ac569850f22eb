// gather_rs: GEMM2 + GatherRS (docs/design.md, "GatherRS"). ExpertKernel (expert_combine.cu) runs the producer and
// gather_rs's consumer (gather_consumer.cuh), which stores each source's float32 partial into slice `rank` of the
// source's ret rows; then GatherSumKernel waits for the R slices of this rank's tokens, sums them in rank order
// 0, 1, ..., R - 1 in float32 (rounded once to the call's dtype), copies the GEMM's rows out when asked, and closes
// the call.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/device/convert.cuh"
#include "cuda/device/copy.cuh"
#include "cuda/launch.h"
#include "cuda/workspace/protocol.cuh"

namespace jmo::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kSumThreads = 512;  // one CTA per SM of the rank's budget, like every kernel of a call

// V consecutive outputs of one token, from V float32 sums.
template <typename T, int V>
__device__ __forceinline__ void StoreOut(T* dst, const float* v) {
  if constexpr (V == 4 && sizeof(T) == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
  } else if constexpr (V == 4) {  // four bfloat16: one 8-byte store
    union {
      bf16 h[4];
      uint2 u;
    } p;
#pragma unroll
    for (int i = 0; i < 4; ++i) p.h[i] = FromFloat<T>(v[i]);
    *reinterpret_cast<uint2*>(dst) = p.u;
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) dst[i] = FromFloat<T>(v[i]);
  }
}

// y[t, n] = ((0 + slice_0[t, n]) + slice_1[t, n]) + ... + slice_{R-1}[t, n] in float32, rounded once (the CPU
// handler's SumSlices); V columns per thread and step (4: 16-byte loads, N % 4 == 0). rows_out (or null): the GEMM's
// rows, stage rows [0, kept) with kept = the call's segment rows, zero in [kept, cap). The last CTA closes the call.
template <typename T, int V>
__global__ void __launch_bounds__(kSumThreads, 1)
    GatherSumKernel(RankDev rd, int64_t T_, int64_t N, const int32_t* seg_rows, int n_segs, int64_t cap,
                    int64_t row_bytes, T* y, T* rows_out) {
  __shared__ CallState st;
  __shared__ int64_t kept;  // rows_out: the call's segment rows (BuildSegments refused segments that overflow cap)
  LoadCallState(rd, &st);
  if (threadIdx.x == 0)
    atomicMin(reinterpret_cast<unsigned long long*>(&rd.priv->comb_t0), (unsigned long long)GlobalTimer());
  const int R = rd.ranks;
  const uint64_t expected = (uint64_t)R * (uint64_t)T_;  // T rows from every rank of the group, this one too
  if (threadIdx.x == 0 && st.ok) {  // thread 0 alone touches st until the barrier
    RankControl* ctl = View(rd, rd.rank).control();
    st.ok = WaitAtLeast(rd, &ctl->ret_arrivals.value, LoadVolatile(&ctl->ret_expected.value), expected, R,
                        kStageRetArrivals);
    int64_t rows = 0;
    for (int i = 0; i < n_segs && rows_out != nullptr; ++i) rows += seg_rows[i] > 0 ? seg_rows[i] : 0;
    kept = rows < cap ? rows : cap;
  }
  __syncthreads();
  if (!st.ok) return;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, nthreads = (int64_t)gridDim.x * blockDim.x;
  const float* slices = reinterpret_cast<const float*>(View(rd, rd.rank).ret());
  const int64_t TN = T_ * N;
  for (int64_t e = tid * V; e < TN; e += nthreads * V) {
    float acc[V];
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = 0.f;
    for (int g = 0; g < R; ++g) {
      const float* p = slices + g * TN + e;
      float v[V];
      if constexpr (V == 4) {
        const float4 q = __ldcg(reinterpret_cast<const float4*>(p));
        v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) v[i] = __ldcg(p + i);
      }
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] = __fadd_rn(acc[i], v[i]);
    }
    StoreOut<T, V>(y + e, acc);
  }
  if (rows_out != nullptr) {
    char* out = reinterpret_cast<char*>(rows_out);
    CopyBytes(out, View(rd, rd.rank).stage(), kept * row_bytes, tid, nthreads);
    const int64_t from = kept * row_bytes, to = cap * row_bytes;
    const int64_t vec_end = ((uint64_t)from | reinterpret_cast<uintptr_t>(out)) % 16 == 0 ? from + (to - from) / 16 * 16
                                                                                         : from;
    uint4* z = reinterpret_cast<uint4*>(out + from);
    for (int64_t i = tid; i < (vec_end - from) / 16; i += nthreads) z[i] = make_uint4(0, 0, 0, 0);
    for (int64_t i = vec_end + tid; i < to; i += nthreads) out[i] = 0;
  }
  // Every CTA has read all its slices: the last one closes the call.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0 &&
      atomicAdd(reinterpret_cast<unsigned long long*>(&rd.priv->combine_done), 1ull) == gridDim.x - 1ull) {
    rd.priv->comb_t1 = GlobalTimer();
    CloseCall(rd, (int64_t)expected, 1);
  }
}

Status LaunchGatherSum(const RankDev& rd, int grid, cudaStream_t stream, DType dt, int64_t T, int64_t N,
                       const int32_t* seg_rows, int n_segs, int64_t cap, int64_t row_bytes, void* y, void* rows_out) {
  // 16-byte loads of the slices when N % 4 == 0 (every token's slice row then starts 16-byte aligned), with y's
  // stores aligned alike.
  const bool vec = N % 4 == 0 && reinterpret_cast<uintptr_t>(y) % (dt == DType::kBF16 ? 8 : 16) == 0;
  auto launch = [&](auto kernel, auto* typed_y) {
    using Ptr = decltype(typed_y);
    kernel<<<grid, kSumThreads, 0, stream>>>(rd, T, N, seg_rows, n_segs, cap, row_bytes, typed_y,
                                             static_cast<Ptr>(rows_out));
  };
  if (dt == DType::kBF16)
    vec ? launch(GatherSumKernel<bf16, 4>, static_cast<bf16*>(y))
        : launch(GatherSumKernel<bf16, 1>, static_cast<bf16*>(y));
  else
    vec ? launch(GatherSumKernel<float, 4>, static_cast<float*>(y))
        : launch(GatherSumKernel<float, 1>, static_cast<float*>(y));
  return LaunchError("launch of GatherSumKernel");
}

}  // namespace

Status PrepareGatherSumKernels(int dev) {
  (void)dev;  // (the current device: PrepareKernels' caller has set it)
  cudaFuncAttributes attr;
  Status s;
  const void* kernels[] = {(const void*)GatherSumKernel<bf16, 1>, (const void*)GatherSumKernel<float, 1>,
                           (const void*)GatherSumKernel<bf16, 4>, (const void*)GatherSumKernel<float, 4>};
  for (const void* k : kernels)
    if (s.ok()) s = CudaStatus(cudaFuncGetAttributes(&attr, k), "cudaFuncGetAttributes");
  return s;
}

Status GatherRs(const CallSite& c, DType dt, const void* lhs, int64_t cap, int64_t K, const void* w, int64_t E_l,
                int64_t N, bool transpose_rhs, const float* row_gate, const int32_t* token_rows, int64_t T, int64_t Q,
                const int32_t* seg_rows, const int32_t* seg_ret_off, const int32_t* group_op, const int32_t* rank_op,
                void* y, void* rows_out) {
  const int64_t row_bytes = RowBytes(dt, N);
  const int64_t R = c.ws != nullptr ? c.ws->ranks() : 0;
  const int64_t partial_rows = GatherRsPartialRows(R, T, N, row_bytes);
  Status s = BeginCall(c, "gather_rs", CallFootprint{row_bytes, cap, partial_rows, E_l}, group_op, rank_op);
  if (!s.ok()) return s;
  s = LaunchExpertOperator(c, "gather_rs", dt, lhs, cap, K, w, E_l, N, transpose_rhs, seg_rows, seg_ret_off,
                           GatherArgs{true, row_gate, token_rows, T, Q});
  if (!s.ok()) return s;
  return LaunchGatherSum(c.ws->Dev(c.group, c.rank), c.ws->budget(c.group, c.rank), c.stream, dt, T, N, seg_rows,
                         (int)(E_l * R), cap, row_bytes, y, rows_out);
}

}  // namespace jmo::cuda
