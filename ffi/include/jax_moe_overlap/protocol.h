// The one definition of the peer workspace layout and the signalling protocol.
//
// Both the CPU handlers (ffi/cpu) and the CUDA kernels (ffi/cuda) include this header, so the two can never
// disagree about where a counter lives or what a flag value means. It is plain C++ (no <atomic>, no CUDA headers):
// each side applies its own atomics (std::atomic_ref on the host, cuda::atomic_ref / PTX on the device) to the
// 64-bit words defined here.
//
// Terms:
//   R         ranks in one expert-parallel group (the mesh axis size); G independent groups (the other mesh axes).
//   epoch     every custom call on a workspace is one epoch; rank r numbers its calls 1, 2, 3, ... in `calls`.
//   recv      rows pushed *to* this rank by dispatch, grouped by (local expert, source rank).
//   ret       expert outputs pushed *back* to this rank by expert_combine, in this rank's send order.
//   stage     where this rank's producer (the grouped GEMM) stores finished output tiles before the consumer ships them.
//   tile_ready[b] = epoch of the last call whose producer finished band b (monotonic, so never reset).
//
// Protocol of one call with epoch n on rank r (all counters monotonic; nothing is reset between calls):
//   1. Before writing into peer d's recv/ret rows, wait until d.done_epoch >= n-1 (d has finished reading call n-1).
//   2. Store the rows, then release-add the row count to d.recv_arrivals (dispatch) or d.ret_arrivals (combine).
//   3. Wait (acquire) until own arrivals >= own expected_* + expected rows of this call; advance expected_*.
//   4. Read the rows into the XLA output, then release-store done_epoch = n.
// dispatch_gemm (the dispatch and GEMM1 in one launch) refines steps 2-3 per block of rows: a pushing CTA moves the
// rows of one block J of its send order (send positions [128 J, 128 J + 128), its ret rows) that go to one rank d
// and release-adds their count to d.src_blocks[r][J] (and to d.recv_arrivals, so the call ends like a dispatch); a
// GEMM1 tile of rows from source s waits (acquire) until the blocks of s its rows lie in hold all the rows s keeps
// for d in them, which d knows from its plan (seg_ret_off, seg_rows). These counters are not monotonic: d zeroes
// the blocks of a call after its last tile and before the call's done_epoch, and no source adds before it has seen
// that done_epoch (step 1).
// Send once (dispatch and dispatch_gemm with a slot_primary operand of [P] slots): a token's row crosses to a rank once,
// not once per slot. Of the kept slots of one token routed to one other rank d, the one first in the send order (its
// primary) carries the row into its recv row; with every block, the source also stores, for each kept slot of the
// block, recv_from[row] = RecvFrom(epoch, primary's recv row) into d (a primary names its own row; slots the rank
// keeps for itself are all their own primaries). The counts stay those of the slots, so d's plan is unchanged. d
// fills a row whose entry names another row f < r (the expansion) only after the counter covering f's slot: in
// dispatch while copying recv into its output (a gather, no extra bytes), in dispatch_gemm before the GEMM tile that
// reads the row (its own copy in its recv). An entry of another epoch, or one naming a row that is not a primary of
// the same source, is a bad input (kBadRecvFrom), never a silent row.
// Rows a rank sends to itself follow the same steps with d = r: step 1 holds by stream order (the rank's own call
// n-1 ended before call n began). On CUDA the producer of expert_combine stores a local segment's output tiles
// straight into the rank's own ret rows and counts each finished band into its own ret_arrivals, so the consumer
// never copies them (at EP = 1 every row is local and no copy is left). Likewise a dispatch in a group of one rank
// stores its rows straight into the call's output (no recv rows), still counting them into its recv_arrivals; step 4
// then only zeroes the output's rows past them.
// Every wait is bounded by the call's timeout (CallWaitBoundMs: a group's first call may wait longer). A rank whose
// wait expires (or whose inputs fail validation) records an ErrorRecord and raises the group's abort word to the
// failing epoch, so every other waiter of the group gives up too instead of waiting out its own timeout. A rank that
// only now starts that failed epoch fails it at once.
// A rank starting a later call first meets all R ranks at a host barrier, and the last to arrive resets all
// control words and flags to zero (epochs restart at 1); only then does anyone write again.
//
// exchange_counts (groups whose ranks span processes, where the collective backend's wait has no bound) is an epoch
// like the others. Each rank owns one slot of the group's count board (CountSlot below, in group memory): its routing
// counts and a stamp, the epoch they belong to. Epoch n on rank r:
//   1. Wait until every peer d has d.done_epoch >= n-1 (d has finished reading the board in call n-1).
//   2. Store r's counts in its slot, then release-store its stamp = n.
//   3. For every source s, wait (acquire) until s's stamp >= n, and copy s's counts. No peer can move its stamp
//      past n before r's done_epoch reaches n (step 1), so the counts read are those of epoch n.
//   4. Release-store done_epoch = n.
// A peer that hangs or died before step 2 leaves its stamp at an earlier epoch: the wait in step 3 names it.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#define JMO_HD __host__ __device__
#else
#define JMO_HD
#endif

