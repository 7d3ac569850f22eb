// expert_combine, the overlapped operator: ExpertKernel runs the producer (the grouped GEMM over the call's segments,
// expert_producer.cuh) and the consumer (pushing each finished remote band to its source's ret rows,
// transport/bulk_push.cuh) as CTAs of one launch; then the combine (combine.cu) waits for this rank's ret rows and
// closes the call. gather_rs (gather_rs.cu) runs the same kernel with its own consumer (gather_consumer.cuh). Also
// the host's choice of consumer policy for a call.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <optional>
#include <string>

#include "cuda/device/copy.cuh"
#include "cuda/gemm/sm90/wgmma_grouped.cuh"
#include "cuda/gemm/sm90/wgmma_grouped_fp8.cuh"
#include "cuda/launch.h"
#include "cuda/ops/expert_producer.cuh"
#include "cuda/ops/gather_consumer.cuh"
#include "cuda/schedule/resource_manager.cuh"
#include "cuda/transport/bulk_push.cuh"
#include "cuda/transport/emulated_link.cuh"

namespace jmo::cuda {
namespace {

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
//
// kGather (gather_rs): every tile goes to stage and publishes its band, and the consumer is GatherConsume (ga), which
// every source needs, so C >= 1 even where no band goes to another rank; C is gather_rs's model's where it chooses
// (GatherConsumersOfCall).
//
// kEngine = kWgmmaFp8: the producer multiplies e4m3 lhs [cap, K] by e4m3 w [E_l, N, K] (a_map, b_map, sa_map: the FP8
// grouped GEMM's maps, wgmma_grouped_fp8.cuh's CachedFp8Maps; w_scales [E_l, N/128, K/128]) into T rows; lhs and w
// are unread (the maps carry them).
template <typename T, int kEngine, bool kTransB, bool kGather>
__global__ void __launch_bounds__(kEngineThreads<kEngine>, 1)
    ExpertKernel(RankDev rd, const T* __restrict__ lhs, const T* __restrict__ w, int64_t cap, int64_t K, int64_t N,
                 const int32_t* seg_rows, const int32_t* seg_ret_off, int E_l,
                 const __grid_constant__ ConsumerConfig pol, const GatherArgs ga,
                 const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                 const __grid_constant__ CUtensorMap sa_map, const float* __restrict__ w_scales) {
  static_assert(kEngine != kWgmmaFp8 || (!kTransB && !kGather), "the e4m3 producer is expert_combine's, w K-major");
  extern __shared__ __align__(16) char smem[];
  __shared__ int32_t tile_prefix[kWgmmaLoop<kEngine> ? kMaxSegments + 1 : 1];
  __shared__ SegPlace seg_order[kWgmmaLoop<kEngine> && !kGather ? kMaxSegments : 1];  // (UseExpertMajor)
  __shared__ CallState st;
  __shared__ SegTable table;
  __shared__ TableScratch scratch;
  __shared__ ChoiceScratch choice;
  __shared__ int wait_ok;
  if (threadIdx.x == 0)
    atomicMin(reinterpret_cast<unsigned long long*>(&rd.priv->entry_t), (unsigned long long)GlobalTimer());
  // The plan entries before the call state: the two global round trips overlap (LoadPlanEntries).
  const PlanEntries plan = LoadPlanEntries(seg_rows, seg_ret_off, E_l, rd.ranks);
  LoadCallState(rd, &st);
  if (!st.ok) return;
  // Roles. C is known at once where the call pins or fixes it, or where no band goes to another rank. Under the model
  // CTAs [0, max_ctas), the only ones C can make consumers, choose it (each the same C: same table, same operations)
  // while the others start producing, so the choice is off the producers' path; a chooser that C leaves a producer
  // joins them. Producers claim tiles from the call's counter (TileClaims), so none needs the producer count.
  const bool chooses = pol.use_model && (int)blockIdx.x < pol.max_ctas;  // (uniform in the CTA)
  // A chooser builds the table with the parts of the choice's terms (one pass less): expert_combine's segments',
  // gather_rs's sources'.
  const GatherModelShape gsh{ga.T, ga.Q, N, K, (int64_t)sizeof(T)};
  TermPrepOut prep{};
  // Whether the producer goes expert-major, seg_order then its order of all segments (UseExpertMajor: decided once
  // per CTA, the same in every CTA).
  bool expert_major = false;
  if (kGather && chooses) {
    const GatherPrepIn in = GatherPrepFor(pol.cand, gsh, rd.rank, &choice);
    if (!BuildSegmentsFrom<kPrepGather>(rd, plan, E_l, cap, &table, &scratch, &in, &prep)) return;
  } else if (!kGather && chooses) {
    const TermPrepIn in = TermPrepFor(pol.model, pol.cand, N, pol.elem_bytes, &choice);
    if (!BuildSegmentsFrom<kPrepTerms>(rd, plan, E_l, cap, &table, &scratch, &in, &prep)) return;
    // The terms in the expert-major producer's order where it goes so: its tiles over each expert's rows, the
    // consumer's pushes in its order.
    if constexpr (kWgmmaLoop<kEngine> && !kGather) {
      expert_major = UseExpertMajor(table, pol.producer_order, pol.band_m, seg_order);
      if (expert_major)
        ExpertMajorTermPrep(table, scratch.raw, E_l, rd.ranks, in, &prep, seg_order, tile_prefix, scratch.warp_sums);
    }
  } else {
    if (!BuildSegmentsFrom(rd, plan, E_l, cap, &table, &scratch)) return;
    if constexpr (kWgmmaLoop<kEngine> && !kGather)
      expert_major = UseExpertMajor(table, pol.producer_order, pol.band_m, seg_order);
  }
  // C, or -1 on a CTA that produces without knowing it. (gather_rs: C >= 1, the host keeps the pinned and the fixed C
  // in [1, grid - 1].)
  const bool known = !pol.use_model || table.remote_bands == 0;
  const int consumers =
      !known && !chooses ? -1
      : kGather ? GatherConsumersOfCall(table, prep, pol, gsh, rd.rank, rd.ranks, &choice)
                : ConsumersOfCall(table, prep, pol, N, kEngine == kWgmmaFp8 ? Fp8ModelK(K) : K, &choice);
  const int64_t row_bytes = N * (int64_t)sizeof(T);
  if (blockIdx.x == 0 && threadIdx.x == 0) {  // (block 0 knows C: it chooses, or C is known)
    rd.priv->consumers = (uint64_t)consumers;
    // gather_rs: its float32 partials for the other ranks.
    rd.priv->pushed_bytes =
        kGather ? (uint64_t)((rd.ranks - 1) * ga.T * N * 4) : (uint64_t)(table.remote_rows * row_bytes);
  }
  RankView self = View(rd, rd.rank);
  T* stage = reinterpret_cast<T*>(self.stage());
  T* ret = reinterpret_cast<T*>(self.ret());
  uint64_t* flags = self.tile_ready();

  if (consumers < 0 || (int)blockIdx.x >= consumers) {
    // Producer: tiles in producer order (the table's, remote-critical segments first, or expert-major where that
    // pays: UseExpertMajor), claimed one at a time.
    __shared__ bool produced;  // thread 0's: this CTA claimed a tile (TileClaims)
    if (threadIdx.x == 0) produced = false;
    const SegPlace* order = expert_major ? seg_order : nullptr;  // (nullptr: the table's order)
    if constexpr (kEngine == kWgmma)
      ProduceWgmma(rd, table, st.epoch, WgmmaBf16Operands<kTransB>(a_map, b_map), K, N, stage, ret, flags,
                   tile_prefix, scratch.warp_sums, smem, kGather, pol.band_m, order, scratch.raw, &produced);
    else if constexpr (kEngine == kWgmmaFp8)
      ProduceWgmma(rd, table, st.epoch,
                   wgmma_gemm::Fp8BlockScaledOperands{
                       &a_map, &b_map, &sa_map,
                       {w_scales, (int)(N / wgmma_gemm::kScaleChunk), (int)(K / wgmma_gemm::kScaleChunk)}},
                   K, N, stage, ret, flags, tile_prefix, scratch.warp_sums, smem, kGather, pol.band_m, order,
                   scratch.raw, &produced);
    else
      ProduceBands<T, kEngine == kMmaSync, kTransB>(rd, table, st.epoch, lhs, w, K, N, stage, ret, flags, smem,
                                                    kGather, &produced);
    CountLocalRows(rd, table, !kGather);
    if (threadIdx.x == 0 && produced)
      atomicMax(reinterpret_cast<unsigned long long*>(&rd.priv->prod_t1), (unsigned long long)GlobalTimer());
    return;
  }
  // A consumer: counted among the launch's CTAs done producing at once (it stores no tile).
  CountLocalRows(rd, table, !kGather);

  if constexpr (kGather) {
    GatherConsume<T>(rd, table, st.epoch, ga, cap, N, stage, flags, pol, consumers, smem);
    return;
  }
  // Consumer: the remote bands [0, remote_bands) in producer order; CTA c pushes bands c, c + C, c + 2 C, ...
  const int first = blockIdx.x;
  const int count = first < table.remote_bands ? (table.remote_bands - 1 - first) / consumers + 1 : 0;
  if (count == 0) return;
  // The producer's order of the remote segments: the table's, or expert-major (their band prefix in tile_prefix,
  // which a consumer CTA does not otherwise use).
  const SegPlace* order = nullptr;
  if (expert_major) {
    ExpertMajorBands(table, seg_order, tile_prefix, scratch.warp_sums);
    order = seg_order;
  }
  // The baseline without overlap: start pushing only once every producer CTA has stored all its tiles.
  if (pol.serialize && !WaitProducersDone(rd)) return;
  if (threadIdx.x == 0)
    atomicMin(reinterpret_cast<unsigned long long*>(&rd.priv->cons_t0), (unsigned long long)GlobalTimer());
  struct BandAt {
    const Segment* s;
    int b;     // band within the segment
    int rows;
  };
  auto band_at = [&](int i) {
    const int band = first + i * consumers;
    const int p = order ? LastAtMost(tile_prefix, table.remote_segs, band) : FindSegment(table, band);
    const Segment& s = table.seg[order ? order[p].seg : p];
    const int b = band - (order ? tile_prefix[p] : table.band_prefix[p]);
    return BandAt{&s, b, min((int)kBandRows, s.rows - b * (int)kBandRows)};
  };
  // A band is contiguous on both ends: rows x N at stage row (recv_off + 64 b) -> source's ret row (ret_off + 64 b).
  auto src_of = [&](const BandAt& a) {
    return reinterpret_cast<const char*>(stage) + ((int64_t)a.s->recv_off + (int64_t)a.b * kBandRows) * row_bytes;
  };
  auto dst_of = [&](const BandAt& a) {
    return View(rd, a.s->src).ret() + ((int64_t)a.s->ret_off + (int64_t)a.b * kBandRows) * row_bytes;
  };
  // A band's stores have completed: fenced, carried by the emulated link where there is one (every band here goes to
  // another rank), then counted at its source. One thread.
  auto signal_band = [&](const BandAt& a) {
    __threadfence_system();
    if (pol.link_bytes_per_ns > 0) PaceLink(rd, (uint64_t)a.rows * row_bytes, pol.link_bytes_per_ns);
    AddReleaseSys(&View(rd, a.s->src).control()->ret_arrivals.value, (uint64_t)a.rows);
  };
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
    // TMA bulk copies, driven by `issuers` threads (transport/bulk_push.cuh).
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
    auto done = [&](int i) { signal_band(band_at_w(i)); };
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
    if (threadIdx.x == 0) signal_band(a);
  }
  if (threadIdx.x == 0)
    atomicMax(reinterpret_cast<unsigned long long*>(&rd.priv->cons_t1), (unsigned long long)GlobalTimer());
}

template <typename T, int kEngine, bool kTransB, bool kGather>
Status PrepareExpertKernel(int dev, int* smem_bytes) {
  const int need = kEngine == kWgmmaFp8 ? wgmma_gemm::LoopSmemBytes<wgmma_gemm::kStages, wgmma_gemm::kFp8ExtraBytes>()
                   : kEngine == kWgmma  ? wgmma_gemm::kLoopSmemBytes
                   : kEngine == kMmaSync ? kTcSmemBytes
                                         : kSimtSmemBytes;
  return PrepareOneCtaPerSm(reinterpret_cast<const void*>(ExpertKernel<T, kEngine, kTransB, kGather>),
                            kEngineThreads<kEngine>, need, kWgmmaLoop<kEngine> ? kWgmmaKernelSetup : KernelSetup{},
                            "ExpertKernel", dev, smem_bytes);
}

// ExpertKernel's launch arguments, for LaunchExpertKernel.
struct ExpertLaunch {
  cudaStream_t stream;
  int dev, budget;  // the rank's device and SM budget (the grid)
  RankDev rd;
  const void *lhs, *w;
  int64_t cap, K, N, E_l;
  const int32_t *seg_rows, *seg_ret_off;
  ConsumerConfig pol;  // smem_bytes is filled in here
  GatherArgs gather;   // active: gather_rs's kernel
  CUtensorMap a_map, b_map, sa_map;  // sa_map: the e4m3 producer's lhs scales
  const float* w_scales;             // the e4m3 producer's
};

// Prepares ExpertKernel<T, kEngine, kTransB, kGather> on the device (once) and launches it: one CTA per SM of the
// budget.
template <typename T, int kEngine, bool kTransB, bool kGather>
Status LaunchExpertKernel(ExpertLaunch l) {
  int smem = 0;
  Status s = PrepareExpertKernel<T, kEngine, kTransB, kGather>(l.dev, &smem);
  if (!s.ok()) return s;
  l.pol.smem_bytes = smem;
  ExpertKernel<T, kEngine, kTransB, kGather><<<l.budget, kEngineThreads<kEngine>, smem, l.stream>>>(
      l.rd, static_cast<const T*>(l.lhs), static_cast<const T*>(l.w), l.cap, l.K, l.N, l.seg_rows, l.seg_ret_off,
      (int)l.E_l, l.pol, l.gather, l.a_map, l.b_map, l.sa_map, l.w_scales);
  return LaunchError("launch of ExpertKernel");
}

template <typename T, int kEngine>
Status LaunchExpertKernel(const ExpertLaunch& l, bool transpose_rhs) {
  if (l.gather.active)
    return transpose_rhs ? LaunchExpertKernel<T, kEngine, true, true>(l)
                         : LaunchExpertKernel<T, kEngine, false, true>(l);
  return transpose_rhs ? LaunchExpertKernel<T, kEngine, true, false>(l)
                       : LaunchExpertKernel<T, kEngine, false, false>(l);
}

// The e4m3 producer's kernels (expert_combine's consumer, w K-major) for both output dtypes.
Status PrepareExpertFp8Kernels(int dev, int* smem_bytes) {
  Status s = PrepareExpertKernel<bf16, kWgmmaFp8, false, false>(dev, smem_bytes);
  return s.ok() ? PrepareExpertKernel<float, kWgmmaFp8, false, false>(dev, smem_bytes) : s;
}

// PrepareExpertKernel for both layouts of w and both consumers (expert_combine's, gather_rs's).
template <typename T, int kEngine>
Status PrepareExpertKernelSet(int dev, int* smem_bytes) {
  Status s = PrepareExpertKernel<T, kEngine, false, false>(dev, smem_bytes);
  if (s.ok()) s = PrepareExpertKernel<T, kEngine, true, false>(dev, smem_bytes);
  if (s.ok()) s = PrepareExpertKernel<T, kEngine, false, true>(dev, smem_bytes);
  return s.ok() ? PrepareExpertKernel<T, kEngine, true, true>(dev, smem_bytes) : s;
}

}  // namespace

