// XLA:CPU handlers of the workspace calls: dispatch, expert_combine and exchange_counts.
//
// The handler thread is the producer; the rank's persistent Consumer thread (workspace_cpu.h) is the
// communication engine. Both follow protocol.h step by step, so the CUDA kernels can be checked against this code.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common/bf16.h"
#include "common/call_signature.h"
#include "common/dtype.h"
#include "common/error_text.h"
#include "common/workspace_fit.h"
#include "cpu/call_steps.h"
#include "cpu/segment_producer.h"
#include "cpu/handlers.h"
#include "cpu/workspace_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jmo::cpu {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// dispatch: push src rows to their destination ranks' recv rows; wait for this rank's rows; copy them out. With
// send once (slot_primary [P]) a source row crosses to another rank once (its primary slot's), with every slot's
// recv_from entry, and the copy out gathers each row from the row its entry names (protocol.h).

ffi::Error DispatchImpl(ffi::Token, ffi::Result<ffi::Token>, ffi::AnyBuffer src, ffi::Buffer<ffi::S32> slot_src_row,
                        ffi::Buffer<ffi::S32> slot_dest_rank, ffi::Buffer<ffi::S32> slot_dest_row,
                        ffi::Buffer<ffi::S32> recv_rows_expected, ffi::Buffer<ffi::S32> slot_primary,
                        ffi::Buffer<ffi::F32> row_scale, ffi::Buffer<ffi::S32> group_op, ffi::Buffer<ffi::S32> rank_op,
                        ffi::Result<ffi::AnyBuffer> out, CallAttrs attrs) {
  auto shape = CheckDispatch(src, slot_src_row, slot_dest_rank, slot_dest_row, slot_primary, row_scale, *out);
  if (shape.has_error()) return shape.error();
  const int64_t S = shape->S, cap = shape->cap, P = shape->P;
  const int64_t row_bytes = RowBytes(shape->dtype, shape->D);

  auto ctx = BeginCall("dispatch", attrs, group_op.typed_data()[0], rank_op.typed_data()[0],
                       CallFootprint{row_bytes, cap});
  if (ctx.has_error()) return ctx.error();
  const CallContext c = ctx.value();
  Workspace* ws = c.ws;
  const int R = ws->ranks();
  const int32_t* src_row = slot_src_row.typed_data();
  const int32_t* dst_rank = slot_dest_rank.typed_data();
  const int32_t* dst_row = slot_dest_row.typed_data();
  const int64_t expected = recv_rows_expected.typed_data()[0];
  if (expected < 0 || expected > cap) return FailInput(c, "dispatch", kBadExpectedRows, 0, expected, cap);
  if (ffi::Error err = CheckSlots(c, "dispatch", src_row, dst_rank, dst_row, P, S, cap); err.failure()) return err;
  const int32_t* primary = shape->send_once ? slot_primary.typed_data() : nullptr;
  if (primary != nullptr)
    if (ffi::Error err = CheckPrimaries(c, "dispatch", src_row, dst_rank, dst_row, primary, P); err.failure())
      return err;

  const SlotScale scale{shape->scaled ? row_scale.typed_data() : nullptr, shape->dtype, shape->D};
  const char* src_bytes = static_cast<const char*>(src.untyped_data());
  // A group of one rank stores its rows straight into the output (protocol.h: no recv rows, no copy).
  char* direct = R == 1 ? static_cast<char*>(out->untyped_data()) : nullptr;
  // Start with the next rank so that the R senders do not all hit the same receiver at once.
  for (int i = 1; i <= R; ++i) {
    const int d = (c.rank + i) % R;
    RankView peer = ws->view(c.group, d);
    ErrorRecord e = WaitFor(c, &peer.control()->done_epoch.value, 0, c.epoch - 1, d, kStagePeerReady);
    if (e.code) return TimeoutError("dispatch", e, c);
    char* rows = direct != nullptr ? direct : peer.recv();
    uint64_t sent = 0;
    for (int64_t p = 0; p < P; ++p) {
      if (dst_row[p] < 0 || dst_rank[p] != d) continue;
      MoveSlot(c, peer, d, p, src_bytes, row_bytes, src_row, dst_row, primary, rows, scale);
      ++sent;  // every kept slot, sent once or not: the receiver's plan counts slots
    }
    if (sent) AtomicAdd(&peer.control()->recv_arrivals.value, sent);
  }

  return EndDispatch(c, "dispatch", expected, cap, row_bytes, out->untyped_data(), direct != nullptr,
                     /*zero_padding=*/true, /*gather=*/primary != nullptr);
}

// ---------------------------------------------------------------------------------------------------------------
// expert_combine: producer = grouped GEMM over the (expert, source) segments, remote first, one ready flag per
// band; consumer thread = pushes bands to their source ranks; then combine this rank's returned rows.

