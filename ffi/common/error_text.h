// Text of a failure record (protocol.h's ErrorRecord), shared by the CPU and CUDA handlers so that a timeout or a
// bad input reads the same on both platforms. Host code only.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "jax_moe_overlap/protocol.h"

namespace jmo {

// "rank 1 (group 0) timed out after 200 ms in epoch 7 at stage ..., waiting for peer 2: observed 3, expected 9",
// or the bad input a kernel found. `ranks` tells a named peer from "any peer" (peer == ranks).
//
// Built by string concatenation, not iostreams: the text is formed on the failure path inside Python processes
// whose modules may link their own copy of the C++ runtime, and a stream's locale machinery can then mix two copies
// and crash; std::to_string and std::string stay within one module.
inline std::string DescribeRecord(const ErrorRecord& e, int group, int ranks) {
  using std::to_string;
  const auto i64 = [](uint64_t v) { return to_string(static_cast<int64_t>(v)); };
  std::string s = "rank " + to_string(e.rank) + " (group " + to_string(group) + ") ";
  if (e.code == kStageBadInput) {
    s += "found an invalid input in epoch " + to_string(e.epoch) + ": ";
    switch (e.detail) {
      case kBadExpertId:
        s += "its token " + i64(e.got) + " (slot " + to_string(e.peer) + ") names expert id " + i64(e.expected) +
             ", which is neither -1 (no selection) nor in [0, num_experts)";
        break;
      case kBadRoute:
        s += "slot " + to_string(e.peer) + " routes outside the workspace (value " + i64(e.got) + ", bound " +
             to_string(e.expected) + ")";
        break;
      case kBadSegment:
        s += "segment " + to_string(e.peer) + " lies outside the buffers (value " + i64(e.got) + ", bound " +
             to_string(e.expected) + ")";
        break;
      case kBadExpectedRows: s += "expected rows " + i64(e.got) + " outside [0, " + to_string(e.expected) + "]"; break;
      case kBadRankOperands:
        s += "rank/group operands (" + i64(e.got) + ", " + i64(e.peer) +
             ") do not match the workspace's rank/group of this device (" + to_string(e.rank) + ", " +
             to_string(e.expected) + ")";
        break;
      case kBadRetRow:
        s += "slot " + to_string(e.peer) + " has ret row " + i64(e.got) + " outside [0, " + to_string(e.expected) + ")";
        break;
      case kBadTooManyTiles:
        s += "more tiles (" + to_string(e.got) + ") than the workspace has flags (" + to_string(e.expected) + ")";
        break;
      case kBadKeptRows:
        s += "expected rows " + i64(e.got) + " differ from the rows of its segments (" + to_string(e.expected) + ")";
        break;
      case kBadRecvFrom:
        s += "send once: recv row " + to_string(e.peer) + " has recv_from entry " + to_string(e.got) +
             " (epoch << 32 | row), not this call's (epoch " + to_string(e.expected) +
             ") naming an earlier primary row of the same source: the ranks do not agree on sending once";
        break;
      case kBadPrimary:
        s += "send once: slot " + to_string(e.peer) + " names slot " + i64(e.got) + " of " + to_string(e.expected) +
             " as its primary, which is not a kept slot of the same source row and destination rank, its own "
             "primary, at an earlier recv row";
        break;
      case kBadCallShape: s += "the call's operands do not fit the workspace (that rank's own error names them)"; break;
      default: s += "code " + to_string(e.detail); break;
    }
    return s;
  }
  s += "timed out";
  if (e.timeout_ms > 0) s += " after " + to_string(e.timeout_ms) + " ms";
  s += " in epoch " + to_string(e.epoch) + " at stage " + StageName(e.code) + ", waiting for ";
  if (e.peer >= static_cast<uint64_t>(ranks))
    s += "rows from peers that all started this epoch";
  else
    s += "peer " + to_string(e.peer);
  s += ": observed " + to_string(e.got) + ", expected " + to_string(e.expected);
  return s;
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

// For a group spanning processes (`process[r]`: the process owning rank r; null, or -1 everywhere, in one process):
// which process the awaited peer (or every rank) belongs to, appended to a record's text.
inline std::string ProcessNote(const ErrorRecord& e, int ranks, const int32_t* process) {
  if (process == nullptr || process[0] < 0) return "";
  const std::string stops = "; a process that died or hangs stops its ranks)";
  if (e.peer < (uint64_t)ranks)
    return " (peer rank " + std::to_string(e.peer) + " is in process " + std::to_string(process[e.peer]) + stops;
  std::string s = " (the group's ranks are in processes";
  for (int r = 0; r < ranks; ++r) s += (r ? ", " : " [") + std::to_string(process[r]);
  return s + "] by rank" + stops;
}

}  // namespace jmo
