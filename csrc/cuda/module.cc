#include "cuda/module.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "cuda/grouped_gemm.h"
#include "cuda/handlers.h"
#include "cuda/api.h"
#include "cuda/workspace.h"

namespace nb = nanobind;

namespace jmo::cuda {

void RegisterModule(nb::module_& m) {
  m.def("cuda_registrations", []() {
    nb::dict d;
    d["jmo_dispatch"] = nb::capsule(reinterpret_cast<void*>(JmoDispatchCuda));
    d["jmo_expert_combine"] = nb::capsule(reinterpret_cast<void*>(JmoExpertCombineCuda));
    d["jmo_dispatch_gemm"] = nb::capsule(reinterpret_cast<void*>(JmoDispatchGemmCuda));
    d["jmo_grouped_matmul"] = nb::capsule(reinterpret_cast<void*>(JmoGroupedMatmulCuda));
    d["jmo_grouped_outer"] = nb::capsule(reinterpret_cast<void*>(JmoGroupedOuterCuda));
    return d;
  });
  m.def(
      "create_cuda_workspace",
      [](int ranks, int groups, std::vector<int> ordinals, int64_t row_bytes, int64_t recv_rows, int64_t ret_rows,
         int64_t num_segments, int consumer_ctas, int sm_budget, std::optional<ModelParams> model) {
        if (ranks < 1 || groups < 1 || row_bytes < 1 || recv_rows < 0 || ret_rows < 0 || num_segments < 0)
          throw std::invalid_argument("jax_moe_overlap: invalid workspace sizes");
        WorkspaceSizes s{row_bytes, recv_rows, ret_rows, MaxBands(recv_rows, num_segments)};
        std::unique_ptr<Workspace> ws;
        Status st = Workspace::Create(ranks, groups, ordinals, s, consumer_ctas, sm_budget,
                                      model ? &*model : nullptr, &ws);
        if (!st.ok()) throw std::runtime_error(st.msg);
        return RegisterWorkspace(std::move(ws));
      },
      nb::arg("ranks"), nb::arg("groups"), nb::arg("ordinals"), nb::arg("row_bytes"), nb::arg("recv_rows"),
      nb::arg("ret_rows"), nb::arg("num_segments"), nb::arg("consumer_ctas"), nb::arg("sm_budget") = 0,
      nb::arg("model") = nb::none());
  m.def(
      "cuda_workspace_info",
      [](int64_t handle) {
        Workspace* ws = LookupWorkspace(handle);
        if (ws == nullptr) throw std::invalid_argument("jax_moe_overlap: not a live CUDA workspace handle");
        nb::dict d;
        d["min_sm_budget"] = ws->min_budget();
        d["fixed_consumer_ctas"] = ws->consumer_ctas();
        d["has_model"] = ws->has_model();
        return d;
      },
      nb::arg("handle"));
  // What the last expert_combine recorded on each rank of group `group` (RankPrivate), after synchronizing every device
  // of the group (cudaDeviceSynchronize: for benchmarks, between calls). The %globaltimer values are raw: a start of
  // 2^64 - 1 or an end of 0 means that side did nothing in the last call (or the last call was not an expert_combine:
  // every call's BeginKernel resets the spans; a group's recovery zeroes them). jax_moe_overlap/cuda_workspace.py
  // turns them into CallStats (Workspace.last_call_stats).
  m.def(
      "cuda_last_combine_records",
      [](int64_t handle, int group) {
        Workspace* ws = LookupWorkspace(handle);
        if (ws == nullptr) throw std::invalid_argument("jax_moe_overlap: not a live CUDA workspace handle");
        std::vector<RankPrivate> recs(ws->ranks());
        {
          nb::gil_scoped_release release;  // the synchronization may wait for XLA's running kernels
          for (int r = 0; r < ws->ranks(); ++r) {
            Status st = ws->ReadPrivate(group, r, nullptr, &recs[r]);
            if (!st.ok()) throw std::runtime_error(st.msg);
          }
        }
        nb::list out;
        for (const RankPrivate& p : recs) {
          nb::dict d;
          d["consumers"] = p.consumers;
          d["pushed_bytes"] = p.pushed_bytes;
          d["producer_start_ns"] = p.prod_t0;
          d["producer_end_ns"] = p.prod_t1;
          d["consumer_start_ns"] = p.cons_t0;
          d["consumer_end_ns"] = p.cons_t1;
          d["begin_ns"] = p.begin_t;
          d["last_producer_start_ns"] = p.prod_t0_last;
          d["combine_start_ns"] = p.comb_t0;
          d["combine_end_ns"] = p.comb_t1;
          out.append(d);
        }
        return out;
      },
      nb::arg("handle"), nb::arg("group") = 0);
  m.attr("cuda_tile_n") = ProducerTileN();
  m.def(
      "cuda_grouped_gemm_path",
      [](bool bf16, int64_t K, int64_t N) { return std::string(GroupedGemmPath(bf16 ? DType::kBF16 : DType::kF32, K, N)); },
      nb::arg("bf16"), nb::arg("K"), nb::arg("N"));
  m.def(
      "cuda_producer_path",
      [](bool bf16, int64_t K, int64_t N, bool transpose_rhs) {
        // With 16-byte aligned operands (XLA's buffers are): which producer kernel expert_combine runs (w [E, K, N],
        // or [E, N, K] with transpose_rhs).
        alignas(16) static char dummy[16];
        return std::string(
            ProducerPathName(SelectProducerPath(bf16 ? DType::kBF16 : DType::kF32, K, N, transpose_rhs, dummy, dummy)));
      },
      nb::arg("bf16"), nb::arg("K"), nb::arg("N"), nb::arg("transpose_rhs") = false);
}

bool IsCudaWorkspaceHandle(int64_t handle) { return handle >= kHandleBase; }
bool ReleaseCudaWorkspace(int64_t handle) { return ReleaseWorkspace(handle); }

}  // namespace jmo::cuda
