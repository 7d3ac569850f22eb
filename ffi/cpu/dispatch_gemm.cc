// XLA:CPU handler of dispatch_gemm: the dispatch and GEMM1 in one call, by protocol.h's per-block refinement of the
// dispatch. The CPU twin of ffi/cuda/ops/dispatch_gemm.cu's DispatchGemmKernel, and the specification it is tested
// against: the same blocks, counters, round order, claim order and waits, played by the handler thread in turn.
// Results (call_signature.h, BindDispatchGemm): x_recv [cap, D] (the recv rows, or [0, D]: not kept), out and a:
//   plain:  out [cap, N] float32 = recv[segment] @ w[expert] (or in bf16 src's dtype: the product rounded once);
//           a [0, N], unused.
//   swiglu: out = h [cap, F] in src's dtype = silu(pre[:, :F]) * pre[:, F:] in float32 of the float32 preactivation
//           pre [cap, 2F] = recv[segment] @ w[expert]; a = pre when kept ([cap, 2F]), else [0, 2F].
//   FP8 (packed e4m3 rows, e4m3 w [E_local, N, D] with block scales): the product is grouped_matmul_fp8's rows
//           (MatmulFp8Rows) read from the packed rows where they land; plain: out [cap, N] float32; swiglu: h_q, h_s
//           and (kept) a_q, a_s of it as grouped_matmul_swiglu_fp8 gives them (SwiGluForwardFp8Rows).
//
//   1. push   this rank's rows for the other ranks, one 128-row block of its send order (kSrcBlockRows) at a time,
//             in the CUDA pushers' rounds: block i of every destination's rows before block i + 1, each round from
//             the next rank on; each block's row count is release-added into the destination's
//             src_blocks[rank][J] and recv_arrivals, after waiting (once per destination, before its first block)
//             for its done_epoch >= n - 1.
//   2. copy   the rows this rank keeps into its own recv, by the same blocks and counters (step 1 holds by program
//             order).
//   3. GEMM   the float32 product recv[rows of expert e] @ w[e] (w[e]^T with transpose_rhs) in the kernel's tiles
//             and claim order (TileOrder: 128-row tiles of each expert's rows from its first row, the tiles of the
//             rank's own rows alone first, then the others expert by expert). Before a tile: a bounded wait (stage
//             src_block, peer = the source) until, for each source the tile's rows come from, every block of that
//             source holding them has all the rows this rank keeps from it. The product goes to out [cap, N]
//             (plain), or with swiglu is the preactivation pre [cap, 2F] (into a when kept, else into one tile of
//             scratch) whose epilogue, right after the tile, stores the tile's rows of out = h [cap, F] in src's
//             dtype. The row loop and the SwiGLU are the bare grouped GEMMs' (gemm_rows.h), so the call equals
//             dispatch + grouped_matmul (plain) or dispatch + grouped_matmul_swiglu (swiglu) bit for bit in the kept
//             rows. No result's rows past them are written (no consumer reads them: docs/design.md, "Padding rows").
//   send once (slot_primary [P], protocol.h): step 1 moves only the rows of primary slots, with the recv_from entry
//             of every slot of the block (step 2 every row, with its entry), and before a tile's GEMM the tile's rows
//             whose entry names another row are copied from it in recv (the expansion), after a bounded wait for the
//             block of the source that holds that row. The counts stay the slots', so the waits are those above.
//   4. zero   the call's src_blocks: every block with rows has been waited for, so every add of the call has landed,
//             and no source adds again before this rank's done_epoch of this call. Then the end of a dispatch
//             (recv -> x_recv's kept rows when kept, done_epoch); without x_recv every step of it but the copy.
// Every rank pushes all its rows before it waits for any, so no rank waits on a rank that is waiting on it: the waits
// end with one thread per rank. CallOptions::pushers sizes the CUDA launch and has no effect here (checked, unused).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/call_signature.h"
#include "common/dtype.h"
#include "cpu/call_steps.h"
#include "cpu/fp8_gemm_rows.h"
#include "cpu/gemm_rows.h"
#include "cpu/handlers.h"
#include "cpu/workspace_cpu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jmo::cpu {
namespace {

// Rows of one GEMM tile: the CUDA kernel's m-tile, so that a tile waits for the blocks its CUDA counterpart does.
constexpr int64_t kTileRows = 128;

// The sender's side of the plan: slots [P] and the send order in kSrcBlockRows blocks.
struct SendPlan {
  const int32_t *src_row, *dst_rank, *dst_row, *send_order, *send_start;
  const int32_t* primary;  // send once: slot_primary [P]; nullptr: one row per slot
  SlotScale scale;         // row_scale (MoveSlot)
  int64_t P;
};

// Send blocks of rank d's rows: [first, end).
void DestBlocks(const SendPlan& sp, int d, int64_t* first, int64_t* end) {
  const int64_t q0 = sp.send_start[d], q1 = sp.send_start[d + 1];
  *first = q0 / kSrcBlockRows;
  *end = q1 > q0 ? (q1 - 1) / kSrcBlockRows + 1 : *first;
}

// The send order against the slots, before any row moves: send_start ascending within [0, P], every send position
// of a destination's range naming a slot in [0, P) that is routed to that destination or not moved (dropped).
ffi::Error CheckSendOrder(const CallContext& c, const SendPlan& sp) {
  const int R = c.ws->ranks();
  for (int d = 0; d < R; ++d)
    if (sp.send_start[d] < 0 || sp.send_start[d] > sp.send_start[d + 1] || sp.send_start[d + 1] > sp.P)
      return FailInput(c, "dispatch_gemm", kBadRoute, d, (uint64_t)(int64_t)sp.send_start[d + 1], sp.P);
  for (int d = 0; d < R; ++d)
    for (int64_t q = sp.send_start[d]; q < sp.send_start[d + 1]; ++q) {
      const int32_t p = sp.send_order[q];
      if (p < 0 || p >= sp.P) return FailInput(c, "dispatch_gemm", kBadRoute, q, (uint64_t)(int64_t)p, sp.P);
      if (sp.dst_row[p] >= 0 && sp.dst_rank[p] != d)
        return FailInput(c, "dispatch_gemm", kBadRoute, p, (uint64_t)(int64_t)sp.dst_rank[p], R);
    }
  return ffi::Error::Success();
}

// Moves the kept rows of send block J that go to rank d (send positions [128 J, 128 J + 128) within d's range) into
// d's recv rows, then release-adds their count to d's src_blocks[rank][J] and recv_arrivals.
void PushBlock(const CallContext& c, const SendPlan& sp, const char* src, int64_t row_bytes, int d, int64_t J) {
  RankView peer = c.ws->view(c.group, d);
  const int64_t q0 = std::max<int64_t>(J * kSrcBlockRows, sp.send_start[d]);
  const int64_t q1 = std::min<int64_t>((J + 1) * kSrcBlockRows, sp.send_start[d + 1]);
  uint64_t moved = 0;
  for (int64_t q = q0; q < q1; ++q) {
    const int32_t p = sp.send_order[q];
    if (sp.dst_row[p] < 0) continue;  // dropped by the capacity rule
    MoveSlot(c, peer, d, p, src, row_bytes, sp.src_row, sp.dst_row, sp.primary, peer.recv(), sp.scale);
    ++moved;  // every kept slot, sent once or not: the receiver's plan counts slots
  }
  if (moved == 0) return;  // the receiver expects nothing of this block (its plan agrees)
  AtomicAdd(&peer.src_blocks()[(int64_t)c.rank * SrcBlocks(c.ws->sizes().ret_rows) + J], moved);
  AtomicAdd(&peer.control()->recv_arrivals.value, moved);
}

// Rows of source s's send block J that this rank keeps: segment (e, s) holds s's send positions [ret_off,
// ret_off + rows). `segs` in (expert, source) order (RecvSegments).
uint64_t BlockRows(const std::vector<Segment>& segs, int R, int64_t E_l, int s, int64_t J) {
  const int64_t lo = J * kSrcBlockRows, hi = lo + kSrcBlockRows;
  uint64_t n = 0;
  for (int64_t e = 0; e < E_l; ++e) {
    const Segment& x = segs[e * R + s];
    const int64_t a = std::max<int64_t>(lo, x.ret_off), b = std::min<int64_t>(hi, (int64_t)x.ret_off + x.rows);
    if (b > a) n += (uint64_t)(b - a);
  }
  return n;
}

// The segment holding recv row r (segs in (expert, source) order, packed from row 0; r below their rows).
const Segment& SegmentOf(const std::vector<Segment>& segs, int64_t r) {
  auto it = std::upper_bound(segs.begin(), segs.end(), r,
                             [](int64_t row, const Segment& x) { return row < (int64_t)x.recv_off; });
  while (it != segs.begin() && (it - 1)->rows <= 0) --it;  // empty segments share their successor's recv_off
  return *(it - 1);
}

// One thread, one source s: waits until every block of s holding send positions [pos0, pos0 + rows) has all the rows
// this rank keeps from it.
ErrorRecord WaitSourceRows(const CallContext& c, const std::vector<Segment>& segs, int64_t E_l, const uint64_t* blocks,
                           int64_t nb, int s, int64_t pos0, int64_t rows) {
  const int R = c.ws->ranks();
  for (int64_t J = pos0 / kSrcBlockRows; rows > 0 && J <= (pos0 + rows - 1) / kSrcBlockRows; ++J) {
    ErrorRecord e = WaitFor(c, &blocks[s * nb + J], 0, BlockRows(segs, R, E_l, s, J), s, kStageSrcBlock);
    if (e.code) return e;
  }
  return ErrorRecord{};
}

// Send once: fills the rows [r0, r0 + rows) of recv whose recv_from entry names another row, from that row, after
// waiting for the block of the same source that holds it (the rows themselves have arrived: the caller waited for
// their blocks).
ffi::Error ExpandRows(const CallContext& c, const std::vector<Segment>& segs, int64_t E_l, const uint64_t* blocks,
                      int64_t nb, int64_t r0, int64_t rows, int64_t row_bytes) {
  RankView self = c.ws->view(c.group, c.rank);
  for (int64_t r = r0; r < r0 + rows; ++r) {
    auto f = RecvFromChecked(c, "dispatch_gemm", self, r);
    if (f.has_error()) return f.error();
    if (*f == r) continue;
    const Segment& x = SegmentOf(segs, r);
    const Segment& y = SegmentOf(segs, *f);
    if (y.src != x.src) return FailInput(c, "dispatch_gemm", kBadRecvFrom, r, self.recv_from()[r], c.epoch);
    ErrorRecord e = WaitSourceRows(c, segs, E_l, blocks, nb, y.src, y.ret_off + (*f - y.recv_off), 1);
    if (e.code) return TimeoutError("dispatch_gemm", e, c);
    std::memcpy(self.recv() + r * row_bytes, self.recv() + *f * row_bytes, row_bytes);
  }
  return ffi::Error::Success();
}

// The GEMM's m-tiles in the CUDA kernel's claim order (DgSchedule): 128-row tiles of each local expert's rows of recv
// (all sources, contiguous: segments (e, 0), (e, 1), ...) from the expert's first row, as the bare grouped GEMM
// tiles its groups; first the m-tiles made of this rank's own rows alone, then the others expert by expert.
struct MTile {
  int64_t expert, r0, rows;  // recv rows [r0, r0 + rows)
};
std::vector<MTile> TileOrder(const std::vector<Segment>& segs, int R, int64_t E_l, int rank) {
  std::vector<MTile> own, rest;
  for (int64_t e = 0; e < E_l; ++e) {
    int64_t rows = 0;
    for (int s = 0; s < R; ++s) rows += std::max<int32_t>(segs[e * R + s].rows, 0);
    const int64_t row0 = segs[e * R].recv_off, mt = (rows + kTileRows - 1) / kTileRows;
    const Segment& o = segs[e * R + rank];
    const int64_t lo = o.recv_off - row0, hi = lo + std::max<int32_t>(o.rows, 0);
    int64_t own_lo = (lo + kTileRows - 1) / kTileRows, own_hi = hi == rows ? mt : hi / kTileRows;
    if (own_hi < own_lo || o.rows <= 0) own_lo = own_hi = 0;
    for (int64_t m = 0; m < mt; ++m)
      (m >= own_lo && m < own_hi ? own : rest)
          .push_back(MTile{e, row0 + m * kTileRows, std::min<int64_t>(kTileRows, rows - m * kTileRows)});
  }
  own.insert(own.end(), rest.begin(), rest.end());
  return own;
}

ffi::Error DispatchGemmImpl(ffi::Token, ffi::Result<ffi::Token>, ffi::AnyBuffer src,
                            ffi::Buffer<ffi::S32> slot_src_row, ffi::Buffer<ffi::S32> slot_dest_rank,
                            ffi::Buffer<ffi::S32> slot_dest_row, ffi::Buffer<ffi::S32> recv_rows_expected,
                            ffi::Buffer<ffi::S32> slot_primary, ffi::Buffer<ffi::F32> row_scale,
                            ffi::Buffer<ffi::S32> send_order, ffi::Buffer<ffi::S32> send_start,
                            ffi::Buffer<ffi::S32> seg_rows, ffi::Buffer<ffi::S32> seg_ret_off, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::F32> w_scales, ffi::Buffer<ffi::S32> group_op,
                            ffi::Buffer<ffi::S32> rank_op, ffi::Result<ffi::AnyBuffer> x_recv,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> a_out,
                            ffi::Result<ffi::Buffer<ffi::F32>> h_scales, ffi::Result<ffi::Buffer<ffi::F32>> a_scales,
                            DispatchGemmAttrs attrs) {
  const bool transpose_rhs = attrs.transpose_rhs, swiglu = attrs.swiglu;
  auto shape = CheckDispatchGemm(src, slot_src_row, slot_dest_rank, slot_dest_row, slot_primary, row_scale, w,
                                 w_scales, *x_recv, *out, *a_out, *h_scales, *a_scales, transpose_rhs, swiglu);
  if (shape.has_error()) return shape.error();
  const int64_t S = shape->rows.S, cap = shape->rows.cap, P = shape->rows.P, K = shape->rows.D;
  const int64_t E_l = shape->E_local, N = shape->N, F = N / 2;
  const bool bf16 = shape->rows.dtype == DType::kBF16, fp8 = shape->fp8;
  const int64_t elem_bytes = Traits(shape->rows.dtype).elem_bytes, row_bytes = RowBytes(shape->rows.dtype, K);

  auto ctx = BeginCall("dispatch_gemm", attrs.call, group_op.typed_data()[0], rank_op.typed_data()[0],
                       CallFootprint{row_bytes, cap, P});
  if (ctx.has_error()) return ctx.error();
  const CallContext c = ctx.value();
  Workspace* ws = c.ws;
  const int R = ws->ranks();
  if (ffi::Error e = CheckDispatchGemmPlan(*shape, R, send_order, send_start, seg_rows, seg_ret_off); e.failure())
    return Fail(c, std::move(e));
  if (R > kMaxSourceCounters)
    return Fail(c, InvalidCall("dispatch_gemm: " + std::to_string(R) + " ranks exceed the workspace's " +
                               std::to_string(kMaxSourceCounters) + " src_blocks sources"));
  const SendPlan sp{slot_src_row.typed_data(), slot_dest_rank.typed_data(), slot_dest_row.typed_data(),
                    send_order.typed_data(), send_start.typed_data(),
                    shape->rows.send_once ? slot_primary.typed_data() : nullptr,
                    {shape->rows.scaled ? row_scale.typed_data() : nullptr, shape->rows.dtype, K}, P};
  const int64_t expected = recv_rows_expected.typed_data()[0];
  if (expected < 0 || expected > cap) return FailInput(c, "dispatch_gemm", kBadExpectedRows, 0, expected, cap);
  if (ffi::Error e = CheckSlots(c, "dispatch_gemm", sp.src_row, sp.dst_rank, sp.dst_row, P, S, cap); e.failure())
    return e;
  if (ffi::Error e = CheckSendOrder(c, sp); e.failure()) return e;
  if (sp.primary != nullptr)
    if (ffi::Error e = CheckPrimaries(c, "dispatch_gemm", sp.src_row, sp.dst_rank, sp.dst_row, sp.primary, P);
        e.failure())
      return e;
  std::vector<int64_t> rows_to_rank;
  auto recv_segs = RecvSegments(c, "dispatch_gemm", seg_rows.typed_data(), seg_ret_off.typed_data(), E_l, cap,
                                &rows_to_rank);
  if (recv_segs.has_error()) return recv_segs.error();
  const std::vector<Segment>& segs = *recv_segs;
  int64_t kept_rows = 0;  // recv is packed from row 0
  for (int64_t r : rows_to_rank) kept_rows += r;
  // The plan's count of the rows this rank receives must be its segments' (the recv_arrivals account), as on CUDA.
  if (expected != kept_rows) return FailInput(c, "dispatch_gemm", kBadKeptRows, 0, expected, kept_rows);

  // 1. Push: the other ranks' rows in rounds (unit u: round u / (R - 1), destination rank + 1 + u % (R - 1)).
  const char* src_bytes = static_cast<const char*>(src.untyped_data());
  int64_t rounds = 0;
  for (int i = 1; i < R; ++i) {
    const int d = (c.rank + i) % R;
    ErrorRecord e = WaitFor(c, &ws->view(c.group, d).control()->done_epoch.value, 0, c.epoch - 1, d, kStagePeerReady);
    if (e.code) return TimeoutError("dispatch_gemm", e, c);
    int64_t f, end;
    DestBlocks(sp, d, &f, &end);
    rounds = std::max(rounds, end - f);
  }
  for (int64_t u = 0; R > 1 && u < rounds * (R - 1); ++u) {
    const int d = (c.rank + 1 + (int)(u % (R - 1))) % R;
    int64_t f, end;
    DestBlocks(sp, d, &f, &end);
    if (f + u / (R - 1) < end) PushBlock(c, sp, src_bytes, row_bytes, d, f + u / (R - 1));
  }
  // 2. Copy: the rows this rank keeps.
  {
    int64_t f, end;
    DestBlocks(sp, c.rank, &f, &end);
    for (int64_t J = f; J < end; ++J) PushBlock(c, sp, src_bytes, row_bytes, c.rank, J);
  }

  // 3. GEMM over the m-tiles in claim order, each after the source blocks that hold its rows, then with swiglu
  //    the tile's epilogue. A tile's float32 product goes to `product` at the tile's rows (out when plain, a when
  //    swiglu keeps it in float32), else to `tile_scratch`, which the epilogue reads (and rounds into a kept in
  //    src's dtype) before the next tile overwrites it; a plain product in src's dtype is rounded into out by the
  //    row loop itself (grouped_matmul's CPU rows with that output dtype). The row loops see the tile's rows as rows
  //    0..rows-1 of views that start at its first recv row.
  RankView self = ws->view(c.group, c.rank);
  uint64_t* blocks = self.src_blocks();
  const int64_t nb = SrcBlocks(ws->sizes().ret_rows);
  // (FP8 with swiglu: a is the e4m3 a_q, so the product always goes to the tile scratch.)
  const bool a_rounded = swiglu && shape->keep_a && !fp8 && a_out->element_type() != ffi::DataType::F32;
  const bool out_rounded = shape->out_rounded;  // plain, out in src's dtype (bf16)
  float* product = !swiglu ? (out_rounded ? nullptr : static_cast<float*>(out->untyped_data()))
                   : shape->keep_a && !fp8 && !a_rounded ? static_cast<float*>(a_out->untyped_data())
                                                         : nullptr;
  std::vector<float> tile_scratch(product == nullptr && !out_rounded ? kTileRows * N : 0), acc(N);
  const char* recv = self.recv();
  char* h = static_cast<char*>(out->untyped_data());  // swiglu: [cap, F] in src's dtype (FP8: h_q)
  const ElemView rhs{w.untyped_data(), bf16};
  const Fp8Lhs recv_fp8 = Fp8Lhs::PackedRows(reinterpret_cast<const uint8_t*>(recv), K);
  const int64_t w_blocks = (N / kFp8Tile) * (K / kFp8Tile);  // (FP8: w_scales per expert)
  for (const MTile& t : TileOrder(segs, R, E_l, c.rank)) {
    // Wait for the rows of each source the tile's rows come from: segment (e, s) holds recv rows [recv_off,
    // recv_off + rows), s's send positions from ret_off.
    for (int s = 0; s < R; ++s) {
      const Segment& x = segs[t.expert * R + s];
      const int64_t lo = std::max<int64_t>(t.r0, x.recv_off);
      const int64_t hi = std::min<int64_t>(t.r0 + t.rows, x.recv_off + x.rows);
      if (hi <= lo) continue;
      ErrorRecord e = WaitSourceRows(c, segs, E_l, blocks, nb, s, x.ret_off + (lo - x.recv_off), hi - lo);
      if (e.code) return TimeoutError("dispatch_gemm", e, c);
    }
    if (sp.primary != nullptr)
      if (ffi::Error e = ExpandRows(c, segs, E_l, blocks, nb, t.r0, t.rows, row_bytes); e.failure()) return e;
    float* tile = product != nullptr ? product + t.r0 * N : tile_scratch.data();
    if (fp8) {
      // grouped_matmul_fp8's rows (MatmulFp8Rows) on the packed rows where they landed, then with swiglu
      // grouped_matmul_swiglu_fp8's epilogue over them: the bits of unpacking and calling those.
      MatmulFp8Rows(recv_fp8.From(t.r0), static_cast<const uint8_t*>(w.untyped_data()) + t.expert * N * K,
                    w_scales.typed_data() + t.expert * w_blocks, {0, t.rows}, K, N, tile, /*out_bf16=*/false);
      if (swiglu)
        SwiGluForwardFp8Rows(tile, t.rows, F, reinterpret_cast<uint8_t*>(h) + t.r0 * F,
                             h_scales->typed_data() + t.r0 * (F / kFp8Tile),
                             shape->keep_a ? static_cast<uint8_t*>(a_out->untyped_data()) + t.r0 * N : nullptr,
                             shape->keep_a ? a_scales->typed_data() + t.r0 * (N / kFp8Tile) : nullptr);
      continue;
    }
    if (out_rounded) {
      MatmulRows(ElemView{recv + t.r0 * row_bytes, bf16}, rhs, t.expert * K * N, 0, t.rows, K, N, transpose_rhs,
                 static_cast<char*>(out->untyped_data()) + t.r0 * N * elem_bytes, /*out_bf16=*/true, acc);
      continue;
    }
    MatmulRows(ElemView{recv + t.r0 * row_bytes, bf16}, rhs, t.expert * K * N, 0, t.rows, K, N, transpose_rhs, tile,
               /*out_bf16=*/false, acc);
    if (swiglu) SwiGluRows(tile, 0, t.rows, F, h + t.r0 * F * elem_bytes, bf16);
    if (a_rounded)
      for (int64_t i = 0; i < t.rows * N; ++i) StoreElem(a_out->untyped_data(), bf16, t.r0 * N + i, tile[i]);
  }

  // 4. Zero this call's blocks of every source (the send positions it keeps here: [lo, hi)), then end as a dispatch.
  for (int s = 0; s < R; ++s) {
    int64_t lo = INT64_MAX, hi = 0;
    for (int64_t e = 0; e < E_l; ++e) {
      const Segment& x = segs[e * R + s];
      if (x.rows > 0) {
        lo = std::min<int64_t>(lo, x.ret_off);
        hi = std::max<int64_t>(hi, (int64_t)x.ret_off + x.rows);
      }
    }
    for (int64_t J = hi > lo ? lo / kSrcBlockRows : 0; hi > lo && J <= (hi - 1) / kSrcBlockRows; ++J)
      AtomicStore(&blocks[s * nb + J], 0);
  }
  return EndDispatch(c, "dispatch_gemm", expected, cap, row_bytes,
                     shape->keep_recv ? x_recv->untyped_data() : nullptr, /*rows_in_out=*/false,
                     /*zero_padding=*/false);
}

}  // namespace
}  // namespace jmo::cpu

// The ordering token first, as the other workspace calls on CPU (handlers.cc says why).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoDispatchGemmCpuBody, jmo::cpu::DispatchGemmImpl,
                              jmo::BindDispatchGemm(ffi::Ffi::Bind().Arg<ffi::Token>().Ret<ffi::Token>()));
