// XLA:CPU handler of gather_rs: GEMM2 with the top-k gather-reduce and one reduce-scatter over the group
// (docs/design.md, "GatherRS"; the operands in common/call_signature.h's BindGatherRs).
//
// The handler thread is the producer, expert_combine's (segment_producer.h: remote sources first, each finished band
// flagged). The rank's consumer thread takes the group's sources in turn: once every band of a source's segments is
// flagged, it sums each of that source's tokens' rows here, gate times row in float32 in slot order, into a dense
// partial of the source's T tokens, and stores it into slice `rank` of the source's ret rows (float32 [R, T, N]),
// counting T rows into its ret_arrivals. Each rank then sums its R slices in rank order 0, 1, ..., R - 1. Both sums
// run in a fixed order, so the output is bitwise the same call after call.
#include <cstring>
#include <string>
#include <vector>

#include "common/call_signature.h"
#include "common/dtype.h"
#include "common/error_text.h"
#include "cpu/call_steps.h"
#include "cpu/handlers.h"
#include "cpu/segment_producer.h"
#include "cpu/workspace_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jmo::cpu {
namespace {

// What the consumer needs of one call.
struct Reduction {
  const std::vector<Segment>* segments;  // the producer's, in its order
  const std::vector<int64_t>* rows_to_rank;
  const float* row_gate;                 // [cap]
  const int32_t* token_rows;             // [R, T, Q]
  int64_t T, Q, N;
};

// The sources in the consumer's order: those this rank holds no row of first (their partial is zero, ready at once),
// then the others in the producer's order (protocol.h's SourceBefore: remote, the most rows first; this rank last).
std::vector<int> ConsumerSources(int R, int rank, const std::vector<int64_t>& rows_to_rank) {
  std::vector<int> empty, full;
  for (int s = 0; s < R; ++s) (rows_to_rank[s] == 0 ? empty : full).push_back(s);
  for (size_t i = 1; i < full.size(); ++i)
    for (size_t j = i; j > 0 && SourceBefore(full[j], full[j - 1], rank, rows_to_rank.data()); --j)
      std::swap(full[j], full[j - 1]);
  empty.insert(empty.end(), full.begin(), full.end());
  return empty;
}

// The consumer's work: per source, wait for its bands, reduce its tokens, store the partial into its ret rows.
template <typename T>
ErrorRecord ReduceAndShip(const CallContext& c, const Reduction& job) {
  Workspace* ws = c.ws;
  const int R = ws->ranks();
  RankView self = ws->view(c.group, c.rank);
  auto wait_bands = [&](const Segment& seg) {
    ErrorRecord e{};
    for (int64_t b = 0; b < (seg.rows + kBandRows - 1) / kBandRows && !e.code; ++b)
      e = WaitFor(c, &self.tile_ready()[seg.band_base + b], 0, c.epoch, c.rank, kStageTileReady);
    return e;
  };
  if (c.opts.serialize)  // the no-overlap baseline: GEMM2 whole, then the reduce-scatter
    for (const Segment& seg : *job.segments)
      if (ErrorRecord e = wait_bands(seg); e.code) return e;
  const int64_t TN = job.T * job.N;
  std::vector<float> part(TN);
  for (int s : ConsumerSources(R, c.rank, *job.rows_to_rank)) {
    for (const Segment& seg : *job.segments)
      if (seg.src == s)
        if (ErrorRecord e = wait_bands(seg); e.code) return e;
    const int32_t* rows = job.token_rows + s * job.T * job.Q;
    std::fill(part.begin(), part.end(), 0.f);
    for (int64_t t = 0; t < job.T; ++t) {
      float* acc = part.data() + t * job.N;
      for (int64_t q = 0; q < job.Q; ++q) {  // slot order: deterministic sums
        const int32_t i = rows[t * job.Q + q];
        if (i < 0) continue;
        const float g = job.row_gate[i];
        for (int64_t n = 0; n < job.N; ++n) acc[n] += g * Elem<T>::Load(self.stage(), i * job.N + n);
      }
    }
    RankView peer = ws->view(c.group, s);
    // The source must have finished reading its ret rows of the previous call (protocol.h step 1).
    ErrorRecord e = WaitFor(c, &peer.control()->done_epoch.value, 0, c.epoch - 1, s, kStagePeerReady);
    if (e.code) return e;
    std::memcpy(peer.ret() + c.rank * TN * 4, part.data(), TN * 4);
    AtomicAdd(&peer.control()->ret_arrivals.value, static_cast<uint64_t>(job.T));
  }
  return ErrorRecord{};
}

// y[t] = the sum of the R partial slices in rank order, in float32, rounded once.
template <typename T>
void SumSlices(const RankView& self, int R, int64_t T_, int64_t N, void* y) {
  const float* slices = reinterpret_cast<const float*>(self.ret());
  std::vector<float> acc(N);
  for (int64_t t = 0; t < T_; ++t) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int g = 0; g < R; ++g)
      for (int64_t n = 0; n < N; ++n) acc[n] += slices[(g * T_ + t) * N + n];
    for (int64_t n = 0; n < N; ++n) Elem<T>::Store(y, t * N + n, acc[n]);
  }
}

