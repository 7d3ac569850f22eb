// exchange_counts: every rank's routing counts through the group's count board (protocol.h's steps), for groups
// whose ranks span processes: every wait is a bounded WaitAtLeast (deadline, abort word), unlike a collective's.
// One CTA: BeginKernel opens the epoch, then CountsKernel runs the four steps and closes it.
#include <cuda_runtime.h>

#include <string>

#include "cuda/launch.h"
#include "cuda/workspace/protocol.cuh"

namespace jmo::cuda {
namespace {

__device__ __forceinline__ CountSlot* Slot(char* board, int rank) {
  return reinterpret_cast<CountSlot*>(board + rank * CountSlotBytes(kMaxSegments));
}

// board: the count board's device address (group memory, host-mapped); counts [n] in, out [R, n].
__global__ void __launch_bounds__(kThreads) CountsKernel(RankDev rd, char* board, const int32_t* counts, int64_t n,
                                                         int32_t* out) {
  __shared__ CallState st;
  LoadCallState(rd, &st);
  const int R = rd.ranks;
  // 1. Every peer has finished reading the board in the previous call.
  if (threadIdx.x == 0 && st.ok) {
    for (int i = 1; i < R && st.ok; ++i) {
      const int d = (rd.rank + i) % R;
      st.ok = WaitAtLeast(rd, &View(rd, d).control()->done_epoch.value, 0, st.epoch - 1, d, kStagePeerReady);
    }
  }
  __syncthreads();
  if (st.ok) {
    // 2. Publish this rank's counts, then its stamp (release, after every thread's stores are fenced).
    CountSlot* mine = Slot(board, rd.rank);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
      reinterpret_cast<volatile int32_t*>(mine->values)[i] = counts[i];
    __threadfence_system();
    __syncthreads();
    // 3. Every rank's stamp of this epoch (acquire); the copy below reads their counts.
    if (threadIdx.x == 0) {
      StoreReleaseSys(&mine->stamp.value, st.epoch);
      for (int s = 0; s < R && st.ok; ++s)
        st.ok = WaitAtLeast(rd, &Slot(board, s)->stamp.value, 0, st.epoch, s, kStageCounts);
    }
    __syncthreads();
  }
  // A failed call leaves zero counts (a plan with nothing to move; the next call reports the failure).
  for (int64_t i = threadIdx.x; i < R * n; i += blockDim.x)
    out[i] = st.ok ? reinterpret_cast<volatile int32_t*>(Slot(board, i / n)->values)[i % n] : 0;
  __syncthreads();
  // 4. Done reading: peers may publish the next epoch's counts.
  if (threadIdx.x == 0 && st.ok && LoadVolatile(&rd.priv->failed) == 0) {
    __threadfence_system();
    StoreReleaseSys(&View(rd, rd.rank).control()->done_epoch.value, st.epoch);
  }
}

}  // namespace

Status PrepareCountsKernels(int dev) {
  cudaFuncAttributes attr;
  return CudaStatus(cudaFuncGetAttributes(&attr, (const void*)CountsKernel), "cudaFuncGetAttributes");
}

Status ExchangeCounts(const CallSite& c, const int32_t* counts, int64_t R_src, int64_t R_dst, int64_t E_local,
                      const int32_t* group_op, const int32_t* rank_op, int32_t* out) {
  Status s = BeginCall(c, "exchange_counts", CallFootprint{}, group_op, rank_op);
  if (!s.ok()) return s;
  Workspace& ws = *c.ws;
  const int64_t n = R_dst * E_local;
  if (std::string bad = CheckCountsFit(R_src, R_dst, E_local, ws.ranks(), kMaxSegments); !bad.empty())
    return FailCall(c, "exchange_counts", bad);
  CountsKernel<<<1, kThreads, 0, c.stream>>>(ws.Dev(c.group, c.rank), ws.shared_device(c.group) +
                                             CountBoardOffset(ws.ranks()), counts, n, out);
  return LaunchError("launch of CountsKernel");
}

}  // namespace jmo::cuda
