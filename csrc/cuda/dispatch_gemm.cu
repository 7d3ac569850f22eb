// Experimental: dispatch_gemm, the dispatch and GEMM1 of the expert MLP in one launch. Everything of this path is in
// this file (the kernel, its launch, DispatchGemm in api.h) and in the FFI handler that calls it; removing it removes
// nothing the other primitives use.
#include <cuda.h>
#include <cuda_runtime.h>

#include <string>

#include "cuda/dispatch.cuh"
#include "cuda/expert_producer.cuh"
#include "cuda/gemm/wgmma_grouped.cuh"
#include "cuda/launch.h"

namespace jmo::cuda {

bool WgmmaProducerApplies(DType dt, int64_t K, int64_t N, bool transpose_rhs, const void* lhs, const void* w);

namespace {

// dispatch_gemm: the dispatch and GEMM1 in one launch, so that GEMM1 runs while the tokens are still in flight (the
// dispatch-side producer / consumer; expert_combine is the return side). Roles by block index, one CTA per SM as in
// ExpertKernel (the same co-residency argument: every CTA of every rank is resident, so the waits below end):
//   pushers  CTAs [0, pushers) first push this rank's rows for the other ranks, a 128-row block of the send order
//            (SrcBlocks, protocol.h) at a time, in rounds: block i of every destination's rows before block i + 1,
//            each destination from the next rank on, so that every rank receives from every source at once and in
//            the order its GEMM consumes; each block's count is release-added into the destination's
//            src_blocks[rank][J] and recv_arrivals. Then they join the GEMM.
//   GEMM     CTAs [pushers, grid) first copy the rows this rank keeps into its own recv (the same blocks and
//            counters), then run the grouped GEMM; the pushers join it when their push is done.
// The GEMM is over recv's (expert, source) segments with A read by TMA straight from the workspace's recv rows. Its
// tiles are claimed one at a time from a per-call counter (CTAs that join late take what is left), in the order
// rows arrive: the rank's own segments, then the other sources' by expert, then source. Before a tile's first load
// the TMA thread waits until the source's blocks that hold the tile's rows are complete.
// a [cap, N] float32 = recv[segment] @ w[expert] (w[expert]^T with transpose_rhs) on every kept row, zero on the rows
// past them. The call then ends as a dispatch does (RecvKernel copies recv to x_recv, EndKernel frees recv for the
// next call); before that the last CTA zeroes the src_blocks counters of this call.
struct DispatchGemmArgs {
  const char* src;       // x [S, K] bf16 (row_bytes = K * 2)
  int64_t S, row_bytes;
  const int32_t *src_row, *dst_rank, *dst_row;  // the dispatch plan's slots [P]
  const int32_t *send_order;                     // [P]: the slot at each send position
  const int32_t *send_start;                     // [R + 1]: first send position of each destination's rows
  int64_t P, cap;
  const int32_t *seg_rows, *seg_ret_off;  // [E_l * R] rows this rank receives per (expert, source), and their first
                                          // send position on the source
  int E_l, pushers;
  int64_t K, N;
  float* a;              // [cap, N]
};

// Moves the rows of send block J that go to rank d (send positions [128 J, 128 J + 128) within d's range) into d's
// recv rows, then (one thread) release-adds their count to d's src_blocks[rank][J] and recv_arrivals. Every thread of
// the CTA calls it. Invalid slots are reported as PushRows does.
__device__ inline void PushBlock(const RankDev& rd, const DispatchGemmArgs& g, int d, int64_t J, unsigned* sent) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int64_t q0 = max(J * kSrcBlockRows, (int64_t)g.send_start[d]);
  const int64_t q1 = min((J + 1) * kSrcBlockRows, (int64_t)g.send_start[d + 1]);
  unsigned moved = 0;
  for (int64_t q = q0 + warp; q < q1; q += warps) {
    const int p = g.send_order[q];
    const int dr = g.dst_rank[p], row = g.dst_row[p], sr = g.src_row[p];
    if (dr == -1) {
      if (lane == 0) ReportBadInput(rd, kBadExpertId, p, sr, (uint64_t)(int64_t)row);  // the plan puts the id in row
      continue;
    }
    if (row < 0) continue;  // dropped by the capacity rule
    if (dr != d || row >= g.cap || sr < 0 || sr >= g.S) {
      if (lane == 0)
        ReportBadInput(rd, kBadRoute, p, dr != d ? dr : (row >= g.cap ? row : sr),
                       dr != d ? rd.ranks : (row >= g.cap ? g.cap : g.S));
      continue;
    }
    CopyRowWarp(View(rd, d).recv() + (int64_t)row * g.row_bytes, g.src + (int64_t)sr * g.row_bytes, g.row_bytes,
                lane);
    ++moved;
  }
  if (lane == 0 && moved > 0) atomicAdd(sent, moved);
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned n = *sent;
    if (n > 0) {
      AddReleaseSys(&View(rd, d).src_blocks()[(int64_t)rd.rank * SrcBlocks(rd.sizes.ret_rows) + J], n);
      AddReleaseSys(&View(rd, d).control()->recv_arrivals.value, n);
    }
    *sent = 0;
  }
  __syncthreads();
}

