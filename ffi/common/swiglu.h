// The SwiGLU of the expert MLP, h = silu(gate) * up, and its input gradient, in float32, compiled for the host and for
// CUDA devices: one formula for the CPU handlers (cpu/gemm_rows.h, cpu/swiglu_backward_fp8.cc,
// cpu/swiglu_forward_fp8.cc) and the kernels (the bf16 backward GEMM's epilogue through device/activation.cuh,
// ops/swiglu_backward_fp8.cu, ops/swiglu_forward_fp8.cu).
//
// The expressions are those XLA runs for the layer's jnp SwiGLU (expert_gemms.swiglu: jax.nn.silu(gate) * up, silu
// being gate * logistic(gate)) and for jax.vjp of it (JAX's jvp rules of mul and logistic, transposed), the operands
// grouped the same way, the logistic as XLA expands it, 1 / (1 + exp(-gate)):
//   sig = 1 / (1 + exp(-gate))
//   h = (gate * sig) * up
//   d_up = (gate * sig) * dh,  j = dh * up,  d_gate = j * sig + (gate * j) * (sig * (1 - sig))
// Each operation is rounded on its own (no contraction into FMAs: the __f*_rn intrinsics on the device; the host
// build passes -ffp-contract=off, CMakeLists.txt), so the result is the float32 math of the jnp composition wherever
// the exp agrees. The exp is the platform's expf: glibc's on the host, CUDA's on the device (within 2 ulp, not
// correctly rounded), XLA's own on each backend. They agree on most inputs but not on all, so the host and the device
// (and either and XLA) may part in the last bit of sig for some gates, and then in everything computed from it.
// Subnormal float32 values follow the calling thread: XLA:CPU runs the CPU handlers on threads that flush them to zero
// (as its own elementwise code does), the kernels keep them (as XLA:GPU does); they arise here only for gates below
// about -87, where the logistic is subnormal, or for products of tiny operands.
#pragma once

#include <math.h>

#ifdef __CUDACC__
#define JMO_SWIGLU_HD __host__ __device__ __forceinline__
#else
#define JMO_SWIGLU_HD inline
#endif

namespace jmo {
namespace swiglu_ops {  // float32 operations, each rounded once (to nearest even)

#ifdef __CUDA_ARCH__
__device__ __forceinline__ float Add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float Sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float Mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float Div(float a, float b) { return __fdiv_rn(a, b); }
#else
inline float Add(float a, float b) { return a + b; }
inline float Sub(float a, float b) { return a - b; }
inline float Mul(float a, float b) { return a * b; }
inline float Div(float a, float b) { return a / b; }
#endif

}  // namespace swiglu_ops

// The logistic's denominator, 1 + exp(-gate): >= 1, +inf for gates below about -88.7, NaN for a NaN gate.
JMO_SWIGLU_HD float SwiGluDenominator(float gate) { return swiglu_ops::Add(1.0f, expf(-gate)); }

// logistic(gate) = 1 / (1 + exp(-gate)).
JMO_SWIGLU_HD float SwiGluSigmoid(float gate) { return swiglu_ops::Div(1.0f, SwiGluDenominator(gate)); }

// h = silu(gate) * up = (gate * sig) * up: the forward alone (the FP8 forward, which quantizes h for GEMM2).
// SwiGluOfSig takes the logistic from the caller, as SwiGluAndGradOfSig below.
JMO_SWIGLU_HD float SwiGluOfSig(float gate, float sig, float up) {
  using namespace swiglu_ops;
  return Mul(Mul(gate, sig), up);
}
JMO_SWIGLU_HD float SwiGlu(float gate, float up) { return SwiGluOfSig(gate, SwiGluSigmoid(gate), up); }

// h = silu(gate) * up (SwiGlu's expression) and its input gradient at the output gradient dh (*d_gate, *d_up),
// sharing the logistic and gate * sig (the FP8 backward recomputes h where it takes the gradient).
// SwiGluAndGradOfSig takes the logistic from the caller (sig = SwiGluSigmoid(gate), or the same bits by another route:
// the FP8 backward kernel's reciprocal).
JMO_SWIGLU_HD void SwiGluAndGradOfSig(float gate, float sig, float up, float dh, float* h, float* d_gate,
                                      float* d_up) {
  using namespace swiglu_ops;
  const float silu = Mul(gate, sig);
  const float j = Mul(dh, up);
  *h = Mul(silu, up);
  *d_up = Mul(silu, dh);
  *d_gate = Add(Mul(j, sig), Mul(Mul(gate, j), Mul(sig, Sub(1.0f, sig))));
}
JMO_SWIGLU_HD void SwiGluAndGrad(float gate, float up, float dh, float* h, float* d_gate, float* d_up) {
  SwiGluAndGradOfSig(gate, SwiGluSigmoid(gate), up, dh, h, d_gate, d_up);
}

// The input gradient alone (the compiler drops h's product).
JMO_SWIGLU_HD void SwiGluGrad(float gate, float up, float dh, float* d_gate, float* d_up) {
  float h;
  SwiGluAndGrad(gate, up, dh, &h, d_gate, d_up);
}

}  // namespace jmo
