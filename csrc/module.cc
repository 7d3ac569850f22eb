// The nanobind extension `jax_moe_overlap._jmo`: FFI handler capsules and workspace management.
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/tuple.h>

#include "cpu/handlers.h"
#include "cpu/workspace_cpu.h"
#include "jax_moe_overlap/protocol.h"
#include "jax_moe_overlap/resource_model.h"

#ifdef JMO_WITH_CUDA
#include "cuda/module.h"
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
  return jmo::cpu::RegisterWorkspace(std::make_unique<jmo::cpu::Workspace>(ranks, groups, s));
}

// The resource model of resource_model.h, exposed so that tests check the Python mirror against it.
jmo::ModelParams Params(const std::vector<double>& v) {
  if (v.size() != 9) throw std::invalid_argument("resource model: 9 parameters expected");
  return jmo::ModelParams{(int32_t)v[0], (int32_t)v[1], (int32_t)v[2], (int32_t)v[3], v[4], v[5], v[6], v[7], v[8]};
}

std::vector<jmo::ModelSegment> Segments(const std::vector<std::tuple<int, int>>& segs) {
  std::vector<jmo::ModelSegment> out;
  for (auto& [rows, remote] : segs) out.push_back(jmo::ModelSegment{rows, remote});
  return out;
}

}  // namespace

NB_MODULE(_jmo, m) {
  m.doc() = "jax-moe-overlap native extension: XLA FFI handlers and peer workspaces";
  m.def("cpu_registrations", []() {
    nb::dict d;
    d["jmo_dispatch"] = Capsule(JmoDispatchCpu);
    d["jmo_expert_combine"] = Capsule(JmoExpertCombineCpu);
    d["jmo_grouped_matmul"] = Capsule(JmoGroupedMatmulCpu);
    d["jmo_grouped_outer"] = Capsule(JmoGroupedOuterCpu);
    return d;
  });
  m.def("create_cpu_workspace", &CreateCpuWorkspace, nb::arg("ranks"), nb::arg("groups"), nb::arg("row_bytes"),
        nb::arg("recv_rows"), nb::arg("ret_rows"), nb::arg("num_segments"));
  m.def("release_workspace", &jmo::cpu::ReleaseWorkspace, nb::arg("handle"));
  m.def("workspace_bytes_per_rank", [](int64_t row_bytes, int64_t recv_rows, int64_t ret_rows, int64_t segs) {
    jmo::WorkspaceSizes s{row_bytes, recv_rows, ret_rows, jmo::MaxBands(recv_rows, segs)};
    return jmo::MakeLayout(s).total;
  });
  m.attr("band_rows") = jmo::kBandRows;
  m.def("model_makespan_us", [](const std::vector<double>& params, const std::vector<std::tuple<int, int>>& segs,
                                int64_t n, int64_t k, int64_t elem_bytes, int ctas) {
    auto s = Segments(segs);
    std::vector<jmo::ModelPrefix> scratch(s.size() + 1);
    return jmo::ModelMakespanUs(Params(params), s.data(), (int)s.size(), n, k, elem_bytes, ctas, scratch.data());
  });
  m.def("model_choose_consumer_ctas", [](const std::vector<double>& params,
                                         const std::vector<std::tuple<int, int>>& segs, int64_t n, int64_t k,
                                         int64_t elem_bytes, int max_ctas) {
    auto s = Segments(segs);
    std::vector<jmo::ModelPrefix> scratch(s.size() + 1);
    return jmo::ChooseConsumerCtas(Params(params), s.data(), (int)s.size(), n, k, elem_bytes, max_ctas,
                                   scratch.data());
  });
#ifdef JMO_WITH_CUDA
  m.attr("with_cuda") = true;
  jmo::cuda::RegisterModule(m);
#else
  m.attr("with_cuda") = false;
#endif
}
