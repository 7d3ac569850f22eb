// The nanobind extension `jax_moe_overlap._jmo`: FFI handler capsules and workspace management.
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include <sys/mman.h>

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/tuple.h>

#include "common/build_info.h"
#include "common/call_options.h"
#include "common/dtype.h"
#include "cpu/handlers.h"
#include "cpu/workspace_cpu.h"
#include "jax_moe_overlap/protocol.h"
#include "jax_moe_overlap/resource_model.h"

#ifdef JMO_WITH_CUDA
#include "cuda/handlers/module.h"
#endif

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>, "not an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

int64_t CreateCpuWorkspace(int ranks, int groups, int64_t row_bytes, int64_t recv_rows, int64_t ret_rows,
                           int64_t num_segments) {
  if (ranks < 1 || groups < 1 || row_bytes < 1 || recv_rows < 0 || ret_rows < 0 || num_segments < 0)
    throw std::invalid_argument("jax_moe_overlap: invalid workspace sizes");
  jmo::WorkspaceSizes s{row_bytes, recv_rows, ret_rows, jmo::MaxBands(recv_rows, num_segments)};
  return jmo::cpu::RegisterWorkspace(std::make_unique<jmo::cpu::Workspace>(ranks, groups, s, num_segments));
}

// A workspace whose groups span processes: creates this process's shared-memory objects (workspace_cpu.h).
int64_t CreateCpuSharedWorkspace(int ranks, int groups, int64_t row_bytes, int64_t recv_rows, int64_t ret_rows,
                                 int64_t num_segments, const std::vector<int>& process, int here,
                                 const std::string& prefix) {
  if (ranks < 1 || groups < 1 || row_bytes < 1 || recv_rows < 0 || ret_rows < 0 || num_segments < 0)
    throw std::invalid_argument("jax_moe_overlap: invalid workspace sizes");
  jmo::WorkspaceSizes s{row_bytes, recv_rows, ret_rows, jmo::MaxBands(recv_rows, num_segments)};
  return jmo::cpu::RegisterWorkspace(
      std::make_unique<jmo::cpu::Workspace>(ranks, groups, s, num_segments, process, here, prefix));
}

jmo::cpu::Workspace& LiveCpuWorkspace(int64_t handle) {
  jmo::cpu::Workspace* ws = jmo::cpu::LookupWorkspace(handle);
  if (ws == nullptr) throw std::invalid_argument("jax_moe_overlap: no live CPU workspace " + std::to_string(handle));
  return *ws;
}

// (rows, remote) segments in producer order, with the rows whose tiles each carries (ModelSegment::tile_rows; empty:
// every segment its own).
std::vector<jmo::ModelSegment> Segments(const std::vector<std::tuple<int, int>>& segs,
                                        const std::vector<int>& tile_rows) {
  if (!tile_rows.empty() && tile_rows.size() != segs.size())
    throw std::invalid_argument("tile_rows must hold one entry per segment, or none");
  std::vector<jmo::ModelSegment> out;
  for (size_t i = 0; i < segs.size(); ++i) {
    const auto& [rows, remote] = segs[i];
    out.push_back(jmo::ModelSegment{rows, remote, tile_rows.empty() ? -1 : tile_rows[i]});
  }
  return out;
}

// gather_rs's sources in the consumer's order (resource_model.h GatherModelSources) from (rows, source) segments in
// producer order; the tiles of all segments. Refuses what the kernels never see: ranks outside [1, 32], rank outside
// [0, ranks), a source outside [0, ranks) or its segments apart.
int64_t GatherSources(const jmo::ModelParams& p, const std::vector<std::tuple<int, int>>& segs, int rank, int ranks,
                      int64_t n, std::vector<jmo::GatherModelSource>* out) {
  if (ranks < 1 || ranks > 32 || rank < 0 || rank >= ranks)
    throw std::invalid_argument("jax_moe_overlap: gather model: rank " + std::to_string(rank) + " of " +
                                std::to_string(ranks) + " ranks (1..32)");
  std::vector<jmo::GatherModelSegment> g;
  for (auto& [rows, src] : segs) g.push_back(jmo::GatherModelSegment{rows, src});
  out->assign(ranks, jmo::GatherModelSource{});
  const int64_t total = jmo::GatherModelSources(p, g.data(), (int)g.size(), ranks, rank, n, out->data());
  if (total < 0)
    throw std::invalid_argument("jax_moe_overlap: gather model: the segments must be in producer order, each source "
                                "in [0, ranks) with its segments consecutive");
  return total;
}

}  // namespace

