// The resource manager's device decision of commit 06410c5, kept as decision_probe's second baseline: the segment
// table (BuildSegments: 64-bit block scans, a branching placing loop) and the consumer choice on it
// (DeviceChooseConsumersPrepared: three FP64 operations for a ready time, RmMax in the chunked loop). The library's
// data structures (SegTable, TableScratch, ChoiceScratch, TermPrepIn/Out) and its unchanged helpers are shared; only
// these functions are frozen. The probe times the library's decision beside this one in the same run and checks
// both sums against the host's rule.
#pragma once

#include "cuda/schedule/resource_manager.cuh"
#include "cuda/schedule/segment_table.cuh"

namespace jmo::cuda::decision_v1 {

// 06410c5's ready time: a multiply, a rounded-up add of 2^52 and an fma (RmMul((double)CeilDiv(cum, P), tile_us)).
__device__ __forceinline__ double ReadyUsFmaV1(double ceil_arg, double rp, double tile_us, double neg_shift) {
  return __fma_rn(__dadd_ru(__dmul_rn(ceil_arg, rp), kTwo52), tile_us, neg_shift);
}

template <int K>
__device__ inline void ScanV1(const int64_t (&v)[K], int64_t* sums, int64_t (&before)[K],
                                           int64_t (&total)[K]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  int64_t incl[K];
#pragma unroll
  for (int k = 0; k < K; ++k) incl[k] = v[k];
  bool nonzero = false;
#pragma unroll
  for (int k = 0; k < K; ++k) nonzero = nonzero || v[k] != 0;
  if (__any_sync(0xffffffffu, nonzero)) {  // warp-uniform
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const long long y = __shfl_up_sync(0xffffffffu, (long long)incl[k], o);
        if (lane >= o) incl[k] += y;
      }
    }
  }
  if (lane == 31) {
#pragma unroll
    for (int k = 0; k < K; ++k) sums[warp * K + k] = incl[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    before[k] = incl[k] - v[k];
    total[k] = 0;
  }
#pragma unroll 4
  for (int w = 0; w < warps; ++w) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t s = sums[w * K + k];
      if (w < warp) before[k] += s;
      total[k] += s;
    }
  }
}

__device__ inline bool SourceBeforeRowsV1(int u, int s, int rank, int64_t rows_u, int64_t rows_s) {
  const bool ul = u == rank, sl = s == rank;
  if (ul != sl) return !ul;  // remote before local
  if (rows_u != rows_s) return rows_u > rows_s;
  return u < s;
}