Status PrepareExpertKernels(int dev) {
  int smem = 0;
  DeviceInfo info;
  Status s = GetDeviceInfo(dev, &info);
  if (s.ok() && GemmEngineDeviceRefusal(GemmEngine::kWgmma, info.cc) == nullptr)
    s = PrepareExpertKernelSet<bf16, kWgmma>(dev, &smem);
  if (s.ok() && Fp8GroupedGemmDeviceRefusal(info.cc) == nullptr) s = PrepareExpertFp8Kernels(dev, &smem);
  if (s.ok()) s = PrepareExpertKernelSet<bf16, kMmaSync>(dev, &smem);
  if (s.ok()) s = PrepareExpertKernelSet<bf16, kSimt>(dev, &smem);
  if (s.ok()) s = PrepareExpertKernelSet<float, kSimt>(dev, &smem);
  return s;
}

int ProducerTileN() { return kMmaBN; }

void ProducerTile(GemmEngine engine, int* tile_m, int* tile_n) {
  const bool wg = engine == GemmEngine::kWgmma;
  *tile_m = wg ? kWgBM : kMmaBM;
  *tile_n = wg ? kWgBN : kMmaBN;
}

std::string CheckModelParams(const ModelParams& p) {
  auto finite_nonneg = [](double v) { return v >= 0.0 && v < 1e300; };
  if (!(p.tile_m == kMmaBM && p.tile_n == kMmaBN) && !(p.tile_m == kWgBM && p.tile_n == kWgBN))
    return "the model describes " + std::to_string(p.tile_m) + "x" + std::to_string(p.tile_n) +
           " tiles but the compiled producers use " + std::to_string(kMmaBM) + "x" + std::to_string(kMmaBN) +
           " (mma.sync) or " +
           std::to_string(kWgBM) + "x" + std::to_string(kWgBN) + " (wgmma)";
  if (p.ctas_per_sm != 1) return "ctas_per_sm must be 1 (the expert kernel runs one CTA per SM)";
  if (p.sms < 2) return "sms must be >= 2";
  if (!finite_nonneg(p.tile_us_base) || !finite_nonneg(p.tile_us_per_k) || !finite_nonneg(p.seg_us))
    return "tile_us_base, tile_us_per_k and seg_us must be finite and >= 0";
  if (!(p.tile_us_base + p.tile_us_per_k > 0.0)) return "the tile time must be positive";
  if (!(p.cta_gbps > 0.0 && p.cta_gbps < 1e300) || !(p.link_gbps > 0.0 && p.link_gbps < 1e300))
    return "cta_gbps and link_gbps must be finite and > 0";
  if (!(p.pusher_gbps >= 0.0 && p.pusher_gbps < 1e300))
    return "pusher_gbps must be finite and >= 0 (0: no pusher rate, dispatch_gemm keeps the fixed rule)";
  if (!(p.gather_gbps >= 0.0 && p.gather_gbps < 1e300))
    return "gather_gbps must be finite and >= 0 (0: no gather rate, gather_rs's model takes 2 cta_gbps)";
  return "";
}

