// XLA:CPU handlers of the bare grouped GEMMs (ffi/common/grouped_gemm_signature.h): plain loops with float32
// accumulation, the executable specification of ffi/cuda/ops/grouped_gemm.cu. The group sizes are host data here, so
// invalid ones (negative, or more rows than lhs has) are reported instead of clipped as on the device.
#include <algorithm>
#include <string>
#include <vector>

#include "common/grouped_gemm_signature.h"
#include "common/dtype.h"
#include "cpu/gemm_rows.h"
#include "cpu/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jmo::cpu {
namespace {

// Row offsets of the groups; an error names the first invalid group.
ffi::ErrorOr<std::vector<int64_t>> RowOffsets(const char* op, const ffi::Buffer<ffi::S32>& sizes, int64_t M) {
  std::vector<int64_t> off(sizes.element_count() + 1, 0);
  for (int64_t g = 0; g < sizes.element_count(); ++g) {
    const int64_t n = sizes.typed_data()[g];
    if (n < 0 || off[g] + n > M)
      return ffi::Unexpected(InvalidCall(std::string(op) + ": group " + std::to_string(g) + " has " +
                                         std::to_string(n) + " rows; group sizes must be >= 0 and sum to at most " +
                                         std::to_string(M) + " (the rows of lhs)"));
    off[g + 1] = off[g] + n;
  }
  return off;
}

ffi::Error GroupedMatmulImpl(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> group_sizes,
                             ffi::Result<ffi::AnyBuffer> out, bool transpose_rhs) {
  auto shape = CheckGroupedMatmul(lhs, rhs, group_sizes, *out, transpose_rhs);
  if (shape.has_error()) return shape.error();
  const int64_t M = shape->M, K = shape->K, N = shape->N;
  auto off = RowOffsets("grouped_matmul", group_sizes, M);
  if (off.has_error()) return off.error();
  const bool bf16 = shape->dtype == DType::kBF16, out_bf16 = !shape->out_f32;
  const ElemView a{lhs.untyped_data(), bf16}, b{rhs.untyped_data(), bf16};
  void* o = out->untyped_data();
  std::vector<float> acc(N);
  for (int64_t g = 0; g < shape->G; ++g)
    MatmulRows(a, b, g * K * N, (*off)[g], (*off)[g + 1], K, N, transpose_rhs, o, out_bf16, acc);
  for (int64_t i = off->back() * N; i < M * N; ++i) StoreElem(o, out_bf16, i, 0.f);
  return ffi::Error::Success();
}

ffi::Error GroupedOuterImpl(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> group_sizes,
                            ffi::Result<ffi::AnyBuffer> out) {
  auto shape = CheckGroupedOuter(lhs, rhs, group_sizes, *out);
  if (shape.has_error()) return shape.error();
  const int64_t M = shape->M, K = shape->K, N = shape->N;
  auto off = RowOffsets("grouped_outer", group_sizes, M);
  if (off.has_error()) return off.error();
  const bool bf16 = shape->dtype == DType::kBF16, out_bf16 = !shape->out_f32;
  const ElemView a{lhs.untyped_data(), bf16}, b{rhs.untyped_data(), bf16};
  std::vector<float> acc(K * N);
  for (int64_t g = 0; g < shape->G; ++g) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t r = (*off)[g]; r < (*off)[g + 1]; ++r)
      for (int64_t k = 0; k < K; ++k) {
        const float x = a[r * K + k];
        for (int64_t n = 0; n < N; ++n) acc[k * N + n] += x * b[r * N + n];
      }
    for (int64_t i = 0; i < K * N; ++i) StoreElem(out->untyped_data(), out_bf16, g * K * N + i, acc[i]);
  }
  return ffi::Error::Success();
}

ffi::Error GroupedMatmulSwiGluImpl(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> group_sizes,
                                   ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::AnyBuffer> a) {
  bool keep_a = false;
  auto shape = CheckGroupedSwiGlu(lhs, rhs, group_sizes, *h, *a, &keep_a);
  if (shape.has_error()) return shape.error();
  const int64_t M = shape->M, K = shape->K, F = shape->N;
  auto off = RowOffsets("grouped_matmul_swiglu", group_sizes, M);
  if (off.has_error()) return off.error();
  const bool bf16 = shape->dtype == DType::kBF16;
  const ElemView x{lhs.untyped_data(), bf16}, w{rhs.untyped_data(), bf16};
  // The preactivation in float32 (into a, or scratch when a is not kept), then the SwiGLU in float32.
  std::vector<float> scratch(keep_a ? 0 : M * 2 * F), acc;
  float* pre = keep_a ? static_cast<float*>(a->untyped_data()) : scratch.data();
  for (int64_t g = 0; g < shape->G; ++g)
    MatmulRows(x, w, g * K * 2 * F, (*off)[g], (*off)[g + 1], K, 2 * F, false, pre, false, acc);
  SwiGluRows(pre, 0, off->back(), F, h->untyped_data(), bf16);
  for (int64_t i = off->back() * F; i < M * F; ++i) StoreElem(h->untyped_data(), bf16, i, 0.f);
  if (keep_a) std::fill(pre + off->back() * 2 * F, pre + M * 2 * F, 0.f);
  return ffi::Error::Success();
}

ffi::Error GroupedMatmulSwiGluGradImpl(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> group_sizes,
                                       ffi::Buffer<ffi::F32> a, ffi::Result<ffi::AnyBuffer> da, bool transpose_rhs) {
  auto shape = CheckGroupedSwiGluGrad(lhs, rhs, group_sizes, a, *da, transpose_rhs);
  if (shape.has_error()) return shape.error();
  const int64_t M = shape->M, K = shape->K, F = shape->N;
  auto off = RowOffsets("grouped_matmul_swiglu_grad", group_sizes, M);
  if (off.has_error()) return off.error();
  const bool bf16 = shape->dtype == DType::kBF16;
  const ElemView x{lhs.untyped_data(), bf16}, w{rhs.untyped_data(), bf16};
  // dh in float32 scratch (the CUDA kernel keeps it in registers), then the SwiGLU's gradient from it.
  std::vector<float> dh(off->back() * F), acc;
  for (int64_t g = 0; g < shape->G; ++g)
    MatmulRows(x, w, g * K * F, (*off)[g], (*off)[g + 1], K, F, transpose_rhs, dh.data(), false, acc);
  SwiGluGradRows(dh.data(), a.typed_data(), 0, off->back(), F, da->untyped_data(), bf16);
  for (int64_t i = off->back() * 2 * F; i < M * 2 * F; ++i) StoreElem(da->untyped_data(), bf16, i, 0.f);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jmo::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoGroupedMatmulCpu, jmo::cpu::GroupedMatmulImpl,
                              jmo::BindGroupedMatmul(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoGroupedOuterCpu, jmo::cpu::GroupedOuterImpl, jmo::BindGroupedOuter(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoGroupedMatmulSwiGluCpu, jmo::cpu::GroupedMatmulSwiGluImpl,
                              jmo::BindGroupedSwiGlu(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoGroupedMatmulSwiGluGradCpu, jmo::cpu::GroupedMatmulSwiGluGradImpl,
                              jmo::BindGroupedSwiGluGrad(ffi::Ffi::Bind()));
