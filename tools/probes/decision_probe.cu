// Decision probe: the resource manager's device-side choice of the consumer CTA count C (resource_manager.cuh, the
// code ExpertKernel runs) checked against the host's ChooseConsumerCtas (resource_model.h) on random segment tables,
// and timed alone on one CTA. Two forms, which must both pick the host's C:
//   library   DeviceChooseConsumers: the chunked form (1 barrier, FP64-only inner loop, its divisions done by the
//             host: FillCandidateConsts), falling back to the scans form where its shortcuts would not be exact (the
//             tables with rows up to 2^24 below)
//   scans     ChooseByScans alone (block scans, 7 barriers): the general form, for comparison
//   e3dd3a1   the chunked form of commit e3dd3a1 (decision_v0.cuh), the baseline
// The segment table: the library's BuildSegments (and BuildSegments<kPrepTerms>, the table with the consumer choice's
// parts, followed by DeviceChooseConsumersPrepared: ExpertKernel's form under the model) and e3dd3a1's
// (decision_v0.cuh) on random plans, some invalid, some with several defects, some with segments of 2^23 rows and more
// (the prepared choice's fallback), 256 and 384 threads: the host's answer, table and error record (HostTable: the
// lowest bad segment in plan order, else too many bands), e3dd3a1's scratch, and the host's C (ChooseConsumerCtas on
// the host's table, each plan with its own SM budget, N and link) on every thread, else WRONG and exit status 1; then
// timed alone and followed by the consumer choice (the whole decision of an expert_combine call: the library's column
// is BuildSegments<kPrepTerms> + DeviceChooseConsumersPrepared), beside e3dd3a1's, each sum checked against the host's;
// and the library's decision in phases (the plan loads and the first scan, the table with the choice's parts, the whole
// decision), so that the differences show where its time goes.
//
// Check: for random tables (n segments in producer order, the first mr remote; n in 1..256, several seeds; sms 24,
// 66, 132; N 4096, 8192), both forms with 256 and 384 threads (the wgmma engine's CTA) must give the host's C for both
// parameter sets of the timing loop (seg_us + 0 and + 1e-12), on every thread; any difference prints WRONG and the
// exit status is 1. Timing: one CTA of kThreads threads, `--iters` decisions in a loop timed with %globaltimer (as
// DecisionBenchKernel: seg_us varies with the iteration's parity, the inputs are re-read with volatile loads so
// nothing is hoisted out of the loop), median of `--reps` launches, ns per decision; the sum of the choices is checked.
// Parameters: jax_moe_overlap/calibration/nvidia_h200.json (tile 128 x 256, K = 2048, bf16, max_ctas 32).
// Then dispatch_gemm's pusher count P: WarpChooseDispatchPushers (the warp dispatch_gemm's CTAs run) against the host's
// ChooseDispatchPushers on random calls (rows to push and to multiply, K, N, SM budget, link and per-CTA rates), one
// warp per call, every lane's answer compared; any difference prints WRONG and the exit status is 1.
//
// Then gather_rs's C as every CTA of ExpertKernel<kGather> takes it under the model: the table built from the plan
// arrays with the sources' parts (BuildSegments<kPrepGather>) and DeviceChooseGatherConsumersPrepared, twice per CTA
// (the same scratch; some calls with segments of 2^23 rows and more, where it falls back), then
// DeviceChooseGatherConsumers (the general form, the prepared form's fallback) on that table, against the host's
// HostTable + GatherModelSources + ChooseGatherConsumerCtasFromSources on random calls (R 2..32, any rank, E_l experts
// with empty segments, T, Q, N, K, bf16 or float32, the SM budget and the link), 256 and 384 threads, every thread's
// answer compared; any difference prints WRONG and the exit status is 1. And its time per iteration (one CTA, --iters
// iterations, median of --reps launches): the choice alone (e3dd3a1's, the library's general form), the table alone and
// with the general form, the table with the sources' parts alone and with the prepared form; each sum checked against
// the host's. Moving work from the choice into the table shows in the table's column: the decision's cost is the last
// column against "table + choice".
//
// Build and run (repository root; < 30 s; options: --iters 1000 --reps 5 --seeds 12):
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -I ffi -I ffi/include \
//     -o /tmp/decision_probe tools/probes/decision_probe.cu && /tmp/decision_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/schedule/resource_manager.cuh"
#include "cuda/schedule/segment_table.cuh"
#include "decision_v0.cuh"  // the baseline: the decision of e3dd3a1
#include "probe_common.cuh"  // CK

