// Host-memory peer workspace for XLA:CPU devices.
//
// XLA:CPU runs the per-device programs of one jitted call concurrently on host threads, so "peer memory" is just
// another rank's block in this process. The layout and protocol are those of protocol.h, exactly as on the GPU.
// Each rank also owns a persistent consumer thread: the CPU analogue of the communication kernel on its own SMs.
//
// A group may span processes (jax.distributed): each process then creates the blocks of its own ranks as POSIX
// shared-memory objects and maps its peers' objects (SharedWorkspace below). The protocol keeps no pointers in
// shared memory, only counters, flags and rows, so each process uses its own mapping addresses; atomics on
// lock-free 64-bit words of a shared mapping work across processes. A rank's consumer thread lives in the process
// that owns the rank.
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
  // A call whose consumer does other work than shipping bands (gather_rs: reduce, then ship per source) posts it
  // here; the consumer thread runs it in place of the band copy and returns its record. Its waits must be bounded
  // by `deadline`, as the band copy's are.
  std::function<ErrorRecord()> run;
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

// Per group, after GroupShared: the recovery barrier's word (generation << 32 | ranks arrived) and which process
// owns each rank (-1 everywhere when the group lives in one process), for error texts.
struct GroupTail {
  Word barrier;
  int32_t process[1];  // really [R]
};
inline int64_t GroupTailBytes(int64_t ranks) { return AlignUp((int64_t)sizeof(Word) + 4 * ranks); }
inline GroupTail* TailOf(const GroupShared* shared, int ranks) {
  return reinterpret_cast<GroupTail*>(reinterpret_cast<char*>(const_cast<GroupShared*>(shared)) +
                                      GroupSharedBytes(ranks));
}

// Per group, after GroupTail: the count board of exchange_counts (protocol.h's CountSlot per rank).

class Workspace {
 public:
  // Every rank of every group in this process. count_values: the most routing counts one rank exchanges per call
  // (R x E_local, the workspace's segments).
  Workspace(int ranks, int groups, WorkspaceSizes sizes, int64_t count_values);
  // Groups spanning processes: `process[g * ranks + r]` owns rank r of group g; this process is `here`. Creates
  // (O_EXCL) the shared-memory object `<prefix>-g<g>-r<r>` of every rank it owns; MapPeers() then maps the other
  // ranks of the groups it has a rank in, once their owners created them. Throws std::runtime_error naming the
  // object and errno on failure.
  Workspace(int ranks, int groups, WorkspaceSizes sizes, int64_t count_values, std::vector<int> process, int here,
            std::string prefix);
  ~Workspace();

  // Shared mode: maps the peers' objects, fills the process table and starts the local consumers.
  void MapPeers();
  // Shared mode: removes the names of this process's objects (the mappings stay valid); idempotent. Called once
  // every process has mapped them, and at release, so that nothing stays in /dev/shm.
  void UnlinkOwn();

  int ranks() const { return ranks_; }
  int groups() const { return groups_; }
  const WorkspaceSizes& sizes() const { return sizes_; }
  RankView view(int group, int rank) const { return RankView{blocks_[group * ranks_ + rank], layout_}; }
  GroupShared* shared(int group) const { return reinterpret_cast<GroupShared*>(shared_[group]); }
  int64_t count_values() const { return count_values_; }
  CountSlot* count_slot(int group, int rank) const {
    return reinterpret_cast<CountSlot*>(shared_[group] + GroupSharedBytes(ranks_) + GroupTailBytes(ranks_) +
                                        rank * CountSlotBytes(count_values_));
  }
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
  bool Local(int g, int r) const { return process_.empty() || process_[g * ranks_ + r] == here_; }
  bool GroupHere(int g) const;
  std::string ObjectName(int g, int r) const;
  int64_t GroupBytes() const {
    return GroupSharedBytes(ranks_) + GroupTailBytes(ranks_) + CountBoardBytes(ranks_, count_values_);
  }
  int64_t ObjectBytes() const { return layout_.total + GroupBytes(); }
  void Map(int g, int r, bool create);
  void StartConsumers();

  int ranks_, groups_;
  WorkspaceSizes sizes_;
  int64_t count_values_;
  Layout layout_;
  std::vector<char*> blocks_;   // per g * ranks + r (nullptr: a group this process has no rank in)
  std::vector<char*> shared_;   // per group: GroupShared, GroupTail, then the count board
  std::vector<std::unique_ptr<Consumer>> consumers_;  // null for ranks of other processes
  // Shared mode only.
  std::vector<int> process_;
  int here_ = -1;
  std::string prefix_;
  std::vector<std::pair<void*, size_t>> mappings_;
  std::vector<std::string> own_names_;
};

// Registry: the custom calls name a workspace by an integer handle attribute.
int64_t RegisterWorkspace(std::unique_ptr<Workspace> ws);
Workspace* LookupWorkspace(int64_t handle);
bool ReleaseWorkspace(int64_t handle);

// Error text for a failed wait; for a rank that gave up because of a peer, names the group's first failure.
std::string FormatError(const char* op, const ErrorRecord& e, int group, int ranks, int64_t timeout_ms,
                        const GroupShared* shared);

}  // namespace jmo::cpu
