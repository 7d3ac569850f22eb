// Variants A/B of the grouped GEMM (see cutlass_grouped_gemm.cuh) + shared helpers.
#include "cutlass_grouped_gemm.cuh"
#include "cutlass_grouped_gemm_impl.cuh"

namespace cgg {
namespace {

// lhs (M,K) row-major  -> A RowMajor (K contiguous), ld K.
// rhs [G,K,N]          -> B RowMajor (N contiguous), ld N.    (variant A)
// rhs [G,N,K]          -> B ColumnMajor (K contiguous), ld K. (variant B)
template <bool kRhsKMajor, bool kOutF32>
using FwdCfg = GroupedGemm<cutlass::layout::RowMajor,
                           std::conditional_t<kRhsKMajor, cutlass::layout::ColumnMajor,
                                              cutlass::layout::RowMajor>,
                           std::conditional_t<kOutF32, float, BF16>>;

// One launch: every block scans the group sizes (so that it knows min(sum, M)) and zeroes its
// share of the output tail rows [total, M); block 0 also writes the per-group CUTLASS arguments.
template <class Cfg>
__global__ void __launch_bounds__(1024) prep_forward(
    const int32_t* __restrict__ group_sizes, int G, int64_t M, int64_t K, int64_t N,
    const BF16* lhs, const BF16* rhs, bool rhs_k_major, typename Cfg::DPtr out,
    UnderlyingShape* shapes, const BF16** ptr_a, const BF16** ptr_b, typename Cfg::DPtr* ptr_d,
    typename Cfg::StrideA* stride_a, typename Cfg::StrideB* stride_b, typename Cfg::StrideD* stride_d) {
  __shared__ GroupScan s;
  scan_groups(group_sizes, G, M, s);
  using ElementD = std::remove_pointer_t<typename Cfg::DPtr>;
  const int64_t row_bytes = N * (int64_t)sizeof(ElementD);
  zero_range16(out, s.total * row_bytes, M * row_bytes);
  const int g = threadIdx.x;
  if (blockIdx.x != 0 || g >= G) return;
  const int64_t b = s.start[g], m = s.rows[g];
  // Empty groups get M = 0: the scheduler gives them no tiles, their pointers are never read.
  shapes[g] = UnderlyingShape{(int)m, (int)N, (int)K};
  ptr_a[g] = lhs + b * K;
  ptr_b[g] = rhs + (int64_t)g * K * N;
  ptr_d[g] = out + b * N;
  typename Cfg::StrideA sa{};
  typename Cfg::StrideB sb{};
  typename Cfg::StrideD sd{};
  set_ld(sa, K);
  set_ld(sb, rhs_k_major ? K : N);
  set_ld(sd, N);
  stride_a[g] = sa;
  stride_b[g] = sb;
  stride_d[g] = sd;
}

template <bool kRhsKMajor, bool kOutF32>
cudaError_t forward(const __nv_bfloat16* lhs, int64_t M, int64_t K, const __nv_bfloat16* rhs,
                    int64_t G, int64_t N, const int32_t* group_sizes, void* out,
                    cudaStream_t stream) {
  using Cfg = FwdCfg<kRhsKMajor, kOutF32>;
  using ElementD = std::remove_pointer_t<typename Cfg::DPtr>;
  int device = 0, sms = 0;
  CGG_CUDA(cudaGetDevice(&device));
  CGG_CUDA(sm_count_for(device, &sms));

  const size_t bytes = buffer_bytes_for(G, sms);
  void* buf = nullptr;
  CGG_CUDA(get_buffer(stream, bytes, &buf));
  char* base = static_cast<char*>(buf);
  const ArgArrays l = ArgArrays::layout<Cfg>(round_cap(G));

  // Enough blocks to zero a full-size tail quickly, at most 2 per SM; the GEMM itself writes
  // only rows < total, so the tail zeroing never races with it.
  const int64_t tail_vec16 = M * N * (int64_t)sizeof(ElementD) / 16;
  const int blocks = (int)std::max<int64_t>(1, std::min<int64_t>(2 * sms, (tail_vec16 + 1023) / 1024));
  auto* d_out = static_cast<typename Cfg::DPtr>(out);
  prep_forward<Cfg><<<blocks, 1024, 0, stream>>>(
      group_sizes, (int)G, M, K, N, reinterpret_cast<const BF16*>(lhs),
      reinterpret_cast<const BF16*>(rhs), kRhsKMajor, d_out,
      reinterpret_cast<UnderlyingShape*>(base + l.shapes), reinterpret_cast<const BF16**>(base + l.ptr_a),
      reinterpret_cast<const BF16**>(base + l.ptr_b), reinterpret_cast<typename Cfg::DPtr*>(base + l.ptr_d),
      reinterpret_cast<typename Cfg::StrideA*>(base + l.stride_a),
      reinterpret_cast<typename Cfg::StrideB*>(base + l.stride_b),
      reinterpret_cast<typename Cfg::StrideD*>(base + l.stride_d));
  CGG_CUDA(cudaGetLastError());
  return run_cutlass<Cfg>((int)G, l, base, base + l.end, bytes - l.end, stream);
}

}  // namespace
}  // namespace cgg