// Send blocks of rank d's rows: [first, end).
__device__ __forceinline__ void DestBlocks(const DispatchGemmArgs& g, int d, int64_t* first, int64_t* end) {
  const int64_t q0 = g.send_start[d], q1 = g.send_start[d + 1];
  *first = q0 / kSrcBlockRows;
  *end = q1 > q0 ? (q1 - 1) / kSrcBlockRows + 1 : *first;
}

// Rows of source s's send block J that this rank keeps (from its plan: segment (e, s) holds s's send positions
// [seg_ret_off, seg_ret_off + seg_rows)).
__device__ __forceinline__ uint64_t BlockRows(const TableScratch& sc, int R, int E_l, int s, int64_t J) {
  const int64_t lo = J * kSrcBlockRows, hi = lo + kSrcBlockRows;
  uint64_t n = 0;
  for (int e = 0; e < E_l; ++e) {
    const Segment& x = sc.raw[e * R + s];
    const int64_t a = max(lo, (int64_t)x.ret_off), b = min(hi, (int64_t)x.ret_off + max(x.rows, 0));
    if (b > a) n += (uint64_t)(b - a);
  }
  return n;
}

// Rewrites table->seg (non-empty segments) in the order their rows arrive: this rank's own by expert, then the
// others' by expert, then source (from the next rank on). One thread per position and a block scan.
__device__ inline int ArrivalOrder(const RankDev& rd, int E_l, SegTable* t, TableScratch* sc) {
  const int R = rd.ranks, n = E_l * R, i = threadIdx.x;
  int e = 0, s = rd.rank;
  if (i >= E_l && i < n) {
    const int j = i - E_l;
    e = j / (R - 1);
    s = (rd.rank + 1 + j % (R - 1)) % R;
  } else if (i < E_l) {
    e = i;
  }
  const int64_t kept = i < n && sc->raw[e * R + s].rows > 0 ? 1 : 0;
  int64_t total = 0;
  const int64_t pos = BlockInclusiveScan(kept, sc->warp_sums, &total) - kept;  // (synchronizes the CTA)
  if (kept) t->seg[pos] = sc->raw[e * R + s];
  if (i == 0) t->n = (int32_t)total;
  __syncthreads();
  return (int)total;
}

