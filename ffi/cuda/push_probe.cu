// Push probe: what limits a consumer CTA's copy rate on one GPU (issue 4: the bulk-copy consumer measured a flat
// ~10 GB/s per CTA whatever its ring size or store lags; CopyBand 25 GB/s per CTA falling with C).
//
// Copies `total` bytes in 512 KiB bands (64 rows of 8 KiB, the consumer's band at N = 4096 bf16) from one buffer to
// another of the same GPU with C CTAs, each taking bands c, c + C, ..., in these ways:
//   bulk W      StreamBands (bulk_copy.cuh, the consumer's code) run by W issuing threads per CTA (lane 0 of warps
//               0..W-1), each with its own ring of `slots` slots of 8, 16 or 32 KiB and every W-th of the CTA's bands
//   band T      CopyBand (kernels.cu's 16-loads-in-flight copy) by T threads per CTA
//   memcpy      cudaMemcpyAsync of all bytes (the copy ceiling bench_consumer.py reports)
// Median of --reps timed launches (CUDA events) after one warm-up; the destination is checked against the source
// after each configuration's first launch (poisoned before it).
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -I ffi \
//     -o /tmp/push_probe ffi/cuda/push_probe.cu && /tmp/push_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/bulk_copy.cuh"
#include "cuda/wgmma/probe_common.cuh"  // CK

namespace {
using namespace jmo::cuda;

constexpr int64_t kBand = 64 * 8192;

template <int kChunk>
__global__ void BulkKernel(const char* src, char* dst, int64_t bands, int issuers, int slots) {
  extern __shared__ __align__(128) char smem[];
  const int w = threadIdx.x / 32;
  if (threadIdx.x % 32 != 0 || w >= issuers) return;
  // This issuer's bands: CTA-local index i -> global band blockIdx.x + (w + i * issuers) * gridDim.x.
  const int64_t mine_cta = blockIdx.x < bands ? (bands - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const int count = mine_cta > w ? (int)((mine_cta - 1 - w) / issuers + 1) : 0;
  if (count == 0) return;
  auto band = [&](int i) { return blockIdx.x + ((int64_t)w + (int64_t)i * issuers) * gridDim.x; };
  auto ready = [](int, bool) { return true; };
  auto band_of = [&](int i) { return PushBand{src + band(i) * kBand, dst + band(i) * kBand, kBand}; };
  auto done = [](int) {};
  StreamBands<kChunk>(count, ready, band_of, done, smem + (int64_t)w * PushRingBytes<kChunk>(slots), slots,
                      slots - 1 < kPushReadLag ? slots - 1 : kPushReadLag);
}

// CopyBand's shape (kernels.cu): 16 independent 16-byte loads per thread, then their stores.
__global__ void BandKernel(const char* src, char* dst, int64_t bands) {
  constexpr int kUnroll = 16;
  for (int64_t b = blockIdx.x; b < bands; b += gridDim.x) {
    const uint4* s = reinterpret_cast<const uint4*>(src + b * kBand);
    uint4* d = reinterpret_cast<uint4*>(dst + b * kBand);
    const int64_t n = kBand / 16;
    for (int64_t i = threadIdx.x; i < n; i += kUnroll * blockDim.x) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = __ldcg(s + i + u * blockDim.x);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) d[i + u * blockDim.x] = v[u];
    }
  }
}
}  // namespace

int main(int argc, char** argv) {
  int64_t total = 256ll << 20;
  int reps = 7;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--mib")) total = atoll(argv[i + 1]) << 20;
    if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
  }
  const int64_t bands = total / kBand;
  char *src, *dst;
  CK(cudaMalloc(&src, total));
  CK(cudaMalloc(&dst, total));
  std::vector<unsigned char> h(total);
  for (int64_t i = 0; i < total; ++i) h[i] = (unsigned char)((i * 2654435761ull) >> 13);
  CK(cudaMemcpy(src, h.data(), total, cudaMemcpyHostToDevice));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<unsigned char> back(total);
  auto time = [&](const char* what, auto launch) {
    CK(cudaMemset(dst, 0xA5, total));
    launch();
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(st));
    CK(cudaMemcpy(back.data(), dst, total, cudaMemcpyDeviceToHost));
    const bool ok = memcmp(back.data(), h.data(), total) == 0;
    std::vector<float> ms;
    for (int r = 0; r < reps; ++r) {
      CK(cudaEventRecord(e0, st));
      launch();
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float m;
      CK(cudaEventElapsedTime(&m, e0, e1));
      ms.push_back(m);
    }
    std::sort(ms.begin(), ms.end());
    const double gbs = total / (ms[ms.size() / 2] * 1e-3) / 1e9;
    printf("| %-24s | %8.3f | %7.1f | %s |\n", what, ms[ms.size() / 2], gbs, ok ? "ok" : "WRONG");
    fflush(stdout);
    return gbs;
  };
  printf("push probe: %lld MiB in %lld bands of 512 KiB, median of %d\n", (long long)(total >> 20), (long long)bands,
         reps);
  printf("| config | ms | GB/s | check |\n|---|---|---|---|\n");
  time("memcpy", [&] { CK(cudaMemcpyAsync(dst, src, total, cudaMemcpyDeviceToDevice, st)); });
  char name[64];
  // One bulk-copy configuration: C CTAs x W issuers, `slots` slots of kChunk bytes each.
  auto bulk = [&](auto chunk, int C, int W, int slots) {
    constexpr int kChunk = decltype(chunk)::value;
    const int smem = W * PushRingBytes<kChunk>(slots);
    if (smem > 200 * 1024) return;
    CK(cudaFuncSetAttribute(BulkKernel<kChunk>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    snprintf(name, sizeof name, "bulk C=%d W=%d slots=%d x %d KiB", C, W, slots, kChunk / 1024);
    time(name, [&] { BulkKernel<kChunk><<<C, 32 * W, smem, st>>>(src, dst, bands, W, slots); });
  };
  using K8 = std::integral_constant<int, 8192>;
  using K16 = std::integral_constant<int, 16384>;
  using K32 = std::integral_constant<int, 32768>;
  for (int C : {1, 4, 16}) {
    for (int W : {1, 2, 4, 8}) {
      for (int slots : {4, 12}) bulk(K8{}, C, W, slots);
      bulk(K16{}, C, W, 4);
      bulk(K32{}, C, W, 3);
    }
    for (int T : {256, 512}) {
      snprintf(name, sizeof name, "band C=%d T=%d", C, T);
      time(name, [&] { BandKernel<<<C, T, 0, st>>>(src, dst, bands); });
    }
  }
  return 0;
}
