// The segment table of one expert_combine call: the call's (expert, source) segments in producer order with their
// band offsets, built by every CTA from the device-side plan arrays. The producer engines, the consumer, the resource
// manager's device side and the fused dispatch_gemm read it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

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

// What BuildSegments builds beside the table, on request: nothing; the consumer choice's parts of its terms
// (TermPrepIn: DeviceChooseConsumersPrepared's); gather_rs's choice's parts of its sources' terms (GatherPrepIn:
// DeviceChooseGatherConsumersPrepared's).
enum : int { kPrepNone = 0, kPrepTerms = 1, kPrepGather = 2 };

// A source's exclusive prefixes at its first segment in source-major order (BuildSegments): rows, kept segments and
// their bands packed as (segments << kSegShift) + bands, and (kPrepTerms, kPrepGather) the model's row tiles.
struct SourcePrefix {
  int64_t rows;
  int64_t segs_bands;
  int64_t tiles;
};
constexpr int kSegShift = 40;  // bands of <= kMaxSegments segments of < 2^31 rows each: < 2^34
constexpr int kPlaceWarps = 4;  // warps that order the sources (one per SM sub-partition)
static_assert(kThreads >= 32 * kPlaceWarps && kMaxRanks <= 32, "a lane per source in every placing warp");

struct TableScratch {
  Segment raw[kMaxSegments];         // in plan order (expert-major)
  int64_t rows_to_rank[kMaxRanks];
  int32_t segs_of_rank[kMaxRanks];   // kept (non-empty) segments per source
  int64_t warp_sums[32];
  SourcePrefix src_start[kMaxRanks + 1];  // by source, [ranks]: the totals
  union {
    int64_t scan[5 * 32];     // BlockExclusiveScanN's warp totals (64-bit words)
    uint32_t scan32[6 * 32];  // (32-bit words: ScanSegmentValues' narrow form)
    struct {               // per source and placing warp, of the sources before it: (segments, bands), and
      int64_t sb[kMaxRanks][kPlaceWarps];
      uint64_t tr[kMaxRanks][kPlaceWarps];  // (row tiles << 32) + (kPrepTerms) rows, (kPrepGather) sources with rows
    } before;
  } x;
  int32_t first_bad;
  int32_t sources_with_rows;  // (kPrepGather)
};

// What the consumer choice's chunked form (resource_manager.cuh DeviceChooseConsumersPrepared) needs of the table,
// built with it on request (BuildSegments<kPrepTerms>, one scanned value more and no pass of the choice's own): for
// each segment j < remote_segs in producer order the parts of its term that do not depend on C, as
// DeviceChooseConsumers computes them from the same integers (tiles up to j, rows from j on).
struct TermPrepIn {
  uint32_t tile_m, tile_m_magic;  // the model's BM and MagicCeilDiv's magic for it (CandidateConsts)
  int64_t col_tiles;              // ceil(N / BN)
  int64_t row_bytes;              // N * element bytes
  double seg_us;
  double* ceil_arg;  // [kMaxSegments] CeilArg(cum_tiles_j), cum_tiles_j = (row tiles of segments 0..j) * col_tiles
  double* push_us;   // [kMaxSegments] RmMul(remote_segs - j, seg_us)
  double* bytes;     // [kMaxSegments] (rows of segments j..remote_segs - 1) * row_bytes
};
struct TermPrepOut {  // the same on every thread (kPrepTerms and kPrepGather)
  int64_t row_tiles;  // ceil(rows / BM) over all segments
  bool rows_small;    // every segment's rows below 2^23 and all rows below 2^31: the arrays are the choice's
};