template <bool kTransB>
__global__ void __launch_bounds__(wgmma_gemm::kThreads, 1)
    DispatchGemmKernel(RankDev rd, const __grid_constant__ DispatchGemmArgs g,
                       const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map) {
  extern __shared__ __align__(16) char smem[];
  __shared__ CallState st;
  __shared__ unsigned sent[kMaxRanks];
  __shared__ int32_t tile_prefix[kMaxSegments + 1];
  __shared__ SegTable table;
  __shared__ TableScratch scratch;
  __shared__ int last_cta;
  LoadCallState(rd, &st);
  if (!st.ok) return;
  const int R = rd.ranks;
  const int64_t nb = SrcBlocks(rd.sizes.ret_rows);

  if ((int)blockIdx.x < g.pushers) {
    // The rows for the other ranks, in rounds (see above). Unit u: round u / (R - 1), destination rank + 1 + u % (R - 1).
    if (!BeginPush(rd, &st, sent)) return;
    int64_t rounds = 0;
    for (int d = 0; d < R; ++d) {
      int64_t f, e;
      DestBlocks(g, d, &f, &e);
      if (d != rd.rank) rounds = max(rounds, e - f);
    }
    for (int64_t u = blockIdx.x; R > 1 && u < rounds * (R - 1); u += g.pushers) {
      const int d = (rd.rank + 1 + (int)(u % (R - 1))) % R;
      int64_t f, e;
      DestBlocks(g, d, &f, &e);
      if (f + u / (R - 1) < e) PushBlock(rd, g, d, f + u / (R - 1), sent);
    }
  } else {
    // The rows this rank keeps, spread over the GEMM CTAs (step 1 holds for the own recv by stream order).
    if (threadIdx.x < kMaxRanks) sent[threadIdx.x] = 0;
    __syncthreads();
    int64_t f, e;
    DestBlocks(g, rd.rank, &f, &e);
    for (int64_t J = f + blockIdx.x - g.pushers; J < e; J += gridDim.x - g.pushers) PushBlock(rd, g, rd.rank, J, sent);
  }

  if (!BuildSegments(rd, g.seg_rows, g.seg_ret_off, g.E_l, g.cap, &table, &scratch)) return;
  ArrivalOrder(rd, g.E_l, &table, &scratch);
  const int col_tiles = (int)((g.N + kWgBN - 1) / kWgBN);
  WgmmaTilePrefix(table, col_tiles, tile_prefix, scratch.warp_sums);
  const int total_tiles = tile_prefix[table.n];
  // Rows past the kept ones (recv is packed from row 0) are zero, as the bare grouped GEMM leaves them.
  int64_t kept_rows = 0;
  for (int s = 0; s < R; ++s) kept_rows += scratch.rows_to_rank[s];
  for (int64_t x = kept_rows * g.N + ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 4; x < g.cap * g.N;
       x += (int64_t)gridDim.x * blockDim.x * 4)
    *reinterpret_cast<float4*>(g.a + x) = make_float4(0.f, 0.f, 0.f, 0.f);  // (N % 64 == 0: whole float4s)
  struct DgTile : wgmma_gemm::WgmmaTile {
    int src;     // the source rank of the tile's rows
    int pos0;    // the send position of its first row on the source
  };
  auto tile_of = [&](int i) {
    // Bands of row blocks (nothing reads a's rows during the call): GEMM1's N = 2 * d_ff spans up to ~100 n-tiles.
    const SegmentTile at = WgmmaTileAt(table, tile_prefix, col_tiles, g.N, i, wgmma_gemm::kBandM);
    DgTile t;
    static_cast<wgmma_gemm::WgmmaTile&>(t) = at.t;
    t.out = g.a + (int64_t)t.a_row * g.N + t.n0;
    t.ldc = g.N;
    t.publish = 0;
    t.src = at.s->src;
    t.pos0 = at.s->ret_off + at.mt * kWgBM;
    return t;
  };
  const uint64_t* blocks = View(rd, rd.rank).src_blocks();
  auto tile_wait = [&](const DgTile& t) {
    // On failure the call is failed (the error names source and counts); the loop runs on rather than hang.
    for (int64_t J = t.pos0 / kSrcBlockRows; t.rows > 0 && J <= (t.pos0 + t.rows - 1) / kSrcBlockRows; ++J)
      WaitAtLeast(rd, &blocks[t.src * nb + J], 0, BlockRows(scratch, R, g.E_l, t.src, J), t.src, kStageSrcBlock);
    ptx::FenceProxyAsyncGlobal();  // the rows were stored by the generic proxy; TMA reads by the async one
  };
  auto next_tile = [&](int) { return (int)atomicAdd(rd.tile_claims, 1u); };
  wgmma_gemm::WgmmaTileLoopNext<kTransB ? 0 : 1, true>(a_map, b_map, (int)g.K, total_tiles, next_tile, tile_of,
                                                       wgmma_gemm::NoTileDone{}, smem, tile_wait);
  // The last CTA to finish zeroes the call's src_blocks: every tile has waited for its blocks, so every add of the
  // call has landed, and no source adds again before this rank's done_epoch (EndKernel, later on the stream).
  __syncthreads();
  if (threadIdx.x == 0)
    last_cta = atomicAdd(reinterpret_cast<unsigned long long*>(rd.producers_done), 1ull) == gridDim.x - 1ull;
  __syncthreads();
  if (!last_cta) return;
  uint64_t* own = View(rd, rd.rank).src_blocks();
  for (int s = 0; s < R; ++s) {
    int64_t lo = INT64_MAX, hi = 0;  // s's send positions kept here: [lo, hi)
    for (int e = 0; e < g.E_l; ++e) {
      const Segment& x = scratch.raw[e * R + s];
      if (x.rows > 0) {
        lo = min(lo, (int64_t)x.ret_off);
        hi = max(hi, (int64_t)x.ret_off + x.rows);
      }
    }
    for (int64_t J = (hi > lo ? lo / kSrcBlockRows : 0) + threadIdx.x; hi > lo && J <= (hi - 1) / kSrcBlockRows;
         J += blockDim.x)
      own[s * nb + J] = 0;
  }
}

}  // namespace

