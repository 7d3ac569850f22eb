// _jmo_loopback: the Python face of the loopback runner (runner.h) and of a few device queries the benchmarks need.
// Arrays come in as C-contiguous host numpy arrays of any dtype (bf16 as uint16 views) and are read as bytes.
#include <cuda_runtime.h>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda/api.h"
#include "cuda/gemm/engine.h"
#include "runner.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace jmo::loopback {
namespace {

using HostArray = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;

// Error texts may carry bytes a kernel wrote (record fields): decoded with replacement, never an exception that
// would lose the case's results.
nb::str Text(const std::string& s) {
  return nb::steal<nb::str>(PyUnicode_DecodeUTF8(s.data(), (Py_ssize_t)s.size(), "replace"));
}

nb::list Texts(const std::vector<std::string>& v) {
  nb::list out;
  for (const std::string& s : v) out.append(Text(s));
  return out;
}

nb::dict MakeDict(std::initializer_list<std::pair<const char*, nb::object>> items) {
  nb::dict d;
  for (const auto& [key, value] : items) d[key] = value;
  return d;
}

template <typename T>
T Get(const nb::dict& d, const char* key, T fallback) {
  return d.contains(key) ? nb::cast<T>(d[key]) : fallback;
}

Bytes ArrayBytes(const nb::dict& d, const char* key, std::vector<HostArray>* keep) {
  if (!d.contains(key)) return Bytes{};
  HostArray a = nb::cast<HostArray>(d[key]);
  keep->push_back(a);
  return Bytes{a.data(), a.nbytes()};
}

Spec ParseSpec(const nb::dict& d) {
  Spec s;
  s.ranks = Get<int>(d, "ranks", s.ranks);
  s.tokens = Get<int>(d, "tokens", s.tokens);
  s.top_k = Get<int>(d, "top_k", s.top_k);
  s.experts_per_rank = Get<int>(d, "experts_per_rank", s.experts_per_rank);
  s.d_model = Get<int>(d, "d_model", s.d_model);
  s.k_dim = Get<int>(d, "k_dim", s.k_dim);
  s.n_dim = Get<int>(d, "n_dim", s.n_dim);
  s.cap = Get<int>(d, "cap", s.cap);
  s.f32 = Get<bool>(d, "f32", s.f32);
  s.transpose_rhs = Get<bool>(d, "transpose_rhs", s.transpose_rhs);
  s.fp8 = Get<bool>(d, "fp8", s.fp8);
  s.iters = Get<int>(d, "iters", s.iters);
  s.timeout_at = Get<int>(d, "timeout_at", s.timeout_at);
  s.timeout_ms = Get<int64_t>(d, "timeout_ms", s.timeout_ms);
  s.short_timeout_ms = Get<int64_t>(d, "short_timeout_ms", s.short_timeout_ms);
  s.stuck_stream_ms = Get<int64_t>(d, "stuck_stream_ms", s.stuck_stream_ms);
  s.delay_rank = Get<int>(d, "delay_rank", s.delay_rank);
  s.delay_us = Get<int64_t>(d, "delay_us", s.delay_us);
  s.consumers = Get<int>(d, "consumers", s.consumers);
  s.serialize = Get<bool>(d, "serialize", s.serialize);
  s.tuning.bulk_copy = Get<bool>(d, "bulk_copy", s.tuning.bulk_copy);
  s.tuning.push_slots = Get<int32_t>(d, "push_slots", s.tuning.push_slots);
  s.tuning.push_read_lag = Get<int32_t>(d, "push_read_lag", s.tuning.push_read_lag);
  s.tuning.push_issuers = Get<int32_t>(d, "push_issuers", s.tuning.push_issuers);
  s.sm_budget = Get<int>(d, "sm_budget", s.sm_budget);
  s.device = Get<int>(d, "device", s.device);
  s.dispatch_gemm_pushers = Get<int>(d, "dispatch_gemm_pushers", s.dispatch_gemm_pushers);
  if (d.contains("dg_sweep") && !d["dg_sweep"].is_none()) s.dg_sweep = nb::cast<std::vector<int>>(d["dg_sweep"]);
  s.dg_mode = Get<int>(d, "dg_mode", s.dg_mode);
  s.dg_out_bf16 = Get<bool>(d, "dg_out_bf16", s.dg_out_bf16);
  s.row_scale = Get<bool>(d, "row_scale", s.row_scale);
  s.emulated_link_gbps = Get<double>(d, "emulated_link_gbps", s.emulated_link_gbps);
  s.producer_band_m = Get<int>(d, "producer_band_m", s.producer_band_m);
  s.producer_order = Get<int>(d, "producer_order", s.producer_order);
  s.x_recv_from_tiles = Get<bool>(d, "x_recv_from_tiles", s.x_recv_from_tiles);
  s.gather_rs = Get<bool>(d, "gather_rs", s.gather_rs);
  s.time = Get<bool>(d, "time", s.time);
  s.warmup = Get<int>(d, "warmup", s.warmup);
  s.reps = Get<int>(d, "reps", s.reps);
  s.per_call_stats = Get<bool>(d, "per_call_stats", s.per_call_stats);
  s.gemm_alone = Get<bool>(d, "gemm_alone", s.gemm_alone);
  s.decision_iters = Get<int>(d, "decision_iters", s.decision_iters);
  if (d.contains("model") && !d["model"].is_none()) {
    std::vector<double> m = nb::cast<std::vector<double>>(d["model"]);
    if (m.size() < 9 || m.size() > 11)
      throw nb::value_error("model takes the 11 ModelParams numbers (resource_model.h order; 10: gather_gbps 0; 9: "
                            "pusher_gbps 0 too)");
    s.has_model = true;
    s.model = ModelParams{(int32_t)m[0], (int32_t)m[1], (int32_t)m[2], (int32_t)m[3], m[4], m[5], m[6], m[7], m[8],
                          m.size() > 9 ? m[9] : 0.0, m.size() > 10 ? m[10] : 0.0};
  }
  if (d.contains("variants"))
    for (auto [c, ser] : nb::cast<std::vector<std::tuple<int, bool>>>(d["variants"])) s.variants.push_back({c, ser});
  return s;
}

RankInputs ParseInputs(const nb::dict& d, std::vector<HostArray>* keep) {
  RankInputs in;
  in.x = ArrayBytes(d, "x", keep);
  in.slot_src_row = ArrayBytes(d, "slot_src_row", keep);
  in.slot_dest_rank = ArrayBytes(d, "slot_dest_rank", keep);
  in.slot_dest_row = ArrayBytes(d, "slot_dest_row", keep);
  in.slot_ret_row = ArrayBytes(d, "slot_ret_row", keep);
  in.recv_rows = nb::cast<int32_t>(d["recv_rows"]);
  in.ret_rows = nb::cast<int32_t>(d["ret_rows"]);
  in.lhs = ArrayBytes(d, "lhs", keep);
  in.w = ArrayBytes(d, "w", keep);
  in.lhs_scales = ArrayBytes(d, "lhs_scales", keep);
  in.w_scales = ArrayBytes(d, "w_scales", keep);
  in.gates = ArrayBytes(d, "gates", keep);
  in.seg_rows = ArrayBytes(d, "seg_rows", keep);
  in.seg_ret_off = ArrayBytes(d, "seg_ret_off", keep);
  in.w1 = ArrayBytes(d, "w1", keep);
  in.w1_scales = ArrayBytes(d, "w1_scales", keep);
  in.x_recv_q = ArrayBytes(d, "x_recv_q", keep);
  in.x_recv_s = ArrayBytes(d, "x_recv_s", keep);
  in.expert_rows = ArrayBytes(d, "expert_rows", keep);
  in.send_order = ArrayBytes(d, "send_order", keep);
  in.send_start = ArrayBytes(d, "send_start", keep);
  in.row_gate = ArrayBytes(d, "row_gate", keep);
  in.token_rows = ArrayBytes(d, "token_rows", keep);
  in.slot_primary = ArrayBytes(d, "slot_primary", keep);
  return in;
}

nb::bytes ToBytes(const std::vector<char>& v) { return nb::bytes(v.data(), v.size()); }

nb::dict DeviceRecord(const cuda::RankPrivate& q) {
  return MakeDict({{"consumers", nb::cast(q.consumers)}, {"begin_t", nb::cast(q.begin_t)},
                   {"prod_t0", nb::cast(q.prod_t0)}, {"prod_t1", nb::cast(q.prod_t1)},
                   {"prod_t0_last", nb::cast(q.prod_t0_last)}, {"cons_t0", nb::cast(q.cons_t0)},
                   {"cons_t1", nb::cast(q.cons_t1)}, {"comb_t0", nb::cast(q.comb_t0)}, {"comb_t1", nb::cast(q.comb_t1)},
                   {"pushed_bytes", nb::cast(q.pushed_bytes)}, {"push_t1", nb::cast(q.push_t1)},
                   {"pushers", nb::cast(q.pushers)}, {"gemm_wait_ns", nb::cast(q.gemm_wait_ns)},
                   {"gemm_wait_own_ns", nb::cast(q.gemm_wait_own_ns)}, {"gemm_stall_ns", nb::cast(q.gemm_stall_ns[0])},
                   {"gemm_stall_first_ns", nb::cast(q.gemm_stall_ns[1])},
                   {"phase_b_t0", nb::cast(q.phase_b_t0)},
                   {"ctas", nb::cast(q.ctas)}, {"entry_t", nb::cast(q.entry_t)}});
}

nb::dict ToDict(const Result& r) {
  nb::list digests, first, timeout, timed, dg_us;
  for (const CallDigest& c : r.digests)
    digests.append(nb::make_tuple(c.iter, c.rank, c.dataset, c.recv, c.y, c.slot, c.a, c.pre));
  for (const auto& set : r.first) {
    nb::list ranks;
    for (const FirstOutputs& f : set)
      ranks.append(MakeDict({{"recv", nb::cast(ToBytes(f.recv))}, {"y", nb::cast(ToBytes(f.y))},
                             {"slot", nb::cast(ToBytes(f.slot))}, {"a", nb::cast(ToBytes(f.a))},
                             {"pre", nb::cast(ToBytes(f.pre))}, {"recv2", nb::cast(ToBytes(f.recv2))},
                             {"a2", nb::cast(ToBytes(f.a2))}, {"pre2", nb::cast(ToBytes(f.pre2))}}));
    first.append(ranks);
  }
  for (const TimeoutReport& t : r.timeout)
    timeout.append(MakeDict({{"reported", nb::cast(t.reported)}, {"code", nb::cast(t.code)},
                             {"msg", Text(t.msg)}, {"stuck_reported", nb::cast(t.stuck_reported)},
                             {"stuck_code", nb::cast(t.stuck_code)}, {"stuck_msg", Text(t.stuck_msg)},
                             {"stuck_ms", nb::cast(t.stuck_ms)}}));
  for (const auto& variant : r.timed) {
    nb::list ranks;
    for (const RankTiming& t : variant) {
      nb::list dev;
      for (const cuda::RankPrivate& q : t.device) dev.append(DeviceRecord(q));
      ranks.append(MakeDict({{"call_us", nb::cast(t.call_us)}, {"device", nb::cast(dev)},
                             {"y_after", nb::cast(t.y_after)}}));
    }
    timed.append(ranks);
  }
  for (const auto& v : r.dg_us) dg_us.append(nb::cast(v));
  nb::list dg_device;
  for (const cuda::RankPrivate& q : r.dg_device) dg_device.append(DeviceRecord(q));
  return MakeDict({{"errors", Texts(r.errors)}, {"calls", nb::cast(r.calls)}, {"digests", nb::cast(digests)},
                   {"first", nb::cast(first)}, {"timeout", nb::cast(timeout)}, {"timed", nb::cast(timed)},
                   {"dg_us", nb::cast(dg_us)}, {"dg_device", nb::cast(dg_device)}, {"gemm_us", nb::cast(r.gemm_us)},
                   {"pushers", nb::cast(r.pushers)}, {"dg_sweep_us", nb::cast(r.dg_sweep_us)},
                   {"dg_sweep_pushers", nb::cast(r.dg_sweep_pushers)}, {"table_ns", nb::cast(r.table_ns)},
                   {"decision_ns", nb::cast(r.decision_ns)}, {"decision_choice", nb::cast(r.decision_choice)},
                   {"budget", nb::cast(r.budget)}, {"producer", nb::cast(r.producer)},
                   {"consumer_policy", nb::cast(r.consumer_policy)}, {"fixed_consumers", nb::cast(r.fixed_consumers)},
                   {"seconds", nb::cast(r.seconds)}});
}

nb::dict RunRanksPy(const nb::dict& spec, const nb::list& data) {
  const Spec s = ParseSpec(spec);
  std::vector<HostArray> keep;
  std::vector<std::vector<RankInputs>> inputs;
  for (nb::handle set : data) {
    std::vector<RankInputs> ranks;
    for (nb::handle rank : nb::cast<nb::list>(set)) ranks.push_back(ParseInputs(nb::cast<nb::dict>(rank), &keep));
    inputs.push_back(std::move(ranks));
  }
  Result r;
  {
    nb::gil_scoped_release release;
    r = RunRanks(s, inputs);
  }
  return ToDict(r);
}

// (number of CUDA devices, "" or why none can be used).
std::tuple<int, std::string> DeviceCount() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return {0, cudaGetErrorString(e)};
  return {n, n ? "" : "no CUDA device"};
}

