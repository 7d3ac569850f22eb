// CUDA kernels of dispatch and expert_combine, following protocol.h step by step (the CPU handlers in
// csrc/cpu/handlers_cpu.cc are the executable specification; this file does the same on the device).
//
// One call = a short sequence of kernels on the caller's stream:
//   Begin     (1 thread)  epoch = ++calls, deadline = now + timeout, the testing delay, operand checks.
//   dispatch:       Push (push rows to peers' recv, then release-add their recv_arrivals)
//                   Recv (acquire-wait for own arrivals, copy recv -> out)      End (recv_expected, done_epoch)
//   expert_combine: Expert (producer CTAs: grouped GEMM -> stage, flag each band; consumer CTAs: push bands to
//                   the source ranks' ret rows, release-add ret_arrivals)
//                   Combine (acquire-wait for own ret rows, y = sum_j gates * ret)   End (ret_expected, done_epoch)
// Epoch state lives in device memory (RankControl::calls, RankPrivate), so no kernel depends on host values that
// change per call: a step toward CUDA-graph capture.
//
// Memory ordering: data stores -> every storing thread fences at system scope -> CTA barrier -> one thread
// red.release.sys on the peer's counter. Readers: one thread ld.acquire.sys polls, CTA barrier, then all threads
// read with ld.global.cg (L2, never a stale L1 line). Every wait is bounded by the call's deadline (%globaltimer)
// and gives up at once when the group's abort word (host-mapped) is raised.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include "cuda/bulk_copy.cuh"
#include "cuda/combine_gather.cuh"
#include "cuda/consumer_choice.cuh"
#include "cuda/gemm_tile.cuh"
#include "cuda/kernels.h"
#include "cuda/wgmma/wgmma_gemm.cuh"
#include "cuda/wgmma/wgmma_tile_loop.cuh"

