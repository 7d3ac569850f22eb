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

// One lane's slot p of a push (PushRows, dispatch_gemm's PushBlock): loads and checks its route and returns the recv
// row it is kept at (-1: not kept: dropped by the capacity rule, or invalid and reported), with *sr its source row
// and *from the recv row holding its bytes (itself, or sending once its primary's). dest >= 0: the slot must go to
// rank dest (the caller pushes one destination's send positions); else to any rank of the group (*d). Reports an
// unrouted expert id (kBadExpertId), a route off the group, the capacity or the source rows (kBadRoute), and, sending
// once, a primary that breaks CheckPrimary's rule (kBadPrimary: the slot is not moved). Sending once, a kept slot
// stores its recv_from entry (RecvFrom(epoch, *from)).
__device__ inline int CheckPushSlot(const RankDev& rd, const int32_t* src_row, const int32_t* dst_rank,
                                    const int32_t* dst_row, const int32_t* primary, int64_t P, int64_t S,
                                    int64_t cap, int64_t p, int dest, uint64_t epoch, int* d, int* sr, int* from) {
  *d = dst_rank[p];
  int row = dst_row[p];
  *sr = src_row[p];
  *from = -1;
  if (*d == -1) {
    ReportBadInput(rd, kBadExpertId, p, *sr, (uint64_t)(int64_t)row);  // the plan puts the id in row
    return -1;
  }
  if (row < 0) return -1;  // dropped by the capacity rule
  const bool bad_d = dest >= 0 ? *d != dest : (*d < 0 || *d >= rd.ranks);
  if (bad_d || row >= cap || *sr < 0 || *sr >= S) {
    ReportBadInput(rd, kBadRoute, p, bad_d ? *d : (row >= cap ? row : *sr),
                   bad_d ? rd.ranks : (row >= cap ? cap : S));
    return -1;
  }
  *from = row;
  if (primary != nullptr && *d != rd.rank && primary[p] != p) {
    const int64_t q = primary[p];
    if (!CheckPrimary(src_row, dst_rank, dst_row, primary, P, p, q)) {
      ReportBadInput(rd, kBadPrimary, p, q, P);
      *from = -1;
      return -1;
    }
    *from = dst_row[q];
  }
  if (primary != nullptr) View(rd, *d).recv_from()[row] = RecvFrom(epoch, *from);
  return row;
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

// Step 2 of dispatch, by warp `warp` of `warps` (every lane calls it): the slots in chunks of 32 consecutive
// positions, chunk c of the warp at (c * warps + warp) * 32. Each lane loads and checks one slot of the chunk
// (CheckPushSlot), so the warp waits for one round trip of indices per 32 slots rather than per slot; then the warp
// copies the chunk's rows two at a time with 16-byte loads all issued before the stores (CopyRowPairWarp: 8 KiB in
// flight per warp for 4 KiB rows), as dispatch_gemm's PushBlock does. Slot p's row src[src_row[p]] goes to peer
// dst_rank[p]'s recv row dst_row[p], counted into sent[d] (shared). `which` picks the destinations this pass moves
// (the rank itself, the others, or all). link_bytes_per_ns > 0: the chunk's pushes to other ranks go over the
// emulated link (PaceLink) before the call signals them. own_rows != nullptr: the rows for this rank itself go there
// instead of its recv rows (a group of one rank stores them straight into the call's output: protocol.h). primary
// != nullptr: send once (protocol.h, CheckPushSlot). Scale: RowScale{} moves the bytes; RowScale{row_scale, bf16}
// lands slot p's row times row_scale[p] (ScaleVector's rule: float32 or bfloat16 rows, never sent once).
struct RowScale {
  const float* scale = nullptr;  // [P], or nullptr: rows moved unchanged
  bool bf16 = false;             // the rows' dtype: bfloat16, else float32
};

// The rows of a warp's slots, by the warp (every lane calls it): lane i's slot moves a row where bit i of `moves` is
// set, from src(i) to dst(i) (each calls __shfl_sync: every lane evaluates them), scaled by lane i's `scale` where
// `scaled` says so; two rows at a time while two are left (CopyRowPairWarp, ScaleRowPairWarp: both rows' loads in
// flight before any store), the last one alone.
template <typename Dst, typename Src>
__device__ inline void MoveSlotRowsWarp(unsigned moves, RowScale scaled, float scale, int64_t row_bytes, int lane,
                                        Dst dst, Src src) {
  const int64_t cols = row_bytes / (scaled.bf16 ? 2 : 4);
  for (unsigned left = moves; left != 0;) {
    const int i = __ffs(left) - 1;
    left &= left - 1;
    char* d0 = dst(i);
    const char* s0 = src(i);
    const float c0 = scaled.scale != nullptr ? __shfl_sync(0xffffffffu, scale, i) : 0.f;  // (uniform branch)
    if (left != 0) {
      const int j = __ffs(left) - 1;
      left &= left - 1;
      char* d1 = dst(j);
      const char* s1 = src(j);
      const float c1 = scaled.scale != nullptr ? __shfl_sync(0xffffffffu, scale, j) : 0.f;
      if (scaled.scale == nullptr) CopyRowPairWarp(d0, s0, d1, s1, row_bytes, lane);
      else if (scaled.bf16) ScaleRowPairWarp<__nv_bfloat16>(d0, s0, c0, d1, s1, c1, cols, lane);
      else ScaleRowPairWarp<float>(d0, s0, c0, d1, s1, c1, cols, lane);
    } else if (scaled.scale == nullptr) {
      CopyRowWarp(d0, s0, row_bytes, lane);
    } else if (scaled.bf16) {
      ScaleRowWarp<__nv_bfloat16>(d0, s0, cols, c0, lane);
    } else {
      ScaleRowWarp<float>(d0, s0, cols, c0, lane);
    }
  }
}
__device__ inline void PushRows(const RankDev& rd, const char* src, int64_t S, int64_t row_bytes,
                                const int32_t* src_row, const int32_t* dst_rank, const int32_t* dst_row, int64_t P,
                                int64_t cap, PushWhich which, int64_t warp, int64_t warps, unsigned* sent,
                                double link_bytes_per_ns, char* own_rows = nullptr, const int32_t* primary = nullptr,
                                uint64_t epoch = 0, RowScale scaled = {}) {
  const int lane = threadIdx.x % 32;
  for (int64_t base = warp * 32; base < P; base += warps * 32) {
    const int64_t p = base + lane;
    int d = 0, row = -1, sr = 0, from = -1;  // lane's slot: destination, recv row (-1: not kept), source row
    if (p < P && (which == kPushAll || (dst_rank[p] == rd.rank) == (which == kPushLocal))) {
      row = CheckPushSlot(rd, src_row, dst_rank, dst_row, primary, P, S, cap, p, -1, epoch, &d, &sr, &from);
      if (row >= 0) atomicAdd(&sent[d], 1u);  // every kept slot, sent once or not: the receiver's plan counts slots
    }
    const unsigned moves = __ballot_sync(0xffffffffu, row >= 0 && from == row);
    const float sc = scaled.scale != nullptr && row >= 0 ? scaled.scale[p] : 0.f;
    MoveSlotRowsWarp(
        moves, scaled, sc, row_bytes, lane,
        [&](int i) {
          const int d0 = __shfl_sync(0xffffffffu, d, i), r0 = __shfl_sync(0xffffffffu, row, i);
          return (d0 == rd.rank && own_rows != nullptr ? own_rows : View(rd, d0).recv()) + (int64_t)r0 * row_bytes;
        },
        [&](int i) { return src + (int64_t)__shfl_sync(0xffffffffu, sr, i) * row_bytes; });
    if (link_bytes_per_ns > 0) {
      // The link carries the chunk's rows moved to other ranks and, sending once, the recv_from entries it stored.
      const bool remote = row >= 0 && d != rd.rank;
      const unsigned remote_moves = __ballot_sync(0xffffffffu, remote && from == row);
      const unsigned remote_kept = __ballot_sync(0xffffffffu, remote);
      const uint64_t bytes = (uint64_t)__popc(remote_moves) * row_bytes +
                             (primary != nullptr ? 8ull * __popc(remote_kept) : 0);
      if (lane == 0 && bytes > 0) PaceLink(rd, bytes, link_bytes_per_ns);
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
