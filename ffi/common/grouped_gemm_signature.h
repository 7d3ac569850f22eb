// Operands, results, attributes and shape checks of the two bare grouped-GEMM custom calls, shared by the CPU and
// CUDA handlers (as call_signature.h is for dispatch and expert_combine):
//
//   jmo_grouped_matmul(lhs [M, K], rhs [G, K, N] (or [G, N, K] with transpose_rhs), group_sizes [G] s32)
//       -> out [M, N]                 out[r] = lhs[r] @ rhs[g(r)] for the rows of group g; rows past the groups are 0
//   jmo_grouped_outer(lhs [M, K], rhs [M, N], group_sizes [G] s32)
//       -> out [G, K, N]              out[g] = lhs[rows of g]^T @ rhs[rows of g]
//   jmo_grouped_matmul_swiglu(lhs [M, K], rhs [G, K, 2F], group_sizes [G] s32)
//       -> h [M, F], a [M or 0, 2F]   a = lhs[r] @ rhs[g(r)] in float32 (0 rows: not kept), h = silu(a[:, :F]) *
//                                     a[:, F:] in lhs's dtype; rows past the groups are 0 in both
//   jmo_grouped_matmul_swiglu_grad(lhs [M, K], rhs [G, K, F] (or [G, F, K] with transpose_rhs), group_sizes [G] s32,
//                                  a [M, 2F] f32 or lhs's dtype)
//       -> da [M, 2F]                 dh = lhs[r] @ rhs[g(r)] in float32 (not an output), da = the input gradient of
//                                     silu(a[:, :F]) * a[:, F:] at dh (d_gate | d_up; a taken to float32) in lhs's
//                                     dtype; rows past the groups are 0
//   jmo_grouped_matmul_fp8(lhs [M, K] e4m3, lhs_scales [K/128, ld] f32, rhs [G, N, K] e4m3,
//                          rhs_scales [G, N/128, K/128] f32, group_sizes [G] s32)
//       -> out [M, N] bf16 or f32     DeepSeek-V3's block-scaled GEMM (arXiv 2412.19437 section 3.3):
//                                     out[r, n] = sum over 128-wide K chunks kc of
//                                       (sum_{k in kc} lhs[r, k] rhs[g(r)][n, k]) * lhs_scales[kc][r] *
//                                       rhs_scales[g(r)][n / 128][kc]
//                                     rows past the groups are 0. lhs_scales is MN-major (one chunk's scales of
//                                     consecutive rows contiguous: the layout the Hopper kernel loads by TMA), with
//                                     ld >= M and ld % 4 == 0 (16-byte rows); rhs is K-major (fp8.Fp8Weight's values,
//                                     the only B layout of FP8 wgmma), rhs_scales Fp8Weight's scales. K and N are
//                                     positive multiples of 128 (whole scale tiles).
//   jmo_grouped_matmul_swiglu_fp8(lhs [M, K] e4m3, lhs_scales [K/128, ld] f32, rhs [G, 2F, K] e4m3,
//                                 rhs_scales [G, 2F/128, K/128] f32, group_sizes [G] s32)
//       -> h_q [M, F] e4m3, h_s [M, F/128] f32, a_q [M, 2F] e4m3, a_s [M, 2F/128] f32 (a not kept: both [0, ...])
//                                     GEMM1 of the FP8 recipe with its SwiGLU forward: jmo_swiglu_forward_fp8 of
//                                     jmo_grouped_matmul_fp8's float32 a (N = 2F: the gate's F rows of rhs, then the
//                                     up projection's), bit for bit, without a in memory. F is a positive multiple
//                                     of 128.
//   jmo_grouped_outer_fp8(lhs_t [K, Mp] e4m3, lhs_scales [Mp/128, lda] f32, rhs_t [N, Mp] e4m3,
//                         rhs_scales [Mp/128, ldb] f32, group_sizes [G] s32)
//       -> out [G, K, N] bf16 or f32  the weight gradient of the recipe, both operands scaled per 128 x 1 tile
//                                     (per channel, per 128 rows of a group) and stored token-contiguous (FP8 wgmma
//                                     reads both operands K-major only): with P_g = sum_{h<g} ceil(size_h / 128) * 128
//                                     (each group's rows start a 128-row tile; clipped at Mp),
//                                     out[g][m, n] = sum over the chunks kc = P_g / 128 .. P_{g+1} / 128 - 1 of
//                                       (sum_{r in kc} lhs_t[m, r] rhs_t[n, r]) * lhs_scales[kc][m] *
//                                       rhs_scales[kc][n]
//                                     (zero for a group without rows). The columns P_g + size_g .. P_{g+1} - 1 of
//                                     both operands (a group's padding) must be zero. The scales are
//                                     fp8.quantize_columns' ([tiles, channels]); lda >= K, ldb >= N, both multiples
//                                     of 4 (16-byte rows). Mp, K and N are positive multiples of 128.
//   jmo_quantize_columns_fp8(x [M, C] f32, bf16 or e4m3, x_scales [M, C/128] or [M, 0] f32, group_sizes [G] s32)
//       -> q_t [C, Mp] e4m3, s [Mp/128, C] f32
//                                     jmo_grouped_outer_fp8's operand from rows: fp8.quantize_columns with the
//                                     tiles of fp8.column_tiles(M, group_sizes) (common/fp8_columns.h states the
//                                     rules), in the token-contiguous layout: q_t[c, 128 t + i] = channel c of the
//                                     i-th row of tile t quantized, 0 where tile t has fewer than i + 1 rows; s[t, c]
//                                     tile t's scale. Mp / 128 (the tiles) >= ceil(M / 128) + G, enough for any group
//                                     sizes (fp8.ColumnTiles.count); the tiles past the groups' are empty (zero
//                                     values, scale 2^-126). x float32 or bfloat16: x_scales is [M, 0] (unread) and
//                                     C a positive multiple of 128. x e4m3: x is row-quantized (fp8.quantize_rows),
//                                     its rows dequantize_rows(x, x_scales) (each value times its 1 x 128 tile's
//                                     scale, one float32 product: DequantizeE4m3), and C is a positive multiple of
//                                     kRowsE4m3Channels = 256 (the CUDA kernel's item: 32 lanes of 8 values).
//   jmo_swiglu_backward_fp8(aq [M, 2F] e4m3, a_s [M, 2F/128] f32, dh [M, F] f32 or bf16, group_sizes [G] s32)
//       -> da_q [M, 2F] e4m3, da_s [M, 2F/128] f32, da_t [2F, Mp] e4m3, da_ts [Mp/128, 2F] f32,
//          h_t [F, Mp] e4m3, h_ts [Mp/128, F] f32
//                                     the FP8 recipe's SwiGLU backward: with a = dequantize_rows(aq, a_s) (the gate's
//                                     F columns, then the up projection's), h = silu(gate) * up and da = (d_gate |
//                                     d_up) its input gradient at dh (common/swiglu.h), on the rows of the groups:
//                                     (da_q, da_s) = fp8.quantize_rows(da) (1 x 128; a row past the groups: zero
//                                     values, scales 2^-126, quantize_rows of a zero row); (da_t, da_ts) and (h_t,
//                                     h_ts) = jmo_quantize_columns_fp8 of da and of h. F is a positive multiple of
//                                     128; Mp / 128 as for jmo_quantize_columns_fp8.
//   jmo_swiglu_forward_fp8(a [M, 2F] f32)
//       -> h_q [M, F] e4m3, h_s [M, F/128] f32, a_q [M, 2F] e4m3, a_s [M, 2F/128] f32
//                                     the FP8 recipe's SwiGLU forward, row by row: h = silu(gate) * up of a's gate
//                                     (its F first columns) and up (the F others) in float32 (common/swiglu.h),
//                                     (h_q, h_s) = fp8.quantize_rows(h) (GEMM2's operand) and (a_q, a_s) =
//                                     fp8.quantize_rows(a) (what the backward keeps), 1 x 128, scales not powers of
//                                     two. Every row, group sizes or not (a zero row gives zero values and scales
//                                     2^-126, as quantize_rows does). F is a positive multiple of 128.
//   jmo_quantize_weight_fp8(w [E, K, N] f32 or bf16; attributes transposed: bool, both: bool)
//       -> q [E, N, K] e4m3, s [E, N/128, K/128] f32 (transposed)
//          q [E, K, N] e4m3, s [E, K/128, N/128] f32 (not transposed)
//          q2, s2: with both, the other layout's (the same blocks, scales and bytes, transposed); else [0] each
//                                     an expert weight quantized per 128 x 128 block by the tile rules of
//                                     common/fp8_columns.h (AmaxStep over the block, ColumnTileScale, QuantizeE4m3):
//                                     transposed, fp8.quantize_weight(w) (Fp8Weight's values and scales, the blocks
//                                     of W^T); not transposed, fp8.quantize_blocks(w), bitwise
//                                     fp8.transpose_weight(fp8.quantize_weight(w)) (the dgrads' weights); with
//                                     both, both forms from the one read of w (the forward's weights and the
//                                     dgrads'). K and N are positive multiples of 128.
//
// Operands of the first three are float32 or bfloat16 (one dtype); the output is float32 or the operands' dtype
// (fp32 accumulation).
#pragma once

