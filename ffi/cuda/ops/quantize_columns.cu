// jmo_quantize_columns_fp8 on CUDA (quantize_columns.h): the persistent kernel of ops/quantize_columns.cuh (a few
// CTAs per SM, each looping over (128 x 1 tile, 128 channels) items and loading its next item while it quantizes the
// current one) on float32 rows (RowsF32: 16-byte loads) or bfloat16 rows (RowsBf16x4: 8-byte loads, 128 channels an
// item, so C need only be a multiple of 128).
#include "cuda/ops/quantize_columns.h"

#include <string>

#include "cuda/ops/grouped_gemm.h"
#include "cuda/ops/quantize_columns.cuh"

namespace jmo::cuda {
namespace {

// CTAs per SM of the persistent kernel: its __launch_bounds__ minimum (registers and shared memory fit that many).
constexpr int kCtasPerSm = 2;

template <class In>
Status LaunchPersistent(cudaStream_t stream, In in, int64_t M, int64_t C, int64_t G, const int32_t* group_sizes,
                        int64_t tiles, uint8_t* q_t, float* s, int sms) {
  constexpr int kCh = qcols::Shared<In>::kCh;
  static_assert(kCh == 128, "an item is 128 channels: C is a multiple of 128");
  const auto kernel = qcols::QuantizeColumnsPersistent<In>;
  const int smem = qcols::PersistentSmem<In>();
  Status st = CudaStatus(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                         "cudaFuncSetAttribute of QuantizeColumnsPersistent");
  if (!st.ok()) return st;
  const int64_t items = tiles * (C / kCh);
  const int grid = static_cast<int>(items < int64_t(kCtasPerSm) * sms ? items : int64_t(kCtasPerSm) * sms);
  kernel<<<grid, qcols::kThreads, smem, stream>>>(in, M, C, group_sizes, static_cast<int>(G), kColumnTile * tiles,
                                                  items, q_t, s);
  return CudaStatus(cudaGetLastError(), "launch of QuantizeColumnsPersistent");
}

}  // namespace

Status QuantizeColumnsFp8(cudaStream_t stream, DType dt, const void* x, int64_t M, int64_t C, int64_t G,
                          const int32_t* group_sizes, int64_t tiles, void* q_t, float* s) {
  Status st = CheckSizes("quantize_columns_fp8", M, G);
  if (!st.ok()) return st;
  DeviceInfo dev;
  if (!(st = Fp8DeviceCheck("quantize_columns_fp8", &dev)).ok()) return st;
  if (C < 128 || C % 128 != 0 || tiles < (M + kColumnTile - 1) / kColumnTile + G || tiles > 0x7FFFFFFF)
    return Status::Error(kInvalidArgument, "jax_moe_overlap: quantize_columns_fp8: C must be a positive multiple of "
                                           "128 and the tiles at least ceil(M / 128) + G, got C=" +
                                               std::to_string(C) + ", tiles=" + std::to_string(tiles));
  auto* q = static_cast<uint8_t*>(q_t);
  if (dt == DType::kF32)
    return LaunchPersistent(stream, qcols::RowsF32{static_cast<const float*>(x), C}, M, C, G, group_sizes, tiles, q,
                            s, dev.sms);
  return LaunchPersistent(stream, qcols::RowsBf16x4{static_cast<const __nv_bfloat16*>(x), C}, M, C, G, group_sizes,
                          tiles, q, s, dev.sms);
}

}  // namespace jmo::cuda