namespace {
using namespace jmo;
using namespace jmo::cuda;

constexpr int kForms = 3;
const char* const kNames[kForms] = {"library (chunked)", "scans", "e3dd3a1 (chunked)"};

__device__ __forceinline__ uint64_t Now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
template <class T>
__device__ __forceinline__ T Vol(const T& x) {
  return *reinterpret_cast<const volatile T*>(&x);
}
// Iteration i's model in a timing loop: p with seg_us + 1e-12 on odd iterations (as DecisionBenchKernel), seg_us read
// with a volatile load, so that no iteration is folded into another or hoisted out of the loop.
__device__ __forceinline__ ModelParams IterParams(const ModelParams& p, int i) {
  ModelParams q = p;
  q.seg_us = Vol(p.seg_us) + (double)(i & 1) * 1e-12;
  return q;
}

struct Inputs {
  ModelParams p;
  CandidateConsts cand;
  int64_t N, K, eb;
  int max_ctas;
};

// out: [0] ns of `iters` decisions, [1] sum of the choices, [2], [3] choices of iterations 0 and 1, [4] threads whose
// choices differ from thread 0's (zeroed by the host).
template <int kForm, int kBlock>
__global__ void __launch_bounds__(kBlock) BenchKernel(const Segment* segs, int n, int mr, const Inputs* inputs,
                                                      int iters, unsigned long long* out) {
  __shared__ SegTable table;
  __shared__ std::conditional_t<kForm == 2, decision_v0::ChoiceScratch, ChoiceScratch> cs;
  __shared__ unsigned long long t0;
  __shared__ int ref[3];
  __shared__ Inputs in;
  for (int i = threadIdx.x; i < n; i += blockDim.x) table.seg[i] = segs[i];
  if (threadIdx.x == 0) {
    table.n = n;
    table.remote_segs = mr;
    in = *inputs;
  }
  __syncthreads();
  if (threadIdx.x == 0) t0 = Now();
  __syncthreads();
  int acc = 0, c0 = 0, c1 = 0;
  for (int i = 0; i < iters; ++i) {
    const ModelParams& v = in.p;
    const ModelParams q{Vol(v.sms),          Vol(v.ctas_per_sm),   Vol(v.tile_m),   Vol(v.tile_n),
                        Vol(v.tile_us_base), Vol(v.tile_us_per_k), Vol(v.cta_gbps), Vol(v.link_gbps),
                        Vol(v.seg_us) + (double)(i & 1) * 1e-12};  // seg_us varies as in DecisionBenchKernel
    int c;
    if constexpr (kForm == 0)
      c = DeviceChooseConsumers(table, q, in.cand, Vol(in.N), Vol(in.K), Vol(in.eb), Vol(in.max_ctas), &cs, i & 1);
    else if constexpr (kForm == 1)
      c = ChooseByScans(table, q, Vol(in.N), Vol(in.K), Vol(in.eb), Vol(in.max_ctas), &cs);
    else
      c = decision_v0::DeviceChooseConsumers(table, q, in.cand, Vol(in.N), Vol(in.K), Vol(in.eb), Vol(in.max_ctas),
                                             &cs, i & 1);
    acc += c;
    if (i == 0) c0 = c;
    if (i == 1) c1 = c;
  }
  if (threadIdx.x == 0) {
    out[0] = Now() - t0;
    ref[0] = acc, ref[1] = c0, ref[2] = c1;
    out[1] = (unsigned long long)acc, out[2] = (unsigned long long)c0, out[3] = (unsigned long long)c1;
  }
  __syncthreads();
  if (acc != ref[0] || c0 != ref[1] || c1 != ref[2]) atomicAdd(&out[4], 1ull);
}

using KernelFn = void (*)(const Segment*, int, int, const Inputs*, int, unsigned long long*);
const KernelFn kKernels[2][kForms] = {{BenchKernel<0, kThreads>, BenchKernel<1, kThreads>, BenchKernel<2, kThreads>},
                                      {BenchKernel<0, 384>, BenchKernel<1, 384>, BenchKernel<2, 384>}};

struct Table {
  std::vector<Segment> seg;
  int mr;
};
// n non-empty segments, the first mr remote (SegTable's order); rows 1..max_rows.
Table MakeTable(int n, int mr, int max_rows, uint32_t seed) {
  std::mt19937 g(seed);
  Table t{std::vector<Segment>(n), mr};
  for (int i = 0; i < n; ++i) t.seg[i] = Segment{i, i < mr ? 1 : 0, 0, 1 + (int32_t)(g() % (uint32_t)max_rows), 0, 0};
  return t;
}
// A random check's summary: its calls, the distinct choices of the host (seen[c] = 1: some call chose c), and whether
// every device choice was `host`'s.
void PrintCheck(const char* what, int calls, const std::vector<int>& seen, int64_t wrong, const char* host) {
  int distinct = 0;
  for (int v : seen) distinct += v;
  printf("%s: %d calls, %d distinct choices: %s%s\n", what, calls, distinct,
         wrong ? "WRONG" : "every choice identical to ", wrong ? "" : host);
}

// One warp per call: out[i] = its P where every lane agrees, -1 where they differ.
__global__ void PusherCheckKernel(const PusherConfig* pc, const PusherInputs* in, int n, int* out) {
  const int i = blockIdx.x;
  if (i >= n) return;
  const int p = WarpChooseDispatchPushers(pc[i], in[i]);
  const bool same = __all_sync(0xffffffffu, p == __shfl_sync(0xffffffffu, p, 0));
  if (threadIdx.x == 0) out[i] = same ? p : -1;
}

// Random calls, device against host; returns the count of differences.
int64_t CheckPushers(int calls, uint64_t seed) {
  std::mt19937_64 g(seed);
  auto pick = [&](std::initializer_list<double> v) { return *(v.begin() + g() % v.size()); };
  std::vector<PusherConfig> pc(calls);
  std::vector<PusherInputs> in(calls);
  std::vector<int> host(calls);
  for (int i = 0; i < calls; ++i) {
    const int sms = (int)pick({2, 3, 8, 16, 17, 33, 44, 66, 132});
    ModelParams p{sms, 1, 128, 256, 2.395217391304346, 0.010803532608695652, 29.56622111004397,
                  pick({15.0, 46.25, 92.5, 185.0, 370.0, 1744.7}), 0.4301974372287516,
                  pick({5.0, 17.3, 28.0, 41.5})};
    pc[i] = PusherConfig{p, 1, 0, PusherMaxCtas(sms)};
    const int64_t rows = (int64_t)(g() % 300000);
    in[i] = PusherInputs{(int64_t)(g() % 2 ? 0 : g() % (rows + 1)) * (int64_t)pick({256, 4096, 14336}), rows,
                         (int64_t)pick({128, 2048, 4096, 7168}), (int64_t)pick({256, 1024, 4096, 28672}),
                         (int64_t)(g() % (rows / 8 + 1)), (int64_t)(g() % 64)};
    host[i] = ChooseDispatchPushers(p, in[i], pc[i].max_pushers);
  }
  PusherConfig* d_pc;
  PusherInputs* d_in;
  int* d_out;
  CK(cudaMalloc(&d_pc, calls * sizeof(PusherConfig)));
  CK(cudaMalloc(&d_in, calls * sizeof(PusherInputs)));
  CK(cudaMalloc(&d_out, calls * sizeof(int)));
  CK(cudaMemcpy(d_pc, pc.data(), calls * sizeof(PusherConfig), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_in, in.data(), calls * sizeof(PusherInputs), cudaMemcpyHostToDevice));
  PusherCheckKernel<<<calls, 32>>>(d_pc, d_in, calls, d_out);
  CK(cudaGetLastError());
  std::vector<int> dev(calls);
  CK(cudaMemcpy(dev.data(), d_out, calls * sizeof(int), cudaMemcpyDeviceToHost));
  int64_t wrong = 0;
  std::vector<int> seen(33, 0);
  for (int i = 0; i < calls; ++i) {
    if (host[i] >= 0 && host[i] <= 32) seen[host[i]] = 1;
    if (dev[i] != host[i] && ++wrong <= 20)
      printf("WRONG pushers: sms %d link %g pusher %g bytes %lld rows %lld K %lld N %lld: device %d, host %d\n",
             pc[i].model.sms, pc[i].model.link_gbps, pc[i].model.pusher_gbps, (long long)in[i].push_bytes,
             (long long)in[i].gemm_rows, (long long)in[i].K, (long long)in[i].N, dev[i], host[i]);
  }
  PrintCheck("pushers check", calls, seen, wrong, "the host's ChooseDispatchPushers");
  cudaFree(d_pc);
  cudaFree(d_in);
  cudaFree(d_out);
  return wrong;
}

// The segment table: the library's BuildSegments against the baseline's (decision_v0.cuh), one CTA per plan, and
// timed. A plan: R ranks, this rank, E_l experts, the recv capacity and the workspace's sizes; its seg_rows and
// seg_ret_off (E_l R each) from `begin` in the plan arrays.
struct TablePlan {
  int R, rank, E_l, begin;
  int64_t cap, ret_rows, max_bands;
  Inputs model;  // the consumer choice's (BuildSegments<kPrepTerms> + DeviceChooseConsumersPrepared)
};
struct TableOut {
  int32_t ok;
  int32_t choice;  // the prepared form's C where every thread agrees (0: no remote band), else -1
  SegTable t;
  Segment raw[kMaxSegments];
  int64_t rows_to_rank[kMaxRanks];
  int32_t segs_of_rank[kMaxRanks];
};
// Plan i's group words: GroupSharedBytes(kMaxRanks) bytes from `gs` on (GroupShared's errors[] is really [R]; with one
// record a plan, rank r's record would land in the next plans' words, and which write lands last would depend on the
// blocks' timing).
__host__ __device__ GroupShared* PlanGroup(void* gs, int i) {
  return reinterpret_cast<GroupShared*>(static_cast<char*>(gs) + i * GroupSharedBytes(kMaxRanks));
}
__device__ RankDev PlanRankDev(const TablePlan& pl, GroupShared* gs, RankPrivate* pv) {
  RankDev rd{};
  rd.rank = pl.rank;
  rd.ranks = pl.R;
  rd.sizes.ret_rows = pl.ret_rows;
  rd.sizes.max_bands = pl.max_bands;
  rd.shared = gs;
  rd.priv = pv;
  return rd;
}
// The plan arrays (`words` entries each) and the per-plan words (PlanGroup's group words, RankPrivate) of `plans` plans
// on the device, all zeroed; Upload copies plan arrays in.
struct DevicePlans {
  int32_t *rows = nullptr, *ret = nullptr;
  GroupShared* gs = nullptr;
  RankPrivate* pv = nullptr;
  size_t gs_bytes, pv_bytes;
  DevicePlans(size_t words, int plans)
      : gs_bytes(plans * (size_t)GroupSharedBytes(kMaxRanks)), pv_bytes(plans * sizeof(RankPrivate)) {
    CK(cudaMalloc(&rows, std::max<size_t>(words, 1) * sizeof(int32_t)));
    CK(cudaMalloc(&ret, std::max<size_t>(words, 1) * sizeof(int32_t)));
    CK(cudaMalloc(&gs, gs_bytes));
    CK(cudaMalloc(&pv, pv_bytes));
    CK(cudaMemset(ret, 0, std::max<size_t>(words, 1) * sizeof(int32_t)));
    ZeroWords();
  }
  DevicePlans(const DevicePlans&) = delete;
  DevicePlans& operator=(const DevicePlans&) = delete;
  ~DevicePlans() {
    cudaFree(rows);
    cudaFree(ret);
    cudaFree(gs);
    cudaFree(pv);
  }
  void ZeroWords() const {
    CK(cudaMemset(gs, 0, gs_bytes));
    CK(cudaMemset(pv, 0, pv_bytes));
  }
  void Upload(const std::vector<int32_t>& r, const std::vector<int32_t>& t) const {
    CK(cudaMemcpy(rows, r.data(), r.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(ret, t.data(), t.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  }
};
// kPrep: BuildSegments<kPrepTerms> and then the prepared consumer choice (ExpertKernel's form under the model).
template <bool kV0, bool kPrep, int kBlock>
__global__ void __launch_bounds__(kBlock) TableCheckKernel(const TablePlan* plans, const int32_t* rows,
                                                           const int32_t* ret_off, GroupShared* gs, RankPrivate* pv,
                                                           TableOut* out) {
  __shared__ SegTable table;
  __shared__ std::conditional_t<kV0, decision_v0::TableScratch, TableScratch> sc;
  __shared__ ChoiceScratch cs;
  __shared__ int ref, differ;
  const TablePlan& pl = plans[blockIdx.x];
  const RankDev rd = PlanRankDev(pl, PlanGroup(gs, blockIdx.x), pv + blockIdx.x);
  if (threadIdx.x == 0) differ = 0;
  bool ok;
  int c = 0;
  if constexpr (kV0) {
    ok = decision_v0::BuildSegments(rd, rows + pl.begin, ret_off + pl.begin, pl.E_l, pl.cap, &table, &sc);
  } else if constexpr (kPrep) {
    const Inputs& m = pl.model;
    const TermPrepIn pin = TermPrepFor(m.p, m.cand, m.N, m.eb, &cs);
    TermPrepOut prep{};
    ok = BuildSegments<kPrepTerms>(rd, rows + pl.begin, ret_off + pl.begin, pl.E_l, pl.cap, &table, &sc, &pin, &prep);
    if (ok && table.remote_bands > 0)
      c = DeviceChooseConsumersPrepared(table, prep, m.p, m.cand, m.N, m.K, m.eb, m.max_ctas, &cs);
  } else {
    ok = BuildSegments(rd, rows + pl.begin, ret_off + pl.begin, pl.E_l, pl.cap, &table, &sc);
  }
  __syncthreads();
  TableOut& o = out[blockIdx.x];
  if (threadIdx.x == 0) {
    o.ok = ok;
    ref = c;
  }
  __syncthreads();
  if (c != ref) atomicAdd(&differ, 1);
  __syncthreads();
  if (threadIdx.x == 0) o.choice = differ ? -1 : c;
  if (!ok) return;
  if (threadIdx.x == 0) o.t = table;  // (every field; the probe compares the defined ones)
  for (int i = threadIdx.x; i < pl.E_l * pl.R; i += blockDim.x) o.raw[i] = sc.raw[i];
  for (int i = threadIdx.x; i < pl.R; i += blockDim.x) {
    o.rows_to_rank[i] = sc.rows_to_rank[i];
    o.segs_of_rank[i] = sc.segs_of_rank[i];
  }
}

// The host's statement of BuildSegments' answer (the CPU handler's rule, call_steps.cc): the first bad segment in plan
// order (expert-major) is reported (kBadSegment, its plan index; got: its negative rows, else its end in recv where
// past the capacity, else its ret offset; expected: the capacity where past it, else ret_rows), else too many bands
// (kBadTooManyTiles); a valid plan's table is its non-empty segments in OrderSegments' order. One error for any block
// size and any timing: the lowest bad index wins.
bool HostTable(const TablePlan& pl, const int32_t* rows, const int32_t* ret, SegTable* t, ErrorRecord* e) {
  const int R = pl.R, n = pl.E_l * R;
  auto bands_of = [](int32_t r) { return (int32_t)((r + kBandRows - 1) / kBandRows); };
  *e = ErrorRecord{};
  std::vector<Segment> raw(n);
  std::vector<int64_t> to_rank(R, 0);
  int64_t off = 0, band = 0;
  for (int i = 0; i < n; ++i) {
    const bool over_cap = off + rows[i] > pl.cap;
    if (rows[i] < 0 || over_cap || ret[i] < 0 || (int64_t)ret[i] + rows[i] > pl.ret_rows) {
      *e = ErrorRecord{kStageBadInput, (uint64_t)pl.rank, (uint64_t)i, 0,
                       (uint64_t)(rows[i] < 0 ? (int64_t)rows[i] : over_cap ? off + rows[i] : (int64_t)ret[i]),
                       (uint64_t)(over_cap ? pl.cap : pl.ret_rows), kBadSegment, 0};
      return false;
    }
    raw[i] = Segment{i / R, i % R, (int32_t)off, rows[i], ret[i], (int32_t)band};
    off += rows[i];
    band += bands_of(rows[i]);
    to_rank[i % R] += rows[i];
  }
  if (band > pl.max_bands) {
    *e = ErrorRecord{kStageBadInput, (uint64_t)pl.rank, 0, 0, (uint64_t)band, (uint64_t)pl.max_bands,
                     kBadTooManyTiles, 0};
    return false;
  }
  std::vector<int> order(n);
  OrderSegments(raw.data(), n, pl.rank, to_rank.data(), order.data());
  int m = 0, b = 0, remote = 0;
  for (int i : order)
    if (raw[i].rows > 0) {
      t->seg[m] = raw[i];
      t->band_prefix[m++] = b;
      b += bands_of(raw[i].rows);
      if (raw[i].src != pl.rank) remote = m;
    }
  t->band_prefix[m] = b;
  t->n = m;
  t->bands = b;
  t->remote_segs = remote;
  t->remote_bands = t->band_prefix[remote];
  t->remote_rows = off - to_rank[pl.rank];
  return true;
}

int HostChoice(const Table& t, const ModelParams& p, int64_t N, int64_t K, int64_t eb, int max_ctas);

// Random plans (some invalid: negative rows, over the capacity, ret rows out of range, too many bands, several of
// these at once), library against baseline with 256 and 384 threads, each against the host's rule (HostTable): the
// same answer, table and error record (code, detail, peer, got, expected) as the host, and the library's scratch
// (raw segments, rows and segments by source) as the baseline's. Returns the count of differences.
int64_t CheckTables(int plans, uint64_t seed) {
  std::mt19937_64 g(seed);
  auto pick = [&](std::initializer_list<int64_t> v) { return *(v.begin() + g() % v.size()); };
  std::vector<TablePlan> pl(plans);
  std::vector<int32_t> rows, ret;
  int invalid_kinds[5] = {0, 0, 0, 0, 0};
  for (int i = 0; i < plans; ++i) {
    const int R = (int)pick({1, 2, 3, 4, 5, 8, 16, 32});
    const int E_l = 1 + (int)(g() % (uint64_t)(kMaxSegments / R));
    const int zero_pct = (int)pick({0, 30, 90});
    // (Segments of 2^23 rows and more: the prepared choice's fallback, ChooseByScans.)
    const int64_t max_rows = E_l * R <= 64 ? pick({4, 64, 300, 5000, (1 << 23) + 64}) : pick({4, 64, 300, 5000});
    int64_t sum = 0;
    pl[i] = TablePlan{R, (int)(g() % R), E_l, (int)rows.size(), 0, 0, 0};
    {  // the consumer choice's model: an SM budget, N, a link
      const int sms = (int)pick({24, 66, 132});
      const int64_t N = pick({4096, 8192});
      const ModelParams p{sms, 1, 128, 256, 2.395217391304346, 0.010803532608695652, 29.56622111004397,
                          (double)pick({1744, 185, 46}) + 0.7158381863562, 0.4301974372287516};
      pl[i].model = Inputs{p, FillCandidateConsts(p, ModelMaxCtas(sms), N), N, 2048, 2, ModelMaxCtas(sms)};
    }
    for (int j = 0; j < E_l * R; ++j) {
      int32_t r = (int)(g() % 100) < zero_pct ? 0 : 1 + (int32_t)(g() % (uint64_t)max_rows);
      if (g() % 4 == 0 && j > 0) r = rows.back();  // ties between sources' row counts
      rows.push_back(r);
      sum += r;
    }
    pl[i].cap = sum + (int64_t)(g() % 3);
    pl[i].ret_rows = sum + 64;
    pl[i].max_bands = 1 << 26;
    for (int j = 0; j < E_l * R; ++j) ret.push_back((int32_t)(g() % (uint64_t)(pl[i].ret_rows - rows[pl[i].begin + j] + 1)));
    switch (g() % 10) {  // 0-4: an invalid plan
      case 0: rows[pl[i].begin + g() % (E_l * R)] = -1 - (int)(g() % 5); ++invalid_kinds[0]; break;
      case 1: pl[i].cap = sum / 2; ++invalid_kinds[1]; break;
      case 2: ret[pl[i].begin + g() % (E_l * R)] = (g() % 2) ? -3 : (int32_t)pl[i].ret_rows; ++invalid_kinds[2]; break;
      case 3: pl[i].max_bands = sum / kBandRows / 2; ++invalid_kinds[3]; break;
      case 4:  // several defects: the lowest bad segment is the one reported
        for (int k = (int)(g() % 3); k >= 0; --k) {
          const int j = pl[i].begin + (int)(g() % (E_l * R));
          if (g() % 2) rows[j] = -1 - (int)(g() % 5);
          else ret[j] = (g() % 2) ? -3 : (int32_t)pl[i].ret_rows;
        }
        if (g() % 2) pl[i].cap = sum / 2;
        pl[i].max_bands = 0;
        ++invalid_kinds[4];
        break;
      default: break;
    }
  }
  TablePlan* d_pl;
  TableOut* d_out;
  const DevicePlans dp(rows.size(), plans);
  dp.Upload(rows, ret);
  CK(cudaMalloc(&d_pl, plans * sizeof(TablePlan)));
  CK(cudaMalloc(&d_out, plans * sizeof(TableOut)));
  CK(cudaMemcpy(d_pl, pl.data(), plans * sizeof(TablePlan), cudaMemcpyHostToDevice));
  constexpr int kVariants = 5;
  std::vector<TableOut> out[kVariants];
  std::vector<ErrorRecord> err[kVariants];
  // baseline (256 threads), library (256, 384), library with the choice's parts and the prepared choice (256, 384)
  for (int v = 0; v < kVariants; ++v) {
    dp.ZeroWords();
    CK(cudaMemset(d_out, 0xff, plans * sizeof(TableOut)));  // poisoned: an unwritten entry differs
    const int blk = v == 2 || v == 4 ? 384 : kThreads;
    auto kernel = v == 0 ? TableCheckKernel<true, false, kThreads> : v == 1 ? TableCheckKernel<false, false, kThreads>
                  : v == 2 ? TableCheckKernel<false, false, 384> : v == 3 ? TableCheckKernel<false, true, kThreads>
                                                                         : TableCheckKernel<false, true, 384>;
    kernel<<<plans, blk>>>(d_pl, dp.rows, dp.ret, dp.gs, dp.pv, d_out);
    CK(cudaGetLastError());
    out[v].resize(plans);
    CK(cudaMemcpy(out[v].data(), d_out, plans * sizeof(TableOut), cudaMemcpyDeviceToHost));
    std::vector<char> gs(dp.gs_bytes);
    CK(cudaMemcpy(gs.data(), dp.gs, dp.gs_bytes, cudaMemcpyDeviceToHost));
    for (int i = 0; i < plans; ++i) err[v].push_back(PlanGroup(gs.data(), i)->errors[pl[i].rank]);
  }
  static const char* const kForm[kVariants] = {"e3dd3a1, 256 threads", "library, 256 threads", "library, 384 threads",
                                               "library + prepared choice, 256 threads",
                                               "library + prepared choice, 384 threads"};
  int64_t wrong = 0, valid = 0, choices = 0;
  std::vector<int> seen(33, 0);
  static SegTable h;  // (large)
  for (int i = 0; i < plans; ++i) {
    ErrorRecord eh;
    const int ok = HostTable(pl[i], rows.data() + pl[i].begin, ret.data() + pl[i].begin, &h, &eh);
    valid += ok;
    // The host's C of a valid plan with a remote band (the choice of every form with the choice's parts), else 0.
    int host_c = 0;
    if (ok && h.remote_bands > 0) {
      const Inputs& m = pl[i].model;
      host_c = HostChoice(Table{std::vector<Segment>(h.seg, h.seg + h.n), h.remote_segs}, m.p, m.N, m.K, m.eb,
                          m.max_ctas);
      ++choices;
      if (host_c >= 0 && host_c <= 32) seen[host_c] = 1;
    }
    for (int v = 0; v < kVariants; ++v) {
      const TableOut& a = out[0][i];
      const TableOut& b = out[v][i];
      const ErrorRecord& eb = err[v][i];
      bool same = b.ok == ok && eh.code == eb.code && eh.detail == eb.detail && eh.peer == eb.peer &&
                  eh.got == eb.got && eh.expected == eb.expected;
      if (same && ok) {
        const int n = h.n, m = pl[i].E_l * pl[i].R;
        same = n == b.t.n && h.bands == b.t.bands && h.remote_segs == b.t.remote_segs &&
               h.remote_bands == b.t.remote_bands && h.remote_rows == b.t.remote_rows &&
               !memcmp(h.seg, b.t.seg, n * sizeof(Segment)) &&
               !memcmp(h.band_prefix, b.t.band_prefix, (n + 1) * sizeof(int32_t)) &&
               !memcmp(a.raw, b.raw, m * sizeof(Segment)) &&
               !memcmp(a.rows_to_rank, b.rows_to_rank, pl[i].R * sizeof(int64_t)) &&
               !memcmp(a.segs_of_rank, b.segs_of_rank, pl[i].R * sizeof(int32_t));
      }
      if (same && v >= 3) same = b.choice == host_c;
      if (!same && ++wrong <= 20)
        printf("WRONG table (%s): plan %d R %d rank %d E_l %d: ok %d (host %d), C %d (host %d), error code %llu (host "
               "%llu) detail %llu (%llu) peer %llu (%llu) got %llu (%llu) expected %llu (%llu)\n", kForm[v], i,
               pl[i].R, pl[i].rank, pl[i].E_l, b.ok, ok, v >= 3 ? b.choice : 0, v >= 3 ? host_c : 0,
               (unsigned long long)eb.code, (unsigned long long)eh.code,
               (unsigned long long)eb.detail, (unsigned long long)eh.detail, (unsigned long long)eb.peer,
               (unsigned long long)eh.peer, (unsigned long long)eb.got, (unsigned long long)eh.got,
               (unsigned long long)eb.expected, (unsigned long long)eh.expected);
    }
  }
  int distinct = 0;
  for (int x : seen) distinct += x;
  printf("table check (256 and 384 threads): %d plans (%lld valid; invalid: %d negative rows, %d over capacity, %d ret "
         "rows, %d too many bands, %d several defects): %s\n", plans, (long long)valid, invalid_kinds[0],
         invalid_kinds[1], invalid_kinds[2], invalid_kinds[3], invalid_kinds[4],
         wrong ? "WRONG" : "every answer, table and error record the host's rule (HostTable), every scratch e3dd3a1's");
  printf("prepared choice check (the table with the choice's parts, 256 and 384 threads): %lld plans with a remote "
         "band, %d distinct choices: %s\n", (long long)choices, distinct,
         wrong ? "see the table check" : "every choice identical to the host's ChooseConsumerCtas on every thread");
  cudaFree(d_pl);
  cudaFree(d_out);
  return wrong;
}

// gather_rs: one CTA per call builds its table from its plan arrays as ExpertKernel<kGather> does under the model
// (BuildSegments<kPrepGather>, then DeviceChooseGatherConsumersPrepared) twice with the same scratch, then runs
// DeviceChooseGatherConsumers (the prepared form's fallback) on the table; out[kGatherDecisions i + k]: decision k's C
// where every thread agrees, -1 where they differ, -3 where the table build failed.
struct GatherCall {
  ModelParams p;
  GatherModelShape sh;
  int max_ctas;
  CandidateConsts cand;  // FillCandidateConsts(p, max_ctas, sh.N): the library's (ConsumerConfig::cand)
  TablePlan plan;        // its ranks R, rank, E_l and plan arrays, valid (plan.model unused)
};
constexpr int kGatherDecisions = 3;
const char* const kGatherDecisionNames[kGatherDecisions] = {"prepared, 1st", "prepared, 2nd", "general"};
template <int kBlock>
__global__ void __launch_bounds__(kBlock) GatherCheckKernel(const GatherCall* calls, const int32_t* rows,
                                                            const int32_t* ret_off, GroupShared* gs, RankPrivate* pv,
                                                            int* out) {
  __shared__ SegTable table;
  __shared__ TableScratch sc;
  __shared__ ChoiceScratch cs;
  __shared__ int ref[kGatherDecisions], differ;
  const GatherCall& g = calls[blockIdx.x];
  const TablePlan& pl = g.plan;
  const RankDev rd = PlanRankDev(pl, PlanGroup(gs, blockIdx.x), pv + blockIdx.x);
  if (threadIdx.x == 0) differ = 0;
  int c[kGatherDecisions];
  bool ok = true;
  for (int k = 0; k < 2; ++k) {
    const GatherPrepIn in = GatherPrepFor(g.cand, g.sh, pl.rank, &cs);
    TermPrepOut prep{};
    ok = BuildSegments<kPrepGather>(rd, rows + pl.begin, ret_off + pl.begin, pl.E_l, pl.cap, &table, &sc, &in, &prep) &&
         ok;
    c[k] = ok ? DeviceChooseGatherConsumersPrepared(table, prep, g.p, g.cand, g.sh, pl.rank, pl.R, g.max_ctas, &cs)
              : -3;
  }
  c[2] = ok ? DeviceChooseGatherConsumers(table, g.p, g.cand, g.sh, pl.rank, pl.R, g.max_ctas, &cs) : -3;
  if (threadIdx.x == 0)
    for (int k = 0; k < kGatherDecisions; ++k) ref[k] = c[k];
  __syncthreads();
  for (int k = 0; k < kGatherDecisions; ++k)
    if (c[k] != ref[k]) atomicAdd(&differ, 1);
  __syncthreads();
  if (threadIdx.x == 0)
    for (int k = 0; k < kGatherDecisions; ++k) out[kGatherDecisions * blockIdx.x + k] = differ ? -1 : c[k];
}

// The host's C of a gather_rs call on a valid plan (rows in plan order, ret offsets 0): its table by the host's rule
// (HostTable), then GatherModelSources + ChooseGatherConsumerCtasFromSources with seg_us + ds; -2 where they fail.
int HostGatherChoice(const GatherCall& c, const int32_t* rows, double ds = 0.0) {
  static SegTable h;  // (large)
  ErrorRecord e;
  const std::vector<int32_t> ret(c.plan.E_l * c.plan.R, 0);
  if (!HostTable(c.plan, rows, ret.data(), &h, &e)) return -2;
  std::vector<GatherModelSegment> ms;
  for (int i = 0; i < h.n; ++i) ms.push_back(GatherModelSegment{h.seg[i].rows, h.seg[i].src});
  ModelParams q = c.p;
  q.seg_us += ds;
  std::vector<GatherModelSource> src(c.plan.R);
  const int64_t total = GatherModelSources(q, ms.data(), (int)ms.size(), c.plan.R, c.plan.rank, c.sh.N, src.data());
  return total < 0 ? -2 : ChooseGatherConsumerCtasFromSources(q, src.data(), c.plan.R, total, c.sh, c.max_ctas);
}

// One random gather_rs call: its plan's rows in plan order (expert-major, ret offsets 0; one in 8 of <= 64 segments
// with rows up to 2^23 + 64) and its host choice.
struct GatherDraw {
  GatherCall call;
  std::vector<int32_t> rows;
  int host;
};
GatherDraw DrawGather(std::mt19937_64& g) {
  auto pick = [&](std::initializer_list<int64_t> v) { return *(v.begin() + g() % v.size()); };
  GatherDraw d{};
  const int R = (int)pick({2, 4, 8, 16, 32});
  const int E_l = std::max(1, (int)(g() % (kMaxSegments / R)) + 1);
  const int sms = (int)pick({2, 3, 16, 33, 66, 132});
  // gather_gbps: 0 (the model's 2 cta_gbps) or a calibrated traffic rate per CTA.
  ModelParams p{sms, 1, 128, 256, 2.395217391304346, 0.010803532608695652, 29.56622111004397,
                (double)pick({15, 46, 92, 185, 370, 1745}) + 0.25, 0.4301974372287516, 17.3,
                (double)pick({0, 0, 9, 15, 23, 59}) * 1.0173};
  d.call.p = p;
  d.call.sh = GatherModelShape{pick({1, 64, 1024, 4096}), pick({1, 2, 4, 8, 16}), pick({128, 1024, 4096}),
                               pick({128, 2048, 7168}), pick({2, 4})};
  const int rank = (int)(g() % R);
  d.call.max_ctas = ModelMaxCtas(sms);
  d.call.cand = FillCandidateConsts(p, d.call.max_ctas, d.call.sh.N);
  const int zero_pct = (int)pick({0, 30, 90});
  // (Some calls of <= 64 segments with segments of 2^23 rows and more: the prepared form's fallback.)
  const bool huge = E_l * R <= 64 && g() % 8 == 0;
  int64_t sum = 0;
  for (int e = 0; e < E_l; ++e)
    for (int s = 0; s < R; ++s) {
      const int64_t max_rows = huge ? pick({16, 5000, (1 << 23) + 64}) : pick({16, 300, 5000});
      const int32_t rows = (int)(g() % 100) < zero_pct ? 0 : 1 + (int32_t)(g() % (uint64_t)max_rows);
      d.rows.push_back(rows);
      sum += rows;
    }
  // (One in 4 with a capacity of 2^24 rows more: the table's 64-bit scans.)
  d.call.plan = TablePlan{R, rank, E_l, 0, sum + (g() % 4 == 0 ? 1 << 24 : 0), std::max<int64_t>(sum, 1), 1 << 26,
                          Inputs{}};
  d.host = HostGatherChoice(d.call, d.rows.data());
  return d;
}

// Random gather_rs calls, device against host; returns the count of differences.
int64_t CheckGather(int calls, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<GatherCall> cl;
  std::vector<int32_t> rows;
  std::vector<int> host;
  for (int i = 0; i < calls; ++i) {
    GatherDraw d = DrawGather(g);
    d.call.plan.begin = (int)rows.size();
    rows.insert(rows.end(), d.rows.begin(), d.rows.end());
    cl.push_back(d.call);
    host.push_back(d.host);
  }
  GatherCall* d_calls;
  int* d_out;
  const DevicePlans dp(rows.size(), calls);  // (ret offsets 0)
  dp.Upload(rows, {});
  CK(cudaMalloc(&d_calls, calls * sizeof(GatherCall)));
  CK(cudaMalloc(&d_out, kGatherDecisions * calls * sizeof(int)));
  CK(cudaMemcpy(d_calls, cl.data(), calls * sizeof(GatherCall), cudaMemcpyHostToDevice));
  int64_t wrong = 0;
  std::vector<int> seen(33, 0);
  std::vector<int> dev(kGatherDecisions * calls);
  for (int blk : {kThreads, 384}) {
    CK(cudaMemset(d_out, 0xff, kGatherDecisions * calls * sizeof(int)));  // poisoned: an unwritten entry differs
    (blk == kThreads ? GatherCheckKernel<kThreads> : GatherCheckKernel<384>)<<<calls, blk>>>(d_calls, dp.rows, dp.ret,
                                                                                            dp.gs, dp.pv, d_out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(dev.data(), d_out, kGatherDecisions * calls * sizeof(int), cudaMemcpyDeviceToHost));
    for (int i = 0; i < calls; ++i) {
      if (host[i] >= 0 && host[i] <= 32) seen[host[i]] = 1;
      const TablePlan& pl = cl[i].plan;
      for (int k = 0; k < kGatherDecisions; ++k)
        if ((host[i] < 1 || dev[kGatherDecisions * i + k] != host[i]) && ++wrong <= 20)
          printf("WRONG gather (%d threads, %s): R %d rank %d E_l %d sms %d T %lld Q %lld N %lld K %lld eb %lld "
                 "link %g gather %g: device %d, host %d\n", blk, kGatherDecisionNames[k], pl.R, pl.rank, pl.E_l,
                 cl[i].p.sms, (long long)cl[i].sh.T, (long long)cl[i].sh.Q, (long long)cl[i].sh.N,
                 (long long)cl[i].sh.K, (long long)cl[i].sh.elem_bytes, cl[i].p.link_gbps, cl[i].p.gather_gbps,
                 dev[kGatherDecisions * i + k], host[i]);
    }
  }
  PrintCheck("gather_rs check (BuildSegments<kPrepGather> + DeviceChooseGatherConsumersPrepared twice, then "
             "DeviceChooseGatherConsumers; 256 and 384 threads)", calls, seen, wrong,
             "the host's ChooseGatherConsumerCtasFromSources on every thread");
  cudaFree(d_calls);
  cudaFree(d_out);
  return wrong;
}

// gather_rs's decision timed in one CTA of kThreads threads: `iters` of them (seg_us varies with the iteration's
// parity as in DecisionBenchKernel; the plan arrays re-read from global memory each time, L1/L2 hits after the
// first), out[0] ns, out[1] the sum of the answers (per iteration: C of the choice, plus n + remote_bands of the table
// where the form builds one). kForm (kGatherFormNames):
//   0, 1   the choice alone on a table built before the clock starts: e3dd3a1's (decision_v0.cuh), the library's
//          general form (DeviceChooseGatherConsumers)
//   2, 3   the table (BuildSegments), alone and followed by the general form
//   4, 5   the table with the sources' parts (BuildSegments<kPrepGather>), alone and followed by the prepared form
//          (DeviceChooseGatherConsumersPrepared): ExpertKernel<kGather>'s decision under the model
constexpr int kGatherForms = 6;
const char* const kGatherFormNames[kGatherForms] = {
    "choice, e3dd3a1", "choice", "table", "table + choice", "table with the parts",
    "table with the parts + prepared choice"};
template <int kForm>
__global__ void __launch_bounds__(kThreads) GatherBenchKernel(const GatherCall* call, const int32_t* rows,
                                                             const int32_t* ret_off, GroupShared* gs,
                                                             RankPrivate* pv, int iters, unsigned long long* out) {
  __shared__ SegTable table;
  __shared__ TableScratch sc;
  __shared__ std::conditional_t<kForm == 0, decision_v0::ChoiceScratch, ChoiceScratch> cs;
  __shared__ unsigned long long t0;
  const GatherCall& g = *call;
  const int E_l = g.plan.E_l;
  const int64_t cap = g.plan.cap;
  const RankDev rd = PlanRankDev(g.plan, gs, pv);
  if constexpr (kForm <= 1) BuildSegments(rd, rows, ret_off, E_l, cap, &table, &sc);
  if (threadIdx.x == 0) t0 = Now();
  __syncthreads();
  unsigned long long acc = 0;
  for (int i = 0; i < iters; ++i) {
    const ModelParams q = IterParams(g.p, i);
    const int rank = Vol(g.plan.rank), ranks = Vol(g.plan.R), max_ctas = Vol(g.max_ctas);
    if constexpr (kForm == 0) {
      acc += decision_v0::DeviceChooseGatherConsumers(table, q, g.sh, rank, ranks, max_ctas, &cs, i & 1);
    } else if constexpr (kForm == 1) {
      acc += DeviceChooseGatherConsumers(table, q, g.cand, g.sh, rank, ranks, max_ctas, &cs);
    } else if constexpr (kForm <= 3) {
      const bool ok = BuildSegments(rd, rows, ret_off, E_l, cap, &table, &sc);
      acc += ok ? table.n + table.remote_bands : 1000000;
      if (kForm == 3 && ok) acc += DeviceChooseGatherConsumers(table, q, g.cand, g.sh, rank, ranks, max_ctas, &cs);
    } else {
      const GatherPrepIn in = GatherPrepFor(g.cand, g.sh, rank, &cs);
      TermPrepOut prep{};
      const bool ok = BuildSegments<kPrepGather>(rd, rows, ret_off, E_l, cap, &table, &sc, &in, &prep);
      acc += ok ? table.n + table.remote_bands : 1000000;
      if (kForm == 5 && ok)
        acc += DeviceChooseGatherConsumersPrepared(table, prep, q, g.cand, g.sh, rank, ranks, max_ctas, &cs);
    }
  }
  if (threadIdx.x == 0) {
    out[0] = Now() - t0;
    out[1] = acc;
  }
}

// gather_rs's decision cost at the loopback's meshes (R = 4, 8; E_l = 2, 4 experts: n = E_l R segments) and at 32
// ranks, every form (GatherBenchKernel); returns the count of forms and shapes whose sum is not the host's.
int64_t TimeGather(int iters, int reps) {
  printf("gather_rs: ns per iteration (one CTA of %d threads, %d iters, median of %d), sms 33, T 1024, Q 4, N 4096, "
         "K 7168, bf16, rank 1, rows 400..599:\n| R | segments |", kThreads, iters, reps);
  for (const char* f : kGatherFormNames) printf(" %s |", f);
  printf(" C |\n|---|---|");
  for (int f = 0; f < kGatherForms; ++f) printf("---|");
  printf("---|\n");
  int64_t wrong = 0;
  GatherCall* d_call;
  unsigned long long* d_out;
  const DevicePlans dp(kMaxSegments, 1);  // (ret offsets 0)
  CK(cudaMalloc(&d_call, sizeof(GatherCall)));
  CK(cudaMalloc(&d_out, 2 * sizeof(unsigned long long)));
  decltype(&GatherBenchKernel<0>) const kernels[kGatherForms] = {GatherBenchKernel<0>, GatherBenchKernel<1>,
                                                                 GatherBenchKernel<2>, GatherBenchKernel<3>,
                                                                 GatherBenchKernel<4>, GatherBenchKernel<5>};
  for (auto [R, E_l] : {std::pair{4, 2}, {4, 4}, {8, 2}, {8, 4}, {32, 8}}) {
    std::mt19937 g(5u + R * E_l);
    std::vector<int32_t> rows(E_l * R);
    int64_t sum = 0;
    for (int32_t& r : rows) sum += r = 400 + (int32_t)(g() % 200);
    const ModelParams p{33, 1, 128, 256, 2.395217391304346, 0.010803532608695652, 29.56622111004397, 370.0 / 4,
                        0.4301974372287516, 17.3};
    GatherCall call{p, GatherModelShape{1024, 4, 4096, 7168, 2}, ModelMaxCtas(33), {},
                    TablePlan{R, 1, E_l, 0, sum, sum, 1 << 20, Inputs{}}};
    call.cand = FillCandidateConsts(p, call.max_ctas, call.sh.N);
    // The sums the kernels must give: per iteration C (by seg_us's parity), plus n + remote_bands with a table.
    static SegTable h;
    ErrorRecord eh;
    const std::vector<int32_t> ret(rows.size(), 0);
    const bool host_ok = HostTable(call.plan, rows.data(), ret.data(), &h, &eh);
    const int c0 = HostGatherChoice(call, rows.data()), c1 = HostGatherChoice(call, rows.data(), 1e-12);
    const unsigned long long choices =
        (unsigned long long)((iters + 1) / 2) * c0 + (unsigned long long)(iters / 2) * c1;
    const unsigned long long tables = (unsigned long long)iters * (h.n + h.remote_bands);
    CK(cudaMemcpy(d_call, &call, sizeof call, cudaMemcpyHostToDevice));
    dp.Upload(rows, {});
    printf("| %d | %d |", R, E_l * R);
    for (int f = 0; f < kGatherForms; ++f) {
      const unsigned long long want = (f <= 1 ? 0 : tables) + (f == 2 || f == 4 ? 0 : choices);
      std::vector<double> ns;
      unsigned long long o[2] = {0, 0};
      bool ok = host_ok && c0 > 0 && c1 > 0;
      for (int r = 0; r <= reps; ++r) {
        kernels[f]<<<1, kThreads>>>(d_call, dp.rows, dp.ret, dp.gs, dp.pv, iters, d_out);
        CK(cudaGetLastError());
        CK(cudaMemcpy(o, d_out, sizeof o, cudaMemcpyDeviceToHost));
        ok = ok && o[1] == want;
        if (r > 0) ns.push_back((double)o[0] / iters);
      }
      std::sort(ns.begin(), ns.end());
      wrong += !ok;
      printf(" %.0f%s |", ns[ns.size() / 2], ok ? "" : " WRONG");
      fflush(stdout);
    }
    printf(" %d |\n", c0);
  }
  printf("\n");
  cudaFree(d_call);
  cudaFree(d_out);
  return wrong;
}

// The table build, and the table build followed by the consumer choice (the whole decision of an expert_combine
// call), timed in one CTA: `iters` of them (the plan arrays re-read from global memory each time, L1/L2 hits after the
// first), out[0] ns, out[1] the sum of n + remote_bands + C. kForm: 0 the e3dd3a1 baseline (decision_v0.cuh), 1 the
// library.
template <int kForm, bool kChoose>
__global__ void __launch_bounds__(kThreads) TableBenchKernel(const TablePlan* plan, const int32_t* rows,
                                                            const int32_t* ret_off, const Inputs* inputs,
                                                            GroupShared* gs, RankPrivate* pv, int iters,
                                                            unsigned long long* out) {
  __shared__ SegTable table;
  __shared__ std::conditional_t<kForm == 0, decision_v0::TableScratch, TableScratch> sc;
  __shared__ std::conditional_t<kForm == 0, decision_v0::ChoiceScratch, ChoiceScratch> cs;
  __shared__ unsigned long long t0;
  __shared__ Inputs in;
  const TablePlan& plan_ref = *plan;  // (its scalars to registers: the model is not needed here)
  const struct {
    int E_l;
    int64_t cap;
  } pl{plan_ref.E_l, plan_ref.cap};
  const RankDev rd = PlanRankDev(plan_ref, gs, pv);
  if (threadIdx.x == 0) in = *inputs;
  __syncthreads();
  if (threadIdx.x == 0) t0 = Now();
  __syncthreads();
  unsigned long long acc = 0;
  for (int i = 0; i < iters; ++i) {
    const ModelParams q = IterParams(in.p, i);
    bool ok;
    TermPrepOut prep{};
    if constexpr (kForm == 0) {
      ok = decision_v0::BuildSegments(rd, rows, ret_off, pl.E_l, pl.cap, &table, &sc);
    } else if constexpr (kChoose) {  // as ExpertKernel under the model: the table with the choice's parts
      const TermPrepIn pin = TermPrepFor(q, in.cand, in.N, in.eb, &cs);
      ok = BuildSegments<kPrepTerms>(rd, rows, ret_off, pl.E_l, pl.cap, &table, &sc, &pin, &prep);
    } else {
      ok = BuildSegments(rd, rows, ret_off, pl.E_l, pl.cap, &table, &sc);
    }
    acc += ok ? table.n + table.remote_bands : 1000000;
    if constexpr (kChoose) {
      if (table.remote_bands > 0) {
        if constexpr (kForm == 0)
          acc += decision_v0::DeviceChooseConsumers(table, q, in.cand, in.N, in.K, in.eb, in.max_ctas, &cs, i & 1);
        else
          acc += DeviceChooseConsumersPrepared(table, prep, q, in.cand, in.N, in.K, in.eb, in.max_ctas, &cs, i & 1);
      }
    }
  }
  if (threadIdx.x == 0) {
    out[0] = Now() - t0;
    out[1] = acc;
  }
}

// The library's decision in phases, timed as TableBenchKernel: kPhase 0 the plan entries' loads and barrier 1's scan
// (LoadPlanEntries + ScanSegmentValues<5>, then a barrier so that the next iteration may reuse the scratch; out[1] the
// sum of the kept rows' totals), 1 the table with the choice's parts (BuildSegments<kPrepTerms>; out[1] the sum of n +
// remote_bands), 2 that and the prepared choice (out[1] adds C).
template <int kPhase>
__global__ void __launch_bounds__(kThreads) PhaseBenchKernel(const TablePlan* plan, const int32_t* rows,
                                                            const int32_t* ret_off, const Inputs* inputs,
                                                            GroupShared* gs, RankPrivate* pv, int iters,
                                                            unsigned long long* out) {
  __shared__ SegTable table;
  __shared__ TableScratch sc;
  __shared__ ChoiceScratch cs;
  __shared__ unsigned long long t0;
  __shared__ Inputs in;
  const TablePlan& plan_ref = *plan;
  const int E_l = plan_ref.E_l;
  const int64_t cap = plan_ref.cap;
  const RankDev rd = PlanRankDev(plan_ref, gs, pv);
  if (threadIdx.x == 0) in = *inputs;
  __syncthreads();
  if (threadIdx.x == 0) t0 = Now();
  __syncthreads();
  unsigned long long acc = 0;
  for (int i = 0; i < iters; ++i) {
    const ModelParams q = IterParams(in.p, i);
    const TermPrepIn pin = TermPrepFor(q, in.cand, in.N, in.eb, &cs);
    if constexpr (kPhase == 0) {
      const PlanEntries pe = LoadPlanEntries(rows, ret_off, E_l, rd.ranks);
      int64_t pre[5], total[5];
      ScanSegmentValues<5>(pe.rows > 0 ? pe.rows : 0, pe.rows_q > 0 ? pe.rows_q : 0, pin.tile_m, pin.tile_m_magic, cap,
                           &sc, pre, total);
      acc += (unsigned long long)total[0];
      __syncthreads();
    } else {
      TermPrepOut prep{};
      const bool ok = BuildSegments<kPrepTerms>(rd, rows, ret_off, E_l, cap, &table, &sc, &pin, &prep);
      acc += ok ? table.n + table.remote_bands : 1000000;
      if (kPhase == 2 && ok && table.remote_bands > 0)
        acc += DeviceChooseConsumersPrepared(table, prep, q, in.cand, in.N, in.K, in.eb, in.max_ctas, &cs, i & 1);
    }
  }
  if (threadIdx.x == 0) {
    out[0] = Now() - t0;
    out[1] = acc;
  }
}

// Table build alone and table + consumer choice, the e3dd3a1 baseline and the library, at n = E_l R =
// 16..256 segments (R 8, E_l 2..32; R 32, E_l 8; R 2, E_l 128), sms 132, N 8192, the capacity the plan's rows (the
// table's 32-bit scans), and once at R 8, E_l 32 with a capacity of 2^24 rows (its 64-bit scans); each form's sum
// checked against the host's (HostTable, then HostChoice for either parity of seg_us): returns the count of forms and
// shapes where it differs.
int64_t TimeTables(int iters, int reps) {
  printf("segment table (and table + consumer choice): ns per build (one CTA of %d threads, %d iters, median of %d), "
         "sms 132, N 8192, K 2048, rows 1..2048:\n| R | E_l | segments | table, e3dd3a1 | table | "
         "table + choice, e3dd3a1 | table + choice |\n|---|---|---|---|---|---|---|\n",
         kThreads, iters, reps);
  int64_t wrong = 0;
  TablePlan* d_pl;
  Inputs* d_in;
  unsigned long long* d_out;
  const DevicePlans dp(kMaxSegments, 1);
  CK(cudaMalloc(&d_pl, sizeof(TablePlan)));
  CK(cudaMalloc(&d_in, sizeof(Inputs)));
  CK(cudaMalloc(&d_out, 2 * sizeof(unsigned long long)));
  const ModelParams p{132, 1, 128, 256, 2.395217391304346, 0.010803532608695652, 29.56622111004397,
                      1744.7158381863562, 0.4301974372287516};
  const Inputs in{p, FillCandidateConsts(p, ModelMaxCtas(132), 8192), 8192, 2048, 2, ModelMaxCtas(132)};
  CK(cudaMemcpy(d_in, &in, sizeof in, cudaMemcpyHostToDevice));
  struct Shape {
    int R, E_l;
    int64_t cap;  // 0: the plan's rows
  };
  std::vector<std::string> phases;  // the library's phase rows, printed after the table
  for (auto [R, E_l, cap] : {Shape{8, 2, 0}, {8, 8, 0}, {8, 16, 0}, {8, 32, 0}, {32, 8, 0}, {2, 128, 0},
                             {8, 32, 1 << 24}}) {
    std::mt19937 g(91u + R * E_l);
    std::vector<int32_t> rows(E_l * R), ret(E_l * R);
    int64_t sum = 0;
    for (int j = 0; j < E_l * R; ++j) {
      rows[j] = 1 + (int32_t)(g() % 2048);
      ret[j] = 0;
      sum += rows[j];
    }
    const TablePlan pl{R, 1 % R, E_l, 0, cap > 0 ? cap : sum, 4096, 1 << 20};
    // The sums the kernels must give: per iteration n + remote_bands, plus C where remote_bands > 0.
    static SegTable h;
    ErrorRecord eh;
    unsigned long long want[2] = {0, 0};
    if (HostTable(pl, rows.data(), ret.data(), &h, &eh)) {
      const Table t{std::vector<Segment>(h.seg, h.seg + h.n), h.remote_segs};
      int c[2] = {0, 0};
      for (int k = 0; k < 2 && h.remote_bands > 0; ++k) {
        ModelParams q = p;
        q.seg_us += (double)k * 1e-12;
        c[k] = HostChoice(t, q, in.N, in.K, in.eb, in.max_ctas);
      }
      want[0] = (unsigned long long)iters * (h.n + h.remote_bands);
      want[1] = want[0] + (unsigned long long)((iters + 1) / 2) * c[0] + (unsigned long long)(iters / 2) * c[1];
    }
    CK(cudaMemcpy(d_pl, &pl, sizeof pl, cudaMemcpyHostToDevice));
    dp.Upload(rows, ret);
    // f: table alone (e3dd3a1, library), then table + choice (the same two).
    constexpr int kF = 4;
    decltype(&TableBenchKernel<0, false>) const kernels[kF] = {TableBenchKernel<0, false>, TableBenchKernel<1, false>,
                                                               TableBenchKernel<0, true>, TableBenchKernel<1, true>};
    double med[kF];
    unsigned long long sums[kF];
    for (int f = 0; f < kF; ++f) {
      std::vector<double> ns;
      unsigned long long o[2];
      for (int r = 0; r <= reps; ++r) {
        auto k = kernels[f];
        k<<<1, kThreads>>>(d_pl, dp.rows, dp.ret, d_in, dp.gs, dp.pv, iters, d_out);
        CK(cudaGetLastError());
        CK(cudaMemcpy(o, d_out, sizeof o, cudaMemcpyDeviceToHost));
        if (r > 0) ns.push_back((double)o[0] / iters);
      }
      std::sort(ns.begin(), ns.end());
      med[f] = ns[ns.size() / 2];
      sums[f] = o[1];
    }
    bool ok[kF];
    for (int f = 0; f < kF; ++f) {
      ok[f] = want[0] > 0 && sums[f] == want[f / 2];
      wrong += !ok[f];
    }
    printf("| %d | %d | %d%s |", R, E_l, E_l * R, cap > 0 ? " (cap 2^24)" : "");
    for (int f = 0; f < kF; ++f) printf(" %.0f%s |", med[f], ok[f] ? "" : " WRONG");
    printf("\n");
    // The library's phases (PhaseBenchKernel), each sum checked: the kept rows' total, then as the table's forms.
    {
      unsigned long long rows_sum = 0;
      for (int32_t r : rows) rows_sum += (unsigned long long)(r > 0 ? r : 0);
      const unsigned long long pwant[3] = {(unsigned long long)iters * rows_sum, want[0], want[1]};
      decltype(&PhaseBenchKernel<0>) const pk[3] = {PhaseBenchKernel<0>, PhaseBenchKernel<1>, PhaseBenchKernel<2>};
      char line[256];
      int len = snprintf(line, sizeof line, "| %d | %d | %d%s |", R, E_l, E_l * R, cap > 0 ? " (cap 2^24)" : "");
      for (int f = 0; f < 3; ++f) {
        std::vector<double> ns;
        unsigned long long o[2] = {0, 0};
        for (int r = 0; r <= reps; ++r) {
          pk[f]<<<1, kThreads>>>(d_pl, dp.rows, dp.ret, d_in, dp.gs, dp.pv, iters, d_out);
          CK(cudaGetLastError());
          CK(cudaMemcpy(o, d_out, sizeof o, cudaMemcpyDeviceToHost));
          if (r > 0) ns.push_back((double)o[0] / iters);
        }
        std::sort(ns.begin(), ns.end());
        const bool pok = want[0] > 0 && o[1] == pwant[f];
        wrong += !pok;
        len += snprintf(line + len, sizeof line - len, " %.0f%s |", ns[ns.size() / 2], pok ? "" : " WRONG");
      }
      phases.push_back(line);
    }
  }
  printf("\nthe library's decision in phases, ns per iteration (the same shapes and method):\n| R | E_l | segments | "
         "plan loads + barrier 1's scan (+ a barrier) | table with the choice's parts | table + choice |\n"
         "|---|---|---|---|---|---|\n");
  for (const std::string& l : phases) printf("%s\n", l.c_str());
  printf("\n");
  cudaFree(d_pl);
  cudaFree(d_in);
  cudaFree(d_out);
  return wrong;
}

int HostChoice(const Table& t, const ModelParams& p, int64_t N, int64_t K, int64_t eb, int max_ctas) {
  std::vector<ModelSegment> ms(t.seg.size());
  std::vector<ModelPrefix> scratch(t.seg.size() + 1);
  for (size_t i = 0; i < ms.size(); ++i) ms[i] = ModelSegment{t.seg[i].rows, (int)i < t.mr ? 1 : 0};
  return ChooseConsumerCtas(p, ms.data(), (int)ms.size(), N, K, eb, max_ctas, scratch.data());
}
}  // namespace

int main(int argc, char** argv) {
  int iters = 1000, reps = 5, seeds = 12;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--iters")) iters = std::max(2, atoi(argv[i + 1]));
    else if (!strcmp(argv[i], "--reps")) reps = std::max(1, atoi(argv[i + 1]));
    else if (!strcmp(argv[i], "--seeds")) seeds = std::max(1, atoi(argv[i + 1]));
    else { fprintf(stderr, "usage: %s [--iters I] [--reps R] [--seeds S]\n", argv[0]); return 2; }
  }
  const int64_t K = 2048, eb = 2;  // nvidia_h200.json; sms per configuration (66: a loopback rank's budget, 132)
  auto params = [](int sms, double ds) {
    return ModelParams{sms, 1, 128, 256, 2.395217391304346, 0.010803532608695652, 29.56622111004397,
                       1744.7158381863562, 0.4301974372287516 + ds};
  };
  auto host = [&](const Table& t, int sms, int64_t N, double ds) {
    return HostChoice(t, params(sms, ds), N, K, eb, ModelMaxCtas(sms));
  };
  Segment* d_seg;
  Inputs* d_in;
  unsigned long long* d_out;
  std::vector<unsigned long long> out(2 * kForms * 5);
  CK(cudaMalloc(&d_seg, kMaxSegments * sizeof(Segment)));
  CK(cudaMalloc(&d_in, sizeof(Inputs)));
  CK(cudaMalloc(&d_out, out.size() * sizeof(out[0])));
  // Table t and the inputs of (sms, N) to the device, outputs zeroed.
  auto upload = [&](const Table& t, int sms, int64_t N) {
    const ModelParams p = params(sms, 0);
    const Inputs in{p, FillCandidateConsts(p, ModelMaxCtas(sms), N), N, K, eb, ModelMaxCtas(sms)};
    CK(cudaMemcpy(d_seg, t.seg.data(), t.seg.size() * sizeof(Segment), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_in, &in, sizeof in, cudaMemcpyHostToDevice));
    CK(cudaMemset(d_out, 0, out.size() * sizeof(out[0])));
  };
  // Form f with blk threads, `it` iterations, into d_out + slot * 5.
  auto launch = [&](int f, int blk, const Table& t, int it, int slot) {
    kKernels[blk == kThreads ? 0 : 1][f]<<<1, blk>>>(d_seg, (int)t.seg.size(), t.mr, d_in, it, d_out + slot * 5);
    CK(cudaGetLastError());
  };
  auto fetch = [&] { CK(cudaMemcpy(out.data(), d_out, out.size() * sizeof(out[0]), cudaMemcpyDeviceToHost)); };

  // 1. Check: both forms, 256 and 384 threads, iterations 0 and 1 against the host. Seeds s % 6 == 5 draw rows up to
  // 2^24: outside the chunked form's exactness bounds, so DeviceChooseConsumers takes its fallback.
  std::mt19937_64 g(7);
  int64_t wrong = 0, tables = 0;
  for (int n : {1, 5, 16, 33, 64, 100, 128, 200, 256})
    for (int s = 0; s < seeds; ++s)
      for (int sms : {24, 66, 132})
        for (int64_t N : {4096, 8192}) {
          const int mr = s == 0 ? n : s == 1 ? 0 : (int)(g() % (n + 1));
          const int max_rows[] = {16, 128, 512, 2048, 8192, 1 << 24};
          const Table t = MakeTable(n, mr, max_rows[s % 6], 1000u * n + s);
          const int h0 = host(t, sms, N, 0), h1 = host(t, sms, N, 1e-12);
          upload(t, sms, N);
          for (int v = 0; v < 2 * kForms; ++v) launch(v % kForms, v < kForms ? kThreads : 384, t, 2, v);
          fetch();
          ++tables;
          for (int v = 0; v < 2 * kForms; ++v) {
            const unsigned long long* o = &out[v * 5];
            if ((o[2] != (unsigned)h0 || o[3] != (unsigned)h1 || o[4] != 0) && ++wrong <= 20)
              printf("WRONG %s (%d threads): n %d mr %d sms %d N %lld seed %d: C %llu, %llu (host %d, %d), %llu "
                     "threads differ\n", kNames[v % kForms], v < kForms ? kThreads : 384, n, mr, sms, (long long)N, s,
                     o[2], o[3], h0, h1, o[4]);
          }
        }
  printf("check: %lld tables x %d forms x 2 block sizes: %s\n", (long long)tables, kForms,
         wrong ? "WRONG" : "every choice identical to the host's ChooseConsumerCtas");
  wrong += CheckTables(4000, 17);
  wrong += CheckPushers(20000, 11);
  wrong += CheckGather(4000, 13);
  printf("\n");
  wrong += TimeGather(iters, reps);
  wrong += TimeTables(iters, reps);

  // 2. Timing: one CTA of kThreads threads, `iters` decisions per launch, median of `reps` launches (after a warm-up).
  for (int sms : {66, 132}) {
    const int64_t N = sms == 66 ? 4096 : 8192;
    const int sizes[] = {16, 64, 128, 256};
    printf("ns per decision, sms %d, N %lld, K %lld, mr = 3n/4 remote, rows 1..2048, %d iters, median of %d:\n", sms,
           (long long)N, (long long)K, iters, reps);
    printf("| form | n=16 | n=64 | n=128 | n=256 |\n|---|---|---|---|---|\n");
    std::vector<Table> ts;
    std::vector<unsigned long long> want;
    for (int n : sizes) {
      ts.push_back(MakeTable(n, 3 * n / 4, 2048, 77u + n));
      want.push_back((unsigned long long)((iters + 1) / 2) * host(ts.back(), sms, N, 0) +
                     (unsigned long long)(iters / 2) * host(ts.back(), sms, N, 1e-12));
    }
    for (int f = 0; f < kForms; ++f) {
      printf("| %s |", kNames[f]);
      for (size_t i = 0; i < ts.size(); ++i) {
        std::vector<double> ns;
        bool ok = true;
        for (int r = 0; r <= reps; ++r) {
          upload(ts[i], sms, N);
          launch(f, kThreads, ts[i], iters, 0);
          fetch();
          ok = ok && out[1] == want[i] && out[4] == 0;
          if (r > 0) ns.push_back((double)out[0] / iters);
        }
        std::sort(ns.begin(), ns.end());
        wrong += !ok;
        printf(" %.0f%s |", ns[ns.size() / 2], ok ? "" : " WRONG");
        fflush(stdout);
      }
      printf("\n");
    }
    printf("| (chosen C) |");
    for (const Table& t : ts) printf(" %d |", host(t, sms, N, 0));
    printf("\n\n");
  }
  return wrong ? 1 : 0;
}
