// Standalone probe for gemm/sm90/wgmma_grouped_fp8.cuh (WgmmaGroupedGemmFp8, e4m3 with DeepSeek-V3's block scales):
// correctness against a float32 GPU reference on random e4m3 operands and scales, then timing beside the library's
// bf16 grouped GEMM (same shapes) and, when built with cuBLASLt (-DPROBE_CUBLASLT), cuBLASLt's FP8 dense GEMM of the
// same FLOPs.
//   wgmma_fp8_probe [--small-only] [--no-timing]
// Exit codes: 0 all PASS, 1 some FAIL, 2 CUDA error, 3 watchdog timeout.
//
// The reference dequantizes exactly as fp8.py defines it (a value is float32(q) * s: A per 1 x 128 tile, B per
// 128 x 128 block) and sums the float32 products in K order, one thread per output. The kernel multiplies the same
// e4m3 values on the tensor cores and promotes each 128-wide chunk's partial sums with the product of the two scales,
// so the two differ by the tensor core's limited accumulation inside a chunk (and float32 roundings). Tolerance, as
// max |out - ref| / max |ref|: a model of that accumulation (each k32 step's addends aligned to the largest exponent
// among them and the running sum and truncated 13 bits below it: DeepSeek-V3's "about 14 bits") errs by up to
// 3.5e-4 of max |ref| on these inputs at K = 128 .. 7168, so 2e-3 for float32 output; a bfloat16 output adds its own
// rounding, up to 2^-9 of max |ref|, so 5e-3. A lost or doubled chunk, a wrong scale or a wrong row is off by 1e-1 or
// more. Outputs are poisoned (NaN) before each checked call, rows past the groups must be exactly +0, and a second
// call must reproduce the first bit for bit.
#include <cuda_fp8.h>

#include "cuda/gemm/sm90/wgmma_grouped.cuh"
#include "cuda/gemm/sm90/wgmma_grouped_fp8.cuh"
#include "fp8_probe_common.cuh"
#include "probe_common.cuh"

#if PROBE_CUBLASLT
#include <cublasLt.h>
#endif

constexpr int kChunk = 128;  // K per scale; N per weight block

// Reference for the rows [row0, row0 + rows) of group g: 32 x 32 outputs per block of 32 x 8 threads, each thread 4
// rows of one column; dequantized tiles of 32 k in shared memory, float32 sums in K order.
__global__ void RefKernel(const uint8_t* __restrict__ a, const float* __restrict__ sa, int64_t lds,
                          const uint8_t* __restrict__ b, const float* __restrict__ sb, int row0, int rows, int g, int K,
                          int N, float* __restrict__ ref) {
  __shared__ float as[32][33], bs[32][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int r0 = blockIdx.y * 32, n0 = blockIdx.x * 32;
  const int kc_n = K / kChunk, nb_n = N / kChunk;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int k0 = 0; k0 < K; k0 += 32) {
    const int kc = k0 / kChunk;
    for (int i = ty; i < 32; i += 8) {
      const int r = r0 + i, n = n0 + i;
      as[i][tx] = r < rows ? E4m3ToFloat(a[(int64_t)(row0 + r) * K + k0 + tx]) * sa[(int64_t)kc * lds + row0 + r] : 0.f;
      bs[i][tx] = E4m3ToFloat(b[((int64_t)g * N + n) * K + k0 + tx]) * sb[((int64_t)g * nb_n + n / kChunk) * kc_n + kc];
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < 32; ++kk)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[j] += as[ty + 8 * j][kk] * bs[tx][kk];
    __syncthreads();
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = r0 + ty + 8 * j;
    if (r < rows) ref[(int64_t)(row0 + r) * N + n0 + tx] = acc[j];
  }
}

