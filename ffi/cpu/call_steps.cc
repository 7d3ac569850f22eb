#include "cpu/call_steps.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <thread>

#include "common/bf16.h"
#include "common/call_signature.h"
#include "common/error_text.h"

namespace ffi = xla::ffi;

namespace jmo::cpu {

ffi::ErrorOr<CallContext> BeginCall(const char* op, const CallAttrs& attrs, int32_t group, int32_t rank,
                                    const CallFootprint& need) {
  const int64_t handle = attrs.workspace;
  const CallOptions& opts = attrs.options;
  Workspace* ws = LookupWorkspace(handle);
  if (ws == nullptr)
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                                      "jax_moe_overlap: workspace handle " + std::to_string(handle) +
                                          " is not live (released, or created in another process; a program compiled "
                                          "ahead of time before release_workspaces() must be compiled again)"));
  if (rank < 0 || rank >= ws->ranks() || group < 0 || group >= ws->groups())
    return ffi::Unexpected(InvalidCall("rank " + std::to_string(rank) + " / group " + std::to_string(group) +
                                   " outside the workspace's " + std::to_string(ws->ranks()) + " ranks x " +
                                   std::to_string(ws->groups()) + " groups"));
  if (std::string bad = CheckOptions(opts); !bad.empty())
    return ffi::Unexpected(InvalidCall(std::string(op) + ": " + bad));
  if (opts.delay_rank == rank && opts.delay_us > 0)
    std::this_thread::sleep_for(std::chrono::microseconds(opts.delay_us));
  // The recovery's barrier is bounded by timeout_ms; the epoch's waits, once the epoch is known, by its bound.
  const Clock::time_point start = Clock::now();
  CallContext c{ws, group, rank, opts, 0, start + std::chrono::milliseconds(opts.timeout_ms), opts.timeout_ms};
  ErrorRecord rec = ws->RecoverIfAborted(group, rank, c.deadline);
  if (rec.code)
    return ffi::Unexpected(
        ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                   FormatError("recover", rec, group, ws->ranks(), opts.timeout_ms, ws->shared(group))));
  RankControl* ctl = ws->view(group, rank).control();
  c.epoch = ctl->calls.value + 1;  // only this rank writes `calls`
  AtomicStore(&ctl->calls.value, c.epoch);
  c.bound_ms = CallWaitBoundMs(opts.timeout_ms, opts.first_call_timeout_ms, c.epoch);
  c.deadline = start + std::chrono::milliseconds(c.bound_ms);
  // The CPU handlers keep their segments in vectors: no segment bound.
  if (std::string bad = CheckFits(need, ws->sizes(), ws->ranks(), INT64_MAX); !bad.empty())
    return ffi::Unexpected(Fail(c, InvalidCall(std::string(op) + ": " + bad)));
  return c;
}

ErrorRecord WaitFor(const CallContext& c, const uint64_t* word, uint64_t base, uint64_t count, int peer, Stage stage) {
  return c.ws->WaitAtLeast(word, base, count, c.group, c.rank, peer, c.epoch, stage, c.deadline, c.bound_ms);
}

ffi::Error Fail(const CallContext& c, ffi::Error err, BadInput detail, uint64_t peer, uint64_t got,
                uint64_t expected) {
  c.ws->RecordFailure(c.group, ErrorRecord{kStageBadInput, (uint64_t)c.rank, peer, c.epoch, got, expected,
                                           (uint64_t)detail, 0});
  return err;
}

ffi::Error FailInput(const CallContext& c, const char* op, BadInput detail, uint64_t peer, uint64_t got,
                     uint64_t expected) {
  const ErrorRecord rec{kStageBadInput, (uint64_t)c.rank, peer, c.epoch, got, expected, (uint64_t)detail, 0};
  return Fail(c, InvalidCall(std::string(op) + ": " + DescribeRecord(rec, c.group, c.ws->ranks())), detail, peer, got,
              expected);
}

