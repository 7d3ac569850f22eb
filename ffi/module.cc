// The nanobind extension `jax_moe_overlap._jmo`: FFI handler capsules and workspace management.
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "cpu/handlers_cpu.h"
#include "cpu/workspace_cpu.h"
#include "jax_moe_overlap/protocol.h"

#ifdef JMO_WITH_CUDA
#include "cuda/module_cuda.h"
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

}  // namespace

NB_MODULE(_jmo, m) {
  m.doc() = "jax-moe-overlap native extension: XLA FFI handlers and peer workspaces";
  m.def("cpu_registrations", []() {
    nb::dict d;
    d["jmo_dispatch"] = Capsule(JmoDispatchCpu);
    d["jmo_expert_combine"] = Capsule(JmoExpertCombineCpu);
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
#ifdef JMO_WITH_CUDA
  m.attr("with_cuda") = true;
  jmo::cuda::RegisterModule(m);
#else
  m.attr("with_cuda") = false;
#endif
}
