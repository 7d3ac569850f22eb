// The recovery barrier of a group after a failure (protocol.h): the R ranks meet on one 64-bit word of group memory,
// generation << 32 | ranks arrived, and the last to arrive resets the group before it opens the barrier. Host atomics
// on a lock-free word, so the same code serves ranks that are threads of one process and ranks of several processes
// mapping the group memory (POSIX shared memory). Host code only.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

namespace jmo {

// Polls politely: a 2-core CI machine runs 4 device threads and 4 consumer threads, and the ranks of one GPU's
// processes share its host's cores.
inline void Backoff(int& spins) {
  if (++spins < 64) return;
  if (spins < 256) {
    std::this_thread::yield();
    return;
  }
  std::this_thread::sleep_for(std::chrono::microseconds(spins < 2048 ? 20 : 200));
}

class GroupBarrier {
 public:
  explicit GroupBarrier(uint64_t* word) : word_(*word) {}

  // Arrives; true for the last of `ranks` ranks: every rank is then here, so nothing reads or writes group memory,
  // and the caller resets the group, then calls Open().
  bool Arrive(int ranks) {
    ranks_ = static_cast<uint64_t>(ranks);
    const uint64_t before = word_.fetch_add(1, std::memory_order_acq_rel);
    gen_ = before >> 32;
    return (before & 0xffffffffu) + 1 == ranks_;
  }

  void Open() { word_.store((gen_ + 1) << 32, std::memory_order_release); }

  // Waits for the last rank's Open(), until `deadline`. At the deadline leaves the barrier and returns false with
  // *arrived = the ranks that were there, this one included; but not once every rank has arrived (the count and the
  // generation are one word): the last rank is then resetting the group, this rank's memory included, and opens it
  // when done, so leaving would report a missing rank that is not missing and skip the reset.
  bool Wait(std::chrono::steady_clock::time_point deadline, uint64_t* arrived) {
    int spins = 0;
    for (;;) {
      uint64_t v = word_.load(std::memory_order_acquire);
      if ((v >> 32) != gen_) return true;
      if (std::chrono::steady_clock::now() >= deadline && (v & 0xffffffffu) < ranks_) {
        if (word_.compare_exchange_strong(v, v - 1, std::memory_order_acq_rel)) {
          *arrived = v & 0xffffffffu;
          return false;
        }
        continue;
      }
      Backoff(spins);
    }
  }

 private:
  std::atomic_ref<uint64_t> word_;
  uint64_t gen_ = 0;
  uint64_t ranks_ = 0;
};

}  // namespace jmo
