// Push-beside-GEMM probe: what a pushing CTA moves while the bf16 grouped GEMM runs on the GPU's other SMs, the
// situation of dispatch_gemm's pushers (docs/design.md, "The pushers' rate"): alone on the GPU a pusher moves 35-47 GB/s
// of 4 KiB rows (row_push_probe.cu), beside the fused call's GEMM 17-22 GB/s, whether it copies with 16-byte warp
// stores, through shared memory, or by TMA bulk copies. This probe takes the fused kernel apart: the pushing CTAs are a
// kernel of their own on C SMs (row_copy_kernels.cuh's copies), the GEMM (WgmmaGroupedGemm) another on the other
// SMs - C, launched first on another stream and repeated so that it runs through the whole push; a one-thread delay
// kernel ahead of the push on its stream lets the GEMM's CTAs take their SMs first.
//
// Per configuration (copy, C): the push alone (GB/s per CTA), the push beside the GEMM (GB/s per CTA, and whether it
// ended before the GEMM's last launch did: "inside"), and the GEMM's time per launch on SMs - C with and without the
// push beside it. The push's rows are checked against the permuted source after the first push beside the GEMM.
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -I ffi -I ffi/include \
//     -o /tmp/push_beside_gemm_probe tools/probes/push_beside_gemm_probe.cu && /tmp/push_beside_gemm_probe
//   options: --mib 64 (the rows pushed) --reps 5 --row 4096 --m 16384 --k 2048 --n 4096 --groups 4 (the GEMM:
//   [m, k] x [groups, k, n], bf16, balanced groups: dispatch_gemm's GEMM1 at one rank of the seed shape)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/gemm/sm90/wgmma_grouped.cuh"
#include "probe_common.cuh"      // CK, FillKernel, Balanced, MedianLaunchMs
#include "row_copy_kernels.cuh"  // the copies

using namespace row_copy;

// Holds its stream for `ns` nanoseconds (%globaltimer): the GEMM's CTAs, launched just before on another stream, take
// their SMs meanwhile.
__global__ void DelayKernel(uint64_t ns) {
  uint64_t t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (uint64_t t = t0; t - t0 < ns;) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
}

