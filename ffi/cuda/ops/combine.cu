// The combine of expert_combine: once this rank's ret rows have all arrived, y[t] = the gate-weighted sum of its k
// ret rows, and the last CTA closes the call.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/launch.h"
#include "cuda/ops/combine_gather.cuh"
#include "cuda/workspace/protocol.cuh"

namespace jmo::cuda {
namespace {

using bf16 = __nv_bfloat16;

// y[t] = sum_j gates[t, j] * ret[slot_ret_row[t k + j]] in the fixed order j = 0..k-1 (deterministic), fp32
// accumulation; slot_out[p] = ret row of slot p (zero for dropped slots). One warp per token (combine_gather.cuh).
// The last CTA to finish closes the call (CloseCall: what EndKernel does for dispatch), so no extra launch.
constexpr int kCombineThreads = 512;  // one CTA per SM of the rank's budget, like every kernel of a call
template <typename T, int V>
__global__ void __launch_bounds__(kCombineThreads, 1)
    CombineKernel(RankDev rd, const float* gates, const int32_t* slot_ret_row, const int32_t* expected_p, int64_t T_,
                  int64_t k, int64_t N, T* y, T* slot_out) {
  __shared__ CallState st;
  LoadCallState(rd, &st);
  if (threadIdx.x == 0)
    atomicMin(reinterpret_cast<unsigned long long*>(&rd.priv->comb_t0), (unsigned long long)GlobalTimer());
  if (threadIdx.x == 0 && LoadVolatile(&rd.priv->failed) == 0) {  // thread 0 alone touches st until the barrier
    const int64_t expected = expected_p[0];
    RankControl* ctl = View(rd, rd.rank).control();
    if (expected < 0 || expected > rd.sizes.ret_rows) {
      if (blockIdx.x == 0) ReportBadInput(rd, kBadExpectedRows, 0, expected, rd.sizes.ret_rows);
      st.ok = 0;
    } else {
      st.ok = WaitAtLeast(rd, &ctl->ret_arrivals.value, LoadVolatile(&ctl->ret_expected.value), expected, rd.ranks,
                          kStageRetArrivals);
    }
  }
  __syncthreads();
  if (!st.ok) return;
  const T* ret = reinterpret_cast<const T*>(View(rd, rd.rank).ret());
  // 4 vectors x 2 choices of loads in flight per lane (combine_gather.cuh says why).
  GatherWeightedSum<T, V, 4, 2>(
      ret, rd.sizes.ret_rows, gates, slot_ret_row, T_, k, N, y, slot_out,
      [](Pack<T, V>& v, const T* p) { v.LoadCg(p); },
      [&](int64_t p, int32_t r) { ReportBadInput(rd, kBadRetRow, p, r, rd.sizes.ret_rows); });
  // Every CTA has read all its ret rows (their values are in y): the last one closes the call.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0 &&
      atomicAdd(reinterpret_cast<unsigned long long*>(&rd.priv->combine_done), 1ull) == gridDim.x - 1ull) {
    rd.priv->comb_t1 = GlobalTimer();
    CloseCall(rd, expected_p[0], 1);
  }
}

}  // namespace

Status PrepareCombineKernels(int dev) {
  cudaFuncAttributes attr;
  Status s;
  const void* kernels[] = {(const void*)CombineKernel<bf16, 1>, (const void*)CombineKernel<float, 1>,
                           (const void*)CombineKernel<bf16, 8>, (const void*)CombineKernel<float, 4>};
  for (const void* k : kernels)
    if (s.ok()) s = CudaStatus(cudaFuncGetAttributes(&attr, k), "cudaFuncGetAttributes");
  return s;
}

Status LaunchCombine(const RankDev& rd, int grid, cudaStream_t stream, DType dt, const float* gates,
                     const int32_t* slot_ret_row, const int32_t* ret_expected, int64_t T, int64_t k, int64_t N,
                     int64_t row_bytes, void* y, void* slot_out) {
  // 16-byte vectors when every row starts 16-byte aligned (ret rows do when N * element bytes is a multiple of 16).
  const bool vec = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(slot_out) % 16 == 0;
  auto launch = [&](auto kernel, auto* typed_y) {
    using Ptr = decltype(typed_y);
    kernel<<<grid, kCombineThreads, 0, stream>>>(rd, gates, slot_ret_row, ret_expected, T, k, N, typed_y,
                                                 static_cast<Ptr>(slot_out));
  };
  if (dt == DType::kBF16)
    vec ? launch(CombineKernel<bf16, 8>, static_cast<bf16*>(y)) : launch(CombineKernel<bf16, 1>, static_cast<bf16*>(y));
  else
    vec ? launch(CombineKernel<float, 4>, static_cast<float*>(y))
        : launch(CombineKernel<float, 1>, static_cast<float*>(y));
  return LaunchError("launch of CombineKernel");
}

}  // namespace jmo::cuda