namespace jmo::cuda {
namespace {

using bf16 = __nv_bfloat16;

// ---------------------------------------------------------------------------------------------------------------
// Device primitives

__device__ __forceinline__ uint64_t GlobalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint64_t LoadAcquireSys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t LoadVolatile(const uint64_t* p) {
  return *reinterpret_cast<const volatile uint64_t*>(p);
}
__device__ __forceinline__ void StoreReleaseSys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void StoreReleaseGpu(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void AddReleaseSys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ RankView View(const RankDev& rd, int r) { return RankView{rd.peers.base[r], rd.layout}; }

// Records this rank's first failure in its ErrorRecord (host-mapped), marks the call failed and raises the group's
// abort word. Called by one thread.
__device__ void RecordError(const RankDev& rd, uint64_t code, uint64_t sub, uint64_t peer, uint64_t got,
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
}

__device__ void ReportBadInput(const RankDev& rd, uint64_t sub, uint64_t index, int64_t got, uint64_t bound) {
  RecordError(rd, kStageBadInput, sub, index, static_cast<uint64_t>(got), bound);
}

// Bounded wait (one thread) until *word >= base + count. On timeout records (rank, peer, stage, counts relative to
// base) and raises abort; on a peer's abort gives up silently (the next call reports the group's first failure).
//
// The group's abort word is host-mapped memory, and a GPU read of it crosses PCIe. Read every 16 spins by each
// waiting thread, it stalled the *producer's* tiles on the same GPU: in the loopback harness (R = 2, serialized, the
// consumers of both ranks waiting for their producers) the producer span grew with the number of waiting consumer
// CTAs, 0.18 ms at C = 1 to 18.1 ms at C = 32 per rank, and skewed workloads, whose light rank waits in CombineKernel
// while the heavy rank computes, took 44-84 ms instead of 3.5 ms. Read once per 1024 spins (about every millisecond
// once the sleeps are 1 us): 0.35 ms at C = 32; relaxed polling loads or longer sleeps alone did not help
// (benchmarks/RESULTS.md, session 5, call 3). Our own rank's failure and the deadline, both on the GPU, are still
// checked every 16 spins; a peer's abort is seen within about a millisecond (the first look at spin 1024, after
// ~0.1 ms of waiting).
__device__ bool WaitAtLeast(const RankDev& rd, const uint64_t* word, uint64_t base, uint64_t count, uint64_t peer,
                            Stage stage) {
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

// Block-wide copy of `bytes` from src to dst: 16-byte vectors when both are 16-byte aligned, else 4 or 2 bytes.
// Loads bypass L1 (ld.global.cg): the source may have been written by another SM or GPU during this kernel.
__device__ void CopyBytes(char* dst, const char* src, int64_t bytes, int64_t tid, int64_t nthreads) {
  const uintptr_t align = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  if ((align & 15) == 0) {
    const int64_t n = bytes / 16;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t i = tid; i < n; i += nthreads) d[i] = __ldcg(s + i);
    for (int64_t i = n * 16 + tid; i < bytes; i += nthreads) dst[i] = src[i];
  } else if ((align & 3) == 0) {
    const int64_t n = bytes / 4;
    const unsigned* s = reinterpret_cast<const unsigned*>(src);
    unsigned* d = reinterpret_cast<unsigned*>(dst);
    for (int64_t i = tid; i < n; i += nthreads) d[i] = __ldcg(s + i);
    for (int64_t i = n * 4 + tid; i < bytes; i += nthreads) dst[i] = src[i];
  } else {
    const int64_t n = bytes / 2;
    const unsigned short* s = reinterpret_cast<const unsigned short*>(src);
    unsigned short* d = reinterpret_cast<unsigned short*>(dst);
    for (int64_t i = tid; i < n; i += nthreads) d[i] = __ldcg(s + i);
    for (int64_t i = n * 2 + tid; i < bytes; i += nthreads) dst[i] = src[i];
  }
}

// CopyBytes for the consumer's big contiguous bands: with 16-byte alignment, each thread first issues kUnroll
// independent 16-byte loads, then the stores, so an SM keeps 256 x 16 x 16 B = 64 KiB in flight (one load at a time
// per thread left the consumer latency-bound at ~9 GB/s per CTA on the H200).
__device__ void CopyBand(char* dst, const char* src, int64_t bytes, int64_t tid, int64_t nthreads) {
  constexpr int kUnroll = 16;
  const uintptr_t align = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  if ((align & 15) != 0) {
    CopyBytes(dst, src, bytes, tid, nthreads);
    return;
  }
  const int64_t n = bytes / 16;
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  int64_t i = tid;
  for (; i + (kUnroll - 1) * nthreads < n; i += kUnroll * nthreads) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldcg(s + i + u * nthreads);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[i + u * nthreads] = v[u];
  }
  for (; i < n; i += nthreads) d[i] = __ldcg(s + i);
  for (int64_t j = n * 16 + tid; j < bytes; j += nthreads) dst[j] = src[j];
}

__device__ void ZeroBytes(char* dst, int64_t bytes, int64_t tid, int64_t nthreads) {
  if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    const int64_t n = bytes / 16;
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t i = tid; i < n; i += nthreads) d[i] = make_uint4(0, 0, 0, 0);
    for (int64_t i = n * 16 + tid; i < bytes; i += nthreads) dst[i] = 0;
  } else {
    for (int64_t i = tid; i < bytes; i += nthreads) dst[i] = 0;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Begin / End

__global__ void BeginKernel(RankDev rd, const int32_t* group_op, const int32_t* rank_op, int64_t timeout_ns,
                            int64_t delay_ns) {
  const uint64_t begin_t = GlobalTimer();
  if (delay_ns > 0) {  // the testing delay: hold this rank back on its device (bounded by itself)
    const uint64_t t0 = GlobalTimer();
    while (GlobalTimer() - t0 < static_cast<uint64_t>(delay_ns)) __nanosleep(1000);
  }
  RankControl* ctl = View(rd, rd.rank).control();
  const uint64_t epoch = LoadVolatile(&ctl->calls.value) + 1;  // only this rank writes `calls`
  *reinterpret_cast<volatile uint64_t*>(&ctl->calls.value) = epoch;
  RankPrivate* p = rd.priv;
  p->epoch = epoch;
  p->deadline_ns = GlobalTimer() + static_cast<uint64_t>(timeout_ns);
  p->timeout_ms = static_cast<uint64_t>(timeout_ns / 1000000);
  p->prod_t0 = p->cons_t0 = p->comb_t0 = ~0ull;
  p->prod_t1 = p->cons_t1 = p->prod_t0_last = p->comb_t1 = 0;
  p->begin_t = begin_t;
  p->combine_done = 0;
  // An abort raised before this call began: do nothing; the next call's host side recovers and reports.
  p->failed = LoadVolatile(&rd.shared->abort.value) != 0 ? 1 : 0;
  __threadfence();
  if (rank_op != nullptr && group_op != nullptr && (rank_op[0] != rd.rank || group_op[0] != rd.group))
    ReportBadInput(rd, kBadRankOperands, static_cast<uint64_t>(group_op[0]), rank_op[0], static_cast<uint64_t>(rd.group));
}

// Closes the call: consumed rows are accounted, then done_epoch = epoch (release) lets peers write again. Run by one
// thread once every read of the call's recv (which = 0) or ret (which = 1) rows is done.
__device__ void CloseCall(const RankDev& rd, int64_t expected, int which) {
  if (LoadVolatile(&rd.priv->failed)) return;
  RankControl* ctl = View(rd, rd.rank).control();
  uint64_t* counter = which == 0 ? &ctl->recv_expected.value : &ctl->ret_expected.value;
  *reinterpret_cast<volatile uint64_t*>(counter) = LoadVolatile(counter) + static_cast<uint64_t>(expected);
  __threadfence_system();
  StoreReleaseSys(&ctl->done_epoch.value, LoadVolatile(&rd.priv->epoch));
}

__global__ void EndKernel(RankDev rd, const int32_t* expected, int which) { CloseCall(rd, expected[0], which); }

// Every kernel starts with this: epoch of the call, and whether it already failed.
struct CallState {
  uint64_t epoch;
  int ok;
};

__device__ void LoadCallState(const RankDev& rd, CallState* s) {
  if (threadIdx.x == 0) {
    s->epoch = LoadVolatile(&rd.priv->epoch);
    s->ok = LoadVolatile(&rd.priv->failed) == 0;
  }
  __syncthreads();
}

// ---------------------------------------------------------------------------------------------------------------
// dispatch

enum PushWhich { kPushAll = 0, kPushLocal = 1, kPushRemote = 2 };

// Step 2 of dispatch for slots p = first, first + stride, ... (one warp each; `first` differs per warp): the row
// src[src_row[p]] into peer dst_rank[p]'s recv row dst_row[p] with 16-byte stores, counted into sent[d] (shared).
// `which` picks the destinations this pass moves (the rank itself, the others, or all); invalid slots are reported
// by the pass that would move them to another rank.
__device__ void PushRows(const RankDev& rd, const char* src, int64_t S, int64_t row_bytes, const int32_t* src_row,
                         const int32_t* dst_rank, const int32_t* dst_row, int64_t P, int64_t cap, PushWhich which,
                         int64_t first, int64_t stride, unsigned* sent) {
  const int lane = threadIdx.x % 32, R = rd.ranks;
  for (int64_t p = first; p < P; p += stride) {
    const int d = dst_rank[p], row = dst_row[p], sr = src_row[p];
    if (which != kPushAll && (d == rd.rank) != (which == kPushLocal)) continue;
    if (d == -1) {
      if (lane == 0) ReportBadInput(rd, kBadExpertId, p, sr, 0);
      continue;
    }
    if (row < 0) continue;  // dropped by the capacity rule
    if (d < 0 || d >= R || row >= cap || sr < 0 || sr >= S) {
      if (lane == 0) ReportBadInput(rd, kBadRoute, p, (d < 0 || d >= R) ? d : (row >= cap ? row : sr), (d < 0 || d >= R) ? R : (row >= cap ? cap : S));
      continue;
    }
    CopyBytes(View(rd, d).recv() + (int64_t)row * row_bytes, src + (int64_t)sr * row_bytes, row_bytes, lane, 32);
    if (lane == 0) atomicAdd(&sent[d], 1u);
  }
}

// Step 1 of dispatch, by every thread of a pushing CTA: thread 0 waits until every destination has finished reading
// call epoch - 1 (st is written by thread 0 only until the barrier: racecheck-clean); sent[] is zeroed. False if the
// call failed (here or before).
__device__ bool BeginPush(const RankDev& rd, CallState* st, unsigned* sent) {
  if (threadIdx.x == 0) {
    for (int i = 1; i <= rd.ranks && st->ok; ++i) {
      const int d = (rd.rank + i) % rd.ranks;
      st->ok = WaitAtLeast(rd, &View(rd, d).control()->done_epoch.value, 0, st->epoch - 1, d, kStagePeerReady);
    }
  }
  if (threadIdx.x < kMaxRanks) sent[threadIdx.x] = 0;
  __syncthreads();
  return st->ok;
}

__global__ void __launch_bounds__(kThreads) PushKernel(RankDev rd, const char* src, int64_t S, int64_t row_bytes,
                                                       const int32_t* src_row, const int32_t* dst_rank,
                                                       const int32_t* dst_row, int64_t P, int64_t cap) {
  __shared__ CallState st;
  __shared__ unsigned sent[kMaxRanks];
  LoadCallState(rd, &st);
  const int R = rd.ranks;
  if (!BeginPush(rd, &st, sent)) return;
  const int warps = blockDim.x / 32;
  PushRows(rd, src, S, row_bytes, src_row, dst_rank, dst_row, P, cap, kPushAll,
           (int64_t)blockIdx.x * warps + threadIdx.x / 32, (int64_t)gridDim.x * warps, sent);
  __threadfence_system();
  __syncthreads();
  // Then release-add the rows to each destination's arrival counter.
  if (threadIdx.x < R && sent[threadIdx.x] > 0)
    AddReleaseSys(&View(rd, threadIdx.x).control()->recv_arrivals.value, sent[threadIdx.x]);
}

__global__ void __launch_bounds__(kThreads) RecvKernel(RankDev rd, const int32_t* expected_p, char* out, int64_t cap,
                                                       int64_t row_bytes) {
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
  CopyBytes(out, View(rd, rd.rank).recv(), expected * row_bytes, tid, n);
  ZeroBytes(out + expected * row_bytes, (cap - expected) * row_bytes, tid, n);
}

// ---------------------------------------------------------------------------------------------------------------
// expert_combine: the segment table (built by every CTA from the device-side plan arrays)

struct TableScratch {
  Segment raw[kMaxSegments];         // in plan order (expert-major)
  int64_t rows_to_rank[kMaxRanks];
  int32_t segs_of_rank[kMaxRanks];   // kept (non-empty) segments per source
  int64_t warp_sums[32];
  int32_t first_bad;
};

__device__ __forceinline__ int32_t BandsOf(int32_t rows) { return (rows + (int32_t)kBandRows - 1) / (int32_t)kBandRows; }

// Builds the table from the device-side plan arrays, one thread per segment (E_l * R <= kMaxSegments <= blockDim.x):
// offsets by prefix sums, each segment's place in producer order by counting the segments SegmentBefore puts first
// (by source, then by expert within its source). Every thread calls it and gets the same answer; false (and the error
// recorded, naming the first bad segment) on an invalid plan.
__device__ bool BuildSegments(const RankDev& rd, const int32_t* seg_rows, const int32_t* seg_ret_off, int E_l,
                              int64_t cap, SegTable* t, TableScratch* sc) {
  const int R = rd.ranks, n = E_l * R, tid = threadIdx.x;
  for (int s = tid; s < R; s += blockDim.x) {
    sc->rows_to_rank[s] = 0;
    sc->segs_of_rank[s] = 0;
  }
  if (tid == 0) sc->first_bad = n;
  const bool mine = tid < n;
  const int32_t rows = mine ? seg_rows[tid] : 0, ret_off = mine ? seg_ret_off[tid] : 0;
  const int32_t kept = rows > 0 ? rows : 0;
  int64_t total_rows = 0, total_bands = 0;
  const int64_t off = BlockInclusiveScan(kept, sc->warp_sums, &total_rows) - kept;  // (has synchronized the CTA)
  const int64_t band = BlockInclusiveScan(BandsOf(kept), sc->warp_sums, &total_bands) - BandsOf(kept);
  const bool over_cap = off + (int64_t)rows > cap;
  const bool bad = mine && (rows < 0 || over_cap || ret_off < 0 || (int64_t)ret_off + rows > rd.sizes.ret_rows);
  if (bad) atomicMin(&sc->first_bad, tid);
  if (mine) {
    sc->raw[tid] = Segment{tid / R, tid % R, (int32_t)off, rows, ret_off, (int32_t)band};
    if (rows > 0) {
      atomicAdd(reinterpret_cast<unsigned long long*>(&sc->rows_to_rank[tid % R]), (unsigned long long)rows);
      atomicAdd(&sc->segs_of_rank[tid % R], 1);
    }
  }
  __syncthreads();
  if (sc->first_bad < n) {
    if (tid == sc->first_bad)  // the segments before it are valid, so `off` is the CPU handler's offset too
      ReportBadInput(rd, kBadSegment, tid, rows < 0 ? rows : (over_cap ? off + (int64_t)rows : ret_off),
                     over_cap ? cap : rd.sizes.ret_rows);
    return false;
  }
  if (total_bands > rd.sizes.max_bands) {
    if (tid == 0) ReportBadInput(rd, kBadTooManyTiles, 0, total_bands, rd.sizes.max_bands);
    return false;
  }
  const bool kept_seg = mine && rows > 0;
  if (kept_seg) {
    // Place by counting what SegmentBefore puts first, in O(R + E_l) rather than O(R E_l): the kept segments of the
    // sources before ours, then those of our source with a smaller expert (raw index = expert * R + source).
    const int src = tid % R, expert = tid / R;
    int pos = 0;
    for (int u = 0; u < R; ++u)
      if (u != src && SourceBefore(u, src, rd.rank, sc->rows_to_rank)) pos += sc->segs_of_rank[u];
    for (int e = 0; e < expert; ++e) pos += sc->raw[e * R + src].rows > 0;
    t->seg[pos] = sc->raw[tid];
  }
  const int m = __syncthreads_count(kept_seg);
  const int remote = __syncthreads_count(kept_seg && tid % R != rd.rank);
  const int32_t nb = tid < m ? BandsOf(t->seg[tid].rows) : 0;
  int64_t bands = 0;
  const int64_t bend = BlockInclusiveScan(nb, sc->warp_sums, &bands);
  if (tid < m) t->band_prefix[tid] = (int32_t)(bend - nb);
  if (tid == 0) {
    t->band_prefix[m] = (int32_t)bands;
    t->n = m;
    t->bands = (int32_t)bands;
    t->remote_segs = remote;
    t->remote_rows = total_rows - sc->rows_to_rank[rd.rank];
  }
  __syncthreads();
  if (tid == 0) t->remote_bands = t->band_prefix[remote];
  __syncthreads();
  return true;
}

__device__ __forceinline__ int FindSegment(const SegTable& t, int band) {
  int lo = 0, hi = t.n - 1;  // last i with band_prefix[i] <= band
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.band_prefix[mid] <= band) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// ---------------------------------------------------------------------------------------------------------------
// The resource manager's choice of C on the device: consumer_choice.cuh (also built into decision_probe.cu).

// What ExpertKernel is told about C.
struct Policy {
  ModelParams model;  // sms = the rank's SM budget, ctas_per_sm = 1
  int32_t use_model;  // 1: choose on the device; 0: `consumers`
  int32_t consumers;  // pinned or fixed C
  int32_t max_ctas;   // candidates 1..max_ctas (ModelMaxCtas(budget))
  int32_t serialize;
  int32_t smem_bytes;  // dynamic shared memory of the launch (a consumer CTA's bulk-copy ring lives there)
  int32_t bulk_copy;   // 1: TMA bulk copies on sm_90 (bulk_copy.cuh); 0: CopyBand (JMO_CONSUMER_COPY=plain)
  int32_t push_slots;     // bulk copies: ring slots (JMO_PUSH_SLOTS, default 12)
  int32_t push_read_lag;  // bulk copies: stores allowed to be reading their slot (JMO_PUSH_READ_LAG, default 4)
  int32_t push_issuers;   // bulk copies: issuing threads per consumer CTA, one ring each (JMO_PUSH_ISSUERS)
  int64_t elem_bytes;
  CandidateConsts cand;  // use_model: FillCandidateConsts(model, max_ctas, N)
};

// C of one call (every thread calls it): none when the call has no remote band (EP = 1, or nothing routed to other
// ranks; every CTA then produces), else the pinned or fixed C, or the model's choice. Python mirror:
// resource.kernel_consumer_ctas.
__device__ int ConsumersOfCall(const SegTable& t, const Policy& pol, int64_t N, int64_t K, ChoiceScratch* sc) {
  if (t.remote_bands == 0) return 0;
  return pol.use_model ? DeviceChooseConsumers(t, pol.model, pol.cand, N, K, pol.elem_bytes, pol.max_ctas, sc)
                       : pol.consumers;
}

// ---------------------------------------------------------------------------------------------------------------
// Producer engines. A finished tile is counted per 64-row band it covers; the CTA completing a band's last column
// tile publishes the band (fence, release-store of tile_ready = epoch), which is all the consumer waits for.
//
// kTransB (every engine): w is [E_l, N, K] and the producer reads w[e]^T in place (the input gradient dy @ W^T of
// the backward pass), else w is [E_l, K, N]. Meaning as in gemm_tile.cuh: B[k, n] = kTransB ? w_e[n K + k]
// : w_e[k N + n].

enum Engine : int { kSimt = 0, kMmaSync = 1, kWgmma = 2 };
template <int kEngine>
constexpr int kEngineThreads = kEngine == kWgmma ? wgmma_gemm::kThreads : kThreads;

// Called by one thread after the tile's stores are fenced and every storing thread has passed a barrier: the CTA
// completing a band of a remote segment publishes it through its tile_ready flag (the consumer pushes it). Tiles of
// local segments publish nothing: see CountLocalRows.
__device__ __forceinline__ void PublishTile(const RankDev& rd, uint64_t* flags, int first_flag, int bands,
                                            int col_tiles, uint64_t epoch) {
  for (int b = 0; b < bands; ++b) {
    if (atomicAdd(&rd.band_done[first_flag + b], 1u) == (unsigned)(col_tiles - 1)) {
      __threadfence();
      StoreReleaseGpu(&flags[first_flag + b], epoch);
    }
  }
}

// Every thread of every producer CTA calls this once it has stored all its tiles. The rows of local segments (stored
// in place in this rank's ret rows; no consumer and no peer reads them, only this rank's CombineKernel, later on the
// stream) are counted into ret_arrivals once, by the last producer CTA to finish: each thread's fence and the CTA
// barrier order the CTA's stores before its producers_done add, so the last adder's count follows every store of
// the call. This keeps the per-tile fence and consumer barrier off local tiles (all tiles at EP = 1). Also what the
// serialized mode's consumer waits for (producers_done == producer CTAs).
__device__ void CountLocalRows(const RankDev& rd, const SegTable& t, int producers) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (atomicAdd(reinterpret_cast<unsigned long long*>(rd.producers_done), 1ull) != (unsigned long long)(producers - 1))
    return;
  uint64_t local_rows = 0;
  for (int i = t.remote_segs; i < t.n; ++i) local_rows += (uint64_t)t.seg[i].rows;
  __threadfence();
  if (local_rows > 0) AddReleaseSys(&View(rd, rd.rank).control()->ret_arrivals.value, local_rows);
}

// Where a producer tile of segment s goes: the stage rows the consumer pushes from, or for a local segment the
// rank's own ret rows (no push). `row` is the tile's first row within the segment.
template <typename T>
__device__ __forceinline__ T* TileOut(const RankDev& rd, const Segment& s, int row, int64_t n0, int64_t N, T* stage,
                                      T* ret) {
  return s.src == rd.rank ? ret + ((int64_t)s.ret_off + row) * N + n0 : stage + ((int64_t)s.recv_off + row) * N + n0;
}

// mma.sync / SIMT engine (gemm_tile.cuh): one band (64 rows) x kTileN columns per tile.
constexpr int BM = 64;
constexpr int BN = kTileN;
static_assert(BM == kBandRows, "a producer tile is one row band");
static_assert(kTileThreads == kThreads, "the tile engine assumes the kernels' CTA size");
constexpr int kTcSmemBytes = TcLayout<BM>::kSmemBytes;
constexpr int kSimtSmemBytes = SimtSmemBytes<BM>();

template <typename T, bool kTensorCores, bool kTransB>
__device__ void ProduceBands(const RankDev& rd, const SegTable& table, uint64_t epoch, const T* __restrict__ lhs,
                             const T* __restrict__ w, int64_t K, int64_t N, T* stage, T* ret, uint64_t* flags, int pid,
                             int np, char* smem) {
  const int64_t ntiles = (N + BN - 1) / BN;
  const int64_t tiles = (int64_t)table.bands * ntiles;
  for (int64_t t = pid; t < tiles; t += np) {
    const int band = (int)(t / ntiles);
    const int64_t n0 = (t % ntiles) * BN;
    const Segment& s = table.seg[FindSegment(table, band)];
    const int b = band - table.band_prefix[&s - table.seg];
    const int64_t row0 = s.recv_off + (int64_t)b * BM;
    const int rows = min((int)BM, s.rows - b * (int)BM);
    const T* w_e = w + (int64_t)s.expert * K * N;
    // Column n0 of B: column n0 of row 0 of w_e [K, N], or row n0 of w_e [N, K].
    const TileArgs<T, T> tile{lhs + row0 * K, K, w_e + n0 * (kTransB ? K : 1), kTransB ? K : N,
                              TileOut(rd, s, b * BM, n0, N, stage, ret), N, rows, (int)min((int64_t)BN, N - n0),
                              (int)K};
    if constexpr (kTensorCores)
      TcTile<BM, false, kTransB, T>(tile, smem);
    else
      SimtTile<BM, false, kTransB, T, T>(tile, smem);
    const bool publish = s.src != rd.rank;  // (uniform in the CTA)
    if (publish) __threadfence();
    __syncthreads();
    if (publish && threadIdx.x == 0) PublishTile(rd, flags, s.band_base + b, 1, (int)ntiles, epoch);
  }
}

// wgmma engine (sm_90a, csrc/cuda/wgmma): 128 rows (two bands) x 256 columns of one segment per tile, TMA-fed,
// warp-specialized (384 threads). tile_prefix[i] = tiles of the segments before segment i, in producer order.
constexpr int kWgBM = wgmma_gemm::kBM;
constexpr int kWgBN = wgmma_gemm::kBN;
static_assert(kWgBM % kBandRows == 0, "a wgmma tile covers whole bands");

struct WgTile : wgmma_gemm::WgmmaTile {
  int flag;   // tile_ready index of the tile's first band
  int bands;  // bands the tile covers (1 or 2)
};

static_assert(kMaxSegments <= wgmma_gemm::kThreads, "one thread per segment for the tile prefix scan");

// tile_prefix[i] = wgmma tiles of the segments before segment i (tile_prefix[n] = all of them), col_tiles per 128-row
// block: one thread per segment and a block scan (kMaxSegments <= the CTA's threads), not one thread's loop over up
// to 256 segments with a division each (microseconds at kernel start, on every CTA). Every thread calls it.
__device__ void WgmmaTilePrefix(const SegTable& table, int col_tiles, int32_t* tile_prefix, int64_t* warp_sums) {
  const int i = threadIdx.x;
  const int64_t tiles = i < table.n ? (int64_t)((table.seg[i].rows + kWgBM - 1) / kWgBM) * col_tiles : 0;
  int64_t total = 0;
  const int64_t incl = BlockInclusiveScan(tiles, warp_sums, &total);
  if (i < table.n) tile_prefix[i] = (int32_t)(incl - tiles);
  if (i == 0) tile_prefix[table.n] = (int32_t)total;
  __syncthreads();
}

// Wgmma tile j of the table (tiles in segment order, WgmmaTilePrefix): its segment, its 128-row block within the
// segment (mt), and the tile's A row, expert, columns and rows; out, ldc and publish are the caller's. Inside a
// segment the tiles go in bands of band_m row blocks (wgmma_gemm::BandRaster).
struct SegmentTile {
  const Segment* s;
  int mt;
  wgmma_gemm::WgmmaTile t;
};
__device__ __forceinline__ SegmentTile WgmmaTileAt(const SegTable& table, const int32_t* tile_prefix, int col_tiles,
                                                   int64_t N, int j, int band_m) {
  int lo = 0, hi = table.n - 1;  // the segment holding tile j: last lo with tile_prefix[lo] <= j
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile_prefix[mid] <= j) lo = mid; else hi = mid - 1;
  }
  const Segment& s = table.seg[lo];
  int mt, nt;
  wgmma_gemm::BandRaster(j - tile_prefix[lo], (s.rows + kWgBM - 1) / kWgBM, col_tiles, band_m, &mt, &nt);
  SegmentTile at{&s, mt, {}};
  at.t.a_row = s.recv_off + mt * kWgBM;
  at.t.b_idx = s.expert;
  at.t.n0 = nt * kWgBN;
  at.t.rows = min(kWgBM, s.rows - mt * kWgBM);
  at.t.cols = (int)min((int64_t)kWgBN, N - at.t.n0);
  return at;
}

