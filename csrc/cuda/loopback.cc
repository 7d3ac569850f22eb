#include "cuda/loopback.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <iomanip>
#include <mutex>
#include <numeric>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "common/bf16.h"
#include "cuda/grouped_gemm.h"
#include "cuda/kernels.h"
#include "cuda/workspace_cuda.h"

namespace jmo::cuda {
namespace {

// Host tensor in the call's dtype, with its float values.
struct HostRows {
  std::vector<float> f;  // values (already rounded to the dtype)
  std::vector<char> bytes;
};

// Uniform values in [-scale, scale) from a splitmix64 stream seeded by `rng` (fast enough for the timing cases'
// hundreds of millions of values; 16 bits of resolution per value).
HostRows RandomRows(std::mt19937_64& rng, int64_t n, float scale, bool f32) {
  uint64_t state = rng();
  uint64_t bits = 0;
  HostRows h;
  h.f.resize(n);
  h.bytes.resize(n * (f32 ? 4 : 2));
  for (int64_t i = 0; i < n; ++i) {
    if ((i & 3) == 0) {
      uint64_t z = (state += 0x9E3779B97F4A7C15ull);
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      bits = z ^ (z >> 31);
    }
    float v = ((float)(bits & 0xffff) / 32768.f - 1.f) * scale;
    bits >>= 16;
    if (f32) {
      std::memcpy(h.bytes.data() + 4 * i, &v, 4);
    } else {
      uint16_t b = FloatToBf16(v);
      v = Bf16ToFloat(b);
      std::memcpy(h.bytes.data() + 2 * i, &b, 2);
    }
    h.f[i] = v;
  }
  return h;
}

float ValueAt(const std::vector<char>& bytes, int64_t i, bool f32) {
  if (f32) {
    float v;
    std::memcpy(&v, bytes.data() + 4 * i, 4);
    return v;
  }
  uint16_t b;
  std::memcpy(&b, bytes.data() + 2 * i, 2);
  return Bf16ToFloat(b);
}

// The bytes of w [E_l, K, N] (elements of `eb` bytes) rearranged as [E_l, N, K]: expert_combine's transpose_rhs
// layout of the same weights.
std::vector<char> TransposedWeights(const std::vector<char>& w, int64_t E_l, int64_t K, int64_t N, int eb) {
  std::vector<char> t(w.size());
  for (int64_t e = 0; e < E_l; ++e)
    for (int64_t kk = 0; kk < K; ++kk)
      for (int64_t n = 0; n < N; ++n)
        std::memcpy(t.data() + ((e * N + n) * K + kk) * eb, w.data() + ((e * K + kk) * N + n) * eb, eb);
  return t;
}

// The routing plan of plan.py, written again in C++ (the Python tests check plan.py against the reference layer).
struct RankPlan {
  std::vector<int32_t> slot_src_row, slot_dest_rank, slot_dest_row, slot_ret_row;  // [P]
  std::vector<int32_t> seg_rows, seg_ret_off;                                      // [E_l * R]
  int32_t recv_rows = 0, ret_rows = 0;
  std::vector<int32_t> slot_expert;  // local expert of each slot (reference only)
};

std::vector<RankPlan> MakePlans(const std::vector<std::vector<int32_t>>& ids, int R, int T, int k, int E, int cap_e) {
  const int E_l = E / R, P = T * k;
  auto C = [&](std::vector<int64_t>& v, int s, int d, int e) -> int64_t& { return v[(s * R + d) * E_l + e]; };
  std::vector<int64_t> counts(R * R * E_l, 0), kept(R * R * E_l, 0);
  for (int s = 0; s < R; ++s)
    for (int p = 0; p < P; ++p) ++counts[s * R * E_l + ids[s][p]];
  for (int d = 0; d < R; ++d)
    for (int e = 0; e < E_l; ++e) {
      int64_t before = 0;
      for (int s = 0; s < R; ++s) {
        C(kept, s, d, e) = std::clamp<int64_t>(cap_e - before, 0, C(counts, s, d, e));
        before += C(counts, s, d, e);
      }
    }
  // recv_off[d][e][s]: segments packed in (e, s) order on d.
  std::vector<int64_t> recv_off(R * E_l * R, 0);
  for (int d = 0; d < R; ++d) {
    int64_t off = 0;
    for (int e = 0; e < E_l; ++e)
      for (int s = 0; s < R; ++s) {
        recv_off[(d * E_l + e) * R + s] = off;
        off += C(kept, s, d, e);
      }
  }
  std::vector<std::vector<int64_t>> send_start(R, std::vector<int64_t>(E, 0));
  for (int s = 0; s < R; ++s) {
    int64_t acc = 0;
    for (int g = 0; g < E; ++g) {
      send_start[s][g] = acc;
      acc += counts[s * E + g];
    }
  }
  std::vector<RankPlan> plans(R);
  for (int s = 0; s < R; ++s) {
    RankPlan& pl = plans[s];
    std::vector<int> order(P);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return ids[s][a] < ids[s][b]; });
    std::vector<int> pos(P);
    for (int i = 0; i < P; ++i) pos[order[i]] = i;
    pl.slot_src_row.resize(P);
    pl.slot_dest_rank.resize(P);
    pl.slot_dest_row.resize(P);
    pl.slot_ret_row.resize(P);
    pl.slot_expert.resize(P);
    for (int p = 0; p < P; ++p) {
      const int g = ids[s][p], d = g / E_l, e = g % E_l;
      const int64_t pig = pos[p] - send_start[s][g];
      const bool is_kept = pig < C(kept, s, d, e);
      pl.slot_src_row[p] = p / k;
      pl.slot_dest_rank[p] = d;
      pl.slot_dest_row[p] = is_kept ? (int32_t)(recv_off[(d * E_l + e) * R + s] + pig) : -1;
      pl.slot_ret_row[p] = is_kept ? pos[p] : -1;
      pl.slot_expert[p] = e;
      if (is_kept) ++pl.ret_rows;
    }
  }
  for (int d = 0; d < R; ++d) {
    RankPlan& pl = plans[d];
    pl.seg_rows.assign(E_l * R, 0);
    pl.seg_ret_off.assign(E_l * R, 0);
    for (int e = 0; e < E_l; ++e)
      for (int s = 0; s < R; ++s) {
        pl.seg_rows[e * R + s] = (int32_t)C(kept, s, d, e);
        pl.seg_ret_off[e * R + s] = (int32_t)send_start[s][d * E_l + e];
        pl.recv_rows += (int32_t)C(kept, s, d, e);
      }
  }
  return plans;
}

