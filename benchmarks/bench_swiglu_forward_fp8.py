"""The FP8 recipe's SwiGLU forward timed alone on one GPU, at the training preset's expert shape: from GEMM1's float32
output a to h quantized 1 x 128 (GEMM2's operand) and a quantized 1 x 128 (what the backward keeps), by

  custom call             grouped_gemm.swiglu_forward_fp8: one kernel, one read of a
  XLA                     fp8_experts.swiglu_forward_composed: swiglu and two fp8.quantize_rows (the definition, what
                          DENSE and RAGGED run)

The XLA variant's outputs are compared with the custom call's: the count of differing bytes prints (XLA's exp and its
float32 division, div.full on GPUs, part from the kernel's in the last bit now and then: one e4m3 step at most).

  python3 -m benchmarks.bench_swiglu_forward_fp8                    # M = 131072 rows, F = 1024
  python3 -m benchmarks.bench_swiglu_forward_fp8 --rows 65536 --F 2048
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_swiglu_backward_fp8 import time_and_compare
from jax_moe_overlap import fp8_experts
from jax_moe_overlap.grouped_gemm import swiglu_forward_fp8

VARIANTS = {"custom call": swiglu_forward_fp8, "XLA": fp8_experts.swiglu_forward_composed}


def main(rows=131072, F=1024):
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.standard_normal((rows, 2 * F), np.float32) * 2)
  moved = rows * (8 * F) + rows * (3 * F + 3 * F // 32)   # a read; h and a written with their scales
  print(f"rows {rows}, F {F}; ms per call (median of 15); {moved / 2**30:.2f} GiB read + written by the kernel")
  time_and_compare({name: jax.jit(f) for name, f in VARIANTS.items()}, (a,), moved, width=12)


if __name__ == "__main__":
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--rows", type=int, default=131072)
  ap.add_argument("--F", type=int, default=1024)
  args = ap.parse_args()
  main(args.rows, args.F)
