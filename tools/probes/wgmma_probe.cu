// Standalone probe for gemm/sm90/wgmma_grouped.cuh: correctness against a naive fp32 GPU reference, then timing.
//   wgmma_probe [--small-only] [--no-timing]
// Exit codes: 0 all PASS, 1 some FAIL, 2 CUDA error, 3 watchdog timeout.
#include "cuda/gemm/sm90/wgmma_grouped.cuh"
#include "probe_common.cuh"

// [G, K, N] -> [G, N, K]
__global__ void TransposeKernel(const __nv_bfloat16* in, __nv_bfloat16* out, int K, int N) {
  __shared__ __nv_bfloat16 t[32][33];
  const int64_t g = blockIdx.z;
  const int k0 = blockIdx.y * 32, n0 = blockIdx.x * 32;
  const __nv_bfloat16* src = in + g * K * (int64_t)N;
  __nv_bfloat16* dst = out + g * K * (int64_t)N;
  for (int i = threadIdx.y; i < 32; i += blockDim.y) t[i][threadIdx.x] = src[(int64_t)(k0 + i) * N + n0 + threadIdx.x];
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += blockDim.y) dst[(int64_t)(n0 + i) * K + k0 + threadIdx.x] = t[threadIdx.x][i];
}

// tile_done of the callback variants: counts every 64-row band of every group once per finished tile that covers
// it (a 128-row tile covers 1 or 2 bands of its group), and checks that two far corners of the tile, stored by
// other consumer threads, are already visible (not the NaN poison) to the calling thread.
struct BandCounter {
  unsigned* band_count;   // [total bands]
  const int* band_base;   // [G] index of group g's first band
  unsigned* stats;        // [0] tiles seen, [1] tiles whose corners were still poison, [2] calls by a thread != 128
  bool out_f32;
  __device__ void operator()(const wgmma_gemm::GroupTile& t) const {
    atomicAdd(&stats[0], 1u);
    if (threadIdx.x != 128) atomicAdd(&stats[2], 1u);
    const int b0 = t.group_row / 64, nb = (t.rows + 63) / 64;
    for (int j = 0; j < nb; ++j) atomicAdd(&band_count[band_base[t.b_idx] + b0 + j], 1u);
    if (t.rows > 0) {
      bool bad = false;
      const int64_t far = (int64_t)(t.rows - 1) * t.ldc + t.cols - 1, mid = (int64_t)(t.rows / 2) * t.ldc + t.cols / 2;
      if (out_f32) {
        const unsigned* o = static_cast<const unsigned*>(t.out);
        bad = __ldcg(o + far) == 0xFFFFFFFFu || __ldcg(o + mid) == 0xFFFFFFFFu;
      } else {
        const unsigned short* o = static_cast<const unsigned short*>(t.out);
        bad = __ldcg(o + far) == 0xFFFFu || __ldcg(o + mid) == 0xFFFFu;
      }
      if (bad) atomicAdd(&stats[1], 1u);
    }
  }
};

