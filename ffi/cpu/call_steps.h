// The steps the CPU handlers of the workspace calls share (handlers.cc, dispatch_gemm.cc): opening an epoch,
// recording a failure, and the parts of protocol.h's dispatch that dispatch_gemm repeats (the slot checks, the recv
// segments, the end of the call).
#pragma once

#include <cstdint>
#include <vector>

#include "common/call_attrs.h"
#include "common/call_options.h"
#include "common/dtype.h"
#include "common/workspace_fit.h"
#include "cpu/workspace_cpu.h"
#include "jax_moe_overlap/protocol.h"
#include "xla/ffi/api/ffi.h"

namespace jmo::cpu {

// One call of a rank, as the CUDA launchers' CallSite: where it runs, its options, and the epoch it opened with the
// bound of its waits (protocol.h's CallWaitBoundMs for that epoch) and their deadline (the call's start + the bound).
struct CallContext {
  Workspace* ws;
  int group, rank;
  CallOptions opts;
  uint64_t epoch;
  Clock::time_point deadline;
  int64_t bound_ms;
};

// Common start of every call: resolve the workspace (attrs.workspace), check rank/group and the options (CheckOptions: like a shape
// error, a refusal before the epoch, which leaves the group as it was), apply the test delay, recover from an earlier
// abort and open the epoch; then check that `need` fits the workspace (CheckFits), failing the epoch (Fail) if not,
// so the peers give up at once.
xla::ffi::ErrorOr<CallContext> BeginCall(const char* op, const CallAttrs& attrs, int32_t group, int32_t rank,
                                         const CallFootprint& need);

// Bounded wait of the call until *word >= base + count (Workspace::WaitAtLeast with the call's rank, epoch and
// deadline): `peer` and `stage` name what it waits for in the error record.
ErrorRecord WaitFor(const CallContext& c, const uint64_t* word, uint64_t base, uint64_t count, int peer, Stage stage);

// A call that fails validation after its epoch began must not leave its peers waiting for rows that will never
// come: record the failure (`detail`, `peer`, `got`, `expected` as protocol.h's BadInput describes them) and raise
// the group's abort word, so they give up at once naming this rank's failure, and the next call resets the group.
xla::ffi::Error Fail(const CallContext& c, xla::ffi::Error err, BadInput detail = kBadCallShape, uint64_t peer = 0,
                     uint64_t got = 0, uint64_t expected = 0);

// A bad input whose record says it all: this rank's error is the record's text, as its peers quote it.
xla::ffi::Error FailInput(const CallContext& c, const char* op, BadInput detail, uint64_t peer, uint64_t got,
                          uint64_t expected);

// The error of a failed wait (its record), for op.
xla::ffi::Error TimeoutError(const char* op, const ErrorRecord& e, const CallContext& c);

// Every slot of a dispatch before any row moves: a valid expert id, and a kept slot's destination rank, recv row
// (< cap) and source row (< S) in range. Dropped and skipped slots (dest row -1) are not moved.
xla::ffi::Error CheckSlots(const CallContext& c, const char* op, const int32_t* src_row, const int32_t* dst_rank,
                           const int32_t* dst_row, int64_t P, int64_t S, int64_t cap);

// Send once (protocol.h): every kept slot routed to another rank whose slot_primary names another slot must name a
// kept slot of the same source row and destination rank that is its own primary and lies at an earlier recv row
// (kBadPrimary). Slots this rank keeps for itself ignore slot_primary (their rows are always copied one per slot).
xla::ffi::Error CheckPrimaries(const CallContext& c, const char* op, const int32_t* src_row, const int32_t* dst_rank,
                               const int32_t* dst_row, const int32_t* primary, int64_t P);

// The sender's side of one kept slot p routed to rank d (peer = d's view), as a dispatch moves it: the row
// src[src_row[p]] into d's recv row dst_row[p], or with send once (primary != nullptr) only where p is its own
// primary or d is this rank, and then also d's recv_from entry of that row (RecvFrom: the call's epoch, the recv row
// holding its bytes). The caller counts the slot.
// scale: a dispatch's row_scale (never with send once): the row lands as src * scale.factor[p], its D elements of dt
// (float32 or bfloat16) each the float32 product rounded once to dt (round to nearest even), as the CUDA kernel's
// ScaleRowWarp; scale.factor nullptr: the row's bytes moved.
struct SlotScale {
  const float* factor = nullptr;  // [P]
  DType dt = DType::kF32;
  int64_t D = 0;
};
void MoveSlot(const CallContext& c, const RankView& peer, int d, int64_t p, const char* src, int64_t row_bytes,
              const int32_t* src_row, const int32_t* dst_row, const int32_t* primary, char* rows,
              const SlotScale& scale = {});

// Send once, the receiver's side: the recv row whose bytes row r takes (RecvFromRow of its entry), after checking
// that the entry is this call's and names r itself or an earlier row whose own entry names itself; else the call
// fails (kBadRecvFrom).
xla::ffi::ErrorOr<int64_t> RecvFromChecked(const CallContext& c, const char* op, const RankView& self, int64_t r);

// The (local expert, source) segments of this rank's recv in (expert, source) order, as the plan packs them
// (Segment: recv_off from the packing, ret_off = the first send position on the source, band_base = the first
// tile_ready flag of the segment); rows_to_rank[s] = the rows this rank receives from s. A segment outside recv
// (cap rows) or the source's ret rows fails the call (kBadSegment).
xla::ffi::ErrorOr<std::vector<Segment>> RecvSegments(const CallContext& c, const char* op, const int32_t* seg_rows,
                                                     const int32_t* seg_ret_off, int64_t E_l, int64_t cap,
                                                     std::vector<int64_t>* rows_to_rank);

// The producer's segments of a call that runs a grouped GEMM over recv (expert_combine, gather_rs): RecvSegments,
// then the tile-ready flags checked against the workspace's (kBadTooManyTiles), then the non-empty segments in
// protocol.h's producer order (OrderSegments: remote sources first, the most loaded first; local last).
xla::ffi::ErrorOr<std::vector<Segment>> ProducerSegments(const CallContext& c, const char* op,
                                                         const int32_t* seg_rows, const int32_t* seg_ret_off,
                                                         int64_t E_l, int64_t cap, std::vector<int64_t>* rows_to_rank);

// The end of a dispatch (protocol.h steps 3-4): wait until `expected` more rows have arrived in recv, advance
// recv_expected, copy them to out [cap, row_bytes], then release-store done_epoch. out == nullptr: the caller does not
// keep the rows (dispatch_gemm without x_recv); every step but the copy still runs, since the counters and done_epoch
// are what the next call of this rank and its peers' pushes wait on. rows_in_out: the rows were stored straight into
// out (a group of one rank), so only what follows them is written. zero_padding: out's rows past them are zeroed
// (dispatch's result); else left unwritten (dispatch_gemm's, which no consumer reads there). gather: send once, so
// row r of out is recv's row RecvFromChecked(r) (the expansion as part of the copy: no bytes beyond it).
xla::ffi::Error EndDispatch(const CallContext& c, const char* op, int64_t expected, int64_t cap, int64_t row_bytes,
                            void* out, bool rows_in_out, bool zero_padding, bool gather = false);

}  // namespace jmo::cpu