template <bool kPrep = false>
__device__ inline bool BuildSegments(const RankDev& rd, const int32_t* seg_rows, const int32_t* seg_ret_off, int E_l,
                                     int64_t cap, SegTable* t, TableScratch* sc, const TermPrepIn* prep = nullptr,
                                     TermPrepOut* out = nullptr) {
  const int R = rd.ranks, n = E_l * R, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool mine = tid < n;
  if (tid == 0) sc->first_bad = n;
  // Plan order: segment tid (expert tid / R, source tid % R). Source-major: source s, expert e, plan index q.
  const int32_t rows = mine ? seg_rows[tid] : 0, ret_off = mine ? seg_ret_off[tid] : 0;
  const int s = mine ? SmallDiv(tid, E_l) : 0, e = tid - s * E_l, q = e * R + s;
  const int expert = SmallDiv(tid, R);  // (blockDim.x <= 1024, R <= kMaxRanks)
  const int32_t rows_q = mine ? seg_rows[q] : 0;
  const int32_t kept = rows > 0 ? rows : 0, kept_q = rows_q > 0 ? rows_q : 0;
  constexpr int kValues = kPrep ? 5 : 4;
  int64_t v[kValues] = {kept, BandsOf(kept), kept_q, (kept_q > 0 ? 1ll << kSegShift : 0) + BandsOf(kept_q)};
  if constexpr (kPrep) v[4] = MagicCeilDiv((uint32_t)kept_q, prep->tile_m, prep->tile_m_magic);  // (0 rows: 0)
  int64_t pre[kValues], total[kValues];
  ScanV1<kValues>(v, sc->x.scan, pre, total);  // barrier 1
  const int64_t off = pre[0];
  const bool over_cap = off + (int64_t)rows > cap;
  const bool bad = mine && (rows < 0 || over_cap || ret_off < 0 || (int64_t)ret_off + rows > rd.sizes.ret_rows);
  if (bad) atomicMin(&sc->first_bad, tid);  // (only an invalid plan's bad segments)
  if (mine) {
    sc->raw[tid] = Segment{expert, tid - expert * R, (int32_t)off, rows, ret_off, (int32_t)pre[1]};
    if (e == 0) sc->src_start[s] = SourcePrefix{pre[2], pre[3], kPrep ? pre[kValues - 1] : 0};
  }
  if (tid == 0) sc->src_start[R] = SourcePrefix{total[2], total[3], kPrep ? total[kValues - 1] : 0};
  if (__syncthreads_or(bad)) {  // barrier 2 (a valid plan reads no error word)
    if (tid == sc->first_bad)  // the segments before it are valid, so `off` is the CPU handler's offset too
      ReportBadInput(rd, kBadSegment, tid, rows < 0 ? rows : (over_cap ? off + (int64_t)rows : ret_off),
                     over_cap ? cap : rd.sizes.ret_rows);
    return false;
  }
  const int64_t total_bands = total[1];
  if (total_bands > rd.sizes.max_bands) {
    if (tid == 0) ReportBadInput(rd, kBadTooManyTiles, 0, total_bands, rd.sizes.max_bands);
    return false;
  }
  // Source u's rows, packed (segments, bands) and row tiles (0 past the last source), from shared memory (broadcast
  // loads where every lane asks for the same u).
  auto source = [&](int u, int64_t* rows_u, int64_t* segs_bands_u, int64_t* tiles_u) {
    const SourcePrefix a = sc->src_start[u < R ? u : R], b = sc->src_start[u < R ? u + 1 : R];
    *rows_u = b.rows - a.rows;
    *segs_bands_u = b.segs_bands - a.segs_bands;
    *tiles_u = b.tiles - a.tiles;
  };
  if (warp < kPlaceWarps) {
    int64_t rows_u, sb_u, tiles_u, acc = 0;
    uint64_t acc_tr = 0;
    source(lane, &rows_u, &sb_u, &tiles_u);
#pragma unroll 4
    for (int w = warp; w < R; w += kPlaceWarps) {  // warp-uniform; the loads of different w are independent
      int64_t rows_w, sb_w, tiles_w;
      source(w, &rows_w, &sb_w, &tiles_w);
      if (w != lane && SourceBeforeRowsV1(w, lane, rd.rank, rows_w, rows_u)) {
        acc += sb_w;
        if constexpr (kPrep) acc_tr += ((uint64_t)tiles_w << 32) + (uint64_t)rows_w;  // (exact if rows_small)
      }
    }
    if (lane < R) {
      sc->x.before.sb[lane][warp] = acc;
      if constexpr (kPrep) sc->x.before.tr[lane][warp] = acc_tr;
      if (warp == 0) {
        sc->rows_to_rank[lane] = rows_u;
        sc->segs_of_rank[lane] = (int32_t)(sb_u >> kSegShift);
      }
    }
  }
  const int m = (int)(total[3] >> kSegShift);
  if (tid == 0) {
    int64_t own_rows, own_sb, own_tiles;
    source(rd.rank, &own_rows, &own_sb, &own_tiles);
    const int remote = m - (int)(own_sb >> kSegShift);  // (remote before local: the local segments are the last)
    t->band_prefix[m] = (int32_t)total_bands;
    t->n = m;
    t->bands = (int32_t)total_bands;
    t->remote_segs = remote;
    t->remote_rows = total[0] - own_rows;
    t->remote_bands = (int32_t)(total_bands - (own_sb & ((1ll << kSegShift) - 1)));
  }
  __syncthreads();  // barrier 3
  if (mine && kept_q > 0) {
    const SourcePrefix own = sc->src_start[s];
    int64_t place = pre[3] - own.segs_bands;  // this source's kept segments and bands before it
#pragma unroll
    for (int w = 0; w < kPlaceWarps; ++w) place += sc->x.before.sb[s][w];
    const int pos = (int)(place >> kSegShift);
    t->seg[pos] = sc->raw[q];
    t->band_prefix[pos] = (int32_t)(place & ((1ll << kSegShift) - 1));
    if constexpr (kPrep) {
      const int mr = t->remote_segs;  // (tid 0's, before barrier 3)
      if (pos < mr) {
        uint64_t tr = 0;
#pragma unroll
        for (int w = 0; w < kPlaceWarps; ++w) tr += sc->x.before.tr[s][w];
        const int64_t rows_before = (int64_t)(tr & 0xffffffffull) + (pre[2] - own.rows);  // segments before j
        const int64_t tiles_upto = (int64_t)(tr >> 32) + (pre[4] - own.tiles) + v[4];      // segments 0..j
        prep->ceil_arg[pos] = CeilArg(tiles_upto * prep->col_tiles);
        prep->push_us[pos] = RmMul((double)(mr - pos), prep->seg_us);
        prep->bytes[pos] = (double)((t->remote_rows - rows_before) * prep->row_bytes);
      }
    }
  }
  if constexpr (kPrep) {
    const bool small = __syncthreads_and(!(mine && kept_q > 0) || kept_q < (1 << 23));  // barrier 4
    out->row_tiles = total[4];
    out->rows_small = small && total[0] < (1ll << 31);
  } else {
    __syncthreads();  // barrier 4
  }
  return true;
}