template <bool kTransB>
__device__ void ProduceWgmma(const RankDev& rd, const SegTable& table, uint64_t epoch, const CUtensorMap& a_map,
                             const CUtensorMap& b_map, int64_t K, int64_t N, bf16* stage, bf16* ret, uint64_t* flags,
                             int pid, int np, int32_t* tile_prefix, int64_t* warp_sums, char* smem) {
  const int col_tiles = (int)((N + kWgBN - 1) / kWgBN);
  WgmmaTilePrefix(table, col_tiles, tile_prefix, warp_sums);
  auto tile_of = [&](int i) {
    // Row-block order (band_m = 1): a row block's flags complete together, so the consumer can ship it early.
    const SegmentTile at = WgmmaTileAt(table, tile_prefix, col_tiles, N, i, 1);
    WgTile t;
    static_cast<wgmma_gemm::WgmmaTile&>(t) = at.t;
    t.out = TileOut(rd, *at.s, at.mt * kWgBM, t.n0, N, stage, ret);
    t.ldc = N;
    t.flag = at.s->band_base + at.mt * (kWgBM / (int)kBandRows);
    t.bands = (t.rows + (int)kBandRows - 1) / (int)kBandRows;
    t.publish = at.s->src != rd.rank;  // local tiles: no fence, no barrier, no flag (CountLocalRows)
    return t;
  };
  auto tile_done = [&](const WgTile& t) { PublishTile(rd, flags, t.flag, t.bands, col_tiles, epoch); };
  // The loop's kTransB is the wgmma instruction's operand layout, the opposite sense of ours: 1 = B MN-major (w [E_l,
  // K, N], b_map built with b_k_major = false), 0 = B K-major (w [E_l, N, K], b_k_major = true), as the bare grouped
  // GEMM's transpose_rhs (wgmma_gemm.cuh, GroupedGemmWithDone).
  wgmma_gemm::WgmmaTileLoop<kTransB ? 0 : 1, false>(a_map, b_map, (int)K, pid, np, tile_prefix[table.n], tile_of,
                                                    tile_done, smem);
}

