// jmo_quantize_columns_fp8 on CUDA (quantize_columns.h), by ops/quantize_columns.cuh's lean kernel (one CTA per
// (128 x 1 tile, kCh channels) item), the schedule tools/probes/quantize_columns_probe.cu measured fastest for every
// input form (docs/performance.md):
//   float32 or bfloat16 rows: RowsF32 (16-byte loads) or RowsBf16x4 (8-byte loads), 128 channels an item, so C need
//     only be a multiple of 128;
//   row-quantized rows (e4m3 values and 1 x 128 scales): RowsE4m3 (8 values a lane, 256 channels an item: C a
//     multiple of 256).
#include "cuda/ops/quantize_columns.h"

#include <string>

#include "cuda/launch.h"
#include "cuda/ops/grouped_gemm.h"
#include "cuda/ops/quantize_columns.cuh"

namespace jmo::cuda {
namespace {

// One CTA per item: tiles * (C / kCh) CTAs.
template <class In>
Status LaunchLean(cudaStream_t stream, In in, int64_t M, int64_t C, int64_t G, const int32_t* group_sizes,
                  int64_t tiles, uint8_t* q_t, float* s) {
  constexpr int kCh = qcols::Shared<In>::kCh;
  const auto kernel = qcols::QuantizeColumnsLean<In>;
  const int smem = qcols::LeanSmem<In>();
  Status st = SetKernelSmem(reinterpret_cast<const void*>(kernel), smem, "QuantizeColumnsLean");
  if (!st.ok()) return st;
  const int64_t items = tiles * (C / kCh);
  kernel<<<static_cast<unsigned>(items), qcols::kThreads, smem, stream>>>(in, M, C, group_sizes, static_cast<int>(G),
                                                                         kColumnTile * tiles, q_t, s);
  return CudaStatus(cudaGetLastError(), "launch of QuantizeColumnsLean");
}

// The checks of both forms: sizes, device, C a positive multiple of `width` (the input form's item) and tiles at
// least ceil(M / 128) + G, with at most 2^31 - 1 items of `width` channels (a grid's x extent).
Status Prepare(const char* form, int64_t M, int64_t C, int64_t G, int64_t tiles, int64_t width, DeviceInfo* dev) {
  Status st = CheckSizes("quantize_columns_fp8", M, G);
  if (!st.ok()) return st;
  if (!(st = Fp8DeviceCheck("quantize_columns_fp8", dev)).ok()) return st;
  if (C < width || C % width != 0 || tiles < ColumnTilesNeeded(M, G) ||
      tiles > 0x7FFFFFFF / (C / width))
    return Status::Error(kInvalidArgument, std::string("jax_moe_overlap: quantize_columns_fp8: C must be a positive "
                                                       "multiple of ") +
                                               std::to_string(width) + " (" + form + ") and the tiles at least "
                                               "ceil(M / 128) + G, at most 2^31 - 1 items of C / " +
                                               std::to_string(width) + " channel blocks, got C=" + std::to_string(C) +
                                               ", tiles=" + std::to_string(tiles));
  return Status{};
}

}  // namespace

Status QuantizeColumnsFp8(cudaStream_t stream, DType dt, const void* x, int64_t M, int64_t C, int64_t G,
                          const int32_t* group_sizes, int64_t tiles, void* q_t, float* s) {
  DeviceInfo dev;
  Status st = Prepare("float32 or bfloat16 rows", M, C, G, tiles, 128, &dev);
  if (!st.ok()) return st;
  auto* q = static_cast<uint8_t*>(q_t);
  if (dt == DType::kF32)
    return LaunchLean(stream, qcols::RowsF32{static_cast<const float*>(x), C}, M, C, G, group_sizes, tiles, q, s);
  return LaunchLean(stream, qcols::RowsBf16x4{static_cast<const __nv_bfloat16*>(x), C}, M, C, G, group_sizes, tiles,
                    q, s);
}

Status QuantizeColumnsFp8FromRows(cudaStream_t stream, const void* xq, const float* xs, int64_t M, int64_t C, int64_t G,
                                  const int32_t* group_sizes, int64_t tiles, void* q_t, float* s) {
  static_assert(qcols::Shared<qcols::RowsE4m3>::kCh == kRowsE4m3Channels,
                "the row-quantized form's C rule (common/grouped_gemm_signature.h) is the kernel's item width");
  DeviceInfo dev;
  Status st = Prepare("row-quantized rows: the kernel's item, 32 lanes of 8 e4m3 values", M, C, G, tiles,
                      kRowsE4m3Channels, &dev);
  if (!st.ok()) return st;
  return LaunchLean(stream, qcols::RowsE4m3{static_cast<const uint8_t*>(xq), xs, C}, M, C, G, group_sizes, tiles,
                    static_cast<uint8_t*>(q_t), s);
}

}  // namespace jmo::cuda
