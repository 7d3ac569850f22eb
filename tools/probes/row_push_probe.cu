// Row-push probe: bytes/s per pushing SM against bytes in flight, for the dispatch's row-granular pushes, by
// 16-byte stores (one warp per row, transport/row_push.cuh's CopyRowWarp and CopyRowPairWarp) and by TMA bulk copies
// (one issuing thread per ring: transport/bulk_push.cuh's StreamBands with each row a band, and the lean ring below,
// one bulk load and one bulk store per row and no other bookkeeping, with one to sixteen issuers per CTA).
//
// Rows of `row` bytes are copied from a source buffer to scattered destination rows (a fixed random permutation, as
// the dispatch writes each slot's row into the peer's recv row of its expert), by C CTAs of one GPU. Each
// configuration reports GB/s in all and per CTA, and the bytes each CTA keeps in flight: W warps x 32 lanes x 8
// loads x 16 B for the warp copies (twice that for the pair copy), issuers x slots x chunk for the bulk copies. On
// one GPU the stores land in HBM; the rate per CTA at a given bytes-in-flight is inflight / latency, so the curve
// gives the latency the copy sees, from which the SMs a push needs over a link of another latency follow
// (docs/design.md, "How many SMs the push needs").
//
// The destination is poisoned before each configuration's first launch and compared with the permuted source after
// it; medians of --reps timed launches (CUDA events) after that check.
//
// With --peer D the destination rows are GPU D's memory (peer access from GPU 0, whose SMs copy): the stores cross
// the link (NVLink between H100s / H200s), the loads stay in GPU 0's HBM, as the dispatch's pushers and the combine's
// consumer push; the curve then gives the SMs a push needs over that link (issue 34's check of design.md's
// prediction). GPU D must exist and be reachable by peer access, else the probe says which and exits 2.
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -I ffi -I ffi/include \
//     -o /tmp/row_push_probe tools/probes/row_push_probe.cu && /tmp/row_push_probe --mib 64 [--peer 1]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "probe_common.cuh"    // CK, MedianLaunchMs
#include "row_copy_kernels.cuh"  // the copies

using namespace jmo::cuda;
using namespace row_copy;

