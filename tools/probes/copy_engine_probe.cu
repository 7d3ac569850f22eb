// Copy-engine transport probe: what it costs to move finished segments with the copy engines instead of SMs.
//
// A transport that takes no SMs from the GEMM has a side stream wait on a device flag per segment
// (cuStreamWaitValue32), then copy the segment (cudaMemcpyAsync): no host round trip, no SM. This probe measures, on
// one GPU (device-to-device copies stand in for NVLink pushes):
//   1. bandwidth of back-to-back copies by segment size (the copy engines' per-copy overhead shows at small sizes);
//   2. trigger latency: a producer kernel publishes segments one by one (a spin of `gap_us` between them stands in for
//      the GEMM tiles that finish a segment), each copy waits for its flag, and an observer kernel records when the
//      segment's last word lands. Latency = arrival - publish, both read from %globaltimer on the same GPU;
//   3. the slowdown of an SM-bound kernel (a long FMA loop on every SM) and of an HBM-bound one (a 1 GiB stream) while
//      large device-to-device copies run beside it.
// Every CUDA call is checked; every wait, on the host and in the device code, is bounded and names what it gave up on.
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -o /tmp/copy_engine_probe \
//     tools/probes/copy_engine_probe.cu && /tmp/copy_engine_probe
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

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

