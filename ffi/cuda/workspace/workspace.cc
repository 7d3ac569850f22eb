#include "common/error_text.h"
#include "common/group_barrier.h"
#include "common/registry.h"
#include "cuda/workspace/workspace.h"

#include "cuda/api.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <thread>

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

// Restores the calling thread's current device (XLA's, or the caller's) at scope exit. Its runtime calls cannot
// report (a constructor's query, a destructor): a failure is cleared rather than left as the thread's last error,
// which a later launch check would blame on its kernel; a failed query restores nothing.
struct DeviceGuard {
  int saved = -1;
  DeviceGuard() {
    if (cudaGetDevice(&saved) != cudaSuccess) {
      saved = -1;
      (void)cudaGetLastError();
    }
  }
  ~DeviceGuard() {
    if (saved >= 0 && cudaSetDevice(saved) != cudaSuccess) (void)cudaGetLastError();
  }
};

// Waits until `stream` has run the work queued on it, at most until `deadline`: the recovery's waits are bounded
// like every other, as the stream may hold work that no timeout of this library bounds (another library's
// collective whose peer is gone). Polls cudaStreamQuery; its "not ready" is not left as the thread's last error,
// which a later launch check would blame on its kernel. DeadlineExceeded with `what` when the deadline passes.
Status DrainStream(cudaStream_t stream, std::chrono::steady_clock::time_point deadline, const std::string& what) {
  for (;;) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess) return Status{};
    if (e != cudaErrorNotReady) return CudaStatus(e, "cudaStreamQuery");
    if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
    if (std::chrono::steady_clock::now() >= deadline) return Status::Error(kDeadlineExceeded, what);
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

// Zeroes `bytes` at `p` on the current device by a stream of its own (no implicit synchronization with other work on
// the device, which a memset on the legacy default stream or cudaDeviceSynchronize would wait for without bound), and
// waits for it until `deadline`.
Status ZeroBounded(void* p, size_t bytes, std::chrono::steady_clock::time_point deadline, const std::string& what) {
  cudaStream_t s = nullptr;
  JMO_RETURN_IF_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Status st = CudaStatus(cudaMemsetAsync(p, 0, bytes, s), "cudaMemsetAsync");
  if (st.ok()) st = DrainStream(s, deadline, what);
  const Status destroyed = CudaStatus(cudaStreamDestroy(s), "cudaStreamDestroy");
  return st.ok() ? destroyed : st;
}

// Peer access from device `from` to device `to`'s memory, after checking that the pair has it.
Status EnablePeerAccess(int from, int to) {
  if (from == to) return Status{};  // a device reaches its own memory (and other processes' on it, through IPC)
  int can = 0;
  JMO_RETURN_IF_CUDA(cudaDeviceCanAccessPeer(&can, from, to));
  if (!can)
    return Status::Error(kFailedPrecondition,
                         "jax_moe_overlap: CUDA device " + std::to_string(from) +
                             " cannot access the memory of device " + std::to_string(to) +
                             " (cudaDeviceCanAccessPeer = 0); the expert-parallel axis needs peer access (NVLink or "
                             "PCIe P2P) between all of its GPUs");
  DeviceGuard guard;
  JMO_RETURN_IF_CUDA(cudaSetDevice(from));
  cudaError_t e = cudaDeviceEnablePeerAccess(to, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();  // XLA (or an earlier workspace) enabled it already: fine
    return Status{};
  }
  return CudaStatus(e, "cudaDeviceEnablePeerAccess");
}

}  // namespace