ffi::Error TimeoutError(const char* op, const ErrorRecord& e, const CallContext& c) {
  return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                    FormatError(op, e, c.group, c.ws->ranks(), c.bound_ms, c.ws->shared(c.group)));
}

ffi::Error CheckSlots(const CallContext& c, const char* op, const int32_t* src_row, const int32_t* dst_rank,
                      const int32_t* dst_row, int64_t P, int64_t S, int64_t cap) {
  const int R = c.ws->ranks();
  for (int64_t p = 0; p < P; ++p) {
    // The plan marks an invalid expert id with dest rank -1 and puts the id itself in the slot's dest row.
    if (dst_rank[p] == -1)
      return FailInput(c, op, kBadExpertId, p, (uint64_t)(int64_t)src_row[p], (uint64_t)(int64_t)dst_row[p]);
    if (dst_row[p] < 0) continue;  // dropped by the capacity rule
    const bool bad_rank = dst_rank[p] < 0 || dst_rank[p] >= R, bad_row = dst_row[p] >= cap;
    if (bad_rank || bad_row || src_row[p] < 0 || src_row[p] >= S)
      return FailInput(c, op, kBadRoute, p,
                       (uint64_t)(int64_t)(bad_rank ? dst_rank[p] : bad_row ? dst_row[p] : src_row[p]),
                       bad_rank ? R : bad_row ? cap : S);
  }
  return ffi::Error::Success();
}

ffi::Error CheckPrimaries(const CallContext& c, const char* op, const int32_t* src_row, const int32_t* dst_rank,
                          const int32_t* dst_row, const int32_t* primary, int64_t P) {
  for (int64_t p = 0; p < P; ++p) {
    if (dst_row[p] < 0 || dst_rank[p] == c.rank) continue;  // not moved, or kept by this rank (one row per slot)
    const int64_t q = primary[p];
    if (q == p) continue;
    const bool ok = q >= 0 && q < P && primary[q] == q && dst_row[q] >= 0 && dst_rank[q] == dst_rank[p] &&
                    src_row[q] == src_row[p] && dst_row[q] < dst_row[p];
    if (!ok) return FailInput(c, op, kBadPrimary, p, (uint64_t)q, P);
  }
  return ffi::Error::Success();
}

namespace {

void ScaleRow(DType dt, char* dst, const char* src, int64_t D, float s) {
  if (dt == DType::kBF16) {
    const uint16_t* in = reinterpret_cast<const uint16_t*>(src);
    uint16_t* out = reinterpret_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < D; ++i) out[i] = FloatToBf16(Bf16ToFloat(in[i]) * s);
  } else {
    const float* in = reinterpret_cast<const float*>(src);
    float* out = reinterpret_cast<float*>(dst);
    for (int64_t i = 0; i < D; ++i) out[i] = in[i] * s;
  }
}

}  // namespace

void MoveSlot(const CallContext& c, const RankView& peer, int d, int64_t p, const char* src, int64_t row_bytes,
              const int32_t* src_row, const int32_t* dst_row, const int32_t* primary, char* rows,
              const SlotScale& scale) {
  const bool own = primary == nullptr || d == c.rank || primary[p] == p;
  char* dst = rows + dst_row[p] * row_bytes;
  if (own && scale.factor != nullptr) ScaleRow(scale.dt, dst, src + src_row[p] * row_bytes, scale.D, scale.factor[p]);
  else if (own) std::memcpy(dst, src + src_row[p] * row_bytes, row_bytes);
  if (primary != nullptr)
    peer.recv_from()[dst_row[p]] = RecvFrom(c.epoch, own ? dst_row[p] : dst_row[primary[p]]);
}

ffi::ErrorOr<int64_t> RecvFromChecked(const CallContext& c, const char* op, const RankView& self, int64_t r) {
  const uint64_t entry = self.recv_from()[r];
  const int64_t f = RecvFromRow(entry);
  if (RecvFromOfEpoch(entry, c.epoch) && f <= r && (f == r || self.recv_from()[f] == RecvFrom(c.epoch, f))) return f;
  return ffi::Unexpected(FailInput(c, op, kBadRecvFrom, r, entry, c.epoch));
}

