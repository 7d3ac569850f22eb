// Copy-engine transport probe: what it costs to move finished segments with the copy engines instead of SMs.
//
// A transport that takes no SMs from the GEMM has a side stream wait on a device flag per segment
// (cuStreamWaitValue32), then copy the segment: no host round trip, no SM. One GPU has no NVLink peer, and the driver
// runs a plain same-device cudaMemcpyAsync on SMs, so the probe compares three copy paths:
//   sm-copy   cudaMemcpyAsync device to device (the driver's choice: a copy kernel on SMs);
//   ce-copy   cudaMemcpyBatchAsync device to device with cudaMemcpyFlagPreferOverlapWithCompute (a hint that asks for
//             the copy engines; whether it got them shows in table 3: an SM-bound kernel beside it keeps its speed);
//   to-host   cudaMemcpyAsync device to pinned host (the copy engines over PCIe, whatever the driver prefers);
// and measures
//   1. bandwidth of back-to-back copies by segment size (the per-copy overhead shows at small sizes);
//   2. trigger latency: a producer kernel publishes segments one by one (a spin of `gap_us` between them stands in for
//      the GEMM tiles that finish a segment), each copy waits for its flag, and an observer kernel records when the
//      segment's last word lands. Latency = arrival - publish, both read from %globaltimer on the same GPU;
//   3. the slowdown of an SM-bound kernel (an FMA chain on every SM), an HBM-bound one (a 1 GiB stream) and the
//      library's grouped GEMM (GroupedMatmul, bf16: the seed shape's GEMM1 and one 8192^3 group) while each copy
//      path runs beside it, and beside C CTAs of an SM copy kernel (the stand-in of C consumer CTAs), with the
//      bandwidth the copies reached meanwhile.
// Every CUDA call is checked; every wait, on the host and in the device code, is bounded and names what it gave up on.
//
//   cmake -S tools -B build/tools && cmake --build build/tools --target copy_engine_probe && \
//     build/tools/copy_engine_probe
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cuda/ops/grouped_gemm.h"

#define CHECK(x)                                                                                  \
  do {                                                                                            \
    cudaError_t e_ = (x);                                                                         \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

namespace {

constexpr uint64_t kSpinLimitNs = 2'000'000'000;  // every device wait gives up after 2 s

__device__ uint64_t GlobalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Waits (bounded) until the host has enqueued every flag-gated copy and raised *go, so the latencies do not include
// the host's enqueueing; then publishes segment i after gap_ns of spinning: writes its sentinel into the source, then
// releases flag i. err[0] = -1 if *go never came.
__global__ void ProducerKernel(uint32_t* src_last_words, int64_t words_per_seg, uint32_t* flags, int segs,
                               uint64_t gap_ns, uint32_t epoch, uint64_t* t_publish, const volatile uint32_t* go,
                               int* err) {
  if (threadIdx.x != 0) return;
  const uint64_t start = GlobalTimer();
  while (*go != epoch) {
    if (GlobalTimer() - start > kSpinLimitNs) {
      err[0] = -1;
      epoch = 0xffffffffu;  // release every copy, so that nothing stays blocked on the device
      for (int i = 0; i < segs; ++i) flags[i] = epoch;
      return;
    }
  }
  for (int i = 0; i < segs; ++i) {
    uint64_t t0 = GlobalTimer();
    while (GlobalTimer() - t0 < gap_ns) {
    }
    src_last_words[(i + 1) * words_per_seg - 1] = epoch * 1000003u + i;
    __threadfence_system();
    t_publish[i] = GlobalTimer();
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(flags + i), "r"(epoch) : "memory");
  }
}

// Records when each segment's sentinel arrives in the destination. err[0] = 1 + the segment it gave up on.
__global__ void ObserverKernel(const volatile uint32_t* dst, int64_t words_per_seg, int segs, uint32_t epoch,
                               uint64_t* t_arrive, int* err) {
  if (threadIdx.x != 0) return;
  uint64_t start = GlobalTimer();
  for (int i = 0; i < segs; ++i) {
    const uint32_t want = epoch * 1000003u + i;
    while (dst[(i + 1) * words_per_seg - 1] != want) {
      if (GlobalTimer() - start > kSpinLimitNs) {
        err[0] = 1 + i;
        return;
      }
    }
    t_arrive[i] = GlobalTimer();
  }
}

// An SM-bound kernel: every thread runs a dependent FMA chain (no memory traffic beyond one store).
__global__ void FmaKernel(float* out, int iters) {
  float a = threadIdx.x * 1e-3f, b = 1.0001f, c = 0.9999f;
  for (int i = 0; i < iters; ++i) {
    a = fmaf(a, b, c);
    b = fmaf(b, c, a * 1e-9f);
  }
  if (a == 12345.f) out[blockIdx.x] = a + b;
}

// An HBM-bound kernel: streams n float4s from in to out (a GEMM's operand reads stand in for this kind of load).
__global__ void StreamKernel(const float4* __restrict__ in, float4* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = in[i];
}

// The stand-in of C consumer CTAs: C CTAs (one per SM, held there by their shared memory) copy `total` float4s with
// 16-byte loads and stores, cycling through `n` float4s of in and out.
__global__ void SmCopyKernel(const float4* __restrict__ in, float4* __restrict__ out, int64_t n, int64_t total) {
  extern __shared__ char hold_the_sm[];
  if (threadIdx.x == 0 && total < 0) hold_the_sm[0] = 0;  // never true: keeps the shared memory allocated
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x)
    out[i % n] = in[i % n];
}

