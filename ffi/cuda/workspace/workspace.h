// The peer workspace on CUDA devices, laid out by protocol.h exactly as on the CPU.
//
// Each rank's symmetric block is cudaMalloc'd on that rank's device by the process that owns the rank; every rank's
// kernels get the table of all R blocks of their group (peer pointers). In one process (jax's single-controller mode)
// the table holds the blocks themselves, valid through CUDA peer access, which Create checks and enables for every
// pair of distinct devices. Several ranks may share one device (the loopback harness).
//
// A group may span processes of one host (jax.distributed, a process per GPU or several GPUs per process; Sharing
// below): each process allocates its own ranks' blocks, exports each with cudaIpcGetMemHandle (ExportHandles), and
// opens its peers' with cudaIpcOpenMemHandle (OpenPeers); the table then holds those mappings. Peers on the opener's
// own device work too (IPC works across processes of one device; peer access of a device with itself is not needed).
//
// The group memory (GroupShared: abort word and error records; then GroupTail and the count board) is host memory
// mapped into the GPUs' address space: kernels write it, and the host reads it at the start of the next call
// without any synchronization. In one process it is cudaHostAlloc'd; across processes it is a POSIX shared-memory
// object created by the process of rank 0 and mapped by the others, each cudaHostRegister'ing its mapping.
//
// Per rank there is also a small private device block (RankPrivate + one tile counter per band), which peers never
// touch: the epoch and deadline of the call in flight, whether it failed, whether it runs inside a CUDA graph, and
// the producer's per-band tile counts. The RankPrivate block is kept (marked released) when the workspace is freed.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "jax_moe_overlap/protocol.h"
#include "jax_moe_overlap/resource_model.h"