nb::dict DeviceInfo(int device, int64_t k_dim, int64_t n_dim, bool transpose_rhs) {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess || cudaSetDevice(device) != cudaSuccess)
    throw std::runtime_error("cannot query CUDA device " + std::to_string(device));
  // The producer engine (and its tile) that bf16 calls of k_dim x n_dim take on this device (aligned operands).
  const cuda::GemmEngine engine = cuda::SelectGemmEngine(
      cuda::ComputeCapability{prop.major, prop.minor},
      {DType::kBF16, cuda::GemmForm::kRows, 1, k_dim, n_dim, transpose_rhs, cuda::GemmEpilogue::kNone}).value();
  int tile_m = 0, tile_n = 0;
  cuda::ProducerTile(engine, &tile_m, &tile_n);
  return MakeDict({{"kind", nb::cast("device")}, {"name", nb::cast(std::string(prop.name))},
                   {"sms", nb::cast(prop.multiProcessorCount)}, {"tile_m", nb::cast(tile_m)},
                   {"tile_n", nb::cast(tile_n)}, {"producer", nb::cast(std::string(cuda::GemmEngineName(engine)))},
                   {"cc", nb::cast(std::to_string(prop.major) + "." + std::to_string(prop.minor))}});
}

}  // namespace
}  // namespace jmo::loopback

