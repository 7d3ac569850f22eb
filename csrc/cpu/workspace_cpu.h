// Host-memory peer workspace for XLA:CPU devices.
//
// XLA:CPU runs the per-device programs of one jitted call concurrently on host threads, so "peer memory" is just
// another rank's block in this process. The layout and protocol are those of protocol.h, exactly as on the GPU.
// Each rank also owns a persistent consumer thread: the CPU analogue of the communication kernel on its own SMs.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "jax_moe_overlap/protocol.h"

namespace jmo::cpu {

using Clock = std::chrono::steady_clock;

inline uint64_t AtomicLoad(const uint64_t* p) {
  return std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(p)).load(std::memory_order_acquire);
}
inline void AtomicStore(uint64_t* p, uint64_t v) {
  std::atomic_ref<uint64_t>(*p).store(v, std::memory_order_release);
}
inline void AtomicAdd(uint64_t* p, uint64_t v) {
  std::atomic_ref<uint64_t>(*p).fetch_add(v, std::memory_order_acq_rel);
}

// Work handed by a rank's producer (the handler thread) to its consumer thread for one epoch.
struct ConsumerJob {
  uint64_t epoch = 0;
  int group = 0, rank = 0;
  std::vector<Segment> segments;  // in producer order (remote-critical first)
  int64_t row_bytes = 0;          // bytes of one output row of this call
  Clock::time_point deadline;
  int64_t timeout_ms = 0;         // the bound behind `deadline`, for error records
  bool serialize = false;         // push nothing before every band of the call is ready (the no-overlap baseline)
};

class Workspace;

// One rank's consumer: a persistent thread that polls tile_ready flags and pushes finished bands to peers.
class Consumer {
 public:
  Consumer(Workspace* ws, int group, int rank);
  ~Consumer();
  void Post(ConsumerJob job);
  // Waits for the posted job; returns its error record (code 0 on success).
  ErrorRecord Join();

 private:
  void Loop();
  Workspace* ws_;
  int group_, rank_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool has_job_ = false, finished_ = false, stop_ = false;
  ConsumerJob job_;
  ErrorRecord result_{};
  std::thread thread_;
};

class Workspace {
 public:
  Workspace(int ranks, int groups, WorkspaceSizes sizes);
  ~Workspace();

  int ranks() const { return ranks_; }
  int groups() const { return groups_; }
  const WorkspaceSizes& sizes() const { return sizes_; }
  RankView view(int group, int rank) const { return RankView{blocks_[group * ranks_ + rank], layout_}; }
  GroupShared* shared(int group) const { return reinterpret_cast<GroupShared*>(shared_[group]); }
  Consumer& consumer(int group, int rank) { return *consumers_[group * ranks_ + rank]; }

  // Bounded wait until *word >= base + count. Gives up at `deadline` (records the error, with the counts relative
  // to `base`, and raises the group's abort word) or as soon as another rank of the group aborted.
  // Returns an ErrorRecord with code 0 on success.
  ErrorRecord WaitAtLeast(const uint64_t* word, uint64_t base, uint64_t count, int group, int rank, int peer,
                          uint64_t epoch, Stage stage, Clock::time_point deadline, int64_t timeout_ms);

  // Marks the group failed in `epoch` (keeps the first failure's epoch), so every waiter gives up.
  void RaiseAbort(int group, uint64_t epoch);

  // A rank's own failure (e.rank, e.epoch): stores its error record, claims the group's first_failed word if no rank
  // has yet, then raises abort, so every rank's error can name the group's first failure and its cause.
  void RecordFailure(int group, const ErrorRecord& e);

  // Called at the start of every call: if the group was aborted, a rank still entering the failed epoch fails
  // at once; a rank past it meets all ranks at the barrier, and the last to arrive resets the group.
  ErrorRecord RecoverIfAborted(int group, int rank, Clock::time_point deadline);

 private:
  int ranks_, groups_;
  WorkspaceSizes sizes_;
  Layout layout_;
  std::vector<char*> blocks_;
  std::vector<char*> shared_;
  std::vector<std::unique_ptr<Consumer>> consumers_;
  struct Barrier {
    std::mutex mu;
    std::condition_variable cv;
    int arrived = 0;
    uint64_t generation = 0;
  };
  std::vector<std::unique_ptr<Barrier>> barriers_;
};

// Registry: the custom calls name a workspace by an integer handle attribute.
int64_t RegisterWorkspace(std::unique_ptr<Workspace> ws);
Workspace* LookupWorkspace(int64_t handle);
bool ReleaseWorkspace(int64_t handle);

// Error text for a failed wait; for a rank that gave up because of a peer, names the group's first failure.
std::string FormatError(const char* op, const ErrorRecord& e, int group, int ranks, int64_t timeout_ms,
                        const GroupShared* shared);

}  // namespace jmo::cpu
