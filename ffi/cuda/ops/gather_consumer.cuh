// gather_rs's consumer (docs/design.md, "GatherRS"): the consumer CTAs of ExpertKernel (expert_combine.cu) when it
// runs GEMM2 + GatherRS. They take (source, token chunk) units; once every band of a source's segments is flagged
// they reduce that chunk of the source's tokens here (gate times GEMM2 row, in float32, in slot order) into a dense
// partial, store it into slice `rank` of the source's ret rows (float32 [R, T, N], peer memory through the
// workspace's peer table, over the emulated link where the call has one) and release-add the chunk's tokens to the
// source's ret_arrivals. The float32 operations are the CPU handler's (ffi/cpu/gather_rs.cc), in its order, each
// rounded on its own (no FMA contraction), so equal GEMM rows give equal partials bit for bit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device/convert.cuh"
#include "cuda/launch.h"
#include "cuda/ops/combine_gather.cuh"
#include "cuda/schedule/resource_manager.cuh"
#include "cuda/schedule/segment_table.cuh"
#include "cuda/transport/emulated_link.cuh"
#include "cuda/workspace/protocol.cuh"

namespace jmo::cuda {

// The consumer's order of the group's sources and where each source's bands lie in producer order.
struct GatherSources {
  int32_t order[kMaxRanks];    // the sources with no row here first (their partial is zero, ready at once), by index;
                               // then the others in producer order (remote, most rows first; this rank last)
  int32_t band_lo[kMaxRanks];  // by source: its bands [band_lo, band_hi) in producer order (a source's segments are
  int32_t band_hi[kMaxRanks];  // consecutive there: SegmentBefore orders by source first); band b's flag is
                               // tile_ready[band_base + b - band_prefix[i]] of its segment i (BandFlag)
};

// The tile_ready index of band b (in producer order): its segment's flags are numbered from the segment's band_base
// (the plan's order, BuildSegments), not from its place in producer order.
__device__ __forceinline__ int BandFlag(const SegTable& t, int b) {
  const int i = FindSegment(t, b);
  return t.seg[i].band_base + (b - t.band_prefix[i]);
}

// Thread 0 fills `out` from the segment table.
__device__ inline void OrderGatherSources(const SegTable& t, int R, GatherSources* out) {
  uint32_t has_rows = 0;
  int full = 0;
  int32_t full_order[kMaxRanks];
  for (int i = 0; i < t.n; ++i) {
    const int s = t.seg[i].src;
    if (!((has_rows >> s) & 1u)) {
      has_rows |= 1u << s;
      full_order[full++] = s;
      out->band_lo[s] = t.band_prefix[i];
    }
    out->band_hi[s] = t.band_prefix[i + 1];
  }
  int n = 0;
  for (int s = 0; s < R; ++s)
    if (!((has_rows >> s) & 1u)) {
      out->order[n++] = s;
      out->band_lo[s] = out->band_hi[s] = 0;
    }
  for (int i = 0; i < full; ++i) out->order[n++] = full_order[i];
}

// Tokens of one consumer unit: two per warp of the CTA.
__device__ __forceinline__ int GatherChunkTokens() { return 2 * (int)(blockDim.x / 32); }

// One token t of source s, by one warp: dst[n] = sum over q = 0, 1, ..., Q - 1 with row i = rows[q] >= 0 of
// row_gate[i] * stage[i, n], in float32, from 0 (V elements of T per vector, kU vectors per lane in flight, kJ slots'
// loads issued before they are summed). A row outside [-1, cap) is reported (kBadRoute) and skipped.
template <typename T, int V, int kU, int kJ>
__device__ __forceinline__ void GatherToken(const RankDev& rd, const T* stage, const float* row_gate,
                                            const int32_t* rows, int64_t first_index, int64_t Q, int64_t cap,
                                            int64_t N, float* dst) {
  const int lane = threadIdx.x & 31, vecs = (int)(N / V);
  for (int c0 = 0; c0 < vecs; c0 += 32 * kU) {  // warp-uniform: the shuffles need every lane
    const int c = c0 + lane;
    float acc[kU][V];
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int i = 0; i < V; ++i) acc[u][i] = 0.f;
    for (int64_t q32 = 0; q32 < Q; q32 += 32) {
      // Slot q32 + lane's row and gate, read once per 32 slots and shuffled to the warp.
      int32_t row_l = -1;
      float gate_l = 0.f;
      if (q32 + lane < Q) {
        row_l = rows[q32 + lane];
        if (row_l < -1 || row_l >= cap) {
          if (c0 == 0) ReportBadInput(rd, kBadRoute, (uint64_t)(first_index + q32 + lane), row_l, (uint64_t)cap);
          row_l = -1;
        }
        if (row_l >= 0) gate_l = row_gate[row_l];
      }
      const int nq = Q - q32 < 32 ? (int)(Q - q32) : 32;
      for (int j0 = 0; j0 < nq; j0 += kJ) {
        Pack<T, V> v[kJ][kU];
        uint32_t ok = 0;  // bit jj: slot j0 + jj has a row here
#pragma unroll
        for (int jj = 0; jj < kJ; ++jj) {
          const int32_t r = __shfl_sync(~0u, row_l, (j0 + jj) & 31);
          if (j0 + jj >= nq || r < 0) continue;
          ok |= 1u << jj;
          const T* src = stage + (int64_t)r * N + (int64_t)c * V;
#pragma unroll
          for (int u = 0; u < kU; ++u)
            if (c + 32 * u < vecs) v[jj][u].LoadCg(src + 32 * u * V);
        }
#pragma unroll
        for (int jj = 0; jj < kJ; ++jj) {
          const float g = __shfl_sync(~0u, gate_l, (j0 + jj) & 31);
          if (!((ok >> jj) & 1u)) continue;
#pragma unroll
          for (int u = 0; u < kU; ++u)
#pragma unroll
            for (int i = 0; i < V; ++i) acc[u][i] = __fadd_rn(acc[u][i], __fmul_rn(g, ToFloat(v[jj][u].e[i])));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (c + 32 * u >= vecs) continue;
      float* out = dst + (int64_t)(c + 32 * u) * V;
      if constexpr (V % 4 == 0) {
#pragma unroll
        for (int i = 0; i < V; i += 4)
          *reinterpret_cast<float4*>(out + i) = make_float4(acc[u][i], acc[u][i + 1], acc[u][i + 2], acc[u][i + 3]);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) out[i] = acc[u][i];
      }
    }
  }
}

// The consumer CTAs' work (every thread of CTAs [0, consumers) calls it; returns when the CTA's units are done or a
// wait gave up). smem: the launch's dynamic shared memory, which only the producer's GEMM uses otherwise (the source
// order lives there rather than in static shared memory, which the wgmma producer's ring leaves little of). Unit u = (position i of the consumer's source order, token chunk) = (u / chunks, u % chunks); CTA b
// takes u = b, b + C, b + 2 C, ..., so the sources go in the consumer's order across the CTAs. The CTA has passed
// CountLocalRows (the serialized mode waits for every CTA of the launch to have).
template <typename T>
__device__ void GatherConsume(const RankDev& rd, const SegTable& table, uint64_t epoch, const GatherArgs& ga,
                              int64_t cap, int64_t N, const T* stage, const uint64_t* flags,
                              const ConsumerConfig& pol, int consumers, char* smem) {
  GatherSources& src = *reinterpret_cast<GatherSources*>(smem);
  const int R = rd.ranks;
  if (threadIdx.x == 0) OrderGatherSources(table, R, &src);
  __syncthreads();
  const int64_t T_ = ga.T, Q = ga.Q;
  const int chunk = GatherChunkTokens();
  const int64_t chunks = (T_ + chunk - 1) / chunk, units = (int64_t)R * chunks;
  if ((int64_t)blockIdx.x >= units) return;  // (uniform in the CTA)
  if (pol.serialize && !WaitProducersDone(rd)) return;
  if (threadIdx.x == 0)
    atomicMin(reinterpret_cast<unsigned long long*>(&rd.priv->cons_t0), (unsigned long long)GlobalTimer());
  constexpr int kV = 16 / sizeof(T);  // one 16-byte vector of a GEMM row
  const bool vec = N % kV == 0;       // (stage rows and the float32 slices are then 16-byte aligned)
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int64_t ready = -1;  // the position (in the source order) whose bands and peer this CTA has seen ready
  for (int64_t u = blockIdx.x; u < units; u += consumers) {
    const int64_t i = u / chunks, t0 = (u % chunks) * chunk, t1 = t0 + chunk < T_ ? t0 + chunk : T_;
    const int s = src.order[i];
    if (i != ready) {
      // Every band of the source's segments flagged (the CTA's threads wait for a share each), and the source done
      // reading its ret rows of the previous call (protocol step 1).
      bool ok = true;
      for (int b = src.band_lo[s] + threadIdx.x; b < src.band_hi[s] && ok; b += blockDim.x)
        ok = WaitAtLeast(rd, &flags[BandFlag(table, b)], 0, epoch, rd.rank, kStageTileReady);
      if (threadIdx.x == 0 && ok)
        ok = WaitAtLeast(rd, &View(rd, s).control()->done_epoch.value, 0, epoch - 1, s, kStagePeerReady);
      if (!__syncthreads_and(ok)) return;
      ready = i;
    }
    const int32_t* rows = ga.token_rows + (int64_t)s * T_ * Q;
    float* slice = reinterpret_cast<float*>(View(rd, s).ret()) + (int64_t)rd.rank * T_ * N;
    for (int64_t t = t0 + warp; t < t1; t += warps) {
      if (vec)
        GatherToken<T, kV, 16 / kV, 4>(rd, stage, ga.row_gate, rows + t * Q, (s * T_ + t) * Q, Q, cap, N,
                                       slice + t * N);
      else
        GatherToken<T, 1, 8, 4>(rd, stage, ga.row_gate, rows + t * Q, (s * T_ + t) * Q, Q, cap, N, slice + t * N);
    }
    // The chunk's stores, fenced, carried by the emulated link when they go to another rank, then counted at the
    // source (protocol step 2).
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
      if (s != rd.rank && pol.link_bytes_per_ns > 0)
        PaceLink(rd, (uint64_t)((t1 - t0) * N * 4), pol.link_bytes_per_ns);
      AddReleaseSys(&View(rd, s).control()->ret_arrivals.value, (uint64_t)(t1 - t0));
    }
  }
  if (threadIdx.x == 0)
    atomicMax(reinterpret_cast<unsigned long long*>(&rd.priv->cons_t1), (unsigned long long)GlobalTimer());
}

}  // namespace jmo::cuda