NB_MODULE(_jmo_loopback, m) {
  using namespace jmo::loopback;
  m.doc() = "R ranks of the jax-moe-overlap kernels on one GPU (tools/loopback)";
  m.attr("DEADLINE_EXCEEDED") = (int)jmo::cuda::kDeadlineExceeded;
  m.def("device_count", &DeviceCount, "(CUDA devices, why none) without failing where there is no GPU");
  m.def("device_info", &DeviceInfo, "device"_a, "k_dim"_a, "n_dim"_a, "transpose_rhs"_a = false);
  m.def(
      "producer_path",
      [](bool f32, int64_t k_dim, int64_t n_dim, bool transpose_rhs) {
        namespace cuda = jmo::cuda;
        cuda::DeviceInfo info;
        if (cuda::Status s = cuda::CurrentDeviceInfo(&info); !s.ok()) throw std::runtime_error(s.msg);
        const std::optional<cuda::GemmEngine> engine = cuda::SelectGemmEngine(
            info.cc, {f32 ? jmo::DType::kF32 : jmo::DType::kBF16, cuda::GemmForm::kRows, 1, k_dim, n_dim,
                      transpose_rhs, cuda::GemmEpilogue::kNone});
        return std::string(engine ? cuda::GemmEngineName(*engine) : "none");
      },
      "f32"_a, "k_dim"_a, "n_dim"_a, "transpose_rhs"_a,
      "The producer engine of expert_combine for these operands on the current device (buffers assumed aligned)");
  m.def("copy_ceiling_us", &CopyCeilingUs, "device"_a, "bytes"_a, "reps"_a);
  m.def("run_ranks", &RunRanksPy, "spec"_a, "data"_a,
        "Runs spec's iterations over data[data set][rank] (dicts of arrays); returns what was recorded");
}