#if PROBE_CUBLASLT
// cuBLASLt's FP8 dense GEMM D [m, n] (row-major, bf16) = X [m, k] e4m3 @ W [n, k]^T e4m3, in its column-major terms
// D^T = op(W) X^T with W transposed (the "TN" layout FP8 needs). Modes: 0 per-tensor scales, 1 the same with fast
// accumulation (no promotion), 2 DeepSeek's block scales (X per 1 x 128, W per 128 x 128: VEC128 / BLK128x128; timed
// only: its scale tensors are the probe's buffers whatever layout cuBLASLt reads them in).
struct CublasFp8 {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t ws_bytes = 64 << 20;
  float* one = nullptr;  // device 1.0f: the per-tensor scales
  CublasFp8() {
    if (cublasLtCreate(&handle) != CUBLAS_STATUS_SUCCESS) handle = nullptr;
    CK(cudaMalloc(&workspace, ws_bytes));
    CK(cudaMalloc(&one, sizeof(float)));
    const float h = 1.0f;
    CK(cudaMemcpy(one, &h, sizeof(float), cudaMemcpyHostToDevice));
  }
  ~CublasFp8() {
    if (handle) cublasLtDestroy(handle);
    cudaFree(workspace);
    cudaFree(one);
  }
  // Median ms of the GEMM, or a negative value with `why` set when cuBLASLt does not run it.
  float Time(int mode, const uint8_t* x, const float* x_scales, const uint8_t* w, const float* w_scales, int64_t m,
             int64_t k, int64_t n, void* d, cudaStream_t stream, std::string* why) {
    if (!handle) {
      *why = "cublasLtCreate failed";
      return -1.f;
    }
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    float ms = -1.f;
    cublasStatus_t st;
    auto fail = [&](const char* what) {
      *why = std::string(what) + ": " + cublasLtGetStatusString(st);
    };
    do {
      if ((st = cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F)) != CUBLAS_STATUS_SUCCESS) {
        fail("MatmulDescCreate");
        break;
      }
      const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t));
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n));
      const void* a_scale = mode == 2 ? (const void*)w_scales : (const void*)one;
      const void* b_scale = mode == 2 ? (const void*)x_scales : (const void*)one;
      if (mode == 2) {
        const cublasLtMatmulMatrixScale_t sa = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
        const cublasLtMatmulMatrixScale_t sb = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        if ((st = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &sa, sizeof(sa))) !=
                CUBLAS_STATUS_SUCCESS ||
            (st = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &sb, sizeof(sb))) !=
                CUBLAS_STATUS_SUCCESS) {
          fail("block scale modes");
          break;
        }
      }
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof(a_scale));
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof(b_scale));
      const int8_t fast = mode == 1;
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast));
      cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, k, n, k);  // W^T's storage: k x n column-major
      cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, k, m, k);  // X^T: k x m column-major
      cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, n, m, n);     // D^T: n x m column-major
      cublasLtMatmulPreferenceCreate(&pref);
      uint64_t ws = ws_bytes;
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
      cublasLtMatmulHeuristicResult_t res;
      int found = 0;
      st = cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, lc, lc, pref, 1, &res, &found);
      if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
        if (st == CUBLAS_STATUS_SUCCESS) st = CUBLAS_STATUS_NOT_SUPPORTED;
        fail("no algorithm");
        break;
      }
      const float alpha = 1.f, beta = 0.f;
      auto launch = [&]() {
        st = cublasLtMatmul(handle, desc, &alpha, w, la, x, lb, &beta, d, lc, d, lc, &res.algo, workspace, ws_bytes,
                            stream);
      };
      for (int i = 0; i < 3; ++i) launch();
      if (st != CUBLAS_STATUS_SUCCESS) {
        fail("cublasLtMatmul");
        break;
      }
      WaitOrDie(stream, "cublasLt warm-up");
      ms = MedianLaunchMs(stream, 20, launch, [](int) {});
    } while (false);
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (desc) cublasLtMatmulDescDestroy(desc);
    return ms;
  }
};
#endif