int main(int argc, char** argv) {
  int64_t total = 64ll << 20;
  int reps = 7;
  std::vector<int64_t> row_sizes = {4096, 14336};  // D = 2048 and D = 7168 in bf16
  int peer = -1;                                   // -1: the destination on GPU 0 too
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--mib")) total = atoll(argv[i + 1]) << 20;
    if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
    if (!strcmp(argv[i], "--row")) row_sizes = {atoll(argv[i + 1])};
    if (!strcmp(argv[i], "--peer")) peer = atoi(argv[i + 1]);
  }
  CK(cudaSetDevice(0));
  if (peer >= 0) {
    int gpus = 0, can = 0;
    CK(cudaGetDeviceCount(&gpus));
    if (peer == 0 || peer >= gpus) {
      fprintf(stderr, "row_push_probe: --peer %d: this machine has %d GPU(s), and GPU 0 pushes (the peer must be "
              "another GPU)\n", peer, gpus);
      return 2;
    }
    CK(cudaDeviceCanAccessPeer(&can, 0, peer));
    if (!can) {
      fprintf(stderr, "row_push_probe: --peer %d: GPU 0 has no peer access to GPU %d\n", peer, peer);
      return 2;
    }
    CK(cudaDeviceEnablePeerAccess(peer, 0));
  }
  const RowBuffers buf = MakeRowBuffers(total, peer);
  char *src = buf.src, *dst = buf.dst;
  std::vector<unsigned char> back(total);
  const std::vector<unsigned char> poison(total, 0xA5);
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  char where[64] = "one GPU";
  if (peer >= 0) snprintf(where, sizeof where, "GPU 0's SMs into GPU %d's memory (peer access)", peer);
  printf("row push probe: %lld MiB of rows to scattered destination rows, %s, median of %d\n",
         (long long)(total >> 20), where, reps);
  printf("| row B | copy | CTAs | in flight per CTA KiB | us | GB/s | GB/s per CTA | check |\n|---|---|---|---|---|---|---|---|\n");
  for (const int64_t row : row_sizes) {
    const int64_t rows = total / row;
    const RowPerm pm = MakeRowPerm(buf, rows, row);
    int32_t* d_perm = pm.dst_row;
    const std::vector<unsigned char>& want = pm.want;
    const int64_t bytes = rows * row;
    // Configurations whose threads the kernel's registers do not allow are skipped (printed as such).
    auto fits = [&](const void* kernel, int threads, const char* what) {
      cudaFuncAttributes a;
      CK(cudaFuncGetAttributes(&a, kernel));
      if (a.maxThreadsPerBlock >= threads) return true;
      printf("| %lld | %s | - | - | - | - | - | skipped: %d threads, at most %d |\n", (long long)row, what, threads,
             a.maxThreadsPerBlock);
      return false;
    };
    auto time = [&](const char* what, int C, double inflight_kib, auto launch) {
      CK(cudaMemcpy(dst, poison.data(), total, cudaMemcpyHostToDevice));  // (dst may be a peer's: a copy, not a memset)
      launch();
      CK(cudaGetLastError());
      CK(cudaStreamSynchronize(st));
      CK(cudaMemcpy(back.data(), dst, bytes, cudaMemcpyDeviceToHost));
      const bool ok = memcmp(back.data(), want.data(), bytes) == 0;
      const float ms = MedianLaunchMs(st, reps, launch, [](int) {});
      const double gbs = bytes / (ms * 1e-3) / 1e9;
      printf("| %lld | %s | %d | %.0f | %.1f | %.1f | %.2f | %s |\n", (long long)row, what, C, inflight_kib, ms * 1e3,
             gbs, gbs / C, ok ? "ok" : "WRONG");
      fflush(stdout);
    };
    char name[96];
    for (int C : {1, 2, 4, 8, 16}) {
      for (int W : {4, 8, 16, 32}) {
        snprintf(name, sizeof name, "16B warp W=%d", W);
        if (fits((const void*)WarpRowsKernel<false>, 32 * W, name))
          time(name, C, W * 4.0, [&] { WarpRowsKernel<false><<<C, 32 * W, 0, st>>>(src, dst, d_perm, rows, row); });
        snprintf(name, sizeof name, "16B warp pair W=%d", W);
        if (fits((const void*)WarpRowsKernel<true>, 32 * W, name))
          time(name, C, W * 8.0, [&] { WarpRowsKernel<true><<<C, 32 * W, 0, st>>>(src, dst, d_perm, rows, row); });
      }
      using K4 = std::integral_constant<int, 4096>;
      using K8 = std::integral_constant<int, 8192>;
      auto bulk = [&](auto chunk, int I, int slots) {
        constexpr int kChunk = decltype(chunk)::value;
        const int smem = I * PushRingBytes<kChunk>(slots);
        if (smem > 227 * 1024) return;
        CK(cudaFuncSetAttribute((const void*)BulkRowsKernel<kChunk>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                smem));
        snprintf(name, sizeof name, "TMA bulk I=%d %d x %d KiB", I, slots, kChunk / 1024);
        time(name, C, I * slots * kChunk / 1024.0, [&] {
          BulkRowsKernel<kChunk><<<C, 32 * I, smem, st>>>(src, dst, d_perm, rows, row, I, slots);
        });
      };
      auto lean = [&](auto slots, auto ahead, int I) {
        constexpr int kS = decltype(slots)::value, kA = decltype(ahead)::value;
        const int smem = PrepareLeanBulkRows<kS, kA>(I, row);
        if (smem == 0) return;
        snprintf(name, sizeof name, "lean TMA I=%d %d slots, %d ahead", I, kS, kA);
        time(name, C, smem / 1024.0, [&] {
          LeanBulkRowsKernel<kS, kA><<<C, 32 * I, smem, st>>>(src, dst, d_perm, rows, row, I);
        });
      };
      using std::integral_constant;
      lean(integral_constant<int, 4>{}, integral_constant<int, 2>{}, 1);
      lean(integral_constant<int, 12>{}, integral_constant<int, 8>{}, 1);
      lean(integral_constant<int, 24>{}, integral_constant<int, 16>{}, 1);
      lean(integral_constant<int, 48>{}, integral_constant<int, 32>{}, 1);
      lean(integral_constant<int, 12>{}, integral_constant<int, 8>{}, 2);
      lean(integral_constant<int, 24>{}, integral_constant<int, 16>{}, 2);
      lean(integral_constant<int, 12>{}, integral_constant<int, 8>{}, 4);
      lean(integral_constant<int, 6>{}, integral_constant<int, 4>{}, 4);
      lean(integral_constant<int, 6>{}, integral_constant<int, 4>{}, 8);
      lean(integral_constant<int, 3>{}, integral_constant<int, 2>{}, 16);
      for (int I : {1, 2, 4}) {
        bulk(K4{}, I, 8);
        bulk(K8{}, I, 8);
        bulk(K8{}, I, 24 / I);
      }
    }
    CK(cudaFree(d_perm));
  }
  return 0;
}