// Fills n bf16 values with a hash of their index, uniform in [-1, 1): the GEMM never runs on zeros.
__global__ void FillBf16(__nv_bfloat16* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = __float2bfloat16((h & 0xffffff) / 8388608.0f - 1.0f);
  }
}

using WaitValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

WaitValueFn LoadWaitValue() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CHECK(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 12000, cudaEnableDefault, &q));
  if (q != cudaDriverEntryPointSuccess || fn == nullptr) {
    std::fprintf(stderr, "cuStreamWaitValue32 not found in the driver\n");
    std::exit(1);
  }
  return reinterpret_cast<WaitValueFn>(fn);
}

// Every host wait is bounded: polls `ev` for up to 20 s, then names the step that did not finish and exits.
void WaitEvent(cudaEvent_t ev, const char* step) {
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      std::fprintf(stderr, "%s: %s\n", step, cudaGetErrorString(e));
      std::exit(1);
    }
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(20)) {
      std::fprintf(stderr, "%s did not finish within 20 s\n", step);
      std::exit(2);
    }
  }
}

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

float Elapsed(cudaEvent_t a, cudaEvent_t b) {
  float t;
  CHECK(cudaEventElapsedTime(&t, a, b));
  return t;
}

// The copy paths compared (see the top of the file).
enum class CopyPath { kSm, kCopyEngine, kToHost };
const char* PathName(CopyPath p) {
  return p == CopyPath::kSm ? "sm-copy" : p == CopyPath::kCopyEngine ? "ce-copy" : "to-host";
}

