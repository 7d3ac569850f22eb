#include "cuda/handlers/module.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "common/dtype.h"
#include "cuda/api.h"
#include "cuda/gemm/engine.h"
#include "cuda/handlers/call_counts.h"
#include "cuda/handlers/handlers.h"
#include "cuda/workspace/workspace.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace jmo::cuda {

namespace {
Workspace& LiveWorkspace(int64_t handle) {
  Workspace* ws = LookupWorkspace(handle);
  if (ws == nullptr) throw std::invalid_argument("jax_moe_overlap: not a live CUDA workspace handle");
  return *ws;
}

GemmEngine EngineNamed(const std::string& name) {
  const std::optional<GemmEngine> e = GemmEngineNamed(name);
  if (!e) throw std::invalid_argument("jax_moe_overlap: no GEMM engine is named '" + name + "'");
  return *e;
}

ComputeCapability Capability(std::tuple<int, int> cc) { return {std::get<0>(cc), std::get<1>(cc)}; }

// A GEMM's operands as Python describes them (aligned addresses, as XLA's buffers are).
GemmOperands Operands(const std::string& dtype, int64_t M, int64_t K, int64_t N, bool transpose_rhs, bool swiglu,
                      bool outer, bool swiglu_grad) {
  if (swiglu && swiglu_grad)
    throw std::invalid_argument("jax_moe_overlap: a GEMM has one epilogue: swiglu or swiglu_grad, not both");
  GemmOperands o{DType::kF32, outer ? GemmForm::kOuter : GemmForm::kRows, M, K, N, transpose_rhs,
                 swiglu ? GemmEpilogue::kSwiGlu : swiglu_grad ? GemmEpilogue::kSwiGluGrad : GemmEpilogue::kNone};
  if (!DTypeNamed(dtype, &o.dtype))
    throw std::invalid_argument("jax_moe_overlap: dtype '" + dtype + "' is none of " + DTypeNames());
  return o;
}

std::optional<std::string> Text(const char* why) {
  return why != nullptr ? std::optional<std::string>(why) : std::nullopt;
}

// The XLA:CUDA handlers by custom call target.
struct Target {
  const char* name;
  XLA_FFI_Handler* handler;
};
constexpr Target kTargets[] = {{"jmo_dispatch", JmoDispatchCuda},
                               {"jmo_expert_combine", JmoExpertCombineCuda},
                               {"jmo_dispatch_gemm", JmoDispatchGemmCuda},
                               {"jmo_exchange_counts", JmoExchangeCountsCuda},
                               {"jmo_gather_rs", JmoGatherRsCuda},
                               {"jmo_grouped_matmul", JmoGroupedMatmulCuda},
                               {"jmo_grouped_outer", JmoGroupedOuterCuda},
                               {"jmo_grouped_matmul_swiglu", JmoGroupedMatmulSwiGluCuda},
                               {"jmo_grouped_matmul_swiglu_grad", JmoGroupedMatmulSwiGluGradCuda},
                               {"jmo_grouped_matmul_fp8", JmoGroupedMatmulFp8Cuda},
                               {"jmo_grouped_outer_fp8", JmoGroupedOuterFp8Cuda},
                               {"jmo_quantize_columns_fp8", JmoQuantizeColumnsFp8Cuda},
                               {"jmo_quantize_weight_fp8", JmoQuantizeWeightFp8Cuda},
                               {"jmo_swiglu_backward_fp8", JmoSwiGluBackwardFp8Cuda},
                               {"jmo_swiglu_forward_fp8", JmoSwiGluForwardFp8Cuda},
                               {"jmo_grouped_matmul_swiglu_fp8", JmoGroupedMatmulSwiGluFp8Cuda}};

// The traits a handler declares to XLA, read as XLA reads them when it registers the handler: a call frame carrying
// only the metadata extension, which the handler fills in without running anything (no device needed).
uint32_t DeclaredTraits(XLA_FFI_Handler* handler) {
  XLA_FFI_Metadata metadata{};
  metadata.struct_size = XLA_FFI_Metadata_STRUCT_SIZE;
  metadata.api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
  XLA_FFI_Metadata_Extension extension{};
  extension.extension_base = {XLA_FFI_Metadata_Extension_STRUCT_SIZE, XLA_FFI_Extension_Metadata, nullptr};
  extension.metadata = &metadata;
  XLA_FFI_CallFrame frame{};
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.extension_start = &extension.extension_base;
  frame.stage = XLA_FFI_ExecutionStage_EXECUTE;
  frame.args.struct_size = XLA_FFI_Args_STRUCT_SIZE;
  frame.rets.struct_size = XLA_FFI_Rets_STRUCT_SIZE;
  frame.attrs.struct_size = XLA_FFI_Attrs_STRUCT_SIZE;
  // (The structs come from the headers the handlers were built with, so the metadata path returns no error, which
  // would need the XLA API this frame does not carry.)
  if (handler(&frame) != nullptr) throw std::runtime_error("jax_moe_overlap: a handler refused its metadata query");
  return metadata.traits;
}
}  // namespace

