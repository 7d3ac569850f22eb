#include "cuda/workspace.h"
#include "common/error_text.h"
#include "common/registry.h"

#include "cuda/api.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>

namespace jmo::cuda {

Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status{};
  return Status::Error(kInternal, std::string("jax_moe_overlap: ") + what + " failed: " + cudaGetErrorName(err) +
                                      " (" + cudaGetErrorString(err) + ")");
}

#define JMO_RETURN_IF_CUDA(expr)                                \
  do {                                                          \
    Status s_ = CudaStatus((expr), #expr);                      \
    if (!s_.ok()) return s_;                                    \
  } while (0)

namespace {

// Restores the calling thread's current device (XLA's, or the caller's) on scope exit.
struct DeviceGuard {
  int saved = -1;
  DeviceGuard() { cudaGetDevice(&saved); }
  ~DeviceGuard() {
    if (saved >= 0) cudaSetDevice(saved);
  }
};

}  // namespace

Status Workspace::Create(int ranks, int groups, const std::vector<int>& ordinals, WorkspaceSizes sizes,
                         int consumer_ctas, int sm_budget, const ModelParams* model,
                         std::unique_ptr<Workspace>* out) {
  if (ranks < 1 || ranks > kMaxRanks || groups < 1)
    return Status::Error(kInvalidArgument, "jax_moe_overlap: CUDA workspaces support 1.." + std::to_string(kMaxRanks) +
                                               " ranks per group, got " + std::to_string(ranks));
  if ((int64_t)ordinals.size() != (int64_t)ranks * groups)
    return Status::Error(kInvalidArgument, "jax_moe_overlap: need one device ordinal per (group, rank)");
  if (sizes.row_bytes < 1 || sizes.recv_rows < 0 || sizes.ret_rows < 0 || sizes.max_bands < 1)
    return Status::Error(kInvalidArgument, "jax_moe_overlap: invalid workspace sizes");
  if (model != nullptr) {
    std::string bad = CheckModelParams(*model);
    if (!bad.empty()) return Status::Error(kInvalidArgument, "jax_moe_overlap: resource model parameters: " + bad);
  }
  DeviceGuard guard;
  int count = 0;
  JMO_RETURN_IF_CUDA(cudaGetDeviceCount(&count));
  for (int o : ordinals)
    if (o < 0 || o >= count)
      return Status::Error(kInvalidArgument, "jax_moe_overlap: device ordinal " + std::to_string(o) +
                                                 " outside the " + std::to_string(count) + " visible CUDA devices");
  // Peer access between every pair of distinct devices of a group: kernels store straight into peers' blocks.
  for (int g = 0; g < groups; ++g) {
    for (int a = 0; a < ranks; ++a) {
      for (int b = 0; b < ranks; ++b) {
        const int da = ordinals[g * ranks + a], db = ordinals[g * ranks + b];
        if (da == db) continue;
        int can = 0;
        JMO_RETURN_IF_CUDA(cudaDeviceCanAccessPeer(&can, da, db));
        if (!can)
          return Status::Error(kFailedPrecondition,
                               "jax_moe_overlap: CUDA device " + std::to_string(da) + " cannot access the memory of device " +
                                   std::to_string(db) + " (cudaDeviceCanAccessPeer = 0); the expert-parallel axis needs "
                                   "peer access (NVLink or PCIe P2P) between all of its GPUs");
        JMO_RETURN_IF_CUDA(cudaSetDevice(da));
        cudaError_t e = cudaDeviceEnablePeerAccess(db, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();  // XLA enabled it already: fine
        } else if (e != cudaSuccess) {
          return CudaStatus(e, "cudaDeviceEnablePeerAccess");
        }
      }
    }
  }
  std::unique_ptr<Workspace> ws(new Workspace());
  ws->ranks_ = ranks;
  ws->groups_ = groups;
  ws->sizes_ = sizes;
  ws->layout_ = MakeLayout(sizes);
  ws->ordinals_ = ordinals;
  std::map<int, int> ranks_on_device;
  for (int o : ordinals) ++ranks_on_device[o];
  for (const auto& [o, n] : ranks_on_device) {
    JMO_RETURN_IF_CUDA(cudaSetDevice(o));
    Status st = PrepareKernels(o);
    if (!st.ok()) return st;
  }
  int min_budget = 1 << 30;
  for (int o : ordinals) {
    int sms = 0;
    JMO_RETURN_IF_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, o));
    int b = sm_budget > 0 ? sm_budget : std::max(2, sms / ranks_on_device[o]);
    ws->budget_.push_back(b);
    min_budget = std::min(min_budget, b);
  }
  if (min_budget < 2)
    return Status::Error(kInvalidArgument, "jax_moe_overlap: each rank needs at least 2 CTAs (a consumer and a producer)");
  ws->consumer_ctas_ = std::clamp(consumer_ctas, 1, min_budget - 1);
  if (model != nullptr) {
    ws->has_model_ = true;
    ws->model_ = *model;
  }
  // The caller's destructor frees whatever was allocated if a later step fails.
  for (int i = 0; i < ranks * groups; ++i) {
    JMO_RETURN_IF_CUDA(cudaSetDevice(ordinals[i]));
    void* p = nullptr;
    JMO_RETURN_IF_CUDA(cudaMalloc(&p, ws->layout_.total));
    ws->blocks_.push_back(static_cast<char*>(p));
    JMO_RETURN_IF_CUDA(cudaMemset(p, 0, ws->layout_.total));
    JMO_RETURN_IF_CUDA(cudaMalloc(&p, sizeof(RankPrivate)));
    ws->priv_.push_back(static_cast<RankPrivate*>(p));
    JMO_RETURN_IF_CUDA(cudaMemset(p, 0, sizeof(RankPrivate)));
    JMO_RETURN_IF_CUDA(cudaMalloc(&p, BandCounterBytes(sizes.max_bands)));
    ws->band_done_.push_back(static_cast<uint32_t*>(p));
    JMO_RETURN_IF_CUDA(cudaMemset(p, 0, BandCounterBytes(sizes.max_bands)));
    JMO_RETURN_IF_CUDA(cudaDeviceSynchronize());
  }
  for (int g = 0; g < groups; ++g) {
    void* p = nullptr;
    const int64_t bytes = GroupSharedBytes(ranks);
    // Portable: mapped into every device's address space (UVA: the same pointer everywhere).
    JMO_RETURN_IF_CUDA(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(p, 0, bytes);
    void* dp = nullptr;
    JMO_RETURN_IF_CUDA(cudaHostGetDevicePointer(&dp, p, 0));
    if (dp != p) return Status::Error(kInternal, "jax_moe_overlap: host-mapped memory without unified addressing");
    ws->shared_.push_back(static_cast<char*>(p));
    ws->barriers_.push_back(std::make_unique<Barrier>());
  }
  *out = std::move(ws);
  return Status{};
}

