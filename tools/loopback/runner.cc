#include "runner.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/workspace_fit.h"  // GatherRsPartialRows
#include "cuda/api.h"
#include "cuda/gemm/engine.h"
#include "cuda/ops/grouped_gemm.h"
#include "cuda/workspace/workspace.h"
#include "decision_bench.h"  // jmo::tools::MeasureDecision

namespace jmo::loopback {

using cuda::CallSite;
using jmo::DType;
using cuda::RankPrivate;
using cuda::Status;
using cuda::Workspace;

uint64_t Digest(const void* p, size_t n) {
  const unsigned char* b = static_cast<const unsigned char*>(p);
  uint64_t h = 0x243F6A8885A308D3ull ^ n;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, b + i, 8);
    h = (h ^ w) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
  }
  for (; i < n; ++i) h = (h ^ b[i]) * 0x100000001B3ull;
  return h ^ (h >> 31);
}

namespace {

#define LB_CHECK(expr)                                                                                   \
  do {                                                                                                   \
    cudaError_t e_ = (expr);                                                                             \
    if (e_ != cudaSuccess) throw std::runtime_error(std::string(#expr) + ": " + cudaGetErrorString(e_)); \
  } while (0)

// A host function that holds its stream for *(int64_t*)ms milliseconds (Spec::stuck_stream_ms).
void CUDART_CB HoldStream(void* ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(*static_cast<const int64_t*>(ms)));
}

// n bytes of p in a device allocation of at least `size` bytes, the bytes past them all `fill`.
void* ToDevice(const void* p, size_t n, size_t size = 0, int fill = 0) {
  void* d = nullptr;
  const size_t bytes = std::max<size_t>({16, n, size});
  LB_CHECK(cudaMalloc(&d, bytes));
  LB_CHECK(cudaMemset(d, fill, bytes));
  if (n) LB_CHECK(cudaMemcpy(d, p, n, cudaMemcpyHostToDevice));
  return d;
}
void* ToDevice(const Bytes& b) { return ToDevice(b.p, b.n); }
void* ToDevice(int32_t v) { return ToDevice(&v, sizeof(v)); }

// Device allocations of one run, freed together.
class DeviceArena {
 public:
  ~DeviceArena() {
    for (void* p : ptrs_) cudaFree(p);
  }
  void* Keep(void* p) {
    ptrs_.push_back(p);
    return p;
  }
  void* Alloc(size_t n) {
    void* p = nullptr;
    LB_CHECK(cudaMalloc(&p, std::max<size_t>(n, 16)));
    return Keep(p);
  }

 private:
  std::vector<void*> ptrs_;
};

struct DeviceSet {  // one data set of one rank, on the device
  void *x, *src_row, *dest_rank, *dest_row, *recv_expected, *lhs, *w, *gates, *seg_rows, *seg_ret_off, *ret_row,
      *ret_expected, *w1 = nullptr, *expert_rows = nullptr, *send_order = nullptr, *send_start = nullptr,
      *row_gate = nullptr, *token_rows = nullptr, *primary = nullptr, *lhs_scales = nullptr, *w_scales = nullptr,
      *w1_scales = nullptr, *x_recv_q = nullptr, *x_recv_s = nullptr;
};

class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  // False if the other ranks did not all arrive within `timeout` (one of them stopped early).
  bool Wait(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t gen = gen_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
      return true;
    }
    if (cv_.wait_for(lock, timeout, [&] { return gen_ != gen; })) return true;
    --arrived_;
    return false;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, arrived_ = 0;
  uint64_t gen_ = 0;
};

// The first `ranks` of the process's rank streams on `device` (the current device), created once and kept for every
// later case: each rank's calls spin on its peers', so no rank's kernel may be queued behind a peer's (it would start
// only once that one timed out). The driver maps streams onto its CUDA_DEVICE_MAX_CONNECTIONS hardware queues (run.py:
// 32) as they are created; streams created and destroyed for every case were seen to put a rank's first call behind
// a peer's waiting kernel (docs/performance.md, GPU test runs), and one set kept for the run never changes its mapping.
std::vector<cudaStream_t> RankStreams(int device, int ranks) {
  static std::mutex mu;
  static std::map<int, std::vector<cudaStream_t>> pool;
  std::lock_guard<std::mutex> lock(mu);
  std::vector<cudaStream_t>& v = pool[device];
  while ((int)v.size() < ranks) {
    cudaStream_t st;
    LB_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    v.push_back(st);
  }
  return std::vector<cudaStream_t>(v.begin(), v.begin() + ranks);
}

// Page-locked host buffer: device-to-host copies into pageable memory go through the driver's staging buffer, and a
// rank thread whose copy waits there for its own stream (itself waiting for a peer rank) blocks the peer's thread
// from copying too: a host-side deadlock.
struct Pinned {
  char* p = nullptr;
  size_t n = 0;
  explicit Pinned(size_t bytes) : n(bytes) {
    if (cudaMallocHost(&p, std::max<size_t>(bytes, 16)) != cudaSuccess) throw std::runtime_error("cudaMallocHost");
  }
  ~Pinned() { cudaFreeHost(p); }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  std::vector<char> vec() const { return std::vector<char>(p, p + n); }
  uint64_t digest() const { return Digest(p, n); }
};

// Everything the rank threads share.
class Run {
 public:
  Run(const Spec& s, const std::vector<std::vector<RankInputs>>& data, Result* res)
      : s_(s), data_(data), res_(*res), R_(s.ranks), T_(s.tokens), k_(s.top_k), E_l_(s.experts_per_rank),
        D_(s.d_model), K_(s.k_dim), N_(s.n_dim), P_(s.tokens * s.top_k), cap_(s.cap),
        eb_(Traits(s.f32 ? DType::kF32 : DType::kBF16).elem_bytes),
        dt_(s.f32 ? DType::kF32 : DType::kBF16), dg_(s.dispatch_gemm_pushers != 0), fp8_dg_(s.fp8 && dg_),
        xdt_(fp8_dg_ ? DType::kE4M3Rows : dt_), xrb_(RowBytes(xdt_, s.d_model)), barrier_(s.ranks),
        bar_timeout_(3 * s.timeout_ms + 10000) {}