namespace jmo {

// Rows of one producer tile / one consumer push: the "row band" (BM rows x all N columns).
constexpr int64_t kBandRows = 64;
// Alignment of every region in the workspace (a cache line on the host; 16-byte vector stores on the GPU need 16).
constexpr int64_t kAlign = 128;

// Stages named in timeout errors.
enum Stage : uint64_t {
  kStageNone = 0,
  kStagePeerReady = 1,    // sender waiting for a peer to finish reading the previous call (done_epoch)
  kStageRecvArrivals = 2, // dispatch receiver waiting for its rows
  kStageTileReady = 3,    // consumer waiting for a producer tile flag
  kStageRetArrivals = 4,  // combine receiver waiting for its expert outputs
  kStageAbortedByPeer = 5,// gave up because another rank of the group aborted
  kStageReset = 6,        // the recovery barrier after an abort did not gather every rank
  kStageBadInput = 7,     // CUDA only: a kernel found an invalid routing input (device data the host cannot check
                          // without a sync); ErrorRecord.detail says which input (BadInput)
  kStageCounts = 8,       // exchange_counts waiting for a peer's routing counts (its stamp: got = the epoch of its
                          // last published counts, expected = this call's epoch)
  kStageSrcBlock = 9,     // dispatch_gemm's GEMM waiting for a block of rows from a source (peer = the source)
  kStageExpand = 10,      // CUDA dispatch_gemm, send once: a GEMM tile waiting for its rows to be filled from their
                          // primaries (peer = the m-tile; values are epochs)
};

// Which input a kStageBadInput record is about (ErrorRecord.detail); ffi/common/error_text.h words each one.
enum BadInput : uint64_t {
  kBadExpertId = 1,       // a slot names an expert id that is neither -1 (no selection) nor in [0, E): ErrorRecord
                          // peer = slot, got = the slot's token (source row), expected = the id (two's complement)
  kBadRoute = 2,          // a slot routes outside the workspace (rank, row or source row out of range)
  kBadSegment = 3,        // a (local expert, source) segment lies outside recv or the source's ret rows
  kBadExpectedRows = 4,   // the expected row count lies outside [0, capacity]
  kBadRankOperands = 5,   // the rank/group operands disagree with the device's place in the workspace
  kBadRetRow = 6,         // a slot's ret row is out of range
  kBadTooManyTiles = 7,   // more tiles than the workspace has tile_ready flags
  kBadCallShape = 8,      // CPU: the call's operands do not fit the workspace (its own error names them)
  kBadKeptRows = 9,       // dispatch_gemm: the expected row count (got) differs from its segments' rows (expected)
  kBadRecvFrom = 10,      // send once: recv row `peer`'s recv_from entry (got, RecvFrom) is not of this call or names a
                          // row that is not an earlier primary row of the same source (expected: the call's epoch)
  kBadPrimary = 11,       // send once: slot `peer`'s slot_primary (got) is not a kept slot of the same source row and
                          // destination, its own primary, at an earlier recv row (expected: the slots P)
};

inline const char* StageName(uint64_t s) {
  switch (s) {
    case kStagePeerReady: return "peer_ready (waiting for the peer to finish the previous call)";
    case kStageRecvArrivals: return "recv_arrivals (dispatch waiting for rows from peers)";
    case kStageTileReady: return "tile_ready (consumer waiting for a producer tile)";
    case kStageRetArrivals: return "ret_arrivals (combine waiting for expert outputs from peers)";
    case kStageAbortedByPeer: return "aborted_by_peer (another rank of the group failed first)";
    case kStageReset: return "reset (recovery barrier after an earlier timeout)";
    case kStageBadInput: return "bad_input (a kernel found an invalid routing input)";
    case kStageCounts: return "counts (exchange_counts waiting for a peer's routing counts; values are epochs)";
    case kStageSrcBlock: return "src_block (dispatch_gemm's GEMM waiting for a block of rows from a peer)";
    case kStageExpand: return "expand (dispatch_gemm's GEMM waiting for its rows to be filled from their primaries)";
    default: return "none";
  }
}

// What a timed-out wait leaves behind, per rank (host memory on CPU, host-mapped memory on CUDA).
struct ErrorRecord {
  uint64_t code;      // 0 = no error, else a Stage
  uint64_t rank;      // who waited
  uint64_t peer;      // whom it waited for (R = "any peer", for arrival counters)
  uint64_t epoch;     // the call's epoch
  uint64_t got;       // value observed when the wait gave up
  uint64_t expected;  // value waited for
  uint64_t detail;    // kStageBadInput: which input (BadInput)
  uint64_t timeout_ms;// the failing rank's wait bound (0: not recorded)
};

// Control words of one rank; each on its own cache line so that polling one does not slow writers of another.
struct alignas(kAlign) Word {
  uint64_t value;
  uint64_t pad[kAlign / 8 - 1];
};

// dispatch_gemm's arrival counters: src_blocks[s * SrcBlocks(ret_rows) + J] = rows of block J of source s's send
// order that s has pushed into this rank's recv in the current call. kMaxSourceCounters = the CUDA kernels'
// kMaxRanks; a block is one 128-row tile of GEMM1.
constexpr int kMaxSourceCounters = 32;
constexpr int kSrcBlockRows = 128;
JMO_HD inline int64_t SrcBlocks(int64_t ret_rows) { return (ret_rows + kSrcBlockRows - 1) / kSrcBlockRows; }

// Send once: recv_from[r] of a recv row r = the call's epoch in the high 32 bits, the recv row holding r's bytes in
// the low 32 (r itself for a primary row). Tagged with the epoch so that an entry no source wrote in this call is
// reported, not read as a row.
JMO_HD inline uint64_t RecvFrom(uint64_t epoch, int64_t row) { return (epoch << 32) | (uint64_t)(uint32_t)row; }
JMO_HD inline bool RecvFromOfEpoch(uint64_t entry, uint64_t epoch) { return (entry >> 32) == (epoch & 0xffffffffu); }
JMO_HD inline int64_t RecvFromRow(uint64_t entry) { return (int64_t)(uint32_t)entry; }

// The bound of every wait of a call with this epoch: timeout_ms, or for epoch 1 (the group's first call, or its first
// after a recovery) at least first_call_timeout_ms. Before a group's first call its ranks have not met since the
// workspace was set up: in a job of several processes each finishes compiling and produces its first batch on its
// own in the meantime, so they begin that call as far apart as those end, while later calls follow one another. After
// a recovery the ranks have just met at the host barrier; the longer bound then only delays the report of another
// failure in that call.
JMO_HD inline int64_t CallWaitBoundMs(int64_t timeout_ms, int64_t first_call_timeout_ms, uint64_t epoch) {
  return epoch == 1 && first_call_timeout_ms > timeout_ms ? first_call_timeout_ms : timeout_ms;
}

struct RankControl {
  Word calls;              // epochs started by this rank (written by this rank only)
  Word done_epoch;         // last epoch whose reads this rank has finished (read by peers before they write)
  Word recv_arrivals;      // rows that peers have pushed into recv, all calls together
  Word recv_expected;      // rows this rank has consumed from recv, all calls together
  Word ret_arrivals;       // rows that peers have pushed into ret, all calls together
  Word ret_expected;       // rows this rank has consumed from ret, all calls together
};

// Sizes of one rank's workspace; identical on every rank (the workspace is symmetric).
struct WorkspaceSizes {
  int64_t row_bytes;   // widest row of any call (model dim x largest element size)
  int64_t recv_rows;   // capacity of recv and stage (rows this rank can receive in one call)
  int64_t ret_rows;    // capacity of ret (T*k: one row per routed slot of this rank)
  int64_t max_bands;   // tile_ready flags (>= ceil(recv_rows/kBandRows) + number of segments)
};

JMO_HD inline int64_t AlignUp(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Byte offsets inside one rank's workspace block.
// Everything before `recv` is control state, which the recovery after a failure zeroes.
struct Layout {
  int64_t control, tile_ready, src_blocks, recv_from, recv, ret, stage, total;
};

JMO_HD inline Layout MakeLayout(const WorkspaceSizes& s) {
  Layout l;
  l.control = 0;
  l.tile_ready = AlignUp(l.control + (int64_t)sizeof(RankControl));
  l.src_blocks = AlignUp(l.tile_ready + s.max_bands * 8);
  l.recv_from = AlignUp(l.src_blocks + kMaxSourceCounters * SrcBlocks(s.ret_rows) * 8);
  l.recv = AlignUp(l.recv_from + s.recv_rows * 8);
  l.ret = AlignUp(l.recv + s.recv_rows * s.row_bytes);
  l.stage = AlignUp(l.ret + s.ret_rows * s.row_bytes);
  l.total = AlignUp(l.stage + s.recv_rows * s.row_bytes);
  return l;
}

JMO_HD inline int64_t MaxBands(int64_t recv_rows, int64_t num_segments) {
  return (recv_rows + kBandRows - 1) / kBandRows + num_segments + 1;
}

// Typed views of one rank's block.
struct RankView {
  char* base;
  Layout layout;
  JMO_HD RankControl* control() const { return reinterpret_cast<RankControl*>(base + layout.control); }
  JMO_HD uint64_t* tile_ready() const { return reinterpret_cast<uint64_t*>(base + layout.tile_ready); }
  JMO_HD uint64_t* src_blocks() const { return reinterpret_cast<uint64_t*>(base + layout.src_blocks); }
  JMO_HD uint64_t* recv_from() const { return reinterpret_cast<uint64_t*>(base + layout.recv_from); }
  JMO_HD char* recv() const { return base + layout.recv; }
  JMO_HD char* ret() const { return base + layout.ret; }
  JMO_HD char* stage() const { return base + layout.stage; }
};

// Group-wide words shared by the R ranks of one group (host memory; host-mapped on CUDA so kernels can poll it).
struct GroupShared {
  Word abort;                // epoch of the group's first failure (0: none); cleared by the reset barrier
  Word first_failed;         // 1 + the rank whose failure was recorded first (0: none): its record is the cause every
                             // rank reports. A rank writes its record, then claims this word (compare-and-swap from
                             // 0), then raises abort, so a rank that sees abort also sees the record it names.
                             // CPU only: GPUs have no atomic on host-mapped memory over PCIe, so on CUDA it stays 0
                             // and the host picks the first record by rule (cuda/workspace/workspace.cc FirstRecord).
  ErrorRecord errors[1];     // really [R]: one record per rank (allocated with R entries)
};

JMO_HD inline int64_t GroupSharedBytes(int64_t ranks) {
  return AlignUp((int64_t)sizeof(GroupShared) + (ranks - 1) * (int64_t)sizeof(ErrorRecord));
}

// The count board of exchange_counts, in group memory: one slot per rank, its stamp (the epoch whose counts the slot
// holds) on its own cache line, then up to `count_values` int32 counts. Each platform places the board after its
// own group words (ffi/cpu/workspace_cpu.h, ffi/cuda/workspace/workspace.h).
struct CountSlot {
  Word stamp;
  int32_t values[1];  // really [count_values]
};
JMO_HD inline int64_t CountSlotBytes(int64_t count_values) {
  return AlignUp((int64_t)sizeof(Word) + 4 * count_values);
}
JMO_HD inline int64_t CountBoardBytes(int64_t ranks, int64_t count_values) {
  return ranks * CountSlotBytes(count_values);
}

// One routing segment as the producer and consumer see it: the rows of recv that came from source rank `src` for
// local expert `expert`, and where their outputs go in the source's ret rows. Every tile of a segment has exactly
// one destination rank, so ordering segments is ordering the GEMM's tiles (remote-critical first).
struct Segment {
  int32_t expert;
  int32_t src;
  int32_t recv_off;    // first row in recv / stage
  int32_t rows;        // kept rows (0 = empty, skipped)
  int32_t ret_off;     // first row in src's ret
  int32_t band_base;   // index of the segment's first tile_ready flag
};

// The producer's segment order: remote segments first, the most loaded destination first (its push takes longest),
// then by source and expert for determinism; local segments (src == rank) last. A strict total order on distinct
// (src, expert) pairs, so the CUDA table builder can place each segment by counting the segments before it (the
// segments of the sources before its own, then those of its source with a smaller expert) and get the CPU's
// insertion-sort order exactly.
// Sources first (SourceBefore: the order of their segment groups), then experts within a source.
// (rows_u, rows_s: the rows of sources u and s; the CUDA table builder compares sources it holds in registers.)
JMO_HD inline bool SourceBeforeRows(int u, int s, int rank, int64_t rows_u, int64_t rows_s) {
  // Remote before local, then more rows first, then the lower index (so never u before u). Written without
  // short-circuits so that device code evaluates it with predicates, not branches (segment_table.cuh's placing loop).
  const bool ul = u == rank, sl = s == rank, mixed = ul != sl;
  return (mixed & !ul) | (!mixed & ((rows_u > rows_s) | ((rows_u == rows_s) & (u < s))));
}
JMO_HD inline bool SourceBefore(int u, int s, int rank, const int64_t* rows_to_rank) {
  return SourceBeforeRows(u, s, rank, rows_to_rank[u], rows_to_rank[s]);
}
JMO_HD inline bool SegmentBefore(const Segment& x, const Segment& y, int rank, const int64_t* rows_to_rank) {
  if (x.src != y.src) return SourceBefore(x.src, y.src, rank, rows_to_rank);
  return x.expert < y.expert;
}

// `order` receives indices into `segs` in SegmentBefore order. O(n^2) insertion sort (the CPU handlers; n = E_local
// * R, small).
JMO_HD inline void OrderSegments(const Segment* segs, int n, int rank, const int64_t* rows_to_rank, int* order) {
  for (int i = 0; i < n; ++i) order[i] = i;
  for (int i = 1; i < n; ++i) {
    int v = order[i];
    int j = i - 1;
    while (j >= 0 && SegmentBefore(segs[v], segs[order[j]], rank, rows_to_rank)) {
      order[j + 1] = order[j];
      --j;
    }
    order[j + 1] = v;
  }
}

}  // namespace jmo
