"""The FP8 recipe's kernels around its GEMMs, each timed alone on one GPU, with a digest of its outputs so that two
builds of the library can be compared for speed and for the same bytes (benchmarks/run_ab.sh's AB_CMD):

  weight single / pair / single+T   grouped_gemm.quantize_weight_fp8 (the forward's Fp8Weight), _pair (both layouts
                                    from one read), and the single call followed by fp8.transpose_weight (what the
                                    layer runs while fp8_experts.WEIGHT_PAIR_KERNEL_ON_GPU is off)
  columns e4m3 / bf16               quantize_columns_fp8 of row-quantized rows (x and dy as the backward keeps them)
                                    and of bfloat16 rows, 128 x 1 tiles per group, token-contiguous
  swiglu forward / backward         swiglu_forward_fp8 (h and a quantized from GEMM1's float32 output) and
                                    swiglu_backward_fp8 (da rows, da and h columns from a's e4m3 and a bfloat16 dh)
  gemm1 fused                       grouped_matmul_swiglu_fp8: GEMM1 with the SwiGLU and both quantizations in its
                                    epilogue

Per kernel: microseconds per call (on GPUs the device's busy time over --calls calls traced back to back after
warm-up, benchmarks/device_trace.py; elsewhere the median wall time of a call waited for), the bytes it must read
and write at the least, their rate, and the first 12 hex digits of a SHA-1 of its outputs' bytes (the inputs are
fixed by --seed: two builds that agree give the same digests).

  python3 -m benchmarks.bench_fp8_side_kernels                     # Mixtral-like weights, the training preset's rows
  python3 -m benchmarks.bench_fp8_side_kernels --kernels weight    # names containing "weight"
  python3 -m benchmarks.bench_fp8_side_kernels --size tiny         # a CPU try-out
"""
import argparse
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import device_trace
from benchmarks.bench_fp8_column_layout import timeit
from benchmarks.bench_gemm1_swiglu_fp8 import operands
from jax_moe_overlap import fp8
from jax_moe_overlap.grouped_gemm import (grouped_matmul_swiglu_fp8, quantize_columns_fp8, quantize_weight_fp8,
                                          quantize_weight_fp8_pair, swiglu_backward_fp8, swiglu_forward_fp8)

# Per size: the weights [E, K, N] quantized, and (rows, G, C of the column quantizer, F of the SwiGLU kernels, GEMM1's
# (G, rows, K, F)).
SIZES = {
    "full": dict(weights={"mixtral_w1": (8, 4096, 28672), "mixtral_w2": (8, 14336, 4096),
                          "preset_w1": (16, 1024, 2048)},
                 rows=131072, groups=16, widths=(1024, 2048), F=1024,
                 gemm1={"preset": (16, 131072, 1024, 1024), "mixtral": (8, 8192, 4096, 14336)}),
    "tiny": dict(weights={"tiny_w1": (2, 256, 512)}, rows=512, groups=3, widths=(256,), F=128,
                 gemm1={"tiny": (3, 512, 256, 128)}),
}


def digest(out) -> str:
  """The first 12 hex digits of a SHA-1 of out's arrays' bytes, in tree order."""
  h = hashlib.sha1()
  for v in jax.tree.leaves(out):
    a = np.asarray(jax.lax.bitcast_convert_type(v, jnp.uint8) if v.dtype == fp8.E4M3 else v)
    h.update(a.tobytes())
  return h.hexdigest()[:12]


def microseconds(jf, args, calls: int) -> float:
  """Device busy time per call on GPUs (a trace of ``calls`` calls), else the median wall time of a call."""
  if jax.default_backend() == "gpu":
    return device_trace.trace_calls(jf, args, calls=calls, warmup=3)["busy_us"] / calls
  return timeit(jf, *args) * 1e3