// Every host wait is bounded: polls `ev` for up to 10 s, then names the step that did not finish and exits.
void WaitEvent(cudaEvent_t ev, const char* step) {
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      std::fprintf(stderr, "%s: %s\n", step, cudaGetErrorString(e));
      std::exit(1);
    }
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(10)) {
      std::fprintf(stderr, "%s did not finish within 10 s\n", step);
      std::exit(2);
    }
  }
}

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IONBF, 0);  // each line shows even if a later step is stopped
  int dev = 0, sms = 0;
  CHECK(cudaSetDevice(dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device %s, %d SMs\n", prop.name, sms);
  const WaitValueFn wait_value = LoadWaitValue();

  const int64_t kMaxBytes = 512ll << 20;
  char *src = nullptr, *dst = nullptr;
  CHECK(cudaMalloc(&src, kMaxBytes));
  CHECK(cudaMalloc(&dst, kMaxBytes));
  CHECK(cudaMemset(src, 0x5a, kMaxBytes));
  CHECK(cudaMemset(dst, 0, kMaxBytes));
  cudaStream_t s_main, s_copy, s_obs;
  CHECK(cudaStreamCreateWithFlags(&s_main, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&s_copy, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&s_obs, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));

  // 1. Bandwidth of back-to-back device-to-device copies by segment size (64 MiB per measurement).
  std::printf("\n| segment KiB | copies | GB/s (read+write counted once) | us per copy |\n|---|---|---|---|\n");
  for (int64_t seg : {16ll << 10, 64ll << 10, 256ll << 10, 1ll << 20, 4ll << 20, 16ll << 20}) {
    const int n = static_cast<int>((64ll << 20) / seg);
    std::vector<float> ms;
    for (int rep = 0; rep < 7; ++rep) {
      CHECK(cudaEventRecord(e0, s_copy));
      for (int i = 0; i < n; ++i) CHECK(cudaMemcpyAsync(dst + i * seg, src + i * seg, seg, cudaMemcpyDeviceToDevice, s_copy));
      CHECK(cudaEventRecord(e1, s_copy));
      WaitEvent(e1, "back-to-back copies");
      float t;
      CHECK(cudaEventElapsedTime(&t, e0, e1));
      if (rep >= 2) ms.push_back(t);
    }
    const float m = Median(ms);
    std::printf("| %lld | %d | %.1f | %.2f |\n", static_cast<long long>(seg >> 10), n, n * seg / (m * 1e-3) / 1e9,
                m * 1e3 / n);
  }

  // 2. Trigger latency: flag-gated copies on a side stream.
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
  std::printf("\n| segment KiB | gap us | latency median us | p90 us | max us | copy alone us |\n|---|---|---|---|---|---|\n");
  uint32_t epoch = 0;
  for (int64_t seg : {64ll << 10, 1ll << 20, 4ll << 20}) {
    for (int gap_us : {5, 50}) {
      std::vector<float> lat;
      for (int rep = 0; rep < 4; ++rep) {
        ++epoch;
        *err = 0;
        std::fprintf(stderr, "trigger latency: %lld KiB, gap %d us, rep %d\n", static_cast<long long>(seg >> 10),
                     gap_us, rep);
        // The producer first (it waits for *go), then the flag-gated copies (each waits for its flag on the device,
        // no host in the loop), then the observer; then *go.
        ProducerKernel<<<1, 32, 0, s_main>>>(reinterpret_cast<uint32_t*>(src), seg / 4, flags, kSegs,
                                             gap_us * 1000ull, epoch, t_pub, go, err);
        CHECK(cudaGetLastError());
        for (int i = 0; i < kSegs; ++i) {
          CUresult r = wait_value(reinterpret_cast<CUstream>(s_copy), reinterpret_cast<CUdeviceptr>(flags + i), epoch,
                                  CU_STREAM_WAIT_VALUE_GEQ);
          if (r != CUDA_SUCCESS) {
            std::fprintf(stderr, "cuStreamWaitValue32 failed: %d\n", static_cast<int>(r));
            return 1;
          }
          CHECK(cudaMemcpyAsync(dst + i * seg, src + i * seg, seg, cudaMemcpyDeviceToDevice, s_copy));
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
          std::fprintf(stderr, "observer gave up waiting for segment %d (epoch %u, %lld KiB)\n", *err - 1, epoch,
                       static_cast<long long>(seg >> 10));
          return 1;
        }
        if (rep == 0) continue;  // warm-up
        for (int i = 0; i < kSegs; ++i) lat.push_back((t_arr[i] - t_pub[i]) * 1e-3f);
      }
      std::sort(lat.begin(), lat.end());
      // One copy of this size alone, for comparison.
      std::vector<float> one;
      for (int rep = 0; rep < 9; ++rep) {
        CHECK(cudaEventRecord(e0, s_copy));
        CHECK(cudaMemcpyAsync(dst, src, seg, cudaMemcpyDeviceToDevice, s_copy));
        CHECK(cudaEventRecord(e1, s_copy));
        WaitEvent(e1, "one copy");
        float t;
        CHECK(cudaEventElapsedTime(&t, e0, e1));
        one.push_back(t * 1e3f);
      }
      std::printf("| %lld | %d | %.1f | %.1f | %.1f | %.1f |\n", static_cast<long long>(seg >> 10), gap_us,
                  lat[lat.size() / 2], lat[lat.size() * 9 / 10], lat.back(), Median(one));
    }
  }

  // 3. Slowdown of an SM-bound kernel with copies running beside it.
  float* sink = nullptr;
  CHECK(cudaMalloc(&sink, sms * 4 * sizeof(float)));
  cudaEvent_t copies_done;
  CHECK(cudaEventCreateWithFlags(&copies_done, cudaEventDisableTiming));
  const int64_t kStreamBytes = 1ll << 30;
  float4 *s_in = nullptr, *s_out = nullptr;
  CHECK(cudaMalloc(&s_in, kStreamBytes));
  CHECK(cudaMalloc(&s_out, kStreamBytes));
  CHECK(cudaMemset(s_in, 0x3c, kStreamBytes));
  // Times `launch` on s_main alone and with eight 512 MiB device-to-device copies queued beside it on s_copy.
  auto time_beside = [&](auto launch, bool with_copies) {
    std::vector<float> ms;
    for (int rep = 0; rep < 7; ++rep) {
      if (with_copies) {
        for (int i = 0; i < 8; ++i) CHECK(cudaMemcpyAsync(dst, src, kMaxBytes, cudaMemcpyDeviceToDevice, s_copy));
      }
      CHECK(cudaEventRecord(e0, s_main));
      launch();
      CHECK(cudaGetLastError());
      CHECK(cudaEventRecord(e1, s_main));
      WaitEvent(e1, "the kernel beside the copies");
      float t;
      CHECK(cudaEventElapsedTime(&t, e0, e1));
      CHECK(cudaEventRecord(copies_done, s_copy));
      WaitEvent(copies_done, "the copies beside the kernel");
      if (rep >= 2) ms.push_back(t);
    }
    return Median(ms);
  };
  auto fma = [&] { FmaKernel<<<sms * 4, 256, 0, s_main>>>(sink, 1 << 17); };
  auto stream = [&] { StreamKernel<<<sms * 8, 256, 0, s_main>>>(s_in, s_out, kStreamBytes / 16); };
  std::printf("\n| kernel | alone ms | beside copies ms | slowdown |\n|---|---|---|---|\n");
  for (int which = 0; which < 2; ++which) {
    const float alone = which == 0 ? time_beside(fma, false) : time_beside(stream, false);
    const float beside = which == 0 ? time_beside(fma, true) : time_beside(stream, true);
    std::printf("| %s | %.3f | %.3f | %+.1f%% |\n", which == 0 ? "SM-bound (FMA chain)" : "HBM-bound (1 GiB stream)",
                alone, beside, 100.0 * (beside - alone) / alone);
  }
  std::printf("copy_engine_probe: done\n");
  return 0;
}