Workspace::~Workspace() {
  DeviceGuard guard;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    cudaSetDevice(ordinals_[i]);
    cudaFree(blocks_[i]);
  }
  for (size_t i = 0; i < priv_.size(); ++i) {
    cudaSetDevice(ordinals_[i]);
    cudaFree(priv_[i]);
  }
  for (size_t i = 0; i < band_done_.size(); ++i) {
    cudaSetDevice(ordinals_[i]);
    cudaFree(band_done_[i]);
  }
  for (char* s : shared_) cudaFreeHost(s);
  cudaGetLastError();  // at process exit the context may be gone already; nothing to report to
}

RankDev Workspace::Dev(int g, int r) const {
  RankDev d{};
  for (int i = 0; i < ranks_; ++i) d.peers.base[i] = blocks_[g * ranks_ + i];
  d.layout = layout_;
  d.sizes = sizes_;
  d.shared = shared(g);
  d.priv = priv_[g * ranks_ + r];
  d.band_done = band_done_[g * ranks_ + r];
  d.producers_done = reinterpret_cast<uint64_t*>(d.band_done + BandCounterWords(sizes_.max_bands));
  d.tile_claims = reinterpret_cast<unsigned*>(d.producers_done + 1);
  d.rank = r;
  d.group = g;
  d.ranks = ranks_;
  return d;
}

int Workspace::min_budget() const {
  int b = 1 << 30;
  for (int v : budget_) b = std::min(b, v);
  return b;
}

Status Workspace::ReadPrivate(int g, int r, cudaStream_t stream, RankPrivate* out) const {
  if (g < 0 || g >= groups_ || r < 0 || r >= ranks_)
    return Status::Error(kInvalidArgument, "jax_moe_overlap: no rank " + std::to_string(r) + " of group " +
                                               std::to_string(g) + " in this workspace");
  if (stream != nullptr) JMO_RETURN_IF_CUDA(cudaStreamSynchronize(stream));
  DeviceGuard guard;
  JMO_RETURN_IF_CUDA(cudaSetDevice(ordinals_[g * ranks_ + r]));
  if (stream == nullptr) JMO_RETURN_IF_CUDA(cudaDeviceSynchronize());
  JMO_RETURN_IF_CUDA(cudaMemcpy(out, priv_[g * ranks_ + r], sizeof(RankPrivate), cudaMemcpyDeviceToHost));
  return Status{};
}

Status Workspace::FindByOrdinal(int ordinal, int* g, int* r) const {
  int found = 0;
  for (int i = 0; i < ranks_ * groups_; ++i) {
    if (ordinals_[i] != ordinal) continue;
    if (found++ == 0) {
      *g = i / ranks_;
      *r = i % ranks_;
    }
  }
  if (found == 1) return Status{};
  // String concatenation, not iostreams, as DescribeRecord (common/error_text.h) says why.
  std::string msg = "jax_moe_overlap: the custom call runs on CUDA device " + std::to_string(ordinal) +
                    " but the workspace's devices are [";
  for (size_t i = 0; i < ordinals_.size(); ++i) msg += (i ? ", " : "") + std::to_string(ordinals_[i]);
  msg += "]";
  if (found > 1) msg += " (several ranks share this device: only the loopback test harness may do that)";
  return Status::Error(kFailedPrecondition, msg);
}

