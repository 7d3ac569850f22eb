// XLA:CPU handlers of the bare grouped GEMMs (ffi/common/grouped_gemm_signature.h): plain loops with float32
// accumulation, the executable specification of ffi/cuda/ops/grouped_gemm.cu. The group sizes are host data here, so
// invalid ones (negative, or more rows than lhs has) are reported instead of clipped as on the device.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/grouped_gemm_signature.h"
#include "common/dtype.h"
#include "common/e4m3.h"
#include "cpu/fp8_gemm_rows.h"
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
  // The preactivation in float32 (into a when a is kept in float32, else scratch), then the SwiGLU in float32; a kept
  // in bf16 is the float32 preactivation rounded once.
  const bool a_f32 = keep_a && a->element_type() == ffi::DataType::F32;
  std::vector<float> scratch(a_f32 ? 0 : M * 2 * F), acc;
  float* pre = a_f32 ? static_cast<float*>(a->untyped_data()) : scratch.data();
  for (int64_t g = 0; g < shape->G; ++g)
    MatmulRows(x, w, g * K * 2 * F, (*off)[g], (*off)[g + 1], K, 2 * F, false, pre, false, acc);
  SwiGluRows(pre, 0, off->back(), F, h->untyped_data(), bf16);
  for (int64_t i = off->back() * F; i < M * F; ++i) StoreElem(h->untyped_data(), bf16, i, 0.f);
  if (keep_a && !a_f32)  // (a in lhs's dtype: CheckGroupedSwiGlu)
    for (int64_t i = 0; i < off->back() * 2 * F; ++i) StoreElem(a->untyped_data(), bf16, i, pre[i]);
  if (keep_a)
    for (int64_t i = off->back() * 2 * F; i < M * 2 * F; ++i) StoreElem(a->untyped_data(), !a_f32 && bf16, i, 0.f);
  return ffi::Error::Success();
}

ffi::Error GroupedMatmulSwiGluGradImpl(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> group_sizes,
                                       ffi::AnyBuffer a, ffi::Result<ffi::AnyBuffer> da, bool transpose_rhs) {
  bool a_f32 = true;
  auto shape = CheckGroupedSwiGluGrad(lhs, rhs, group_sizes, a, *da, transpose_rhs, &a_f32);
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
  // a not float32 is lhs's dtype, then bf16 (CheckGroupedSwiGluGrad), each value taken to float32.
  SwiGluGradRows(dh.data(), ElemView{a.untyped_data(), !a_f32}, 0, off->back(), F, da->untyped_data(), bf16);
  for (int64_t i = off->back() * 2 * F; i < M * 2 * F; ++i) StoreElem(da->untyped_data(), bf16, i, 0.f);
  return ffi::Error::Success();
}

// The FP8 block-scaled grouped GEMM (grouped_gemm_signature.h): the emulation of what the Hopper kernel
// (ffi/cuda/gemm/sm90/wgmma_grouped_fp8.cuh) computes, up to the tensor core's accumulation inside a chunk
// (MatmulFp8Rows, cpu/fp8_gemm_rows.h, states it); rows past the groups are zero. The kernel matches it within what
// the in-chunk accumulation differs by (tests/gpu/test_gpu_grouped_gemm_fp8.py).
ffi::Error GroupedMatmulFp8Impl(ffi::AnyBuffer lhs, ffi::Buffer<ffi::F32> lhs_scales, ffi::AnyBuffer rhs,
                                ffi::Buffer<ffi::F32> rhs_scales, ffi::Buffer<ffi::S32> group_sizes,
                                ffi::Result<ffi::AnyBuffer> out) {
  auto shape = CheckGroupedMatmulFp8(lhs, lhs_scales, rhs, rhs_scales, group_sizes, *out);
  if (shape.has_error()) return shape.error();
  const int64_t M = shape->M, N = shape->N;
  auto off = RowOffsets("grouped_matmul_fp8", group_sizes, M);
  if (off.has_error()) return off.error();
  void* o = out->untyped_data();
  const bool out_bf16 = !shape->out_f32;
  const Fp8Lhs lhs_rows = Fp8Lhs::MnMajor(static_cast<const uint8_t*>(lhs.untyped_data()), shape->K,
                                          lhs_scales.typed_data(), shape->scales_ld);
  MatmulFp8Rows(lhs_rows, static_cast<const uint8_t*>(rhs.untyped_data()), rhs_scales.typed_data(), *off, shape->K, N,
                o, out_bf16);
  for (int64_t i = off->back() * N; i < M * N; ++i) StoreElem(o, out_bf16, i, 0.f);
  return ffi::Error::Success();
}