// ---------------------------------------------------------------------------------------------------------------
// The overlapped operator: producer and consumer CTAs of one launch, roles by block index.
//
// Co-residency. CTAs [0, C) are the consumer, CTAs [C, grid) the producer, grid <= the rank's SM budget, and the
// dynamic shared memory of this kernel is padded to more than half an SM's, so at most one CTA fits per SM: every
// consumer CTA sits on an SM of its own, and the whole grid is resident at once (grid <= SMs; the host checks the
// occupancy). Progress never depends on co-residency: producer CTAs wait for nothing, so even if the hardware
// scheduled consumers first and producers later (or the reverse), every wait is eventually satisfied; co-residency is
// what gives the overlap. One ordinary launch rather than a cooperative one: in the loopback harness R ranks' grids
// run concurrently from R streams, and all of them must be resident together, which per-rank SM budgets give.
template <typename T, int kEngine, bool kTransB>
__global__ void __launch_bounds__(kEngineThreads<kEngine>, 1)
    ExpertKernel(RankDev rd, const T* __restrict__ lhs, const T* __restrict__ w, int64_t cap, int64_t K, int64_t N,
                 const int32_t* seg_rows, const int32_t* seg_ret_off, int E_l, const __grid_constant__ Policy pol,
                 const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map) {
  extern __shared__ __align__(16) char smem[];
  __shared__ int32_t tile_prefix[kEngine == kWgmma ? kMaxSegments + 1 : 1];
  __shared__ CallState st;
  __shared__ SegTable table;
  __shared__ TableScratch scratch;
  __shared__ ChoiceScratch choice;
  __shared__ int wait_ok;
  LoadCallState(rd, &st);
  if (!st.ok) return;
  if (!BuildSegments(rd, seg_rows, seg_ret_off, E_l, cap, &table, &scratch)) return;
  const int consumers = ConsumersOfCall(table, pol, N, K, &choice);
  const int64_t row_bytes = N * (int64_t)sizeof(T);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    rd.priv->consumers = (uint64_t)consumers;
    rd.priv->pushed_bytes = (uint64_t)(table.remote_rows * row_bytes);
  }
  RankView self = View(rd, rd.rank);
  T* stage = reinterpret_cast<T*>(self.stage());
  T* ret = reinterpret_cast<T*>(self.ret());
  uint64_t* flags = self.tile_ready();

  if ((int)blockIdx.x >= consumers) {
    // Producer: tiles in producer order (remote-critical segments first), statically striped over the CTAs.
    const int pid = blockIdx.x - consumers, np = gridDim.x - consumers;
    if (threadIdx.x == 0 && pid < table.bands) {
      const unsigned long long now = GlobalTimer();
      atomicMin(reinterpret_cast<unsigned long long*>(&rd.priv->prod_t0), now);
      atomicMax(reinterpret_cast<unsigned long long*>(&rd.priv->prod_t0_last), now);
    }
    if constexpr (kEngine == kWgmma)
      ProduceWgmma<kTransB>(rd, table, st.epoch, a_map, b_map, K, N, stage, ret, flags, pid, np, tile_prefix,
                            scratch.warp_sums, smem);
    else
      ProduceBands<T, kEngine == kMmaSync, kTransB>(rd, table, st.epoch, lhs, w, K, N, stage, ret, flags, pid, np,
                                                    smem);
    CountLocalRows(rd, table, np);
    if (threadIdx.x == 0 && pid < table.bands)
      atomicMax(reinterpret_cast<unsigned long long*>(&rd.priv->prod_t1), (unsigned long long)GlobalTimer());
    return;
  }

  // Consumer: the remote bands [0, remote_bands) in producer order; CTA c pushes bands c, c + C, c + 2 C, ...
  const int first = blockIdx.x;
  const int count = first < table.remote_bands ? (table.remote_bands - 1 - first) / consumers + 1 : 0;
  if (count == 0) return;
  if (pol.serialize) {
    // The baseline without overlap: start pushing only once every producer CTA has stored all its tiles.
    if (threadIdx.x == 0)
      wait_ok = WaitAtLeast(rd, rd.producers_done, 0, (uint64_t)(gridDim.x - consumers), rd.rank, kStageTileReady);
    __syncthreads();
    const int ok = wait_ok;
    __syncthreads();  // every thread has read wait_ok before thread 0 writes it again below
    if (!ok) return;
  }
  if (threadIdx.x == 0)
    atomicMin(reinterpret_cast<unsigned long long*>(&rd.priv->cons_t0), (unsigned long long)GlobalTimer());
  struct BandAt {
    const Segment* s;
    int b;     // band within the segment
    int rows;
  };
  auto band_at = [&](int i) {
    const int band = first + i * consumers;
    const Segment& s = table.seg[FindSegment(table, band)];
    const int b = band - table.band_prefix[&s - table.seg];
    return BandAt{&s, b, min((int)kBandRows, s.rows - b * (int)kBandRows)};
  };
  // A band is contiguous on both ends: rows x N at stage row (recv_off + 64 b) -> source's ret row (ret_off + 64 b).
  auto src_of = [&](const BandAt& a) {
    return reinterpret_cast<const char*>(stage) + ((int64_t)a.s->recv_off + (int64_t)a.b * kBandRows) * row_bytes;
  };
  auto dst_of = [&](const BandAt& a) {
    return View(rd, a.s->src).ret() + ((int64_t)a.s->ret_off + (int64_t)a.b * kBandRows) * row_bytes;
  };
  auto arrivals_of = [&](const BandAt& a) { return &View(rd, a.s->src).control()->ret_arrivals.value; };
  // The source must have finished reading its ret rows of the previous call; then the band must be ready. A source's
  // done_epoch only grows during the call, so once a thread has seen it (with an acquire, which orders everything the
  // thread does after it) it skips that read -- a remote one over NVLink -- for the source's later bands.
  uint32_t peers_seen = 0;  // this thread's: bit s = source s has finished the previous call
  auto peer_ready = [&](int src, bool block) {
    if ((peers_seen >> src) & 1u) return true;
    const uint64_t* done = &View(rd, src).control()->done_epoch.value;
    const bool ok = block ? WaitAtLeast(rd, done, 0, st.epoch - 1, src, kStagePeerReady)
                          : LoadAcquireSys(done) >= st.epoch - 1;
    if (ok) peers_seen |= 1u << src;
    return ok;
  };
  static_assert(kMaxRanks <= 32, "peers_seen holds one bit per rank");
  auto wait_ready = [&](const BandAt& a) {
    return peer_ready(a.s->src, true) &&
           WaitAtLeast(rd, &flags[a.s->band_base + a.b], 0, st.epoch, rd.rank, kStageTileReady);
  };
