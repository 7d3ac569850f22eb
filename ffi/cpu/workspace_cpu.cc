#include "cpu/workspace_cpu.h"

#include "common/error_text.h"
#include "common/group_barrier.h"
#include "common/registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace jmo::cpu {

namespace {

char* AllocZeroed(int64_t bytes) {
  void* p = std::aligned_alloc(kAlign, AlignUp(bytes > 0 ? bytes : kAlign));
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, AlignUp(bytes > 0 ? bytes : kAlign));
  return static_cast<char*>(p);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Consumer

Consumer::Consumer(Workspace* ws, int group, int rank) : ws_(ws), group_(group), rank_(rank) {
  thread_ = std::thread([this] { Loop(); });
}

Consumer::~Consumer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Consumer::Post(ConsumerJob job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = std::move(job);
    has_job_ = true;
    finished_ = false;
    result_ = ErrorRecord{};
  }
  cv_.notify_all();
}

ErrorRecord Consumer::Join() {
  std::unique_lock<std::mutex> lock(mu_);
  // The consumer's own waits are bounded by the job's deadline, so this wait is bounded too.
  cv_.wait(lock, [this] { return finished_; });
  return result_;
}

void Consumer::Loop() {
  for (;;) {
    ConsumerJob job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || has_job_; });
      if (stop_) return;
      job = std::move(job_);
      has_job_ = false;
    }
    ErrorRecord err{};
    RankView self = ws_->view(job.group, job.rank);
    const int64_t row_bytes = job.row_bytes;
    if (job.run) {
      err = job.run();  // such a job posts no segments: the band copy below ships nothing
    } else if (job.serialize) {
      // The producer publishes bands in this order; wait for every one of them before the first push.
      for (const Segment& seg : job.segments) {
        const int64_t bands = (seg.rows + kBandRows - 1) / kBandRows;
        for (int64_t b = 0; b < bands && !err.code; ++b)
          err = ws_->WaitAtLeast(&self.tile_ready()[seg.band_base + b], 0, job.epoch, job.group, job.rank, job.rank,
                                 job.epoch, kStageTileReady, job.deadline, job.timeout_ms);
        if (err.code) break;
      }
    }
    for (const Segment& seg : job.segments) {
      if (err.code) break;
      if (seg.rows == 0) continue;
      RankView peer = ws_->view(job.group, seg.src);
      // The source rank must have finished reading its ret rows of the previous call.
      err = ws_->WaitAtLeast(&peer.control()->done_epoch.value, 0, job.epoch - 1, job.group, job.rank, seg.src,
                             job.epoch, kStagePeerReady, job.deadline, job.timeout_ms);
      if (err.code) break;
      const int64_t bands = (seg.rows + kBandRows - 1) / kBandRows;
      for (int64_t b = 0; b < bands && !err.code; ++b) {
        err = ws_->WaitAtLeast(&self.tile_ready()[seg.band_base + b], 0, job.epoch, job.group, job.rank, job.rank,
                               job.epoch, kStageTileReady, job.deadline, job.timeout_ms);
        if (err.code) break;
        const int64_t row0 = b * kBandRows;
        const int64_t rows = std::min<int64_t>(kBandRows, seg.rows - row0);
        std::memcpy(peer.ret() + (seg.ret_off + row0) * row_bytes, self.stage() + (seg.recv_off + row0) * row_bytes,
                    rows * row_bytes);
        AtomicAdd(&peer.control()->ret_arrivals.value, static_cast<uint64_t>(rows));
      }
      if (err.code) break;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      result_ = err;
      finished_ = true;
    }
    cv_.notify_all();
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Workspace

Workspace::Workspace(int ranks, int groups, WorkspaceSizes sizes, int64_t count_values)
    : ranks_(ranks), groups_(groups), sizes_(sizes), count_values_(count_values), layout_(MakeLayout(sizes)) {
  for (int i = 0; i < ranks * groups; ++i) blocks_.push_back(AllocZeroed(layout_.total));
  for (int g = 0; g < groups; ++g) {
    shared_.push_back(AllocZeroed(GroupBytes()));
    GroupTail* tail = TailOf(shared(g), ranks);
    for (int r = 0; r < ranks; ++r) tail->process[r] = -1;
  }
  StartConsumers();
}