// What gather_rs's choice (resource_manager.cuh DeviceChooseGatherConsumersPrepared) needs of the table, built with
// it on request (BuildSegments<kPrepGather>: the scan's row tiles and the placing warps' sums of the kPrepTerms form,
// no pass of the choice's own): per source, at its place k in the consumer's order (GatherModelSources: the sources
// with no row here first, by index, then the others in producer order), the parts of its term that do not depend on
// C, from GatherModelSources' integers (WriteGatherSource).
struct GatherPrepIn {
  uint32_t tile_m, tile_m_magic;  // the model's BM and MagicCeilDiv's magic for it (CandidateConsts)
  int64_t col_tiles;              // ceil(N / BN)
  GatherModelShape sh;
  int32_t rank;
  double us_per_link_byte;  // 1e-3 / link_gbps (CandidateConsts)
  int64_t* cum;             // [kMaxRanks] cum_tiles: tiles up to the source's last segment (0: no row here)
  double* ceil_arg;         // [kMaxRanks] CeilArg(cum_tiles)
  double* traffic;          // [kMaxRanks] (double)GatherSourceTraffic(sh, its rows here)
  double* link_us;          // [kMaxRanks] RmMul(its partial's link bytes, us_per_link_byte)
};

// floor(a / d) for 0 <= a < 2^10 and 1 <= d <= 2^10 without an integer division sequence: (a + 0.5) / d lies at
// least 0.5 / d >= 2^-11 from every integer, and __fdividef errs by at most 2 ulp (relative < 2^-22, so absolute
// < 2^-12 on quotients below 2^10): truncating it gives the exact quotient.
__device__ __forceinline__ int SmallDiv(int a, int d) {
  return (int)__fdividef((float)a + 0.5f, (float)d);
}
static_assert(kThreads <= 1024 && kMaxSegments <= 1024 && kMaxRanks <= 1024, "SmallDiv's range");

// ceil(a / d) for a < 2^32, 1 <= d < 2^32, m = 0xffffffff / d: q = umulhi(a, m) is floor(a / d) or one less (m * d >
// 2^32 - d, so a * m / 2^32 > a / d - 1; and m <= 2^32 / d), one correction makes it exact. Instead of the ~20
// instructions of a 32-bit division.
__device__ __forceinline__ uint32_t MagicCeilDiv(uint32_t a, uint32_t d, uint32_t m) {
  uint32_t q = __umulhi(a, m), r = a - q * d;
  if (r >= d) {
    ++q;
    r -= d;
  }
  return q + (r != 0u);
}

// The argument of the FP64 ceiling (resource_manager.cuh ReadyUsFma): cum - 0.5, or 0 for cum = 0.
__device__ __forceinline__ double CeilArg(int64_t cum) { return cum > 0 ? __dadd_rn((double)cum, -0.5) : 0.0; }

// Source s's place k in gather_rs's consumer order (GatherModelSources): the sources with no row here first, by
// index (no_rows_below: those of them below s), then the `with_rows` sources with rows in producer order (place: s's
// among them).
__device__ __forceinline__ int GatherConsumerPlace(int ranks, int with_rows, bool has_rows, int place,
                                                   int no_rows_below) {
  return has_rows ? ranks - with_rows + place : no_rows_below;
}

// Source s's entry k of gather_rs's choice: its tiles up to its last segment and its rows here (0 and 0: no row
// here), the parts of GatherMakespanFromSources' term that do not depend on C, the host's operations.
__device__ __forceinline__ void WriteGatherSource(const GatherPrepIn& g, int k, int s, int64_t cum, int64_t rows) {
  g.cum[k] = cum;
  g.ceil_arg[k] = CeilArg(cum);
  g.traffic[k] = (double)GatherSourceTraffic(g.sh, rows);
  g.link_us[k] = RmMul(s != g.rank ? (double)(g.sh.T * g.sh.N * 4) : 0.0, g.us_per_link_byte);
}

// The last i in [0, n) with prefix[i] <= x (prefix ascending from prefix[0] <= x).
__device__ __forceinline__ int LastAtMost(const int32_t* prefix, int n, int x) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (prefix[mid] <= x) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ int32_t BandsOf(int32_t rows) {
  return (rows + (int32_t)kBandRows - 1) / (int32_t)kBandRows;
}

