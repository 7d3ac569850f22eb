// The resource manager's device decision of commit e3dd3a1, kept as decision_probe's baseline: the segment table
// (BuildSegments: three block scans, shared-memory atomics per source and a place loop of O(R + E_l) trips per
// segment, 11 barriers), the consumer choice (DeviceChooseConsumers, the chunked form; its fallback, the scans form,
// is the library's ChooseByScans) and gather_rs's C (DeviceChooseGatherConsumers: warp 0 builds the sources, every
// warp evaluates all candidates over all sources). The probe checks the library's new forms against these bit for bit
// and times both.
#pragma once

#include "cuda/schedule/resource_manager.cuh"
#include "cuda/schedule/segment_table.cuh"

namespace jmo::cuda::decision_v0 {

// e3dd3a1's ready time: RmMul((double)CeilDiv(cum, P), tile_us) from ceil_arg = CeilArg(cum) and rp = 1 / P, by a
// multiply, a rounded-up add of 2^52, its subtraction and RmMul (exact for cum < 2^50).
__device__ __forceinline__ double ReadyUsFp(double ceil_arg, double rp, double tile_us) {
  return RmMul(__dadd_rn(__dadd_ru(__dmul_rn(ceil_arg, rp), kTwo52), -kTwo52), tile_us);
}

struct TableScratch {
  Segment raw[kMaxSegments];
  int64_t rows_to_rank[kMaxRanks];
  int32_t segs_of_rank[kMaxRanks];
  int64_t warp_sums[32];
  int32_t first_bad;
};

struct ChoiceScratch {
  union {
    struct {
      double ceil_arg[kMaxSegments];
      double push_us[kMaxSegments];
      double bytes[kMaxSegments];
    } seg;
    struct {
      GatherModelSource src[2][kMaxRanks];
      int64_t total_tiles[2];
      int64_t cum_end[kMaxRanks];
      int64_t rows_end[kMaxRanks];
      int64_t rows_before[kMaxRanks];
      int32_t place[kMaxRanks];
    } gather;
  };
  double us[2][kWarps][32];
  jmo::cuda::ChoiceScratch lib;  // the scans form's (the library's ChooseByScans)
};

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

__device__ inline int DeviceChooseConsumers(const SegTable& t, const ModelParams& p, const CandidateConsts& cand,
                                            int64_t N, int64_t K, int64_t eb, int max_ctas, ChoiceScratch* sc,
                                            int parity = 0) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n = t.n, mr = t.remote_segs;
  // This lane's candidate and its constants (an infeasible lane gets C = 1's: checked by ChunkedIsExact, never used in
  // a term); the two that need a division come from the host (CandidateConsts).
  const int c = lane + 1;
  const bool feasible = c <= max_ctas && ModelFeasible(p, c);
  const ModelEval e = ModelEvalWith(p, K, feasible ? c : 1, cand.us_per_byte[lane]);
  const double rp = cand.rcp_producers[lane];
  const uint32_t tm = cand.tile_m, mtm = cand.tile_m_magic;
  const int64_t nn = cand.col_tiles;
  // Warp w's chunk (ch <= 32: one segment per lane). Warps 8..11 of a 384-thread CTA (wgmma engine) get none, they
  // only take the table pass (for ChunkedIsExact's common answer) and meet the barriers.
  const int ch = (mr + kWarps - 1) / kWarps, beg = warp * ch, end = min(beg + ch, mr);
  // This lane's share of: row tiles of all segments, rows of the remote ones, both of the segments before the chunk.
  uint32_t all_t = 0, rem_r = 0, pre_t = 0, pre_r = 0;
  bool rows_ok = true;
#pragma unroll
  for (int i = 0; i < kMaxSegments / 32; ++i) {
    const int j = lane + 32 * i;
    if (j >= n) break;
    const int32_t r = t.seg[j].rows;
    rows_ok = rows_ok && (uint32_t)r - 1u < (1u << 23) - 1u;
    const uint32_t mt = MagicCeilDiv((uint32_t)r, tm, mtm);
    all_t += mt;
    if (j < mr) rem_r += (uint32_t)r;
    if (j < beg) {
      pre_t += mt;
      pre_r += (uint32_t)r;
    }
  }
  if (!ChunkedIsExact(rows_ok, e, p, nn, N, eb)) return ChooseByScans(t, p, N, K, eb, max_ctas, &sc->lib);
  double us = 0.0;
  if (beg < end || warp == 0) {  // warp-uniform
    all_t = __reduce_add_sync(0xffffffffu, all_t);
    rem_r = __reduce_add_sync(0xffffffffu, rem_r);
    pre_t = __reduce_add_sync(0xffffffffu, pre_t);
    pre_r = __reduce_add_sync(0xffffffffu, pre_r);
    // Segment j = beg + lane: tiles up to j and rows from j to the end, as ModelPrefixes (exact integer reorderings:
    // (sum of row tiles) * ceil(N / BN), (sum of rows) * N * eb).
    const int j = beg + lane;
    const bool mine = j < end;
    const uint32_t r = mine ? (uint32_t)t.seg[j].rows : 0u;
    const uint64_t incl = (uint64_t)WarpInclusiveSum(
        (long long)((uint64_t)MagicCeilDiv(r, tm, mtm) << 32 | r), lane);
    if (mine) {
      sc->seg.ceil_arg[j] = CeilArg((int64_t)(pre_t + (uint32_t)(incl >> 32)) * nn);
      sc->seg.push_us[j] = RmMul((double)(mr - j), p.seg_us);
      sc->seg.bytes[j] = (double)((int64_t)(rem_r - pre_r - ((uint32_t)incl - r)) * (N * eb));
    }
    __syncwarp();  // the chunk is this warp's own: no barrier
    if (feasible) {
      // ModelProducerUs and ModelTermUs: the same rounded operations in the same order per term.
      us = warp == 0 ? ReadyUsFp(CeilArg((int64_t)all_t * nn), rp, e.tile_us) : 0.0;
#pragma unroll 4
      for (int s = beg; s < end; ++s)
        us = RmMax(us, RmAdd(ReadyUsFp(sc->seg.ceil_arg[s], rp, e.tile_us),
                             RmAdd(sc->seg.push_us[s], RmMul(sc->seg.bytes[s], e.us_per_byte))));
    }
  }
  double(*us_half)[32] = sc->us[parity & 1];
  if (warp < kWarps) us_half[warp][lane] = us;
  __syncthreads();
  // One barrier: every warp reduces the per-warp maxima itself (no second barrier to publish warp 0's answer). Safe
  // with the same scratch across calls: this call's reads of its half come after its barrier, and the next call that
  // writes the same half (two calls on) does so only after the next call's barrier, which every warp reaches after
  // these reads; seg[] is read before the barrier and each warp writes only its own chunk. (ChooseByScans uses us[0]
  // between barriers of its own.)
  double v = us_half[0][lane];
  for (int w = 1; w < kWarps; ++w) v = RmMax(v, us_half[w][lane]);
  return ArgminC(feasible ? v : 1e300);
}

