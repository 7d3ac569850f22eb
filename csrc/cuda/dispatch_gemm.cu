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
    ptx::FenceProxyAsyncGlobal();  // the rows were stored by the generic proxy; TMA reads by the async one
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

}  // namespace

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
  return LaunchRecvAndEnd(rd, budget, c.stream, recv_expected, static_cast<char*>(x_recv), cap, row_bytes);
}

}  // namespace jmo::cuda