int main(int argc, char** argv) {
  const ProbeArgs args = ParseProbeArgs(argc, argv);
  const int num_sms = ProbeDevice(wgmma_gemm::kFp8SmemBytes);
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
#if PROBE_CUBLASLT
  CublasFp8 cublas;
  printf("cuBLASLt %zu\n", cublasLtGetVersion());
#else
  printf("cuBLASLt: not built in (tools/probes/wgmma_build_and_run.sh found no cublasLt.h / libcublasLt)\n");
#endif

  // Operands the kernel does not take are refused before anything runs (cudaErrorInvalidValue, the rule printed).
  int failures = 0;
  {
    struct Bad {
      const char* what;
      int64_t M, K, N, G, lds, offset;
    };
    const Bad bad[] = {{"K % 128 != 0", 64, 192, 128, 1, 64, 0},     {"N % 128 != 0", 64, 128, 192, 1, 64, 0},
                       {"lds % 4 != 0", 63, 128, 128, 1, 63, 0},     {"lds < M", 64, 128, 128, 1, 60, 0},
                       {"G = 0", 64, 128, 128, 0, 64, 0},            {"M = 0", 0, 128, 128, 1, 4, 0},
                       {"misaligned lhs", 64, 128, 128, 1, 64, 8}};
    failures += CheckRefusals(
        (int)(sizeof(bad) / sizeof(bad[0])),
        [&](int i, uint8_t* buf, const __nv_fp8_e4m3* q, const float* s, const int32_t* sizes) {
          const Bad& b = bad[i];
          return std::make_pair(b.what, WgmmaGroupedGemmFp8(reinterpret_cast<const __nv_fp8_e4m3*>(buf + b.offset), s,
                                                            b.lds, b.M, b.K, q, s, b.G, b.N, sizes, buf, false,
                                                            num_sms, stream));
        },
        stream);
  }

  std::vector<Case> cases = {
      {"small_M300_K256_N256_G3_empty_first", 300, 256, 256, {0, 130, 170}, true},
      {"small_pad_M301_K128_N384_G4", 301, 128, 384, {7, 0, 100, 93}, true},
      {"small_clamp_M300_K384_N512_G2", 300, 384, 512, {250, 250}, true},
      {"small_many_M1000_K256_N256_G40", 1000, 256, 256, RandomSizes(1000, 40, 7, 0.8), true},
      {"small_rows1_M5_K128_N128_G3", 5, 128, 128, {1, 0, 3}, true},
      {"small_skew_M2000_K1024_N640_G8", 2000, 1024, 640, Skewed(2000, 8, 2, 0.6), true},
      {"mixtral_M16384_K4096_N14336_G8_balanced", 16384, 4096, 14336, Balanced(16384, 8), false},
      {"mixtral_M16384_K4096_N14336_G8_skew60", 16384, 4096, 14336, Skewed(16384, 8, 2, 0.6), false},
      {"mixtral_gemm2_M16384_K14336_N4096_G8_balanced", 16384, 14336, 4096, Balanced(16384, 8), false},
      {"deepseek_M16384_K2048_N7168_G8_balanced", 16384, 2048, 7168, Balanced(16384, 8), false},
      {"deepseek_gemm1_M16384_K7168_N4096_G32_random", 16384, 7168, 4096, RandomSizes(16384, 32, 11, 1.0), false},
  };

  std::vector<std::string> summary;
  for (const Case& c : cases) {
    if (args.small_only && !c.small) continue;
    const int64_t M = c.M, K = c.K, N = c.N, G = (int64_t)c.sizes.size();
    const int64_t KC = K / kChunk, NB = N / kChunk, lds = (M + 3) / 4 * 4;
    const std::vector<int> row_start = ClampedRowStart(c.sizes, M);
    const int64_t total_rows = row_start[G];
    const double flops = 2.0 * (double)total_rows * (double)K * (double)N;

    uint8_t *a, *b;
    float *sa, *sb, *ref;
    void *out, *first;
    int32_t* d_sizes;
    CmpResult* d_res;
    unsigned long long* d_diff;
    CK(cudaMalloc(&a, M * K));
    CK(cudaMalloc(&b, G * N * K));
    CK(cudaMalloc(&sa, KC * lds * 4));
    CK(cudaMalloc(&sb, G * NB * KC * 4));
    CK(cudaMalloc(&ref, M * N * 4));
    CK(cudaMalloc(&out, M * N * 4));
    CK(cudaMalloc(&first, M * N * 4));
    CK(cudaMalloc(&d_sizes, G * 4));
    CK(cudaMalloc(&d_res, sizeof(CmpResult)));
    CK(cudaMalloc(&d_diff, sizeof(unsigned long long)));
    CK(cudaMemcpyAsync(d_sizes, c.sizes.data(), G * 4, cudaMemcpyHostToDevice, stream));
    FillE4m3Kernel<<<1024, 256, 0, stream>>>(a, M * K, 1);
    FillE4m3Kernel<<<1024, 256, 0, stream>>>(b, G * N * K, 2);
    FillScalesKernel<<<256, 256, 0, stream>>>(sa, KC * lds, 3, true);
    FillScalesKernel<<<256, 256, 0, stream>>>(sb, G * NB * KC, 4, false);
    CK(cudaGetLastError());
    for (int64_t g = 0; g < G; ++g) {
      const int rows = row_start[g + 1] - row_start[g];
      if (rows == 0) continue;
      RefKernel<<<dim3(N / 32, (rows + 31) / 32), dim3(32, 8), 0, stream>>>(a, sa, lds, b, sb, row_start[g], rows,
                                                                            (int)g, (int)K, (int)N, ref);
    }
    CK(cudaGetLastError());
    WaitOrDie(stream, c.name + " (reference)");

    auto call = [&](bool f32) {
      const cudaError_t e = WgmmaGroupedGemmFp8(reinterpret_cast<const __nv_fp8_e4m3*>(a), sa, lds, M, K,
                                                reinterpret_cast<const __nv_fp8_e4m3*>(b), sb, G, N, d_sizes, out,
                                                f32, num_sms, stream);
      if (e != cudaSuccess) {
        printf("case %s FAIL launch error: %s\n", c.name.c_str(), cudaGetErrorString(e));
        exit(2);
      }
    };
    float fp8_ms = 0.f;
    for (int f32 = 1; f32 >= 0; --f32) {
      const std::string vname = c.name + (f32 ? " out=f32" : " out=bf16");
      const int64_t out_bytes = M * N * (f32 ? 4 : 2);
      const CmpSummary cmp = CheckGroupedCall([&]() { call(f32); }, out, ref, total_rows, M, N, f32, d_res, stream,
                                              vname, f32 ? kTolF32 : kTolBf16);
      // The same call again (after timing, when timed): the output must be the same bits.
      unsigned long long diff = 0;
      const float ms = RepeatCall([&]() { call(f32); }, out, first, out_bytes, args.timing, d_diff, stream, vname, &diff);
      const bool pass = cmp.ok && diff == 0;
      if (!pass) ++failures;
      if (!f32) fp8_ms = ms;
      printf("case %-46s %-9s %s err=%.3e (max_err=%.3e max_ref=%.3e nonfinite=%llu badpad=%llu) repeat_diff=%llu "
             "ms=%.4f TFLOP/s=%.1f\n",
             c.name.c_str(), f32 ? "out=f32" : "out=bf16", pass ? "PASS" : "FAIL", cmp.rel, cmp.max_err, cmp.max_ref,
             cmp.res.bad_values, cmp.res.bad_zero, diff, ms, Tflops(flops, ms));
      fflush(stdout);
    }

    if (args.timing && !c.small) {
      // The library's bf16 grouped GEMM on bf16 operands of the same shape (w as stored, [G, K, N]).
      __nv_bfloat16 *a16, *b16;
      CK(cudaMalloc(&a16, M * K * 2));
      CK(cudaMalloc(&b16, G * N * K * 2));
      FillKernel<<<1024, 256, 0, stream>>>(a16, M * K, 5);
      FillKernel<<<1024, 256, 0, stream>>>(b16, G * N * K, 6);
      CK(cudaGetLastError());
      auto bf16_call = [&]() {
        const cudaError_t e = WgmmaGroupedGemm(a16, M, K, b16, G, N, false, d_sizes, out, false, num_sms, stream);
        if (e != cudaSuccess) {
          printf("case %s bf16 grouped GEMM launch error: %s\n", c.name.c_str(), cudaGetErrorString(e));
          exit(2);
        }
      };
      for (int i = 0; i < 3; ++i) bf16_call();
      WaitOrDie(stream, c.name + " bf16 (warm-up)");
      const float bf16_ms = MedianLaunchMs(stream, 20, bf16_call, [](int) {});
      CK(cudaFree(a16));
      CK(cudaFree(b16));
      char line[512];
      int len = snprintf(line, sizeof(line), "%-46s fp8 %7.1f | bf16 grouped %6.1f (fp8 %.2fx)", c.name.c_str(),
                         Tflops(flops, fp8_ms), Tflops(flops, bf16_ms), bf16_ms / fp8_ms);
#if PROBE_CUBLASLT
      // Dense [total_rows, K] @ [K, N]: the same FLOPs without grouping (x = our lhs, w = rhs[0]).
      const char* names[3] = {"cublasLt fp8 tensor-scaled", "+fast-accum", "block-scaled"};
      for (int mode = 0; mode < 3; ++mode) {
        std::string why;
        const float ms = cublas.Time(mode, a, sa, b, sb, total_rows, K, N, out, stream, &why);
        if (ms > 0)
          len += snprintf(line + len, sizeof(line) - len, " | %s %6.1f (fp8 %.2fx)", names[mode], Tflops(flops, ms),
                          ms / fp8_ms);
        else
          len += snprintf(line + len, sizeof(line) - len, " | %s n/a (%s)", names[mode], why.c_str());
      }
#endif
      printf("timing %s\n", line);
      summary.push_back(line);
      fflush(stdout);
    }
    CK(cudaFree(a));
    CK(cudaFree(b));
    CK(cudaFree(sa));
    CK(cudaFree(sb));
    CK(cudaFree(ref));
    CK(cudaFree(out));
    CK(cudaFree(first));
    CK(cudaFree(d_sizes));
    CK(cudaFree(d_res));
    CK(cudaFree(d_diff));
  }
  if (!summary.empty()) {
    printf("\nTFLOP/s (median of 20 launches after 3 warm-ups, bf16 outputs; FLOPs = 2 x routed rows x K x N):\n");
    for (const std::string& s : summary) printf("  %s\n", s.c_str());
  }
  printf("%s: %d failing variant(s)\n", failures ? "FAILED" : "ALL PASS", failures);
  return failures ? 1 : 0;
}
