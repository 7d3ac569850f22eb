// Standalone probe for gemm/sm90/wgmma_outer_fp8.cuh (WgmmaGroupedOuterFp8, the FP8 weight gradient: e4m3 operands
// token-contiguous, both scaled per 128 x 1 tile): correctness against a float32 GPU reference on random e4m3
// operands and scales, then timing beside the library's bf16 grouped outer GEMM (WgmmaGroupedOuter) on the same
// shapes and group sizes.
//   wgmma_outer_fp8_probe [--small-only] [--no-timing]
// Exit codes: 0 all PASS, 1 some FAIL, 2 CUDA error, 3 watchdog timeout.
//
// Operands as the layer's XLA pass writes them: lhs_t [K, Mp], rhs_t [N, Mp] e4m3, each group's rows starting at a
// multiple of 128 (P_g), its last chunk's padding columns zero; columns past the groups' padded end hold NaN (0x7F),
// which the kernel must never read. Scales [Mp/128, ld] (ld > K for lhs: a padded row stride), random positive floats.
// The reference dequantizes each value (float32(q) * s of its channel and chunk) and sums the float32 products of
// the group's rows in row order, one thread per output. The kernel promotes each chunk's tensor-core partial sums with
// float32(sa * sb): the two differ by the tensor core's limited accumulation inside a chunk (and float32 roundings);
// tolerances kTolF32 / kTolBf16 (fp8_probe_common.cuh). Outputs are poisoned (NaN) before each checked call, groups
// without rows must be exactly +0, and a second call must reproduce the first bit for bit.
#include <cuda_fp8.h>

#include "cuda/gemm/sm90/wgmma_outer.cuh"
#include "cuda/gemm/sm90/wgmma_outer_fp8.cuh"
#include "fp8_probe_common.cuh"
#include "probe_common.cuh"

constexpr int kChunk = 128;  // rows per scale tile

// Column r of a [rows, Mp] operand: its chunk t = r / 128 holds valid[t] rows of its group (1..128: the columns
// r % 128 >= valid[t] are the padding, zero), or valid[t] = -1: past the groups (NaN, never read).
__global__ void MaskColumnsKernel(uint8_t* p, int64_t rows, int64_t Mp, const int* valid) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows * Mp; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i % Mp;
    const int v = valid[r / kChunk];
    if (v < 0) p[i] = 0x7F;
    else if (r % kChunk >= v) p[i] = 0;
  }
}

// ref[g, m, n] = sum over the group's rows r (columns P_g .. P_g + size_g - 1, clipped at Mp) of the dequantized
// a[m, r] * b[n, r], float32 in row order. Block 32 x 8 threads: 32 m x 32 n outputs, each thread 4 m of one n;
// dequantized tiles of 32 rows in shared memory. grid (N / 32, K / 32, G).
__global__ void RefOuterFp8Kernel(const uint8_t* __restrict__ a, const float* __restrict__ sa, int64_t lda,
                                  const uint8_t* __restrict__ b, const float* __restrict__ sb, int64_t ldb,
                                  const int* __restrict__ row_beg, const int* __restrict__ row_end, int64_t Mp, int K,
                                  int N, float* __restrict__ ref) {
  __shared__ float as[32][33], bs[32][33];
  const int tx = threadIdx.x, ty = threadIdx.y, g = blockIdx.z;
  const int m0 = blockIdx.y * 32, n0 = blockIdx.x * 32;
  const int beg = row_beg[g], end = row_end[g];
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int r0 = beg; r0 < end; r0 += 32) {
    const int r = r0 + tx;
    const int64_t kc = r / kChunk;
    for (int i = ty; i < 32; i += 8) {
      as[i][tx] = r < end ? E4m3ToFloat(a[(int64_t)(m0 + i) * Mp + r]) * sa[kc * lda + m0 + i] : 0.f;
      bs[i][tx] = r < end ? E4m3ToFloat(b[(int64_t)(n0 + i) * Mp + r]) * sb[kc * ldb + n0 + i] : 0.f;
    }
    __syncthreads();
#pragma unroll 8
    for (int rr = 0; rr < 32; ++rr)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[j] += as[ty + 8 * j][rr] * bs[tx][rr];
    __syncthreads();
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) ref[((int64_t)g * K + m0 + ty + 8 * j) * N + n0 + tx] = acc[j];
}