ffi::ErrorOr<std::vector<Segment>> RecvSegments(const CallContext& c, const char* op, const int32_t* seg_rows,
                                                const int32_t* seg_ret_off, int64_t E_l, int64_t cap,
                                                std::vector<int64_t>* rows_to_rank) {
  const int R = c.ws->ranks();
  std::vector<Segment> segs;
  rows_to_rank->assign(R, 0);
  int32_t off = 0, band = 0;
  for (int e = 0; e < E_l; ++e) {
    for (int s = 0; s < R; ++s) {
      const int32_t rows = seg_rows[e * R + s];
      const int32_t ret_off = seg_ret_off[e * R + s];
      if (rows < 0 || off + (int64_t)rows > cap || ret_off < 0 || (int64_t)ret_off + rows > c.ws->sizes().ret_rows)
        return ffi::Unexpected(Fail(c, InvalidCall(std::string(op) + ": segment (expert " + std::to_string(e) +
                                                   ", source " + std::to_string(s) + ") lies outside the buffers"),
                                    kBadSegment, e * R + s, (uint64_t)(int64_t)rows, cap));
      segs.push_back(Segment{e, s, off, rows, ret_off, band});
      off += rows;
      band += (rows + kBandRows - 1) / kBandRows;
      (*rows_to_rank)[s] += rows;
    }
  }
  return segs;
}

ffi::ErrorOr<std::vector<Segment>> ProducerSegments(const CallContext& c, const char* op, const int32_t* seg_rows,
                                                    const int32_t* seg_ret_off, int64_t E_l, int64_t cap,
                                                    std::vector<int64_t>* rows_to_rank) {
  auto recv_segs = RecvSegments(c, op, seg_rows, seg_ret_off, E_l, cap, rows_to_rank);
  if (recv_segs.has_error()) return recv_segs;
  const std::vector<Segment>& segs = *recv_segs;
  const int64_t band = segs.empty() ? 0 : segs.back().band_base + (segs.back().rows + kBandRows - 1) / kBandRows;
  if (band > c.ws->sizes().max_bands)
    return ffi::Unexpected(FailInput(c, op, kBadTooManyTiles, 0, band, c.ws->sizes().max_bands));
  std::vector<int> order(segs.size());
  OrderSegments(segs.data(), static_cast<int>(segs.size()), c.rank, rows_to_rank->data(), order.data());
  std::vector<Segment> ordered;
  for (int i : order)
    if (segs[i].rows > 0) ordered.push_back(segs[i]);
  return ordered;
}

ffi::Error EndDispatch(const CallContext& c, const char* op, int64_t expected, int64_t cap, int64_t row_bytes,
                       void* out, bool rows_in_out, bool zero_padding, bool gather) {
  RankView self = c.ws->view(c.group, c.rank);
  RankControl* ctl = self.control();
  const uint64_t base = ctl->recv_expected.value;
  ErrorRecord e = WaitFor(c, &ctl->recv_arrivals.value, base, expected, c.ws->ranks(), kStageRecvArrivals);
  if (e.code) return TimeoutError(op, e, c);
  ctl->recv_expected.value = base + expected;
  if (out != nullptr) {
    char* o = static_cast<char*>(out);
    if (!rows_in_out && gather) {
      for (int64_t r = 0; r < expected; ++r) {
        auto f = RecvFromChecked(c, op, self, r);
        if (f.has_error()) return f.error();
        std::memcpy(o + r * row_bytes, self.recv() + *f * row_bytes, row_bytes);
      }
    } else if (!rows_in_out) {
      std::memcpy(o, self.recv(), expected * row_bytes);
    }
    if (zero_padding) std::memset(o + expected * row_bytes, 0, (cap - expected) * row_bytes);
  }
  AtomicStore(&ctl->done_epoch.value, c.epoch);
  return ffi::Error::Success();
}

}  // namespace jmo::cpu