def cases(size: str, seed: int):
  """(name, function, args, bytes read + written at the least) of each kernel, built lazily (one weight in memory
  at a time)."""
  s = SIZES[size]
  rng = np.random.default_rng(seed)
  for name, (E, K, N) in s["weights"].items():
    w = jnp.asarray(rng.standard_normal((E, K, N), np.float32) * 0.02, jnp.bfloat16)
    one = E * K * N * 3 + E * (K // 128) * (N // 128) * 4        # bf16 read, e4m3 and scales written
    yield f"weight single {name}", quantize_weight_fp8, (w,), one
    yield f"weight pair {name}", quantize_weight_fp8_pair, (w,), one + E * K * N + E * (K // 128) * (N // 128) * 4
    yield (f"weight single+T {name}", lambda w: fp8.transpose_weight(quantize_weight_fp8(w)), (w,),
           one + 2 * E * K * N)
    del w
  rows, G = s["rows"], s["groups"]
  gs = jnp.asarray(rng.multinomial(rows, rng.dirichlet(np.ones(G) * 2)), jnp.int32)
  tiles = fp8.column_tiles(rows, gs).count

  def columns(x, gs):
    return quantize_columns_fp8(x, fp8.column_tiles(rows, gs))

  for C in s["widths"]:
    x = jnp.asarray(rng.standard_normal((rows, C)), jnp.float32)
    xq, xs = jax.jit(lambda x: fp8.quantize_rows(x, pow2=True))(x)
    out = 128 * tiles * C + tiles * C * 4
    yield f"columns e4m3 C {C}", columns, ((xq, xs), gs), rows * C + rows * C // 128 * 4 + out
    yield f"columns bf16 C {C}", columns, (x.astype(jnp.bfloat16), gs), rows * C * 2 + out
  F = s["F"]
  a = jnp.asarray(rng.standard_normal((rows, 2 * F)) * 2, jnp.float32)
  yield "swiglu forward", swiglu_forward_fp8, (a,), rows * 2 * F * 4 + rows * 3 * F + rows * 3 * F // 128 * 4
  aq, a_s = jax.jit(fp8.quantize_rows)(a)
  dh = jnp.asarray(rng.standard_normal((rows, F)), jnp.bfloat16)
  yield ("swiglu backward", lambda aq, a_s, dh, gs: swiglu_backward_fp8(aq, a_s, dh, fp8.column_tiles(rows, gs)),
         (aq, a_s, dh, gs), rows * 2 * F + rows * 2 * F // 128 * 4 + rows * F * 2 + rows * 2 * F + 128 * tiles * 3 * F)
  for name, (G1, r1, K1, F1) in s["gemm1"].items():
    ops = operands(G1, r1, K1, F1, seed=seed)
    yield f"gemm1 fused {name}", grouped_matmul_swiglu_fp8, ops, r1 * K1 + G1 * K1 * 2 * F1 + r1 * 3 * F1


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--size", choices=sorted(SIZES), default="full")
  ap.add_argument("--kernels", default="", help="only the kernels whose name contains this")
  ap.add_argument("--calls", type=int, default=10, help="calls traced for the device time (GPUs)")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  print(f"{jax.devices()[0].device_kind}; us per call ({'device busy time' if jax.default_backend() == 'gpu' else 'wall'})")
  print(f"{'kernel':34s} {'us':>10s} {'MB':>9s} {'TB/s':>6s}  digest")
  rows = []
  for name, fn, fargs, moved in cases(args.size, args.seed):
    if args.kernels not in name:
      continue
    jf = jax.jit(fn)
    us = microseconds(jf, fargs, args.calls)
    d = digest(jf(*fargs))
    rows.append(dict(kernel=name, us=us, bytes=moved, digest=d))
    print(f"{name:34s} {us:10.1f} {moved / 1e6:9.1f} {moved / (us * 1e-6) / 1e12:6.2f}  {d}", flush=True)
  return rows


if __name__ == "__main__":
  main()