// Enqueues one copy of `bytes` from device memory src to dst (device memory, or pinned host memory for kToHost).
void Copy(CopyPath path, void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (path == CopyPath::kCopyEngine) {
    cudaMemcpyAttributes attr;
    std::memset(&attr, 0, sizeof(attr));
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t attr_idx = 0;
    void* dsts[1] = {dst};
    const void* srcs[1] = {src};
    size_t sizes[1] = {bytes};
    CHECK(cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &attr, &attr_idx, 1, stream));
    return;
  }
  CHECK(cudaMemcpyAsync(dst, src, bytes, path == CopyPath::kToHost ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice,
                        stream));
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IONBF, 0);  // each line shows even if a later step is stopped
  int dev = 0, sms = 0;
  CHECK(cudaSetDevice(dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device %s, %d SMs, %d async engines\n", prop.name, sms, prop.asyncEngineCount);
  const WaitValueFn wait_value = LoadWaitValue();

  const int64_t kMaxBytes = 512ll << 20;
  char *src = nullptr, *dst = nullptr, *host = nullptr;
  CHECK(cudaMalloc(&src, kMaxBytes));
  CHECK(cudaMalloc(&dst, kMaxBytes));
  CHECK(cudaMallocHost(&host, kMaxBytes));
  CHECK(cudaMemset(src, 0x5a, kMaxBytes));
  CHECK(cudaMemset(dst, 0, kMaxBytes));
  cudaStream_t s_main, s_copy, s_obs;
  CHECK(cudaStreamCreateWithFlags(&s_main, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&s_copy, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&s_obs, cudaStreamNonBlocking));
  cudaEvent_t e0, e1, c0, c1;
  for (cudaEvent_t* e : {&e0, &e1, &c0, &c1}) CHECK(cudaEventCreate(e));
  const CopyPath kPaths[3] = {CopyPath::kSm, CopyPath::kCopyEngine, CopyPath::kToHost};
  auto dst_of = [&](CopyPath p) { return p == CopyPath::kToHost ? host : dst; };

  // 1. Bandwidth of back-to-back copies by segment size (64 MiB per measurement, 16 MiB to the host).
  float big_gbps[3] = {0, 0, 0};  // each path's bandwidth at the largest segment: sizes the copies of table 3
  std::printf("\n| segment KiB | sm-copy GB/s | us per copy | ce-copy GB/s | us per copy | to-host GB/s | us per copy |\n"
              "|---|---|---|---|---|---|---|\n");
  for (int64_t seg : {16ll << 10, 64ll << 10, 256ll << 10, 1ll << 20, 4ll << 20, 16ll << 20}) {
    std::printf("| %lld ", static_cast<long long>(seg >> 10));
    for (int pi = 0; pi < 3; ++pi) {
      const CopyPath path = kPaths[pi];
      const int n = static_cast<int>(((path == CopyPath::kToHost ? 16ll : 64ll) << 20) / seg);
      std::vector<float> ms;
      for (int rep = 0; rep < 7; ++rep) {
        CHECK(cudaEventRecord(e0, s_copy));
        for (int i = 0; i < n; ++i) Copy(path, dst_of(path) + i * seg, src + i * seg, seg, s_copy);
        CHECK(cudaEventRecord(e1, s_copy));
        WaitEvent(e1, "back-to-back copies");
        if (rep >= 2) ms.push_back(Elapsed(e0, e1));
      }
      const float m = Median(ms);
      big_gbps[pi] = n * seg / (m * 1e-3) / 1e9;
      std::printf("| %.1f | %.2f ", big_gbps[pi], m * 1e3 / n);
    }
    std::printf("|\n");
  }

  // 2. Trigger latency: flag-gated copies on a side stream, for the two device-to-device paths.
  const int kSegs = 64;
  uint32_t* flags = nullptr;
  uint64_t *t_pub = nullptr, *t_arr = nullptr;
  int* err = nullptr;
  CHECK(cudaMalloc(&flags, kSegs * sizeof(uint32_t)));
  CHECK(cudaMemset(flags, 0, kSegs * sizeof(uint32_t)));
  CHECK(cudaMallocHost(&t_pub, kSegs * sizeof(uint64_t)));  // pinned: read by the host after a sync
  CHECK(cudaMallocHost(&t_arr, kSegs * sizeof(uint64_t)));
  CHECK(cudaMallocHost(&err, sizeof(int)));
  uint32_t* go = nullptr;  // pinned, read by the producer kernel: the host raises it once every copy is enqueued
  CHECK(cudaHostAlloc(&go, sizeof(uint32_t), cudaHostAllocMapped));
  *go = 0;
  std::printf("\n| path | segment KiB | gap us | latency median us | p90 us | max us | copy alone us |\n"
              "|---|---|---|---|---|---|---|\n");
  uint32_t epoch = 0;
  for (CopyPath path : {CopyPath::kSm, CopyPath::kCopyEngine}) {
    for (int64_t seg : {64ll << 10, 1ll << 20, 4ll << 20}) {
      for (int gap_us : {5, 50}) {
        std::vector<float> lat;
        for (int rep = 0; rep < 4; ++rep) {
          ++epoch;
          *err = 0;
          std::fprintf(stderr, "trigger latency: %s, %lld KiB, gap %d us, rep %d\n", PathName(path),
                       static_cast<long long>(seg >> 10), gap_us, rep);
          // The producer first (it waits for *go), then the flag-gated copies (each waits for its flag on the
          // device, no host in the loop), then the observer; then *go.
          ProducerKernel<<<1, 32, 0, s_main>>>(reinterpret_cast<uint32_t*>(src), seg / 4, flags, kSegs,
                                               gap_us * 1000ull, epoch, t_pub, go, err);
          CHECK(cudaGetLastError());
          for (int i = 0; i < kSegs; ++i) {
            CUresult r = wait_value(reinterpret_cast<CUstream>(s_copy), reinterpret_cast<CUdeviceptr>(flags + i),
                                    epoch, CU_STREAM_WAIT_VALUE_GEQ);
            if (r != CUDA_SUCCESS) {
              std::fprintf(stderr, "cuStreamWaitValue32 failed: %d\n", static_cast<int>(r));
              return 1;
            }
            Copy(path, dst + i * seg, src + i * seg, seg, s_copy);
          }
          ObserverKernel<<<1, 32, 0, s_obs>>>(reinterpret_cast<uint32_t*>(dst), seg / 4, kSegs, epoch, t_arr, err);
          CHECK(cudaGetLastError());
          __atomic_store_n(go, epoch, __ATOMIC_RELEASE);
          cudaEvent_t done[3];
          cudaStream_t ss[3] = {s_main, s_copy, s_obs};
          const char* names[3] = {"the producer kernel", "the flag-gated copies", "the observer kernel"};
          for (int j = 0; j < 3; ++j) {
            CHECK(cudaEventCreateWithFlags(&done[j], cudaEventDisableTiming));
            CHECK(cudaEventRecord(done[j], ss[j]));
          }
          for (int j = 0; j < 3; ++j) {
            WaitEvent(done[j], names[j]);
            CHECK(cudaEventDestroy(done[j]));
          }
          if (*err == -1) {
            std::fprintf(stderr, "the producer kernel never saw the host's go (epoch %u)\n", epoch);
            return 1;
          }
          if (*err) {
            std::fprintf(stderr, "observer gave up waiting for segment %d (epoch %u, %s, %lld KiB)\n", *err - 1,
                         epoch, PathName(path), static_cast<long long>(seg >> 10));
            return 1;
          }
          if (rep == 0) continue;  // warm-up
          for (int i = 0; i < kSegs; ++i) lat.push_back((t_arr[i] - t_pub[i]) * 1e-3f);
        }
        std::sort(lat.begin(), lat.end());
        std::vector<float> one;  // one copy of this size alone, for comparison
        for (int rep = 0; rep < 9; ++rep) {
          CHECK(cudaEventRecord(e0, s_copy));
          Copy(path, dst, src, seg, s_copy);
          CHECK(cudaEventRecord(e1, s_copy));
          WaitEvent(e1, "one copy");
          one.push_back(Elapsed(e0, e1) * 1e3f);
        }
        std::printf("| %s | %lld | %d | %.1f | %.1f | %.1f | %.1f |\n", PathName(path),
                    static_cast<long long>(seg >> 10), gap_us, lat[lat.size() / 2], lat[lat.size() * 9 / 10],
                    lat.back(), Median(one));
      }
    }
  }

  // 3. Slowdown of kernels with copies running beside them.
  float* sink = nullptr;
  CHECK(cudaMalloc(&sink, sms * 4 * sizeof(float)));
  const int64_t kStreamBytes = 1ll << 30;
  float4 *s_in = nullptr, *s_out = nullptr;
  CHECK(cudaMalloc(&s_in, kStreamBytes));
  CHECK(cudaMalloc(&s_out, kStreamBytes));
  CHECK(cudaMemset(s_in, 0x3c, kStreamBytes));
  // The GEMMs: GroupedMatmul bf16, seed GEMM1 (16384 rows over 8 experts, K 2048, N 4096) and one 8192^3 group.
  struct Gemm {
    const char* name;
    int64_t M, K, N, G;
    __nv_bfloat16 *lhs, *rhs, *out;
    int32_t* sizes;
  };
  std::vector<Gemm> gemms = {{"GEMM seed GEMM1 (M 16384, K 2048, N 4096, 8 groups)", 16384, 2048, 4096, 8},
                             {"GEMM 8192^3 (1 group)", 8192, 8192, 8192, 1}};
  for (Gemm& g : gemms) {
    CHECK(cudaMalloc(&g.lhs, g.M * g.K * 2));
    CHECK(cudaMalloc(&g.rhs, g.G * g.K * g.N * 2));
    CHECK(cudaMalloc(&g.out, g.M * g.N * 2));
    CHECK(cudaMalloc(&g.sizes, g.G * sizeof(int32_t)));
    FillBf16<<<sms * 4, 256>>>(g.lhs, g.M * g.K, 17);
    FillBf16<<<sms * 4, 256>>>(g.rhs, g.G * g.K * g.N, 29);
    CHECK(cudaGetLastError());
    std::vector<int32_t> h(g.G, static_cast<int32_t>(g.M / g.G));
    CHECK(cudaMemcpy(g.sizes, h.data(), g.G * sizeof(int32_t), cudaMemcpyHostToDevice));
  }
  CHECK(cudaDeviceSynchronize());
  const int kHoldSmem = 160 << 10;  // one SmCopyKernel CTA per SM: no GEMM CTA fits beside it
  CHECK(cudaFuncSetAttribute(SmCopyKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kHoldSmem));

  struct Kernel {
    std::string name;
    std::function<void()> launch;
  };
  std::vector<Kernel> kernels = {
      {"SM-bound (FMA chain)", [&] { FmaKernel<<<sms * 4, 256, 0, s_main>>>(sink, 1 << 17); }},
      {"HBM-bound (1 GiB stream)", [&] { StreamKernel<<<sms * 8, 256, 0, s_main>>>(s_in, s_out, kStreamBytes / 16); }}};
  for (const Gemm& g : gemms)
    kernels.push_back({g.name, [&g, &s_main] {
                         jmo::cuda::Status st = jmo::cuda::GroupedMatmul(s_main, jmo::DType::kBF16, false, g.lhs,
                                                                         g.M, g.K, g.rhs, g.G, g.N, false, g.sizes,
                                                                         g.out);
                         if (!st.ok()) {
                           std::fprintf(stderr, "GroupedMatmul failed: %s\n", st.msg.c_str());
                           std::exit(1);
                         }
                       }});

  // What runs beside: nothing, one of the copy paths, or C CTAs of SmCopyKernel (~45 GB/s each).
  struct Beside {
    std::string name;
    int path;  // index into kPaths, or -C for C copy CTAs, or 0x7f for nothing
  };
  std::vector<Beside> besides = {{"alone", 0x7f}, {"sm-copy", 0}, {"ce-copy", 1}, {"to-host", 2},
                                 {"4 copy CTAs", -4}, {"8 copy CTAs", -8}, {"16 copy CTAs", -16}};
  std::printf("\n| kernel | beside | kernel ms | slowdown | copies GB/s meanwhile | copies covered the kernel |\n"
              "|---|---|---|---|---|---|\n");
  for (const Kernel& k : kernels) {
    float alone = 0;
    for (const Beside& b : besides) {
      std::vector<float> ms, gbps;
      bool covered = true;
      for (int rep = 0; rep < 7; ++rep) {
        // Copies sized to outlast the kernel about four times (alone's time at the path's bandwidth).
        double gbps_est = b.path == 0x7f ? 0 : b.path < 0 ? -b.path * 45.0 : big_gbps[b.path];
        const double est_ms = alone > 0 ? alone : 5.0;
        const int64_t total = static_cast<int64_t>(gbps_est * 1e9 * 4 * est_ms * 1e-3) / 16 * 16;
        if (b.path != 0x7f) {
          CHECK(cudaEventRecord(c0, s_copy));
          if (b.path < 0) {
            SmCopyKernel<<<-b.path, 512, kHoldSmem, s_copy>>>(reinterpret_cast<const float4*>(src),
                                                              reinterpret_cast<float4*>(dst), kMaxBytes / 16,
                                                              total / 16);
            CHECK(cudaGetLastError());
          } else {
            const CopyPath path = kPaths[b.path];
            for (int64_t done = 0; done < total; done += 64ll << 20) {
              const int64_t off = done % kMaxBytes, n = std::min<int64_t>(64ll << 20, total - done);
              Copy(path, dst_of(path) + off, src + off, std::min<int64_t>(n, kMaxBytes - off), s_copy);
            }
          }
          CHECK(cudaEventRecord(c1, s_copy));
        }
        CHECK(cudaEventRecord(e0, s_main));
        k.launch();
        CHECK(cudaGetLastError());
        CHECK(cudaEventRecord(e1, s_main));
        WaitEvent(e1, "the kernel beside the copies");
        if (b.path != 0x7f) WaitEvent(c1, "the copies beside the kernel");
        if (rep < 2) continue;
        ms.push_back(Elapsed(e0, e1));
        if (b.path != 0x7f) {
          // Covered: the copies started before the kernel and ended after it.
          covered = covered && Elapsed(c0, e0) >= 0 && Elapsed(e1, c1) > 0;
          gbps.push_back(total / (Elapsed(c0, c1) * 1e-3) / 1e9);
        }
      }
      const float m = Median(ms);
      if (b.path == 0x7f) {
        alone = m;
        std::printf("| %s | alone | %.3f | - | - | - |\n", k.name.c_str(), m);
      } else {
        std::printf("| %s | %s | %.3f | %+.1f%% | %.0f | %s |\n", k.name.c_str(), b.name.c_str(), m,
                    100.0 * (m - alone) / alone, Median(gbps), covered ? "yes" : "no");
      }
    }
  }
  std::printf("copy_engine_probe: done\n");
  return 0;
}
