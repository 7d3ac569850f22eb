#include "cuda/module_cuda.h"

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "cpu/workspace_cpu.h"
#include "cuda/grouped_gemm.h"
#include "cuda/handlers_cuda.h"
#include "cuda/kernels.h"
#include "cuda/workspace_cuda.h"

namespace nb = nanobind;

namespace jmo::cuda {

void RegisterModule(nb::module_& m) {
  m.def("cuda_registrations", []() {
    nb::dict d;
    d["jmo_dispatch"] = nb::capsule(reinterpret_cast<void*>(JmoDispatchCuda));
    d["jmo_expert_combine"] = nb::capsule(reinterpret_cast<void*>(JmoExpertCombineCuda));
    d["jmo_grouped_matmul"] = nb::capsule(reinterpret_cast<void*>(JmoGroupedMatmulCuda));
    d["jmo_grouped_outer"] = nb::capsule(reinterpret_cast<void*>(JmoGroupedOuterCuda));
    return d;
  });
  m.def(
      "create_cuda_workspace",
      [](int ranks, int groups, std::vector<int> ordinals, int64_t row_bytes, int64_t recv_rows, int64_t ret_rows,
         int64_t num_segments, int consumer_ctas, int sm_budget) {
        if (ranks < 1 || groups < 1 || row_bytes < 1 || recv_rows < 0 || ret_rows < 0 || num_segments < 0)
          throw std::invalid_argument("jax_moe_overlap: invalid workspace sizes");
        WorkspaceSizes s{row_bytes, recv_rows, ret_rows, MaxBands(recv_rows, num_segments)};
        std::unique_ptr<Workspace> ws;
        Status st = Workspace::Create(ranks, groups, ordinals, s, consumer_ctas, sm_budget, &ws);
        if (!st.ok()) throw std::runtime_error(st.msg);
        return RegisterWorkspace(std::move(ws));
      },
      nb::arg("ranks"), nb::arg("groups"), nb::arg("ordinals"), nb::arg("row_bytes"), nb::arg("recv_rows"),
      nb::arg("ret_rows"), nb::arg("num_segments"), nb::arg("consumer_ctas"), nb::arg("sm_budget") = 0);
  m.def(
      "cuda_grouped_gemm_path",
      [](bool bf16, int64_t K, int64_t N) { return std::string(GroupedGemmPath(bf16 ? DType::kBF16 : DType::kF32, K, N)); },
      nb::arg("bf16"), nb::arg("K"), nb::arg("N"));
  m.def(
      "cuda_producer_path",
      [](bool bf16, int64_t K, int64_t N) {
        // With 16-byte aligned operands (XLA's buffers are): which producer kernel expert_combine runs.
        alignas(16) static char dummy[16];
        return std::string(ProducerPath(bf16 ? DType::kBF16 : DType::kF32, K, N, dummy, dummy));
      },
      nb::arg("bf16"), nb::arg("K"), nb::arg("N"));
  // release_workspace(handle) from ffi/module.cc knows CPU workspaces only; CUDA handles live in their own range.
  m.attr("release_workspace") = nb::cpp_function(
      [](int64_t handle) {
        if (handle >= kHandleBase) return ReleaseWorkspace(handle);
        return jmo::cpu::ReleaseWorkspace(handle);
      },
      nb::arg("handle"), nb::name("release_workspace"), nb::scope(m));
}

}  // namespace jmo::cuda
