"""The expert weights' 128 x 128 block quantizer timed alone on one GPU, at the Mixtral-like expert weights (w1
[8, 4096, 28672], w2 [8, 14336, 4096]) and the training preset's ([16, 1024, 2048], [16, 1024, 1024]), bfloat16, by

  custom call               grouped_gemm.quantize_weight_fp8: one kernel, one read of w (the forward's Fp8Weight)
  XLA                       fp8.quantize_weight (the definition, what GPUs run while fp8_experts.WEIGHT_QUANTIZER_ON_GPU
                            is off): W's transpose, the blocks' amaxes and the quantization
  custom call, w layout     quantize_weight_fp8(w, transposed=False): the dgrads' weight (the Fp8Weight of W^T)
  XLA, w layout             fp8.transpose_weight(fp8.quantize_weight(w))
  pair call                 quantize_weight_fp8_pair(w): both forms from one read of w (the FP8 layer's forward
                            while fp8_experts.FORWARD_QUANTIZES_DGRAD_WEIGHTS)
  call, then transpose      quantize_weight_fp8(w) and fp8.transpose_weight of it (the layer's forward call and its
                            backward's transposes with that switch off)

Each line: the wall ms of a call waited for (median of 15, after warm-up: it holds the call's dispatch and the wait,
tens of microseconds, which can be most of a small weight's time), the device time per call from a profiler trace of
--calls calls back to back (benchmarks/device_trace.py: the GPU's busy time, every kernel of the call, the gaps
between calls left out), the bandwidth of the kernel's bytes (w read once, the e4m3 values and the scales written
once; for both forms the sum of the two single calls' bytes, against which the pair call moves one read of w less)
in the device time, and how many output bytes differ from the custom call's of the same layout (XLA:GPU's float32
division, div.full, parts from the kernel's IEEE quotient near e4m3 midpoints: a few bytes in 10^5).

  python3 -m benchmarks.bench_quantize_weight_fp8                       # all four weights
  python3 -m benchmarks.bench_quantize_weight_fp8 --weights mixtral_w1 preset_w1 --dtype float32
"""
import argparse

import jax
import jax.numpy as jnp

from benchmarks.bench_swiglu_backward_fp8 import time_and_compare
from jax_moe_overlap import fp8, fp8_experts
from jax_moe_overlap.grouped_gemm import quantize_weight_fp8, quantize_weight_fp8_pair

WEIGHTS = {  # name: [E, K, N]
    "mixtral_w1": (8, 4096, 28672),
    "mixtral_w2": (8, 14336, 4096),
    "preset_w1": (16, 1024, 2048),
    "preset_w2": (16, 1024, 1024),
}

LAYOUTS = {
    "Fp8Weight layout": {"custom call": lambda w: quantize_weight_fp8(w),
                         "XLA": lambda w: fp8_experts.xla_quantize_weight(w)},
    "w layout (dgrads)": {"custom call, w layout": lambda w: quantize_weight_fp8(w, transposed=False),
                          "XLA, w layout": lambda w: fp8_experts.xla_quantize_weight(w, False)},
    "both forms": {"pair call": quantize_weight_fp8_pair,
                   "call, then transpose": lambda w: _with_transpose(quantize_weight_fp8(w))},
}


def _with_transpose(wq):
  return wq, fp8.transpose_weight(wq)


def main(names, dtype, calls):
  for name in names:
    E, K, N = WEIGHTS[name]
    w = jax.jit(lambda key: jax.random.normal(key, (E, K, N), jnp.float32).astype(dtype) * 0.02)(
        jax.random.PRNGKey(0))
    moved = E * K * N * (jnp.dtype(dtype).itemsize + 1) + E * (K // 128) * (N // 128) * 4
    print(f"\n{name} [{E}, {K}, {N}] {jnp.dtype(dtype).name}: {moved / 1e9:.3f} GB read + written by the kernel; "
          f"wall ms per call (median of 15), device us per call ({calls} traced)")
    for layout, variants in LAYOUTS.items():
      print(f"  {layout}")
      time_and_compare({v: jax.jit(f) for v, f in variants.items()}, (w,), moved * (2 if layout == "both forms" else 1),
                       width=24, device_calls=calls)
    del w


if __name__ == "__main__":
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--weights", nargs="+", choices=list(WEIGHTS), default=list(WEIGHTS))
  ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
  ap.add_argument("--calls", type=int, default=20, help="calls traced for the device time")
  args = ap.parse_args()
  main(args.weights, jnp.dtype(args.dtype), args.calls)