  void Go() {
    LB_CHECK(cudaSetDevice(s_.device));
    const int64_t row_bytes = std::max<int64_t>((int64_t)std::max({D_, K_, N_}) * eb_, xrb_);
    // gather_rs: the ret rows also hold the R float32 partial slices of the rank's tokens (workspace.layer_sizes),
    // counted as the call counts them: in rows of its own width (N elements), not of the workspace's wider rows.
    const int64_t partials = s_.gather_rs ? GatherRsPartialRows(R_, T_, N_, (int64_t)N_ * eb_) : 0;
    WorkspaceSizes sizes{row_bytes, cap_, std::max<int64_t>(P_, partials), MaxBands(cap_, (int64_t)E_l_ * R_)};
    int sms = 0;
    LB_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, s_.device));
    // The fixed C without a model: an eighth of the SMs a rank has, as jax_moe_overlap.resource.fallback_consumer_ctas
    // gives on a GPU of one rank (here each rank has SMs / R, or the pinned budget, as Workspace::Create sets them).
    const int rank_sms = s_.sm_budget > 0 ? s_.sm_budget : std::max(2, sms / R_);
    Status st = Workspace::Create(R_, 1, std::vector<int>(R_, s_.device), sizes, std::max(1, rank_sms / 8),
                                  s_.sm_budget, s_.has_model ? &s_.model : nullptr, &ws_);
    if (!st.ok()) throw std::runtime_error("Workspace::Create: " + st.msg);
    res_.budget = ws_->budget(0, 0);
    res_.pushers = s_.dispatch_gemm_pushers > 0 ? s_.dispatch_gemm_pushers : 0;  // 0: the library's choice
    Upload();
    const size_t nd = data_.size();
    res_.first.assign(nd, std::vector<FirstOutputs>(R_));
    res_.timeout.assign(R_, TimeoutReport{});
    res_.timed.assign(s_.variants.size(), std::vector<RankTiming>(R_));
    for (auto& v : res_.dg_us) v.assign(R_, {});
    res_.dg_device.assign(R_, RankPrivate{});
    res_.dg_sweep_us.assign(s_.dg_sweep.size(), std::vector<std::vector<double>>(R_));
    res_.dg_sweep_pushers.assign(s_.dg_sweep.size(), std::vector<int>(R_, 0));
    res_.gemm_us.assign(R_, {});
    have_first_.assign(nd * R_, 0);
    first_launch_.assign(R_, FirstLaunch{});

    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> threads;
    for (int r = 0; r < R_; ++r) threads.emplace_back([this, r] { RankMain(r); });
    for (auto& t : threads) t.join();
    res_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    res_.calls = calls_;