template <typename T>
void CombineRows(const RankView& self, const float* gates, const int32_t* slot_ret_row, int64_t T_, int64_t k,
                 int64_t N, void* y, void* slot_out) {
  std::vector<float> acc(N);
  for (int64_t t = 0; t < T_; ++t) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t j = 0; j < k; ++j) {  // fixed order j = 0..k-1: deterministic sums
      const int64_t p = t * k + j;
      const int32_t row = slot_ret_row[p];
      if (row < 0) {
        if (slot_out) for (int64_t n = 0; n < N; ++n) Elem<T>::Store(slot_out, p * N + n, 0.f);
        continue;
      }
      const float g = gates[p];
      for (int64_t n = 0; n < N; ++n) {
        const float v = Elem<T>::Load(self.ret(), row * N + n);
        acc[n] += g * v;
        if (slot_out) Elem<T>::Store(slot_out, p * N + n, v);
      }
    }
    for (int64_t n = 0; n < N; ++n) Elem<T>::Store(y, t * N + n, acc[n]);
  }
}

ffi::Error ExpertCombineImpl(ffi::Token, ffi::Result<ffi::Token>, ffi::AnyBuffer lhs, ffi::AnyBuffer w,
                             ffi::Buffer<ffi::F32> lhs_scales, ffi::Buffer<ffi::F32> w_scales,
                             ffi::Buffer<ffi::F32> gates, ffi::Buffer<ffi::S32> seg_rows,
                             ffi::Buffer<ffi::S32> seg_ret_off, ffi::Buffer<ffi::S32> slot_ret_row,
                             ffi::Buffer<ffi::S32> ret_rows_expected, ffi::Buffer<ffi::S32> group_op,
                             ffi::Buffer<ffi::S32> rank_op, ffi::Result<ffi::AnyBuffer> y,
                             ffi::Result<ffi::AnyBuffer> slot_out, ExpertCombineAttrs attrs) {
  const bool transpose_rhs = attrs.transpose_rhs;
  auto shape = CheckExpertCombine(lhs, w, lhs_scales, w_scales, gates, seg_rows, seg_ret_off, slot_ret_row, *y,
                                  *slot_out, transpose_rhs);
  if (shape.has_error()) return shape.error();
  const DType dt = shape->dtype;
  const int64_t cap = shape->cap, K = shape->K, E_l = shape->E_local, N = shape->N, T_ = shape->T, k = shape->k;
  const int64_t P = shape->P;
  const bool want_slots = shape->want_slots;
  const int64_t row_bytes = RowBytes(dt, N);

  // consumer_ctas and the push tuning are CUDA resources (the CPU consumer is one thread per rank): checked, unused.
  auto ctx = BeginCall("expert_combine", attrs.call, group_op.typed_data()[0], rank_op.typed_data()[0],
                       CallFootprint{row_bytes, cap, P, E_l});
  if (ctx.has_error()) return ctx.error();
  const CallContext c = ctx.value();
  Workspace* ws = c.ws;
  const int R = ws->ranks();
  if (ffi::Error e = CheckExpertCombinePlan(*shape, R); e.failure()) return Fail(c, std::move(e));

  std::vector<int64_t> rows_to_rank;
  auto producer_segs = ProducerSegments(c, "expert_combine", seg_rows.typed_data(), seg_ret_off.typed_data(), E_l,
                                        cap, &rows_to_rank);
  if (producer_segs.has_error()) return producer_segs.error();
  std::vector<Segment>& ordered = *producer_segs;

  RankView self = ws->view(c.group, c.rank);
  // "Launch" the consumer first, as the CUDA side launches the communication kernel first on its own SMs.
  ConsumerJob job;
  job.epoch = c.epoch;
  job.group = c.group;
  job.rank = c.rank;
  job.segments = ordered;
  job.row_bytes = row_bytes;
  job.deadline = c.deadline;
  job.timeout_ms = c.bound_ms;
  job.serialize = c.opts.serialize;
  Consumer& consumer = ws->consumer(c.group, c.rank);
  consumer.Post(std::move(job));

  if (shape->fp8)
    ProduceSegmentsFp8(ordered, static_cast<const uint8_t*>(lhs.untyped_data()), lhs_scales.typed_data(),
                       shape->scales_ld, static_cast<const uint8_t*>(w.untyped_data()), w_scales.typed_data(), K, N,
                       dt == DType::kBF16, self, c.epoch);
  else if (dt == DType::kF32)
    ProduceSegments<float>(ordered, lhs.untyped_data(), w.untyped_data(), K, N, transpose_rhs, self, c.epoch);
  else
    ProduceSegments<uint16_t>(ordered, lhs.untyped_data(), w.untyped_data(), K, N, transpose_rhs, self, c.epoch);

  RankControl* ctl = self.control();
  const uint64_t base = ctl->ret_expected.value;
  const int64_t expected = ret_rows_expected.typed_data()[0];
  ErrorRecord e = WaitFor(c, &ctl->ret_arrivals.value, base, expected, R, kStageRetArrivals);
  ErrorRecord ce = consumer.Join();  // always join: the next call must not start while it still reads stage
  if (e.code) return TimeoutError("expert_combine", e, c);
  if (ce.code) return TimeoutError("expert_combine", ce, c);
  ctl->ret_expected.value = base + expected;
  const int32_t* ret_row = slot_ret_row.typed_data();
  for (int64_t p = 0; p < P; ++p)
    if (ret_row[p] >= ws->sizes().ret_rows)
      return FailInput(c, "expert_combine", kBadRetRow, p, ret_row[p], ws->sizes().ret_rows);
  void* so_ptr = want_slots ? slot_out->untyped_data() : nullptr;
  if (dt == DType::kF32)
    CombineRows<float>(self, gates.typed_data(), ret_row, T_, k, N, y->untyped_data(), so_ptr);
  else
    CombineRows<uint16_t>(self, gates.typed_data(), ret_row, T_, k, N, y->untyped_data(), so_ptr);
  AtomicStore(&ctl->done_epoch.value, c.epoch);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------------------------
// exchange_counts: this rank's routing counts into its slot of the group's count board, every rank's counts out
// (protocol.h's steps). The count exchange of groups whose ranks span processes: every wait bounded, unlike the
// collective backend's.

ffi::Error ExchangeCountsImpl(ffi::Token, ffi::Result<ffi::Token>, ffi::Buffer<ffi::S32> counts,
                              ffi::Buffer<ffi::S32> group_op, ffi::Buffer<ffi::S32> rank_op,
                              ffi::Result<ffi::Buffer<ffi::S32>> counts_all, CallAttrs attrs) {
  auto shape = CheckExchangeCounts(counts, *counts_all);
  if (shape.has_error()) return shape.error();
  auto ctx = BeginCall("exchange_counts", attrs, group_op.typed_data()[0], rank_op.typed_data()[0], CallFootprint{});
  if (ctx.has_error()) return ctx.error();
  const CallContext c = ctx.value();
  Workspace* ws = c.ws;
  const int R = ws->ranks();
  const int64_t n = counts.element_count();
  if (std::string bad = CheckCountsFit(shape->R_src, shape->R_dst, shape->E_local, R, ws->count_values());
      !bad.empty())
    return Fail(c, InvalidCall("exchange_counts: " + bad));

  // 1. Every peer has finished reading the board in the previous call.
  for (int i = 1; i < R; ++i) {
    const int d = (c.rank + i) % R;
    ErrorRecord e = WaitFor(c, &ws->view(c.group, d).control()->done_epoch.value, 0, c.epoch - 1, d, kStagePeerReady);
    if (e.code) return TimeoutError("exchange_counts", e, c);
  }
  // 2. Publish this rank's counts.
  CountSlot* mine = ws->count_slot(c.group, c.rank);
  std::memcpy(mine->values, counts.typed_data(), n * sizeof(int32_t));
  AtomicStore(&mine->stamp.value, c.epoch);
  // 3. Every rank's counts of this epoch, in source order.
  int32_t* out = counts_all->typed_data();
  for (int s = 0; s < R; ++s) {
    const CountSlot* slot = ws->count_slot(c.group, s);
    ErrorRecord e = WaitFor(c, &slot->stamp.value, 0, c.epoch, s, kStageCounts);
    if (e.code) return TimeoutError("exchange_counts", e, c);
    std::memcpy(out + s * n, slot->values, n * sizeof(int32_t));
  }
  // 4. Done reading: peers may publish the next epoch's counts.
  AtomicStore(&ws->view(c.group, c.rank).control()->done_epoch.value, c.epoch);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jmo::cpu

// On CPU the workspace calls take an ordering token first and return one first (jax_moe_overlap/ordering.py):
// XLA:CPU runs thunks as soon as their operands are ready, several at a time, so two workspace calls with no data
// between them could start in different orders on different ranks. The token chain (a JAX ordered effect) is the
// dependency that makes every rank run its workspace calls in the one program order. The tokens carry no data.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoDispatchCpuBody, jmo::cpu::DispatchImpl,
                              jmo::BindDispatch(ffi::Ffi::Bind().Arg<ffi::Token>().Ret<ffi::Token>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoExpertCombineCpuBody, jmo::cpu::ExpertCombineImpl,
                              jmo::BindExpertCombine(ffi::Ffi::Bind().Arg<ffi::Token>().Ret<ffi::Token>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoExchangeCountsCpuBody, jmo::cpu::ExchangeCountsImpl,
                              jmo::BindExchangeCounts(ffi::Ffi::Bind().Arg<ffi::Token>().Ret<ffi::Token>()));