void RegisterModule(nb::module_& m) {
  m.def("cuda_registrations", []() {
    nb::dict d;
    for (const Target& t : kTargets) d[t.name] = nb::capsule(reinterpret_cast<void*>(t.handler));
    return d;
  });
  // {custom call target: the XLA_FFI_Handler_Traits its handler declares}, and the bit of the command-buffer trait
  // (XLA may trace the call into a CUDA graph).
  m.def("cuda_handler_traits", []() {
    nb::dict d;
    for (const Target& t : kTargets) d[t.name] = DeclaredTraits(t.handler);
    return d;
  });
  m.attr("ffi_trait_command_buffer_compatible") =
      static_cast<uint32_t>(XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
  // process, here, prefix: a workspace whose groups span processes (workspace.h's Sharing; process[g * ranks + r]
  // owns rank r of group g, ordinals of other processes' ranks are -1): this process's part, completed by
  // open_cuda_workspace_peers once every process has created its own (jax_moe_overlap/workspace_cuda.py).
  m.def(
      "create_cuda_workspace",
      [](int ranks, int groups, std::vector<int> ordinals, int64_t row_bytes, int64_t recv_rows, int64_t ret_rows,
         int64_t num_segments, int consumer_ctas, int sm_budget, std::optional<ModelParams> model,
         std::optional<std::vector<int>> process, int here, std::string prefix) {
        if (ranks < 1 || groups < 1 || row_bytes < 1 || recv_rows < 0 || ret_rows < 0 || num_segments < 0)
          throw std::invalid_argument("jax_moe_overlap: invalid workspace sizes");
        WorkspaceSizes s{row_bytes, recv_rows, ret_rows, MaxBands(recv_rows, num_segments)};
        std::optional<Sharing> sharing;
        if (process) sharing = Sharing{*process, here, prefix};
        std::unique_ptr<Workspace> ws;
        Status st = Workspace::Create(ranks, groups, ordinals, s, consumer_ctas, sm_budget,
                                      model ? &*model : nullptr, &ws, sharing ? &*sharing : nullptr);
        if (!st.ok()) throw std::runtime_error(st.msg);
        return RegisterWorkspace(std::move(ws));
      },
      nb::arg("ranks"), nb::arg("groups"), nb::arg("ordinals"), nb::arg("row_bytes"), nb::arg("recv_rows"),
      nb::arg("ret_rows"), nb::arg("num_segments"), nb::arg("consumer_ctas"), nb::arg("sm_budget") = 0,
      nb::arg("model") = nb::none(), nb::arg("process") = nb::none(), nb::arg("here") = -1,
      nb::arg("prefix") = "");
  // The exports of this process's ranks of a shared workspace, by g * ranks + r: (IPC handle bytes, PCI bus id),
  // (b"", "") for the ranks of other processes.
  m.def(
      "export_cuda_workspace_blocks",
      [](int64_t handle) {
        std::vector<BlockExport> ex;
        Status st = LiveWorkspace(handle).ExportHandles(&ex);
        if (!st.ok()) throw std::runtime_error(st.msg);
        nb::list out;
        for (const BlockExport& e : ex)
          out.append(nb::make_tuple(nb::bytes(e.ipc_handle.data(), e.ipc_handle.size()), e.pci_bus_id));
        return out;
      },
      nb::arg("handle"));
  m.def(
      "open_cuda_workspace_peers",
      [](int64_t handle, const std::vector<std::tuple<nb::bytes, std::string>>& peers) {
        std::vector<BlockExport> ex;
        for (const auto& [h, bus] : peers) ex.push_back(BlockExport{std::string(h.c_str(), h.size()), bus});
        Workspace& ws = LiveWorkspace(handle);
        Status st;
        {
          nb::gil_scoped_release release;
          st = ws.OpenPeers(ex);
        }
        if (!st.ok()) throw std::runtime_error(st.msg);
      },
      nb::arg("handle"), nb::arg("peers"));
  m.def("unlink_cuda_workspace_names", [](int64_t handle) { LiveWorkspace(handle).UnlinkOwn(); }, nb::arg("handle"));
  m.def(
      "cuda_workspace_info",
      [](int64_t handle) {
        Workspace* ws = &LiveWorkspace(handle);
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
  // every call's BeginKernel resets the spans; a group's recovery zeroes them). jax_moe_overlap/workspace_cuda.py
  // turns them into CallStats (Workspace.last_call_stats).
  m.def(
      "cuda_last_combine_records",
      [](int64_t handle, int group) {
        Workspace* ws = &LiveWorkspace(handle);
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
          d["expert_kernel_start_ns"] = p.entry_t;
          d["last_producer_start_ns"] = p.prod_t0_last;
          d["combine_start_ns"] = p.comb_t0;
          d["combine_end_ns"] = p.comb_t1;
          out.append(d);
        }
        return out;
      },
      nb::arg("handle"), nb::arg("group") = 0);
  // Per group of the workspace: the text of its recorded failure ("" where the group is not aborted), read from the
  // group's host memory alone, so it also answers after a call inside a CUDA graph stopped the device (when every
  // CUDA call of the process fails). timeout_ms words a record that does not hold its own bound.
  m.def(
      "cuda_workspace_failures",
      [](int64_t handle, int64_t timeout_ms) {
        Workspace& ws = LiveWorkspace(handle);
        std::vector<std::string> out;
        for (int g = 0; g < ws.groups(); ++g) out.push_back(ws.FailureText(g, timeout_ms));
        return out;
      },
      nb::arg("handle"), nb::arg("timeout_ms") = 0);
  // {custom call target: (host runs of its handler, of which traced into a CUDA graph)} since the process started
  // (handlers/call_counts.h).
  m.def("cuda_handler_calls", []() {
    nb::dict d;
    for (const HandlerCalls& c : HandlerCallCounts()) d[c.target] = nb::make_tuple(c.calls, c.captured);
    return d;
  });
  m.attr("cuda_tile_n") = ProducerTileN();
  // The GEMM engine selection of every op (cuda/gemm/engine.h), for jax_moe_overlap/engines.py, the tests and the
  // benchmarks: the engine a GEMM of these operands takes on a device of compute capability (major, minor), or None
  // where none does; and why an engine refuses a device or operands (None: it does not). A GEMM is lhs [M, K] @ w
  // [K, N] per group (w stored [N, K] with transpose_rhs; swiglu: the SwiGLU epilogue, N = 2F; swiglu_grad: the
  // SwiGLU-gradient epilogue, N = F), or with outer lhs[rows]^T @ rhs[rows] -> [K, N]; M is any row count >= 1 where
  // the caller does not know it yet.
  m.def(
      "select_gemm_engine",
      [](std::tuple<int, int> cc, const std::string& dtype, int64_t K, int64_t N, bool transpose_rhs, bool swiglu,
         bool outer, int64_t M, bool swiglu_grad) -> std::optional<std::string> {
        const std::optional<GemmEngine> e =
            SelectGemmEngine(Capability(cc), Operands(dtype, M, K, N, transpose_rhs, swiglu, outer, swiglu_grad));
        return e ? std::optional<std::string>(GemmEngineName(*e)) : std::nullopt;
      },
      nb::arg("compute_capability"), nb::arg("dtype"), nb::arg("K"), nb::arg("N"), nb::arg("transpose_rhs") = false,
      nb::arg("swiglu") = false, nb::arg("outer") = false, nb::arg("M") = 1, nb::arg("swiglu_grad") = false);
  m.def(
      "gemm_engine_device_refusal",
      [](const std::string& engine, std::tuple<int, int> cc) {
        return Text(GemmEngineDeviceRefusal(EngineNamed(engine), Capability(cc)));
      },
      nb::arg("engine"), nb::arg("compute_capability"));
  m.def(
      "fp8_gemm_device_refusal",
      [](std::tuple<int, int> cc) { return Text(Fp8GroupedGemmDeviceRefusal(Capability(cc))); },
      nb::arg("compute_capability"));
  m.def(
      "fp8_dispatch_gemm_operand_refusal",
      [](int64_t d_model, int64_t n) { return Text(Fp8DispatchGemmOperandRefusal(d_model, n)); }, nb::arg("d_model"),
      nb::arg("N"));
  m.def(
      "gemm_engine_operand_refusal",
      [](const std::string& engine, const std::string& dtype, int64_t K, int64_t N, bool transpose_rhs, bool swiglu,
         bool outer, int64_t M, bool swiglu_grad) {
        const GemmOperands o = Operands(dtype, M, K, N, transpose_rhs, swiglu, outer, swiglu_grad);
        return Text(GemmEngineOperandRefusal(EngineNamed(engine), o));
      },
      nb::arg("engine"), nb::arg("dtype"), nb::arg("K"), nb::arg("N"), nb::arg("transpose_rhs") = false,
      nb::arg("swiglu") = false, nb::arg("outer") = false, nb::arg("M") = 1, nb::arg("swiglu_grad") = false);
}

bool IsCudaWorkspaceHandle(int64_t handle) { return handle >= kHandleBase; }
bool ReleaseCudaWorkspace(int64_t handle) { return ReleaseWorkspace(handle); }

}  // namespace jmo::cuda