    if (s_.decision_iters > 0 && s_.has_model && !stop_) {
      CallOptions o{};
      o.emulated_link_gbps = s_.emulated_link_gbps;  // the model of the case's calls
      CallSite c{ws_.get(), 0, 0, streams_[0], o};
      const DeviceSet& d = dsets_[0][0];
      Status s = tools::MeasureDecision(c, (const int32_t*)d.seg_rows, (const int32_t*)d.seg_ret_off, E_l_, cap_,
                                        K_, N_, dt_, s_.decision_iters, &res_.table_ns, &res_.decision_ns,
                                        &res_.decision_choice, s_.gather_rs ? T_ : 0, s_.gather_rs ? k_ : 0);
      if (!s.ok()) Fail("decision benchmark: " + s.msg);
    }
    // The engine of the expert_combine calls (cudaMalloc'ed operands: out_y_[0] stands for their alignment).
    cuda::DeviceInfo info;
    if (Status s = cuda::GetDeviceInfo(s_.device, &info); !s.ok()) Fail("device info: " + s.msg);
    const std::optional<cuda::GemmEngine> engine = cuda::SelectGemmEngine(
        info.cc, {dt_, cuda::GemmForm::kRows, cap_, K_, N_, s_.transpose_rhs, cuda::GemmEpilogue::kNone, out_y_[0],
                  out_y_[0]});
    res_.producer = s_.fp8 ? "wgmma e4m3" : engine ? cuda::GemmEngineName(*engine) : "none";
    if (s_.fp8 || engine)  // (the e4m3 producer is the wgmma engine's tile: LaunchExpertOperator)
      res_.consumer_policy = cuda::ConsumerPolicyName(
          cuda::SelectConsumerPolicy(*ws_, CallOptions{}, s_.fp8 ? cuda::GemmEngine::kWgmma : *engine));
    res_.fixed_consumers = cuda::FixedConsumerCtas(
        *ws_, res_.budget, s_.fp8 ? cuda::GemmEngine::kWgmma : engine.value_or(cuda::GemmEngine::kSimt), s_.gather_rs);
    streams_.clear();  // (kept for the next case: RankStreams)
    for (cudaEvent_t e : first_ready_) cudaEventDestroy(e);
    first_ready_.clear();
    ws_.reset();
    LB_CHECK(cudaGetLastError());
  }

 private:
  void Fail(const std::string& m) {
    std::lock_guard<std::mutex> lock(mu_);
    if (res_.errors.size() < 20) res_.errors.push_back(m);
    stop_ = true;
  }
  // A failure of the first or second iteration (a failure on the device is reported by the rank's next call) also
  // says when that rank's first call was launched, on the host, after the barrier released the ranks, and when its
  // stream reached that call on the device, after the first rank's did (first_ready_): a launch that began or ended
  // seconds late tells a rank thread held up on the host, a stream that reached the call seconds late one held up on
  // the device, from a kernel that waited (a rank whose first call begins after its group failed does nothing).
  std::string Where(int r, int it) const {
    std::string w = "rank " + std::to_string(r) + " iter " + std::to_string(it);
    const FirstLaunch& f = first_launch_[r];
    if (it > 1 || f.end.time_since_epoch().count() == 0) return w;
    auto ms = [&](std::chrono::steady_clock::time_point t) {
      char b[32];
      std::snprintf(b, sizeof(b), "%.1f", std::chrono::duration<double, std::milli>(t - f.released).count());
      return std::string(b);
    };
    w += " (its first call launched " + ms(f.begin) + " .. " + ms(f.end) + " ms after the barrier";
    // The device side: this rank's event against every rank's, each recorded before its first dispatch (NotReady:
    // a rank that has not got that far, or whose stream has not).
    float behind = 0.0f;
    for (int q = 0; q < R_; ++q) {
      float d = 0.0f;
      if (cudaEventElapsedTime(&d, first_ready_[q], first_ready_[r]) != cudaSuccess) {
        (void)cudaGetLastError();
        return w + ")";
      }
      behind = std::max(behind, d);
    }
    char b[64];
    std::snprintf(b, sizeof(b), "; its stream reached it %.1f ms after the first rank's)", behind);
    return w + b;
  }

  void Upload() {
    dsets_.assign(data_.size(), std::vector<DeviceSet>(R_));
    for (size_t ds = 0; ds < data_.size(); ++ds)
      for (int r = 0; r < R_; ++r) {
        const RankInputs& in = data_[ds][r];
        DeviceSet& d = dsets_[ds][r];
        d.x = mem_.Keep(ToDevice(in.x));
        d.src_row = mem_.Keep(ToDevice(in.slot_src_row));
        d.dest_rank = mem_.Keep(ToDevice(in.slot_dest_rank));
        d.dest_row = mem_.Keep(ToDevice(in.slot_dest_row));
        d.recv_expected = mem_.Keep(ToDevice(in.recv_rows));
        d.primary = in.slot_primary.n > 0 ? mem_.Keep(ToDevice(in.slot_primary)) : nullptr;
        // Padding rows NaN (all bits set: NaN in bfloat16, float32 and e4m3).
        d.lhs = mem_.Keep(ToDevice(in.lhs.p, in.lhs.n, (size_t)cap_ * K_ * (s_.fp8 ? 1 : eb_), 0xFF));
        d.w = mem_.Keep(ToDevice(in.w));
        if (s_.fp8) {
          d.lhs_scales = mem_.Keep(ToDevice(in.lhs_scales));
          d.w_scales = mem_.Keep(ToDevice(in.w_scales));
        }
        d.gates = mem_.Keep(ToDevice(in.gates));
        d.seg_rows = mem_.Keep(ToDevice(in.seg_rows));
        d.seg_ret_off = mem_.Keep(ToDevice(in.seg_ret_off));
        d.ret_row = mem_.Keep(ToDevice(in.slot_ret_row));
        d.ret_expected = mem_.Keep(ToDevice(in.ret_rows));
        d.expert_rows = mem_.Keep(ToDevice(in.expert_rows));
        if (s_.gather_rs) {
          d.row_gate = mem_.Keep(ToDevice(in.row_gate));
          d.token_rows = mem_.Keep(ToDevice(in.token_rows));
        }
        if (dg_) {
          d.w1 = mem_.Keep(ToDevice(in.w1));
          d.send_order = mem_.Keep(ToDevice(in.send_order));
          d.send_start = mem_.Keep(ToDevice(in.send_start));
        }
        if (fp8_dg_) {  // (the two calls' GEMM1 operands: the recv rows unpacked; padding rows NaN)
          d.w1_scales = mem_.Keep(ToDevice(in.w1_scales));
          d.x_recv_q = mem_.Keep(ToDevice(in.x_recv_q.p, in.x_recv_q.n, (size_t)cap_ * D_, 0xFF));
          d.x_recv_s = mem_.Keep(ToDevice(in.x_recv_s));
        }
      }
    streams_ = RankStreams(s_.device, R_);
    first_ready_.resize(R_);
    for (auto& e : first_ready_) LB_CHECK(cudaEventCreate(&e));
    out_recv_.assign(R_, nullptr);
    out_y_ = out_slot_ = out_a_ = out_a2_ = out_pre_ = out_pre2_ = out_recv2_ = out_gemm2_ = rank_op_ = group_op_ =
        out_recv_;
    for (int r = 0; r < R_; ++r) {
      out_recv_[r] = mem_.Alloc(RecvBytes());
      out_y_[r] = mem_.Alloc((size_t)T_ * N_ * eb_);
      out_slot_[r] = mem_.Alloc(SlotBytes());
      if (dg_) {  // out_*2: the same dispatch and GEMM1 as two calls, for comparison
        out_a_[r] = mem_.Alloc(GemmOutBytes());
        out_a2_[r] = mem_.Alloc(GemmOutBytes());
        out_pre_[r] = mem_.Alloc(PreBytes());
        out_pre2_[r] = mem_.Alloc(fp8_dg_ && Swiglu() ? Fp8PreBytes() : PreBytes());  // (FP8: a always written)
        out_recv2_[r] = mem_.Alloc(RecvBytes());
      }
      if (s_.gemm_alone && !dg_) out_gemm2_[r] = mem_.Alloc((size_t)cap_ * N_ * eb_);  // GEMM2 alone's output
      rank_op_[r] = mem_.Keep(ToDevice(r));
      group_op_[r] = mem_.Keep(ToDevice(0));
    }
  }

  // The slot output: expert_combine's [P, N] slot rows, or gather_rs's [cap, N] GEMM rows.
  size_t SlotBytes() const { return (size_t)(s_.gather_rs ? cap_ : P_) * N_ * eb_; }

  // dispatch_gemm's modes (Spec::dg_mode): its SwiGLU epilogue, and which results it keeps.
  bool Swiglu() const { return s_.dg_mode != 0; }
  bool KeepRecv() const { return s_.dg_mode != 2; }
  bool KeepPre() const { return s_.dg_mode == 1; }
  // GEMM1's output: float32 [cap, K] (dg_out_bf16: bf16), or with the SwiGLU h [cap, K / 2] bf16; the preactivation
  // float32 [cap, K].
  // FP8 with the SwiGLU: h_q [cap, K / 2] e4m3 then h's scales [cap, K / 256] float32 in one buffer, and a_q
  // [cap, K] then a's scales [cap, K / 128] (tools/loopback/check.py splits them).
  size_t GemmOutBytes() const {
    if (!Swiglu()) return (size_t)cap_ * K_ * (s_.dg_out_bf16 ? 2 : 4);
    return fp8_dg_ ? (size_t)cap_ * (K_ / 2) + (size_t)cap_ * (K_ / 256) * 4 : (size_t)cap_ * (K_ / 2) * 2;
  }
  size_t Fp8PreBytes() const { return (size_t)cap_ * K_ + (size_t)cap_ * (K_ / 128) * 4; }
  size_t PreBytes() const { return KeepPre() ? (fp8_dg_ ? Fp8PreBytes() : (size_t)cap_ * K_ * 4) : 0; }
  // The recv rows: [cap, D] in the dispatch's row format (FP8: packed rows of D + D / 32 bytes).
  size_t RecvBytes() const { return (size_t)cap_ * xrb_; }
  // FP8 with the SwiGLU: a result buffer's scales, after its [cap, cols] e4m3 values.
  static float* ScalesAfter(void* values, int64_t rows, int64_t cols) {
    return reinterpret_cast<float*>(static_cast<char*>(values) + rows * cols);
  }
  cuda::DispatchGemmOut DgOut(int r) const {
    if (!(fp8_dg_ && Swiglu()))
      return cuda::DispatchGemmOut{KeepRecv() ? out_recv_[r] : nullptr, out_a_[r], KeepPre() ? out_pre_[r] : nullptr,
                                   nullptr, nullptr, false, !Swiglu() && s_.dg_out_bf16};
    return cuda::DispatchGemmOut{KeepRecv() ? out_recv_[r] : nullptr, out_a_[r], KeepPre() ? out_pre_[r] : nullptr,
                                 ScalesAfter(out_a_[r], cap_, K_ / 2),
                                 KeepPre() ? ScalesAfter(out_pre_[r], cap_, K_) : nullptr};
  }

  // The dispatches' row_scale: the slots' gates with Spec::row_scale, else none.
  const float* RowScale(const DeviceSet& d) const { return s_.row_scale ? (const float*)d.gates : nullptr; }

  Status Dispatch(int r, const CallSite& c, const DeviceSet& d) {
    if (dg_)
      return cuda::DispatchGemm(c, xdt_, d.x, T_, D_,
                                cuda::DispatchSlots{(const int32_t*)d.src_row, (const int32_t*)d.dest_rank,
                                                    (const int32_t*)d.dest_row, (const int32_t*)d.send_order,
                                                    (const int32_t*)d.send_start, (const int32_t*)d.primary,
                                                    RowScale(d), P_},
                                (const int32_t*)d.recv_expected, (const int32_t*)d.seg_rows,
                                (const int32_t*)d.seg_ret_off, E_l_, d.w1, (const float*)d.w1_scales, K_,
                                Swiglu()  ? cuda::Gemm1Form::kSwiGlu
                                : fp8_dg_ ? cuda::Gemm1Form::kTransposedRhs  // (e4m3 w1 [E_l, K, D]: K-major)
                                          : cuda::Gemm1Form::kPlain,
                                (const int32_t*)group_op_[r], (const int32_t*)rank_op_[r], DgOut(r), cap_);
    return cuda::Dispatch(c, xdt_, d.x, T_, D_, (const int32_t*)d.src_row, (const int32_t*)d.dest_rank,
                          (const int32_t*)d.dest_row, (const int32_t*)d.primary, RowScale(d), P_,
                          (const int32_t*)d.recv_expected,
                          (const int32_t*)group_op_[r], (const int32_t*)rank_op_[r], out_recv_[r], cap_);
  }

  // The first of dispatch_gemm's two-call twin: Dispatch into out_recv2.
  Status DispatchAlone(int r, const CallSite& c, const DeviceSet& d) {
    return cuda::Dispatch(c, xdt_, d.x, T_, D_, (const int32_t*)d.src_row, (const int32_t*)d.dest_rank,
                          (const int32_t*)d.dest_row, (const int32_t*)d.primary, RowScale(d), P_,
                          (const int32_t*)d.recv_expected,
                          (const int32_t*)group_op_[r], (const int32_t*)rank_op_[r], out_recv2_[r], cap_);
  }

  // dispatch_gemm's two-call twin: DispatchAlone, then GEMM1 over all cap rows of out_recv2.
  Status DispatchTwoCalls(int r, const CallSite& c, const DeviceSet& d) {
    Status s = DispatchAlone(r, c, d);
    return s.ok() ? Gemm1(r, c.stream, d, cap_) : s;
  }

  // GEMM1 of dispatch_gemm's two calls over the first M rows of out_recv2 into out_a2 (and out_pre2) by GroupedMatmul
  // or, with the SwiGLU, GroupedMatmulSwiGlu, on the rank's SM budget as dispatch_gemm. M = cap: the two calls (rows
  // past the groups zeroed); M = the kept rows: the GEMM alone.
  Status Gemm1(int r, cudaStream_t stream, const DeviceSet& d, int64_t M) {
    const int sms = res_.budget;
    if (fp8_dg_) {  // on the recv rows unpacked on the host (x_recv_q, x_recv_s: the rows the dispatch moves)
      const int64_t ld = ScalesLd(data_[0][0].x_recv_s, D_);
      if (Swiglu())
        return cuda::GroupedMatmulSwiGluFp8(stream, d.x_recv_q, (const float*)d.x_recv_s, ld, M, D_, d.w1,
                                            (const float*)d.w1_scales, E_l_, K_ / 2, (const int32_t*)d.expert_rows,
                                            static_cast<uint8_t*>(out_a2_[r]), ScalesAfter(out_a2_[r], cap_, K_ / 2),
                                            static_cast<uint8_t*>(out_pre2_[r]), ScalesAfter(out_pre2_[r], cap_, K_),
                                            sms);
      return cuda::GroupedMatmulFp8(stream, /*out_f32=*/true, d.x_recv_q, (const float*)d.x_recv_s, ld, M, D_, d.w1,
                                    (const float*)d.w1_scales, E_l_, K_, (const int32_t*)d.expert_rows, out_a2_[r],
                                    sms);
    }
    if (Swiglu())
      return cuda::GroupedMatmulSwiGlu(stream, DType::kBF16, out_recv2_[r], M, D_, d.w1, E_l_, K_ / 2,
                                       (const int32_t*)d.expert_rows, out_a2_[r],
                                       KeepPre() ? out_pre2_[r] : nullptr, DType::kF32, sms);
    return cuda::GroupedMatmul(stream, DType::kBF16, /*out_f32=*/!s_.dg_out_bf16, out_recv2_[r], M, D_, d.w1, E_l_,
                               K_, /*transpose_rhs=*/false, (const int32_t*)d.expert_rows, out_a2_[r], sms);
  }

  // expert_combine's GEMM2 alone over the first M rows of lhs into out_gemm2, by GroupedMatmul (fp8:
  // GroupedMatmulFp8) on the rank's SM budget.
  Status Gemm2(int r, cudaStream_t stream, const DeviceSet& d, int64_t M) {
    if (s_.fp8)
      return cuda::GroupedMatmulFp8(stream, dt_ == DType::kF32, d.lhs, (const float*)d.lhs_scales,
                                    ScalesLd(data_[0][0].lhs_scales, K_), M, K_, d.w, (const float*)d.w_scales, E_l_,
                                    N_, (const int32_t*)d.expert_rows, out_gemm2_[r], res_.budget);
    return cuda::GroupedMatmul(stream, dt_, /*out_f32=*/false, d.lhs, M, K_, d.w, E_l_, N_, s_.transpose_rhs,
                               (const int32_t*)d.expert_rows, out_gemm2_[r], res_.budget);
  }

  // fp8: the row stride ld of MN-major scales [K/128, ld] (lhs_scales, x_recv_s: the caller's arrays, the same for
  // every data set and rank).
  static int64_t ScalesLd(const Bytes& scales, int64_t K) { return (int64_t)(scales.n / sizeof(float)) / (K / 128); }

  // expert_combine's e4m3 operands besides lhs and w, or none.
  cuda::Fp8ProducerArgs Fp8Args(const DeviceSet& d) const {
    if (!s_.fp8) return {};
    return {true, (const float*)d.lhs_scales, ScalesLd(data_[0][0].lhs_scales, K_), (const float*)d.w_scales};
  }

  Status Combine(int r, const CallSite& c, const DeviceSet& d) {
    if (s_.gather_rs)
      return cuda::GatherRs(c, dt_, d.lhs, cap_, K_, d.w, E_l_, N_, s_.transpose_rhs, (const float*)d.row_gate,
                            (const int32_t*)d.token_rows, T_, k_, (const int32_t*)d.seg_rows,
                            (const int32_t*)d.seg_ret_off, (const int32_t*)group_op_[r], (const int32_t*)rank_op_[r],
                            out_y_[r], out_slot_[r]);
    // (e4m3 w is [E_l, N, K]: transpose_rhs, the only B layout of FP8 wgmma.)
    return cuda::ExpertCombine(c, dt_, d.lhs, cap_, K_, d.w, E_l_, N_, s_.transpose_rhs || s_.fp8,
                               (const float*)d.gates, T_, k_, (const int32_t*)d.seg_rows, (const int32_t*)d.seg_ret_off,
                               (const int32_t*)d.ret_row, (const int32_t*)d.ret_expected,
                               (const int32_t*)group_op_[r], (const int32_t*)rank_op_[r], out_y_[r], out_slot_[r],
                               Fp8Args(d));
  }

  // The forced timeout at this iteration: the last rank skips its dispatch, everyone else times out waiting for its
  // rows; the next call of every rank must report the failure (and reset the group). False: stop this rank.
  bool ForcedTimeout(int r, const CallSite& site, const DeviceSet& d) {
    CallSite c = site;
    c.opts.timeout_ms = s_.short_timeout_ms;
    if (r != R_ - 1) {
      Status s = Dispatch(r, c, d);
      if (!s.ok()) Fail("rank " + std::to_string(r) + ": forced-timeout call failed on the host: " + s.msg);
    }
    LB_CHECK(cudaStreamSynchronize(site.stream));
    if (!barrier_.Wait(bar_timeout_)) {
      Fail("rank " + std::to_string(r) + ": peers did not reach the forced-timeout barrier");
      return false;
    }
    TimeoutReport& rep = res_.timeout[r];
    if (s_.stuck_stream_ms > 0) {
      // Rank 0's stream held by a host function (as by another library's collective that never finishes): its
      // recovery gives up waiting for the stream, the others at the recovery barrier it never reaches, each within
      // the call's timeout; once the stream is free, the call below recovers as usual.
      if (r == 0)
        LB_CHECK(cudaLaunchHostFunc(site.stream, HoldStream, const_cast<int64_t*>(&s_.stuck_stream_ms)));
      const auto t0 = std::chrono::steady_clock::now();
      Status stuck = Dispatch(r, c, d);
      rep.stuck_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      rep.stuck_reported = !stuck.ok();
      rep.stuck_code = stuck.code;
      rep.stuck_msg = stuck.msg;
      LB_CHECK(cudaStreamSynchronize(site.stream));
      if (!barrier_.Wait(bar_timeout_)) {
        Fail("rank " + std::to_string(r) + ": peers did not reach the barrier after the held stream");
        return false;
      }
    }
    Status s = Dispatch(r, site, d);
    rep.reported = !s.ok();
    rep.code = s.code;
    rep.msg = s.msg;
    if (s.ok()) {
      Fail("rank " + std::to_string(r) + ": the call after the forced timeout did not report it");
      LB_CHECK(cudaStreamSynchronize(site.stream));
    }
    if (!barrier_.Wait(bar_timeout_)) {
      Fail("rank " + std::to_string(r) + ": peers did not reach the barrier after the recovery");
      return false;
    }
    return true;
  }

  struct HostOut {  // page-locked copies of one rank's outputs
    Pinned recv, y, slot, a, a2, pre, pre2, recv2;
    HostOut(size_t recv_n, size_t y_n, size_t slot_n, size_t a_n, size_t pre_n)
        : recv(recv_n), y(y_n), slot(slot_n), a(a_n), a2(a_n), pre(pre_n), pre2(pre_n), recv2(a_n ? recv_n : 0) {}
  };

  // One checked iteration: poison, dispatch, expert_combine, copy back, digest (and keep the first call's outputs).
  void CheckedCall(int r, int it, const CallSite& site, HostOut& h) {
    const int ds = it % (int)data_.size();
    const DeviceSet& d = dsets_[ds][r];
    cudaStream_t stream = site.stream;
    LB_CHECK(cudaMemsetAsync(out_recv_[r], 0xFF, RecvBytes(), stream));
    LB_CHECK(cudaMemsetAsync(out_y_[r], 0xFF, (size_t)T_ * N_ * eb_, stream));
    LB_CHECK(cudaMemsetAsync(out_slot_[r], 0xFF, SlotBytes(), stream));
    if (dg_) LB_CHECK(cudaMemsetAsync(out_a_[r], 0xFF, h.a.n, stream));
    if (h.pre.n) LB_CHECK(cudaMemsetAsync(out_pre_[r], 0xFF, h.pre.n, stream));
    FirstLaunch& fl = first_launch_[r];
    if (it == 0) {
      LB_CHECK(cudaEventRecord(first_ready_[r], stream));
      fl.begin = std::chrono::steady_clock::now();
    }
    Status s = Dispatch(r, site, d);
    if (it == 0) fl.end = std::chrono::steady_clock::now();
    if (!s.ok()) return Fail(Where(r, it) + " dispatch: " + s.msg);
    s = Combine(r, site, d);
    if (!s.ok()) return Fail(Where(r, it) + " expert_combine: " + s.msg);
    calls_ += 2;
    LB_CHECK(cudaMemcpyAsync(h.recv.p, out_recv_[r], h.recv.n, cudaMemcpyDeviceToHost, stream));
    LB_CHECK(cudaMemcpyAsync(h.y.p, out_y_[r], h.y.n, cudaMemcpyDeviceToHost, stream));
    LB_CHECK(cudaMemcpyAsync(h.slot.p, out_slot_[r], h.slot.n, cudaMemcpyDeviceToHost, stream));
    if (dg_) LB_CHECK(cudaMemcpyAsync(h.a.p, out_a_[r], h.a.n, cudaMemcpyDeviceToHost, stream));
    if (h.pre.n) LB_CHECK(cudaMemcpyAsync(h.pre.p, out_pre_[r], h.pre.n, cudaMemcpyDeviceToHost, stream));
    LB_CHECK(cudaStreamSynchronize(stream));
    CallDigest cd{it, r, ds, h.recv.digest(), h.y.digest(), h.slot.digest(), dg_ ? h.a.digest() : 0,
                  h.pre.n ? h.pre.digest() : 0};
    {
      std::lock_guard<std::mutex> lock(mu_);
      res_.digests.push_back(cd);
    }
    char& have = have_first_[(size_t)ds * R_ + r];
    if (have) return;
    have = 1;
    FirstOutputs& f = res_.first[ds][r];
    f.recv = h.recv.vec();
    f.y = h.y.vec();
    f.slot = h.slot.vec();
    if (!dg_) return;
    f.a = h.a.vec();
    f.pre = h.pre.vec();
    // The same dispatch and GEMM1 as two calls (every rank makes them at this iteration, so they pair up).
    LB_CHECK(cudaMemsetAsync(out_a2_[r], 0xFF, h.a2.n, stream));
    if (h.pre2.n) LB_CHECK(cudaMemsetAsync(out_pre2_[r], 0xFF, h.pre2.n, stream));
    LB_CHECK(cudaMemsetAsync(out_recv2_[r], 0xFF, h.recv2.n, stream));
    s = DispatchTwoCalls(r, site, d);
    if (!s.ok()) return Fail(Where(r, it) + " dispatch + GEMM1: " + s.msg);
    LB_CHECK(cudaMemcpyAsync(h.a2.p, out_a2_[r], h.a2.n, cudaMemcpyDeviceToHost, stream));
    if (h.pre2.n) LB_CHECK(cudaMemcpyAsync(h.pre2.p, out_pre2_[r], h.pre2.n, cudaMemcpyDeviceToHost, stream));
    LB_CHECK(cudaMemcpyAsync(h.recv2.p, out_recv2_[r], h.recv2.n, cudaMemcpyDeviceToHost, stream));
    LB_CHECK(cudaStreamSynchronize(stream));
    f.a2 = h.a2.vec();
    f.pre2 = h.pre2.vec();
    f.recv2 = h.recv2.vec();
  }

  // expert_combine alone per variant, on data set 0.
  void TimeCombine(int r, const CallSite& site, Pinned& h_y) {
    cudaStream_t stream = site.stream;
    const DeviceSet& d = dsets_[0][r];
    const int reps = std::max(2, s_.reps);
    Pinned h_priv(sizeof(RankPrivate));
    auto read_private = [&]() {
      Status s = ws_->ReadPrivate(0, r, stream, reinterpret_cast<RankPrivate*>(h_priv.p));
      if (!s.ok()) throw std::runtime_error(s.msg);
      return *reinterpret_cast<RankPrivate*>(h_priv.p);
    };
    std::vector<cudaEvent_t> ev(2 * reps);
    for (auto& e : ev) LB_CHECK(cudaEventCreate(&e));
    for (size_t v = 0; v < s_.variants.size() && !stop_; ++v) {
      RankTiming& out = res_.timed[v][r];
      CallSite c = site;
      c.opts.consumer_ctas = s_.variants[v].consumers;
      c.opts.serialize = s_.variants[v].serialize;
      const std::string what = "rank " + std::to_string(r) + " timing (C=" + std::to_string(c.opts.consumer_ctas) +
                               (c.opts.serialize ? ", serialized" : "") + "): ";
      if (!barrier_.Wait(bar_timeout_)) {
        Fail("rank " + std::to_string(r) + ": peers did not reach the timing barrier");
        break;
      }
      bool ok = true;
      for (int i = 0; i < s_.warmup && ok; ++i) {
        Status s = Combine(r, c, d);
        if (!s.ok()) Fail(what + s.msg), ok = false;
      }
      for (int i = 0; i < reps && ok; ++i) {
        if (s_.per_call_stats && !(ok = StartTogether(r, stream))) break;
        LB_CHECK(cudaEventRecord(ev[2 * i], stream));
        Status s = Combine(r, c, d);
        LB_CHECK(cudaEventRecord(ev[2 * i + 1], stream));
        if (!s.ok()) Fail(what + s.msg), ok = false;
        if (ok && s_.per_call_stats) out.device.push_back(read_private());
      }
      if (!ok) break;
      if (!s_.per_call_stats) out.device.push_back(read_private());
      LB_CHECK(cudaStreamSynchronize(stream));
      for (int i = 0; i < reps; ++i) {
        float ms = 0;
        // Back-to-back calls: the interval between consecutive ends; synchronized calls: start to end.
        if (s_.per_call_stats) LB_CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
        else if (i > 0) LB_CHECK(cudaEventElapsedTime(&ms, ev[2 * i - 1], ev[2 * i + 1]));
        else continue;
        out.call_us.push_back(1000.0 * ms);
      }
      LB_CHECK(cudaMemcpyAsync(h_y.p, out_y_[r], h_y.n, cudaMemcpyDeviceToHost, stream));
      LB_CHECK(cudaStreamSynchronize(stream));
      out.y_after = h_y.digest();
    }
    for (auto& e : ev) cudaEventDestroy(e);
  }

  // dispatch + GEMM1 as two calls, then as dispatch_gemm, then the two calls' dispatch alone (what the GEMM1 of the
  // two calls adds is the difference): back-to-back calls on data set 0.
  // h_priv: page-locked room for a RankPrivate, allocated before the first call (see RankMain).
  void TimeDispatchGemm(int r, const CallSite& site, Pinned& h_priv) {
    const DeviceSet& d = dsets_[0][r];
    for (int v = 0; v < 3 && !stop_; ++v) {
      auto once = [&]() {
        return v == 0 ? DispatchTwoCalls(r, site, d) : v == 1 ? Dispatch(r, site, d) : DispatchAlone(r, site, d);
      };
      const bool ok = TimeCalls(r, site.stream, once, &res_.dg_us[v][r]);
      if (!ok) Fail("rank " + std::to_string(r) + ": a timed dispatch + GEMM1 call failed");
      if (v == 1 && ok) {  // the last dispatch_gemm's timeline
        Status s = ws_->ReadPrivate(0, r, site.stream, reinterpret_cast<RankPrivate*>(h_priv.p));
        if (!s.ok()) throw std::runtime_error(s.msg);
        res_.dg_device[r] = *reinterpret_cast<RankPrivate*>(h_priv.p);
      }
    }
    // The sweep: the fused call per P (every rank times the same entries in the same order, so the calls pair up).
    for (size_t v = 0; v < s_.dg_sweep.size() && !stop_; ++v) {
      CallSite c = site;
      c.opts.pushers = s_.dg_sweep[v];
      if (!TimeCalls(r, c.stream, [&]() { return Dispatch(r, c, d); }, &res_.dg_sweep_us[v][r])) {
        Fail("rank " + std::to_string(r) + ": a timed dispatch_gemm of the pusher sweep (P=" +
             std::to_string(c.opts.pushers) + ") failed");
        break;
      }
      Status s = ws_->ReadPrivate(0, r, c.stream, reinterpret_cast<RankPrivate*>(h_priv.p));
      if (!s.ok()) throw std::runtime_error(s.msg);
      res_.dg_sweep_pushers[v][r] = (int)reinterpret_cast<RankPrivate*>(h_priv.p)->pushers;
    }
  }

  // Spec::per_call_stats, before a timed call: this rank's stream drained, then every rank at the barrier, so the
  // ranks start the call together. False (the run failed) if the peers did not come.
  bool StartTogether(int r, cudaStream_t stream) {
    LB_CHECK(cudaStreamSynchronize(stream));
    if (barrier_.Wait(bar_timeout_)) return true;
    Fail("rank " + std::to_string(r) + ": peers did not reach the per-call barrier");
    return false;
  }

  // `warmup` calls, then `reps` timed ones into *us (events): back to back, each from the end of the one before; or
  // with Spec::per_call_stats each after its stream drained and every rank reached the barrier (the ranks start each
  // call together, as a layer's combine leaves them), from its start to its end. Every rank calls it alike (the same
  // calls in the same order). False if a call failed or the peers did not reach a barrier.
  template <class Call>
  bool TimeCalls(int r, cudaStream_t stream, Call once, std::vector<double>* us) {
    const int reps = std::max(2, s_.reps);
    std::vector<cudaEvent_t> ev(2 * reps);
    for (auto& e : ev) LB_CHECK(cudaEventCreate(&e));
    bool ok = true;
    for (int i = 0; i < s_.warmup && ok; ++i) ok = once().ok();
    for (int i = 0; i < reps && ok; ++i) {
      if (s_.per_call_stats && !(ok = StartTogether(r, stream))) break;
      if (s_.per_call_stats || i == 0) LB_CHECK(cudaEventRecord(ev[2 * i], stream));
      ok = once().ok();
      LB_CHECK(cudaEventRecord(ev[2 * i + 1], stream));
    }
    LB_CHECK(cudaStreamSynchronize(stream));
    for (int i = 0; i < reps && ok; ++i) {
      float ms = 0;
      // (Back to back: call i's start is call i - 1's end.)
      LB_CHECK(cudaEventElapsedTime(&ms, s_.per_call_stats || i == 0 ? ev[2 * i] : ev[2 * i - 1], ev[2 * i + 1]));
      us->push_back(1000.0 * ms);
    }
    for (auto& e : ev) cudaEventDestroy(e);
    return ok;
  }

  // The GEMM alone (Spec::gemm_alone) on data set 0: GEMM1 over the rows the last DispatchAlone left in out_recv2, or
  // GEMM2 over lhs; M = the rank's kept rows. The ranks start together and run at once, each on its SMs, as in the
  // calls this is compared with.
  void TimeGemmAlone(int r, const CallSite& site) {
    const DeviceSet& d = dsets_[0][r];
    const int64_t M = data_[0][r].recv_rows;
    if (!barrier_.Wait(bar_timeout_))
      return Fail("rank " + std::to_string(r) + ": peers did not reach the GEMM barrier");
    auto once = [&]() { return dg_ ? Gemm1(r, site.stream, d, M) : Gemm2(r, site.stream, d, M); };
    if (!TimeCalls(r, site.stream, once, &res_.gemm_us[r])) Fail("rank " + std::to_string(r) + ": a timed GEMM failed");
  }

  void RankMain(int r) {
    try {
      LB_CHECK(cudaSetDevice(s_.device));
      CallOptions opts;
      opts.timeout_ms = s_.timeout_ms;
      opts.delay_rank = s_.delay_rank;
      opts.delay_us = s_.delay_us;
      opts.consumer_ctas = s_.consumers;
      opts.serialize = s_.serialize;
      opts.tuning = s_.tuning;
      if (dg_) opts.pushers = res_.pushers;
      opts.emulated_link_gbps = s_.emulated_link_gbps;
      opts.producer_band_m = s_.producer_band_m;
      opts.producer_order = s_.producer_order;
      opts.x_recv_from_tiles = s_.x_recv_from_tiles;
      CallSite site{ws_.get(), 0, r, streams_[r], opts};
      // Every pinned buffer is allocated before the first call: cudaMallocHost and cudaFreeHost may wait for the
      // whole device, so a rank thread doing either while a peer's kernel waits for this rank's next call would
      // stall both until the call times out.
      HostOut h(RecvBytes(), (size_t)T_ * N_ * eb_, SlotBytes(), dg_ ? GemmOutBytes() : 0,
                dg_ ? PreBytes() : 0);
      Pinned h_priv(sizeof(RankPrivate));
      // And no rank's first call begins before every rank holds its buffers: a rank still pinning them (gigabytes
      // for the larger dispatch_gemm cases, four ranks at once) would leave its peers' first call waiting for its
      // rows until the call's timeout.
      if (!barrier_.Wait(bar_timeout_)) {
        Fail("rank " + std::to_string(r) + ": peers did not reach the barrier after allocating their host buffers");
        return;
      }
      first_launch_[r].released = std::chrono::steady_clock::now();
      for (int it = 0; it < s_.iters && !stop_; ++it) {
        if (it == s_.timeout_at && !ForcedTimeout(r, site, dsets_[it % data_.size()][r])) break;
        CheckedCall(r, it, site, h);
      }
      if (s_.time && !stop_) {
        if (dg_) TimeDispatchGemm(r, site, h_priv);
        else TimeCombine(r, site, h.y);
        if (s_.gemm_alone && !stop_) TimeGemmAlone(r, site);
      }
    } catch (const std::exception& e) {
      Fail("rank " + std::to_string(r) + ": " + e.what());
    }
  }

  const Spec& s_;
  const std::vector<std::vector<RankInputs>>& data_;
  Result& res_;
  const int R_, T_, k_, E_l_, D_, K_, N_, P_, cap_, eb_;
  const DType dt_;
  const bool dg_, fp8_dg_;  // every dispatch a DispatchGemm; FP8: on packed e4m3 rows with e4m3 w1
  const DType xdt_;         // the dispatch's row format (FP8: kE4M3Rows)
  const int64_t xrb_;       // its row bytes
  Barrier barrier_;
  const std::chrono::milliseconds bar_timeout_;
  std::unique_ptr<Workspace> ws_;
  DeviceArena mem_;
  std::vector<std::vector<DeviceSet>> dsets_;
  std::vector<cudaStream_t> streams_;
  std::vector<void*> out_recv_, out_y_, out_slot_, out_a_, out_a2_, out_pre_, out_pre2_, out_recv2_, out_gemm2_,
      rank_op_, group_op_;
  std::vector<char> have_first_;
  struct FirstLaunch {  // host times of a rank's first call (the dispatch of iteration 0): see Where
    std::chrono::steady_clock::time_point released, begin, end;
  };
  std::vector<FirstLaunch> first_launch_;  // [rank]
  std::vector<cudaEvent_t> first_ready_;   // [rank]: recorded on the rank's stream before its first dispatch
  std::mutex mu_;
  std::atomic<int64_t> calls_{0};
  std::atomic<bool> stop_{false};  // after a failure the ranks' calls no longer pair up: stop the case
};

}  // namespace

