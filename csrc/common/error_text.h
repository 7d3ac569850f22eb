// Text of a failure record (protocol.h's ErrorRecord), shared by the CPU and CUDA handlers so that a timeout or a
// bad input reads the same on both platforms. Host code only.
#pragma once

#include <atomic>
#include <cstdint>
#include <sstream>
#include <string>

#include "jax_moe_overlap/protocol.h"

namespace jmo {

// "rank 1 (group 0) timed out after 200 ms in epoch 7 at stage ..., waiting for peer 2: observed 3, expected 9",
// or the bad input a kernel found. `ranks` tells a named peer from "any peer" (peer == ranks).
inline std::string DescribeRecord(const ErrorRecord& e, int group, int ranks) {
  std::ostringstream os;
  os << "rank " << e.rank << " (group " << group << ") ";
  if (e.code == kStageBadInput) {
    os << "found an invalid input in epoch " << e.epoch << ": ";
    switch (e.detail) {
      case kBadExpertId:
        os << "its token " << (int64_t)e.got << " (slot " << e.peer << ") names expert id " << (int64_t)e.expected
           << ", which is neither -1 (no selection) nor in [0, num_experts)";
        break;
      case kBadRoute:
        os << "slot " << e.peer << " routes outside the workspace (value " << (int64_t)e.got << ", bound "
           << e.expected << ")";
        break;
      case kBadSegment:
        os << "segment " << e.peer << " lies outside the buffers (value " << (int64_t)e.got << ", bound "
           << e.expected << ")";
        break;
      case kBadExpectedRows: os << "expected rows " << (int64_t)e.got << " outside [0, " << e.expected << "]"; break;
      case kBadRankOperands:
        os << "rank/group operands (" << (int64_t)e.got << ", " << (int64_t)e.peer
           << ") do not match the workspace's rank/group of this device (" << e.rank << ", " << e.expected << ")";
        break;
      case kBadRetRow:
        os << "slot " << e.peer << " has ret row " << (int64_t)e.got << " outside [0, " << e.expected << ")";
        break;
      case kBadTooManyTiles:
        os << "more tiles (" << e.got << ") than the workspace has flags (" << e.expected << ")";
        break;
      case kBadCallShape: os << "the call's operands do not fit the workspace (that rank's own error names them)"; break;
      default: os << "code " << e.detail; break;
    }
    return os.str();
  }
  os << "timed out";
  if (e.timeout_ms > 0) os << " after " << e.timeout_ms << " ms";
  os << " in epoch " << e.epoch << " at stage " << StageName(e.code) << ", waiting for ";
  if (e.peer >= (uint64_t)ranks)
    os << "rows from peers that all started this epoch";
  else
    os << "peer " << e.peer;
  os << ": observed " << e.got << ", expected " << e.expected;
  return os.str();
}

// The record of the group's first failure: the rank named by the first_failed word, else (a record written by code
// that does not claim the word) the lowest rank holding a failure of its own; nullptr when no rank recorded one.
// The caller has seen the abort word raised (acquire), which orders the records and first_failed before it.
inline const ErrorRecord* FirstFailure(const GroupShared* shared, int ranks) {
  if (shared == nullptr) return nullptr;
  const uint64_t first =
      std::atomic_ref<uint64_t>(const_cast<uint64_t&>(shared->first_failed.value)).load(std::memory_order_acquire);
  if (first >= 1 && first <= (uint64_t)ranks && shared->errors[first - 1].code != 0) return &shared->errors[first - 1];
  for (int r = 0; r < ranks; ++r)
    if (shared->errors[r].code != 0 && shared->errors[r].code != kStageAbortedByPeer) return &shared->errors[r];
  return nullptr;
}

}  // namespace jmo