struct OuterCase {
  std::string name;
  int64_t K, N;
  std::vector<int32_t> sizes;
  int64_t extra_chunks;  // Mp = the groups' padded rows + 128 extra_chunks (negative: clipped groups)
  bool small;
};

int main(int argc, char** argv) {
  const ProbeArgs args = ParseProbeArgs(argc, argv);
  const int num_sms = ProbeDevice(wgmma_outer::kOuterFp8SmemBytes);
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int failures = 0;

  // Operands the kernel does not take are refused before anything runs (cudaErrorInvalidValue, the rule printed).
  {
    struct Bad {
      const char* what;
      int64_t Mp, K, N, G, lda, ldb, offset;
    };
    const Bad bad[] = {{"Mp % 128 != 0", 192, 128, 128, 1, 128, 128, 0}, {"K % 128 != 0", 128, 192, 128, 1, 192, 128, 0},
                       {"N % 128 != 0", 128, 128, 64, 1, 128, 64, 0},    {"lda < K", 128, 256, 128, 1, 128, 128, 0},
                       {"ldb % 4 != 0", 128, 128, 128, 1, 128, 130, 0},  {"G = 0", 128, 128, 128, 0, 128, 128, 0},
                       {"G = 1025", 128, 128, 128, 1025, 128, 128, 0},   {"misaligned lhs", 128, 128, 128, 1, 128, 128, 8}};
    failures += CheckRefusals(
        (int)(sizeof(bad) / sizeof(bad[0])),
        [&](int i, uint8_t* buf, const __nv_fp8_e4m3* q, const float* s, const int32_t* sizes) {
          const Bad& b = bad[i];
          return std::make_pair(b.what, WgmmaGroupedOuterFp8(reinterpret_cast<const __nv_fp8_e4m3*>(buf + b.offset), s,
                                                             b.lda, b.K, q, s, b.ldb, b.N, b.Mp, b.G, sizes, buf,
                                                             false, num_sms, stream));
        },
        stream);
  }

  std::vector<OuterCase> cases = {
      {"small_K256_N384_G3_{0,130,300}", 256, 384, {0, 130, 300}, 1, true},
      {"small_K128_N128_G4_{1,0,3,128}", 128, 128, {1, 0, 3, 128}, 0, true},
      {"small_clip_K128_N256_G3_{250,250,9}", 128, 256, {250, 250, 9}, -2, true},
      {"small_K256_N256_G40_random", 256, 256, RandomSizes(3000, 40, 7, 0.8), 1, true},
      {"small_K384_N640_G8_skew", 384, 640, Skewed(5000, 8, 2, 0.6), 0, true},
      {"small_K128_N256_G300_partition", 128, 256, RandomSizes(20000, 300, 5, 1.0), 0, true},
      {"wgrad_K2048_N1408_G8_rows4096", 2048, 1408, Balanced(32768, 8), 0, false},
      {"wgrad_K2048_N1408_G8_skew60", 2048, 1408, Skewed(32768, 8, 2, 0.6), 0, false},
      {"train_dW1_K1024_N2048_E16_T131072", 1024, 2048, Balanced(131072, 16), 0, false},
      {"train_dW2_K1024_N1024_E16_T131072", 1024, 1024, Balanced(131072, 16), 0, false},
      {"train_dW1_K1024_N2048_E16_random", 1024, 2048, RandomSizes(131072, 16, 3, 1.0), 0, false},
  };

  std::vector<std::string> summary;
  for (const OuterCase& c : cases) {
    if (args.small_only && !c.small) continue;
    const int64_t K = c.K, N = c.N, G = (int64_t)c.sizes.size();
    // Padded offsets P_g, Mp, the clipped row ranges and each chunk's valid rows.
    std::vector<int64_t> P(G + 1, 0);
    for (int64_t g = 0; g < G; ++g) P[g + 1] = P[g] + (std::max<int32_t>(0, c.sizes[g]) + kChunk - 1) / kChunk * kChunk;
    const int64_t Mp = P[G] + kChunk * c.extra_chunks;
    std::vector<int> beg(G), end(G), pad_start(G + 1), valid(Mp / kChunk, -1);
    int64_t rows_total = 0;
    for (int64_t g = 0; g < G; ++g) {
      beg[g] = (int)std::min(P[g], Mp);
      end[g] = (int)std::min(P[g] + std::max<int32_t>(0, c.sizes[g]), Mp);
      pad_start[g] = beg[g];
      rows_total += end[g] - beg[g];
      for (int64_t r = beg[g]; r < end[g]; r += kChunk) valid[r / kChunk] = (int)std::min<int64_t>(kChunk, end[g] - r);
    }
    pad_start[G] = (int)std::min(P[G], Mp);
    const int64_t lda = K + 4, ldb = N, chunks = Mp / kChunk;
    const double flops = 2.0 * (double)rows_total * (double)K * (double)N;

    uint8_t *a, *b;
    float *sa, *sb, *ref;
    void *out, *first;
    int32_t* d_sizes;
    int *d_beg, *d_end, *d_pad_start, *d_valid;
    CmpResult* d_res;
    unsigned long long* d_diff;
    CK(cudaMalloc(&a, K * Mp));
    CK(cudaMalloc(&b, N * Mp));
    CK(cudaMalloc(&sa, chunks * lda * 4));
    CK(cudaMalloc(&sb, chunks * ldb * 4));
    CK(cudaMalloc(&ref, G * K * N * 4));
    CK(cudaMalloc(&out, G * K * N * 4));
    CK(cudaMalloc(&first, G * K * N * 4));
    CK(cudaMalloc(&d_sizes, G * 4));
    CK(cudaMalloc(&d_beg, G * 4));
    CK(cudaMalloc(&d_end, G * 4));
    CK(cudaMalloc(&d_pad_start, (G + 1) * 4));
    CK(cudaMalloc(&d_valid, chunks * 4));
    CK(cudaMalloc(&d_res, sizeof(CmpResult)));
    CK(cudaMalloc(&d_diff, sizeof(unsigned long long)));
    CK(cudaMemcpyAsync(d_sizes, c.sizes.data(), G * 4, cudaMemcpyHostToDevice, stream));
    CK(cudaMemcpyAsync(d_beg, beg.data(), G * 4, cudaMemcpyHostToDevice, stream));
    CK(cudaMemcpyAsync(d_end, end.data(), G * 4, cudaMemcpyHostToDevice, stream));
    CK(cudaMemcpyAsync(d_pad_start, pad_start.data(), (G + 1) * 4, cudaMemcpyHostToDevice, stream));
    CK(cudaMemcpyAsync(d_valid, valid.data(), chunks * 4, cudaMemcpyHostToDevice, stream));
    FillE4m3Kernel<<<1024, 256, 0, stream>>>(a, K * Mp, 1);
    FillE4m3Kernel<<<1024, 256, 0, stream>>>(b, N * Mp, 2);
    MaskColumnsKernel<<<1024, 256, 0, stream>>>(a, K, Mp, d_valid);
    MaskColumnsKernel<<<1024, 256, 0, stream>>>(b, N, Mp, d_valid);
    FillScalesKernel<<<256, 256, 0, stream>>>(sa, chunks * lda, 3, false);
    FillScalesKernel<<<256, 256, 0, stream>>>(sb, chunks * ldb, 4, false);
    RefOuterFp8Kernel<<<dim3(N / 32, K / 32, G), dim3(32, 8), 0, stream>>>(a, sa, lda, b, sb, ldb, d_beg, d_end, Mp,
                                                                         (int)K, (int)N, ref);
    CK(cudaGetLastError());
    {
      const double saved = g_watchdog_s;
      g_watchdog_s = std::max(saved, 60.0);
      WaitOrDie(stream, c.name + " (reference)");
      g_watchdog_s = saved;
    }

    auto call = [&](bool f32) {
      const cudaError_t e = WgmmaGroupedOuterFp8(reinterpret_cast<const __nv_fp8_e4m3*>(a), sa, lda, K,
                                                 reinterpret_cast<const __nv_fp8_e4m3*>(b), sb, ldb, N, Mp, G, d_sizes,
                                                 out, f32, num_sms, stream);
      if (e != cudaSuccess) {
        printf("case %s FAIL launch error: %s\n", c.name.c_str(), cudaGetErrorString(e));
        exit(2);
      }
    };
    float fp8_ms = 0.f;
    for (int f32 = 1; f32 >= 0; --f32) {
      const std::string vname = c.name + (f32 ? " out=f32" : " out=bf16");
      const int64_t out_bytes = G * K * N * (f32 ? 4 : 2);
      // Poison: 0xFF bytes are NaN in bf16 and f32.
      CK(cudaMemsetAsync(out, 0xFF, out_bytes, stream));
      call(f32);
      WaitOrDie(stream, vname);
      CK(cudaMemsetAsync(d_res, 0, sizeof(CmpResult), stream));
      if (f32)
        CompareGroupsKernel<true><<<1024, 256, 0, stream>>>(out, ref, d_pad_start, G, K * N, d_res);
      else
        CompareGroupsKernel<false><<<1024, 256, 0, stream>>>(out, ref, d_pad_start, G, K * N, d_res);
      CK(cudaGetLastError());
      const CmpSummary cmp = ReadCompare(d_res, stream, vname, f32, rows_total, f32 ? kTolF32 : kTolBf16);
      // The same call again (after timing, when timed): the output must be the same bits.
      unsigned long long diff = 0;
      const float ms = RepeatCall([&]() { call(f32); }, out, first, out_bytes, args.timing && !c.small, d_diff, stream,
                                  vname, &diff);
      const bool pass = cmp.ok && diff == 0;
      if (!pass) ++failures;
      if (f32) fp8_ms = ms;
      printf("case %-40s %-9s %s err=%.3e (max_err=%.3e max_ref=%.3e nonfinite=%llu bad_empty=%llu) repeat_diff=%llu "
             "ms=%.4f TFLOP/s=%.1f\n",
             c.name.c_str(), f32 ? "out=f32" : "out=bf16", pass ? "PASS" : "FAIL", cmp.rel, cmp.max_err, cmp.max_ref,
             cmp.res.bad_values, cmp.res.bad_zero, diff, ms, Tflops(flops, ms));
      fflush(stdout);
    }

    if (args.timing && !c.small) {
      // The library's bf16 outer GEMM (the wgrad it replaces) on bf16 operands of the same shape, row-major
      // lhs [M, K] and rhs [M, N] with the same group sizes, float32 output (as the layer calls it).
      const int64_t M = rows_total;
      __nv_bfloat16 *l16, *r16;
      CK(cudaMalloc(&l16, M * K * 2));
      CK(cudaMalloc(&r16, M * N * 2));
      FillKernel<<<1024, 256, 0, stream>>>(l16, M * K, 5);
      FillKernel<<<1024, 256, 0, stream>>>(r16, M * N, 6);
      CK(cudaGetLastError());
      auto bf16_call = [&]() {
        const cudaError_t e = WgmmaGroupedOuter(l16, M, K, r16, N, G, d_sizes, out, true, num_sms, stream);
        if (e != cudaSuccess) {
          printf("case %s bf16 outer launch error: %s\n", c.name.c_str(), cudaGetErrorString(e));
          exit(2);
        }
      };
      for (int i = 0; i < 3; ++i) bf16_call();
      WaitOrDie(stream, c.name + " bf16 (warm-up)");
      const float bf16_ms = MedianLaunchMs(stream, 20, bf16_call, [](int) {});
      FreeAll(l16, r16);
      char line[256];
      snprintf(line, sizeof(line), "%-40s fp8 %7.1f | bf16 outer %6.1f (fp8 %.2fx)", c.name.c_str(),
               Tflops(flops, fp8_ms), Tflops(flops, bf16_ms), bf16_ms / fp8_ms);
      printf("timing %s\n", line);
      summary.push_back(line);
      fflush(stdout);
    }
    FreeAll(a, b, sa, sb, ref, out, first, d_sizes, d_beg, d_end, d_pad_start, d_valid, d_res, d_diff);
  }
  if (!summary.empty()) {
    printf("\nTFLOP/s (median of 20 launches after 3 warm-ups, float32 outputs; FLOPs = 2 x rows x K x N):\n");
    for (const std::string& s : summary) printf("  %s\n", s.c_str());
  }
  printf("%s: %d failing variant(s)\n", failures ? "FAILED" : "ALL PASS", failures);
  return failures ? 1 : 0;
}