ffi::Error GatherRsImpl(ffi::Token, ffi::Result<ffi::Token>, ffi::AnyBuffer lhs, ffi::AnyBuffer w,
                        ffi::Buffer<ffi::F32> row_gate, ffi::Buffer<ffi::S32> token_rows,
                        ffi::Buffer<ffi::S32> seg_rows, ffi::Buffer<ffi::S32> seg_ret_off,
                        ffi::Buffer<ffi::S32> group_op, ffi::Buffer<ffi::S32> rank_op, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::AnyBuffer> rows, ExpertCombineAttrs attrs) {
  const bool transpose_rhs = attrs.transpose_rhs;
  auto shape = CheckGatherRs(lhs, w, row_gate, token_rows, seg_rows, seg_ret_off, *y, *rows, transpose_rhs);
  if (shape.has_error()) return shape.error();
  const GatherRsShape s = *shape;
  const int64_t row_bytes = RowBytes(s.dtype, s.N);
  const int64_t partial_rows = GatherRsPartialRows(s.R, s.T, s.N, row_bytes);
  auto ctx = BeginCall("gather_rs", attrs.call, group_op.typed_data()[0], rank_op.typed_data()[0],
                       CallFootprint{row_bytes, s.cap, partial_rows, s.E_local});
  if (ctx.has_error()) return ctx.error();
  const CallContext c = ctx.value();
  Workspace* ws = c.ws;
  const int R = ws->ranks();
  if (ffi::Error e = CheckGatherRsPlan(s, R); e.failure()) return Fail(c, std::move(e));
  const int32_t* table = token_rows.typed_data();
  for (int64_t p = 0; p < s.R * s.T * s.Q; ++p)
    if (table[p] < -1 || table[p] >= s.cap)
      return Fail(c, InvalidCall("gather_rs: token_rows entry " + std::to_string(p) + " is " +
                                 std::to_string(table[p]) + ", outside [-1, cap = " + std::to_string(s.cap) + ")"),
                  kBadRoute, p, (uint64_t)(int64_t)table[p], s.cap);

  std::vector<int64_t> rows_to_rank;
  auto producer_segs = ProducerSegments(c, "gather_rs", seg_rows.typed_data(), seg_ret_off.typed_data(), s.E_local,
                                        s.cap, &rows_to_rank);
  if (producer_segs.has_error()) return producer_segs.error();
  const std::vector<Segment>& ordered = *producer_segs;

  RankView self = ws->view(c.group, c.rank);
  const bool bf16 = s.dtype != DType::kF32;
  const Reduction red{&ordered, &rows_to_rank, row_gate.typed_data(), table, s.T, s.Q, s.N};
  // The consumer first, as expert_combine's; it reads `red` and `c`, which outlive it (Join below).
  ConsumerJob job;
  job.epoch = c.epoch;
  job.group = c.group;
  job.rank = c.rank;
  job.deadline = c.deadline;
  job.timeout_ms = c.bound_ms;
  job.run = [&c, &red, bf16] { return bf16 ? ReduceAndShip<uint16_t>(c, red) : ReduceAndShip<float>(c, red); };
  Consumer& consumer = ws->consumer(c.group, c.rank);
  consumer.Post(std::move(job));

  if (bf16)
    ProduceSegments<uint16_t>(ordered, lhs.untyped_data(), w.untyped_data(), s.K, s.N, transpose_rhs, self, c.epoch);
  else
    ProduceSegments<float>(ordered, lhs.untyped_data(), w.untyped_data(), s.K, s.N, transpose_rhs, self, c.epoch);

  RankControl* ctl = self.control();
  const uint64_t base = ctl->ret_expected.value;
  const uint64_t expected = static_cast<uint64_t>(R * s.T);  // T rows from every rank of the group, this one too
  ErrorRecord e = WaitFor(c, &ctl->ret_arrivals.value, base, expected, R, kStageRetArrivals);
  ErrorRecord ce = consumer.Join();  // always join: the next call must not start while it still reads stage
  if (e.code) return TimeoutError("gather_rs", e, c);
  if (ce.code) return TimeoutError("gather_rs", ce, c);
  ctl->ret_expected.value = base + expected;
  if (bf16)
    SumSlices<uint16_t>(self, R, s.T, s.N, y->untyped_data());
  else
    SumSlices<float>(self, R, s.T, s.N, y->untyped_data());
  if (s.want_rows) {
    // The segments fill recv from row 0; the rows past them are zero.
    int64_t kept = 0;
    for (const Segment& seg : ordered) kept += seg.rows;
    char* out = static_cast<char*>(rows->untyped_data());
    std::memcpy(out, self.stage(), kept * row_bytes);
    std::memset(out + kept * row_bytes, 0, (s.cap - kept) * row_bytes);
  }
  AtomicStore(&ctl->done_epoch.value, c.epoch);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jmo::cpu

// The ordering token first, as every CPU workspace call (handlers.cc says why).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoGatherRsCpuBody, jmo::cpu::GatherRsImpl,
                              jmo::BindGatherRs(ffi::Ffi::Bind().Arg<ffi::Token>().Ret<ffi::Token>()));