Result RunRanks(const Spec& spec, const std::vector<std::vector<RankInputs>>& data) {
  Result res;
  if (data.empty() || spec.ranks < 1 || spec.ranks > cuda::kMaxRanks) {
    res.errors.push_back("bad spec: " + std::to_string(data.size()) + " data sets, " + std::to_string(spec.ranks) +
                         " ranks (1 .. " + std::to_string(cuda::kMaxRanks) + ")");
    return res;
  }
  for (const auto& set : data)
    if ((int)set.size() != spec.ranks) {
      res.errors.push_back("bad spec: a data set has " + std::to_string(set.size()) + " ranks, not " +
                           std::to_string(spec.ranks));
      return res;
    }
  try {
    Run run(spec, data, &res);
    run.Go();
  } catch (const std::exception& e) {
    res.errors.push_back(e.what());
  }
  return res;
}

double CopyCeilingUs(int device, int64_t bytes, int reps) {
  LB_CHECK(cudaSetDevice(device));
  DeviceArena mem;
  void* a = mem.Alloc(bytes);
  void* b = mem.Alloc(bytes);
  LB_CHECK(cudaMemset(a, 1, bytes));
  cudaStream_t st;
  LB_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  reps = std::max(2, reps);
  std::vector<cudaEvent_t> ev(reps + 1);
  for (auto& e : ev) LB_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < 3; ++i) LB_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st));
  LB_CHECK(cudaEventRecord(ev[0], st));
  for (int i = 0; i < reps; ++i) {
    LB_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st));
    LB_CHECK(cudaEventRecord(ev[i + 1], st));
  }
  LB_CHECK(cudaStreamSynchronize(st));
  std::vector<double> us;
  for (int i = 0; i < reps; ++i) {
    float ms = 0;
    LB_CHECK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
    us.push_back(1000.0 * ms);
  }
  for (auto& e : ev) cudaEventDestroy(e);
  cudaStreamDestroy(st);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace jmo::loopback
