// Helpers of the FP8 wgmma probes (wgmma_fp8_probe.cu: the row GEMM, wgmma_outer_fp8_probe.cu: the outer GEMM):
// random e4m3 operands and scales as quantized tiles hold them, the repeat check, TFLOP/s.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "probe_common.cuh"

// Tolerances against a float32 reference on the same quantized operands, as max |out - ref| / max |ref|: the tensor
// core's limited accumulation inside each 128-wide chunk (wgmma_fp8_probe.cu's header: a model of it errs by up to
// 3.5e-4) for float32 output, plus bfloat16's rounding (2^-9) for bfloat16 output.
constexpr double kTolF32 = 2e-3, kTolBf16 = 5e-3;

__device__ __forceinline__ float E4m3ToFloat(uint8_t b) {
  __nv_fp8_e4m3 v;
  v.__x = b;
  return static_cast<float>(v);
}

// Random e4m3 values as a quantized tile holds them: magnitudes 448 u^3 (u uniform: many exponents, the largest
// near 448), random signs, never zero (the smallest subnormal where the rounding gives 0).
__global__ void FillE4m3Kernel(uint8_t* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const uint32_t h = Hash(i * 0x9E3779B97F4A7C15ULL + seed);
    const float u = (float)(h >> 8) / 16777216.0f;
    const float mag = 448.0f * u * u * u;
    uint8_t q = __nv_cvt_float_to_fp8((h & 1) ? -mag : mag, __NV_SATFINITE, __NV_E4M3);
    if ((q & 0x7F) == 0) q |= 1;
    p[i] = q;
  }
}

// Positive scales: powers of two 2^-12 .. 2^-5 (the recipe's activation tiles) or any float in [2^-13, 2^-6)
// (amax / 448 of a weight block).
__global__ void FillScalesKernel(float* p, int64_t n, uint64_t seed, bool pow2) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const uint32_t h = Hash(i * 0xD1B54A32D192ED03ULL + seed);
    p[i] = pow2 ? ldexpf(1.0f, -12 + (int)(h % 8)) : ldexpf(1.0f + (float)(h >> 8) / 16777216.0f, -13 + (int)(h % 7));
  }
}

// The second call of a checked variant: out's first result (out_bytes) copied to `first`, out poisoned, call()
// issued again -- timed when `timed` (3 warm-ups, then the median of 20 launches) -- and the 32-bit words where the
// two results differ counted into *diff (d_diff: a device counter). Returns the median ms (0 when not timed).
template <class Call>
static float RepeatCall(Call call, void* out, void* first, int64_t out_bytes, bool timed, unsigned long long* d_diff,
                        cudaStream_t stream, const std::string& what, unsigned long long* diff) {
  CK(cudaMemcpyAsync(first, out, out_bytes, cudaMemcpyDeviceToDevice, stream));
  CK(cudaMemsetAsync(out, 0xFF, out_bytes, stream));
  float ms = 0.f;
  if (timed) {
    for (int i = 0; i < 3; ++i) call();
    WaitOrDie(stream, what + " (warm-up)");
    ms = MedianLaunchMs(stream, 20, call, [](int) {});
  } else {
    call();
  }
  CK(cudaMemsetAsync(d_diff, 0, sizeof(unsigned long long), stream));
  DiffWordsKernel<<<1024, 256, 0, stream>>>(static_cast<const uint32_t*>(first), static_cast<const uint32_t*>(out),
                                            out_bytes / 4, d_diff);
  CK(cudaGetLastError());
  CK(cudaMemcpyAsync(diff, d_diff, sizeof(*diff), cudaMemcpyDeviceToHost, stream));
  WaitOrDie(stream, what + " (repeat)");
  return ms;
}

// The refusal checks: operands a kernel does not take must be refused before anything runs. check(buf, q, s, sizes)
// is called once per bad case with a 1 MiB scratch buffer (as bytes, e4m3 and float32) and 64 bytes of group sizes,
// and returns (what, the launch's error); a case passes when the error is cudaErrorInvalidValue. Returns the failures.
template <class Check>
static int CheckRefusals(int cases, Check check, cudaStream_t stream) {
  uint8_t* buf;
  int32_t* sizes;
  CK(cudaMalloc(&buf, 1 << 20));
  CK(cudaMalloc(&sizes, 64));
  int failures = 0;
  for (int i = 0; i < cases; ++i) {
    const std::pair<const char*, cudaError_t> r = check(i, buf, reinterpret_cast<const __nv_fp8_e4m3*>(buf),
                                                        reinterpret_cast<const float*>(buf), sizes);
    const bool ok = r.second == cudaErrorInvalidValue;
    failures += !ok;
    printf("refusal %-16s %s (%s)\n", r.first, ok ? "PASS" : "FAIL", cudaGetErrorString(r.second));
  }
  CK(cudaGetLastError());
  WaitOrDie(stream, "refusals");
  CK(cudaFree(buf));
  CK(cudaFree(sizes));
  return failures;
}