cudaError_t CutlassGroupedGemm(const __nv_bfloat16* lhs, int64_t M, int64_t K,
                               const __nv_bfloat16* rhs, int64_t G, int64_t N, bool rhs_k_major,
                               const int32_t* group_sizes_dev, void* out, bool out_f32,
                               cudaStream_t stream) {
  CGG_REQUIRE(M >= 0 && K >= 0 && N >= 0, "negative dimension");
  CGG_REQUIRE(G >= 0 && G <= cgg::kMaxGroups, "need 0 <= G <= 1024");
  CGG_REQUIRE(K % 8 == 0 && N % 8 == 0, "K and N must be multiples of 8 (16-byte TMA pitches)");
  CGG_REQUIRE(M <= INT32_MAX && K <= INT32_MAX && N <= INT32_MAX, "dimension exceeds int32");
  if (M == 0 || N == 0) return cudaSuccess;
  CGG_REQUIRE(out != nullptr && cgg::aligned16(out), "out must be 16-byte aligned");
  const size_t out_bytes = (size_t)M * N * (out_f32 ? 4 : 2);
  // Nothing to multiply: every row is either an (empty) product or tail -> all zeros.
  if (K == 0 || G == 0) {
    CGG_CUDA(cudaMemsetAsync(out, 0, out_bytes, stream));
    return cudaSuccess;
  }
  CGG_REQUIRE(lhs != nullptr && rhs != nullptr && group_sizes_dev != nullptr, "null pointer");
  CGG_REQUIRE(cgg::aligned16(lhs) && cgg::aligned16(rhs), "lhs/rhs must be 16-byte aligned");
  if (rhs_k_major) {
    return out_f32 ? cgg::forward<true, true>(lhs, M, K, rhs, G, N, group_sizes_dev, out, stream)
                   : cgg::forward<true, false>(lhs, M, K, rhs, G, N, group_sizes_dev, out, stream);
  }
  return out_f32 ? cgg::forward<false, true>(lhs, M, K, rhs, G, N, group_sizes_dev, out, stream)
                 : cgg::forward<false, false>(lhs, M, K, rhs, G, N, group_sizes_dev, out, stream);
}

cudaError_t CutlassGroupedGemmReserve(int64_t max_groups, cudaStream_t stream) {
  CGG_REQUIRE(max_groups >= 0 && max_groups <= cgg::kMaxGroups, "need 0 <= max_groups <= 1024");
  int device = 0, sms = 0;
  CGG_CUDA(cudaGetDevice(&device));
  CGG_CUDA(cgg::sm_count_for(device, &sms));
  void* buf = nullptr;
  return cgg::get_buffer(stream, cgg::buffer_bytes_for(max_groups, sms), &buf);
}

const char* CutlassGroupedGemmConfig() { return CGG_CONFIG_STRING; }