// BuildSegments' barrier 1: the exclusive prefix sums over the threads and the totals of each thread's values, kept
// rows (>= 0) of plan segment tid and of source-major segment tid: plan order rows and bands; source-major rows,
// (kept segments << kSegShift) + bands and (K = 5) row tiles of prep's tile. In 32-bit words where the capacity
// bounds them (0 <= cap < kNarrowCap = 2^23), the source-major segments and bands as two words: rows are clamped at
// cap + 1 for the sums, so each is <= 2^23 and over <= 256 segments rows and tiles sum to <= 2^31, bands (<= 2^17
// each) to <= 2^25, segments to <= 256: every word < 2^32. The clamp changes no prefix BuildSegments uses: a valid
// plan has no segment above cap (each ends within it), and in an invalid one every segment before the first bad one
// is valid, so that one's offset and verdict are exact, and the lowest bad index is the same (later ones only matter
// through it). Else 64-bit words. Half the shuffle instructions and adds of the 64-bit form, and no loop over the
// warps (BlockExclusiveScanN); the same integers.
constexpr int64_t kNarrowCap = 1 << 23;
static_assert(kMaxSegments <= 256 && kBandRows == 64, "ScanSegmentValues' 32-bit bounds");
// (K = 5: tile_m and tile_m_magic as CandidateConsts'.)
template <int K>
__device__ __forceinline__ void ScanSegmentValues(int32_t kept, int32_t kept_q, uint32_t tile_m, uint32_t tile_m_magic,
                                                  int64_t cap, TableScratch* sc, int64_t (&pre)[K],
                                                  int64_t (&total)[K]) {
  static_assert(K == 4 || K == 5, "four values, five with the row tiles");
  if (cap >= 0 && cap < kNarrowCap) {  // block-uniform
    const int32_t lim = (int32_t)cap + 1;
    const int32_t a = kept < lim ? kept : lim, b = kept_q < lim ? kept_q : lim;
    // Words 0..K-1 as the 64-bit values, the bands alone in word 3; word K: the source-major segment kept.
    uint32_t v[K + 1], p[K + 1], t[K + 1];
    v[0] = (uint32_t)a;
    v[1] = (uint32_t)BandsOf(a);
    v[2] = (uint32_t)b;
    v[3] = (uint32_t)BandsOf(b);
    if constexpr (K == 5) v[4] = MagicCeilDiv((uint32_t)b, tile_m, tile_m_magic);  // (0 rows: 0)
    v[K] = b > 0 ? 1u : 0u;
    BlockExclusiveScanN<K + 1, uint32_t>(v, sc->x.scan32, p, t);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      pre[k] = k == 3 ? ((int64_t)p[K] << kSegShift) + (int64_t)p[3] : (int64_t)p[k];
      total[k] = k == 3 ? ((int64_t)t[K] << kSegShift) + (int64_t)t[3] : (int64_t)t[k];
    }
  } else {
    int64_t v[K];
    v[0] = kept;
    v[1] = BandsOf(kept);
    v[2] = kept_q;
    v[3] = (kept_q > 0 ? 1ll << kSegShift : 0) + BandsOf(kept_q);
    if constexpr (K == 5) v[4] = MagicCeilDiv((uint32_t)kept_q, tile_m, tile_m_magic);
    BlockExclusiveScanN<K>(v, sc->x.scan, pre, total);
  }
}

