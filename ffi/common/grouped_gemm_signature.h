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
//                                  a [M, 2F] f32)
//       -> da [M, 2F]                 dh = lhs[r] @ rhs[g(r)] in float32 (not an output), da = the input gradient of
//                                     silu(a[:, :F]) * a[:, F:] at dh (d_gate | d_up) in lhs's dtype; rows past the
//                                     groups are 0
//
// Operands are float32 or bfloat16 (one dtype); the output is float32 or the operands' dtype (fp32 accumulation).
#pragma once

#include <optional>
#include <string>
#include <utility>

#include "common/call_signature.h"
#include "common/dtype.h"
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
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<bool>("transpose_rhs");
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
  const std::optional<DType> dt = DTypeOf(xt);
  if (!dt || rhs.element_type() != xt)
    return xla::ffi::Unexpected(InvalidCall(std::string(op) + ": lhs and rhs must share one dtype, " + DTypeNames()));
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

// N of the result is F; out_f32 is whether h is float32. keep_a: a has M rows.
inline xla::ffi::ErrorOr<GroupedShape> CheckGroupedSwiGlu(const xla::ffi::AnyBuffer& lhs,
                                                          const xla::ffi::AnyBuffer& rhs,
                                                          const xla::ffi::Buffer<xla::ffi::S32>& group_sizes,
                                                          const xla::ffi::AnyBuffer& h, const xla::ffi::AnyBuffer& a,
                                                          bool* keep_a) {
  const auto xt = lhs.element_type();
  const std::optional<DType> dt = DTypeOf(xt);
  if (!dt || rhs.element_type() != xt || h.element_type() != xt || a.element_type() != xla::ffi::DataType::F32)
    return xla::ffi::Unexpected(InvalidCall("grouped_matmul_swiglu: lhs, rhs and h must share one dtype, " +
                                            DTypeNames() + ", and a must be float32"));
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

// N of the result is F (dh's columns); out_f32 is false (da is in the operands' dtype).
inline xla::ffi::ErrorOr<GroupedShape> CheckGroupedSwiGluGrad(const xla::ffi::AnyBuffer& lhs,
                                                              const xla::ffi::AnyBuffer& rhs,
                                                              const xla::ffi::Buffer<xla::ffi::S32>& group_sizes,
                                                              const xla::ffi::Buffer<xla::ffi::F32>& a,
                                                              const xla::ffi::AnyBuffer& da, bool transpose_rhs) {
  const auto xt = lhs.element_type();
  const std::optional<DType> dt = DTypeOf(xt);
  if (!dt || rhs.element_type() != xt || da.element_type() != xt)
    return xla::ffi::Unexpected(InvalidCall("grouped_matmul_swiglu_grad: lhs, rhs and da must share one dtype, " +
                                            DTypeNames() + ", and a must be float32"));
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

}  // namespace jmo