Workspace::Workspace(int ranks, int groups, WorkspaceSizes sizes, int64_t count_values, std::vector<int> process,
                     int here, std::string prefix)
    : ranks_(ranks), groups_(groups), sizes_(sizes), count_values_(count_values), layout_(MakeLayout(sizes)),
      process_(std::move(process)), here_(here), prefix_(std::move(prefix)) {
  if ((int64_t)process_.size() != (int64_t)ranks * groups)
    throw std::invalid_argument("jax_moe_overlap: the process table needs one entry per rank of every group");
  blocks_.assign(ranks * groups, nullptr);
  shared_.assign(groups, nullptr);
  try {
    for (int g = 0; g < groups; ++g)
      for (int r = 0; r < ranks; ++r)
        if (Local(g, r)) Map(g, r, /*create=*/true);
  } catch (...) {
    UnlinkOwn();
    for (auto& [p, n] : mappings_) munmap(p, n);
    throw;
  }
}

bool Workspace::GroupHere(int g) const {
  for (int r = 0; r < ranks_; ++r)
    if (Local(g, r)) return true;
  return false;
}

std::string Workspace::ObjectName(int g, int r) const {
  return prefix_ + "-g" + std::to_string(g) + "-r" + std::to_string(r);
}

void Workspace::Map(int g, int r, bool create) {
  const std::string name = ObjectName(g, r);
  const size_t bytes = (size_t)ObjectBytes();
  const int fd = shm_open(name.c_str(), create ? (O_RDWR | O_CREAT | O_EXCL) : O_RDWR, 0600);
  if (fd < 0)
    throw std::runtime_error("jax_moe_overlap: shm_open(" + name + ") for rank " + std::to_string(r) + " of group " +
                             std::to_string(g) + " (process " + std::to_string(process_[g * ranks_ + r]) +
                             ") failed: " + std::strerror(errno));
  if (create) own_names_.push_back(name);
  struct stat st {};
  if ((create && ftruncate(fd, (off_t)bytes) != 0) || fstat(fd, &st) != 0 || (size_t)st.st_size < bytes) {
    const int err = errno;
    close(fd);
    throw std::runtime_error("jax_moe_overlap: shared-memory object " + name + " of " + std::to_string(bytes) +
                             " bytes could not be sized or is too small: " + std::strerror(err));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED)
    throw std::runtime_error("jax_moe_overlap: mmap(" + name + ") failed: " + std::strerror(err));
  mappings_.emplace_back(p, bytes);  // a fresh object reads as zeros
  blocks_[g * ranks_ + r] = static_cast<char*>(p);
  if (r == 0) shared_[g] = static_cast<char*>(p) + layout_.total;
}

void Workspace::MapPeers() {
  for (int g = 0; g < groups_; ++g) {
    if (!GroupHere(g)) continue;
    for (int r = 0; r < ranks_; ++r)
      if (!Local(g, r)) Map(g, r, /*create=*/false);
    GroupTail* tail = TailOf(shared(g), ranks_);
    for (int r = 0; r < ranks_; ++r) tail->process[r] = process_[g * ranks_ + r];
  }
  StartConsumers();
}

void Workspace::UnlinkOwn() {
  for (const std::string& name : own_names_) shm_unlink(name.c_str());
  own_names_.clear();
}

void Workspace::StartConsumers() {
  for (int g = 0; g < groups_; ++g)
    for (int r = 0; r < ranks_; ++r)
      consumers_.push_back(Local(g, r) ? std::make_unique<Consumer>(this, g, r) : nullptr);
}

Workspace::~Workspace() {
  consumers_.clear();  // joins the threads before the memory they poll goes away
  if (process_.empty()) {
    for (char* b : blocks_) std::free(b);
    for (char* s : shared_) std::free(s);
    return;
  }
  UnlinkOwn();
  for (auto& [p, n] : mappings_) munmap(p, n);
}

ErrorRecord Workspace::WaitAtLeast(const uint64_t* word, uint64_t base, uint64_t count, int group, int rank,
                                   int peer, uint64_t epoch, Stage stage, Clock::time_point deadline,
                                   int64_t timeout_ms) {
  GroupShared* g = shared(group);
  const uint64_t target = base + count;
  int spins = 0;
  for (;;) {
    uint64_t v = AtomicLoad(word);
    if (v >= target) return ErrorRecord{};
    if (AtomicLoad(&g->abort.value) != 0) {
      ErrorRecord e{kStageAbortedByPeer, (uint64_t)rank, (uint64_t)peer, epoch, v - base, count, 0, 0};
      return e;
    }
    if (Clock::now() >= deadline) {
      if (peer >= ranks_) {
        // Waiting on an aggregate counter: name the first peer that has not even started this epoch, if any.
        for (int r = 0; r < ranks_; ++r)
          if (AtomicLoad(&view(group, r).control()->calls.value) < epoch) {
            peer = r;
            break;
          }
      }
      ErrorRecord e{stage, (uint64_t)rank, (uint64_t)peer, epoch, v - base, count, 0, (uint64_t)timeout_ms};
      RecordFailure(group, e);
      return e;
    }
    Backoff(spins);
  }
}