namespace jmo::cuda {

constexpr int kMaxRanks = 32;      // ranks of one group (the peer table is passed to kernels by value)
static_assert(kMaxRanks <= kMaxSourceCounters, "a per-source arrival counter for every rank");
constexpr int kMaxSegments = 256;  // E_local * R segments of one expert_combine call (kept in shared memory)
constexpr int kThreads = 256;      // threads of every CTA

// What a call can fail with (mapped to ffi::ErrorCode by the handlers).
enum StatusCode { kOk = 0, kInvalidArgument = 1, kDeadlineExceeded = 2, kInternal = 3, kFailedPrecondition = 4 };

struct Status {
  int code = kOk;
  std::string msg;
  bool ok() const { return code == kOk; }
  static Status Error(int c, std::string m) { return Status{c, std::move(m)}; }
};

// This rank's private state on its device (not part of the symmetric layout).
struct RankPrivate {
  uint64_t epoch;        // epoch of the call in flight (copy of RankControl::calls)
  uint64_t deadline_ns;  // %globaltimer value after which every wait of this call gives up
  uint64_t failed;       // non-zero once a wait of this call gave up or an input was invalid
  uint64_t err_claim;    // the first failure of this rank claims its ErrorRecord (cleared by the reset)
  uint64_t timeout_ms;   // the call's timeout, for the error text
  // What the last expert_combine did (read by the loopback harness and the benchmarks; never by the protocol):
  uint64_t consumers;    // its consumer CTA count C (pinned, the fixed fallback, or the device-side model's choice)
  uint64_t pushed_bytes;  // bytes its consumer pushes to the other ranks (rows of remote segments x row bytes)
  uint64_t prod_t0, prod_t1;  // %globaltimer: first producer tile started, last producer tile finished
  uint64_t cons_t0, cons_t1;  // first consumer CTA started pushing (after the serialize wait), last push finished
  uint64_t combine_done;      // CTAs of the call's CombineKernel that are done (the last one closes the call)
  // The call's timeline (%globaltimer, for the loopback harness and Workspace.last_call_stats; never the protocol):
  uint64_t begin_t;           // BeginKernel started (before the testing delay)
  uint64_t prod_t0_last;      // the last producer CTA with work started: > prod_t0 by much = CTAs not co-resident
  uint64_t comb_t0, comb_t1;  // CombineKernel: first CTA started, last CTA finished
  // dispatch_gemm's (its GEMM span is prod_t0..prod_t1, its pushers' cons_t0..cons_t1, from their first push to the
  // end of their side work):
  uint64_t push_t1;           // the last pusher finished pushing
  uint64_t pushers;           // its pushing CTA count P (pinned, the fixed rule, or the device-side model's choice)
  // The emulated link of the call (CallOptions::emulated_link_gbps; PaceLink, transport/row_push.cuh): its first push,
  // and the bytes reserved on it so far.
  uint64_t link_t0, link_bytes;
  // 1 while the call in flight runs inside a CUDA graph (its BeginKernel was captured by XLA's command buffers), where
  // a failure stops the device instead of waiting for the next call to report it (StopIfCaptured, protocol.cuh).
  uint64_t captured;
  // 1 once the workspace is released. The block outlives its workspace (never freed): a CUDA graph recorded against
  // the workspace and replayed after its release finds this set in its first kernel and stops the device there,
  // before it touches the freed blocks.
  uint64_t released;
  // dispatch_gemm's GEMM tiles: the nanoseconds the loop's look-ahead warps spent waiting for the tiles' rows,
  // summed over the tiles not made of this rank's own rows alone and over those that are (phase B and phase A), the
  // nanoseconds the TMA threads stalled for the look-ahead's next tile (wgmma_gemm::HasStalled) on every tile but a
  // CTA's first ([0]) and on its first ([1]), when the first phase-B tile was claimed, and the CTAs of the launch
  // (for the loopback harness; never the protocol).
  uint64_t gemm_wait_ns, gemm_wait_own_ns, gemm_stall_ns[2], phase_b_t0, ctas;
  // ExpertKernel: its first CTA started (%globaltimer; its segment table, its choice of C and its first tile follow).
  uint64_t entry_t;
};

// The per-band tile counters (uint32, zeroed by one memset per call) followed by the call counters (kCallCounterBytes,
// 8-byte aligned): the count of the launch's CTAs that are done producing (uint64), then the next unclaimed GEMM tile
// (ExpertKernel's producer, dispatch_gemm's GEMM1) and dispatch_gemm's next unclaimed side unit (uint32 each).
constexpr int64_t kCallCounterBytes = 16;
inline int64_t BandCounterWords(int64_t max_bands) { return (max_bands + 1) / 2 * 2; }
inline int64_t BandCounterBytes(int64_t max_bands) { return BandCounterWords(max_bands) * 4 + kCallCounterBytes; }

// Per group, after GroupShared (GroupSharedBytes): what the host sides of the ranks share. Then the count board of
// exchange_counts (protocol.h's CountSlot per rank, kMaxSegments values each, at CountBoardOffset). The board lives
// here, in host-mapped memory, rather than in a device block: it is a few hundred bytes polled by one thread per
// rank once per layer call, every process maps group memory anyway, and a board in rank 0's block would grow the
// symmetric layout of every rank.
struct GroupTail {
  Word barrier;                       // the recovery barrier (common/group_barrier.h)
  ErrorRecord reset_records[kMaxRanks];  // the group's records as the last reset found them, for every rank's report
  int32_t process[kMaxRanks];         // the process owning each rank (-1 everywhere: the group is in one process)
  int32_t pid[kMaxRanks];             // its OS process id (0: not known), so a release need not wait for a dead one
  uint32_t released[kMaxRanks];       // 1 once the owner of the rank closed its mappings of the peers' blocks
};
inline int64_t CountBoardOffset(int ranks) { return GroupSharedBytes(ranks) + AlignUp(sizeof(GroupTail)); }
inline int64_t GroupMemoryBytes(int ranks) { return CountBoardOffset(ranks) + CountBoardBytes(ranks, kMaxSegments); }

struct PeerTable {
  char* base[kMaxRanks];
};

// Everything a kernel needs to know about its rank; passed by value.
struct RankDev {
  PeerTable peers;
  Layout layout;
  WorkspaceSizes sizes;
  GroupShared* shared;   // host-mapped
  RankPrivate* priv;     // device
  uint32_t* band_done;   // device, [sizes.max_bands], then producers_done (BandCounterBytes in all)
  uint64_t* producers_done;  // device: CTAs of this call's launch done producing (ExpertKernel: a consumer once it
                             // has its role, a producer once it has stored all its tiles; dispatch_gemm: every CTA)
  unsigned* tile_claims;     // device: GEMM tiles claimed so far in this call (ExpertKernel's, dispatch_gemm's)
  unsigned* side_claims;     // device: dispatch_gemm's side units claimed so far in this call
  int32_t rank, group, ranks, pad_;
};

// A group spanning processes: process[g * ranks + r] owns rank r of group g; this process is `here`; the group
// memory of group g is the POSIX shared-memory object "<prefix>-g<g>".
struct Sharing {
  std::vector<int> process;
  int here = -1;
  std::string prefix;
};

// What a process publishes for one of its ranks so that the others can open its block: the cudaIpcMemHandle_t's
// bytes and the PCI bus id of the rank's device (to find it among the opener's devices for peer access).
struct BlockExport {
  std::string ipc_handle;
  std::string pci_bus_id;
};

class Workspace {
 public:
  // ordinals[g * ranks + r]: CUDA device of rank r of group g (-1 for ranks of other processes). consumer_ctas: the
  // fixed C (communication CTAs of expert_combine) used when no resource model applies; model: calibrated constants
  // of the resource model (resource_model.h), or null: then every call not pinning C uses consumer_ctas. sm_budget:
  // CTAs of every kernel of one rank (0 = the device's SM count divided by the number of this process's ranks on
  // that device, so that they all fit on it at once). sharing: null for a workspace of one process; else the
  // process table, and Create allocates this process's part: its ranks' blocks and the group memory of the groups
  // whose rank 0 it owns. OpenPeers completes it once every process has created its part.
  static Status Create(int ranks, int groups, const std::vector<int>& ordinals, WorkspaceSizes sizes,
                       int consumer_ctas, int sm_budget, const ModelParams* model, std::unique_ptr<Workspace>* out,
                       const Sharing* sharing = nullptr);
  // Frees this process's part after its kernels end. Sharing: first closes its IPC mappings of the peers' blocks,
  // then waits (bounded) for the peers' processes to close theirs, and only then frees its own blocks.
  ~Workspace();