const char* ConsumerPolicyName(ConsumerPolicy p) {
  switch (p) {
    case ConsumerPolicy::kPinned: return "pinned";
    case ConsumerPolicy::kModel: return "model";
    default: return "fixed";
  }
}

ConsumerPolicy SelectConsumerPolicy(const Workspace& ws, const CallOptions& o, GemmEngine producer) {
  if (o.consumer_ctas > 0) return ConsumerPolicy::kPinned;
  // A calibration describes one tensor-core engine, named by its tile shape; calls on another engine (and the SIMT
  // engine: float32, odd shapes) keep the fixed C.
  if (!ws.has_model() || producer == GemmEngine::kSimt) return ConsumerPolicy::kFixed;
  int tile_m = 0, tile_n = 0;
  ProducerTile(producer, &tile_m, &tile_n);
  const ModelParams& m = ws.model();
  return tile_m == m.tile_m && tile_n == m.tile_n ? ConsumerPolicy::kModel : ConsumerPolicy::kFixed;
}

int FixedConsumerCtas(const Workspace& ws, int budget, GemmEngine producer, bool gathers) {
  if (gathers && producer == GemmEngine::kSimt) return 1;
  return std::max(1, std::min(ws.consumer_ctas(), budget - 1));
}

Status LaunchExpertOperator(const CallSite& c, const char* op, DType dt, const void* lhs, int64_t cap, int64_t K,
                            const void* w, int64_t E_l, int64_t N, bool transpose_rhs, const int32_t* seg_rows,
                            const int32_t* seg_ret_off, const GatherArgs& gather, const Fp8ProducerArgs& fp8) {
  Status s;
  Workspace& ws = *c.ws;
  const RankDev rd = ws.Dev(c.group, c.rank);
  const int dev = ws.device(c.group, c.rank);
  const int budget = ws.budget(c.group, c.rank);
  const bool gathers = gather.active;
  if (c.opts.consumer_ctas > budget - 1)  // (>= 0: CheckOptions)
    return FailCall(c, op,
                    "consumer_ctas=" + std::to_string(c.opts.consumer_ctas) + " but rank " + std::to_string(c.rank) +
                        " (group " + std::to_string(c.group) + ") has an SM budget of " + std::to_string(budget) +
                        " CTAs and needs at least one producer CTA: pin C in [1, " + std::to_string(budget - 1) +
                        "], or 0 for the resource manager's choice");
  if (gathers && budget < 2)
    return FailCall(c, op, "rank " + std::to_string(c.rank) + " has an SM budget of " + std::to_string(budget) +
                               " CTA: gather_rs needs a producer CTA and a consumer CTA");
  ConsumerConfig pol{};
  pol.serialize = c.opts.serialize ? 1 : 0;
  // How the consumer pushes (CallOptions::tuning; the ranges are checked where CallConfig builds the options).
  pol.bulk_copy = c.opts.tuning.bulk_copy ? 1 : 0;
  pol.push_slots = c.opts.tuning.push_slots;
  pol.push_read_lag = c.opts.tuning.push_read_lag;
  pol.push_issuers = c.opts.tuning.push_issuers;
  pol.elem_bytes = Traits(dt).elem_bytes;
  pol.link_bytes_per_ns = c.opts.emulated_link_gbps;  // GB/s = bytes/ns
  // The wgmma producer's row blocks per raster band (ConsumerConfig::band_m) where the call does not pin it: the bare
  // grouped GEMM's (wgmma_gemm::kBandM), one rule for every wgmma tile loop. Row-block order (1) completes each band's
  // flags soonest but reads every column slab of the expert's weight from HBM again for each row block once the weight
  // outgrows L2; bands of 8 row blocks share each slab over 8 row blocks (fewer HBM reads there than bands of 4:
  // docs/performance.md, "The producer's tile order").
  pol.band_m = c.opts.producer_band_m > 0 ? c.opts.producer_band_m : wgmma_gemm::kBandM;
  pol.producer_order = gathers ? 1 : c.opts.producer_order;  // (gather_rs: its consumer reduces a source's rows as one)
  pol.max_ctas = ModelMaxCtas(budget);
  DeviceInfo info;
  if (!(s = GetDeviceInfo(dev, &info)).ok()) return s;
  if (fp8.active) {
    if (const char* why = Fp8GroupedGemmDeviceRefusal(info.cc))
      return FailCall(c, op, std::string("e4m3 operands: ") + why);
    if (!transpose_rhs)
      return FailCall(c, op, "e4m3 w must be [E_local, N, K] (K-major: transpose_rhs), the only B layout of FP8 wgmma");
    // (The rows go to the workspace's stage and ret rows, aligned by the workspace: lhs stands in for the output in
    // the alignment rule.)
    if (const char* why = wgmma_gemm::GroupedGemmFp8Refusal(cap, K, N, E_l, fp8.scales_ld, lhs, fp8.lhs_scales, w,
                                                            fp8.w_scales, lhs))
      return FailCall(c, op, std::string("e4m3 operands: ") + why);
  }
  // (The e4m3 producer is no GemmEngine: wgmma's loop over another operand format.)
  const std::optional<GemmEngine> selected =
      fp8.active ? std::optional<GemmEngine>(GemmEngine::kWgmma)
                 : SelectGemmEngine(info.cc, {dt, GemmForm::kRows, cap, K, N, transpose_rhs, GemmEpilogue::kNone, lhs,
                                              w});
  if (!selected)
    return FailCall(c, op, std::string("no GEMM engine takes ") + Traits(dt).name + " operands on this device");
  const GemmEngine engine = *selected;
  // The fixed C; also gather_rs's under the model where no band goes to another rank (GatherConsumersOfCall).
  const int fixed = FixedConsumerCtas(ws, budget, engine, gathers);
  // (The e4m3 producer's tiles are the wgmma engine's shape: the model sizes its C with Fp8ModelK.)
  const ConsumerPolicy policy = SelectConsumerPolicy(ws, c.opts, engine);
  if (policy == ConsumerPolicy::kPinned) {
    pol.consumers = c.opts.consumer_ctas;
  } else if (policy == ConsumerPolicy::kModel) {
    pol.use_model = 1;
    pol.model = ModelWithLink(ws.model(), c.opts.emulated_link_gbps);  // the call's link, where it has one
    pol.model.sms = budget;  // the rank's CTAs are its SMs (one CTA per SM, checked by PrepareExpertKernel)
    pol.model.ctas_per_sm = 1;
    pol.cand = FillCandidateConsts(pol.model, pol.max_ctas, N);
    pol.consumers = gathers ? fixed : 0;
  } else {
    pol.consumers = fixed;
  }
  // Per-band tile counters and the finished-band count start from zero every call (stream-ordered: the previous
  // call's kernels are done).
  if (!(s = CudaStatus(cudaMemsetAsync(rd.band_done, 0, BandCounterBytes(ws.sizes().max_bands), c.stream),
                       "cudaMemsetAsync(band counters)")).ok())
    return s;
  ExpertLaunch l{c.stream, dev, budget, rd, lhs, w, cap, K, N, E_l, seg_rows, seg_ret_off, pol, gather, {}, {}, {},
                 fp8.w_scales};
  if (fp8.active) {  // the FP8 grouped GEMM's three tensor maps
    CUtensorMap maps[3];
    if (!(s = CudaStatus(wgmma_gemm::CachedFp8Maps(lhs, fp8.lhs_scales, fp8.scales_ld, cap, K, w, E_l, N, maps),
                         "tensor maps of the e4m3 producer")).ok())
      return s;
    l.a_map = maps[0];
    l.b_map = maps[1];
    l.sa_map = maps[2];
    return dt == DType::kF32 ? LaunchExpertKernel<float, kWgmmaFp8, false, false>(l)
                             : LaunchExpertKernel<bf16, kWgmmaFp8, false, false>(l);
  }
  if (engine == GemmEngine::kWgmma) {  // the TMA descriptors of the wgmma engine (unused by the others)
    if (!(s = CudaStatus(wgmma_gemm::CachedGemmMaps(lhs, cap, K, w, E_l, N, /*b_k_major=*/transpose_rhs, &l.a_map,
                                                    &l.b_map),
                         "tensor maps of the wgmma producer")).ok())
      return s;
    return LaunchExpertKernel<bf16, kWgmma>(l, transpose_rhs);
  }
  if (engine == GemmEngine::kMmaSync) return LaunchExpertKernel<bf16, kMmaSync>(l, transpose_rhs);
  if (dt == DType::kBF16) return LaunchExpertKernel<bf16, kSimt>(l, transpose_rhs);
  return LaunchExpertKernel<float, kSimt>(l, transpose_rhs);
}