// dispatch_gemm (see DispatchGemmKernel): Begin, the fused kernel, then the end of a dispatch (RecvKernel copies recv
// into x_recv; EndKernel frees recv for the peers' next call).
Status DispatchGemm(const CallSite& c, const void* src, int64_t S, int64_t D, const DispatchSlots& slots,
                    const int32_t* recv_expected, const int32_t* seg_rows, const int32_t* seg_ret_off, int64_t E_l,
                    const void* w, int64_t N, bool transpose_rhs, const int32_t* group_op, const int32_t* rank_op,
                    void* x_recv, float* a, int64_t cap, int pushers) {
  const int64_t row_bytes = D * 2;
  Status s = BeginCall(c, "dispatch_gemm", group_op, rank_op);
  if (!s.ok()) return s;
  Workspace& ws = *c.ws;
  const int R = ws.ranks();
  const int budget = ws.budget(c.group, c.rank);
  std::string bad;
  if (row_bytes > ws.sizes().row_bytes || cap > ws.sizes().recv_rows || slots.P > ws.sizes().ret_rows)
    bad = "dispatch_gemm: call needs rows of " + std::to_string(row_bytes) + " B x " + std::to_string(cap) +
          " and " + std::to_string(slots.P) + " slots but the workspace holds " + std::to_string(ws.sizes().row_bytes) +
          " B x " + std::to_string(ws.sizes().recv_rows) + " and " + std::to_string(ws.sizes().ret_rows);
  else if (E_l * R > kMaxSegments)
    bad = "dispatch_gemm: " + std::to_string(E_l * R) + " segments (local experts x ranks) exceed the CUDA kernels' " +
          std::to_string(kMaxSegments);
  else if (!WgmmaProducerApplies(DType::kBF16, D, N, transpose_rhs, src, w))
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
  // producers_done counts the CTAs done with the GEMM (the last one zeroes src_blocks); tile_claims hands out tiles.
  if (!(s = CudaStatus(cudaMemsetAsync(rd.band_done, 0, BandCounterBytes(ws.sizes().max_bands), c.stream),
                       "cudaMemsetAsync(band counters)")).ok())
    return s;
  CUtensorMap a_map, b_map;
  const void* recv = RankView{rd.peers.base[c.rank], rd.layout}.recv();  // A: where the peers' pushes land
  if (!(s = CudaStatus(wgmma_gemm::CachedGemmMaps(recv, cap, D, w, E_l, N, /*b_k_major=*/transpose_rhs, &a_map,
                                                  &b_map),
                       "tensor maps of dispatch_gemm")).ok())
    return s;
  const void* kernel = transpose_rhs ? reinterpret_cast<const void*>(DispatchGemmKernel<true>)
                                     : reinterpret_cast<const void*>(DispatchGemmKernel<false>);
  int smem = 0;
  if (!(s = PrepareOneCtaPerSm(kernel, wgmma_gemm::kThreads, wgmma_gemm::kLoopSmemBytes, /*wgmma=*/true,
                               "DispatchGemmKernel", dev, &smem)).ok())
    return s;
  const DispatchGemmArgs args{static_cast<const char*>(src), S, row_bytes, slots.src_row, slots.dest_rank,
                              slots.dest_row, slots.send_order, slots.send_start, slots.P, cap, seg_rows, seg_ret_off,
                              (int)E_l, pushers, D, N, a};
  if (transpose_rhs)
    DispatchGemmKernel<true><<<budget, wgmma_gemm::kThreads, smem, c.stream>>>(rd, args, a_map, b_map);
  else
    DispatchGemmKernel<false><<<budget, wgmma_gemm::kThreads, smem, c.stream>>>(rd, args, a_map, b_map);
  if (!(s = LaunchError("launch of DispatchGemmKernel")).ok()) return s;
  return LaunchRecvAndEnd(rd, budget, c.stream, recv_expected, static_cast<char*>(x_recv), cap, row_bytes);
}

}  // namespace jmo::cuda
