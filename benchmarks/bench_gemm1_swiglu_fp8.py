"""GEMM1 of the FP8 recipe with its SwiGLU forward timed on one GPU: from x quantized 1 x 128 and W1's e4m3 blocks to
h quantized 1 x 128 (GEMM2's operand) and a quantized 1 x 128 (what the backward keeps), by

  fused                   grouped_gemm.grouped_matmul_swiglu_fp8: one kernel, the SwiGLU and both quantizations in
                          the GEMM's epilogue (no float32 a in memory)
  two calls               grouped_gemm.grouped_matmul_fp8 (float32 a [rows, 2F] written) then
                          grouped_gemm.swiglu_forward_fp8 (a read back): what fp8_experts.KERNELS runs on GPUs while
                          FUSED_GEMM1_SWIGLU_ON_GPU is off
  fused, no a             grouped_matmul_swiglu_fp8(keep_a=False): h alone, as a forward that nothing
                          differentiates runs it (inference); its h compared with the fused call's
  GEMM alone              grouped_matmul_fp8 with a bfloat16 result: the same MMAs and promotion with the
                          cheapest epilogue, the floor the SwiGLU epilogue's cost is read against (its output is
                          not the others': not compared)

at two shapes: Mixtral-like (8 experts, 8192 rows, K 4096, 2F 28672) and the training preset's (16 experts, 131072
rows, K 1024, 2F 2048), rows spread over the experts unevenly (a Dirichlet draw). Each variant's ms is the median of
15 calls after two warm-up calls; the fused outputs are compared with the two calls' (they must be the same bytes:
the count of differing bytes prints, 0 expected).

  python3 -m benchmarks.bench_gemm1_swiglu_fp8                     # both shapes
  python3 -m benchmarks.bench_gemm1_swiglu_fp8 --shape mixtral
  python3 -m benchmarks.bench_gemm1_swiglu_fp8 --rows 4096 --K 1024 --F 1024 --G 8
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_fp8_column_layout import timeit
from jax_moe_overlap import fp8
from jax_moe_overlap.grouped_gemm import grouped_matmul_fp8, grouped_matmul_swiglu_fp8, swiglu_forward_fp8

SHAPES = {  # name: (experts G, rows, K, F)
    "mixtral": (8, 8192, 4096, 14336),
    "preset": (16, 131072, 1024, 1024),
}


def two_calls(lq, ls, wq, ws, gs):
  return swiglu_forward_fp8(grouped_matmul_fp8(lq, ls, wq, ws, gs))


def fused_without_a(lq, ls, wq, ws, gs):
  return grouped_matmul_swiglu_fp8(lq, ls, wq, ws, gs, keep_a=False)[0]


def gemm_alone(lq, ls, wq, ws, gs):
  return grouped_matmul_fp8(lq, ls, wq, ws, gs, preferred_element_type=jnp.bfloat16)


VARIANTS = {"fused": grouped_matmul_swiglu_fp8, "two calls": two_calls, "fused, no a": fused_without_a,
            "GEMM alone": gemm_alone}


def operands(G, rows, K, F, seed=0):
  """x [rows, K] quantized 1 x 128, W1 [G, K, 2F] quantized 128 x 128 (Fp8Weight's [G, 2F, K] values), drawn on the
  device; group sizes summing to rows."""
  rng = np.random.default_rng(seed)
  sizes = rng.multinomial(rows, rng.dirichlet(np.ones(G) * 2))
  kx, kw = jax.random.split(jax.random.key(seed))
  lq, ls = jax.jit(lambda k: fp8.quantize_rows(jax.random.normal(k, (rows, K), jnp.float32)))(kx)
  wq = jax.jit(lambda k: fp8.quantize_weight(jax.random.normal(k, (G, K, 2 * F), jnp.float32) / np.sqrt(K)))(kw)
  return lq, ls, wq.values, wq.scales, jnp.asarray(sizes, jnp.int32)


def _bytes(out):
  return [np.asarray(v).reshape(-1).view(np.uint8) for v in jax.tree.leaves(out)]


def run(name, G, rows, K, F):
  args = operands(G, rows, K, F)
  flops = 2 * rows * K * 2 * F
  print(f"{name}: G {G}, rows {rows}, K {K}, 2F {2 * F}; {flops / 1e12:.2f} TFLOP per call; the two calls write and "
        f"read back a float32 a of {rows * 2 * F * 4 / 1e9:.2f} GB; ms per call (median of 15 after 2 warm-up calls)")
  ref, times = None, {}
  for variant, f in VARIANTS.items():
    jf = jax.jit(f)
    ms = times[variant] = timeit(jf, *args)
    if variant == "GEMM alone":
      check = "(another output: not compared)"
    else:
      out = _bytes(jf(*args))
      ref = out if ref is None else ref
      differ = sum(int(np.count_nonzero(o != r)) for o, r in zip(out, ref))
      check = "same bytes as fused" if differ == 0 else f"{differ} of {sum(o.size for o in out)} bytes differ"
    print(f"  {variant:11s} {ms:8.3f} ms  {flops / (ms * 1e-3) / 1e12:6.1f} TFLOP/s  {check}")
  print("  / GEMM alone: " + ", ".join(f"{v} {times[v] / times['GEMM alone']:.3f}" for v in VARIANTS
                                       if v != "GEMM alone"))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shape", choices=sorted(SHAPES) + ["all"], default="all")
  ap.add_argument("--rows", type=int, help="a shape of your own (with --K, --F, --G)")
  ap.add_argument("--K", type=int, default=1024)
  ap.add_argument("--F", type=int, default=1024)
  ap.add_argument("--G", type=int, default=8)
  args = ap.parse_args()
  if args.rows:
    run("custom", args.G, args.rows, args.K, args.F)
    return
  for name in (sorted(SHAPES) if args.shape == "all" else [args.shape]):
    run(name, *SHAPES[name])


if __name__ == "__main__":
  main()