#if WGMMA_SM90A
  // Issuers: lane 0 of warps 0..W-1, each streaming every W-th of the CTA's bands through its own ring (a slice of
  // the dynamic shared memory).
  const int issuers = max(1, min(pol.push_issuers, (int)(blockDim.x / 32)));
  const int slots = min(pol.push_slots, (pol.smem_bytes / issuers - PushRingBytes(0)) / kPushChunkBytes);
  if (pol.bulk_copy && row_bytes % 16 == 0 && slots >= 2) {
    // TMA bulk copies, driven by `issuers` threads (bulk_copy.cuh).
    const int w = threadIdx.x / 32;
    if (threadIdx.x % 32 != 0 || w >= issuers) return;
    const int mine = count > w ? (count - 1 - w) / issuers + 1 : 0;
    auto band_at_w = [&](int i) { return band_at(w + i * issuers); };
    auto ready = [&](int i, bool block) {
      const BandAt a = band_at_w(i);
      if (block) return wait_ready(a);
      return peer_ready(a.s->src, false) && LoadAcquireSys(&flags[a.s->band_base + a.b]) >= st.epoch;
    };
    auto band_of = [&](int i) {
      const BandAt a = band_at_w(i);
      return PushBand{src_of(a), dst_of(a), (int64_t)a.rows * row_bytes};
    };
    auto done = [&](int i) {
      const BandAt a = band_at_w(i);
      __threadfence_system();
      AddReleaseSys(arrivals_of(a), (uint64_t)a.rows);
    };
    if (StreamBands(mine, ready, band_of, done, smem + (int64_t)w * PushRingBytes(slots), slots,
                    min(pol.push_read_lag, slots - 1)))
      atomicMax(reinterpret_cast<unsigned long long*>(&rd.priv->cons_t1), (unsigned long long)GlobalTimer());
    return;
  }
#endif
  for (int i = 0; i < count; ++i) {
    const BandAt a = band_at(i);
    if (threadIdx.x == 0) wait_ok = wait_ready(a);
    __syncthreads();
    if (!wait_ok) return;
    CopyBand(dst_of(a), src_of(a), (int64_t)a.rows * row_bytes, threadIdx.x, blockDim.x);
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) AddReleaseSys(arrivals_of(a), (uint64_t)a.rows);
  }
  if (threadIdx.x == 0)
    atomicMax(reinterpret_cast<unsigned long long*>(&rd.priv->cons_t1), (unsigned long long)GlobalTimer());
}

// ---------------------------------------------------------------------------------------------------------------
// dispatch_gemm: the dispatch and GEMM1 in one launch, so that GEMM1 runs while the tokens are still in flight (the
// dispatch-side producer / consumer; expert_combine is the return side). Roles by block index, one CTA per SM as in
// ExpertKernel (the same co-residency argument: every CTA of every rank is resident, so the waits below end):
//   pushers  CTAs [0, pushers): this rank's rows for the other ranks; each CTA release-adds what it moved per
//            destination into the destination's src_arrivals[rank] and recv_arrivals.
//   GEMM1    CTAs [pushers, grid): first, together, the rows this rank keeps into its own recv (counted the same way),
//            then the grouped GEMM over recv's (expert, source) segments, A read by TMA straight from the workspace's
//            recv rows, the rank's own segments first, then the other sources'; the TMA thread waits for a segment's
//            source to have pushed all its rows (src_arrivals) before the tile's first load.
// a [cap, N] float32 = recv[segment] @ w[expert] on every kept row, zero on the rows past them. The call then ends as
// a dispatch does (RecvKernel copies recv to x_recv, EndKernel frees recv for the next call); the last GEMM1 CTA
// advances src_expected.
struct DispatchGemmArgs {
  const char* src;       // x [S, K] bf16 (row_bytes = K * 2)
  int64_t S, row_bytes;
  const int32_t *src_row, *dst_rank, *dst_row;  // the dispatch plan's slots [P]
  int64_t P, cap;
  const int32_t *seg_rows, *seg_ret_off;  // [E_l * R] rows this rank receives per (expert, source) (and, unused
                                          // here but validated as in expert_combine, where their outputs return)
  int E_l, pushers;
  int64_t K, N;
  float* a;              // [cap, N]
};

__global__ void __launch_bounds__(wgmma_gemm::kThreads, 1)
    DispatchGemmKernel(RankDev rd, const __grid_constant__ DispatchGemmArgs g,
                       const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map) {
  extern __shared__ __align__(16) char smem[];
  __shared__ CallState st;
  __shared__ unsigned sent[kMaxRanks];
  __shared__ int32_t tile_prefix[kMaxSegments + 1];
  __shared__ SegTable table;
  __shared__ TableScratch scratch;
  LoadCallState(rd, &st);
  if (!st.ok) return;
  const int R = rd.ranks;
  RankControl* self = View(rd, rd.rank).control();

  // Moves this CTA's share (slots first, first + stride, ...) of the rows `which` picks, then release-adds them per
  // destination into its src_arrivals[rank] and recv_arrivals.
  auto push = [&](PushWhich which, int64_t first, int64_t stride) {
    PushRows(rd, g.src, g.S, g.row_bytes, g.src_row, g.dst_rank, g.dst_row, g.P, g.cap, which, first, stride, sent);
    __threadfence_system();
    __syncthreads();
    for (int d = threadIdx.x; d < R; d += blockDim.x) {
      if (sent[d] > 0) {
        AddReleaseSys(&View(rd, d).control()->src_arrivals.rows[rd.rank], sent[d]);
        AddReleaseSys(&View(rd, d).control()->recv_arrivals.value, sent[d]);
      }
    }
  };
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32;
  if ((int)blockIdx.x < g.pushers) {  // the rows for the other ranks
    if (!BeginPush(rd, &st, sent)) return;
    push(kPushRemote, (int64_t)blockIdx.x * warps + warp, (int64_t)g.pushers * warps);
    return;
  }

  // GEMM1 CTAs first copy the rows this rank keeps into its own recv, all of them together: spread over a few
  // pushers the local copy would hold every GEMM1 tile back for longer than the copy over the whole GPU takes.
  // (Step 1 holds for the own recv by stream order.)
  const int pid = blockIdx.x - g.pushers, np = gridDim.x - g.pushers;
  if (threadIdx.x < kMaxRanks) sent[threadIdx.x] = 0;
  __syncthreads();
  push(kPushLocal, (int64_t)pid * warps + warp, (int64_t)np * warps);

  // GEMM1. The segment table in SegmentBefore order puts the remote segments first; this loop starts at the first
  // local tile instead (rotated): the rank's own rows are in first.
  if (!BuildSegments(rd, g.seg_rows, g.seg_ret_off, g.E_l, g.cap, &table, &scratch)) return;
  const int col_tiles = (int)((g.N + kWgBN - 1) / kWgBN);
  WgmmaTilePrefix(table, col_tiles, tile_prefix, scratch.warp_sums);
  const int total_tiles = tile_prefix[table.n], remote_tiles = tile_prefix[table.remote_segs];
  // Rows past the kept ones (recv is packed from row 0) are zero, as the bare grouped GEMM leaves them.
  int64_t kept_rows = 0;
  for (int s = 0; s < R; ++s) kept_rows += scratch.rows_to_rank[s];
  for (int64_t e = kept_rows * g.N + ((int64_t)pid * blockDim.x + threadIdx.x) * 4; e < g.cap * g.N;
       e += (int64_t)np * blockDim.x * 4)
    *reinterpret_cast<float4*>(g.a + e) = make_float4(0.f, 0.f, 0.f, 0.f);  // (N % 64 == 0: whole float4s)
  struct DgTile : wgmma_gemm::WgmmaTile {
    int src;  // the source rank of the tile's rows
  };
  auto tile_of = [&](int i) {
    const int j = total_tiles > 0 ? (i + remote_tiles) % total_tiles : 0;  // the local tiles first
    // Bands of row blocks (nothing reads a's rows during the call): GEMM1's N = 2 * d_ff spans up to ~100 n-tiles.
    const SegmentTile at = WgmmaTileAt(table, tile_prefix, col_tiles, g.N, j, wgmma_gemm::kBandM);
    DgTile t;
    static_cast<wgmma_gemm::WgmmaTile&>(t) = at.t;
    t.out = g.a + (int64_t)t.a_row * g.N + t.n0;
    t.ldc = g.N;
    t.publish = 0;
    t.src = at.s->src;
    return t;
  };
  // The TMA thread's wait for a tile's source, once per source (a source's count only grows during the call).
  uint32_t sources_in = 0;
  static_assert(kMaxRanks <= 32, "sources_in holds one bit per rank");
  auto tile_wait = [&](const DgTile& t) {
    if ((sources_in >> t.src) & 1u) return;
    const uint64_t base = LoadVolatile(&self->src_expected.rows[t.src]);  // (written by this rank only)
    // On failure the call is failed (the error names source and counts); the loop runs on rather than hang.
    // (Inlined into the 24-register TMA thread, the wait costs ptxas about 100 bytes of spills; out of line it
    // copied the whole RankDev to the stack, 480 bytes.)
    if (WaitAtLeast(rd, &self->src_arrivals.rows[t.src], base, (uint64_t)scratch.rows_to_rank[t.src], t.src,
                    kStageRecvArrivals))
      sources_in |= 1u << t.src;
    bulk::FenceProxyAsyncGlobal();  // the rows were stored by the generic proxy; TMA reads by the async one
  };
  wgmma_gemm::WgmmaTileLoop<1, true>(a_map, b_map, (int)g.K, pid, np, total_tiles, tile_of, wgmma_gemm::NoTileDone{},
                                     smem, tile_wait);
  // The last GEMM1 CTA to finish accounts this call's rows per source (read by the next call's waits).
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (atomicAdd(reinterpret_cast<unsigned long long*>(rd.producers_done), 1ull) != (unsigned long long)(np - 1)) return;
  for (int s = 0; s < R; ++s)
    *reinterpret_cast<volatile uint64_t*>(&self->src_expected.rows[s]) =
        LoadVolatile(&self->src_expected.rows[s]) + (uint64_t)scratch.rows_to_rank[s];
}

