// dispatch: PushKernel pushes this rank's rows to the peers' recv rows and release-adds their arrival counters;
// RecvKernel waits (acquire) for this rank's rows and copies recv -> out; EndKernel closes the call. In a group of one
// rank PushKernel stores the rows straight into out and RecvKernel only zeroes the rows past them (protocol.h). With
// send once (slot_primary) PushKernel moves a token's row to another rank once and RecvKernel's copy gathers every
// row from the row its recv_from entry names.
#include <cuda_runtime.h>

#include <string>

#include "cuda/launch.h"
#include "cuda/transport/row_push.cuh"

namespace jmo::cuda {
namespace {

__global__ void __launch_bounds__(kThreads) PushKernel(RankDev rd, const char* src, int64_t S, int64_t row_bytes,
                                                       const int32_t* src_row, const int32_t* dst_rank,
                                                       const int32_t* dst_row, const int32_t* primary, int64_t P,
                                                       int64_t cap, double link_bytes_per_ns, char* own_rows,
                                                       RowScale scaled) {
  __shared__ CallState st;
  __shared__ unsigned sent[kMaxRanks];
  LoadCallState(rd, &st);
  const int R = rd.ranks;
  if (!BeginPush(rd, &st, sent)) return;
  const int warps = blockDim.x / 32;
  PushRows(rd, src, S, row_bytes, src_row, dst_rank, dst_row, P, cap, kPushAll,
           (int64_t)blockIdx.x * warps + threadIdx.x / 32, (int64_t)gridDim.x * warps, sent, link_bytes_per_ns,
           own_rows, primary, st.epoch, scaled);
  __threadfence_system();
  __syncthreads();
  // Then release-add the rows to each destination's arrival counter.
  if (threadIdx.x < R && sent[threadIdx.x] > 0)
    AddReleaseSys(&View(rd, threadIdx.x).control()->recv_arrivals.value, sent[threadIdx.x]);
}

// rows_in_out: PushKernel stored the rows in out (a group of one rank); only the zeros past them are left to write.
// gather (send once): row r of out is recv's row RecvFromChecked(r), one warp per row (the expansion as part of the
// copy: no bytes beyond it).
__global__ void __launch_bounds__(kThreads) RecvKernel(RankDev rd, const int32_t* expected_p, char* out, int64_t cap,
                                                       int64_t row_bytes, bool rows_in_out, bool gather) {
  __shared__ CallState st;
  __shared__ int64_t expected;
  LoadCallState(rd, &st);
  if (threadIdx.x == 0) {
    expected = expected_p[0];
    if (st.ok && (expected < 0 || expected > cap)) {
      if (blockIdx.x == 0) ReportBadInput(rd, kBadExpectedRows, 0, expected, cap);
      st.ok = 0;
    }
    // Step 3: wait (acquire) until this call's rows have all arrived.
    RankControl* ctl = View(rd, rd.rank).control();
    if (st.ok)
      st.ok = WaitAtLeast(rd, &ctl->recv_arrivals.value, LoadVolatile(&ctl->recv_expected.value), expected,
                          rd.ranks, kStageRecvArrivals);
  }
  __syncthreads();
  if (!st.ok) return;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, n = (int64_t)gridDim.x * blockDim.x;
  if (!rows_in_out && gather) {
    const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const char* recv = View(rd, rd.rank).recv();
    for (int64_t r = (int64_t)blockIdx.x * warps + threadIdx.x / 32; r < expected; r += (int64_t)gridDim.x * warps) {
      int64_t f = 0;
      if (lane == 0) f = RecvFromChecked(rd, st.epoch, r);
      f = __shfl_sync(0xffffffffu, f, 0);
      if (f >= 0) CopyRowWarp(out + r * row_bytes, recv + f * row_bytes, row_bytes, lane);
    }
  } else if (!rows_in_out) {
    CopyBand(out, View(rd, rd.rank).recv(), expected * row_bytes, tid, n);
  }
  ZeroBytes(out + expected * row_bytes, (cap - expected) * row_bytes, tid, n);
}

}  // namespace

Status LaunchRecvAndEnd(const RankDev& rd, int grid, cudaStream_t stream, const int32_t* expected, char* out,
                        int64_t cap, int64_t row_bytes, bool rows_in_out, bool gather) {
  RecvKernel<<<grid, kThreads, 0, stream>>>(rd, expected, out, cap, row_bytes, rows_in_out, gather);
  Status s = LaunchError("launch of RecvKernel");
  return s.ok() ? LaunchEnd(rd, stream, expected, 0) : s;
}

Status PrepareDispatchKernels(int dev) {
  cudaFuncAttributes attr;
  Status s = CudaStatus(cudaFuncGetAttributes(&attr, (const void*)PushKernel), "cudaFuncGetAttributes");
  if (s.ok()) s = CudaStatus(cudaFuncGetAttributes(&attr, (const void*)RecvKernel), "cudaFuncGetAttributes");
  return s;
}

Status Dispatch(const CallSite& c, DType dt, const void* src, int64_t S, int64_t D, const int32_t* slot_src_row,
                const int32_t* slot_dest_rank, const int32_t* slot_dest_row, const int32_t* slot_primary,
                const float* row_scale, int64_t P, const int32_t* recv_expected, const int32_t* group_op,
                const int32_t* rank_op, void* out, int64_t cap) {
  const int64_t row_bytes = RowBytes(dt, D);
  Status s = BeginCall(c, "dispatch", CallFootprint{row_bytes, cap}, group_op, rank_op);
  if (!s.ok()) return s;
  Workspace& ws = *c.ws;
  const RankDev rd = ws.Dev(c.group, c.rank);
  const int grid = ws.budget(c.group, c.rank);
  // A group of one rank: its rows go straight into out (no recv rows, no copy).
  char* own_rows = rd.ranks == 1 ? static_cast<char*>(out) : nullptr;
  PushKernel<<<grid, kThreads, 0, c.stream>>>(rd, static_cast<const char*>(src), S, row_bytes, slot_src_row,
                                              slot_dest_rank, slot_dest_row, slot_primary, P, cap,
                                              c.opts.emulated_link_gbps, own_rows,
                                              RowScale{row_scale, dt == DType::kBF16});
  if (!(s = LaunchError("launch of PushKernel")).ok()) return s;
  return LaunchRecvAndEnd(rd, grid, c.stream, recv_expected, static_cast<char*>(out), cap, row_bytes,
                          own_rows != nullptr, slot_primary != nullptr);
}

}  // namespace jmo::cuda