  // Sharing: the exports of this process's ranks, by g * ranks + r (empty entries for the others).
  Status ExportHandles(std::vector<BlockExport>* out) const;
  // Sharing: maps the group memory created by other processes and opens the other processes' blocks (`peers`, by
  // g * ranks + r, as their ExportHandles gave them), enabling peer access where the opener's devices differ.
  Status OpenPeers(const std::vector<BlockExport>& peers);
  // Sharing: removes the names of the shared-memory objects this process created (the mappings stay valid);
  // idempotent. Called once every process has mapped them, and at release, so that nothing stays in /dev/shm.
  void UnlinkOwn();

  int ranks() const { return ranks_; }
  int groups() const { return groups_; }
  const WorkspaceSizes& sizes() const { return sizes_; }
  int device(int g, int r) const { return ordinals_[g * ranks_ + r]; }
  int consumer_ctas() const { return consumer_ctas_; }
  bool has_model() const { return has_model_; }
  const ModelParams& model() const { return model_; }
  int budget(int g, int r) const { return budget_[g * ranks_ + r]; }
  int min_budget() const;
  // Copies this rank's RankPrivate (the last call's C and timings) after synchronizing `stream`, or with
  // stream == nullptr after synchronizing the rank's whole device (cudaDeviceSynchronize: every stream on it, XLA's
  // included; for benchmarks, which do not know XLA's stream).
  Status ReadPrivate(int g, int r, cudaStream_t stream, RankPrivate* out) const;
  RankDev Dev(int g, int r) const;
  // The group memory: host address (for the host side) and its device address (for kernels).
  GroupShared* shared(int g) const { return reinterpret_cast<GroupShared*>(shared_[g]); }
  GroupTail* tail(int g) const { return reinterpret_cast<GroupTail*>(shared_[g] + GroupSharedBytes(ranks_)); }
  char* shared_device(int g) const { return shared_dev_[g]; }
  // Whether rank r of group g belongs to this process.
  bool Local(int g, int r) const { return process_.empty() || process_[g * ranks_ + r] == here_; }