// k distinct experts per token of rank r.
std::vector<int32_t> Route(std::mt19937_64& rng, int T, int k, int E, int routing, double zipf, int r, int R) {
  std::vector<double> weight(E, 1.0);
  if (routing == 1)
    for (int e = 0; e < E; ++e) weight[e] = std::pow(1.0 + e, -zipf);  // Zipf: expert 0 the most popular
  std::vector<int32_t> ids(T * k);
  if (routing == 3) {  // exact round robin: every expert gets the same number of slots when E divides T*k
    for (int p = 0; p < T * k; ++p) ids[p] = p % E;
    return ids;
  }
  if (routing == 4) {  // to the next rank: round robin over the experts of rank r + 1 (every row is pushed, R > 1)
    const int E_l = E / R, first = (r + 1) % R * E_l;
    for (int p = 0; p < T * k; ++p) ids[p] = first + p % E_l;
    return ids;
  }
  for (int t = 0; t < T; ++t) {
    std::vector<double> w = weight;
    for (int j = 0; j < k; ++j) {
      int pick;
      if (routing == 2) {
        pick = j;  // extreme: every token chooses experts 0..k-1: most experts and ranks get nothing
      } else {
        std::discrete_distribution<int> dist(w.begin(), w.end());
        pick = dist(rng);
      }
      w[pick] = 0;
      ids[t * k + j] = pick;
    }
  }
  return ids;
}

#define LB_CHECK(expr)                                                                          \
  do {                                                                                          \
    cudaError_t e_ = (expr);                                                                    \
    if (e_ != cudaSuccess) throw std::runtime_error(std::string(#expr) + ": " + cudaGetErrorString(e_)); \
  } while (0)

template <typename V>
void* ToDevice(const V& v) {
  void* p = nullptr;
  const size_t bytes = std::max<size_t>(16, v.size() * sizeof(v[0]));
  LB_CHECK(cudaMalloc(&p, bytes));
  LB_CHECK(cudaMemset(p, 0, bytes));
  if (!v.empty()) LB_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(v[0]), cudaMemcpyHostToDevice));
  return p;
}

struct DeviceSet {  // one data set of one rank, on the device
  void *x, *src_row, *dest_rank, *dest_row, *recv_expected, *lhs, *w, *gates, *seg_rows, *seg_ret_off, *ret_row,
      *ret_expected, *w1 = nullptr, *expert_rows = nullptr;  // (w1, expert_rows: dispatch_gemm only)
};

struct Expected {  // host references of one data set of one rank
  std::vector<char> recv;     // [cap, D] bytes, exact
  std::vector<float> y;       // [T, N]
  std::vector<float> slot;    // [P, N]
  std::vector<float> a;       // [cap, K]: dispatch_gemm's GEMM1 (zero past the kept rows)
  std::vector<char> a_unchecked;  // [cap]: 1 = a kept row whose reference was not computed (check_tokens)
};

struct Golden {
  bool have = false;
  std::vector<char> recv, y, slot, a;
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

// Page-locked host buffer: device-to-host copies into pageable memory go through the driver's staging buffer, and a
// rank thread whose copy waits there for its own stream (itself waiting for a peer rank) blocks the peer's thread from
// copying too: a host-side deadlock that the loopback harness met on its first H200 run.
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
  bool operator!=(const std::vector<char>& v) const { return v.size() != n || std::memcmp(p, v.data(), n) != 0; }
};

// Relative error over the rows of `ref` ([rows, width]) whose token (row / per_token) is a multiple of `stride`.
double RelErr(const Pinned& got, const std::vector<float>& ref, bool f32, int64_t* nonfinite, int64_t width = 1,
              int64_t per_token = 1, int64_t stride = 1) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (stride > 1 && ((int64_t)i / width / per_token) % stride != 0) continue;
    float g;
    if (f32) {
      std::memcpy(&g, got.p + 4 * i, 4);
    } else {
      uint16_t b;
      std::memcpy(&b, got.p + 2 * i, 2);
      g = Bf16ToFloat(b);
    }
    if (!std::isfinite(g)) ++*nonfinite;
    num += (double(g) - ref[i]) * (double(g) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

}  // namespace

