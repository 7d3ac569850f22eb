// The pushing half of dispatch, shared by PushKernel (dispatch.cu) and the fused dispatch_gemm (dispatch_gemm.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device/copy.cuh"
#include "cuda/transport/emulated_link.cuh"
#include "cuda/workspace/protocol.cuh"

namespace jmo::cuda {

enum PushWhich { kPushAll = 0, kPushLocal = 1, kPushRemote = 2 };

// Send once (protocol.h): slot q may carry kept slot p's row to p's destination: q is a kept slot of the same source
// row and destination, its own primary, at an earlier recv row.
__device__ __forceinline__ bool CheckPrimary(const int32_t* src_row, const int32_t* dst_rank, const int32_t* dst_row,
                                             const int32_t* primary, int64_t P, int64_t p, int64_t q) {
  return q >= 0 && q < P && primary[q] == q && dst_row[q] >= 0 && dst_rank[q] == dst_rank[p] &&
         src_row[q] == src_row[p] && dst_row[q] < dst_row[p];
}

// Send once, the receiver (one thread): the recv row whose bytes row r of this rank's recv takes, after checking its
// recv_from entry (this call's, naming r or an earlier row whose own entry names itself); -1 after reporting a bad
// entry (kBadRecvFrom).
__device__ __forceinline__ int64_t RecvFromChecked(const RankDev& rd, uint64_t epoch, int64_t r) {
  // (L2 loads: the entries were stored by other GPUs.)
  const auto* from = reinterpret_cast<const unsigned long long*>(View(rd, rd.rank).recv_from());
  const uint64_t entry = __ldcg(&from[r]);
  const int64_t f = RecvFromRow(entry);
  if (RecvFromOfEpoch(entry, epoch) && f <= r && (f == r || __ldcg(&from[f]) == RecvFrom(epoch, f))) return f;
  ReportBadInput(rd, kBadRecvFrom, r, (int64_t)entry, epoch);
  return -1;
}

// Step 2 of dispatch for slots p = first, first + stride, ... (one warp each; `first` differs per warp): the row
// src[src_row[p]] into peer dst_rank[p]'s recv row dst_row[p] with 16-byte stores, counted into sent[d] (shared).
// `which` picks the destinations this pass moves (the rank itself, the others, or all); invalid slots are reported
// by the pass that would move them to another rank. link_bytes_per_ns > 0: pushes to other ranks go over the emulated
// link (PaceLink). own_rows != nullptr: the rows for this rank itself go there instead of its recv rows (a group of
// one rank stores them straight into the call's output: protocol.h). primary != nullptr (send once, protocol.h): a
// slot routed to another rank moves its row only where it is its own primary, and every moved slot stores its
// recv_from entry (RecvFrom(epoch, the recv row holding its bytes)); a primary that breaks CheckPrimary's rule is
// reported (kBadPrimary) and the slot is not moved.
__device__ inline void PushRows(const RankDev& rd, const char* src, int64_t S, int64_t row_bytes,
                                const int32_t* src_row, const int32_t* dst_rank, const int32_t* dst_row, int64_t P,
                                int64_t cap, PushWhich which, int64_t first, int64_t stride, unsigned* sent,
                                double link_bytes_per_ns, char* own_rows = nullptr, const int32_t* primary = nullptr,
                                uint64_t epoch = 0) {
  const int lane = threadIdx.x % 32, R = rd.ranks;
  for (int64_t p = first; p < P; p += stride) {
    const int d = dst_rank[p], row = dst_row[p], sr = src_row[p];
    if (which != kPushAll && (d == rd.rank) != (which == kPushLocal)) continue;
    if (d == -1) {
      if (lane == 0) ReportBadInput(rd, kBadExpertId, p, sr, (uint64_t)(int64_t)row);  // the plan puts the id in row
      continue;
    }
    if (row < 0) continue;  // dropped by the capacity rule
    if (d < 0 || d >= R || row >= cap || sr < 0 || sr >= S) {
      if (lane == 0)
        ReportBadInput(rd, kBadRoute, p, (d < 0 || d >= R) ? d : (row >= cap ? row : sr),
                       (d < 0 || d >= R) ? R : (row >= cap ? cap : S));
      continue;
    }
    int from = row;  // the recv row holding the slot's bytes
    if (primary != nullptr && d != rd.rank && primary[p] != p) {
      const int64_t q = primary[p];
      if (!CheckPrimary(src_row, dst_rank, dst_row, primary, P, p, q)) {
        if (lane == 0) ReportBadInput(rd, kBadPrimary, p, q, P);
        continue;
      }
      from = dst_row[q];
    }
    char* rows = d == rd.rank && own_rows != nullptr ? own_rows : View(rd, d).recv();
    if (from == row) CopyRowWarp(rows + (int64_t)row * row_bytes, src + (int64_t)sr * row_bytes, row_bytes, lane);
    if (lane == 0) {
      if (primary != nullptr) View(rd, d).recv_from()[row] = RecvFrom(epoch, from);
      atomicAdd(&sent[d], 1u);  // every kept slot, sent once or not: the receiver's plan counts slots
    }
    if (d != rd.rank && link_bytes_per_ns > 0) {
      if (lane == 0) PaceLink(rd, (from == row ? (uint64_t)row_bytes : 0) + (primary != nullptr ? 8 : 0),
                              link_bytes_per_ns);
      __syncwarp();
    }
  }
}

// Step 1 of dispatch, by every thread of a pushing CTA: thread 0 waits until every destination has finished reading
// call epoch - 1 (st is written by thread 0 only until the barrier: racecheck-clean); sent[] is zeroed. False if the
// call failed (here or before).
__device__ inline bool BeginPush(const RankDev& rd, CallState* st, unsigned* sent) {
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

}  // namespace jmo::cuda
