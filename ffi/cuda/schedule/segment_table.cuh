// The segment table of one expert_combine call: the call's (expert, source) segments in producer order with their
// band offsets, built by every CTA from the device-side plan arrays. The producer engines, the consumer, the resource
// manager's device side and the fused dispatch_gemm read it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device/warp.cuh"
#include "cuda/workspace/protocol.cuh"

namespace jmo::cuda {

// The segment table of one expert_combine call (BuildSegments).
struct SegTable {
  Segment seg[kMaxSegments];      // in producer order, non-empty only
  int32_t band_prefix[kMaxSegments + 1];  // ordered bands before segment i
  int32_t n;                      // non-empty segments
  int32_t bands;                  // total bands (ordered)
  int32_t remote_segs;            // segments [0, remote_segs) go to other ranks (SegmentBefore puts them first)
  int32_t remote_bands;           // their bands: [0, remote_bands) is all the consumer pushes
  int64_t remote_rows;            // their rows (what the consumer pushes, in rows)
};

struct TableScratch {
  Segment raw[kMaxSegments];         // in plan order (expert-major)
  int64_t rows_to_rank[kMaxRanks];
  int32_t segs_of_rank[kMaxRanks];   // kept (non-empty) segments per source
  int64_t warp_sums[32];
  int32_t first_bad;
};

__device__ __forceinline__ int32_t BandsOf(int32_t rows) {
  return (rows + (int32_t)kBandRows - 1) / (int32_t)kBandRows;
}

// Builds the table from the device-side plan arrays, one thread per segment (E_l * R <= kMaxSegments <= blockDim.x):
// offsets by prefix sums, each segment's place in producer order by counting the segments SegmentBefore puts first
// (by source, then by expert within its source). Every thread calls it and gets the same answer; false (and the error
// recorded, naming the first bad segment) on an invalid plan.
__device__ inline bool BuildSegments(const RankDev& rd, const int32_t* seg_rows, const int32_t* seg_ret_off, int E_l,
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

}  // namespace jmo::cuda
