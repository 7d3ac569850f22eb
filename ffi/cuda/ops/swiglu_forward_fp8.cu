// jmo_swiglu_forward_fp8 on CUDA (swiglu_forward_fp8.h): a work item is (kRowsPerCta rows, one block cb of 128 of h's
// channels), 256 threads, the items numbered with the channel block fastest (the CTAs of one row block run together,
// and the scales of a row, written 4 bytes at a time by CTAs of different blocks, meet in L2). The block covers h's
// channels [128 cb, 128 cb + 128), which are a's gate channels of the same index and its up channels F + those: one
// 1 x 128 row tile of h and two of a per row. Warp w takes the item's rows kRowsPerWarp w .. kRowsPerWarp (w + 1) - 1,
// a lane 4 consecutive channels of each (one float4 of the gate and one of the up projection per row: a warp reads
// 512 + 512 contiguous bytes of a row and writes 128 contiguous bytes to each of the three outputs). All of a warp's
// loads are issued before any math. Per row: h = SwiGlu(gate, up) (common/swiglu.h; the logistic by SwiGluSigmoids,
// ops/swiglu_sigmoid.cuh), each tile's amax by warp shuffles, its scale and bytes (cuda/ops/fp8_rows.cuh: the rules
// of the CPU handler's loop). Each value's byte is RoundE4m3 of its IEEE quotient by the scale (ops/e4m3.cuh's
// QuotientFast).
#include "cuda/ops/swiglu_forward_fp8.h"

#include <string>

#include "common/fp8_columns.h"
#include "common/swiglu.h"
#include "cuda/launch.h"
#include "cuda/ops/fp8_rows.cuh"
#include "cuda/ops/grouped_gemm.h"
#include "cuda/ops/swiglu_sigmoid.cuh"

namespace jmo::cuda {
namespace {

constexpr int kCtaThreads = 256;
constexpr int kCtaWarps = kCtaThreads / 32;
constexpr int kChannels = 128;  // h's channels per item: 4 per lane, one row tile
constexpr int kRowsPerWarp = 4;
constexpr int kRowsPerCta = kCtaWarps * kRowsPerWarp;  // 32

__device__ __forceinline__ void Values(const float4& f, float (&v)[4]) {
  v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
}

__global__ void __launch_bounds__(kCtaThreads)
    SwiGluForwardKernel(const float* __restrict__ a, int64_t M, int64_t F, uint8_t* __restrict__ h_q,
                        float* __restrict__ h_s, uint8_t* __restrict__ a_q, float* __restrict__ a_s) {
  const int64_t blocks = F / kChannels, C = 2 * F, R = C / kChannels;  // R: a's scales per row
  const int64_t cb = blockIdx.x % blocks, rb = blockIdx.x / blocks;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row0 = rb * kRowsPerCta + warp * kRowsPerWarp;
  const int64_t gate_c = kChannels * cb + 4 * lane, up_c = F + gate_c;  // the lane's first channel of each half

  float4 g[kRowsPerWarp], u[kRowsPerWarp];
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    g[k] = u[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (row0 + k < M) {  // warp-uniform
      g[k] = *reinterpret_cast<const float4*>(a + (row0 + k) * C + gate_c);
      u[k] = *reinterpret_cast<const float4*>(a + (row0 + k) * C + up_c);
    }
  }
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int64_t r = row0 + k;
    if (r >= M) break;
    float gate[4], up[4], sig[4], h[4];
    Values(g[k], gate);
    Values(u[k], up);
    SwiGluSigmoids(gate, sig);
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = SwiGluOfSig(gate[j], sig[j], up[j]);
    const float sg = WarpRowScale(gate), su = WarpRowScale(up), sh = WarpRowScale(h);
    reinterpret_cast<uint32_t*>(a_q + r * C + kChannels * cb)[lane] = QuantizeWord(gate, sg);
    reinterpret_cast<uint32_t*>(a_q + r * C + F + kChannels * cb)[lane] = QuantizeWord(up, su);
    reinterpret_cast<uint32_t*>(h_q + r * F + kChannels * cb)[lane] = QuantizeWord(h, sh);
    if (lane == 0) {
      a_s[r * R + cb] = sg;
      a_s[r * R + blocks + cb] = su;
      h_s[r * blocks + cb] = sh;
    }
  }
}

}  // namespace

Status SwiGluForwardFp8(cudaStream_t stream, const float* a, int64_t M, int64_t F, uint8_t* h_q, float* h_s,
                        uint8_t* a_q, float* a_s) {
  DeviceInfo dev;
  Status st = Fp8DeviceCheck("swiglu_forward_fp8", &dev);
  if (!st.ok()) return st;
  const int64_t items = (M + kRowsPerCta - 1) / kRowsPerCta * (F / kChannels);
  if (F < kChannels || F % kChannels != 0 || M < 0 || items > 0x7FFFFFFF)
    return Status::Error(kInvalidArgument, "jax_moe_overlap: swiglu_forward_fp8: F must be a positive multiple of "
                                           "128 and ceil(M / 32) * F / 128 below 2^31, got M=" + std::to_string(M) +
                                           ", F=" + std::to_string(F));
  if (items == 0) return LaunchEmpty(stream);  // (a call inside a CUDA graph must launch something)
  SwiGluForwardKernel<<<(unsigned)items, kCtaThreads, 0, stream>>>(a, M, F, h_q, h_s, a_q, a_s);
  return CudaStatus(cudaGetLastError(), "launch of SwiGluForwardKernel");
}

}  // namespace jmo::cuda