LoopbackResult RunLoopback(const LoopbackConfig& cfg) {
  LoopbackResult res;
  std::ostringstream log;
  const int R = cfg.ranks, T = cfg.tokens, k = cfg.top_k, E = cfg.experts, D = cfg.d_model, K = cfg.k_dim,
            N = cfg.n_dim;
  const bool f32 = cfg.f32;
  const int eb = f32 ? 4 : 2;
  const int E_l = E / R, P = T * k;
  const int cap_e = cfg.capacity_factor > 0
                        ? std::max(1, std::min(T * R, (int)std::ceil(cfg.capacity_factor * T * R * k / E)))
                        : T * R;
  const int cap = std::min(E_l * cap_e, T * R * k);
  std::ostringstream name;
  name << "R=" << R << " T=" << T << " k=" << k << " E=" << E << " D=" << D << " K=" << K << " N=" << N
       << " dtype=" << (f32 ? "f32" : "bf16") << (cfg.transpose_rhs ? " w=transposed" : "") << " routing="
       << (const char*[]){"balanced", "moderate", "extreme", "round_robin", "next_rank"}[std::clamp(cfg.routing, 0, 4)]
       << (cfg.routing == 1 && cfg.zipf != 1.0 ? " zipf=" + std::to_string(cfg.zipf) : std::string())
       << (cfg.capacity_factor > 0 ? " cf=" + std::to_string(cfg.capacity_factor) : std::string(" dropless"))
       << " iters=" << cfg.iters << " consumers=" << (cfg.consumers > 0 ? std::to_string(cfg.consumers)
                                                                      : std::string(cfg.has_model ? "model" : "fixed"));
  if (cfg.serialize) name << " serialized";
  const bool dg = cfg.dispatch_gemm_pushers > 0;
  if (dg) name << " dispatch_gemm pushers=" << cfg.dispatch_gemm_pushers;
  if (cfg.delay_rank >= 0) name << " delay_rank=" << cfg.delay_rank << " delay_us=" << cfg.delay_us;
  if (cfg.timeout_at >= 0) name << " forced_timeout_at=" << cfg.timeout_at;
  if (E % R != 0 || R < 1 || R > kMaxRanks || cfg.routing < 0 || cfg.routing > 4 || k > E ||
      (cfg.routing == 4 && k > E / R) || (dg && (f32 || D % 64 != 0 || K % 64 != 0))) {
    res.summary = "FAIL " + name.str() + ": bad config";
    return res;
  }
  try {
    LB_CHECK(cudaSetDevice(cfg.device));
    std::unique_ptr<Workspace> ws;
    WorkspaceSizes sizes{(int64_t)std::max({D, K, N}) * eb, cap, P, MaxBands(cap, E_l * R)};
    int sms = 0;
    LB_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, cfg.device));
    // The fixed C without a model: SMs / 8, as jax_moe_overlap.resource.fallback_consumer_ctas.
    Status st = Workspace::Create(R, 1, std::vector<int>(R, cfg.device), sizes, std::max(1, sms / 8), cfg.sm_budget,
                                  cfg.has_model ? &cfg.model : nullptr, &ws);
    if (!st.ok()) throw std::runtime_error(st.msg);
    res.budget = ws->budget(0, 0);
    // Check the expert outputs of every stride-th token only (the timing cases' host reference would take minutes).
    const int64_t stride = cfg.check_tokens > 0 ? std::max(1, T / cfg.check_tokens) : 1;

    // Data sets, plans and references.
    std::mt19937_64 rng(cfg.seed);
    std::vector<std::vector<DeviceSet>> dsets(cfg.datasets, std::vector<DeviceSet>(R));
    std::vector<std::vector<Expected>> expect(cfg.datasets, std::vector<Expected>(R));
    int64_t max_recv_rows = 0, dropped_total = 0;
    for (int ds = 0; ds < cfg.datasets; ++ds) {
      std::vector<std::vector<int32_t>> ids(R);
      for (int r = 0; r < R; ++r) ids[r] = Route(rng, T, k, E, cfg.routing, cfg.zipf, r, R);
      std::vector<RankPlan> plans = MakePlans(ids, R, T, k, E, cap_e);
      if (ds == 0)
        for (int r = 0; r < R; ++r) res.seg_rows.push_back(plans[r].seg_rows);
      std::vector<HostRows> x(R), lhs(R), w(R), w1(R);
      std::vector<std::vector<float>> gates(R);
      for (int r = 0; r < R; ++r) {
        x[r] = RandomRows(rng, (int64_t)T * D, 1.f, f32);
        lhs[r] = RandomRows(rng, (int64_t)plans[r].recv_rows * K, 1.f, f32);  // rows past recv_rows: never read
        lhs[r].bytes.resize((size_t)cap * K * eb, 0);
        w[r] = RandomRows(rng, (int64_t)E_l * K * N, 1.f / std::sqrt((float)K), f32);
        if (dg) w1[r] = RandomRows(rng, (int64_t)E_l * D * K, 1.f / std::sqrt((float)D), f32);
        std::uniform_real_distribution<float> g(0.1f, 1.f);
        gates[r].resize(P);
        for (auto& v : gates[r]) v = g(rng);
      }
      for (int r = 0; r < R; ++r) {
        const RankPlan& pl = plans[r];
        max_recv_rows = std::max<int64_t>(max_recv_rows, pl.recv_rows);
        dropped_total += P - pl.ret_rows;
        DeviceSet& d = dsets[ds][r];
        d.x = ToDevice(x[r].bytes);
        d.src_row = ToDevice(pl.slot_src_row);
        d.dest_rank = ToDevice(pl.slot_dest_rank);
        d.dest_row = ToDevice(pl.slot_dest_row);
        d.recv_expected = ToDevice(std::vector<int32_t>{pl.recv_rows});
        d.lhs = ToDevice(lhs[r].bytes);
        // The reference below reads w[r] as [E_l, K, N]; the call gets the same values in the layout asked for.
        d.w = ToDevice(cfg.transpose_rhs ? TransposedWeights(w[r].bytes, E_l, K, N, eb) : w[r].bytes);
        d.gates = ToDevice(gates[r]);
        d.seg_rows = ToDevice(pl.seg_rows);
        d.seg_ret_off = ToDevice(pl.seg_ret_off);
        d.ret_row = ToDevice(pl.slot_ret_row);
        d.ret_expected = ToDevice(std::vector<int32_t>{pl.ret_rows});
        if (dg) {
          d.w1 = ToDevice(w1[r].bytes);
          std::vector<int32_t> er(E_l, 0);  // GEMM1's group sizes: rows per local expert over all sources
          for (int e = 0; e < E_l; ++e)
            for (int s = 0; s < R; ++s) er[e] += pl.seg_rows[(size_t)e * R + s];
          d.expert_rows = ToDevice(er);
        }
        expect[ds][r].recv.assign((size_t)cap * D * eb, 0);
        expect[ds][r].y.assign((size_t)T * N, 0.f);
        expect[ds][r].slot.assign((size_t)P * N, 0.f);
        if (dg) {
          expect[ds][r].a.assign((size_t)cap * K, 0.f);
          expect[ds][r].a_unchecked.assign((size_t)cap, 0);
        }
      }
      // References: dispatch rows (exact) and expert outputs in float32 from the dtype's values.
      std::vector<float> out(N);
      for (int s = 0; s < R; ++s) {
        const RankPlan& pl = plans[s];
        for (int p = 0; p < P; ++p) {
          const int d = pl.slot_dest_rank[p], row = pl.slot_dest_row[p];
          if (row < 0) continue;
          std::memcpy(expect[ds][d].recv.data() + (size_t)row * D * eb,
                      x[s].bytes.data() + (size_t)pl.slot_src_row[p] * D * eb, (size_t)D * eb);
          if (dg && (p / k) % stride != 0) expect[ds][d].a_unchecked[row] = 1;
          if (dg && (p / k) % stride == 0) {  // GEMM1 of the row at its expert's rank, in float32 from the bf16 values
            const float* xr = x[s].f.data() + (size_t)pl.slot_src_row[p] * D;
            const float* we = w1[d].f.data() + (size_t)pl.slot_expert[p] * D * K;
            float* ar = expect[ds][d].a.data() + (size_t)row * K;
            for (int kk = 0; kk < D; ++kk)
              for (int n = 0; n < K; ++n) ar[n] += xr[kk] * we[(size_t)kk * K + n];
          }
          if ((p / k) % stride != 0) continue;
          const int e = pl.slot_expert[p];
          std::fill(out.begin(), out.end(), 0.f);
          const float* a = lhs[d].f.data() + (size_t)row * K;
          const float* we = w[d].f.data() + (size_t)e * K * N;
          for (int kk = 0; kk < K; ++kk) {
            const float av = a[kk];
            const float* wr = we + (size_t)kk * N;
            for (int n = 0; n < N; ++n) out[n] += av * wr[n];
          }
          const int t = p / k;
          for (int n = 0; n < N; ++n) {
            expect[ds][s].slot[(size_t)p * N + n] = out[n];
            expect[ds][s].y[(size_t)t * N + n] += gates[s][p] * out[n];
          }
        }
      }
    }

    // One stream, one thread per rank.
    std::vector<cudaStream_t> streams(R);
    for (auto& s : streams) LB_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::vector<void*> out_recv(R), out_y(R), out_slot(R), out_a(R, nullptr), out_recv2(R, nullptr), out_a2(R, nullptr),
        rank_op(R), group_op(R);
    for (int r = 0; r < R; ++r) {
      if (dg) {  // out_*2: the same dispatch and GEMM1 as two calls (Dispatch, GroupedMatmul), for comparison
        LB_CHECK(cudaMalloc(&out_a[r], (size_t)cap * K * 4 + 16));
        LB_CHECK(cudaMalloc(&out_a2[r], (size_t)cap * K * 4 + 16));
        LB_CHECK(cudaMalloc(&out_recv2[r], (size_t)cap * D * eb + 16));
      }
      LB_CHECK(cudaMalloc(&out_recv[r], (size_t)cap * D * eb + 16));
      LB_CHECK(cudaMalloc(&out_y[r], (size_t)T * N * eb + 16));
      LB_CHECK(cudaMalloc(&out_slot[r], (size_t)P * N * eb + 16));
      rank_op[r] = ToDevice(std::vector<int32_t>{r});
      group_op[r] = ToDevice(std::vector<int32_t>{0});
    }
    std::vector<std::vector<Golden>> golden(cfg.datasets, std::vector<Golden>(R));
    std::mutex log_mu;
    std::atomic<int64_t> failures{0}, calls{0}, bit_checks{0};
    std::atomic<bool> stop{false};  // after an unexpected failure the ranks' calls no longer pair up: stop the case
    std::vector<double> max_rel_y(R, 0), max_rel_slot(R, 0);
    std::vector<std::string> timeout_msgs(R);
    Barrier barrier(R);
    const double tol = f32 ? 1e-5 : 1e-2;
    auto fail = [&](const std::string& m) {
      std::lock_guard<std::mutex> lock(log_mu);
      if (failures++ < 20) log << "  " << m << "\n";
      stop = true;
    };
    const auto bar_timeout = std::chrono::milliseconds(3 * cfg.timeout_ms + 10000);

    // Timing: the variants, per rank and timed call: the call's microseconds and the device's record of it.
    std::vector<TimedVariant> variants;
    if (cfg.time) {
      TimedVariant v;
      v.serialize = cfg.serialize;
      if (cfg.sweep.empty()) {
        v.consumers = cfg.consumers;
        variants.push_back(v);
      } else {
        for (int c : cfg.sweep) {
          v.consumers = c;
          variants.push_back(v);
        }
        v.consumers = 0;  // then the manager
        variants.push_back(v);
        if (!cfg.serialize) {  // and the manager serialized: the same kernels without overlap (the baseline)
          v.serialize = true;
          variants.push_back(v);
        }
      }
    }
    const int reps = std::max(2, cfg.reps);
    std::vector<std::vector<std::vector<double>>> call_us(variants.size(), std::vector<std::vector<double>>(R));
    std::vector<std::vector<std::vector<RankPrivate>>> dev_rec(variants.size(), std::vector<std::vector<RankPrivate>>(R));
    auto timed_phase = [&](int r, cudaStream_t stream, const CallSite& site, Pinned& h_y) {
      const DType dt = f32 ? DType::kF32 : DType::kBF16;
      const DeviceSet& d = dsets[0][r];
      auto combine = [&](const CallSite& c) {
        return ExpertCombine(c, dt, d.lhs, cap, K, d.w, E_l, N, cfg.transpose_rhs, (const float*)d.gates, T, k,
                             (const int32_t*)d.seg_rows, (const int32_t*)d.seg_ret_off, (const int32_t*)d.ret_row,
                             (const int32_t*)d.ret_expected, (const int32_t*)group_op[r], (const int32_t*)rank_op[r],
                             out_y[r], out_slot[r]);
      };
      Pinned h_priv(sizeof(RankPrivate));
      auto read_private = [&]() {
        Status s = ws->ReadPrivate(0, r, stream, reinterpret_cast<RankPrivate*>(h_priv.p));
        if (!s.ok()) throw std::runtime_error(s.msg);
        return *reinterpret_cast<RankPrivate*>(h_priv.p);
      };
      std::vector<cudaEvent_t> ev(2 * reps);
      for (auto& e : ev) LB_CHECK(cudaEventCreate(&e));
      for (size_t v = 0; v < variants.size() && !stop; ++v) {
        CallSite c = site;
        c.opts.consumer_ctas = variants[v].consumers;
        c.opts.serialize = variants[v].serialize;
        if (!barrier.Wait(bar_timeout)) {
          fail("rank " + std::to_string(r) + ": peers did not reach the timing barrier");
          break;
        }
        bool ok = true;
        for (int i = 0; i < cfg.warmup && ok; ++i) {
          Status s = combine(c);
          if (!s.ok()) {
            fail("rank " + std::to_string(r) + " timing (C=" + std::to_string(c.opts.consumer_ctas) + "): " + s.msg);
            ok = false;
          }
        }
        for (int i = 0; i < reps && ok; ++i) {
          if (cfg.per_call_stats) {
            LB_CHECK(cudaStreamSynchronize(stream));
            if (!barrier.Wait(bar_timeout)) {
              fail("rank " + std::to_string(r) + ": peers did not reach the per-call barrier");
              ok = false;
              break;
            }
          }
          LB_CHECK(cudaEventRecord(ev[2 * i], stream));
          Status s = combine(c);
          LB_CHECK(cudaEventRecord(ev[2 * i + 1], stream));
          if (!s.ok()) {
            fail("rank " + std::to_string(r) + " timing (C=" + std::to_string(c.opts.consumer_ctas) + "): " + s.msg);
            ok = false;
          }
          if (ok && cfg.per_call_stats) dev_rec[v][r].push_back(read_private());
        }
        if (!ok) break;
        if (!cfg.per_call_stats) dev_rec[v][r].push_back(read_private());
        LB_CHECK(cudaStreamSynchronize(stream));
        for (int i = 0; i < reps; ++i) {
          float ms = 0;
          // Back-to-back calls: the interval between consecutive ends; synchronized calls: start to end.
          if (cfg.per_call_stats) LB_CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
          else if (i > 0) LB_CHECK(cudaEventElapsedTime(&ms, ev[2 * i - 1], ev[2 * i + 1]));
          else continue;
          call_us[v][r].push_back(1000.0 * ms);
        }
        // The timed calls ran on data set 0: their outputs must equal the checked call's, bit for bit.
        LB_CHECK(cudaMemcpyAsync(h_y.p, out_y[r], h_y.n, cudaMemcpyDeviceToHost, stream));
        LB_CHECK(cudaStreamSynchronize(stream));
        if (golden[0][r].have && h_y != golden[0][r].y) {
          variants[v].identical = false;
          fail("rank " + std::to_string(r) + ": outputs after the timed calls with C=" +
               std::to_string(c.opts.consumer_ctas) + (c.opts.serialize ? " (serialized)" : "") +
               " differ from the checked call");
        }
      }
      for (auto& e : ev) cudaEventDestroy(e);
    };

    std::vector<std::vector<double>> dg_us[2] = {std::vector<std::vector<double>>(R),
                                                 std::vector<std::vector<double>>(R)};  // [two calls, fused][rank]
    auto rank_main = [&](int r) {
      try {
        LB_CHECK(cudaSetDevice(cfg.device));
        cudaStream_t stream = streams[r];
        CallSite site{ws.get(), 0, r, stream,
                      CallOptions{cfg.timeout_ms, cfg.delay_rank, cfg.delay_us, cfg.consumers, cfg.serialize}};
        // Every pinned buffer is allocated here, before the first call: cudaFreeHost (and cudaMallocHost) may wait
        // for the whole device, so a rank thread freeing one while a peer's kernel waits for this rank's next call
        // would stall both until the call times out (it did, in dispatch_gemm's first GPU run).
        Pinned h_recv((size_t)cap * D * eb), h_y((size_t)T * N * eb), h_slot((size_t)P * N * eb),
            h_a(dg ? (size_t)cap * K * 4 : 0), h_a2(h_a.n), h_recv2(dg ? h_recv.n : 0);
        const DType dt = f32 ? DType::kF32 : DType::kBF16;
        auto dispatch_two_calls = [&](const CallSite& c, const DeviceSet& d) {
          Status s = Dispatch(c, dt, d.x, T, D, (const int32_t*)d.src_row, (const int32_t*)d.dest_rank,
                              (const int32_t*)d.dest_row, P, (const int32_t*)d.recv_expected,
                              (const int32_t*)group_op[r], (const int32_t*)rank_op[r], out_recv2[r], cap);
          if (!s.ok()) return s;
          return GroupedMatmul(c.stream, DType::kBF16, /*out_f32=*/true, out_recv2[r], cap, D, d.w1, E_l, K,
                               /*transpose_rhs=*/false, (const int32_t*)d.expert_rows, out_a2[r]);
        };
        auto dispatch = [&](const CallSite& c, const DeviceSet& d) {
          if (dg)
            return DispatchGemm(c, d.x, T, D, (const int32_t*)d.src_row, (const int32_t*)d.dest_rank,
                                (const int32_t*)d.dest_row, P, (const int32_t*)d.recv_expected,
                                (const int32_t*)d.seg_rows, (const int32_t*)d.seg_ret_off, E_l, d.w1, K,
                                (const int32_t*)group_op[r], (const int32_t*)rank_op[r], out_recv[r],
                                static_cast<float*>(out_a[r]), cap, cfg.dispatch_gemm_pushers);
          return Dispatch(c, dt, d.x, T, D, (const int32_t*)d.src_row, (const int32_t*)d.dest_rank,
                          (const int32_t*)d.dest_row, P, (const int32_t*)d.recv_expected,
                          (const int32_t*)group_op[r], (const int32_t*)rank_op[r], out_recv[r], cap);
        };
        for (int it = 0; it < cfg.iters && !stop; ++it) {
          const int ds = it % cfg.datasets;
          const DeviceSet& d = dsets[ds][r];
          if (it == cfg.timeout_at) {
            // The last rank skips this call; everyone else times out waiting for its rows.
            CallSite c = site;
            c.opts.timeout_ms = cfg.short_timeout_ms;
            if (r != R - 1) {
              Status s = dispatch(c, d);
              if (!s.ok()) fail("rank " + std::to_string(r) + ": forced-timeout call failed on the host: " + s.msg);
            }
            LB_CHECK(cudaStreamSynchronize(stream));
            if (!barrier.Wait(bar_timeout)) {
              fail("rank " + std::to_string(r) + ": peers did not reach the forced-timeout barrier");
              break;
            }
            // The next call of every rank reports the failure (and resets the group).
            Status s = dispatch(site, d);
            if (s.ok()) {
              fail("rank " + std::to_string(r) + ": the call after the forced timeout did not report it");
              LB_CHECK(cudaStreamSynchronize(stream));
            } else {
              timeout_msgs[r] = s.msg;
              if (s.code != kDeadlineExceeded || s.msg.find("timed out") == std::string::npos)
                fail("rank " + std::to_string(r) + ": unexpected error after the forced timeout: " + s.msg);
            }
            if (!barrier.Wait(bar_timeout)) {
              fail("rank " + std::to_string(r) + ": peers did not reach the barrier after the recovery");
              break;
            }
          }
          // Poison outputs: NaN (bf16 0xFFFF / f32 0xFFFFFFFF) wherever a kernel fails to write.
          LB_CHECK(cudaMemsetAsync(out_recv[r], 0xFF, (size_t)cap * D * eb, stream));
          LB_CHECK(cudaMemsetAsync(out_y[r], 0xFF, (size_t)T * N * eb, stream));
          LB_CHECK(cudaMemsetAsync(out_slot[r], 0xFF, (size_t)P * N * eb, stream));
          if (dg) LB_CHECK(cudaMemsetAsync(out_a[r], 0xFF, (size_t)cap * K * 4, stream));
          Status s = dispatch(site, d);
          if (!s.ok()) {
            fail("rank " + std::to_string(r) + " iter " + std::to_string(it) + " dispatch: " + s.msg);
            continue;
          }
          s = ExpertCombine(site, dt, d.lhs, cap, K, d.w, E_l, N, cfg.transpose_rhs, (const float*)d.gates, T, k,
                            (const int32_t*)d.seg_rows, (const int32_t*)d.seg_ret_off, (const int32_t*)d.ret_row,
                            (const int32_t*)d.ret_expected, (const int32_t*)group_op[r], (const int32_t*)rank_op[r],
                            out_y[r], out_slot[r]);
          if (!s.ok()) {
            fail("rank " + std::to_string(r) + " iter " + std::to_string(it) + " expert_combine: " + s.msg);
            continue;
          }
          calls += 2;
          LB_CHECK(cudaMemcpyAsync(h_recv.p, out_recv[r], h_recv.n, cudaMemcpyDeviceToHost, stream));
          LB_CHECK(cudaMemcpyAsync(h_y.p, out_y[r], h_y.n, cudaMemcpyDeviceToHost, stream));
          LB_CHECK(cudaMemcpyAsync(h_slot.p, out_slot[r], h_slot.n, cudaMemcpyDeviceToHost, stream));
          if (dg) LB_CHECK(cudaMemcpyAsync(h_a.p, out_a[r], h_a.n, cudaMemcpyDeviceToHost, stream));
          LB_CHECK(cudaStreamSynchronize(stream));
          Golden& g = golden[ds][r];
          if (!g.have) {
            const Expected& ex = expect[ds][r];
            if (h_recv != ex.recv) {
              int64_t bad = 0;
              for (int64_t i = 0; i < (int64_t)cap; ++i)
                if (std::memcmp(h_recv.p + i * D * eb, ex.recv.data() + i * D * eb, (size_t)D * eb)) ++bad;
              fail("rank " + std::to_string(r) + " iter " + std::to_string(it) + ": dispatch output differs from the reference in " +
                   std::to_string(bad) + " of " + std::to_string(cap) + " rows");
            }
            int64_t nonfinite = 0;
            const double ey = RelErr(h_y, ex.y, f32, &nonfinite, N, 1, stride);
            const double es = RelErr(h_slot, ex.slot, f32, &nonfinite, N, k, stride);
            max_rel_y[r] = std::max(max_rel_y[r], ey);
            max_rel_slot[r] = std::max(max_rel_slot[r], es);
            if (!(ey < tol) || !(es < tol) || nonfinite)
              fail("rank " + std::to_string(r) + " iter " + std::to_string(it) + ": expert_combine rel err y " +
                   std::to_string(ey) + ", slots " + std::to_string(es) + ", non-finite " + std::to_string(nonfinite) +
                   " (tolerance " + std::to_string(tol) + ")");
            if (dg) {  // GEMM1: float32 accumulation of the same bf16 products; rows past the kept ones exactly zero
              const float* got = reinterpret_cast<const float*>(h_a.p);
              double num = 0, den = 0;
              int64_t nonfinite_a = 0;
              for (size_t i = 0; i < ex.a.size(); ++i) {
                if (!std::isfinite(got[i])) ++nonfinite_a;
                if (ex.a_unchecked[i / K]) continue;
                num = std::max(num, (double)std::abs(got[i] - ex.a[i]));
                den = std::max(den, (double)std::abs(ex.a[i]));
              }
              const double ea = den > 0 ? num / den : num;
              if (!(ea < 1e-4) || nonfinite_a)
                fail("rank " + std::to_string(r) + " iter " + std::to_string(it) + ": dispatch_gemm GEMM1 rel err " +
                     std::to_string(ea) + ", non-finite " + std::to_string(nonfinite_a) + " (tolerance 1e-4)");
              g.a = h_a.vec();
              // The same dispatch and GEMM1 as two calls (every rank makes them at this iteration, so they pair up):
              // recv and GEMM1 must be the same bits.
              LB_CHECK(cudaMemsetAsync(out_a2[r], 0xFF, h_a2.n, stream));
              Status s2 = dispatch_two_calls(site, d);
              if (!s2.ok()) {
                fail("rank " + std::to_string(r) + " iter " + std::to_string(it) + " dispatch + GEMM1: " + s2.msg);
              } else {
                LB_CHECK(cudaMemcpyAsync(h_a2.p, out_a2[r], h_a2.n, cudaMemcpyDeviceToHost, stream));
                LB_CHECK(cudaMemcpyAsync(h_recv2.p, out_recv2[r], h_recv2.n, cudaMemcpyDeviceToHost, stream));
                LB_CHECK(cudaStreamSynchronize(stream));
                if (h_a2 != g.a || h_recv2 != h_recv.vec())
                  fail("rank " + std::to_string(r) + " iter " + std::to_string(it) + ": dispatch_gemm differs from "
                       "dispatch + GroupedMatmul (recv " + std::to_string(h_recv2 != h_recv.vec()) + ", GEMM1 " +
                       std::to_string(h_a2 != g.a) + ")");
              }
            }
            g.recv = h_recv.vec();
            g.y = h_y.vec();
            g.slot = h_slot.vec();
            g.have = true;
          } else {
            ++bit_checks;
            if (h_recv != g.recv || h_y != g.y || h_slot != g.slot || (dg && h_a != g.a))
              fail("rank " + std::to_string(r) + " iter " + std::to_string(it) +
                   ": outputs differ from the first call on the same data (recv " +
                   std::to_string(h_recv != g.recv) + ", y " + std::to_string(h_y != g.y) + ", slots " +
                   std::to_string(h_slot != g.slot) + ")");
          }
        }
        if (cfg.time && !stop && dg) {
          // dispatch + GEMM1: as two calls, then as dispatch_gemm; back-to-back calls on data set 0.
          const DeviceSet& d = dsets[0][r];
          for (int v = 0; v < 2 && !stop; ++v) {
            auto once = [&]() { return v == 0 ? dispatch_two_calls(site, d) : dispatch(site, d); };
            std::vector<cudaEvent_t> ev(reps + 1);
            for (auto& e : ev) LB_CHECK(cudaEventCreate(&e));
            bool ok = true;
            for (int i = 0; i < cfg.warmup && ok; ++i) ok = once().ok();
            LB_CHECK(cudaEventRecord(ev[0], stream));
            for (int i = 0; i < reps && ok; ++i) {
              ok = once().ok();
              LB_CHECK(cudaEventRecord(ev[i + 1], stream));
            }
            LB_CHECK(cudaStreamSynchronize(stream));
            if (!ok) fail("rank " + std::to_string(r) + ": a timed dispatch + GEMM1 call failed");
            for (int i = 0; i < reps && ok; ++i) {
              float ms = 0;
              LB_CHECK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
              dg_us[v][r].push_back(1000.0 * ms);
            }
            for (auto& e : ev) cudaEventDestroy(e);
          }
        } else if (cfg.time && !stop) {
          timed_phase(r, stream, site, h_y);
        }
      } catch (const std::exception& e) {
        fail("rank " + std::to_string(r) + ": " + e.what());
      }
    };
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> threads;
    for (int r = 0; r < R; ++r) threads.emplace_back(rank_main, r);
    for (auto& t : threads) t.join();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    // Rows the consumers push: every rank's remote segments (seg_rows[e * R + s] with s != r; own rows are stored
    // in place by the producer).
    int64_t pushed_rows = 0;
    std::vector<int64_t> remote_rows(R, 0);
    for (int r = 0; r < R; ++r)
      for (size_t i = 0; i < res.seg_rows[r].size(); ++i)
        if ((int)(i % R) != r) remote_rows[r] += res.seg_rows[r][i];
    for (int r = 0; r < R; ++r) pushed_rows += remote_rows[r];
    for (size_t v = 0; v < variants.size() && !stop; ++v) {
      TimedVariant& tv = variants[v];
      std::vector<double> per_call;
      for (size_t i = 0; i < call_us[v][0].size(); ++i) {
        double m = 0;
        for (int r = 0; r < R; ++r)
          if (i < call_us[v][r].size()) m = std::max(m, call_us[v][r][i]);
        per_call.push_back(m);
      }
      auto quantile = [](std::vector<double> x, double q) {
        if (x.empty()) return 0.0;
        std::sort(x.begin(), x.end());
        return x[std::min(x.size() - 1, (size_t)std::floor(q * (x.size() - 1) + 0.5))];
      };
      tv.median_us = quantile(per_call, 0.5);
      tv.p10_us = quantile(per_call, 0.1);
      tv.p90_us = quantile(per_call, 0.9);
      tv.mean_us = per_call.empty() ? 0 : std::accumulate(per_call.begin(), per_call.end(), 0.0) / per_call.size();
      std::vector<double> prod, cons;
      for (size_t i = 0; i < dev_rec[v][0].size(); ++i) {
        double pm = 0, cm = 0;
        for (int r = 0; r < R; ++r) {
          if (i >= dev_rec[v][r].size()) continue;
          const RankPrivate& q = dev_rec[v][r][i];
          if (q.prod_t1 > q.prod_t0) pm = std::max(pm, (q.prod_t1 - q.prod_t0) * 1e-3);
          if (q.cons_t1 > q.cons_t0) cm = std::max(cm, (q.cons_t1 - q.cons_t0) * 1e-3);
        }
        prod.push_back(pm);
        cons.push_back(cm);
      }
      // The device timeline of the call whose time is the median: per rank, microseconds from the earliest
      // BeginKernel of the call (all ranks share one %globaltimer on one GPU).
      if (cfg.per_call_stats && !per_call.empty() && dev_rec[v][0].size() == per_call.size()) {
        size_t med = 0;
        for (size_t i = 0; i < per_call.size(); ++i)
          if (std::abs(per_call[i] - tv.median_us) < std::abs(per_call[med] - tv.median_us)) med = i;
        uint64_t t0 = ~0ull;
        for (int r = 0; r < R; ++r)
          if (med < dev_rec[v][r].size()) t0 = std::min<uint64_t>(t0, dev_rec[v][r][med].begin_t);
        std::ostringstream tl;
        tl << std::fixed << std::setprecision(1);
        auto at = [&](uint64_t t) { return (t == 0 || t == ~0ull) ? -1.0 : ((double)t - (double)t0) * 1e-3; };
        for (int r = 0; r < R; ++r) {
          if (med >= dev_rec[v][r].size()) continue;
          const RankPrivate& q = dev_rec[v][r][med];
          tl << (r ? " | " : "") << "r" << r << " C=" << q.consumers << " begin " << at(q.begin_t) << " prod "
             << at(q.prod_t0) << ".." << at(q.prod_t1) << " (last CTA start " << at(q.prod_t0_last) << ") cons "
             << at(q.cons_t0) << ".." << at(q.cons_t1) << " comb " << at(q.comb_t0) << ".." << at(q.comb_t1);
        }
        tv.timeline = tl.str();
      }
      tv.prod_span_us = quantile(prod, 0.5);
      tv.cons_span_us = quantile(cons, 0.5);
      for (int r = 0; r < R; ++r) tv.chosen.push_back(dev_rec[v][r].empty() ? 0 : (int)dev_rec[v][r].back().consumers);
      tv.pushed_bytes = (double)pushed_rows * N * eb;
    }
    res.timed = variants;
    if (cfg.decision_iters > 0 && cfg.has_model && !stop) {
      CallSite c{ws.get(), 0, 0, streams[0], CallOptions{}};
      Status s = MeasureDecision(c, (const int32_t*)dsets[0][0].seg_rows, (const int32_t*)dsets[0][0].seg_ret_off, E_l,
                                 cap, K, N, f32 ? DType::kF32 : DType::kBF16, cfg.decision_iters, &res.table_ns,
                                 &res.decision_ns, &res.decision_choice);
      if (!s.ok()) fail("decision benchmark: " + s.msg);
    }

    double ry = 0, rs = 0;
    for (int r = 0; r < R; ++r) {
      ry = std::max(ry, max_rel_y[r]);
      rs = std::max(rs, max_rel_slot[r]);
    }
    if (cfg.timeout_at >= 0 && cfg.timeout_at < cfg.iters) {
      log << "  reported after the forced timeout (rank 0): " << timeout_msgs[0] << "\n";
    }
    for (int r = 0; r < R; ++r) {
      cudaFree(out_recv[r]);
      cudaFree(out_y[r]);
      cudaFree(out_slot[r]);
      for (void* p : {out_a[r], out_a2[r], out_recv2[r]})
        if (p) cudaFree(p);
      cudaFree(rank_op[r]);
      cudaFree(group_op[r]);
      cudaStreamDestroy(streams[r]);
    }
    for (auto& v : dsets)
      for (auto& d : v)
        for (void* p : {d.x, d.src_row, d.dest_rank, d.dest_row, d.recv_expected, d.lhs, d.w, d.gates, d.seg_rows,
                        d.seg_ret_off, d.ret_row, d.ret_expected, d.w1, d.expert_rows})
          if (p) cudaFree(p);
    ws.reset();
    LB_CHECK(cudaGetLastError());
    std::ostringstream sum;
    // A timed run must have recorded every rank's C: some C >= 1 exactly where the rank had rows to push.
    bool chosen_ok = !cfg.time || dg || (!variants.empty() && (int)variants.back().chosen.size() == R);
    for (int r = 0; chosen_ok && cfg.time && !dg && r < R; ++r)
      chosen_ok = (variants.back().chosen[r] > 0) == (remote_rows[r] > 0);
    res.pass = failures == 0 && calls == (int64_t)2 * R * cfg.iters && chosen_ok;
    sum << (res.pass ? "PASS " : "FAIL ") << name.str() << " | calls " << calls << " | max rel err y " << ry
        << ", slots " << rs << " (tol " << tol << ") | bit-identical repeats " << bit_checks << " | max recv rows "
        << max_recv_rows << "/" << cap << " | dropped " << dropped_total << " | producer "
        << ProducerPath(f32 ? DType::kF32 : DType::kBF16, K, N, cfg.transpose_rhs, out_y[0], out_y[0]) << " | " << secs
        << " s";
    if (stride > 1) sum << " | expert outputs checked on every " << stride << "th token";
    if (dg && cfg.time && !dg_us[0][0].empty() && !dg_us[1][0].empty()) {
      // Per call: the slowest rank's interval (ranks pair up call by call); the median over calls.
      auto median_of_max = [&](const std::vector<std::vector<double>>& us) {
        std::vector<double> m(us[0].size(), 0);
        for (const auto& u : us)
          for (size_t i = 0; i < m.size() && i < u.size(); ++i) m[i] = std::max(m[i], u[i]);
        std::sort(m.begin(), m.end());
        return m[m.size() / 2];
      };
      const double two = median_of_max(dg_us[0]), fused = median_of_max(dg_us[1]);
      sum << std::fixed << std::setprecision(1) << " | dispatch + GEMM1 per call: two calls " << two
          << " us, dispatch_gemm " << fused << " us (" << std::setprecision(3) << two / fused << "x)";
    }
    if (failures) sum << " | failures " << failures;
    res.summary = sum.str();
  } catch (const std::exception& e) {
    res.summary = "FAIL " + name.str() + ": " + e.what();
  }
  res.log = log.str();
  return res;
}

double CopyCeilingUs(int device, int64_t bytes, int reps) {
  LB_CHECK(cudaSetDevice(device));
  void *a = nullptr, *b = nullptr;
  LB_CHECK(cudaMalloc(&a, bytes));
  LB_CHECK(cudaMalloc(&b, bytes));
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
  cudaFree(a);
  cudaFree(b);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace jmo::cuda