void Workspace::RaiseAbort(int group, uint64_t epoch) {
  // The abort word holds the epoch of the group's first failure (epochs start at 1, so 0 means "no abort").
  uint64_t expected = 0;
  std::atomic_ref<uint64_t>(shared(group)->abort.value)
      .compare_exchange_strong(expected, epoch, std::memory_order_acq_rel);
}

void Workspace::RecordFailure(int group, const ErrorRecord& e) {
  GroupShared* g = shared(group);
  g->errors[e.rank] = e;  // only this rank writes its record; readers see it after the release below
  uint64_t none = 0;
  std::atomic_ref<uint64_t>(g->first_failed.value)
      .compare_exchange_strong(none, e.rank + 1, std::memory_order_acq_rel);
  RaiseAbort(group, e.epoch);
}

ErrorRecord Workspace::RecoverIfAborted(int group, int rank, Clock::time_point deadline) {
  GroupShared* g = shared(group);
  const uint64_t failed_epoch = AtomicLoad(&g->abort.value);
  if (failed_epoch == 0) return ErrorRecord{};
  const uint64_t epoch = view(group, rank).control()->calls.value + 1;
  if (epoch <= failed_epoch) {
    // This rank is late: it is starting the very call that failed elsewhere. Fail it too, at once (the epoch is
    // used up); the group meets at the barrier on the next call, which every rank is then past the failed epoch for.
    AtomicStore(&view(group, rank).control()->calls.value, epoch);
    return ErrorRecord{kStageAbortedByPeer, (uint64_t)rank, (uint64_t)ranks_, epoch, 0, 0, 0, 0};
  }
  // The barrier word lives in group memory, so it works across processes too.
  GroupBarrier bar(&TailOf(g, ranks_)->barrier.value);
  if (bar.Arrive(ranks_)) {
    // Every rank of the group is here, so nobody reads or writes group memory: reset it all.
    for (int r = 0; r < ranks_; ++r) {
      RankView v = view(group, r);
      // Everything before recv: the control words, the tile flags and dispatch_gemm's src_blocks counters.
      std::memset(v.base + layout_.control, 0, layout_.recv - layout_.control);
    }
    std::memset(shared_[group], 0, GroupSharedBytes(ranks_));
    for (int r = 0; r < ranks_; ++r) count_slot(group, r)->stamp.value = 0;  // stamps are epochs, which restart
    bar.Open();
    return ErrorRecord{};
  }
  uint64_t arrived = 0;
  if (bar.Wait(deadline, &arrived)) return ErrorRecord{};
  return ErrorRecord{kStageReset, (uint64_t)rank, (uint64_t)ranks_, 0, arrived, (uint64_t)ranks_, 0, 0};
}

// ---------------------------------------------------------------------------------------------------------------
// Registry

namespace {
HandleRegistry<Workspace>& Registry() {
  static auto* r = new HandleRegistry<Workspace>(1);
  return *r;
}
}  // namespace

int64_t RegisterWorkspace(std::unique_ptr<Workspace> ws) { return Registry().Add(std::move(ws)); }
Workspace* LookupWorkspace(int64_t handle) { return Registry().Find(handle); }
bool ReleaseWorkspace(int64_t handle) { return Registry().Remove(handle); }

std::string FormatError(const char* op, const ErrorRecord& e, int group, int ranks, int64_t timeout_ms,
                        const GroupShared* shared) {
  // String concatenation, not iostreams, as DescribeRecord (common/error_text.h) says why.
  using std::to_string;
  std::string s = std::string("jax_moe_overlap.") + op + ": ";
  if (e.code == kStageAbortedByPeer) {
    s += "rank " + to_string(e.rank) + " (group " + to_string(group) + ") gave up in epoch " + to_string(e.epoch) +
         " because another rank of its group failed first";
    if (const ErrorRecord* first = FirstFailure(shared, ranks))
      s += "; first failure: " + DescribeRecord(*first, group, ranks) +
           ProcessNote(*first, ranks, TailOf(shared, ranks)->process);
    return s;
  }
  if (e.code == kStageReset) {
    return s + "rank " + to_string(e.rank) + " (group " + to_string(group) + ") waited " + to_string(timeout_ms) +
           " ms at the recovery barrier after an earlier timeout; only " + to_string(e.got) + " of " +
           to_string(e.expected) + " ranks arrived";
  }
  return s + DescribeRecord(e, group, ranks) + ProcessNote(e, ranks, shared ? TailOf(shared, ranks)->process : nullptr);
}

}  // namespace jmo::cpu
