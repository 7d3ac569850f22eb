// Push probe: what limits a consumer CTA's copy rate on one GPU: ring size, store lags, issuing threads and chunk
// size of the bulk-copy consumer, against CopyBand and the cudaMemcpyAsync ceiling.
//
// Copies `total` bytes in 512 KiB bands (64 rows of 8 KiB, the consumer's band at N = 4096 bf16) from one buffer to
// another of the same GPU with C CTAs, each taking bands c, c + C, ..., in these ways:
//   bulk W      StreamBands (transport/bulk_push.cuh, the consumer's) by W issuing threads per CTA (lane 0 of warps
//               0..W-1), each with its own ring of `slots` slots of 8, 16 or 32 KiB and every W-th of the CTA's bands
//   band T      CopyBand (device/copy.cuh's 16-loads-in-flight copy) by T threads per CTA
//   memcpy      cudaMemcpyAsync of all bytes (the copy ceiling bench_consumer.py reports)
// Median of --reps timed launches (CUDA events) after one warm-up; the destination is checked against the source
// after each configuration's first launch (poisoned before it).
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -I ffi -I ffi/include \
//     -o /tmp/push_probe tools/probes/push_probe.cu && /tmp/push_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/transport/bulk_push.cuh"
#include "probe_common.cuh"  // CK

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

// The two halves of a bulk copy alone, to see which one limits a CTA: `slots` chunks of kChunk in flight per issuer.
// Loads only (global -> shared, the destination is not written) or stores only (shared -> global, from whatever the
// ring holds: the destination's contents are not checked).
template <int kChunk, bool kStores>
__global__ void HalfKernel(const char* src, char* dst, int64_t bands, int issuers, int slots) {
  using namespace jmo::ptx;
  using namespace jmo::ptx::bulk;
  extern __shared__ __align__(128) char smem[];
  const int w = threadIdx.x / 32;
  if (threadIdx.x % 32 != 0 || w >= issuers) return;
  char* base = smem + (int64_t)w * PushRingBytes<kChunk>(slots);
  uint64_t* bars = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(base) + 127) & ~(uintptr_t)127);
  char* ring = reinterpret_cast<char*>(bars) + 128;
  for (int q = 0; q < slots; ++q) MbarInit(SmemAddr(&bars[q]), 1);
  MbarInitFence();
  constexpr int64_t kPerBand = kBand / kChunk;
  int64_t q = 0;
  for (int64_t b = blockIdx.x + (int64_t)w * gridDim.x; b < bands; b += (int64_t)issuers * gridDim.x) {
    for (int64_t c = 0; c < kPerBand; ++c, ++q) {
      const int slot = (int)(q % slots);
      if constexpr (kStores) {
        if (q >= slots) WaitStoresReadLag(slots - 1);
        Store(dst + b * kBand + c * kChunk, SmemAddr(ring + (int64_t)slot * kChunk), kChunk);
      } else {
        if (q >= slots) MbarWait(SmemAddr(&bars[slot]), (uint32_t)(((q / slots) - 1) & 1));
        MbarArriveExpectTx(SmemAddr(&bars[slot]), kChunk);
        Load(SmemAddr(ring + (int64_t)slot * kChunk), src + b * kBand + c * kChunk, kChunk, SmemAddr(&bars[slot]));
      }
    }
  }
  if constexpr (kStores) {
    WaitStores<0>();
  } else {
    for (int64_t r = q > slots ? q - slots : 0; r < q; ++r)
      MbarWait(SmemAddr(&bars[r % slots]), (uint32_t)((r / slots) & 1));
  }
}

// CopyBand's shape (device/copy.cuh): 16 independent 16-byte loads per thread, then their stores.
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
  std::vector<unsigned char> back(total);
  auto time = [&](const char* what, auto launch, bool check = true) {
    CK(cudaMemset(dst, 0xA5, total));
    launch();
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(st));
    CK(cudaMemcpy(back.data(), dst, total, cudaMemcpyDeviceToHost));
    const bool ok = memcmp(back.data(), h.data(), total) == 0;
    const float ms = MedianLaunchMs(st, reps, launch, [](int) {});
    const double gbs = total / (ms * 1e-3) / 1e9;
    printf("| %-40s | %8.3f | %7.1f | %s |\n", what, ms, gbs, !check ? "n/a" : ok ? "ok" : "WRONG");
    fflush(stdout);
    return gbs;
  };
  printf("push probe: %lld MiB in %lld bands of 512 KiB, median of %d\n", (long long)(total >> 20), (long long)bands,
         reps);
  printf("| config | ms | GB/s | check |\n|---|---|---|---|\n");
  time("memcpy", [&] { CK(cudaMemcpyAsync(dst, src, total, cudaMemcpyDeviceToDevice, st)); });
  char name[96];
  constexpr int kMaxSmem = 227 * 1024;
  // One bulk-copy configuration: C CTAs x W issuers, `slots` slots of kChunk bytes each; mode 0 copy, 1 loads only,
  // 2 stores only.
  auto bulk = [&](auto chunk, int C, int W, int slots, int mode) {
    constexpr int kChunk = decltype(chunk)::value;
    const int smem = W * PushRingBytes<kChunk>(slots);
    if (smem > kMaxSmem || slots < 1 || (mode == 0 && slots < 2)) return;
    const void* k = mode == 0 ? (const void*)BulkKernel<kChunk>
                    : mode == 1 ? (const void*)HalfKernel<kChunk, false> : (const void*)HalfKernel<kChunk, true>;
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    snprintf(name, sizeof name, "%s C=%d W=%d %d x %d KiB (%d KiB)", mode == 0 ? "bulk" : mode == 1 ? "loads" : "stores",
             C, W, slots, kChunk / 1024, smem / 1024);
    time(name, [&] {
      if (mode == 0) BulkKernel<kChunk><<<C, 32 * W, smem, st>>>(src, dst, bands, W, slots);
      else if (mode == 1) HalfKernel<kChunk, false><<<C, 32 * W, smem, st>>>(src, dst, bands, W, slots);
      else HalfKernel<kChunk, true><<<C, 32 * W, smem, st>>>(src, dst, bands, W, slots);
    }, mode == 0);
  };
  using K8 = std::integral_constant<int, 8192>;
  using K16 = std::integral_constant<int, 16384>;
  using K32 = std::integral_constant<int, 32768>;
  for (int C : {1, 16}) {
    // Bytes in flight per CTA: 96 KiB and ~192 KiB rings, split over 1..8 issuers and chunk sizes.
    for (int W : {1, 2, 4, 8}) {
      bulk(K8{}, C, W, 12 / W < 2 ? 2 : 12 / W, 0);
      bulk(K8{}, C, W, 24 / W < 2 ? 2 : 24 / W, 0);
      bulk(K16{}, C, W, 12 / W < 2 ? 2 : 12 / W, 0);
      bulk(K32{}, C, W, 6 / W < 2 ? 2 : 6 / W, 0);
    }
    for (int mode : {1, 2}) {
      for (int W : {1, 4}) {
        bulk(K8{}, C, W, 24 / W, mode);
        bulk(K32{}, C, W, 6 / W < 1 ? 1 : 6 / W, mode);
      }
    }
    for (int T : {256, 512}) {  // (1024 threads x 16 uint4 in flight do not fit the register file)
      snprintf(name, sizeof name, "band C=%d T=%d", C, T);
      time(name, [&] { BandKernel<<<C, T, 0, st>>>(src, dst, bands); });
    }
  }
  return 0;
}