__device__ __forceinline__ double ChunkMaxUsV1(const ChoiceScratch* sc, int beg, int end, bool producer,
                                             double all_ceil_arg, double rp, const ModelEval& e) {
  const double shift = ShiftOf(e.tile_us);
  double us = producer ? ReadyUsFmaV1(all_ceil_arg, rp, e.tile_us, shift) : 0.0;
#pragma unroll 4
  for (int s = beg; s < end; ++s)
    us = RmMax(us, RmAdd(ReadyUsFmaV1(sc->seg.ceil_arg[s], rp, e.tile_us, shift),
                         RmAdd(sc->seg.push_us[s], RmMul(sc->seg.bytes[s], e.us_per_byte))));
  return us;
}

__device__ __forceinline__ int ArgminOverWarpsV1(double us, bool feasible, ChoiceScratch* sc, int parity) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double(*us_half)[32] = sc->us[parity & 1];
  if (warp < kWarps) us_half[warp][lane] = us;
  __syncthreads();
  // One barrier: every warp reduces the per-warp maxima itself (no second barrier to publish warp 0's answer). Safe
  // with the same scratch across calls: this call's reads of its half come after its barrier, and the next call that
  // writes the same half (two calls on) does so only after the next call's barrier, which every warp reaches after
  // these reads; seg[] is read before the barrier, and written either by each warp for its own chunk
  // (DeviceChooseConsumers) or by BuildSegments<true> before its last barrier. (ChooseByScans uses us[0] between
  // barriers of its own.)
  // (A tree of maxima: exact in any grouping, the terms being >= +0 and not NaN.)
  double m[kWarps];
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m[w] = us_half[w][lane];
#pragma unroll
  for (int h = kWarps / 2; h > 0; h /= 2)
#pragma unroll
    for (int w = 0; w < h; ++w) m[w] = RmMax(m[w], m[w + h]);
  return ArgminC(feasible ? m[0] : 1e300);
}

__device__ inline int DeviceChooseConsumersPrepared(const SegTable& t, const TermPrepOut& prep, const ModelParams& p,
                                                    const CandidateConsts& cand, int64_t N, int64_t K, int64_t eb,
                                                    int max_ctas, ChoiceScratch* sc, int parity = 0) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, mr = t.remote_segs;
  const int c = lane + 1;
  const bool feasible = c <= max_ctas && ModelFeasible(p, c);
  const ModelEval e = ModelEvalWith(p, K, feasible ? c : 1, cand.us_per_byte[lane]);
  const double rp = cand.rcp_producers[lane];
  const int64_t nn = cand.col_tiles;
  if (!ChunkedIsExact(prep.rows_small, e, p, nn, N, eb)) return ChooseByScans(t, p, N, K, eb, max_ctas, sc);
  const int ch = (mr + kWarps - 1) / kWarps, beg = warp * ch, end = min(beg + ch, mr);
  double us = 0.0;
  if (feasible && (beg < end || warp == 0))
    us = ChunkMaxUsV1(sc, beg, end, warp == 0, CeilArg(prep.row_tiles * nn), rp, e);
  return ArgminOverWarpsV1(us, feasible, sc, parity);
}

}  // namespace jmo::cuda::decision_v1