NB_MODULE(_jmo, m) {
  m.doc() = "jax-moe-overlap native extension: XLA FFI handlers and peer workspaces";
  m.def("cpu_registrations", []() {
    nb::dict d;
    d["jmo_dispatch"] = Capsule(JmoDispatchCpu);
    d["jmo_expert_combine"] = Capsule(JmoExpertCombineCpu);
    d["jmo_dispatch_gemm"] = Capsule(JmoDispatchGemmCpu);
    d["jmo_exchange_counts"] = Capsule(JmoExchangeCountsCpu);
    d["jmo_gather_rs"] = Capsule(JmoGatherRsCpu);
    d["jmo_grouped_matmul"] = Capsule(JmoGroupedMatmulCpu);
    d["jmo_grouped_outer"] = Capsule(JmoGroupedOuterCpu);
    d["jmo_grouped_matmul_swiglu"] = Capsule(JmoGroupedMatmulSwiGluCpu);
    d["jmo_grouped_matmul_swiglu_grad"] = Capsule(JmoGroupedMatmulSwiGluGradCpu);
    d["jmo_grouped_matmul_fp8"] = Capsule(JmoGroupedMatmulFp8Cpu);
    d["jmo_grouped_matmul_swiglu_fp8"] = Capsule(JmoGroupedMatmulSwiGluFp8Cpu);
    d["jmo_grouped_outer_fp8"] = Capsule(JmoGroupedOuterFp8Cpu);
    d["jmo_quantize_columns_fp8"] = Capsule(JmoQuantizeColumnsFp8Cpu);
    d["jmo_quantize_weight_fp8"] = Capsule(JmoQuantizeWeightFp8Cpu);
    d["jmo_swiglu_backward_fp8"] = Capsule(JmoSwiGluBackwardFp8Cpu);
    d["jmo_swiglu_forward_fp8"] = Capsule(JmoSwiGluForwardFp8Cpu);
    return d;
  });
  m.def("create_cpu_workspace", &CreateCpuWorkspace, nb::arg("ranks"), nb::arg("groups"), nb::arg("row_bytes"),
        nb::arg("recv_rows"), nb::arg("ret_rows"), nb::arg("num_segments"));
  m.def("create_cpu_shared_workspace", &CreateCpuSharedWorkspace, nb::arg("ranks"), nb::arg("groups"),
        nb::arg("row_bytes"), nb::arg("recv_rows"), nb::arg("ret_rows"), nb::arg("num_segments"), nb::arg("process"),
        nb::arg("here"), nb::arg("prefix"));
  // Testing aid: dispatch_gemm's arrival counters (src_blocks, protocol.h) of rank `rank` of group `group`, sources
  // by block, so that tests can see every call leave them zero and the recovery after a failure clear them. Read
  // between calls only (a call in flight writes them).
  m.def(
      "cpu_src_blocks",
      [](int64_t handle, int group, int rank) {
        jmo::cpu::Workspace& ws = LiveCpuWorkspace(handle);
        if (group < 0 || group >= ws.groups() || rank < 0 || rank >= ws.ranks())
          throw std::invalid_argument("jax_moe_overlap: no rank " + std::to_string(rank) + " of group " +
                                      std::to_string(group) + " in CPU workspace " + std::to_string(handle));
        const uint64_t* b = ws.view(group, rank).src_blocks();
        return std::vector<uint64_t>(b, b + jmo::kMaxSourceCounters * jmo::SrcBlocks(ws.sizes().ret_rows));
      },
      nb::arg("handle"), nb::arg("group"), nb::arg("rank"));
  m.def("map_cpu_workspace_peers", [](int64_t handle) { LiveCpuWorkspace(handle).MapPeers(); }, nb::arg("handle"));
  m.def("unlink_cpu_workspace_names", [](int64_t handle) { LiveCpuWorkspace(handle).UnlinkOwn(); },
        nb::arg("handle"));
  m.def("unlink_shm", [](const std::string& name) { return shm_unlink(name.c_str()) == 0; }, nb::arg("name"));
  // CPU and CUDA workspace handles live in disjoint ranges; each side releases its own.
  m.def(
      "release_workspace",
      [](int64_t handle) {
#ifdef JMO_WITH_CUDA
        if (jmo::cuda::IsCudaWorkspaceHandle(handle)) return jmo::cuda::ReleaseCudaWorkspace(handle);
#endif
        return jmo::cpu::ReleaseWorkspace(handle);
      },
      nb::arg("handle"));
  m.def("workspace_bytes_per_rank", [](int64_t row_bytes, int64_t recv_rows, int64_t ret_rows, int64_t segs) {
    jmo::WorkspaceSizes s{row_bytes, recv_rows, ret_rows, jmo::MaxBands(recv_rows, segs)};
    return jmo::MakeLayout(s).total;
  });
  // Bytes of one row of `channels` channels as the workspace holds and ships it (dtype.h's RowBytes), for the
  // workspace's sizes: dtype "float32", "bfloat16" or "uint8" (packed e4m3 rows: the values, then a float32 scale per
  // 128 channels).
  m.def(
      "row_bytes",
      [](const std::string& dtype, int64_t channels) {
        jmo::DType d;
        if (!jmo::DTypeNamed(dtype, &d, /*moved_too=*/true))
          throw std::invalid_argument("jax_moe_overlap: row dtype '" + dtype + "' is none of " +
                                      jmo::DTypeNames(/*moved_too=*/true));
        return jmo::RowBytes(d, channels);
      },
      nb::arg("dtype"), nb::arg("channels"));
  m.attr("band_rows") = jmo::kBandRows;
  // The resource model's constants (resource_model.h), by name: what create_cuda_workspace and the model functions take
  // (jax_moe_overlap.resource.ModelParams.native() builds one).
  nb::class_<jmo::ModelParams>(m, "ModelParams")
      .def(
          "__init__",
          [](jmo::ModelParams* p, int32_t sms, int32_t ctas_per_sm, int32_t tile_m, int32_t tile_n, double tile_us_base,
             double tile_us_per_k, double cta_gbps, double link_gbps, double seg_us, double pusher_gbps,
             double gather_gbps) {
            new (p) jmo::ModelParams{sms,      ctas_per_sm, tile_m, tile_n,      tile_us_base, tile_us_per_k,
                                     cta_gbps, link_gbps,   seg_us, pusher_gbps, gather_gbps};
          },
          nb::kw_only(), nb::arg("sms"), nb::arg("ctas_per_sm"), nb::arg("tile_m"), nb::arg("tile_n"),
          nb::arg("tile_us_base"), nb::arg("tile_us_per_k"), nb::arg("cta_gbps"), nb::arg("link_gbps"),
          nb::arg("seg_us"), nb::arg("pusher_gbps") = 0.0, nb::arg("gather_gbps") = 0.0)
      .def_rw("sms", &jmo::ModelParams::sms)
      .def_rw("ctas_per_sm", &jmo::ModelParams::ctas_per_sm)
      .def_rw("tile_m", &jmo::ModelParams::tile_m)
      .def_rw("tile_n", &jmo::ModelParams::tile_n)
      .def_rw("tile_us_base", &jmo::ModelParams::tile_us_base)
      .def_rw("tile_us_per_k", &jmo::ModelParams::tile_us_per_k)
      .def_rw("cta_gbps", &jmo::ModelParams::cta_gbps)
      .def_rw("link_gbps", &jmo::ModelParams::link_gbps)
      .def_rw("seg_us", &jmo::ModelParams::seg_us)
      .def_rw("pusher_gbps", &jmo::ModelParams::pusher_gbps)
      .def_rw("gather_gbps", &jmo::ModelParams::gather_gbps);
  // The K the model times an e4m3 tile of K at (resource_model.h Fp8ModelK: what the FP8 launches hand it).
  m.def("model_fp8_k", &jmo::Fp8ModelK, nb::arg("K"));
  // The model with a call's link (resource_model.h ModelWithLink: what the launches evaluate; 0: no link).
  m.def("model_with_link", &jmo::ModelWithLink, nb::arg("params"), nb::arg("link_gbps"));
  // expert_combine's consumer CTAs from the call's non-empty segments in producer order as (rows, remote), with
  // tile_rows (ModelSegment::tile_rows, one per segment) for the expert-major producer.
  m.def("model_makespan_us", [](const jmo::ModelParams& params, const std::vector<std::tuple<int, int>>& segs,
                                int64_t n, int64_t k, int64_t elem_bytes, int ctas, const std::vector<int>& tile_rows) {
    auto s = Segments(segs, tile_rows);
    std::vector<jmo::ModelPrefix> scratch(s.size() + 1);
    return jmo::ModelMakespanUs(params, s.data(), (int)s.size(), n, k, elem_bytes, ctas, scratch.data());
  }, nb::arg("params"), nb::arg("segs"), nb::arg("n"), nb::arg("k"), nb::arg("elem_bytes"), nb::arg("ctas"),
        nb::arg("tile_rows") = std::vector<int>{});
  m.def("model_choose_consumer_ctas", [](const jmo::ModelParams& params,
                                         const std::vector<std::tuple<int, int>>& segs, int64_t n, int64_t k,
                                         int64_t elem_bytes, int max_ctas, const std::vector<int>& tile_rows) {
    auto s = Segments(segs, tile_rows);
    std::vector<jmo::ModelPrefix> scratch(s.size() + 1);
    return jmo::ChooseConsumerCtas(params, s.data(), (int)s.size(), n, k, elem_bytes, max_ctas,
                                   scratch.data());
  }, nb::arg("params"), nb::arg("segs"), nb::arg("n"), nb::arg("k"), nb::arg("elem_bytes"), nb::arg("max_ctas"),
        nb::arg("tile_rows") = std::vector<int>{});
  // gather_rs's consumer CTAs (resource_model.h, "gather_rs's consumer CTAs"): the modelled time with C consumer CTAs
  // and the choice, from the call's non-empty segments in producer order as (rows, source).
  m.def("model_gather_makespan_us", [](const jmo::ModelParams& params, const std::vector<std::tuple<int, int>>& segs,
                                       int rank, int ranks, int64_t tokens, int64_t slots, int64_t n, int64_t k,
                                       int64_t elem_bytes, int ctas) {
    std::vector<jmo::GatherModelSource> src;
    const int64_t total = GatherSources(params, segs, rank, ranks, n, &src);
    return jmo::GatherMakespanFromSources(params, src.data(), ranks, total,
                                          jmo::GatherModelShape{tokens, slots, n, k, elem_bytes}, ctas);
  }, nb::arg("params"), nb::arg("segs"), nb::arg("rank"), nb::arg("ranks"), nb::arg("tokens"), nb::arg("slots"),
        nb::arg("n"), nb::arg("k"), nb::arg("elem_bytes"), nb::arg("ctas"));
  // The memory traffic of the call's sources as the model counts it (GatherModelTraffic: the sum of a_s), in bytes;
  // the gather consumer's rate gather_gbps is this / its span / C (benchmarks/calibrate.py). (The traffic depends on
  // no constant: the sources are built with unit tiles.)
  m.def("model_gather_traffic_bytes", [](const std::vector<std::tuple<int, int>>& segs, int rank, int ranks,
                                         int64_t tokens, int64_t slots, int64_t n, int64_t elem_bytes) {
    jmo::ModelParams unit{};
    unit.tile_m = unit.tile_n = 1;
    std::vector<jmo::GatherModelSource> src;
    GatherSources(unit, segs, rank, ranks, n, &src);
    return jmo::GatherModelTraffic(src.data(), ranks, jmo::GatherModelShape{tokens, slots, n, 0, elem_bytes});
  }, nb::arg("segs"), nb::arg("rank"), nb::arg("ranks"), nb::arg("tokens"), nb::arg("slots"), nb::arg("n"),
        nb::arg("elem_bytes"));
  m.def("model_choose_gather_consumer_ctas", [](const jmo::ModelParams& params,
                                                const std::vector<std::tuple<int, int>>& segs, int rank, int ranks,
                                                int64_t tokens, int64_t slots, int64_t n, int64_t k,
                                                int64_t elem_bytes, int max_ctas) {
    std::vector<jmo::GatherModelSource> src;
    const int64_t total = GatherSources(params, segs, rank, ranks, n, &src);
    return jmo::ChooseGatherConsumerCtasFromSources(params, src.data(), ranks, total,
                                                    jmo::GatherModelShape{tokens, slots, n, k, elem_bytes}, max_ctas);
  }, nb::arg("params"), nb::arg("segs"), nb::arg("rank"), nb::arg("ranks"), nb::arg("tokens"), nb::arg("slots"),
        nb::arg("n"), nb::arg("k"), nb::arg("elem_bytes"), nb::arg("max_ctas"));
  // dispatch_gemm's pushing CTAs (resource_model.h): the modelled time with P pushers, and the choice (0: the model
  // has no pusher rate).
  m.def("model_pushers_makespan_us", [](const jmo::ModelParams& params, int64_t push_bytes, int64_t gemm_rows,
                                        int64_t k, int64_t n, int64_t round_rows, int pushers, int64_t rounds) {
    return jmo::PushersMakespanUs(params, jmo::PusherInputs{push_bytes, gemm_rows, k, n, round_rows, rounds}, pushers);
  }, nb::arg("params"), nb::arg("push_bytes"), nb::arg("gemm_rows"), nb::arg("k"), nb::arg("n"), nb::arg("round_rows"),
        nb::arg("pushers"), nb::arg("rounds") = 0);
  m.def("model_choose_dispatch_pushers", [](const jmo::ModelParams& params, int64_t push_bytes, int64_t gemm_rows,
                                            int64_t k, int64_t n, int64_t round_rows, int max_pushers, int64_t rounds) {
    return jmo::ChooseDispatchPushers(params, jmo::PusherInputs{push_bytes, gemm_rows, k, n, round_rows, rounds},
                                      max_pushers);
  }, nb::arg("params"), nb::arg("push_bytes"), nb::arg("gemm_rows"), nb::arg("k"), nb::arg("n"), nb::arg("round_rows"),
        nb::arg("max_pushers"), nb::arg("rounds") = 0);
  // The same choice from a call's plan, as the kernel makes it (PusherInputsFromPlan): send_start [ranks + 1].
  m.def("model_choose_dispatch_pushers_for_plan", [](const jmo::ModelParams& params,
                                                     const std::vector<int32_t>& send_start, int rank,
                                                     int64_t recv_rows, int64_t row_bytes, int64_t k, int64_t n,
                                                     int max_pushers) {
    if (send_start.size() < 2 || rank < 0 || rank + 1 >= (int)send_start.size())
      throw nb::value_error("send_start needs ranks + 1 entries and rank < ranks");
    const jmo::PusherInputs in = jmo::PusherInputsFromPlan(send_start.data(), rank, (int)send_start.size() - 1,
                                                           recv_rows, row_bytes, k, n);
    return jmo::ChooseDispatchPushers(params, in, max_pushers);
  }, nb::arg("params"), nb::arg("send_start"), nb::arg("rank"), nb::arg("recv_rows"), nb::arg("row_bytes"),
        nb::arg("k"), nb::arg("n"), nb::arg("max_pushers"));
  m.def("model_max_ctas", &jmo::ModelMaxCtas, nb::arg("budget"));
  m.def("build_info", &jmo::BuildInfo);
  m.def("default_dispatch_pushers", &jmo::DefaultPushers, nb::arg("sm_budget"),
        "dispatch_gemm's pushing CTAs on a rank of sm_budget SMs where the library chooses (call_options.h)");
#ifdef JMO_WITH_CUDA
  m.attr("with_cuda") = true;
  jmo::cuda::RegisterModule(m);
#else
  m.attr("with_cuda") = false;
#endif
}