// The decision microbenchmark: one CTA builds the table as ExpertKernel does, then runs the choice `iters` times.
// out[0] = table build ns, out[1] = ns of `iters` decisions, out[2] = the choice.
__global__ void __launch_bounds__(kThreads) DecisionBenchKernel(RankDev rd, const int32_t* seg_rows,
                                                                const int32_t* seg_ret_off, int E_l, int64_t cap,
                                                                int64_t K, int64_t N, const __grid_constant__ Policy pol, int iters,
                                                                unsigned long long* out) {
  __shared__ SegTable table;
  __shared__ TableScratch scratch;
  __shared__ ChoiceScratch choice;
  __shared__ unsigned long long t0;
  if (threadIdx.x == 0) t0 = GlobalTimer();
  __syncthreads();
  const bool ok = BuildSegments(rd, seg_rows, seg_ret_off, E_l, cap, &table, &scratch);
  if (threadIdx.x == 0) out[0] = GlobalTimer() - t0;
  if (!ok) return;
  __syncthreads();
  if (threadIdx.x == 0) t0 = GlobalTimer();
  __syncthreads();
  int acc = 0;
  for (int i = 0; i < iters; ++i) {
    ModelParams p = pol.model;
    p.seg_us += (double)(i & 1) * 1e-12;  // vary an input so no iteration can be folded into another
    acc += DeviceChooseConsumers(table, p, pol.cand, N, K, pol.elem_bytes, pol.max_ctas, &choice, i & 1);
  }
  if (threadIdx.x == 0) out[1] = GlobalTimer() - t0;
  const int final_choice = ConsumersOfCall(table, pol, N, K, &choice);
  if (threadIdx.x == 0) {
    out[2] = (unsigned long long)final_choice;
    out[3] = (unsigned long long)acc;
  }
}

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

// ---------------------------------------------------------------------------------------------------------------
// Host side

// Dynamic shared memory of a kernel whose CTAs wait on each other and on peers, so every CTA must be resident:
// `need` bytes, at least half an SM's (one CTA per SM). Set on the kernel once per device (PrepareWgmmaKernel for
// wgmma kernels: it also checks a Hopper device, the sm_90a build and the register budget) and checked with the
// occupancy API. *smem_bytes = the launch's dynamic shared memory.
Status PrepareOneCtaPerSm(const void* kernel, int threads, int need, bool wgmma, const char* name, int dev,
                          int* smem_bytes) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> prepared;  // (kernel, device) -> bytes set
  DeviceInfo info;
  Status s = GetDeviceInfo(dev, &info);
  if (!s.ok()) return s;
  const int bytes = std::max(need, info.smem_per_sm / 2 + 1);
  *smem_bytes = bytes;
  std::lock_guard<std::mutex> lock(mu);
  int& done = prepared[{kernel, dev}];
  if (done != bytes) {
    const std::string what = std::string(wgmma ? "PrepareWgmmaKernel(" : "cudaFuncSetAttribute(") + name + ")";
    s = CudaStatus(wgmma ? wgmma_gemm::PrepareWgmmaKernel(kernel, bytes)
                         : cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
                   what.c_str());
    if (!s.ok()) return s;
    int blocks = 0;
    s = CudaStatus(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, bytes),
                   "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    if (!s.ok()) return s;
    if (blocks != 1)
      return Status::Error(kInternal, std::string("jax_moe_overlap: expected exactly one ") + name +
                                          " CTA per SM, occupancy says " + std::to_string(blocks));
    done = bytes;
  }
  return Status{};
}

template <typename T, int kEngine, bool kTransB>
Status PrepareExpertKernel(int dev, int* smem_bytes) {
  const int need = kEngine == kWgmma ? wgmma_gemm::kLoopSmemBytes : kEngine == kMmaSync ? kTcSmemBytes : kSimtSmemBytes;
  return PrepareOneCtaPerSm(reinterpret_cast<const void*>(ExpertKernel<T, kEngine, kTransB>), kEngineThreads<kEngine>,
                            need, kEngine == kWgmma, "ExpertKernel", dev, smem_bytes);
}

// Row length of w[e] as stored (the tile engines' ldb): N for [K, N], K for the transposed layout [N, K].
int64_t WeightLd(int64_t K, int64_t N, bool transpose_rhs) { return transpose_rhs ? K : N; }

// Whether the tensor-core tile (gemm_tile.cuh) takes these operands: bf16, 16-byte aligned, lhs rows (K) and w rows as
// stored multiples of 8 elements. N need not be one when w is transposed (B is then loaded along K; the stores check
// their alignment pair by pair).
bool TcProducerApplies(DType dt, int64_t K, int64_t N, bool transpose_rhs, const void* lhs, const void* w) {
  return TcTileApplies(dt == DType::kBF16, K, WeightLd(K, N, transpose_rhs), lhs, w);
}

// Whether the current device runs the wgmma producer for these operands (bf16, K and N multiples of 64 in either
// layout of w, as the bare grouped GEMM's wgmma path; Hopper).
bool WgmmaProducerApplies(DType dt, int64_t K, int64_t N, bool transpose_rhs, const void* lhs, const void* w) {
  if (!TcProducerApplies(dt, K, N, transpose_rhs, lhs, w) || K % 64 != 0 || N % 64 != 0 || K <= 0) return false;
  int dev = 0;
  DeviceInfo info;
  return cudaGetDevice(&dev) == cudaSuccess && GetDeviceInfo(dev, &info).ok() && info.cc_major == 9;
}

Status LaunchError(const char* what) {
  return CudaStatus(cudaGetLastError(), what);
}

// ExpertKernel's launch arguments, for LaunchExpertKernel.
struct ExpertLaunch {
  cudaStream_t stream;
  int dev, budget;  // the rank's device and SM budget (the grid)
  RankDev rd;
  const void *lhs, *w;
  int64_t cap, K, N, E_l;
  const int32_t *seg_rows, *seg_ret_off;
  Policy pol;  // smem_bytes is filled in here
  CUtensorMap a_map, b_map;
};

// Prepares ExpertKernel<T, kEngine, kTransB> on the device (once) and launches it: one CTA per SM of the budget.
template <typename T, int kEngine, bool kTransB>
Status LaunchExpertKernel(ExpertLaunch l) {
  int smem = 0;
  Status s = PrepareExpertKernel<T, kEngine, kTransB>(l.dev, &smem);
  if (!s.ok()) return s;
  l.pol.smem_bytes = smem;
  ExpertKernel<T, kEngine, kTransB><<<l.budget, kEngineThreads<kEngine>, smem, l.stream>>>(
      l.rd, static_cast<const T*>(l.lhs), static_cast<const T*>(l.w), l.cap, l.K, l.N, l.seg_rows, l.seg_ret_off,
      (int)l.E_l, l.pol, l.a_map, l.b_map);
  return LaunchError("launch of ExpertKernel");
}

template <typename T, int kEngine>
Status LaunchExpertKernel(const ExpertLaunch& l, bool transpose_rhs) {
  return transpose_rhs ? LaunchExpertKernel<T, kEngine, true>(l) : LaunchExpertKernel<T, kEngine, false>(l);
}

// PrepareExpertKernel for both layouts of w.
template <typename T, int kEngine>
Status PrepareExpertKernels(int dev, int* smem_bytes) {
  Status s = PrepareExpertKernel<T, kEngine, false>(dev, smem_bytes);
  return s.ok() ? PrepareExpertKernel<T, kEngine, true>(dev, smem_bytes) : s;
}

// Host part of protocol step 0: recover from an earlier failure (reported here), then Begin on the device.
Status BeginCall(const CallSite& c, const char* op, const int32_t* group_op, const int32_t* rank_op) {
  if (c.ws == nullptr) return Status::Error(kFailedPrecondition, "jax_moe_overlap: no workspace");
  if (c.rank < 0 || c.rank >= c.ws->ranks() || c.group < 0 || c.group >= c.ws->groups())
    return Status::Error(kInvalidArgument, "jax_moe_overlap: rank/group outside the workspace");
  Status s = c.ws->RecoverIfAborted(c.group, c.rank, c.stream, op, c.opts.timeout_ms);
  if (!s.ok()) return s;
  const int64_t delay_ns = (c.opts.delay_rank == c.rank && c.opts.delay_us > 0) ? c.opts.delay_us * 1000 : 0;
  BeginKernel<<<1, 1, 0, c.stream>>>(c.ws->Dev(c.group, c.rank), group_op, rank_op,
                                     std::max<int64_t>(1, c.opts.timeout_ms) * 1000000, delay_ns);
  return LaunchError("launch of BeginKernel");
}

int ElemBytes(DType dt) { return dt == DType::kF32 ? 4 : 2; }

}  // namespace

Status GetDeviceInfo(int dev, DeviceInfo* info) {
  static std::mutex mu;
  static DeviceInfo cache[64];
  std::lock_guard<std::mutex> lock(mu);
  if (dev < 0 || dev >= 64) return Status::Error(kInvalidArgument, "device ordinal out of range");
  if (cache[dev].sms == 0) {
    Status s = CudaStatus(cudaDeviceGetAttribute(&cache[dev].sms, cudaDevAttrMultiProcessorCount, dev), "attr");
    if (s.ok()) s = CudaStatus(cudaDeviceGetAttribute(&cache[dev].smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev), "attr");
    if (s.ok()) s = CudaStatus(cudaDeviceGetAttribute(&cache[dev].cc_major, cudaDevAttrComputeCapabilityMajor, dev), "attr");
    if (!s.ok()) {
      cache[dev].sms = 0;
      return s;
    }
  }
  *info = cache[dev];
  return Status{};
}

