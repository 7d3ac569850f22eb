// Variant C of the grouped GEMM (weight gradient, see cutlass_grouped_gemm.cuh). Kept in its own
// translation unit so that the two files compile in parallel (CI has 2 cores).
#include "cutlass_grouped_gemm.cuh"
#include "cutlass_grouped_gemm_impl.cuh"

namespace cgg {
namespace {

// Per group g with rows [b, b+m): GEMM M = K, N = N, reduction = m.
//   A = lhs[b:b+m, :]^T, a (K x m) view of row-major lhs: M contiguous -> A ColumnMajor, ld K.
//   B = rhs2[b:b+m, :] as (m x N): N contiguous -> B RowMajor, ld N.
//   D = out[g] (K x N) row-major, ld N.
// TMA zero-fills the reduction dim past m, so neighbouring groups' rows never leak in.
using OuterCfg = GroupedGemm<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float>;

// Empty groups get problem shape (0, N, 0): no tiles at all. (A tile with a zero-length
// reduction is NOT safe: the mainloop then never clears its accumulators.) Their out[g] is
// zeroed here instead, by all blocks, grid-stride.
__global__ void __launch_bounds__(1024) prep_outer(
    const int32_t* __restrict__ group_sizes, int G, int64_t M, int64_t K, int64_t N,
    const BF16* lhs, const BF16* rhs2, float* out, UnderlyingShape* shapes, const BF16** ptr_a,
    const BF16** ptr_b, float** ptr_d, OuterCfg::StrideA* stride_a, OuterCfg::StrideB* stride_b,
    OuterCfg::StrideD* stride_d) {
  __shared__ GroupScan s;
  scan_groups(group_sizes, G, M, s);
  const int64_t group_bytes = K * N * (int64_t)sizeof(float);
  for (int g = 0; g < G; ++g) {
    if (s.rows[g] == 0) zero_range16(out, g * group_bytes, (g + 1) * group_bytes);
  }
  const int g = threadIdx.x;
  if (blockIdx.x != 0 || g >= G) return;
  const int64_t b = s.start[g], m = s.rows[g];
  shapes[g] = m > 0 ? UnderlyingShape{(int)K, (int)N, (int)m} : UnderlyingShape{0, (int)N, 0};
  ptr_a[g] = lhs + b * K;
  ptr_b[g] = rhs2 + b * N;
  ptr_d[g] = out + (int64_t)g * K * N;
  OuterCfg::StrideA sa{};
  OuterCfg::StrideB sb{};
  OuterCfg::StrideD sd{};
  set_ld(sa, K);
  set_ld(sb, N);
  set_ld(sd, N);
  stride_a[g] = sa;
  stride_b[g] = sb;
  stride_d[g] = sd;
}

}  // namespace
}  // namespace cgg

cudaError_t CutlassGroupedOuter(const __nv_bfloat16* lhs, int64_t M, int64_t K,
                                const __nv_bfloat16* rhs2, int64_t N, int64_t G,
                                const int32_t* group_sizes_dev, float* out, cudaStream_t stream) {
  using namespace cgg;
  CGG_REQUIRE(M >= 0 && K >= 0 && N >= 0, "negative dimension");
  CGG_REQUIRE(G >= 0 && G <= kMaxGroups, "need 0 <= G <= 1024");
  CGG_REQUIRE(K % 8 == 0 && N % 8 == 0, "K and N must be multiples of 8 (16-byte TMA pitches)");
  CGG_REQUIRE(M <= INT32_MAX && K <= INT32_MAX && N <= INT32_MAX, "dimension exceeds int32");
  if (G == 0 || K == 0 || N == 0) return cudaSuccess;
  CGG_REQUIRE(out != nullptr && aligned16(out), "out must be 16-byte aligned");
  if (M == 0) {  // every group is empty
    CGG_CUDA(cudaMemsetAsync(out, 0, (size_t)G * K * N * sizeof(float), stream));
    return cudaSuccess;
  }
  CGG_REQUIRE(lhs != nullptr && rhs2 != nullptr && group_sizes_dev != nullptr, "null pointer");
  CGG_REQUIRE(aligned16(lhs) && aligned16(rhs2), "lhs/rhs2 must be 16-byte aligned");

  int device = 0, sms = 0;
  CGG_CUDA(cudaGetDevice(&device));
  CGG_CUDA(sm_count_for(device, &sms));
  const size_t bytes = buffer_bytes_for(G, sms);
  void* buf = nullptr;
  CGG_CUDA(get_buffer(stream, bytes, &buf));
  char* base = static_cast<char*>(buf);
  const ArgArrays l = ArgArrays::layout<OuterCfg>(round_cap(G));

  // Zeroing of empty groups is rare and bounded by G*K*N; 1 block per SM is plenty.
  prep_outer<<<sms, 1024, 0, stream>>>(
      group_sizes_dev, (int)G, M, K, N, reinterpret_cast<const BF16*>(lhs),
      reinterpret_cast<const BF16*>(rhs2), out, reinterpret_cast<UnderlyingShape*>(base + l.shapes),
      reinterpret_cast<const BF16**>(base + l.ptr_a), reinterpret_cast<const BF16**>(base + l.ptr_b),
      reinterpret_cast<float**>(base + l.ptr_d), reinterpret_cast<OuterCfg::StrideA*>(base + l.stride_a),
      reinterpret_cast<OuterCfg::StrideB*>(base + l.stride_b),
      reinterpret_cast<OuterCfg::StrideD*>(base + l.stride_d));
  CGG_CUDA(cudaGetLastError());
  return run_cutlass<OuterCfg>((int)G, l, base, base + l.end, bytes - l.end, stream);
}