void Workspace::RaiseAbort(int g) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  reinterpret_cast<volatile uint64_t*>(&shared(g)->abort.value)[0] = 1;
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

Status Workspace::RecoverIfAborted(int g, int r, cudaStream_t stream, const char* op, int64_t timeout_ms) {
  GroupShared* gs = shared(g);
  const volatile uint64_t* abort = &gs->abort.value;
  const volatile uint64_t* mine = &gs->errors[r].code;
  if (*abort == 0 && *mine == 0) return Status{};
  // Our own kernels are bounded (and see the abort word), so this returns.
  JMO_RETURN_IF_CUDA(cudaStreamSynchronize(stream));
  Barrier& bar = *barriers_[g];
  std::vector<ErrorRecord> records;
  {
    std::unique_lock<std::mutex> lock(bar.mu);
    const uint64_t gen = bar.generation;
    if (++bar.arrived == ranks_) {
      // Every rank of the group is here with an idle stream: nothing reads or writes group memory. Reset it all.
      bar.records.assign(gs->errors, gs->errors + ranks_);
      DeviceGuard guard;
      Status st;
      for (int i = 0; i < ranks_ && st.ok(); ++i) {
        const int idx = g * ranks_ + i;
        st = CudaStatus(cudaSetDevice(ordinals_[idx]), "cudaSetDevice");
        if (st.ok()) st = CudaStatus(cudaMemset(blocks_[idx], 0, layout_.recv), "cudaMemset(control)");
        if (st.ok()) st = CudaStatus(cudaMemset(priv_[idx], 0, sizeof(RankPrivate)), "cudaMemset(private)");
        if (st.ok()) st = CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      }
      std::memset(gs, 0, GroupSharedBytes(ranks_));
      std::atomic_thread_fence(std::memory_order_seq_cst);
      bar.arrived = 0;
      ++bar.generation;
      bar.cv.notify_all();
      if (!st.ok()) return st;
    } else if (!bar.cv.wait_until(lock, std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms),
                                  [&] { return bar.generation != gen; })) {
      const int arrived = bar.arrived--;
      return Status::Error(kDeadlineExceeded,
                           std::string("jax_moe_overlap.") + op + ": rank " + std::to_string(r) + " (group " +
                               std::to_string(g) + ") waited " + std::to_string(timeout_ms) +
                               " ms at the recovery barrier after an earlier failure; only " +
                               std::to_string(arrived) + " of " + std::to_string(ranks_) + " ranks arrived");
    }
    records = bar.records;
  }
  // Every rank reports the group's first failure (FirstRecord), and its own when it had a different one.
  const ErrorRecord* pick = FirstRecord(records);
  std::string msg = std::string("jax_moe_overlap.") + op + ": an earlier call failed (reported by the next call; " +
                    "the group has been reset and the call after this one runs normally): ";
  if (pick == nullptr)
    return Status::Error(kFailedPrecondition,
                         msg + "a call of group " + std::to_string(g) + " failed validation on the host of some rank");
  msg += "first failure: " + FormatRecord(*pick, g, ranks_, timeout_ms);
  if (records[r].code != 0 && pick != &records[r])
    msg += "; this rank's own failure: " + FormatRecord(records[r], g, ranks_, timeout_ms);
  return Status::Error(pick->code == kStageBadInput ? kInvalidArgument : kDeadlineExceeded, msg);
}

// The kernels record failures without a cross-GPU atomic (host-mapped memory has none over PCIe), so the first is
// chosen by rule: a bad input before a timeout (a timeout is usually a consequence of a peer's failure), then the
// earliest epoch, then the lowest rank.
const ErrorRecord* FirstRecord(const std::vector<ErrorRecord>& records) {
  const ErrorRecord* pick = nullptr;
  auto key = [](const ErrorRecord& e) { return std::make_pair(e.code == kStageBadInput ? 0 : 1, e.epoch); };
  for (const ErrorRecord& e : records)
    if (e.code != 0 && e.code != kStageAbortedByPeer && (pick == nullptr || key(e) < key(*pick))) pick = &e;
  return pick;
}

std::string FormatRecord(const ErrorRecord& e, int group, int ranks, int64_t timeout_ms) {
  ErrorRecord r = e;
  if (r.timeout_ms == 0) r.timeout_ms = static_cast<uint64_t>(timeout_ms);
  return DescribeRecord(r, group, ranks);
}

// ---------------------------------------------------------------------------------------------------------------
// Registry

namespace {
HandleRegistry<Workspace>& Registry() {
  static auto* r = new HandleRegistry<Workspace>(kHandleBase);
  return *r;
}
}  // namespace

int64_t RegisterWorkspace(std::unique_ptr<Workspace> ws) { return Registry().Add(std::move(ws)); }
Workspace* LookupWorkspace(int64_t handle) { return Registry().Find(handle); }
bool ReleaseWorkspace(int64_t handle) { return Registry().Remove(handle); }

}  // namespace jmo::cuda
