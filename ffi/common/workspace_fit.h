// Whether a call fits the workspace it runs on: the one capacity check of every workspace call on both platforms
// (each platform's BeginCall makes it, with the call's footprint) and the count board's check of exchange_counts.
// Plain C++ over protocol.h's sizes, so the CPU handlers and the CUDA launchers share it and report alike.
#pragma once

#include <cstdint>
#include <string>

#include "jax_moe_overlap/protocol.h"

namespace jmo {

// What one call takes of a rank's workspace (0: none of that part).
struct CallFootprint {
  int64_t row_bytes = 0;      // its rows' width in bytes (recv, ret and stage rows)
  int64_t recv_rows = 0;      // rows it receives: its recv capacity, cap
  int64_t ret_rows = 0;       // rows that come back to it: its slots (T*k)
  int64_t local_experts = 0;  // E_local: its (local expert, source) segments are E_local x ranks
};

// gather_rs's float32 partial slices [R, T, N] in a rank's ret rows, counted in rows of the call's own width
// (row_bytes, its N elements): the ret rows of its footprint (0 for rows of no bytes).
inline int64_t GatherRsPartialRows(int64_t R, int64_t T, int64_t N, int64_t row_bytes) {
  return row_bytes ? (R * T * N * 4 + row_bytes - 1) / row_bytes : 0;
}

// Empty if `need` fits a workspace of `have` and `ranks` ranks whose kernels take at most `max_segments` segments
// (the CUDA kernels keep them on chip); else what does not fit, with both sides' numbers.
inline std::string CheckFits(const CallFootprint& need, const WorkspaceSizes& have, int ranks, int64_t max_segments) {
  using std::to_string;
  if (need.row_bytes > have.row_bytes || need.recv_rows > have.recv_rows || need.ret_rows > have.ret_rows) {
    std::string s = "the call needs rows of " + to_string(need.row_bytes) + " B x " + to_string(need.recv_rows) +
                    " recv rows";
    if (need.ret_rows > 0) s += " and " + to_string(need.ret_rows) + " ret rows (slots)";
    s += " but the workspace holds rows of " + to_string(have.row_bytes) + " B x " + to_string(have.recv_rows) +
         " recv rows";
    if (need.ret_rows > 0) s += " and " + to_string(have.ret_rows) + " ret rows";
    return s;
  }
  if (need.local_experts * ranks > max_segments)
    return to_string(need.local_experts * ranks) + " segments (local experts x ranks) exceed the kernels' " +
           to_string(max_segments);
  return {};
}

// exchange_counts: counts_all [R_src, R_dst, E_local] of a workspace of `ranks` ranks whose count board holds
// `max_counts` values per rank.
inline std::string CheckCountsFit(int64_t R_src, int64_t R_dst, int64_t E_local, int ranks, int64_t max_counts) {
  using std::to_string;
  if (R_src == ranks && R_dst == ranks && R_dst * E_local <= max_counts) return {};
  return "counts_all [" + to_string(R_src) + ", " + to_string(R_dst) + ", " + to_string(E_local) +
         "] does not fit the workspace (" + to_string(ranks) + " ranks, at most " + to_string(max_counts) +
         " counts per rank)";
}

}  // namespace jmo