Status Workspace::Create(int ranks, int groups, const std::vector<int>& ordinals, WorkspaceSizes sizes,
                         int consumer_ctas, int sm_budget, const ModelParams* model,
                         std::unique_ptr<Workspace>* out, const Sharing* sharing) {
  if (ranks < 1 || ranks > kMaxRanks || groups < 1)
    return Status::Error(kInvalidArgument, "jax_moe_overlap: CUDA workspaces support 1.." + std::to_string(kMaxRanks) +
                                               " ranks per group, got " + std::to_string(ranks));
  if ((int64_t)ordinals.size() != (int64_t)ranks * groups)
    return Status::Error(kInvalidArgument, "jax_moe_overlap: need one device ordinal per (group, rank)");
  if (sharing != nullptr && (int64_t)sharing->process.size() != (int64_t)ranks * groups)
    return Status::Error(kInvalidArgument, "jax_moe_overlap: the process table needs one entry per (group, rank)");
  if (sizes.row_bytes < 1 || sizes.recv_rows < 0 || sizes.ret_rows < 0 || sizes.max_bands < 1)
    return Status::Error(kInvalidArgument, "jax_moe_overlap: invalid workspace sizes");
  if (model != nullptr) {
    std::string bad = CheckModelParams(*model);
    if (!bad.empty()) return Status::Error(kInvalidArgument, "jax_moe_overlap: resource model parameters: " + bad);
  }
  std::unique_ptr<Workspace> ws(new Workspace());
  ws->ranks_ = ranks;
  ws->groups_ = groups;
  ws->sizes_ = sizes;
  ws->layout_ = MakeLayout(sizes);
  ws->ordinals_ = ordinals;
  if (sharing != nullptr) {
    ws->process_ = sharing->process;
    ws->here_ = sharing->here;
    ws->prefix_ = sharing->prefix;
  }
  DeviceGuard guard;
  int count = 0;
  JMO_RETURN_IF_CUDA(cudaGetDeviceCount(&count));
  for (int i = 0; i < ranks * groups; ++i)
    if (ws->Local(i / ranks, i % ranks) && (ordinals[i] < 0 || ordinals[i] >= count))
      return Status::Error(kInvalidArgument, "jax_moe_overlap: device ordinal " + std::to_string(ordinals[i]) +
                                                 " outside the " + std::to_string(count) + " visible CUDA devices");
  // Peer access between every pair of distinct devices of this process in a group: kernels store straight into
  // peers' blocks (the devices of other processes' ranks: OpenPeers).
  for (int g = 0; g < groups; ++g) {
    for (int a = 0; a < ranks; ++a) {
      for (int b = 0; b < ranks; ++b) {
        if (!ws->Local(g, a) || !ws->Local(g, b)) continue;
        Status st = EnablePeerAccess(ordinals[g * ranks + a], ordinals[g * ranks + b]);
        if (!st.ok()) return st;
      }
    }
  }
  std::map<int, int> ranks_on_device;
  for (int i = 0; i < ranks * groups; ++i)
    if (ws->Local(i / ranks, i % ranks)) ++ranks_on_device[ordinals[i]];
  for (const auto& [o, n] : ranks_on_device) {
    JMO_RETURN_IF_CUDA(cudaSetDevice(o));
    Status st = PrepareKernels(o);
    if (!st.ok()) return st;
  }
  int min_budget = 1 << 30;
  for (int i = 0; i < ranks * groups; ++i) {
    if (!ws->Local(i / ranks, i % ranks)) {
      ws->budget_.push_back(0);
      continue;
    }
    int sms = 0;
    JMO_RETURN_IF_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ordinals[i]));
    int b = sm_budget > 0 ? sm_budget : std::max(2, sms / ranks_on_device[ordinals[i]]);
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
  // The destructor frees whatever was allocated if a later step fails.
  ws->blocks_.assign(ranks * groups, nullptr);
  ws->access_dev_ = ordinals;
  ws->opened_.assign(ranks * groups, false);
  ws->priv_.assign(ranks * groups, nullptr);
  ws->band_done_.assign(ranks * groups, nullptr);
  for (int i = 0; i < ranks * groups; ++i) {
    if (!ws->Local(i / ranks, i % ranks)) continue;
    JMO_RETURN_IF_CUDA(cudaSetDevice(ordinals[i]));
    void* p = nullptr;
    JMO_RETURN_IF_CUDA(cudaMalloc(&p, ws->layout_.total));
    ws->blocks_[i] = static_cast<char*>(p);
    JMO_RETURN_IF_CUDA(cudaMemset(p, 0, ws->layout_.total));
    JMO_RETURN_IF_CUDA(cudaMalloc(&p, sizeof(RankPrivate)));
    ws->priv_[i] = static_cast<RankPrivate*>(p);
    JMO_RETURN_IF_CUDA(cudaMemset(p, 0, sizeof(RankPrivate)));
    JMO_RETURN_IF_CUDA(cudaMalloc(&p, BandCounterBytes(sizes.max_bands)));
    ws->band_done_[i] = static_cast<uint32_t*>(p);
    JMO_RETURN_IF_CUDA(cudaMemset(p, 0, BandCounterBytes(sizes.max_bands)));
    JMO_RETURN_IF_CUDA(cudaDeviceSynchronize());
  }
  ws->shared_.assign(groups, nullptr);
  ws->shared_dev_.assign(groups, nullptr);
  for (int g = 0; g < groups; ++g) {
    Status st = sharing == nullptr ? ws->AllocGroupMemory(g)
                : ws->Local(g, 0)  ? ws->MapGroupMemory(g, /*create=*/true)
                                   : Status{};
    if (!st.ok()) return st;
  }
  *out = std::move(ws);
  return Status{};
}