Status ExpertCombine(const CallSite& c, DType dt, const void* lhs, int64_t cap, int64_t K, const void* w, int64_t E_l,
                     int64_t N, bool transpose_rhs, const float* gates, int64_t T, int64_t k, const int32_t* seg_rows,
                     const int32_t* seg_ret_off, const int32_t* slot_ret_row, const int32_t* ret_expected,
                     const int32_t* group_op, const int32_t* rank_op, void* y, void* slot_out,
                     const Fp8ProducerArgs& fp8) {
  const int64_t row_bytes = RowBytes(dt, N);
  Status s = BeginCall(c, "expert_combine", CallFootprint{row_bytes, cap, T * k, E_l}, group_op, rank_op);
  if (!s.ok()) return s;
  s = LaunchExpertOperator(c, "expert_combine", dt, lhs, cap, K, w, E_l, N, transpose_rhs, seg_rows, seg_ret_off,
                           GatherArgs{}, fp8);
  if (!s.ok()) return s;
  const RankDev rd = c.ws->Dev(c.group, c.rank);
  return LaunchCombine(rd, c.ws->budget(c.group, c.rank), c.stream, dt, gates, slot_ret_row, ret_expected, T, k, N,
                       row_bytes, y, slot_out);
}

}  // namespace jmo::cuda