__device__ inline int DeviceChooseGatherConsumers(const SegTable& t, const ModelParams& p, const GatherModelShape& sh,
                                                  int rank, int ranks, int max_ctas, ChoiceScratch* sc,
                                                  int parity = 0) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n = t.n;
  auto& g = sc->gather;
  GatherModelSource* out = g.src[parity & 1];
  if (warp == 0) {
    int64_t carry_t = 0, carry_r = 0;
    int carry_f = 0;
    uint32_t has_rows = 0;
    const uint32_t below = (1u << lane) - 1u;
    for (int base = 0; base < n; base += 32) {  // warp-uniform
      const int j = base + lane;
      const bool valid = j < n;
      const int src = valid ? t.seg[j].src : -1;
      const int64_t rows = valid ? t.seg[j].rows : 0;
      const int64_t tiles = valid ? ModelTiles(p, rows, sh.N) : 0;
      const int64_t incl_t = carry_t + WarpInclusiveSum(tiles, lane);
      const int64_t incl_r = carry_r + WarpInclusiveSum(rows, lane);
      const bool first = valid && (j == 0 || t.seg[j - 1].src != src);
      const bool last = valid && (j == n - 1 || t.seg[j + 1].src != src);
      const uint32_t firsts = __ballot_sync(0xffffffffu, first);
      if (first) {
        g.place[src] = carry_f + __popc(firsts & below);
        g.rows_before[src] = incl_r - rows;
      }
      if (last) {
        g.cum_end[src] = incl_t;
        g.rows_end[src] = incl_r;
      }
      has_rows |= __reduce_or_sync(0xffffffffu, valid ? 1u << src : 0u);
      carry_t = __shfl_sync(0xffffffffu, incl_t, 31);
      carry_r = __shfl_sync(0xffffffffu, incl_r, 31);
      carry_f += __popc(firsts);
    }
    __syncwarp();
    const int no_rows = ranks - __popc(has_rows);
    if (lane < ranks) {
      const int s = lane;
      const int32_t remote = s != rank ? 1 : 0;
      if ((has_rows >> s) & 1u)
        out[no_rows + g.place[s]] = GatherModelSource{g.cum_end[s], g.rows_end[s] - g.rows_before[s], s, remote};
      else
        out[__popc(~has_rows & below)] = GatherModelSource{0, 0, s, remote};
    }
    if (lane == 0) g.total_tiles[parity & 1] = carry_t;
  }
  __syncthreads();
  // Safe with the same scratch across calls: as DeviceChooseConsumers' halves (warp 0's per-source arrays are its own).
  const int c = lane + 1;
  double v = 1e300;
  if (c <= max_ctas && ModelFeasible(p, c))
    v = GatherMakespanFromSources(p, out, ranks, g.total_tiles[parity & 1], sh, c);
  return __shfl_sync(0xffffffffu, ShuffleArgminLane0(v, c), 0);
}

}  // namespace jmo::cuda::decision_v0