// GEMM1 of the FP8 recipe with its SwiGLU forward (grouped_gemm_signature.h): grouped_matmul_fp8's float32 rows (zero
// past the groups) in scratch, then swiglu_forward_fp8's loop over them (cpu/fp8_gemm_rows.h): the two calls' bits.
ffi::Error GroupedMatmulSwiGluFp8Impl(ffi::AnyBuffer lhs, ffi::Buffer<ffi::F32> lhs_scales, ffi::AnyBuffer rhs,
                                      ffi::Buffer<ffi::F32> rhs_scales, ffi::Buffer<ffi::S32> group_sizes,
                                      ffi::Result<ffi::AnyBuffer> h_q, ffi::Result<ffi::Buffer<ffi::F32>> h_s,
                                      ffi::Result<ffi::AnyBuffer> a_q, ffi::Result<ffi::Buffer<ffi::F32>> a_s) {
  auto shape = CheckGroupedMatmulSwiGluFp8(lhs, lhs_scales, rhs, rhs_scales, group_sizes, *h_q, *h_s, *a_q, *a_s);
  if (shape.has_error()) return shape.error();
  const int64_t M = shape->M, N = shape->N;
  auto off = RowOffsets("grouped_matmul_swiglu_fp8", group_sizes, M);
  if (off.has_error()) return off.error();
  std::vector<float> a(M * N, 0.f);
  const Fp8Lhs lhs_rows = Fp8Lhs::MnMajor(static_cast<const uint8_t*>(lhs.untyped_data()), shape->K,
                                          lhs_scales.typed_data(), shape->scales_ld);
  MatmulFp8Rows(lhs_rows, static_cast<const uint8_t*>(rhs.untyped_data()), rhs_scales.typed_data(), *off, shape->K, N,
                a.data(), false);
  SwiGluForwardFp8Rows(a.data(), M, N / 2, static_cast<uint8_t*>(h_q->untyped_data()), h_s->typed_data(),
                       shape->keep_a ? static_cast<uint8_t*>(a_q->untyped_data()) : nullptr,
                       shape->keep_a ? a_s->typed_data() : nullptr);
  return ffi::Error::Success();
}

// The FP8 weight-gradient GEMM (grouped_gemm_signature.h): the emulation of the Hopper kernel
// (ffi/cuda/gemm/sm90/wgmma_outer_fp8.cuh) in the same terms as GroupedMatmulFp8Impl's: per output (m, n) of group g
// and 128-row chunk kc of the group's padded rows (in row order), part = the chunk's exact sum of the e4m3 products
// (float64, padding columns included: zeros), rounded once to float32; acc = fmaf(part, lhs_scales[kc][m] *
// rhs_scales[kc][n], acc) in float32 with the scale product rounded first. A group without rows is zero. The
// groups' padded rows must fit Mp (the device clips them; here that is an error naming the group).
ffi::Error GroupedOuterFp8Impl(ffi::AnyBuffer lhs_t, ffi::Buffer<ffi::F32> lhs_scales, ffi::AnyBuffer rhs_t,
                               ffi::Buffer<ffi::F32> rhs_scales, ffi::Buffer<ffi::S32> group_sizes,
                               ffi::Result<ffi::AnyBuffer> out) {
  auto shape = CheckGroupedOuterFp8(lhs_t, lhs_scales, rhs_t, rhs_scales, group_sizes, *out);
  if (shape.has_error()) return shape.error();
  const int64_t Mp = shape->Mp, K = shape->K, N = shape->N, lda = shape->lhs_ld, ldb = shape->rhs_ld;
  std::vector<int64_t> chunk(shape->G + 1, 0);  // the groups' first chunks
  for (int64_t g = 0; g < shape->G; ++g) {
    const int64_t n = group_sizes.typed_data()[g];
    chunk[g + 1] = chunk[g] + (n + kFp8Tile - 1) / kFp8Tile;
    if (n < 0 || chunk[g + 1] * kFp8Tile > Mp)
      return InvalidCall(
          "grouped_outer_fp8: group " + std::to_string(g) + " has " + std::to_string(n) +
          " rows; group sizes must be >= 0 and, each rounded up to a multiple of 128, sum to at most " +
          std::to_string(Mp) + " (the padded rows of lhs_t)");
  }
  static const E4m3Table e4m3;
  const auto* a = static_cast<const uint8_t*>(lhs_t.untyped_data());
  const auto* b = static_cast<const uint8_t*>(rhs_t.untyped_data());
  const float* sa = lhs_scales.typed_data();
  const float* sb = rhs_scales.typed_data();
  void* o = out->untyped_data();
  const bool out_bf16 = !shape->out_f32;
  for (int64_t g = 0; g < shape->G; ++g)
    for (int64_t m = 0; m < K; ++m)
      for (int64_t n = 0; n < N; ++n) {
        const uint8_t* am = a + m * Mp;
        const uint8_t* bn = b + n * Mp;
        float acc = 0.f;
        for (int64_t kc = chunk[g]; kc < chunk[g + 1]; ++kc) {
          double part = 0.0;
          for (int64_t r = kc * kFp8Tile; r < (kc + 1) * kFp8Tile; ++r)
            part += static_cast<double>(e4m3.value[am[r]]) * static_cast<double>(e4m3.value[bn[r]]);
          acc = std::fma(static_cast<float>(part), sa[kc * lda + m] * sb[kc * ldb + n], acc);
        }
        StoreElem(o, out_bf16, (g * K + m) * N + n, acc);
      }
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
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoGroupedMatmulFp8Cpu, jmo::cpu::GroupedMatmulFp8Impl,
                              jmo::BindGroupedMatmulFp8(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoGroupedMatmulSwiGluFp8Cpu, jmo::cpu::GroupedMatmulSwiGluFp8Impl,
                              jmo::BindGroupedMatmulSwiGluFp8(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoGroupedOuterFp8Cpu, jmo::cpu::GroupedOuterFp8Impl,
                              jmo::BindGroupedMatmulFp8(ffi::Ffi::Bind()));