bool Workspace::GroupHere(int g) const {
  for (int r = 0; r < ranks_; ++r)
    if (Local(g, r)) return true;
  return false;
}

// One process: pinned host memory, portable (mapped into every device's address space; UVA: the same pointer
// everywhere).
Status Workspace::AllocGroupMemory(int g) {
  void* p = nullptr;
  const int64_t bytes = GroupMemoryBytes(ranks_);
  JMO_RETURN_IF_CUDA(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  shared_[g] = static_cast<char*>(p);
  std::memset(p, 0, bytes);
  void* dp = nullptr;
  JMO_RETURN_IF_CUDA(cudaHostGetDevicePointer(&dp, p, 0));
  shared_dev_[g] = static_cast<char*>(dp);
  for (int r = 0; r < ranks_; ++r) tail(g)->process[r] = -1;
  return Status{};
}

// Sharing: the group memory as the POSIX shared-memory object "<prefix>-g<g>" (created by the process of rank 0, a
// fresh object reads as zeros), registered with CUDA (portable and mapped) so that every device reaches it.
Status Workspace::MapGroupMemory(int g, bool create) {
  const std::string name = prefix_ + "-g" + std::to_string(g);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t bytes = (static_cast<size_t>(GroupMemoryBytes(ranks_)) + page - 1) / page * page;
  const int fd = shm_open(name.c_str(), create ? (O_RDWR | O_CREAT | O_EXCL) : O_RDWR, 0600);
  if (fd < 0)
    return Status::Error(kInternal, "jax_moe_overlap: shm_open(" + name + ") for the group memory of group " +
                                        std::to_string(g) + " (created by process " +
                                        std::to_string(process_[g * ranks_]) + ") failed: " + std::strerror(errno));
  if (create) own_names_.push_back(name);
  struct stat st {};
  if ((create && ftruncate(fd, (off_t)bytes) != 0) || fstat(fd, &st) != 0 || (size_t)st.st_size < bytes) {
    const int err = errno;
    close(fd);
    return Status::Error(kInternal, "jax_moe_overlap: shared-memory object " + name + " of " + std::to_string(bytes) +
                                        " bytes could not be sized or is too small: " + std::strerror(err));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED)
    return Status::Error(kInternal, "jax_moe_overlap: mmap(" + name + ") failed: " + std::strerror(err));
  JMO_RETURN_IF_CUDA(cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
  mappings_.emplace_back(p, bytes);
  shared_[g] = static_cast<char*>(p);
  void* dp = nullptr;
  JMO_RETURN_IF_CUDA(cudaHostGetDevicePointer(&dp, p, 0));
  shared_dev_[g] = static_cast<char*>(dp);
  return Status{};
}

Status Workspace::ExportHandles(std::vector<BlockExport>* out) const {
  out->assign(ranks_ * groups_, BlockExport{});
  DeviceGuard guard;
  for (int i = 0; i < ranks_ * groups_; ++i) {
    if (!Local(i / ranks_, i % ranks_)) continue;
    JMO_RETURN_IF_CUDA(cudaSetDevice(ordinals_[i]));
    cudaIpcMemHandle_t h;
    JMO_RETURN_IF_CUDA(cudaIpcGetMemHandle(&h, blocks_[i]));
    char bus[32] = {};
    JMO_RETURN_IF_CUDA(cudaDeviceGetPCIBusId(bus, sizeof(bus), ordinals_[i]));
    (*out)[i] = BlockExport{std::string(reinterpret_cast<const char*>(&h), sizeof(h)), std::string(bus)};
  }
  return Status{};
}

Status Workspace::OpenPeers(const std::vector<BlockExport>& peers) {
  if (process_.empty() || (int64_t)peers.size() != (int64_t)ranks_ * groups_)
    return Status::Error(kInvalidArgument, "jax_moe_overlap: OpenPeers needs a shared workspace and one export per "
                                           "(group, rank)");
  DeviceGuard guard;
  for (int g = 0; g < groups_; ++g) {
    if (!GroupHere(g)) continue;
    if (!Local(g, 0)) {
      Status st = MapGroupMemory(g, /*create=*/false);
      if (!st.ok()) return st;
    }
    std::vector<int> mine;  // this process's devices in the group
    for (int r = 0; r < ranks_; ++r)
      if (Local(g, r)) mine.push_back(ordinals_[g * ranks_ + r]);
    for (int r = 0; r < ranks_; ++r) {
      const int i = g * ranks_ + r;
      if (Local(g, r)) continue;
      const BlockExport& e = peers[i];
      cudaIpcMemHandle_t h;
      if (e.ipc_handle.size() != sizeof(h))
        return Status::Error(kInvalidArgument, "jax_moe_overlap: the IPC handle of rank " + std::to_string(r) +
                                                   " of group " + std::to_string(g) + " has " +
                                                   std::to_string(e.ipc_handle.size()) + " bytes, not " +
                                                   std::to_string(sizeof(h)));
      std::memcpy(&h, e.ipc_handle.data(), sizeof(h));
      // Opened once, through the first of this process's devices of the group (lazily enabling its peer access
      // to the block's device); this process's other devices get peer access to that device explicitly.
      JMO_RETURN_IF_CUDA(cudaSetDevice(mine[0]));
      void* p = nullptr;
      cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
      if (err != cudaSuccess)
        return Status::Error(kInternal, "jax_moe_overlap: cudaIpcOpenMemHandle of the block of rank " +
                                            std::to_string(r) + " (group " + std::to_string(g) + ", process " +
                                            std::to_string(process_[i]) + ", GPU " + e.pci_bus_id + ") on device " +
                                            std::to_string(mine[0]) + " failed: " + cudaGetErrorName(err) + " (" +
                                            cudaGetErrorString(err) + ")");
      blocks_[i] = static_cast<char*>(p);
      opened_[i] = true;
      access_dev_[i] = mine[0];
      if (mine.size() > 1) {
        int dev = -1;
        if (cudaDeviceGetByPCIBusId(&dev, e.pci_bus_id.c_str()) != cudaSuccess) {
          cudaGetLastError();
          return Status::Error(kFailedPrecondition,
                               "jax_moe_overlap: the GPU " + e.pci_bus_id + " of rank " + std::to_string(r) +
                                   " (process " + std::to_string(process_[i]) + ") is not visible to this process, "
                                   "whose several GPUs of the group all need peer access to it");
        }
        for (size_t k = 1; k < mine.size(); ++k) {
          Status st = EnablePeerAccess(mine[k], dev);
          if (!st.ok()) return st;
        }
      }
    }
    GroupTail* t = tail(g);
    for (int r = 0; r < ranks_; ++r) {
      t->process[r] = process_[g * ranks_ + r];
      if (Local(g, r)) t->pid[r] = static_cast<int32_t>(getpid());
    }
  }
  return Status{};
}

void Workspace::UnlinkOwn() {
  for (const std::string& name : own_names_) shm_unlink(name.c_str());
  own_names_.clear();
}

namespace {

// How long a release waits for the other processes of a group to close their mappings of this process's blocks
// before it frees them anyway (a peer that hangs); a dead peer is not waited for.
constexpr int64_t kReleaseWaitMs = 5000;

// Whether the owner of a peer rank no longer maps this process's blocks: it never got as far as opening them (its
// pid is written once it has), or its process `pid` of this host is gone (or a zombie, which runs no kernels).
bool ProcessGone(int32_t pid) {
  if (pid <= 0) return true;
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;
  char state = 0;
  const int n = std::fscanf(f, "%*d (%*[^)]) %c", &state);
  std::fclose(f);
  return n == 1 && (state == 'Z' || state == 'X');
}

}  // namespace

void Workspace::AwaitPeersReleased() {
  for (int g = 0; g < groups_; ++g) {
    if (!GroupHere(g) || shared_[g] == nullptr) continue;
    GroupTail* t = tail(g);
    for (int r = 0; r < ranks_; ++r)
      if (Local(g, r)) std::atomic_ref<uint32_t>(t->released[r]).store(1, std::memory_order_release);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kReleaseWaitMs);
  for (int g = 0; g < groups_; ++g) {
    if (!GroupHere(g) || shared_[g] == nullptr) continue;
    GroupTail* t = tail(g);
    for (int r = 0; r < ranks_; ++r) {
      if (Local(g, r)) continue;
      int spins = 0;
      while (std::atomic_ref<uint32_t>(t->released[r]).load(std::memory_order_acquire) == 0 &&
             !ProcessGone(t->pid[r])) {
        if (std::chrono::steady_clock::now() >= deadline) {
          // A destructor has no caller to report to: say it on stderr (it names rank, peer and the wait).
          std::fprintf(stderr,
                       "jax_moe_overlap: releasing a workspace (process %d): rank %d of group %d (process %d) had not "
                       "closed its mappings of this process's blocks after %lld ms; freeing them anyway\n",
                       here_, r, g, process_[g * ranks_ + r], static_cast<long long>(kReleaseWaitMs));
          break;
        }
        Backoff(spins);
      }
    }
  }
}

Workspace::~Workspace() {
  DeviceGuard guard;
  // Every kernel of this process on the workspace has ended (they are bounded), so it writes no peer block any more.
  for (size_t i = 0; i < blocks_.size(); ++i)
    if (blocks_[i] != nullptr && !opened_[i] && cudaSetDevice(ordinals_[i]) == cudaSuccess) cudaDeviceSynchronize();
  for (size_t i = 0; i < blocks_.size(); ++i) {
    if (!opened_[i]) continue;
    cudaSetDevice(access_dev_[i]);
    cudaIpcCloseMemHandle(blocks_[i]);
  }
  // Across processes, a block is freed only once no other process writes it any more: they have closed their
  // mappings (or are gone), as on CPU the last munmap of a shared-memory object frees it.
  if (!process_.empty() && (int)shared_.size() == groups_) AwaitPeersReleased();
  for (size_t i = 0; i < blocks_.size(); ++i) {
    if (opened_[i]) continue;
    cudaSetDevice(ordinals_[i]);
    if (blocks_[i] != nullptr) cudaFree(blocks_[i]);
    if (band_done_[i] != nullptr) cudaFree(band_done_[i]);
    // The private block is kept, marked released (RankPrivate::released): a CUDA graph still holding this
    // workspace's addresses stops in its first kernel instead of writing freed memory.
    if (priv_[i] != nullptr) {
      const uint64_t one = 1;
      cudaMemcpy(&priv_[i]->released, &one, sizeof(one), cudaMemcpyHostToDevice);
    }
  }
  if (process_.empty()) {
    for (char* s : shared_)
      if (s != nullptr) cudaFreeHost(s);
  } else {
    for (auto& [p, n] : mappings_) {
      cudaHostUnregister(p);
      munmap(p, n);
    }
    UnlinkOwn();
  }
  cudaGetLastError();  // at process exit the context may be gone already; nothing to report to
}

RankDev Workspace::Dev(int g, int r) const {
  RankDev d{};
  for (int i = 0; i < ranks_; ++i) d.peers.base[i] = blocks_[g * ranks_ + i];
  d.layout = layout_;
  d.sizes = sizes_;
  d.shared = reinterpret_cast<GroupShared*>(shared_dev_[g]);
  d.priv = priv_[g * ranks_ + r];
  d.band_done = band_done_[g * ranks_ + r];
  d.producers_done = reinterpret_cast<uint64_t*>(d.band_done + BandCounterWords(sizes_.max_bands));
  d.tile_claims = reinterpret_cast<unsigned*>(d.producers_done + 1);
  d.side_claims = d.tile_claims + 1;
  d.rank = r;
  d.group = g;
  d.ranks = ranks_;
  return d;
}

int Workspace::min_budget() const {
  int b = 1 << 30;
  for (size_t i = 0; i < budget_.size(); ++i)
    if (Local(i / ranks_, i % ranks_)) b = std::min(b, budget_[i]);
  return b;
}

Status Workspace::ReadPrivate(int g, int r, cudaStream_t stream, RankPrivate* out) const {
  if (g < 0 || g >= groups_ || r < 0 || r >= ranks_ || !Local(g, r))
    return Status::Error(kInvalidArgument, "jax_moe_overlap: no rank " + std::to_string(r) + " of group " +
                                               std::to_string(g) + " in this process's part of the workspace");
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
    if (ordinals_[i] != ordinal || !Local(i / ranks_, i % ranks_)) continue;
    if (found++ == 0) {
      *g = i / ranks_;
      *r = i % ranks_;
    }
  }
  if (found == 1) return Status{};
  // String concatenation, not iostreams, as DescribeRecord (common/error_text.h) says why.
  std::string msg = "jax_moe_overlap: the custom call runs on CUDA device " + std::to_string(ordinal) +
                    " but the workspace's devices in this process are [";
  for (size_t i = 0; i < ordinals_.size(); ++i) msg += (i ? ", " : "") + std::to_string(ordinals_[i]);
  msg += "] (-1: a rank of another process)";
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
  // Every message of a recovery that cannot finish: "jax_moe_overlap.<op>: rank r (group g) waited <timeout> ms ...".
  const std::string waited = std::string("jax_moe_overlap.") + op + ": rank " + std::to_string(r) + " (group " +
                             std::to_string(g) + ") waited " + std::to_string(timeout_ms) + " ms ";
  // The group's first failure, for the messages of a recovery that cannot finish.
  auto failure = [&]() {
    std::vector<ErrorRecord> now(gs->errors, gs->errors + ranks_);
    const ErrorRecord* first = FirstRecord(now);
    return first == nullptr ? std::string()
                            : "; the failure: " + FormatRecord(*first, g, ranks_, timeout_ms) +
                                  ProcessNote(*first, ranks_, tail(g)->process);
  };
  auto deadline = [&]() { return std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms); };
  // Our own kernels are bounded (and see the abort word); what else the stream holds may not be.
  Status drained = DrainStream(stream, deadline(), waited + "for its stream to finish the work queued before this "
                                                             "call, to recover from an earlier failure (work that "
                                                             "this library's timeout does not bound, such as another "
                                                             "library's collective whose peer is gone)");
  if (!drained.ok()) return Status::Error(drained.code, drained.msg + failure());
  GroupTail* t = tail(g);
  GroupBarrier bar(&t->barrier.value);
  DeviceGuard guard;
  if (bar.Arrive(ranks_)) {
    // Every rank of the group is here with an idle stream: nothing reads or writes group memory or control words.
    // Reset them all (other processes' blocks through this process's mappings).
    std::memcpy(t->reset_records, gs->errors, ranks_ * sizeof(ErrorRecord));
    Status st;
    for (int i = 0; i < ranks_ && st.ok(); ++i) {
      const int idx = g * ranks_ + i;
      st = CudaStatus(cudaSetDevice(access_dev_[idx]), "cudaSetDevice");
      if (st.ok())
        st = ZeroBounded(blocks_[idx], layout_.recv, deadline(),
                         waited + "for the reset of rank " + std::to_string(i) +
                             "'s control words after an earlier failure");
    }
    std::memset(gs, 0, GroupSharedBytes(ranks_));
    for (int i = 0; i < ranks_; ++i)  // stamps are epochs, which restart
      reinterpret_cast<CountSlot*>(shared_[g] + CountBoardOffset(ranks_) + i * CountSlotBytes(kMaxSegments))
          ->stamp.value = 0;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    bar.Open();
    if (!st.ok()) return st;
  } else {
    uint64_t arrived = 0;
    if (!bar.Wait(deadline(), &arrived)) {
      return Status::Error(kDeadlineExceeded, waited + "at the recovery barrier after an earlier failure; only " +
                                                  std::to_string(arrived) + " of " + std::to_string(ranks_) +
                                                  " ranks arrived" + failure());
    }
  }
  // This rank's private state: only its own kernels read it, and its stream is idle.
  JMO_RETURN_IF_CUDA(cudaSetDevice(ordinals_[g * ranks_ + r]));
  JMO_RETURN_IF_CUDA(cudaMemsetAsync(priv_[g * ranks_ + r], 0, sizeof(RankPrivate), stream));
  Status reset =
      DrainStream(stream, deadline(), waited + "for the reset of its private state after an earlier failure");
  if (!reset.ok()) return reset;
  const std::vector<ErrorRecord> records(t->reset_records, t->reset_records + ranks_);
  return ReportRecords(g, r, records,
                       std::string("jax_moe_overlap.") + op + ": an earlier call failed (reported by the next call; " +
                           "the group has been reset and the call after this one runs normally): ",
                       timeout_ms);
}

