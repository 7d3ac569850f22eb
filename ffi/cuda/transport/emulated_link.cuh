// The emulated link of the loopback harness (CallOptions::emulated_link_gbps), where ranks share one GPU and a push to
// "another rank" is a store into the same HBM: every push of a call to another rank, the dispatch's rows
// (row_push.cuh, dispatch_gemm.cu) and expert_combine's bands (its consumer, expert_combine.cu), goes through PaceLink.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/workspace/protocol.cuh"

namespace jmo::cuda {

// This rank's pushes to other ranks share one first-come first-served link of bytes_per_ns (GB/s) from the call's
// first push on (RankPrivate::link_t0 and link_bytes, zeroed by the call's BeginKernel). A push of `bytes` (already
// stored) reserves them and waits until the link would have carried everything reserved before it and itself; only
// then is it signalled. One thread calls it.
__device__ inline void PaceLink(const RankDev& rd, uint64_t bytes, double bytes_per_ns) {
  auto* t0p = reinterpret_cast<unsigned long long*>(&rd.priv->link_t0);
  const uint64_t now = GlobalTimer();
  const unsigned long long seen = atomicCAS(t0p, 0ull, (unsigned long long)now);
  const uint64_t t0 = seen == 0 ? now : seen;
  const uint64_t end =
      atomicAdd(reinterpret_cast<unsigned long long*>(&rd.priv->link_bytes), (unsigned long long)bytes) + bytes;
  const uint64_t until = t0 + static_cast<uint64_t>((double)end / bytes_per_ns);
  while (GlobalTimer() < until) __nanosleep(500);
}

}  // namespace jmo::cuda
