// The options of a workspace call: how it runs (its wait bound, the testing delay, the CUDA resources it takes and how
// its pushes go), never what it computes. One struct for every call and both platforms: the XLA FFI handlers decode
// it once from the call's `options` attribute (call_signature.h), the CUDA launchers and the CPU handlers read it from
// their call context (cuda/api.h's CallSite, cpu/call_steps.h's CallContext), and the tools fill it directly.
// Plain C++ (no XLA, no CUDA headers), so every side of the library includes it.
#pragma once

#include <cstdint>
#include <string>

namespace jmo {

// How expert_combine's consumer CTAs push their bands on CUDA (ConsumerTuning of jax_moe_overlap's CallConfig, which
// checks the ranges; the CPU consumer, one thread per rank, ignores them). The defaults are the ones the shipped
// calibration describes.
struct ConsumerTuning {
  bool bulk_copy = true;      // TMA bulk copies on sm_90 (transport/bulk_push.cuh); false: CopyBand (16-byte copies)
  int32_t push_slots = 12;    // ring slots of one issuing thread (2..kPushMaxSlots; the launch's smem may give fewer)
  int32_t push_read_lag = 4;  // bulk stores that may still read their slot (1..16; below the slots)
  int32_t push_issuers = 4;   // issuing threads per consumer CTA, one ring each (1..8): one thread's rate is bounded
};

struct CallOptions {
  int64_t timeout_ms = 10000;  // bound of every wait of the call
  // The bound of a group's first call (epoch 1) is at least this (protocol.h, CallWaitBoundMs); 0: timeout_ms alone.
  int64_t first_call_timeout_ms = 0;
  int32_t delay_rank = -1;     // testing aid: this rank is held back delay_us at the start of every call
  int64_t delay_us = 0;
  // expert_combine's consumer. consumer_ctas: 0 = the resource manager's choice (the workspace's model evaluated on
  // the device from the call's routed counts, or its fixed count without a model); > 0 = pinned (on CUDA it must
  // leave a producer CTA: at most the rank's SM budget - 1). serialize: the consumer starts pushing only after the
  // producer has finished every tile (the "same kernels, no overlap" baseline).
  int32_t consumer_ctas = 0;
  bool serialize = false;
  ConsumerTuning tuning;
  // dispatch_gemm's CTAs that push the rows for other ranks first, then join the GEMM: 0 = the library's choice (the
  // resource model's, evaluated on the device from the call's routed counts, where the workspace has a model with a
  // pusher rate; else DefaultPushers below); > 0 = pinned (on CUDA at most the rank's SM budget - 1). No effect on CPU.
  int32_t pushers = 0;
  // dispatch_gemm's x_recv (where kept) on CUDA: false = copied from recv by the side units (the pushers' CTAs after
  // their pushes, and GEMM CTAs out of tiles); true = stored by the GEMM tiles from the A tiles they hold in shared
  // memory (each m-tile's first column tile). The same bytes either way; no effect on CPU.
  bool x_recv_from_tiles = false;
  // Benchmark aid of the loopback harness, where ranks share one GPU and "pushes to a peer" run at HBM speed: > 0
  // paces every push to another rank (the rows of dispatch and dispatch_gemm, the bands of expert_combine's consumer)
  // so that a rank's pushing CTAs together move at most this many GB/s, as over a link of that bandwidth (on CUDA:
  // transport/emulated_link.cuh). Never set by the library's Python API (0: no pacing); no effect on CPU.
  double emulated_link_gbps = 0;
  // Benchmark aid of the loopback harness: > 0 pins the row blocks per raster band of expert_combine's and
  // gather_rs's wgmma producer (wgmma_gemm::BandRaster inside each segment) and of dispatch_gemm's GEMM (inside each
  // expert's phase); 0: the rule, wgmma_gemm::kBandM (the bare grouped GEMM's band, gemm/sm90/wgmma_grouped.cuh).
  // Never set by the library's Python API; no effect on CPU or on other GEMM engines.
  int32_t producer_band_m = 0;
  // Benchmark aid of the loopback harness: the order of expert_combine's wgmma producer tiles over its segments
  // (UseExpertMajor, cuda/ops/expert_producer.cuh) and of dispatch_gemm's GEMM tiles (ExpertMajorDg,
  // cuda/ops/dispatch_gemm.cu). 0: the rule; 1: the segment table's order (remote sources first, a source's segments
  // by expert, each tiled apart: every expert's weight streamed once per source), dispatch_gemm's two phases (the
  // m-tiles of own rows alone first, then the others: every expert's weight streamed once per phase); 2: expert-major
  // (each expert's rows tiled as one range across its sources: each weight slab shared while they run).
  // Never set by the library's Python API; no effect on CPU, on gather_rs (whose consumer reduces a source's rows as
  // one), on dispatch_gemm with send once (its phases stay) or on other GEMM engines.
  int32_t producer_order = 0;
};

// dispatch_gemm's pushing CTAs where the library chooses without a resource model (no calibration, or one without a
// pusher rate: docs/resource_manager.md) on a rank of `sm_budget` SMs: 8 on an H200's 132 (docs/performance.md, dispatch_gemm), and
// the same share of any other budget, rounded to the nearest count, at least one, so that a rank holding part of a
// GPU (several ranks per GPU, as in the loopback harness) gives its pushers the share of its SMs a whole GPU would.
// At most budget - 1 for every budget >= 2 (a GEMM CTA is left). Applied by the launch (DispatchPushersPolicy,
// cuda/schedule/resource_manager.cuh); the Python call site (call_site.dispatch_pushers) reports it as the count of a
// fused call site without a model.
constexpr int32_t kPushersPerH200 = 8, kH200Sms = 132;
inline int32_t DefaultPushers(int32_t sm_budget) {
  const int32_t p = (sm_budget * kPushersPerH200 + kH200Sms / 2) / kH200Sms;
  return p > 1 ? p : 1;
}

// The rules every call's options follow on every platform, checked in one place (each platform's BeginCall, before
// the call's epoch opens, as a shape error): empty, or the first rule `o` breaks, named. The bounds that depend on the
// rank's SM budget are the CUDA launchers' (only they know the budget).
inline std::string CheckOptions(const CallOptions& o) {
  if (o.consumer_ctas < 0)
    return "consumer_ctas must be 0 (the resource manager's choice) or a positive CTA count, got " +
           std::to_string(o.consumer_ctas);
  if (o.pushers < 0)
    return "pushers must be 0 (the library's choice) or a positive count of dispatch_gemm's pushing CTAs (no effect "
           "on CPU), got " + std::to_string(o.pushers);
  if (o.first_call_timeout_ms < 0)
    return "first_call_timeout_ms must be >= 0 (milliseconds; 0: timeout_ms alone), got " +
           std::to_string(o.first_call_timeout_ms);
  if (!(o.emulated_link_gbps >= 0)) return "CallOptions::emulated_link_gbps must be >= 0";
  return {};
}

}  // namespace jmo