Status PrepareKernels(int dev) {
  int smem = 0;
  DeviceInfo info;
  Status s = GetDeviceInfo(dev, &info);
  if (s.ok() && info.cc_major == 9) s = PrepareExpertKernels<bf16, kWgmma>(dev, &smem);
  if (s.ok()) s = PrepareExpertKernels<bf16, kMmaSync>(dev, &smem);
  if (s.ok()) s = PrepareExpertKernels<bf16, kSimt>(dev, &smem);
  if (s.ok()) s = PrepareExpertKernels<float, kSimt>(dev, &smem);
  cudaFuncAttributes attr;
  const void* kernels[] = {(const void*)BeginKernel, (const void*)EndKernel, (const void*)PushKernel,
                           (const void*)RecvKernel, (const void*)CombineKernel<bf16, 1>, (const void*)CombineKernel<float, 1>,
                           (const void*)CombineKernel<bf16, 8>, (const void*)CombineKernel<float, 4>,
                           (const void*)DecisionBenchKernel};
  for (const void* k : kernels)
    if (s.ok()) s = CudaStatus(cudaFuncGetAttributes(&attr, k), "cudaFuncGetAttributes");
  return s;
}

const char* ProducerPath(DType dt, int64_t K, int64_t N, bool transpose_rhs, const void* lhs, const void* w) {
  if (WgmmaProducerApplies(dt, K, N, transpose_rhs, lhs, w)) return "wgmma bf16";
  return TcProducerApplies(dt, K, N, transpose_rhs, lhs, w) ? "mma.sync bf16" : "simt fp32";
}

int ProducerTileN() { return BN; }

void ProducerTile(const std::string& path, int* tile_m, int* tile_n) {
  const bool wg = path == "wgmma bf16";
  *tile_m = wg ? kWgBM : BM;
  *tile_n = wg ? kWgBN : BN;
}

std::string CheckModelParams(const ModelParams& p) {
  auto finite_nonneg = [](double v) { return v >= 0.0 && v < 1e300; };
  if (!(p.tile_m == BM && p.tile_n == BN) && !(p.tile_m == kWgBM && p.tile_n == kWgBN))
    return "the model describes " + std::to_string(p.tile_m) + "x" + std::to_string(p.tile_n) +
           " tiles but the compiled producers use " + std::to_string(BM) + "x" + std::to_string(BN) + " (mma.sync) or " +
           std::to_string(kWgBM) + "x" + std::to_string(kWgBN) + " (wgmma)";
  if (p.ctas_per_sm != 1) return "ctas_per_sm must be 1 (the expert kernel runs one CTA per SM)";
  if (p.sms < 2) return "sms must be >= 2";
  if (!finite_nonneg(p.tile_us_base) || !finite_nonneg(p.tile_us_per_k) || !finite_nonneg(p.seg_us))
    return "tile_us_base, tile_us_per_k and seg_us must be finite and >= 0";
  if (!(p.tile_us_base + p.tile_us_per_k > 0.0)) return "the tile time must be positive";
  if (!(p.cta_gbps > 0.0 && p.cta_gbps < 1e300) || !(p.link_gbps > 0.0 && p.link_gbps < 1e300))
    return "cta_gbps and link_gbps must be finite and > 0";
  return "";
}

const char* ConsumerPolicy(const Workspace& ws, const CallOptions& o, DType dt, int64_t K, int64_t N,
                           bool transpose_rhs, const void* lhs, const void* w) {
  if (o.consumer_ctas > 0) return "pinned";
  // A calibration describes one tensor-core engine, named by its tile shape; calls on another engine (and the SIMT
  // path: float32, odd shapes) keep the fixed C.
  if (!ws.has_model()) return "fixed";
  int tile_m = 0, tile_n = 0;
  const std::string path = ProducerPath(dt, K, N, transpose_rhs, lhs, w);
  ProducerTile(path, &tile_m, &tile_n);
  const ModelParams& m = ws.model();
  return (tile_m == m.tile_m && tile_n == m.tile_n && path != "simt fp32")
             ? "model"
             : "fixed";
}

Status MeasureDecision(const CallSite& c, const int32_t* seg_rows, const int32_t* seg_ret_off, int64_t E_l,
                       int64_t cap, int64_t K, int64_t N, DType dt, int iters, double* table_ns, double* decision_ns,
                       int* choice) {
  if (c.ws == nullptr || !c.ws->has_model())
    return Status::Error(kFailedPrecondition, "jax_moe_overlap: MeasureDecision needs a workspace with a model");
  if (E_l * c.ws->ranks() > kMaxSegments || iters < 1)
    return Status::Error(kInvalidArgument, "jax_moe_overlap: MeasureDecision: too many segments or iters < 1");
  Policy pol{};
  pol.use_model = 1;
  pol.model = c.ws->model();
  pol.model.sms = c.ws->budget(c.group, c.rank);
  pol.model.ctas_per_sm = 1;
  pol.max_ctas = ModelMaxCtas(pol.model.sms);
  pol.cand = FillCandidateConsts(pol.model, pol.max_ctas, N);
  pol.elem_bytes = ElemBytes(dt);
  unsigned long long* out = nullptr;
  Status s = CudaStatus(cudaMalloc(&out, 4 * sizeof(unsigned long long)), "cudaMalloc");
  if (!s.ok()) return s;
  DecisionBenchKernel<<<1, kThreads, 0, c.stream>>>(c.ws->Dev(c.group, c.rank), seg_rows, seg_ret_off, (int)E_l, cap,
                                                    K, N, pol, iters, out);
  unsigned long long h[4] = {0, 0, 0, 0};
  s = LaunchError("launch of DecisionBenchKernel");
  if (s.ok()) s = CudaStatus(cudaStreamSynchronize(c.stream), "cudaStreamSynchronize");
  if (s.ok()) s = CudaStatus(cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost), "cudaMemcpy");
  cudaFree(out);
  if (!s.ok()) return s;
  *table_ns = (double)h[0];
  *decision_ns = (double)h[1] / iters;
  *choice = (int)h[2];
  return Status{};
}

Status Dispatch(const CallSite& c, DType dt, const void* src, int64_t S, int64_t D, const int32_t* slot_src_row,
                const int32_t* slot_dest_rank, const int32_t* slot_dest_row, int64_t P, const int32_t* recv_expected,
                const int32_t* group_op, const int32_t* rank_op, void* out, int64_t cap) {
  const int64_t row_bytes = D * ElemBytes(dt);
  Status s = BeginCall(c, "dispatch", group_op, rank_op);
  if (!s.ok()) return s;
  Workspace& ws = *c.ws;
  if (row_bytes > ws.sizes().row_bytes || cap > ws.sizes().recv_rows) {
    ws.RaiseAbort(c.group);
    return Status::Error(kInvalidArgument, "jax_moe_overlap: dispatch: call needs rows of " + std::to_string(row_bytes) +
                                               " B x " + std::to_string(cap) + " but the workspace holds " +
                                               std::to_string(ws.sizes().row_bytes) + " B x " +
                                               std::to_string(ws.sizes().recv_rows));
  }
  const RankDev rd = ws.Dev(c.group, c.rank);
  const int grid = ws.budget(c.group, c.rank);
  PushKernel<<<grid, kThreads, 0, c.stream>>>(rd, static_cast<const char*>(src), S, row_bytes, slot_src_row,
                                              slot_dest_rank, slot_dest_row, P, cap);
  if (!(s = LaunchError("launch of PushKernel")).ok()) return s;
  RecvKernel<<<grid, kThreads, 0, c.stream>>>(rd, recv_expected, static_cast<char*>(out), cap, row_bytes);
  if (!(s = LaunchError("launch of RecvKernel")).ok()) return s;
  EndKernel<<<1, 1, 0, c.stream>>>(rd, recv_expected, 0);
  return LaunchError("launch of EndKernel");
}

