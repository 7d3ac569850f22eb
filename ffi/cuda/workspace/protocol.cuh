// The device side of the call protocol (jax_moe_overlap/protocol.h) that every kernel of a call shares: the view of
// a peer's rows, error records, bounded waits, the call state each kernel loads first, and closing a call.
//
// Memory ordering: data stores -> a barrier of the storing threads (CTA or warp) -> one of them red.release.sys on
// the peer's counter. The barrier synchronizes the storing threads with the releasing one and a release is cumulative
// (PTX memory model), so it orders every store made before the barrier by any of them: a fence by each storing thread
// before the barrier adds nothing (it is the pattern of NCCL's posts and of cooperative groups' grid sync).
// Readers: one thread ld.acquire.sys polls, CTA barrier, then all threads read with ld.global.cg (L2, never a stale
// L1 line). Every wait is bounded by the call's deadline (%globaltimer) and gives up at once when the group's
// abort word (host-mapped) is raised.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device/ptx.cuh"
#include "cuda/workspace/workspace.h"

namespace jmo::cuda {

using ptx::AddRelaxedSys;
using ptx::AddReleaseGpu;
using ptx::AddReleaseSys;
using ptx::GlobalTimer;
using ptx::LoadAcquireSys;
using ptx::LoadVolatile;
using ptx::StoreReleaseGpu;
using ptx::StoreReleaseSys;

__device__ __forceinline__ RankView View(const RankDev& rd, int r) { return RankView{rd.peers.base[r], rd.layout}; }

// A failed call inside a CUDA graph stops the device. On a stream the failing call's kernels give up and the rank's
// next call reports the failure from the host and resets the group; at the replay of a CUDA graph no host code of
// the library runs, so nothing would report it, and every later replay would find the group aborted and skip its
// work: wrong numbers without an error. So once a captured call (RankPrivate::captured) has recorded its failure,
// or seen that the group failed (a peer's abort, an abort raised before it began), __trap() leaves a sticky error
// in the CUDA context, which XLA raises at the next synchronization; the records stay in the group's host memory
// (Workspace::FailureText). Called by the thread that found the failure.
__device__ inline void StopIfCaptured(const RankDev& rd) {
  if (LoadVolatile(&rd.priv->captured) != 0) {
    __threadfence_system();
    __trap();
  }
}

// Records this rank's first failure in its ErrorRecord (host-mapped), marks the call failed and raises the group's
// abort word; inside a CUDA graph then stops the device (StopIfCaptured). Called by one thread.
__device__ inline void RecordError(const RankDev& rd, uint64_t code, uint64_t sub, uint64_t peer, uint64_t got,
                                   uint64_t expected) {
  const uint64_t epoch = LoadVolatile(&rd.priv->epoch);
  if (atomicCAS(reinterpret_cast<unsigned long long*>(&rd.priv->err_claim), 0ull, 1ull) == 0ull) {
    volatile ErrorRecord* e = &rd.shared->errors[rd.rank];
    e->rank = rd.rank;
    e->peer = peer;
    e->epoch = epoch;
    e->got = got;
    e->expected = expected;
    e->detail = sub;
    e->timeout_ms = LoadVolatile(&rd.priv->timeout_ms);
    __threadfence_system();
    e->code = code;
  }
  *reinterpret_cast<volatile uint64_t*>(&rd.priv->failed) = 1;
  __threadfence_system();
  StoreReleaseSys(&rd.shared->abort.value, 1);
  StopIfCaptured(rd);
}

__device__ inline void ReportBadInput(const RankDev& rd, uint64_t sub, uint64_t index, int64_t got, uint64_t bound) {
  RecordError(rd, kStageBadInput, sub, index, static_cast<uint64_t>(got), bound);
}

// Bounded wait (one thread) until *word >= base + count. On timeout records (rank, peer, stage, counts relative to
// base) and raises abort; on a peer's abort gives up silently (the next call reports the group's first failure).
// Inside a CUDA graph either way stops the device (StopIfCaptured).
//
// The group's abort word is host-mapped memory, and a GPU read of it crosses PCIe: read often by many waiting
// threads, those reads stall the producer's tiles on the same GPU (the producer span grows with the number of waiting
// consumer CTAs). So the abort word is read once per 1024 spins
// (about every millisecond once the sleeps are 1 us); relaxed polling loads or longer sleeps alone do not avoid the
// stall. Our own rank's failure and the deadline, both in device memory, are checked every 16 spins; a peer's abort
// is seen within about a millisecond.
__device__ inline bool WaitAtLeast(const RankDev& rd, const uint64_t* word, uint64_t base, uint64_t count,
                                   uint64_t peer, Stage stage) {
  const uint64_t target = base + count;
  const uint64_t deadline = LoadVolatile(&rd.priv->deadline_ns);
  for (uint32_t spin = 0;; ++spin) {
    const uint64_t v = LoadAcquireSys(word);
    if (v >= target) return true;
    if ((spin & 15) == 0) {
      // (From spin 1024 on: a wait that ends sooner, most of them, never reads host memory.)
      const bool peer_abort = spin >= 1024 && (spin & 1023) == 0 && LoadVolatile(&rd.shared->abort.value) != 0;
      if (peer_abort || LoadVolatile(&rd.priv->failed) != 0) {
        *reinterpret_cast<volatile uint64_t*>(&rd.priv->failed) = 1;
        StopIfCaptured(rd);
        return false;
      }
      if (GlobalTimer() > deadline) {
        RecordError(rd, stage, 0, peer, v - base, count);
        return false;
      }
    }
    if (spin > 32) __nanosleep(spin > 1024 ? 1000 : 100);
  }
}

// Closes the call: consumed rows are accounted, then done_epoch = epoch (release) lets peers write again. Run by one
// thread once every read of the call's recv (which = 0) or ret (which = 1) rows is done.
__device__ inline void CloseCall(const RankDev& rd, int64_t expected, int which) {
  if (LoadVolatile(&rd.priv->failed)) return;
  RankControl* ctl = View(rd, rd.rank).control();
  uint64_t* counter = which == 0 ? &ctl->recv_expected.value : &ctl->ret_expected.value;
  *reinterpret_cast<volatile uint64_t*>(counter) = LoadVolatile(counter) + static_cast<uint64_t>(expected);
  __threadfence_system();
  StoreReleaseSys(&ctl->done_epoch.value, LoadVolatile(&rd.priv->epoch));
}

// Every kernel starts with this: epoch of the call, and whether it already failed (a captured call stops there
// rather than skip its work).
struct CallState {
  uint64_t epoch;
  int ok;
};

__device__ inline void LoadCallState(const RankDev& rd, CallState* s) {
  if (threadIdx.x == 0) {
    s->epoch = LoadVolatile(&rd.priv->epoch);
    s->ok = LoadVolatile(&rd.priv->failed) == 0;
    if (!s->ok) StopIfCaptured(rd);
  }
  __syncthreads();
}

}  // namespace jmo::cuda