int main(int argc, char** argv) {
  int64_t total = 64ll << 20, row = 4096, M = 16384, K = 2048, N = 4096;
  int reps = 5, G = 4;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--mib")) total = atoll(argv[i + 1]) << 20;
    if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
    if (!strcmp(argv[i], "--row")) row = atoll(argv[i + 1]);
    if (!strcmp(argv[i], "--m")) M = atoll(argv[i + 1]);
    if (!strcmp(argv[i], "--k")) K = atoll(argv[i + 1]);
    if (!strcmp(argv[i], "--n")) N = atoll(argv[i + 1]);
    if (!strcmp(argv[i], "--groups")) G = atoi(argv[i + 1]);
  }
  if (reps < 1 || row % 16 != 0 || total < row || G < 1 || M % G != 0) {
    fprintf(stderr, "bad arguments\n");
    return 2;
  }
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));

  // The rows: a random permutation of `rows` rows of `row` bytes.
  const int64_t rows = total / row, bytes = rows * row;
  const RowBuffers buf = MakeRowBuffers(bytes);
  char *src = buf.src, *dst = buf.dst;
  const RowPerm pm = MakeRowPerm(buf, rows, row);
  const int32_t* d_perm = pm.dst_row;
  const std::vector<unsigned char>& want = pm.want;
  std::vector<unsigned char> back(bytes);

  // The GEMM: random bf16 operands, balanced groups, B MN-major (GEMM1's layout).
  __nv_bfloat16 *lhs, *rhs, *out;
  int32_t* d_sizes;
  CK(cudaMalloc(&lhs, M * K * sizeof(__nv_bfloat16)));
  CK(cudaMalloc(&rhs, (int64_t)G * K * N * sizeof(__nv_bfloat16)));
  CK(cudaMalloc(&out, M * N * sizeof(__nv_bfloat16)));
  CK(cudaMalloc(&d_sizes, G * sizeof(int32_t)));
  FillKernel<<<1024, 256>>>(lhs, M * K, 11);
  FillKernel<<<1024, 256>>>(rhs, (int64_t)G * K * N, 12);
  const std::vector<int32_t> sizes = Balanced(M, G);
  CK(cudaMemcpy(d_sizes, sizes.data(), G * sizeof(int32_t), cudaMemcpyHostToDevice));
  CK(cudaDeviceSynchronize());

  cudaStream_t sg, sp;
  CK(cudaStreamCreateWithFlags(&sg, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&sp, cudaStreamNonBlocking));
  cudaEvent_t g0, g1, p0, p1;
  for (cudaEvent_t* e : {&g0, &g1, &p0, &p1}) CK(cudaEventCreate(e));
  auto gemm = [&](int grid, cudaStream_t s) {
    CK(WgmmaGroupedGemm(lhs, M, K, rhs, G, N, /*rhs_k_major=*/false, d_sizes, out, /*out_f32=*/false, grid, s));
  };
  auto elapsed = [](cudaEvent_t a, cudaEvent_t b) {
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    return ms;
  };
  const double gemm_flops = 2.0 * (double)M * K * N;

  printf("push beside GEMM probe: %lld MiB of %lld-byte rows to scattered rows; GEMM [%lld, %lld] x [%d, %lld, %lld] "
         "bf16 on the other SMs (%d in all); medians of %d\n",
         (long long)(bytes >> 20), (long long)row, (long long)M, (long long)K, G, (long long)K, (long long)N, sms, reps);
  printf("| copy | C | alone GB/s per CTA | beside GB/s per CTA | beside / alone | inside | GEMM us per launch on %s, "
         "alone / beside the push | check |\n|---|---|---|---|---|---|---|---|\n", "SMs - C");
  for (int C : {2, 4, 8, 16}) {
    const int gemm_grid = sms - C;
    // The GEMM alone on its SMs (after one warm-up launch).
    gemm(gemm_grid, sg);
    CK(cudaStreamSynchronize(sg));
    const float gemm_ms = MedianLaunchMs(sg, reps, [&] { gemm(gemm_grid, sg); }, [](int) {});

    auto run = [&](const char* what, auto launch) {
      // Alone (after one warm-up launch).
      launch(sp);
      CK(cudaStreamSynchronize(sp));
      const float alone_ms = MedianLaunchMs(sp, reps, [&] { launch(sp); }, [](int) {});
      // Beside: enough GEMM launches to cover the delay and twice the push alone.
      const int launches = std::max(2, (int)std::ceil((0.05 + 2.0 * alone_ms) / gemm_ms) + 1);
      std::vector<float> beside, gemm_beside;
      bool inside = true, ok = true;
      for (int r = 0; r < reps; ++r) {
        if (r == 0) CK(cudaMemset(dst, 0xA5, bytes));
        CK(cudaDeviceSynchronize());
        CK(cudaEventRecord(g0, sg));
        for (int l = 0; l < launches; ++l) gemm(gemm_grid, sg);
        CK(cudaEventRecord(g1, sg));
        DelayKernel<<<1, 1, 0, sp>>>(50000);
        CK(cudaEventRecord(p0, sp));
        launch(sp);
        CK(cudaEventRecord(p1, sp));
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        beside.push_back(elapsed(p0, p1));
        gemm_beside.push_back(elapsed(g0, g1) / launches);
        inside = inside && elapsed(p1, g1) > 0.0f;
        if (r == 0) {
          CK(cudaMemcpy(back.data(), dst, bytes, cudaMemcpyDeviceToHost));
          ok = memcmp(back.data(), want.data(), bytes) == 0;
        }
      }
      std::sort(beside.begin(), beside.end());
      std::sort(gemm_beside.begin(), gemm_beside.end());
      const double a = bytes / (alone_ms * 1e-3) / 1e9 / C, b = bytes / (beside[beside.size() / 2] * 1e-3) / 1e9 / C;
      printf("| %s | %d | %.1f | %.1f | %.2f | %s | %.1f / %.1f (%.0f / %.0f TFLOP/s) | %s |\n", what, C, a, b, b / a,
             inside ? "yes" : "no", gemm_ms * 1e3, gemm_beside[gemm_beside.size() / 2] * 1e3,
             gemm_flops / (gemm_ms * 1e-3) / 1e12, gemm_flops / (gemm_beside[gemm_beside.size() / 2] * 1e-3) / 1e12,
             ok ? "ok" : "WRONG");
      fflush(stdout);
    };
    run("16B warp, 12 warps (a pusher's)", [&](cudaStream_t s) {
      WarpRowsKernel<false><<<C, 384, 0, s>>>(src, dst, d_perm, rows, row);
    });
    run("16B warp pair, 12 warps", [&](cudaStream_t s) {
      WarpRowsKernel<true><<<C, 384, 0, s>>>(src, dst, d_perm, rows, row);
    });
    auto lean = [&](auto slots, auto ahead, int I) {
      constexpr int kS = decltype(slots)::value, kA = decltype(ahead)::value;
      const int smem = PrepareLeanBulkRows<kS, kA>(I, row);
      if (smem == 0) return;
      char name[64];
      snprintf(name, sizeof name, "lean TMA, %d issuers x %d slots", I, kS);
      run(name, [&](cudaStream_t s) {
        LeanBulkRowsKernel<kS, kA><<<C, 32 * I, smem, s>>>(src, dst, d_perm, rows, row, I);
      });
    };
    using std::integral_constant;
    lean(integral_constant<int, 5>{}, integral_constant<int, 3>{}, 8);
    lean(integral_constant<int, 3>{}, integral_constant<int, 2>{}, 16);
  }
  return 0;
}