// dispatch_gemm (see DispatchGemmKernel): Begin, the fused kernel, then the end of a dispatch (RecvKernel copies recv
// into x_recv; EndKernel frees recv for the peers' next call).
Status DispatchGemm(const CallSite& c, const void* src, int64_t S, int64_t D, const int32_t* slot_src_row,
                    const int32_t* slot_dest_rank, const int32_t* slot_dest_row, int64_t P,
                    const int32_t* recv_expected, const int32_t* seg_rows, const int32_t* seg_ret_off, int64_t E_l,
                    const void* w, int64_t N, const int32_t* group_op, const int32_t* rank_op, void* x_recv, float* a,
                    int64_t cap, int pushers) {
  const int64_t row_bytes = D * 2;
  Status s = BeginCall(c, "dispatch_gemm", group_op, rank_op);
  if (!s.ok()) return s;
  Workspace& ws = *c.ws;
  const int R = ws.ranks();
  const int budget = ws.budget(c.group, c.rank);
  std::string bad;
  if (row_bytes > ws.sizes().row_bytes || cap > ws.sizes().recv_rows)
    bad = "dispatch_gemm: call needs rows of " + std::to_string(row_bytes) + " B x " + std::to_string(cap) +
          " but the workspace holds " + std::to_string(ws.sizes().row_bytes) + " B x " +
          std::to_string(ws.sizes().recv_rows);
  else if (E_l * R > kMaxSegments)
    bad = "dispatch_gemm: " + std::to_string(E_l * R) + " segments (local experts x ranks) exceed the CUDA kernels' " +
          std::to_string(kMaxSegments);
  else if (!WgmmaProducerApplies(DType::kBF16, D, N, false, src, w))
    bad = "dispatch_gemm: needs the wgmma engine (a Hopper GPU, bfloat16, d_model and N multiples of 64; got " +
          std::to_string(D) + ", " + std::to_string(N) + ")";
  else if (pushers < 1 || pushers > budget - 1)
    bad = "dispatch_gemm: pushers=" + std::to_string(pushers) + " but rank " + std::to_string(c.rank) +
          " has an SM budget of " + std::to_string(budget) + " CTAs: use 1 .. " + std::to_string(budget - 1);
  if (!bad.empty()) {
    ws.RaiseAbort(c.group);
    return Status::Error(kInvalidArgument, "jax_moe_overlap: " + bad);
  }
  const RankDev rd = ws.Dev(c.group, c.rank);
  const int dev = ws.device(c.group, c.rank);
  // producers_done counts the finished GEMM1 CTAs of this call (the last one accounts src_expected).
  if (!(s = CudaStatus(cudaMemsetAsync(rd.band_done, 0, BandCounterBytes(ws.sizes().max_bands), c.stream),
                       "cudaMemsetAsync(band counters)")).ok())
    return s;
  CUtensorMap a_map, b_map;
  const void* recv = RankView{rd.peers.base[c.rank], rd.layout}.recv();  // A: where the peers' pushes land
  if (!(s = CudaStatus(wgmma_gemm::CachedGemmMaps(recv, cap, D, w, E_l, N, /*b_k_major=*/false, &a_map, &b_map),
                       "tensor maps of dispatch_gemm")).ok())
    return s;
  int smem = 0;
  if (!(s = PrepareOneCtaPerSm(reinterpret_cast<const void*>(DispatchGemmKernel), wgmma_gemm::kThreads,
                               wgmma_gemm::kLoopSmemBytes, /*wgmma=*/true, "DispatchGemmKernel", dev, &smem)).ok())
    return s;
  const DispatchGemmArgs args{static_cast<const char*>(src), S, row_bytes, slot_src_row, slot_dest_rank,
                              slot_dest_row, P, cap, seg_rows, seg_ret_off, (int)E_l, pushers, D, N, a};
  DispatchGemmKernel<<<budget, wgmma_gemm::kThreads, smem, c.stream>>>(rd, args, a_map, b_map);
  if (!(s = LaunchError("launch of DispatchGemmKernel")).ok()) return s;
  RecvKernel<<<budget, kThreads, 0, c.stream>>>(rd, recv_expected, static_cast<char*>(x_recv), cap, row_bytes);
  if (!(s = LaunchError("launch of RecvKernel")).ok()) return s;
  EndKernel<<<1, 1, 0, c.stream>>>(rd, recv_expected, 0);
  return LaunchError("launch of EndKernel");
}

Status ExpertCombine(const CallSite& c, DType dt, const void* lhs, int64_t cap, int64_t K, const void* w, int64_t E_l,
                     int64_t N, bool transpose_rhs, const float* gates, int64_t T, int64_t k, const int32_t* seg_rows,
                     const int32_t* seg_ret_off, const int32_t* slot_ret_row, const int32_t* ret_expected,
                     const int32_t* group_op, const int32_t* rank_op, void* y, void* slot_out) {
  const int64_t row_bytes = N * ElemBytes(dt);
  Status s = BeginCall(c, "expert_combine", group_op, rank_op);
  if (!s.ok()) return s;
  Workspace& ws = *c.ws;
  const int R = ws.ranks();
  std::string bad;
  if (row_bytes > ws.sizes().row_bytes || cap > ws.sizes().recv_rows || T * k > ws.sizes().ret_rows)
    bad = "expert_combine: call does not fit the workspace (row bytes " + std::to_string(row_bytes) + ", cap " +
          std::to_string(cap) + ", slots " + std::to_string(T * k) + ")";
  else if (E_l * R > kMaxSegments)
    bad = "expert_combine: " + std::to_string(E_l * R) + " segments (local experts x ranks) exceed the CUDA kernels' " +
          std::to_string(kMaxSegments);
  if (!bad.empty()) {
    ws.RaiseAbort(c.group);
    return Status::Error(kInvalidArgument, "jax_moe_overlap: " + bad);
  }
  const RankDev rd = ws.Dev(c.group, c.rank);
  const int dev = ws.device(c.group, c.rank);
  const int budget = ws.budget(c.group, c.rank);
  if (c.opts.consumer_ctas < 0 || c.opts.consumer_ctas > budget - 1) {
    ws.RaiseAbort(c.group);
    return Status::Error(kInvalidArgument,
                         "jax_moe_overlap: expert_combine: consumer_ctas=" + std::to_string(c.opts.consumer_ctas) +
                             " but rank " + std::to_string(c.rank) + " (group " + std::to_string(c.group) +
                             ") has an SM budget of " + std::to_string(budget) +
                             " CTAs and needs at least one producer CTA: pin C in [1, " + std::to_string(budget - 1) +
                             "], or 0 for the resource manager's choice");
  }
  Policy pol{};
  pol.serialize = c.opts.serialize ? 1 : 0;
  // The consumer pushes with TMA bulk copies on sm_90 (bulk_copy.cuh); JMO_CONSUMER_COPY=plain selects CopyBand
  // (16-byte loads/stores, 16 in flight per thread). Alone, CopyBand moves more (53 vs 22 GB/s for 2 CTAs on the
  // H200), but its per-CTA rate falls as C grows and it competes with the GEMM: with the manager, the bulk copies
  // made the overlapped loopback calls 14% faster in total, and the shipped calibration describes them
  // (benchmarks/RESULTS.md).
  static const bool plain = getenv("JMO_CONSUMER_COPY") != nullptr && std::string(getenv("JMO_CONSUMER_COPY")) == "plain";
  pol.bulk_copy = plain ? 0 : 1;
  static const int push_slots = std::clamp(getenv("JMO_PUSH_SLOTS") ? atoi(getenv("JMO_PUSH_SLOTS")) : 12, 2,
                                           kPushMaxSlots);
  static const int push_read_lag = getenv("JMO_PUSH_READ_LAG") ? atoi(getenv("JMO_PUSH_READ_LAG")) : kPushReadLag;
  pol.push_slots = push_slots;
  pol.push_read_lag = push_read_lag;
  // Issuing threads per consumer CTA (JMO_PUSH_ISSUERS, 1..8): one thread moves ~12 GB/s whatever its ring's depth
  // (push_probe.cu on the H200: 11.7 / 23.2 / 40.7 GB/s for 1 / 2 / 4 issuers in one CTA; bench_consumer at R = 2,
  // C = 16 per rank: 257 / 574 / 357 GB/s for 1 / 4 / 8, the 8 rings being 3 slots each), so 4.
  static const int push_issuers = std::clamp(getenv("JMO_PUSH_ISSUERS") ? atoi(getenv("JMO_PUSH_ISSUERS")) : 4, 1, 8);
  pol.push_issuers = push_issuers;
  pol.elem_bytes = ElemBytes(dt);
  pol.max_ctas = ModelMaxCtas(budget);
  const char* policy = ConsumerPolicy(ws, c.opts, dt, K, N, transpose_rhs, lhs, w);
  if (c.opts.consumer_ctas > 0) {
    pol.consumers = c.opts.consumer_ctas;
  } else if (std::string(policy) == "model") {
    pol.use_model = 1;
    pol.model = ws.model();
    pol.model.sms = budget;  // the rank's CTAs are its SMs (one CTA per SM, checked by PrepareExpertKernel)
    pol.model.ctas_per_sm = 1;
    pol.cand = FillCandidateConsts(pol.model, pol.max_ctas, N);
    pol.consumers = 0;
  } else {
    pol.consumers = std::min(ws.consumer_ctas(), budget - 1);
  }
  // Per-band tile counters and the finished-band count start from zero every call (stream-ordered: the previous
  // call's kernels are done).
  if (!(s = CudaStatus(cudaMemsetAsync(rd.band_done, 0, BandCounterBytes(ws.sizes().max_bands), c.stream),
                       "cudaMemsetAsync(band counters)")).ok())
    return s;
  const std::string path = ProducerPath(dt, K, N, transpose_rhs, lhs, w);
  ExpertLaunch l{c.stream, dev, budget, rd, lhs, w, cap, K, N, E_l, seg_rows, seg_ret_off, pol, {}, {}};
  if (path == "wgmma bf16") {  // the TMA descriptors of the wgmma engine (unused by the others)
    if (!(s = CudaStatus(wgmma_gemm::CachedGemmMaps(lhs, cap, K, w, E_l, N, /*b_k_major=*/transpose_rhs, &l.a_map,
                                                    &l.b_map),
                         "tensor maps of the wgmma producer")).ok())
      return s;
    s = LaunchExpertKernel<bf16, kWgmma>(l, transpose_rhs);
  } else if (path == "mma.sync bf16") {
    s = LaunchExpertKernel<bf16, kMmaSync>(l, transpose_rhs);
  } else if (dt == DType::kBF16) {
    s = LaunchExpertKernel<bf16, kSimt>(l, transpose_rhs);
  } else {
    s = LaunchExpertKernel<float, kSimt>(l, transpose_rhs);
  }
  if (!s.ok()) return s;
  // 16-byte vectors when every row starts 16-byte aligned (ret rows do when N * element bytes is a multiple of 16).
  const bool vec = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(slot_out) % 16 == 0;
  auto launch_combine = [&](auto kernel, auto* typed_y) {
    using Ptr = decltype(typed_y);
    kernel<<<budget, kCombineThreads, 0, c.stream>>>(rd, gates, slot_ret_row, ret_expected, T, k, N, typed_y,
                                              static_cast<Ptr>(slot_out));
  };
  if (dt == DType::kBF16)
    vec ? launch_combine(CombineKernel<bf16, 8>, static_cast<bf16*>(y))
        : launch_combine(CombineKernel<bf16, 1>, static_cast<bf16*>(y));
  else
    vec ? launch_combine(CombineKernel<float, 4>, static_cast<float*>(y))
        : launch_combine(CombineKernel<float, 1>, static_cast<float*>(y));
  return LaunchError("launch of CombineKernel");
}

}  // namespace jmo::cuda