// Every rank reports the group's first failure (FirstRecord), and its own when it had a different one.
Status Workspace::ReportRecords(int g, int r, const std::vector<ErrorRecord>& records, std::string msg,
                                int64_t timeout_ms) const {
  const ErrorRecord* pick = FirstRecord(records);
  if (pick == nullptr)
    return Status::Error(kFailedPrecondition,
                         msg + "a call of group " + std::to_string(g) + " failed validation on the host of some rank");
  msg += "first failure: " + FormatRecord(*pick, g, ranks_, timeout_ms) + ProcessNote(*pick, ranks_, tail(g)->process);
  if (r >= 0 && records[r].code != 0 && pick != &records[r])
    msg += "; this rank's own failure: " + FormatRecord(records[r], g, ranks_, timeout_ms);
  return Status::Error(pick->code == kStageBadInput ? kInvalidArgument : kDeadlineExceeded, msg);
}

namespace {
// The group's records as its memory holds them now (volatile reads: kernels write them), and whether the group is
// aborted (its abort word raised, or any rank's record written).
bool CurrentRecords(const GroupShared* gs, int ranks, std::vector<ErrorRecord>* records) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const bool aborted = *reinterpret_cast<const volatile uint64_t*>(&gs->abort.value) != 0;
  records->resize(ranks);
  bool any = false;
  for (int i = 0; i < ranks; ++i) {
    const volatile uint64_t* src = reinterpret_cast<const volatile uint64_t*>(&gs->errors[i]);
    uint64_t* dst = reinterpret_cast<uint64_t*>(&(*records)[i]);
    for (size_t w = 0; w < sizeof(ErrorRecord) / sizeof(uint64_t); ++w) dst[w] = src[w];
    any = any || (*records)[i].code != 0;
  }
  return aborted || any;
}
}  // namespace

Status Workspace::RecordedFailure(int g, int r, const char* op, int64_t timeout_ms) const {
  std::vector<ErrorRecord> records;
  if (!CurrentRecords(shared(g), ranks_, &records)) return Status{};
  return ReportRecords(g, r, records,
                       std::string("jax_moe_overlap.") + op + ": an earlier call of group " + std::to_string(g) +
                           " failed, and this call is being recorded into a CUDA graph (XLA's command buffers), "
                           "where it may not synchronize to reset the group: the group stays aborted until a call "
                           "outside a CUDA graph resets it (or the process restarts): ",
                       timeout_ms);
}

std::string Workspace::FailureText(int g, int64_t timeout_ms) const {
  if (g < 0 || g >= groups_ || shared_[g] == nullptr) return "";
  std::vector<ErrorRecord> records;
  if (!CurrentRecords(shared(g), ranks_, &records)) return "";
  return ReportRecords(g, -1, records, "group " + std::to_string(g) + " is aborted: ", timeout_ms).msg;
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
