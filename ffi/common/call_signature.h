// The operands, results and attributes of the workspace calls, and the checks of their shapes, in one place for
// every platform: the CPU and CUDA handlers prepend their platform context (the CUDA ones: stream and device
// ordinal), bind the rest from here, and check shapes with the same functions (so both report the same errors).
// (Binding methods are rvalue-qualified, hence the std::move of each partial binding.)
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "common/call_attrs.h"
#include "common/dtype.h"
#include "xla/ffi/api/ffi.h"

namespace jmo {

// The operands a dispatch starts with: src [S, D], slot_src_row [P], slot_dest_rank [P], slot_dest_row [P] (-1:
// dropped), recv_rows_expected [], slot_primary [P] or [0], row_scale [P] or [0] f32. slot_primary [P] sends each
// row once per destination rank (protocol.h, "Send once"): a kept slot routed to another rank whose slot_primary names
// another slot takes that slot's row on the destination (the primary: a kept slot of the same source row and
// destination, earlier in the send order, its own primary) instead of a row of its own; [0]: every slot sends its own
// row. row_scale [P]: slot p's row lands as src[slot_src_row[p]] * row_scale[p], the float32 product rounded once to
// the rows' dtype (float32 or bfloat16 rows; not with slot_primary, whose slots share a row); [0]: rows moved
// unchanged.
template <typename Binding>
auto BindDispatchRows(Binding&& b) {  // (by reference: ffi::Binding cannot be moved into a parameter)
  namespace ffi = xla::ffi;
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>();
}

// dispatch(dispatch rows (above), group [], rank []) -> recv [cap, D]
// Attributes: those of every call (CallAttrs, call_attrs.h).
template <typename Binding>
auto BindDispatch(Binding b) {
  namespace ffi = xla::ffi;
  return BindDispatchRows(std::move(b))
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Attrs<CallAttrs>();
}

// dispatch_gemm(dispatch rows (above), send_order [P], send_start [R + 1], seg_rows [E_local, R],
//               seg_ret_off [E_local, R], w [E_local, D, N] in src's dtype (or [E_local, N, D] with transpose_rhs),
//               w_scales, group [], rank []) -> (x_recv, out, a, h_scales, a_scales)
// The dispatch and GEMM1 in one call, each GEMM1 tile starting once its rows are in: CUDA on Hopper with bfloat16
// (the wgmma engine's shapes) or packed e4m3 rows, CPU with float32, bfloat16 or packed e4m3 rows. Results:
//   x_recv [cap, D] in src's dtype: the recv rows, as a dispatch returns them; or [0, D]: not kept (inference).
//   swiglu = false: out [cap, N] float32 = recv[segment] @ w[expert], or in src's dtype (the float32 product rounded
//     once to nearest even, as grouped_matmul's with that output dtype); a [0, N] (unused).
//   swiglu = true (GEMM1 of the expert MLP; not with transpose_rhs): N = 2F, out = h [cap, F] in src's dtype =
//     silu(pre[:, :F]) * pre[:, F:] of the float32 preactivation pre = recv[segment] @ w[expert]; a [cap, 2F]
//     float32 = pre (kept for the backward pass) or [0, 2F] (not kept).
//   h_scales, a_scales, w_scales: f32 [0] each.
// FP8 (DeepSeek-V3's recipe; the rows as they land are GEMM1's operand, no unpacking): src uint8 packed e4m3 rows
// [S, D + D/32] (fp8.pack_rows: D e4m3 values, then D/128 float32 scales), x_recv uint8 [cap or 0, D + D/32], w
// float8_e4m3fn [E_local, N, D] (transpose_rhs set: K-major, the only B layout of FP8 wgmma), w_scales
// [E_local, N/128, D/128] f32, D and N multiples of 128 (the CUDA kernel: D of 512, its TMA row stride); the GEMM is
// grouped_matmul_fp8's (each 128-wide K chunk promoted to float32 with its two scales). Results:
//   swiglu = false: out [cap, N] float32; a [0, N] float32; h_scales, a_scales f32 [0].
//   swiglu = true (N = 2F, F a multiple of 128; the gate's F rows of w, then the up projection's): the recipe's
//     SwiGLU forward of the float32 preactivation, as grouped_matmul_swiglu_fp8: out = h_q [cap, F] float8_e4m3fn
//     and h_scales [cap, F/128], a = a_q [cap or 0, 2F] float8_e4m3fn and a_scales [cap or 0, 2F/128] (1 x 128
//     tiles, amax / 448 scales).
// Rows past the kept ones are left unwritten in every result (no consumer reads them: docs/design.md, "Padding
// rows"). Attributes (DispatchGemmAttrs): those of every call (its pushing CTAs are CallOptions::pushers), then
// transpose_rhs (bool) and swiglu (bool).
template <typename Binding>
auto BindDispatchGemm(Binding b) {
  namespace ffi = xla::ffi;
  return BindDispatchRows(std::move(b))
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attrs<DispatchGemmAttrs>();
}

// expert_combine(lhs [cap, K], w [E_local, K, N] (or [E_local, N, K] with transpose_rhs), lhs_scales, w_scales,
//                gates [T, k] f32, seg_rows [E_local, R], seg_ret_off [E_local, R], slot_ret_row [T*k] (-1: dropped),
//                ret_rows_expected [], group [], rank [])
//   -> y [T, N], slot_out [T*k or 0, N]
// Attributes (ExpertCombineAttrs): those of every call (its consumer is CallOptions' consumer_ctas, serialize and
// tuning), then transpose_rhs (bool: w is [E_local, N, K] and the producer reads w[e]^T in place, as
// jmo_grouped_matmul's transpose_rhs: the input gradient dy @ W^T without a transposed copy of W).
// Operands: lhs, w and the outputs in one compute dtype (float32 or bfloat16), lhs_scales and w_scales f32 [0]; or
// the FP8 producer (DeepSeek-V3's block-scaled GEMM, as jmo_grouped_matmul_fp8): lhs [cap, K] and w [E_local, N, K]
// float8_e4m3fn (transpose_rhs set: K-major, the only B layout of FP8 wgmma), lhs_scales [K/128, ld] f32 (ld >= cap,
// a multiple of 4: MN-major), w_scales [E_local, N/128, K/128] f32, K and N multiples of 128, the outputs float32 or
// bfloat16 (the producer's rows are rounded to it, as the compute dtype's are).
template <typename Binding>
auto BindExpertCombine(Binding b) {
  namespace ffi = xla::ffi;
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attrs<ExpertCombineAttrs>();
}

// gather_rs(lhs [cap, K], w [E_local, K, N] (or [E_local, N, K] with transpose_rhs), row_gate [cap] f32,
//           token_rows [R, T, Q] int32, seg_rows [E_local, R], seg_ret_off [E_local, R], group [], rank [])
//   -> y [T, N], rows [cap or 0, N]
// GEMM2 with the top-k gather-reduce and a reduce-scatter over the group (docs/design.md, "GatherRS"): the producer
// as expert_combine's; token_rows[s, t, q] is the recv row holding the q-th slot of source s's token t on this rank
// (-1: none here), row_gate[i] the gate of recv row i. y[t] = sum over the group's ranks g = 0, 1, ..., R - 1 of
// rank g's float32 partial sum_q row_gate[i] * out[i] (i = token_rows[this rank, t, q] on g). rows: the GEMM's
// output rows in lhs's dtype (recv rows outside the segments zero), kept for the gates' gradient; [0, N]: not kept.
// Attributes (ExpertCombineAttrs): those of every call, then transpose_rhs.
template <typename Binding>
auto BindGatherRs(Binding b) {
  namespace ffi = xla::ffi;
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attrs<ExpertCombineAttrs>();
}

// exchange_counts(counts [R_dst, E_local] int32, group [], rank []) -> counts_all [R_src, R_dst, E_local] int32
// Attributes: those of every call. The count exchange of groups whose ranks span processes (protocol.h).
template <typename Binding>
auto BindExchangeCounts(Binding b) {
  namespace ffi = xla::ffi;
  return std::move(b).template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::S32>>()
      .template Attrs<CallAttrs>();
}

inline xla::ffi::Error InvalidCall(const std::string& msg) {
  return xla::ffi::Error(xla::ffi::ErrorCode::kInvalidArgument, "jax_moe_overlap: " + msg);
}

// The library's dtype (common/dtype.h) of an XLA element type: nullopt for the types no call takes as rows of its
// dtype table, which every shape check refuses, so that a handler never maps a dtype it does not know (the e4m3
// operands of expert_combine and the FP8 GEMMs are checked apart). uint8: packed e4m3 rows, which only the dispatch
// takes (ComputeDTypeOf for every other call).
inline std::optional<DType> DTypeOf(xla::ffi::DataType t) {
  switch (t) {
    case xla::ffi::DataType::F32: return DType::kF32;
    case xla::ffi::DataType::BF16: return DType::kBF16;
    case xla::ffi::DataType::U8: return DType::kE4M3Rows;
    default: return std::nullopt;
  }
}

// The dtype of a call that computes on its rows (a GEMM's operands, rows it sums): DTypeOf's, but nullopt for a row
// format the calls only move (MovedOnly), so that such a call refuses it in its shape check.
inline std::optional<DType> ComputeDTypeOf(xla::ffi::DataType t) {
  const std::optional<DType> d = DTypeOf(t);
  return d && !MovedOnly(*d) ? d : std::nullopt;
}

// A computing call's dtype error: its rule, and where it was given rows that only the dispatch moves, what they are.
inline std::string ComputeDTypeRule(const std::string& rule, xla::ffi::DataType t) {
  const std::optional<DType> d = DTypeOf(t);
  if (!d || !MovedOnly(*d)) return rule;
  return rule + "; got " + Traits(*d).name + " (packed e4m3 rows): only dispatch (which moves them unchanged) and "
         "dispatch_gemm with e4m3 w (dispatch_gemm_fp8, which reads them where they land) take them; the other FP8 "
         "calls take the values and scales apart (fp8.unpack_rows)";
}


// "[2, 3, 4]": a buffer's dimensions, for error messages.
template <typename Dims>
std::string DimsText(const Dims& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// Whether a dispatch's rows are scaled (row_scale [P], BindDispatchRows) for rows of dtype dt: [P] or [0], and [P]
// only for float32 or bfloat16 rows that are not sent once.
inline xla::ffi::ErrorOr<bool> CheckRowScale(const std::string& op,
                                             const xla::ffi::Buffer<xla::ffi::F32>& row_scale, int64_t P, DType dt,
                                             bool send_once) {
  if (row_scale.element_count() != P && row_scale.element_count() != 0)
    return xla::ffi::Unexpected(InvalidCall(op + ": row_scale must be [P] (a scale per slot) or [0]"));
  const bool scaled = P > 0 && row_scale.element_count() == P;
  if (scaled && (MovedOnly(dt) || send_once))
    return xla::ffi::Unexpected(InvalidCall(op + ": row_scale scales float32 or bfloat16 rows, each slot's own: not "
                                            "packed e4m3 rows, not with slot_primary (send once)"));
  return scaled;
}

struct DispatchShape {
  DType dtype;
  int64_t S, D, cap, P;  // src rows, row channels (RowBytes(dtype, D) bytes a row), recv capacity, slots
  bool send_once;        // slot_primary has P entries (else 0)
  bool scaled = false;   // row_scale has P entries (else 0)
};

inline xla::ffi::ErrorOr<DispatchShape> CheckDispatch(const xla::ffi::AnyBuffer& src,
                                                      const xla::ffi::Buffer<xla::ffi::S32>& slot_src_row,
                                                      const xla::ffi::Buffer<xla::ffi::S32>& slot_dest_rank,
                                                      const xla::ffi::Buffer<xla::ffi::S32>& slot_dest_row,
                                                      const xla::ffi::Buffer<xla::ffi::S32>& slot_primary,
                                                      const xla::ffi::Buffer<xla::ffi::F32>& row_scale,
                                                      const xla::ffi::AnyBuffer& out) {
  const std::optional<DType> dt = DTypeOf(src.element_type());
  if (!dt || out.element_type() != src.element_type())
    return xla::ffi::Unexpected(InvalidCall("dispatch: rows must be " + DTypeNames(/*moved_too=*/true) +
                                            ", src and out alike"));
  auto sd = src.dimensions();
  auto od = out.dimensions();
  if (sd.size() != 2 || od.size() != 2 || sd[1] != od[1])
    return xla::ffi::Unexpected(InvalidCall("dispatch: src [S, D] and out [cap, D]"));
  // D: the rows' channels (of packed rows, whose buffer holds their bytes, the channels of whole scale tiles).
  const int64_t D = RowChannels(*dt, sd[1]);
  if (D < 0) {
    const int64_t tile = Traits(*dt).channels_per_scale, tile_bytes = RowBytes(*dt, tile);
    return xla::ffi::Unexpected(InvalidCall(
        "dispatch: " + std::string(Traits(*dt).name) + " rows are packed e4m3 rows of whole 1 x " +
        std::to_string(tile) + " tiles (" + std::to_string(tile_bytes) +
        " bytes per tile: the values, then the tile's float32 scale), so their width must be a positive multiple of " +
        std::to_string(tile_bytes) + "; got src " + DimsText(sd)));
  }
  const int64_t P = slot_src_row.element_count();
  if (slot_dest_rank.element_count() != P || slot_dest_row.element_count() != P)
    return xla::ffi::Unexpected(InvalidCall("dispatch: slot arrays must have equal length"));
  if (slot_primary.element_count() != P && slot_primary.element_count() != 0)
    return xla::ffi::Unexpected(InvalidCall("dispatch: slot_primary must be [P] (send once) or [0]"));
  const bool send_once = P > 0 && slot_primary.element_count() == P;
  auto scaled = CheckRowScale("dispatch", row_scale, P, *dt, send_once);
  if (scaled.has_error()) return xla::ffi::Unexpected(scaled.error());
  return DispatchShape{*dt, sd[0], D, od[0], P, send_once, *scaled};
}

struct CountsShape {
  int64_t R_src, R_dst, E_local;
};

// counts holds R_dst x E_local values and counts_all is [R_src, R_dst, E_local].
inline xla::ffi::ErrorOr<CountsShape> CheckExchangeCounts(const xla::ffi::Buffer<xla::ffi::S32>& counts,
                                                          const xla::ffi::Buffer<xla::ffi::S32>& counts_all) {
  auto od = counts_all.dimensions();
  if (od.size() != 3 || counts.element_count() != od[1] * od[2])
    return xla::ffi::Unexpected(InvalidCall("exchange_counts: counts [R_dst, E_local] and counts_all [R_src, R_dst, "
                                            "E_local]; got counts " + DimsText(counts.dimensions()) +
                                            ", counts_all " + DimsText(od)));
  return CountsShape{od[0], od[1], od[2]};
}

struct CombineShape {
  DType dtype;                            // of the outputs (and of lhs and w unless fp8)
  int64_t cap, K, E_local, N, T, k, P, R;  // R: columns of seg_rows (must equal the workspace's ranks)
  bool want_slots;                        // slot_out has T*k rows (else 0)
  bool fp8 = false;                       // e4m3 lhs and w with their scales (BindExpertCombine)
  int64_t scales_ld = 0;                  // fp8: the row stride of lhs_scales [K/128, ld]
};

constexpr int64_t kFp8Tile = 128;  // K elements per scale; the side of a weight block

// The FP8 row GEMMs' rules, each stated once here (jmo_grouped_matmul_fp8's, expert_combine's e4m3 producer's,
// dispatch_gemm's FP8 form's), nullopt or why not in the call's own names (`k`: K's name, K or D).
// K and N positive multiples of 128: whole 1 x 128 and 128 x 128 scale tiles.
inline std::optional<std::string> Fp8TilesRefusal(int64_t K, int64_t N, const std::string& k) {
  if (K < kFp8Tile || K % kFp8Tile != 0 || N < kFp8Tile || N % kFp8Tile != 0)
    return k + " and N must be positive multiples of 128 (whole 1 x 128 and 128 x 128 scale tiles), got " + k + "=" +
           std::to_string(K) + ", N=" + std::to_string(N);
  return std::nullopt;
}

// The weight's block scales [G, N/128, K/128] (`groups`: G's name, `rhs_scales`: the scales').
template <typename RhsDims>
std::optional<std::string> Fp8WeightScalesRefusal(int64_t K, int64_t N, int64_t G, const RhsDims& bd,
                                                  const std::string& k, const std::string& groups,
                                                  const std::string& rhs_scales) {
  if (bd.size() != 3 || bd[0] != G || bd[1] != N / kFp8Tile || bd[2] != K / kFp8Tile)
    return rhs_scales + " must be [" + groups + ", N/128, " + k + "/128] = [" + std::to_string(G) + ", " +
           std::to_string(N / kFp8Tile) + ", " + std::to_string(K / kFp8Tile) + "], got " + DimsText(bd);
  return std::nullopt;
}

// The FP8 grouped GEMM kernel's own limits (wgmma_grouped_fp8.cuh's GroupedGemmFp8Refusal), for the calls whose
// handlers refuse them before the call begins: rows in [1, 2^31 - 128) and fewer than 2^31 weight scales.
inline std::optional<std::string> Fp8KernelLimitsRefusal(int64_t rows, int64_t K, int64_t N, int64_t G,
                                                         const std::string& k) {
  if (rows < 1 || rows > 0x7fffffff - kFp8Tile)
    return "e4m3 lhs needs cap (its rows) in [1, 2^31 - 128), got " + std::to_string(rows);
  if (G * (N / kFp8Tile) * (K / kFp8Tile) > 0x7fffffff)
    return "w_scales must have fewer than 2^31 entries (E_local * N/128 * " + k + "/128)";
  return std::nullopt;
}

// lhs [M, K] and rhs [G, N, K] e4m3: Fp8TilesRefusal, lhs_scales [K/128, ld] (MN-major: ld >= M and a multiple of 4,
// 16-byte rows for TMA), Fp8WeightScalesRefusal; `rows` names M.
template <typename LhsDims, typename RhsDims>
std::optional<std::string> Fp8RowOperandsRefusal(int64_t M, int64_t K, int64_t N, int64_t G, const LhsDims& sd,
                                                 const RhsDims& bd, const std::string& rows, const std::string& groups,
                                                 const std::string& rhs_scales) {
  if (std::optional<std::string> why = Fp8TilesRefusal(K, N, "K")) return why;
  if (sd.size() != 2 || sd[0] != K / kFp8Tile || sd[1] < M || sd[1] % 4 != 0)
    return "lhs_scales must be [K/128, ld] with ld >= " + rows + " and a multiple of 4 (MN-major, 16-byte rows): " +
           "got " + DimsText(sd) + " for " + rows + "=" + std::to_string(M) + ", K=" + std::to_string(K);
  return Fp8WeightScalesRefusal(K, N, G, bd, "K", groups, rhs_scales);
}

// expert_combine's FP8 operands (BindExpertCombine's rule) against the shape CheckExpertCombine read: fills
// s->scales_ld, or says what is wrong.
inline std::optional<std::string> CheckExpertCombineFp8(const xla::ffi::AnyBuffer& w,
                                                        const xla::ffi::Buffer<xla::ffi::F32>& lhs_scales,
                                                        const xla::ffi::Buffer<xla::ffi::F32>& w_scales,
                                                        bool transpose_rhs, CombineShape* s) {
  if (w.element_type() != xla::ffi::DataType::F8E4M3FN)
    return std::string("lhs float8_e4m3fn needs w float8_e4m3fn (with their scales)");
  if (!transpose_rhs)
    return std::string("e4m3 w must be [E_local, N, K] (K-major: transpose_rhs), the only B layout of FP8 wgmma");
  if (std::optional<std::string> why = Fp8RowOperandsRefusal(s->cap, s->K, s->N, s->E_local, lhs_scales.dimensions(),
                                                             w_scales.dimensions(), "cap", "E_local", "w_scales"))
    return why;
  if (std::optional<std::string> why = Fp8KernelLimitsRefusal(s->cap, s->K, s->N, s->E_local, "K")) return why;
  s->fp8 = true;
  s->scales_ld = lhs_scales.dimensions()[1];
  return std::nullopt;
}

struct DispatchGemmShape {
  DispatchShape rows;  // src and the slots as a dispatch's; cap = out's rows (fp8: D the rows' channels)
  int64_t E_local, N;  // w's experts and GEMM columns (2F with swiglu)
  bool keep_recv;      // x_recv has cap rows (else 0)
  bool keep_a;         // swiglu: a has cap rows (else 0)
  bool fp8 = false;    // packed e4m3 rows and e4m3 w with its block scales (BindDispatchGemm's FP8 form)
  bool out_rounded = false;  // without swiglu: out in bf16 src's dtype, the float32 product rounded once
};

// dispatch_gemm's FP8 form (BindDispatchGemm) past the dispatch rows' own checks: src uint8 packed rows, w e4m3.
inline xla::ffi::ErrorOr<DispatchGemmShape> CheckDispatchGemmFp8(
    const xla::ffi::AnyBuffer& src, int64_t P, bool send_once, const xla::ffi::AnyBuffer& w,
    const xla::ffi::Buffer<xla::ffi::F32>& w_scales, const xla::ffi::AnyBuffer& x_recv,
    const xla::ffi::AnyBuffer& out, const xla::ffi::AnyBuffer& a, const xla::ffi::Buffer<xla::ffi::F32>& h_scales,
    const xla::ffi::Buffer<xla::ffi::F32>& a_scales, bool transpose_rhs, bool swiglu) {
  using xla::ffi::DataType;
  using xla::ffi::Unexpected;
  auto fail = [](const std::string& why) { return Unexpected(InvalidCall("dispatch_gemm (e4m3 w): " + why)); };
  if (src.element_type() != DataType::U8 || x_recv.element_type() != DataType::U8)
    return fail("src and x_recv must be uint8 packed e4m3 rows (fp8.pack_rows: D values, then D/128 float32 "
                "scales) beside e4m3 w");
  if (!transpose_rhs)
    return fail("e4m3 w must be [E_local, N, D] (K-major: transpose_rhs), the only B layout of FP8 wgmma");
  auto sd = src.dimensions(), wd = w.dimensions(), xd = x_recv.dimensions(), od = out.dimensions(),
       ad = a.dimensions(), hs = h_scales.dimensions(), as = a_scales.dimensions();
  if (sd.size() != 2 || wd.size() != 3 || xd.size() != 2 || od.size() != 2 || ad.size() != 2)
    return fail("expected src [S, D + D/32], w [E_local, N, D], x_recv [cap or 0, D + D/32], out and a 2D; got src " +
                DimsText(sd) + ", w " + DimsText(wd) + ", x_recv " + DimsText(xd) + ", out " + DimsText(od) +
                ", a " + DimsText(ad));
  const int64_t D = wd[2], N = wd[1], E_l = wd[0], cap = od[0], width = RowBytes(DType::kE4M3Rows, D);
  if (std::optional<std::string> why = Fp8TilesRefusal(D, N, "D")) return fail(*why);
  if (swiglu && N % (2 * kFp8Tile))
    return fail("with swiglu N = 2F must have F a multiple of 128 (whole 1 x 128 tiles of h), got w " + DimsText(wd));
  if (sd[1] != width || xd[1] != width || (xd[0] != cap && xd[0] != 0))
    return fail("src and x_recv rows must be D + D/32 = " + std::to_string(width) + " bytes for w " + DimsText(wd) +
                " (x_recv [cap or 0, ...]); got src " + DimsText(sd) + ", x_recv " + DimsText(xd));
  if (std::optional<std::string> why =
          Fp8WeightScalesRefusal(D, N, E_l, w_scales.dimensions(), "D", "E_local", "w_scales"))
    return fail(*why);
  if (std::optional<std::string> why = Fp8KernelLimitsRefusal(cap, D, N, E_l, "D")) return fail(*why);
  const int64_t F = N / 2, a_rows = ad[0];
  const bool ok = swiglu ? out.element_type() == DataType::F8E4M3FN && od[1] == F &&
                               a.element_type() == DataType::F8E4M3FN && ad[1] == N && (a_rows == cap || a_rows == 0) &&
                               hs.size() == 2 && hs[0] == cap && hs[1] == F / kFp8Tile && as.size() == 2 &&
                               as[0] == a_rows && as[1] == N / kFp8Tile
                         : out.element_type() == DataType::F32 && od[1] == N && a.element_type() == DataType::F32 &&
                               a_rows == 0 && ad[1] == N && h_scales.element_count() == 0 &&
                               a_scales.element_count() == 0;
  if (!ok)
    return fail(swiglu ? "with swiglu, out = h_q float8_e4m3fn [cap, F], a = a_q float8_e4m3fn [cap or 0, 2F], "
                         "h_scales f32 [cap, F/128], a_scales f32 [a's rows, 2F/128] (F = N/2 = " +
                             std::to_string(F) + "); got out " + DimsText(od) + ", a " + DimsText(ad) + ", h_scales " +
                             DimsText(hs) + ", a_scales " + DimsText(as)
                       : "without swiglu, out float32 [cap, N], a float32 [0, N], h_scales and a_scales f32 [0]; "
                         "got out " + DimsText(od) + ", a " + DimsText(ad));
  return DispatchGemmShape{DispatchShape{DType::kE4M3Rows, sd[0], D, cap, P, send_once}, E_l, N, xd[0] == cap,
                           swiglu && a_rows == cap, true};
}

// dispatch_gemm's operands and results apart from the plan arrays whose sizes depend on the workspace's ranks
// (CheckDispatchGemmPlan); see BindDispatchGemm for the shapes.
inline xla::ffi::ErrorOr<DispatchGemmShape> CheckDispatchGemm(
    const xla::ffi::AnyBuffer& src, const xla::ffi::Buffer<xla::ffi::S32>& slot_src_row,
    const xla::ffi::Buffer<xla::ffi::S32>& slot_dest_rank, const xla::ffi::Buffer<xla::ffi::S32>& slot_dest_row,
    const xla::ffi::Buffer<xla::ffi::S32>& slot_primary, const xla::ffi::Buffer<xla::ffi::F32>& row_scale,
    const xla::ffi::AnyBuffer& w, const xla::ffi::Buffer<xla::ffi::F32>& w_scales, const xla::ffi::AnyBuffer& x_recv,
    const xla::ffi::AnyBuffer& out, const xla::ffi::AnyBuffer& a, const xla::ffi::Buffer<xla::ffi::F32>& h_scales,
    const xla::ffi::Buffer<xla::ffi::F32>& a_scales, bool transpose_rhs, bool swiglu) {
  using xla::ffi::Unexpected;
  const int64_t P = slot_src_row.element_count();
  if (slot_dest_rank.element_count() != P || slot_dest_row.element_count() != P)
    return Unexpected(InvalidCall("dispatch_gemm: slot arrays must have equal length"));
  if (slot_primary.element_count() != P && slot_primary.element_count() != 0)
    return Unexpected(InvalidCall("dispatch_gemm: slot_primary must be [P] (send once) or [0]"));
  const bool send_once = P > 0 && slot_primary.element_count() == P;
  if (w.element_type() == xla::ffi::DataType::F8E4M3FN) {
    if (auto scaled = CheckRowScale("dispatch_gemm", row_scale, P, DType::kE4M3Rows, send_once); scaled.has_error())
      return Unexpected(scaled.error());
    return CheckDispatchGemmFp8(src, P, send_once, w, w_scales, x_recv, out, a, h_scales, a_scales, transpose_rhs,
                                swiglu);
  }
  const auto xt = src.element_type();
  if (xt == xla::ffi::DataType::U8)
    return Unexpected(InvalidCall("dispatch_gemm: packed e4m3 rows (uint8 src) need w float8_e4m3fn [E_local, N, D] "
                                  "with its block scales (dispatch_gemm_fp8)"));
  const std::optional<DType> dt = ComputeDTypeOf(xt);
  if (!dt || w.element_type() != xt || x_recv.element_type() != xt)
    return Unexpected(InvalidCall("dispatch_gemm: src, w and x_recv must share one dtype, " + DTypeNames() +
                                  ", or src and x_recv packed e4m3 rows (uint8) with w float8_e4m3fn and its scales"));
  if (w_scales.element_count() != 0 || h_scales.element_count() != 0 || a_scales.element_count() != 0)
    return Unexpected(InvalidCall("dispatch_gemm: w_scales, h_scales and a_scales are the e4m3 form's (f32 [0] for " +
                                  std::string(Traits(*dt).name) + " rows)"));
  if (swiglu && transpose_rhs)
    return Unexpected(InvalidCall("dispatch_gemm: swiglu is GEMM1's epilogue (w [E_local, D, 2F]), not for "
                                  "transpose_rhs"));
  if ((swiglu ? out.element_type() != xt
              : out.element_type() != xla::ffi::DataType::F32 && out.element_type() != xt) ||
      (a.element_type() != xla::ffi::DataType::F32 && !(swiglu && a.element_type() == xt)))
    return Unexpected(InvalidCall(swiglu ? "dispatch_gemm: with swiglu, out (h) must be in src's dtype and a float32 "
                                           "or src's dtype"
                                         : "dispatch_gemm: without swiglu, out must be float32 or src's dtype, and a "
                                           "float32"));
  auto sd = src.dimensions(), wd = w.dimensions(), xd = x_recv.dimensions(), od = out.dimensions();
  auto ad = a.dimensions();
  const int64_t wk = transpose_rhs ? 2 : 1, wn = transpose_rhs ? 1 : 2;  // w's K and N dimensions
  const bool ranks_ok = sd.size() == 2 && wd.size() == 3 && xd.size() == 2 && od.size() == 2 && ad.size() == 2;
  const int64_t D = ranks_ok ? sd[1] : 0, N = ranks_ok ? wd[wn] : 0, cap = ranks_ok ? od[0] : 0;
  const bool ok = ranks_ok && wd[wk] == D && xd[1] == D && (xd[0] == cap || xd[0] == 0) &&
                  (swiglu ? N % 2 == 0 && od[1] == N / 2 && ad[1] == N && (ad[0] == cap || ad[0] == 0)
                          : od[1] == N && ad[1] == N && ad[0] == 0);
  if (!ok)
    return Unexpected(InvalidCall(
        std::string("dispatch_gemm: expected src [S, D], ") +
        (transpose_rhs ? "w [E_local, N, D] (transpose_rhs), " : "w [E_local, D, N], ") + "x_recv [cap or 0, D], " +
        (swiglu ? "out [cap, N / 2] and a [cap or 0, N] (swiglu)" : "out [cap, N] and a [0, N]") + "; got src " +
        DimsText(sd) + ", w " + DimsText(wd) + ", x_recv " + DimsText(xd) + ", out " + DimsText(od) + ", a " +
        DimsText(ad)));
  auto scaled = CheckRowScale("dispatch_gemm", row_scale, P, *dt, send_once);
  if (scaled.has_error()) return Unexpected(scaled.error());
  return DispatchGemmShape{DispatchShape{*dt, sd[0], D, cap, P, send_once, *scaled}, wd[0], N,
                           xd[0] == cap && cap > 0,
                           swiglu && ad[0] == cap && cap > 0, false,
                           !swiglu && out.element_type() != xla::ffi::DataType::F32};
}

// dispatch_gemm's plan arrays against the workspace's R ranks: send_order [P], send_start [R + 1], seg_rows and
// seg_ret_off [E_local, R].
inline xla::ffi::Error CheckDispatchGemmPlan(const DispatchGemmShape& s, int64_t R,
                                             const xla::ffi::Buffer<xla::ffi::S32>& send_order,
                                             const xla::ffi::Buffer<xla::ffi::S32>& send_start,
                                             const xla::ffi::Buffer<xla::ffi::S32>& seg_rows,
                                             const xla::ffi::Buffer<xla::ffi::S32>& seg_ret_off) {
  if (seg_rows.element_count() != s.E_local * R || seg_ret_off.element_count() != seg_rows.element_count())
    return InvalidCall("dispatch_gemm: seg_rows and seg_ret_off must be [E_local, R] with R = workspace ranks");
  if (send_order.element_count() != s.rows.P || send_start.element_count() != R + 1)
    return InvalidCall("dispatch_gemm: send_order must be [P] (one per slot) and send_start [R + 1]");
  return xla::ffi::Error::Success();
}

// w is [E_local, K, N], or [E_local, N, K] with transpose_rhs (N and K then read from its last two dimensions
// swapped). Each error names the shapes it got.
inline xla::ffi::ErrorOr<CombineShape> CheckExpertCombine(const xla::ffi::AnyBuffer& lhs,
                                                          const xla::ffi::AnyBuffer& w,
                                                          const xla::ffi::Buffer<xla::ffi::F32>& lhs_scales,
                                                          const xla::ffi::Buffer<xla::ffi::F32>& w_scales,
                                                          const xla::ffi::Buffer<xla::ffi::F32>& gates,
                                                          const xla::ffi::Buffer<xla::ffi::S32>& seg_rows,
                                                          const xla::ffi::Buffer<xla::ffi::S32>& seg_ret_off,
                                                          const xla::ffi::Buffer<xla::ffi::S32>& slot_ret_row,
                                                          const xla::ffi::AnyBuffer& y,
                                                          const xla::ffi::AnyBuffer& slot_out, bool transpose_rhs) {
  using xla::ffi::Unexpected;
  const bool fp8 = lhs.element_type() == xla::ffi::DataType::F8E4M3FN;
  const xla::ffi::DataType xt = fp8 ? y.element_type() : lhs.element_type();  // the compute dtype
  const std::optional<DType> dt = ComputeDTypeOf(xt);
  if (!dt || (!fp8 && w.element_type() != xt) || y.element_type() != xt || slot_out.element_type() != xt)
    return Unexpected(InvalidCall(ComputeDTypeRule(
        "expert_combine: lhs, w and outputs must share one dtype, " + DTypeNames() +
            " (its producer GEMM's operands), or lhs and w float8_e4m3fn with outputs of one of those",
        xt)));
  if (!fp8 && (lhs_scales.element_count() != 0 || w_scales.element_count() != 0))
    return Unexpected(InvalidCall("expert_combine: lhs_scales and w_scales are the e4m3 operands' (empty for " +
                                  std::string(Traits(*dt).name) + " lhs and w)"));
  auto ld = lhs.dimensions(), wd = w.dimensions(), gd = gates.dimensions(), yd = y.dimensions(),
       sd = seg_rows.dimensions(), so = slot_out.dimensions();
  const char* w_layout = transpose_rhs ? "w [E_local, N, K] (transpose_rhs)" : "w [E_local, K, N]";
  if (ld.size() != 2 || wd.size() != 3 || gd.size() != 2 || yd.size() != 2 || sd.size() != 2 || so.size() != 2)
    return Unexpected(InvalidCall(std::string("expert_combine: expected lhs [cap, K], ") + w_layout +
                                  ", gates [T, k], seg_rows [E_local, R]; got lhs " + DimsText(ld) + ", w " +
                                  DimsText(wd) + ", gates " + DimsText(gd) + ", seg_rows " + DimsText(sd)));
  const int64_t w_k = transpose_rhs ? wd[2] : wd[1], w_n = transpose_rhs ? wd[1] : wd[2];
  CombineShape s{*dt, ld[0], ld[1], wd[0], w_n, gd[0], gd[1], gd[0] * gd[1], sd[1], so[0] != 0};
  if (w_k != s.K)
    return Unexpected(InvalidCall(std::string("expert_combine: ") + w_layout + " does not fit lhs [cap, K]: lhs " +
                                  DimsText(ld) + ", w " + DimsText(wd) + " (K " + std::to_string(s.K) + " vs " +
                                  std::to_string(w_k) + ")"));
  if (yd[0] != s.T || yd[1] != s.N || sd[0] != s.E_local)
    return Unexpected(InvalidCall("expert_combine: inconsistent shapes: y " + DimsText(yd) + " must be [T, N] = [" +
                                  std::to_string(s.T) + ", " + std::to_string(s.N) + "] and seg_rows " +
                                  DimsText(sd) + " must have E_local = " + std::to_string(s.E_local) + " rows"));
  if ((s.want_slots && (so[0] != s.P || so[1] != s.N)) || slot_ret_row.element_count() != s.P ||
      seg_ret_off.element_count() != seg_rows.element_count())
    return Unexpected(InvalidCall("expert_combine: slot arrays must have T*k rows"));
  if (fp8) {
    if (std::optional<std::string> why = CheckExpertCombineFp8(w, lhs_scales, w_scales, transpose_rhs, &s))
      return Unexpected(InvalidCall("expert_combine: " + *why));
  }
  return s;
}

// expert_combine's segments against the workspace's R ranks: seg_rows and seg_ret_off [E_local, R].
inline xla::ffi::Error CheckExpertCombinePlan(const CombineShape& s, int64_t R) {
  if (s.R != R) return InvalidCall("expert_combine: seg_rows must be [E_local, R] with R = workspace ranks");
  return xla::ffi::Error::Success();
}

struct GatherRsShape {
  DType dtype;
  int64_t cap, K, E_local, N, T, Q, R;  // R: seg_rows' columns and token_rows' sources (the workspace's ranks)
  bool want_rows;                       // rows has cap rows (else 0)
};

// gather_rs's operands and results (BindGatherRs); each error names the shapes it got.
inline xla::ffi::ErrorOr<GatherRsShape> CheckGatherRs(const xla::ffi::AnyBuffer& lhs, const xla::ffi::AnyBuffer& w,
                                                      const xla::ffi::Buffer<xla::ffi::F32>& row_gate,
                                                      const xla::ffi::Buffer<xla::ffi::S32>& token_rows,
                                                      const xla::ffi::Buffer<xla::ffi::S32>& seg_rows,
                                                      const xla::ffi::Buffer<xla::ffi::S32>& seg_ret_off,
                                                      const xla::ffi::AnyBuffer& y, const xla::ffi::AnyBuffer& rows,
                                                      bool transpose_rhs) {
  using xla::ffi::Unexpected;
  const xla::ffi::DataType xt = lhs.element_type();
  const std::optional<DType> dt = ComputeDTypeOf(xt);
  if (!dt || w.element_type() != xt || y.element_type() != xt || rows.element_type() != xt)
    return Unexpected(InvalidCall(ComputeDTypeRule(
        "gather_rs: lhs, w and outputs must share one dtype, " + DTypeNames() + " (its producer GEMM's operands)",
        xt)));
  auto ld = lhs.dimensions(), wd = w.dimensions(), td = token_rows.dimensions(), yd = y.dimensions(),
       sd = seg_rows.dimensions(), rd = rows.dimensions();
  const char* w_layout = transpose_rhs ? "w [E_local, N, K] (transpose_rhs)" : "w [E_local, K, N]";
  const bool ranks_ok = ld.size() == 2 && wd.size() == 3 && td.size() == 3 && yd.size() == 2 && sd.size() == 2 &&
                        rd.size() == 2;
  const int64_t w_k = ranks_ok ? (transpose_rhs ? wd[2] : wd[1]) : 0, w_n = ranks_ok ? (transpose_rhs ? wd[1] : wd[2]) : 0;
  const bool ok = ranks_ok && w_k == ld[1] && yd[1] == w_n && td[1] == yd[0] && sd[0] == wd[0] && sd[1] == td[0] &&
                  row_gate.element_count() == ld[0] && seg_ret_off.element_count() == seg_rows.element_count() &&
                  rd[1] == w_n && (rd[0] == ld[0] || rd[0] == 0);
  if (!ok)
    return Unexpected(InvalidCall(std::string("gather_rs: expected lhs [cap, K], ") + w_layout +
                                  ", row_gate [cap], token_rows [R, T, Q], seg_rows and seg_ret_off [E_local, R], "
                                  "y [T, N], rows [cap or 0, N]; got lhs " + DimsText(ld) + ", w " + DimsText(wd) +
                                  ", row_gate " + DimsText(row_gate.dimensions()) + ", token_rows " + DimsText(td) +
                                  ", seg_rows " + DimsText(sd) + ", y " + DimsText(yd) + ", rows " + DimsText(rd)));
  return GatherRsShape{*dt, ld[0], ld[1], wd[0], w_n, yd[0], td[2], td[0], rd[0] != 0 && ld[0] > 0};
}

// gather_rs's R (seg_rows' columns, token_rows' sources) against the workspace's ranks.
inline xla::ffi::Error CheckGatherRsPlan(const GatherRsShape& s, int64_t R) {
  if (s.R == R) return xla::ffi::Error::Success();
  return InvalidCall("gather_rs: seg_rows [E_local, R] and token_rows [R, T, Q] must have R = the workspace's " +
                     std::to_string(R) + " ranks, got R = " + std::to_string(s.R));
}

}  // namespace jmo