int main(int argc, char** argv) {
  const ProbeArgs args = ParseProbeArgs(argc, argv);
  const int num_sms = ProbeDevice(wgmma_gemm::kSmemBytes);
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  std::vector<Case> cases = {
      {"small_M300_K128_N192_G3", 300, 128, 192, {0, 130, 170}, true},
      {"small_pad_M300_K128_N64_G4", 300, 128, 64, {7, 0, 100, 93}, true},
      {"small_clamp_M300_K192_N320_G2", 300, 192, 320, {250, 250}, true},
      {"small_many_M1000_K64_N128_G40", 1000, 64, 128, RandomSizes(1000, 40, 7, 0.8), true},
      {"small_rows1_M5_K64_N64_G3", 5, 64, 64, {1, 0, 3}, true},
      {"M16384_K2048_N4096_G8_balanced", 16384, 2048, 4096, Balanced(16384, 8), false},
      {"M16384_K2048_N4096_G8_skew60", 16384, 2048, 4096, Skewed(16384, 8, 2, 0.6), false},
      {"M16384_K2048_N4096_G64_random", 16384, 2048, 4096, RandomSizes(16384, 64, 11, 1.0), false},
      {"M16384_K2048_N4096_G64_pad90", 16384, 2048, 4096, RandomSizes(16384, 64, 13, 0.9), false},
      {"M16384_K4096_N14336_G8_balanced", 16384, 4096, 14336, Balanced(16384, 8), false},
      {"M65536_K2048_N7168_G32_balanced", 65536, 2048, 7168, Balanced(65536, 32), false},
      {"dense_ref_M8192_K8192_N8192_G1", 8192, 8192, 8192, {8192}, false},
  };

  int failures = 0;
  for (const Case& c : cases) {
    if (args.small_only && !c.small) continue;
    const int64_t M = c.M, K = c.K, N = c.N, G = (int64_t)c.sizes.size();
    const std::vector<int> row_start = ClampedRowStart(c.sizes, M);
    const int64_t total_rows = row_start[G];
    const double flops = 2.0 * (double)total_rows * (double)K * (double)N;

    __nv_bfloat16 *lhs, *rhs_kn, *rhs_nk;
    float* ref;
    void* out;
    int32_t* d_sizes;
    int* d_row_start;
    CmpResult* d_res;
    CK(cudaMalloc(&lhs, M * K * 2));
    CK(cudaMalloc(&rhs_kn, G * K * N * 2));
    CK(cudaMalloc(&rhs_nk, G * K * N * 2));
    CK(cudaMalloc(&ref, M * N * 4));
    CK(cudaMalloc(&out, M * N * 4));
    CK(cudaMalloc(&d_sizes, G * 4));
    CK(cudaMalloc(&d_row_start, (G + 1) * 4));
    CK(cudaMalloc(&d_res, sizeof(CmpResult)));
    // Bands of 64 rows per group (clamped sizes), for the callback variants.
    std::vector<int> band_base(G, 0);
    int total_bands = 0;
    for (int64_t g = 0; g < G; ++g) {
      band_base[g] = total_bands;
      total_bands += (row_start[g + 1] - row_start[g] + 63) / 64;
    }
    const unsigned n_tiles = (unsigned)((N + wgmma_gemm::kBN - 1) / wgmma_gemm::kBN);
    unsigned *d_band_count, *d_stats;
    int* d_band_base;
    CK(cudaMalloc(&d_band_count, std::max(total_bands, 1) * sizeof(unsigned)));
    CK(cudaMalloc(&d_stats, 3 * sizeof(unsigned)));
    CK(cudaMalloc(&d_band_base, G * sizeof(int)));
    CK(cudaMemcpyAsync(d_band_base, band_base.data(), G * sizeof(int), cudaMemcpyHostToDevice, stream));
    CK(cudaMemcpyAsync(d_sizes, c.sizes.data(), G * 4, cudaMemcpyHostToDevice, stream));
    CK(cudaMemcpyAsync(d_row_start, row_start.data(), (G + 1) * 4, cudaMemcpyHostToDevice, stream));
    FillKernel<<<1024, 256, 0, stream>>>(lhs, M * K, 1);
    FillKernel<<<1024, 256, 0, stream>>>(rhs_kn, G * K * N, 2);
    CK(cudaGetLastError());
    TransposeKernel<<<dim3(N / 32, K / 32, G), dim3(32, 8), 0, stream>>>(rhs_kn, rhs_nk, (int)K, (int)N);
    CK(cudaGetLastError());
    RefKernel<<<dim3((N + 31) / 32, (M + 7) / 8), dim3(32, 8), 0, stream>>>(lhs, rhs_kn, d_row_start, (int)G, (int)M,
                                                                              (int)K, (int)N, ref);
    CK(cudaGetLastError());
    WaitOrDie(stream, c.name + " (reference)");

    // Variants 0-3: {rhs[G,K,N], rhs[G,N,K]} x {bf16, f32} out, plain. 4: rhs[G,K,N] bf16 (the expert_combine
    // configuration) and 5: rhs[G,N,K] f32 through the tile_done callback (BandCounter).
    for (int variant = 0; variant < 6; ++variant) {
      const bool cb = variant >= 4;
      const bool k_major = cb ? variant == 5 : variant >= 2, f32 = cb ? variant == 5 : variant % 2;
      const std::string vname = c.name + (k_major ? " rhs[G,N,K]" : " rhs[G,K,N]") + (f32 ? " out=f32" : " out=bf16") +
                                (cb ? " callback" : "");
      const __nv_bfloat16* rhs = k_major ? rhs_nk : rhs_kn;
      const BandCounter counter{d_band_count, d_band_base, d_stats, f32};
      if (cb) {
        CK(cudaMemsetAsync(d_band_count, 0, std::max(total_bands, 1) * sizeof(unsigned), stream));
        CK(cudaMemsetAsync(d_stats, 0, 3 * sizeof(unsigned), stream));
      }
      auto call = [&]() {
        const cudaError_t e =
            cb ? wgmma_gemm::GroupedGemmWithDone(lhs, M, K, rhs, G, N, k_major, d_sizes, out, f32, num_sms, counter,
                                                 stream)
               : WgmmaGroupedGemm(lhs, M, K, rhs, G, N, k_major, d_sizes, out, f32, num_sms, stream);
        if (e != cudaSuccess) {
          printf("case %s FAIL launch error: %s\n", vname.c_str(), cudaGetErrorString(e));
          exit(2);
        }
      };
      const CmpSummary cmp = CheckGroupedCall(call, out, ref, total_rows, M, N, f32, d_res, stream, vname);
      bool pass = cmp.ok;
      std::string cb_note;
      if (cb) {
        // Right after the first call: every band counted exactly n_tiles times, one call per tile, by thread 128.
        std::vector<unsigned> counts(std::max(total_bands, 1));
        unsigned stats[3];
        CK(cudaMemcpyAsync(counts.data(), d_band_count, counts.size() * sizeof(unsigned), cudaMemcpyDeviceToHost,
                           stream));
        CK(cudaMemcpyAsync(stats, d_stats, sizeof(stats), cudaMemcpyDeviceToHost, stream));
        WaitOrDie(stream, vname + " (band counts)");
        int wrong = 0;
        for (int b = 0; b < total_bands; ++b) wrong += counts[b] != n_tiles;
        unsigned long long exp_tiles = 0;
        for (int64_t g = 0; g < G; ++g) exp_tiles += (unsigned long long)((row_start[g + 1] - row_start[g] + 127) / 128) * n_tiles;
        const bool cb_ok = wrong == 0 && stats[0] == exp_tiles && stats[1] == 0 && stats[2] == 0;
        char buf[200];
        snprintf(buf, sizeof(buf), " bands=%d wrong_bands=%d tiles=%u/%llu not_visible=%u wrong_thread=%u", total_bands,
                 wrong, stats[0], exp_tiles, stats[1], stats[2]);
        cb_note = buf;
        pass = pass && cb_ok;
      }
      if (!pass) ++failures;

      const double ms = args.timing ? TimeCalls(call, 5, 20, stream, vname) : 0.0;
      printf("case %-34s %-12s %-9s%s %s err=%.3e (max_err=%.3e max_ref=%.3e nonfinite=%llu badpad=%llu) ms=%.4f "
             "TFLOP/s=%.1f%s\n",
             c.name.c_str(), k_major ? "rhs[G,N,K]" : "rhs[G,K,N]", f32 ? "out=f32" : "out=bf16", cb ? " cb" : "",
             pass ? "PASS" : "FAIL", cmp.rel, cmp.max_err, cmp.max_ref, cmp.res.bad_values, cmp.res.bad_zero, ms,
             ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0, cb_note.c_str());
      fflush(stdout);
    }
    CK(cudaFree(lhs));
    CK(cudaFree(rhs_kn));
    CK(cudaFree(rhs_nk));
    CK(cudaFree(ref));
    CK(cudaFree(out));
    CK(cudaFree(d_sizes));
    CK(cudaFree(d_row_start));
    CK(cudaFree(d_res));
    CK(cudaFree(d_band_count));
    CK(cudaFree(d_stats));
    CK(cudaFree(d_band_base));
  }
  printf("%s: %d failing variant(s)\n", failures ? "FAILED" : "ALL PASS", failures);
  return failures ? 1 : 0;
}