#include <algorithm>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

#include "common/call_signature.h"
#include "common/dtype.h"
#include "common/fp8_columns.h"
#include "xla/ffi/api/ffi.h"

namespace jmo {

// The operands and result both calls share; grouped_matmul adds its attribute. (Bindings are taken by reference:
// XLA's Binding cannot be moved, only chained.)
template <typename Binding>
auto BindGroupedOuter(Binding&& b) {
  namespace ffi = xla::ffi;
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>();
}

template <typename Binding>
auto BindGroupedMatmul(Binding&& b) {
  return BindGroupedOuter(std::move(b)).template Attr<bool>("transpose_rhs");
}

template <typename Binding>
auto BindGroupedSwiGlu(Binding&& b) {
  return BindGroupedOuter(std::move(b)).template Ret<xla::ffi::AnyBuffer>();
}

// grouped_matmul_swiglu_grad: grouped_matmul's operands and attribute, then the preactivation a as a fourth operand.
template <typename Binding>
auto BindGroupedSwiGluGrad(Binding&& b) {
  namespace ffi = xla::ffi;
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<bool>("transpose_rhs");
}

// The operands of the FP8 row GEMMs: lhs, lhs_scales, rhs, rhs_scales, group_sizes.
template <typename Binding>
auto BindFp8RowOperands(Binding&& b) {
  namespace ffi = xla::ffi;
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>();
}

// lhs, lhs_scales, rhs, rhs_scales, group_sizes -> out.
template <typename Binding>
auto BindGroupedMatmulFp8(Binding&& b) {
  return BindFp8RowOperands(std::move(b)).template Ret<xla::ffi::AnyBuffer>();
}

// The results of the SwiGLU forward: h_q, h_s, a_q, a_s.
template <typename Binding>
auto BindSwiGluForwardResults(Binding&& b) {
  namespace ffi = xla::ffi;
  return std::move(b).template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

// x, x_scales, group_sizes -> q_t, s.
template <typename Binding>
auto BindQuantizeColumnsFp8(Binding&& b) {
  namespace ffi = xla::ffi;
  return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>().template Ret<ffi::AnyBuffer>().template Ret<ffi::Buffer<ffi::F32>>();
}

struct GroupedShape {
  DType dtype;  // operands
  bool out_f32;
  int64_t M, K, N, G;
};

// Common dtype rules of both calls: the operands' dtype.
inline xla::ffi::ErrorOr<DType> CheckGroupedDtypes(const char* op, const xla::ffi::AnyBuffer& lhs,
                                                   const xla::ffi::AnyBuffer& rhs, const xla::ffi::AnyBuffer& out) {
  const auto xt = lhs.element_type();
  const std::optional<DType> dt = ComputeDTypeOf(xt);
  if (!dt || rhs.element_type() != xt)
    return xla::ffi::Unexpected(
        InvalidCall(ComputeDTypeRule(std::string(op) + ": lhs and rhs must share one dtype, " + DTypeNames(), xt)));
  if (out.element_type() != xt && out.element_type() != xla::ffi::DataType::F32)
    return xla::ffi::Unexpected(InvalidCall(std::string(op) + ": the output must be float32 or the operands' dtype"));
  return *dt;
}

inline xla::ffi::ErrorOr<GroupedShape> CheckGroupedMatmul(const xla::ffi::AnyBuffer& lhs,
                                                          const xla::ffi::AnyBuffer& rhs,
                                                          const xla::ffi::Buffer<xla::ffi::S32>& group_sizes,
                                                          const xla::ffi::AnyBuffer& out, bool transpose_rhs) {
  auto dt = CheckGroupedDtypes("grouped_matmul", lhs, rhs, out);
  if (dt.has_error()) return xla::ffi::Unexpected(dt.error());
  auto ld = lhs.dimensions(), rd = rhs.dimensions(), od = out.dimensions();
  if (ld.size() != 2 || rd.size() != 3 || od.size() != 2 || group_sizes.dimensions().size() != 1)
    return xla::ffi::Unexpected(InvalidCall("grouped_matmul: expected lhs [M, K], rhs [G, K, N], group_sizes [G]"));
  const int64_t K = ld[1], N = transpose_rhs ? rd[1] : rd[2], rhs_k = transpose_rhs ? rd[2] : rd[1];
  GroupedShape s{*dt, out.element_type() == xla::ffi::DataType::F32, ld[0], K, N, rd[0]};
  if (rhs_k != K || od[0] != s.M || od[1] != N || static_cast<int64_t>(group_sizes.element_count()) != s.G)
    return xla::ffi::Unexpected(InvalidCall("grouped_matmul: inconsistent shapes"));
  return s;
}

// N of the result is F; out_f32 is whether h is float32. keep_a: a has M rows. a is float32 or in lhs's dtype (the
// preactivation's float32 values rounded once to it).
inline xla::ffi::ErrorOr<GroupedShape> CheckGroupedSwiGlu(const xla::ffi::AnyBuffer& lhs,
                                                          const xla::ffi::AnyBuffer& rhs,
                                                          const xla::ffi::Buffer<xla::ffi::S32>& group_sizes,
                                                          const xla::ffi::AnyBuffer& h, const xla::ffi::AnyBuffer& a,
                                                          bool* keep_a) {
  const auto xt = lhs.element_type();
  const std::optional<DType> dt = ComputeDTypeOf(xt);
  if (!dt || rhs.element_type() != xt || h.element_type() != xt ||
      (a.element_type() != xla::ffi::DataType::F32 && a.element_type() != xt))
    return xla::ffi::Unexpected(InvalidCall(ComputeDTypeRule(
        "grouped_matmul_swiglu: lhs, rhs and h must share one dtype, " + DTypeNames() +
            ", and a must be float32 or that dtype", xt)));
  auto ld = lhs.dimensions(), rd = rhs.dimensions(), hd = h.dimensions(), ad = a.dimensions();
  if (ld.size() != 2 || rd.size() != 3 || hd.size() != 2 || ad.size() != 2 || group_sizes.dimensions().size() != 1)
    return xla::ffi::Unexpected(InvalidCall(
        "grouped_matmul_swiglu: expected lhs [M, K], rhs [G, K, 2F], group_sizes [G], h [M, F], a [M or 0, 2F]"));
  GroupedShape s{*dt, xt == xla::ffi::DataType::F32, ld[0], ld[1], rd[2] / 2, rd[0]};
  *keep_a = ad[0] == s.M;
  if (rd[1] != s.K || rd[2] % 2 != 0 || hd[0] != s.M || hd[1] != s.N || ad[1] != 2 * s.N ||
      (ad[0] != 0 && ad[0] != s.M) || static_cast<int64_t>(group_sizes.element_count()) != s.G)
    return xla::ffi::Unexpected(InvalidCall("grouped_matmul_swiglu: inconsistent shapes"));
  return s;
}

// N of the result is F (dh's columns); out_f32 is false (da is in the operands' dtype). a_f32: a is float32 (else in
// lhs's dtype: the preactivation kept in the compute dtype).
inline xla::ffi::ErrorOr<GroupedShape> CheckGroupedSwiGluGrad(const xla::ffi::AnyBuffer& lhs,
                                                              const xla::ffi::AnyBuffer& rhs,
                                                              const xla::ffi::Buffer<xla::ffi::S32>& group_sizes,
                                                              const xla::ffi::AnyBuffer& a,
                                                              const xla::ffi::AnyBuffer& da, bool transpose_rhs,
                                                              bool* a_f32) {
  const auto xt = lhs.element_type();
  const std::optional<DType> dt = ComputeDTypeOf(xt);
  if (!dt || rhs.element_type() != xt || da.element_type() != xt ||
      (a.element_type() != xla::ffi::DataType::F32 && a.element_type() != xt))
    return xla::ffi::Unexpected(InvalidCall(ComputeDTypeRule(
        "grouped_matmul_swiglu_grad: lhs, rhs and da must share one dtype, " + DTypeNames() +
            ", and a must be float32 or that dtype",
        xt)));
  *a_f32 = a.element_type() == xla::ffi::DataType::F32;
  auto ld = lhs.dimensions(), rd = rhs.dimensions(), pd = a.dimensions(), dd = da.dimensions();
  if (ld.size() != 2 || rd.size() != 3 || pd.size() != 2 || dd.size() != 2 || group_sizes.dimensions().size() != 1)
    return xla::ffi::Unexpected(InvalidCall("grouped_matmul_swiglu_grad: expected lhs [M, K], rhs [G, K, F] (or "
                                            "[G, F, K] transposed), group_sizes [G], a [M, 2F], da [M, 2F]"));
  const int64_t K = ld[1], F = transpose_rhs ? rd[1] : rd[2], rhs_k = transpose_rhs ? rd[2] : rd[1];
  GroupedShape s{*dt, false, ld[0], K, F, rd[0]};
  if (rhs_k != K || pd[0] != s.M || pd[1] != 2 * F || dd[0] != s.M || dd[1] != 2 * F ||
      static_cast<int64_t>(group_sizes.element_count()) != s.G)
    return xla::ffi::Unexpected(InvalidCall("grouped_matmul_swiglu_grad: inconsistent shapes"));
  return s;
}

inline xla::ffi::ErrorOr<GroupedShape> CheckGroupedOuter(const xla::ffi::AnyBuffer& lhs, const xla::ffi::AnyBuffer& rhs,
                                                         const xla::ffi::Buffer<xla::ffi::S32>& group_sizes,
                                                         const xla::ffi::AnyBuffer& out) {
  auto dt = CheckGroupedDtypes("grouped_outer", lhs, rhs, out);
  if (dt.has_error()) return xla::ffi::Unexpected(dt.error());
  auto ld = lhs.dimensions(), rd = rhs.dimensions(), od = out.dimensions();
  if (ld.size() != 2 || rd.size() != 2 || od.size() != 3 || group_sizes.dimensions().size() != 1)
    return xla::ffi::Unexpected(InvalidCall("grouped_outer: expected lhs [M, K], rhs [M, N], group_sizes [G]"));
  GroupedShape s{*dt, out.element_type() == xla::ffi::DataType::F32, ld[0], ld[1], rd[1],
                 static_cast<int64_t>(group_sizes.element_count())};
  if (rd[0] != s.M || od[0] != s.G || od[1] != s.K || od[2] != s.N)
    return xla::ffi::Unexpected(InvalidCall("grouped_outer: inconsistent shapes"));
  return s;
}

// Whether a buffer's dimensions are `want`.
template <typename Dims>
bool DimsAre(std::initializer_list<int64_t> want, const Dims& got) {
  return got.size() == want.size() && std::equal(want.begin(), want.end(), got.begin());
}

struct GroupedFp8Shape {
  bool out_f32;  // else bfloat16
  int64_t M, K, N, G;
  int64_t scales_ld;  // the row stride of lhs_scales [K/128, ld]
  bool keep_a = true;  // jmo_grouped_matmul_swiglu_fp8: a_q and a_s written (else empty: [0, 2F], [0, 2F/128])
};

// The operands of the FP8 row GEMMs (jmo_grouped_matmul_fp8, jmo_grouped_matmul_swiglu_fp8; `op` names the call in
// the errors); out_f32 is left false for the caller.
inline xla::ffi::ErrorOr<GroupedFp8Shape> CheckGroupedFp8Operands(
    const std::string& op, const xla::ffi::AnyBuffer& lhs, const xla::ffi::Buffer<xla::ffi::F32>& lhs_scales,
    const xla::ffi::AnyBuffer& rhs, const xla::ffi::Buffer<xla::ffi::F32>& rhs_scales,
    const xla::ffi::Buffer<xla::ffi::S32>& group_sizes) {
  namespace ffi = xla::ffi;
  auto fail = [&op](const std::string& why) { return ffi::Unexpected(InvalidCall(op + ": " + why)); };
  if (lhs.element_type() != ffi::DataType::F8E4M3FN || rhs.element_type() != ffi::DataType::F8E4M3FN)
    return fail("lhs and rhs must be float8_e4m3fn");
  auto ld = lhs.dimensions(), sd = lhs_scales.dimensions(), rd = rhs.dimensions(), bd = rhs_scales.dimensions();
  if (ld.size() != 2 || sd.size() != 2 || rd.size() != 3 || bd.size() != 3 || group_sizes.dimensions().size() != 1)
    return fail("expected lhs [M, K], lhs_scales [K/128, ld], rhs [G, N, K], rhs_scales [G, N/128, K/128], "
                "group_sizes [G]");
  GroupedFp8Shape s{false, ld[0], ld[1], rd[1], rd[0], sd[1]};
  if (std::optional<std::string> why = Fp8RowOperandsRefusal(s.M, s.K, s.N, s.G, sd, bd, "M", "G", "rhs_scales"))
    return fail(*why);
  if (rd[2] != s.K || static_cast<int64_t>(group_sizes.element_count()) != s.G) return fail("inconsistent shapes");
  return s;
}

inline xla::ffi::ErrorOr<GroupedFp8Shape> CheckGroupedMatmulFp8(
    const xla::ffi::AnyBuffer& lhs, const xla::ffi::Buffer<xla::ffi::F32>& lhs_scales, const xla::ffi::AnyBuffer& rhs,
    const xla::ffi::Buffer<xla::ffi::F32>& rhs_scales, const xla::ffi::Buffer<xla::ffi::S32>& group_sizes,
    const xla::ffi::AnyBuffer& out) {
  namespace ffi = xla::ffi;
  auto fail = [](const std::string& why) { return ffi::Unexpected(InvalidCall("grouped_matmul_fp8: " + why)); };
  if (out.element_type() != ffi::DataType::F32 && out.element_type() != ffi::DataType::BF16)
    return fail("the output must be float32 or bfloat16");
  auto s = CheckGroupedFp8Operands("grouped_matmul_fp8", lhs, lhs_scales, rhs, rhs_scales, group_sizes);
  if (s.has_error()) return s;
  s->out_f32 = out.element_type() == ffi::DataType::F32;
  if (!DimsAre({s->M, s->N}, out.dimensions())) return fail("inconsistent shapes: out must be [M, N]");
  return s;
}

// jmo_grouped_matmul_swiglu_fp8: lhs, lhs_scales, rhs, rhs_scales, group_sizes -> h_q, h_s, a_q, a_s.
template <typename Binding>
auto BindGroupedMatmulSwiGluFp8(Binding&& b) {
  return BindSwiGluForwardResults(BindFp8RowOperands(std::move(b)));
}

// N of the shape is 2F (rhs [G, 2F, K]); F a positive multiple of 128.
inline xla::ffi::ErrorOr<GroupedFp8Shape> CheckGroupedMatmulSwiGluFp8(
    const xla::ffi::AnyBuffer& lhs, const xla::ffi::Buffer<xla::ffi::F32>& lhs_scales, const xla::ffi::AnyBuffer& rhs,
    const xla::ffi::Buffer<xla::ffi::F32>& rhs_scales, const xla::ffi::Buffer<xla::ffi::S32>& group_sizes,
    const xla::ffi::AnyBuffer& h_q, const xla::ffi::Buffer<xla::ffi::F32>& h_s, const xla::ffi::AnyBuffer& a_q,
    const xla::ffi::Buffer<xla::ffi::F32>& a_s) {
  namespace ffi = xla::ffi;
  auto fail = [](const std::string& why) {
    return ffi::Unexpected(InvalidCall("grouped_matmul_swiglu_fp8: " + why));
  };
  auto s = CheckGroupedFp8Operands("grouped_matmul_swiglu_fp8", lhs, lhs_scales, rhs, rhs_scales, group_sizes);
  if (s.has_error()) return s;
  s->out_f32 = true;  // a's accumulators (not an output)
  const int64_t M = s->M, F = s->N / 2;
  if (s->N % (2 * kFp8Tile) != 0)
    return fail("F (half of rhs's " + std::to_string(s->N) + " rows) must be a positive multiple of 128");
  if (h_q.element_type() != ffi::DataType::F8E4M3FN || a_q.element_type() != ffi::DataType::F8E4M3FN)
    return fail("h_q and a_q must be float8_e4m3fn");
  // a (the backward's) not kept: a_q [0, 2F] and a_s [0, 2F/128], neither written.
  s->keep_a = !(DimsAre({0, 2 * F}, a_q.dimensions()) && DimsAre({0, 2 * F / kFp8Tile}, a_s.dimensions()));
  if (!DimsAre({M, F}, h_q.dimensions()) || !DimsAre({M, F / kFp8Tile}, h_s.dimensions()) ||
      (s->keep_a && (!DimsAre({M, 2 * F}, a_q.dimensions()) || !DimsAre({M, 2 * F / kFp8Tile}, a_s.dimensions()))))
    return fail("inconsistent results: expected h_q [M, F], h_s [M, F/128], a_q [M, 2F], a_s [M, 2F/128] (or both "
                "[0, ...]: a not kept) for M=" + std::to_string(M) + ", F=" + std::to_string(F));
  return s;
}

struct GroupedOuterFp8Shape {
  bool out_f32;  // else bfloat16
  int64_t Mp, K, N, G;
  int64_t lhs_ld, rhs_ld;  // the row strides of lhs_scales and rhs_scales [Mp/128, ld]
};

// jmo_grouped_outer_fp8's operands bind like jmo_grouped_matmul_fp8's (BindGroupedMatmulFp8).
inline xla::ffi::ErrorOr<GroupedOuterFp8Shape> CheckGroupedOuterFp8(
    const xla::ffi::AnyBuffer& lhs_t, const xla::ffi::Buffer<xla::ffi::F32>& lhs_scales,
    const xla::ffi::AnyBuffer& rhs_t, const xla::ffi::Buffer<xla::ffi::F32>& rhs_scales,
    const xla::ffi::Buffer<xla::ffi::S32>& group_sizes, const xla::ffi::AnyBuffer& out) {
  namespace ffi = xla::ffi;
  auto fail = [](const std::string& why) { return ffi::Unexpected(InvalidCall("grouped_outer_fp8: " + why)); };
  if (lhs_t.element_type() != ffi::DataType::F8E4M3FN || rhs_t.element_type() != ffi::DataType::F8E4M3FN)
    return fail("lhs_t and rhs_t must be float8_e4m3fn");
  if (out.element_type() != ffi::DataType::F32 && out.element_type() != ffi::DataType::BF16)
    return fail("the output must be float32 or bfloat16");
  auto ld = lhs_t.dimensions(), sd = lhs_scales.dimensions(), rd = rhs_t.dimensions(), bd = rhs_scales.dimensions(),
       od = out.dimensions();
  if (ld.size() != 2 || sd.size() != 2 || rd.size() != 2 || bd.size() != 2 || od.size() != 3 ||
      group_sizes.dimensions().size() != 1)
    return fail("expected lhs_t [K, Mp], lhs_scales [Mp/128, lda], rhs_t [N, Mp], rhs_scales [Mp/128, ldb], "
                "group_sizes [G]");
  GroupedOuterFp8Shape s{out.element_type() == ffi::DataType::F32, ld[1], ld[0], rd[0], od[0], sd[1], bd[1]};
  if (s.Mp < kFp8Tile || s.Mp % kFp8Tile != 0 || s.K < kFp8Tile || s.K % kFp8Tile != 0 || s.N < kFp8Tile ||
      s.N % kFp8Tile != 0)
    return fail("Mp (the padded rows), K and N must be positive multiples of 128 (whole 128 x 1 tiles), got Mp=" +
                std::to_string(s.Mp) + ", K=" + std::to_string(s.K) + ", N=" + std::to_string(s.N));
  if (rd[1] != s.Mp || sd[0] != s.Mp / kFp8Tile || bd[0] != s.Mp / kFp8Tile || od[1] != s.K || od[2] != s.N ||
      static_cast<int64_t>(group_sizes.element_count()) != s.G)
    return fail("inconsistent shapes");
  if (s.lhs_ld < s.K || s.lhs_ld % 4 != 0 || s.rhs_ld < s.N || s.rhs_ld % 4 != 0)
    return fail("lhs_scales [Mp/128, lda] and rhs_scales [Mp/128, ldb] need lda >= K, ldb >= N, both multiples of 4 "
                "(16-byte rows), got lda=" + std::to_string(s.lhs_ld) + ", ldb=" + std::to_string(s.rhs_ld));
  return s;
}

// Empty where `tiles` column tiles (Mp / 128) hold M rows in G groups (ColumnTilesNeeded), else why not.
inline std::string ColumnTilesShortfall(int64_t tiles, int64_t M, int64_t G) {
  const int64_t need = ColumnTilesNeeded(M, G);
  if (tiles >= need) return "";
  return std::to_string(tiles) + " tiles (Mp / 128) cannot hold " + std::to_string(M) + " rows in " +
         std::to_string(G) + " groups: need ceil(M / 128) + G = " + std::to_string(need);
}

struct QuantizeColumnsShape {
  bool rows_e4m3;  // x row-quantized (e4m3 values, x_scales their 1 x 128 scales)
  DType dtype;     // x's when not rows_e4m3 (then unread)
  int64_t M, C, G;
  int64_t tiles;  // Mp / 128
};

inline xla::ffi::ErrorOr<QuantizeColumnsShape> CheckQuantizeColumnsFp8(
    const xla::ffi::AnyBuffer& x, const xla::ffi::Buffer<xla::ffi::F32>& x_scales,
    const xla::ffi::Buffer<xla::ffi::S32>& group_sizes, const xla::ffi::AnyBuffer& q_t,
    const xla::ffi::Buffer<xla::ffi::F32>& s) {
  namespace ffi = xla::ffi;
  auto fail = [](const std::string& why) { return ffi::Unexpected(InvalidCall("quantize_columns_fp8: " + why)); };
  const bool rows_e4m3 = x.element_type() == ffi::DataType::F8E4M3FN;
  const std::optional<DType> dt = ComputeDTypeOf(x.element_type());
  if (!rows_e4m3 && !dt)
    return fail(ComputeDTypeRule("x must be float8_e4m3fn (row-quantized) or " + DTypeNames(), x.element_type()));
  if (q_t.element_type() != ffi::DataType::F8E4M3FN) return fail("q_t must be float8_e4m3fn");
  auto xd = x.dimensions(), xsd = x_scales.dimensions(), qd = q_t.dimensions(), sd = s.dimensions();
  if (xd.size() != 2 || xsd.size() != 2 || qd.size() != 2 || sd.size() != 2 || group_sizes.dimensions().size() != 1)
    return fail("expected x [M, C], x_scales [M, C/128] or [M, 0], group_sizes [G], q_t [C, Mp], s [Mp/128, C]");
  QuantizeColumnsShape r{rows_e4m3, dt.value_or(DType::kF32), xd[0], xd[1],
                         static_cast<int64_t>(group_sizes.element_count()), sd[0]};
  if (r.C < kFp8Tile || r.C % kFp8Tile != 0)
    return fail("C (x's channels) must be a positive multiple of 128, got " + std::to_string(r.C));
  if (rows_e4m3 && r.C % kRowsE4m3Channels != 0)
    return fail("C (x's channels) must be a multiple of " + std::to_string(kRowsE4m3Channels) +
                " when x is row-quantized (e4m3), got " + std::to_string(r.C));
  if (xsd[0] != r.M || xsd[1] != (rows_e4m3 ? r.C / kFp8Tile : 0))
    return fail("x_scales must be [M, C/128] when x is e4m3 and [M, 0] otherwise: x " + DimsText(xd) +
                ", x_scales " + DimsText(xsd));
  if (qd[0] != r.C || qd[1] != kFp8Tile * r.tiles || sd[1] != r.C)
    return fail("inconsistent shapes: x " + DimsText(xd) + ", q_t " + DimsText(qd) + ", s " + DimsText(sd));
  if (const std::string why = ColumnTilesShortfall(r.tiles, r.M, r.G); !why.empty()) return fail(why);
  return r;
}

// jmo_swiglu_backward_fp8: aq, a_s, dh, group_sizes -> da_q, da_s, da_t, da_ts, h_t, h_ts.
template <typename Binding>
auto BindSwiGluBackwardFp8(Binding&& b) {
  namespace ffi = xla::ffi;
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

struct SwiGluBackwardShape {
  int64_t M, F, G;
  int64_t tiles;  // Mp / 128
  bool dh_bf16;   // dh in bfloat16 (the compute dtype's dgrad), else float32
};

inline xla::ffi::ErrorOr<SwiGluBackwardShape> CheckSwiGluBackwardFp8(
    const xla::ffi::AnyBuffer& aq, const xla::ffi::Buffer<xla::ffi::F32>& a_s,
    const xla::ffi::AnyBuffer& dh, const xla::ffi::Buffer<xla::ffi::S32>& group_sizes,
    const xla::ffi::AnyBuffer& da_q, const xla::ffi::Buffer<xla::ffi::F32>& da_s, const xla::ffi::AnyBuffer& da_t,
    const xla::ffi::Buffer<xla::ffi::F32>& da_ts, const xla::ffi::AnyBuffer& h_t,
    const xla::ffi::Buffer<xla::ffi::F32>& h_ts) {
  namespace ffi = xla::ffi;
  auto fail = [](const std::string& why) { return ffi::Unexpected(InvalidCall("swiglu_backward_fp8: " + why)); };
  for (const ffi::AnyBuffer* b : {&aq, &da_q, &da_t, &h_t})
    if (b->element_type() != ffi::DataType::F8E4M3FN) return fail("aq, da_q, da_t and h_t must be float8_e4m3fn");
  auto ad = aq.dimensions(), asd = a_s.dimensions(), dd = dh.dimensions();
  if (ad.size() != 2 || asd.size() != 2 || dd.size() != 2 || group_sizes.dimensions().size() != 1)
    return fail("expected aq [M, 2F], a_s [M, 2F/128], dh [M, F], group_sizes [G]");
  if (h_ts.dimensions().size() != 2) return fail("expected h_ts [Mp/128, F]");
  if (dh.element_type() != ffi::DataType::F32 && dh.element_type() != ffi::DataType::BF16)
    return fail("dh must be float32 or bfloat16");
  SwiGluBackwardShape r{dd[0], dd[1], static_cast<int64_t>(group_sizes.element_count()), h_ts.dimensions()[0],
                        dh.element_type() == ffi::DataType::BF16};
  if (r.F < kFp8Tile || r.F % kFp8Tile != 0)
    return fail("F (dh's channels, half of aq's) must be a positive multiple of 128, got " + std::to_string(r.F));
  const int64_t C = 2 * r.F, Mp = kFp8Tile * r.tiles;
  if (!DimsAre({r.M, C}, ad) || !DimsAre({r.M, C / kFp8Tile}, asd))
    return fail("inconsistent operands: aq " + DimsText(ad) + ", a_s " + DimsText(asd) + ", dh " + DimsText(dd) +
                " (aq [M, 2F], a_s [M, 2F/128], dh [M, F])");
  if (!DimsAre({r.M, C}, da_q.dimensions()) || !DimsAre({r.M, C / kFp8Tile}, da_s.dimensions()) ||
      !DimsAre({C, Mp}, da_t.dimensions()) || !DimsAre({r.tiles, C}, da_ts.dimensions()) ||
      !DimsAre({r.F, Mp}, h_t.dimensions()) || !DimsAre({r.tiles, r.F}, h_ts.dimensions()))
    return fail("inconsistent results: expected da_q [M, 2F], da_s [M, 2F/128], da_t [2F, Mp], da_ts [Mp/128, 2F], "
                "h_t [F, Mp], h_ts [Mp/128, F] for M=" + std::to_string(r.M) + ", F=" + std::to_string(r.F) +
                ", Mp/128=" + std::to_string(r.tiles));
  if (const std::string why = ColumnTilesShortfall(r.tiles, r.M, r.G); !why.empty()) return fail(why);
  return r;
}

// jmo_swiglu_forward_fp8: a -> h_q, h_s, a_q, a_s.
template <typename Binding>
auto BindSwiGluForwardFp8(Binding&& b) {
  return BindSwiGluForwardResults(std::move(b).template Arg<xla::ffi::AnyBuffer>());
}

struct SwiGluForwardShape {
  int64_t M, F;
};

inline xla::ffi::ErrorOr<SwiGluForwardShape> CheckSwiGluForwardFp8(
    const xla::ffi::AnyBuffer& a, const xla::ffi::AnyBuffer& h_q, const xla::ffi::Buffer<xla::ffi::F32>& h_s,
    const xla::ffi::AnyBuffer& a_q, const xla::ffi::Buffer<xla::ffi::F32>& a_s) {
  namespace ffi = xla::ffi;
  auto fail = [](const std::string& why) { return ffi::Unexpected(InvalidCall("swiglu_forward_fp8: " + why)); };
  if (a.element_type() != ffi::DataType::F32) return fail("a must be float32");
  if (h_q.element_type() != ffi::DataType::F8E4M3FN || a_q.element_type() != ffi::DataType::F8E4M3FN)
    return fail("h_q and a_q must be float8_e4m3fn");
  auto ad = a.dimensions();
  if (ad.size() != 2) return fail("expected a [M, 2F], got " + DimsText(ad));
  SwiGluForwardShape r{ad[0], ad[1] / 2};
  if (ad[1] % (2 * kFp8Tile) != 0 || r.F == 0)
    return fail("F (half of a's " + std::to_string(ad[1]) + " channels) must be a positive multiple of 128");
  if (!DimsAre({r.M, r.F}, h_q.dimensions()) || !DimsAre({r.M, r.F / kFp8Tile}, h_s.dimensions()) ||
      !DimsAre({r.M, 2 * r.F}, a_q.dimensions()) || !DimsAre({r.M, 2 * r.F / kFp8Tile}, a_s.dimensions()))
    return fail("inconsistent results: expected h_q [M, F], h_s [M, F/128], a_q [M, 2F], a_s [M, 2F/128] for M=" +
                std::to_string(r.M) + ", F=" + std::to_string(r.F));
  return r;
}

// jmo_quantize_weight_fp8: w -> q, s, q2, s2; attributes transposed, both.
template <typename Binding>
auto BindQuantizeWeightFp8(Binding&& b) {
  namespace ffi = xla::ffi;
  return std::move(b).template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<bool>("transposed")
      .template Attr<bool>("both");
}

struct QuantizeWeightShape {
  DType dtype;  // w's
  int64_t E, K, N;
};

inline xla::ffi::ErrorOr<QuantizeWeightShape> CheckQuantizeWeightFp8(const xla::ffi::AnyBuffer& w,
                                                                     const xla::ffi::AnyBuffer& q,
                                                                     const xla::ffi::Buffer<xla::ffi::F32>& s,
                                                                     const xla::ffi::AnyBuffer& q2,
                                                                     const xla::ffi::Buffer<xla::ffi::F32>& s2,
                                                                     bool transposed, bool both) {
  namespace ffi = xla::ffi;
  auto fail = [](const std::string& why) { return ffi::Unexpected(InvalidCall("quantize_weight_fp8: " + why)); };
  const std::optional<DType> dt = ComputeDTypeOf(w.element_type());
  if (!dt) return fail(ComputeDTypeRule("w must be " + DTypeNames(), w.element_type()));
  if (q.element_type() != ffi::DataType::F8E4M3FN || q2.element_type() != ffi::DataType::F8E4M3FN)
    return fail("q and q2 must be float8_e4m3fn");
  auto wd = w.dimensions();
  if (wd.size() != 3) return fail("expected w [E, K, N], got " + DimsText(wd));
  QuantizeWeightShape r{*dt, wd[0], wd[1], wd[2]};
  if (r.K < kFp8Tile || r.K % kFp8Tile != 0 || r.N < kFp8Tile || r.N % kFp8Tile != 0)
    return fail("K and N (w's last two axes) must be positive multiples of 128 (whole 128 x 128 blocks), got K=" +
                std::to_string(r.K) + ", N=" + std::to_string(r.N));
  const int64_t rows = transposed ? r.N : r.K, cols = transposed ? r.K : r.N;
  auto layout = [](bool t) {
    return std::string(t ? "[E, N, K], s [E, N/128, K/128]" : "[E, K, N], s [E, K/128, N/128]");
  };
  if (!DimsAre({r.E, rows, cols}, q.dimensions()) ||
      !DimsAre({r.E, rows / kFp8Tile, cols / kFp8Tile}, s.dimensions()))
    return fail("inconsistent results: expected q " + layout(transposed) + " for w " + DimsText(wd) + ", got q " +
                DimsText(q.dimensions()) + ", s " + DimsText(s.dimensions()));
  // The second pair: the other layout with both, else empty ([0] each).
  if (both ? !DimsAre({r.E, cols, rows}, q2.dimensions()) ||
                 !DimsAre({r.E, cols / kFp8Tile, rows / kFp8Tile}, s2.dimensions())
           : !DimsAre({0}, q2.dimensions()) || !DimsAre({0}, s2.dimensions()))
    return fail("inconsistent results: expected q2 " + (both ? layout(!transposed) : std::string("[0], s2 [0]")) +
                " for w " + DimsText(wd) + (both ? "" : " without both") + ", got q2 " + DimsText(q2.dimensions()) +
                ", s2 " + DimsText(s2.dimensions()));
  return r;
}

}  // namespace jmo