// A thread's entries of the plan arrays, BuildSegments' one round of global loads: plan segment tid's rows and ret
// offset, and the rows of source-major segment tid (source tid / E_l, expert tid % E_l); 0 past the last segment. A
// kernel loads them before the other loads it waits for (ExpertKernel: its call state), so that the two round trips
// overlap: they are the call's inputs, valid to read whatever the call state says.
struct PlanEntries {
  int32_t rows, ret_off, rows_q;
};
__device__ __forceinline__ PlanEntries LoadPlanEntries(const int32_t* seg_rows, const int32_t* seg_ret_off, int E_l,
                                                       int R) {
  const int tid = threadIdx.x;
  if (tid >= E_l * R) return PlanEntries{0, 0, 0};
  const int s = SmallDiv(tid, E_l), e = tid - s * E_l;
  return PlanEntries{seg_rows[tid], seg_ret_off[tid], seg_rows[e * R + s]};
}

// Builds the table from the device-side plan arrays (E_l * R <= kMaxSegments <= blockDim.x). Every thread calls it
// and gets the same answer; false (and the error recorded, naming the first bad segment) on an invalid plan. Four
// barriers, no loop over the segments:
//   1. thread i takes segment i in plan order (expert-major: offsets and band bases) and segment i in source-major
//      order (source i / E_l, expert i % E_l: a source's segments consecutive), and one block scan gives the four
//      prefix sums (plan order: rows, bands; source-major: rows, (kept segments, bands); ScanSegmentValues);
//   2. the first segment of each source publishes its source-major prefixes: each source's rows, segments and bands
//      are differences of consecutive ones;
//   3. the placing warps order the sources (lane u: source u; warp w compares it with sources w, w + kPlaceWarps, ...
//      by SourceBeforeRows) into the segments and bands of the sources before it;
//   4. segment i in source-major order lands at (segments of the sources before its own) + (kept segments of its
//      source before it), with band_prefix (bands before it in producer order) from the same two parts: the place
//      SegmentBefore gives it (sources first, then experts within a source).
// kPrepTerms: the scan also counts the model's row tiles (source-major), the placing warps the rows and row tiles of
// the sources before, and each remote segment's thread writes its TermPrepIn entries where step 4 places it (the
// fourth barrier, an AND, also tells whether every segment is small); *out gets the totals.
// kPrepGather: the same scan and barriers; the placing warps sum the row tiles and the sources with rows before each
// source (its place among them in producer order), warp 0 writes the GatherPrepIn entries of the sources with no row
// (a ballot gives them and their count) and each source's first kept segment writes its source's entry in step 4
// (tiles up to its last segment: of the sources before it and its own; its rows: differences of src_start); *out as
// kPrepTerms'. The packed sums are exact where out->rows_small (row tiles below 2^31, sources with rows <= 32).
// BuildSegmentsFrom takes the plan entries loaded by LoadPlanEntries (the same E_l and R); BuildSegments loads them.
template <int kPrep>
using PrepIn = std::conditional_t<kPrep == kPrepGather, GatherPrepIn, TermPrepIn>;
template <int kPrep = kPrepNone>
__device__ inline bool BuildSegmentsFrom(const RankDev& rd, const PlanEntries& plan, int E_l, int64_t cap,
                                         SegTable* t, TableScratch* sc, const PrepIn<kPrep>* prep = nullptr,
                                         TermPrepOut* out = nullptr) {
  static_assert(kPrep == kPrepNone || kPrep == kPrepTerms || kPrep == kPrepGather, "a BuildSegments form");
  const int R = rd.ranks, n = E_l * R, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool mine = tid < n;
  if (tid == 0) sc->first_bad = n;
  // Plan order: segment tid (expert tid / R, source tid % R). Source-major: source s, expert e, plan index q.
  const int32_t rows = plan.rows, ret_off = plan.ret_off, rows_q = plan.rows_q;
  const int s = mine ? SmallDiv(tid, E_l) : 0, e = tid - s * E_l, q = e * R + s;
  const int expert = SmallDiv(tid, R);  // (blockDim.x <= 1024, R <= kMaxRanks)
  const int32_t kept = rows > 0 ? rows : 0, kept_q = rows_q > 0 ? rows_q : 0;
  constexpr bool kTiles = kPrep != kPrepNone;
  constexpr int kValues = kTiles ? 5 : 4;
  uint32_t tile_m = 1u, tile_m_magic = 0u;
  if constexpr (kTiles) {
    tile_m = prep->tile_m;
    tile_m_magic = prep->tile_m_magic;
  }
  int64_t pre[kValues], total[kValues];
  ScanSegmentValues<kValues>(kept, kept_q, tile_m, tile_m_magic, cap, sc, pre, total);  // barrier 1
  const int64_t off = pre[0];
  const bool over_cap = off + (int64_t)rows > cap;
  const bool bad = mine && (rows < 0 || over_cap || ret_off < 0 || (int64_t)ret_off + rows > rd.sizes.ret_rows);
  if (bad) atomicMin(&sc->first_bad, tid);  // (only an invalid plan's bad segments)
  if (mine) {
    sc->raw[tid] = Segment{expert, tid - expert * R, (int32_t)off, rows, ret_off, (int32_t)pre[1]};
    if (e == 0) sc->src_start[s] = SourcePrefix{pre[2], pre[3], kTiles ? pre[kValues - 1] : 0};
  }
  if (tid == 0) sc->src_start[R] = SourcePrefix{total[2], total[3], kTiles ? total[kValues - 1] : 0};
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
    // Branch-free: each source's loads go out whatever the order says (an unrolled group's together), and its parts
    // are added through a mask. (A source is never before itself: SourceBeforeRows' index tie-break.)
#pragma unroll 4
    for (int w = warp; w < R; w += kPlaceWarps) {  // warp-uniform
      int64_t rows_w, sb_w, tiles_w;
      source(w, &rows_w, &sb_w, &tiles_w);
      const int64_t take = -(int64_t)SourceBeforeRows(w, lane, rd.rank, rows_w, rows_u);
      acc += sb_w & take;
      if constexpr (kTiles)  // (exact if rows_small)
        acc_tr += (((uint64_t)tiles_w << 32) + (kPrep == kPrepGather ? (uint64_t)(rows_w > 0) : (uint64_t)rows_w)) &
                  (uint64_t)take;
    }
    if (lane < R) {
      sc->x.before.sb[lane][warp] = acc;
      if constexpr (kTiles) sc->x.before.tr[lane][warp] = acc_tr;
      if (warp == 0) {
        sc->rows_to_rank[lane] = rows_u;
        sc->segs_of_rank[lane] = (int32_t)(sb_u >> kSegShift);
      }
    }
    if constexpr (kPrep == kPrepGather) {
      if (warp == 0) {  // the sources with no row here: first in the consumer's order, by index (rows_u: 0 past R)
        const uint32_t has_rows = __ballot_sync(0xffffffffu, rows_u > 0);
        if (lane < R && rows_u == 0)
          WriteGatherSource(*prep, GatherConsumerPlace(R, 0, false, 0, __popc(~has_rows & ((1u << lane) - 1u))), lane,
                            0, 0);
        if (lane == 0) sc->sources_with_rows = __popc(has_rows);
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
    // (Every shared load this segment needs depends on s and q only: one round of loads.)
    const SourcePrefix own = sc->src_start[s];
    const Segment raw = sc->raw[q];
    int64_t place = pre[3] - own.segs_bands;  // this source's kept segments and bands before it
    uint64_t tr = 0;
#pragma unroll
    for (int w = 0; w < kPlaceWarps; ++w) {
      place += sc->x.before.sb[s][w];
      if constexpr (kTiles) tr += sc->x.before.tr[s][w];
    }
    const int mr = t->remote_segs;  // (tid 0's, before barrier 3)
    const int64_t remote_rows = t->remote_rows;
    const int pos = (int)(place >> kSegShift);
    t->seg[pos] = raw;
    t->band_prefix[pos] = (int32_t)(place & ((1ll << kSegShift) - 1));
    if constexpr (kPrep == kPrepTerms) {
      if (pos < mr) {
        const int64_t rows_before = (int64_t)(tr & 0xffffffffull) + (pre[2] - own.rows);  // segments before j
        const int64_t tiles_upto = (int64_t)(tr >> 32) + (pre[4] - own.tiles) +            // segments 0..j
                                   (int64_t)MagicCeilDiv((uint32_t)kept_q, prep->tile_m, prep->tile_m_magic);
        prep->ceil_arg[pos] = CeilArg(tiles_upto * prep->col_tiles);
        prep->push_us[pos] = RmMul((double)(mr - pos), prep->seg_us);
        prep->bytes[pos] = (double)((remote_rows - rows_before) * prep->row_bytes);
      }
    }
    if constexpr (kPrep == kPrepGather) {
      if (((pre[3] - own.segs_bands) >> kSegShift) == 0) {  // its source's first kept segment: the source's entry,
        // after the sources with no row and those with rows before it
        const SourcePrefix next = sc->src_start[s + 1];
        const int k = GatherConsumerPlace(R, sc->sources_with_rows, true, (int)(uint32_t)tr, 0);
        WriteGatherSource(*prep, k, s, ((int64_t)(tr >> 32) + (next.tiles - own.tiles)) * prep->col_tiles,
                          next.rows - own.rows);
      }
    }
  }
  if constexpr (kTiles) {
    const bool small = __syncthreads_and(!(mine && kept_q > 0) || kept_q < (1 << 23));  // barrier 4
    out->row_tiles = total[4];
    out->rows_small = small && total[0] < (1ll << 31);
  } else {
    __syncthreads();  // barrier 4
  }
  return true;
}
template <int kPrep = kPrepNone>
__device__ inline bool BuildSegments(const RankDev& rd, const int32_t* seg_rows, const int32_t* seg_ret_off, int E_l,
                                     int64_t cap, SegTable* t, TableScratch* sc, const PrepIn<kPrep>* prep = nullptr,
                                     TermPrepOut* out = nullptr) {
  return BuildSegmentsFrom<kPrep>(rd, LoadPlanEntries(seg_rows, seg_ret_off, E_l, rd.ranks), E_l, cap, t, sc, prep,
                                  out);
}

__device__ __forceinline__ int FindSegment(const SegTable& t, int band) { return LastAtMost(t.band_prefix, t.n, band); }

// A segment's place in expert-major order (ExpertMajorOrder): its table index, and its expert's first place.
struct SegPlace {
  int16_t seg, first;
};

// Local expert e's rows in recv, [start, start + rows) (its segments are contiguous there: the plan's order, e R + s),
// and its segment from this rank (nullptr: none), from BuildSegments' segments in plan order (TableScratch::raw).
struct ExpertRange {
  int32_t start, rows;
  const Segment* local;
};
__device__ __forceinline__ ExpertRange ExpertRangeOf(const Segment* raw, int R, int rank, int e) {
  const Segment &first = raw[e * R], &last = raw[e * R + R - 1], &own = raw[e * R + rank];
  return {first.recv_off, last.recv_off + last.rows - first.recv_off, own.rows > 0 ? &own : nullptr};
}
static_assert(kMaxSegments <= 32767, "a segment index fits an int16_t");

// The table's segments expert-major: order[p] = the p-th, an expert's segments one after another (experts ascending)
// in the table's order among them (remote sources first, the local source last). expert_combine's wgmma producer in
// this order tiles each expert's rows in recv as one range (ExpertTileAt), so the CTAs running at once share the
// expert's weight slabs in L2, where the table's order (a source's segments by expert) streams every expert's weight
// once per source; its consumer then pushes the remote segments in the same order (ExpertMajorBands). One thread per
// segment counts the segments before its own (t.n <= kMaxSegments <= the CTA's threads); every thread calls it.
// Returns (every thread the same) whether the table's order streams the weights at least twice as often as
// expert-major order, counting a weight pass per band of band_m row blocks of block_rows rows: the sum over the
// segments of ceil(row blocks / band_m) against the same over the experts' rows.
__device__ inline bool ExpertMajorOrder(const SegTable& t, int block_rows, int band_m, SegPlace* order) {
  __shared__ int passes[2];  // the table's order's, expert-major's
  if (threadIdx.x == 0) passes[0] = passes[1] = 0;
  __syncthreads();
  const int i = threadIdx.x, n = t.n;
  if (i < n) {
    const int e = t.seg[i].expert;
    int below = 0, same_before = 0, rows = 0;
    for (int j = 0; j < n; ++j) {
      const Segment& sj = t.seg[j];
      const bool mine = sj.expert == e;
      below += sj.expert < e;
      same_before += mine & (j < i);
      rows += mine ? sj.rows : 0;
    }
    order[below + same_before] = SegPlace{(int16_t)i, (int16_t)below};
    const int mine = (t.seg[i].rows + block_rows - 1) / block_rows;
    atomicAdd(&passes[0], (mine + band_m - 1) / band_m);
    if (same_before == 0) atomicAdd(&passes[1], ((rows + block_rows - 1) / block_rows + band_m - 1) / band_m);
  }
  __syncthreads();
  const bool pays = passes[0] >= 2 * passes[1];
  __syncthreads();  // (read before a next call resets them)
  return pays;
}

// Place p of the expert-major order (ExpertMajorOrder's) among the remote segments alone (the table's first
// t.remote_segs): the remote segments keep their relative order, so these places are the expert-major order of the
// remote segments (each expert's remote sources in the table's order). Thread p: q, its remote place (-1 where place p
// holds the local segment or none), and `before` = the sum of `v` over the remote places before q; *total = the sum
// over all remote places. v: this thread's value (read where place p is remote, v < 2^47). Every thread calls it (one
// block scan).
struct RemotePlace {
  int q;
  int64_t before;
};
__device__ inline RemotePlace RemotePlaceOf(const SegTable& t, const SegPlace* order, int64_t v, int64_t* total,
                                            int64_t* warp_sums) {
  const int p = threadIdx.x;
  const bool remote = p < t.n && order[p].seg < t.remote_segs;
  constexpr int kCountShift = 48;  // (count <= kMaxSegments above the sums of v)
  const int64_t mine = remote ? ((int64_t)1 << kCountShift) + v : 0;
  int64_t all = 0;
  const int64_t incl = BlockInclusiveScan(mine, warp_sums, &all);
  constexpr int64_t kSumMask = ((int64_t)1 << kCountShift) - 1;
  *total = all & kSumMask;
  return {remote ? (int)(incl >> kCountShift) - 1 : -1, (incl & kSumMask) - (remote ? v : 0)};
}

// The consumer's remote bands in the expert-major producer's order. On entry order holds ExpertMajorOrder's order of
// all segments; on return order[q] = the q-th remote place (q < t.remote_segs; its `first` not kept) and
// band_prefix[q] = the bands of order[0..q-1] (band_prefix[remote_segs] = remote_bands). Every thread calls it.
__device__ inline void ExpertMajorBands(const SegTable& t, SegPlace* order, int32_t* band_prefix,
                                        int64_t* warp_sums) {
  const int p = threadIdx.x;
  const SegPlace mine = p < t.n ? order[p] : SegPlace{};
  const int64_t bands = p < t.n ? (int64_t)BandsOf(t.seg[mine.seg].rows) : 0;
  int64_t total = 0;
  const RemotePlace r = RemotePlaceOf(t, order, bands, &total, warp_sums);  // (its last barrier: order read)
  if (r.q >= 0) {
    order[r.q] = mine;
    band_prefix[r.q] = (int32_t)r.before;
  }
  if (p == 0) band_prefix[t.remote_segs] = (int32_t)total;
  __syncthreads();
}

}  // namespace jmo::cuda