  // The (group, rank) of this process living on `ordinal`; an error if none or several do.
  Status FindByOrdinal(int ordinal, int* g, int* r) const;

  // Start of every call on the host. If the group was aborted (a wait timed out, or an input was invalid, in some
  // earlier call), synchronize this rank's stream, meet every rank of the group at the barrier in group memory
  // (bounded by timeout_ms), let the last one reset all control words, flags, count stamps and error records, and
  // return the recorded error: the call that reports a failure is the one after it (kernels run asynchronously),
  // and the call after that runs normally again.
  Status RecoverIfAborted(int g, int r, cudaStream_t stream, const char* op, int64_t timeout_ms);

  // The group's failure as the error a call of rank r reports, read from the group memory on the host alone (no
  // CUDA call, no synchronization, no reset), or OK when the group is not aborted. What a call being captured into
  // a CUDA graph returns instead of RecoverIfAborted: a capturing thread may not synchronize.
  Status RecordedFailure(int g, int r, const char* op, int64_t timeout_ms) const;

  // The text of group g's failure as the records in its memory hold it now ("" when the group is not aborted), read
  // on the host alone: it stays readable after a call inside a CUDA graph stopped the device (the group memory is
  // host memory), when every CUDA call of the process fails.
  std::string FailureText(int g, int64_t timeout_ms) const;

  // Raises the group's abort word from the host (a call that fails validation after peers may depend on it).
  void RaiseAbort(int g);

 private:
  Workspace() = default;
  bool GroupHere(int g) const;
  Status AllocGroupMemory(int g);
  Status MapGroupMemory(int g, bool create);
  // Sharing: marks this process's ranks released in group memory, then waits (bounded) for the other processes'.
  void AwaitPeersReleased();
  // `msg` followed by the group's first failure among `records` (and rank r's own when it differs; r < 0: none), as
  // the status a call reports.
  Status ReportRecords(int g, int r, const std::vector<ErrorRecord>& records, std::string msg,
                       int64_t timeout_ms) const;
  int ranks_ = 0, groups_ = 0, consumer_ctas_ = 0;
  bool has_model_ = false;
  ModelParams model_{};
  WorkspaceSizes sizes_{};
  Layout layout_{};
  std::vector<int> ordinals_, budget_;  // per g * ranks + r (-1 / 0 for ranks of other processes)
  std::vector<char*> blocks_;           // device: own blocks, or the IPC mappings of other processes' blocks
  std::vector<int> access_dev_;         // the device this process reaches each block through (the opener's)
  std::vector<bool> opened_;            // blocks_[i] is an IPC mapping (closed, never freed, by this process)
  std::vector<RankPrivate*> priv_;      // device (own ranks)
  std::vector<uint32_t*> band_done_;    // device (own ranks), BandCounterBytes(max_bands)
  std::vector<char*> shared_;           // per group: host address of the group memory (null: no rank here)
  std::vector<char*> shared_dev_;       // per group: its device address
  // Sharing only.
  std::vector<int> process_;
  int here_ = -1;
  std::string prefix_;
  std::vector<std::pair<void*, size_t>> mappings_;  // group memory mappings (registered with CUDA)
  std::vector<std::string> own_names_;
};

// Registry: the custom calls name a workspace by an integer handle. CUDA handles start at kHandleBase, so they never
// collide with the CPU registry's.
constexpr int64_t kHandleBase = int64_t{1} << 40;
int64_t RegisterWorkspace(std::unique_ptr<Workspace> ws);
Workspace* LookupWorkspace(int64_t handle);
bool ReleaseWorkspace(int64_t handle);

std::string FormatRecord(const ErrorRecord& e, int group, int ranks, int64_t timeout_ms);
// The group's first failure among the ranks' records (nullptr: none).
const ErrorRecord* FirstRecord(const std::vector<ErrorRecord>& records);

// "<what> failed: <cudaGetErrorString>" when err != cudaSuccess.
Status CudaStatus(cudaError_t err, const char* what);

}  // namespace jmo::cuda
