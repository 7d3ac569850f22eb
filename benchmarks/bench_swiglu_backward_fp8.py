"""The FP8 recipe's SwiGLU backward timed alone on one GPU, at the training preset's expert shape: from the kept a
(e4m3, 1 x 128 scales) and the dgrad's dh (float32) to the three quantized operands the backward's GEMMs read (da
1 x 128 for dx; da and h 128 x 1 per expert, token-contiguous, for dW1 and dW2), by

  custom call (shipped)   grouped_gemm.swiglu_backward_fp8: one kernel, one read of a and dh
  XLA + column calls      what the recipe ran before it: a dequantized, h and da by jax.vjp in XLA, fp8.quantize_rows
                          of da in XLA, quantize_columns_fp8 (one custom call each) of h and of da
  XLA only                the jnp composition with fp8.quantize_columns and fp8.token_contiguous (the definition)

Each variant's outputs are compared with the custom call's: the count of differing bytes prints (XLA's exp and its
float32 division, div.full on GPUs, part from the kernel's in the last bit now and then: one e4m3 step at most).

  python3 -m benchmarks.bench_swiglu_backward_fp8                    # M = 131072 rows, F = 1024, G = 16
  python3 -m benchmarks.bench_swiglu_backward_fp8 --rows 65536 --F 2048
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import device_trace
from benchmarks.bench_fp8_column_layout import timeit
from jax_moe_overlap import fp8, fp8_experts
from jax_moe_overlap.expert_gemms import swiglu
from jax_moe_overlap.grouped_gemm import quantize_columns_fp8, swiglu_backward_fp8


def shipped(aq, a_s, dh, tiles):
  da_rows, da_cols, h_cols = swiglu_backward_fp8(aq, a_s, dh, tiles)
  return da_rows, da_cols, h_cols


def xla_and_column_calls(aq, a_s, dh, tiles):
  h, vjp = jax.vjp(swiglu, fp8.dequantize_rows(aq, a_s))
  (da,) = vjp(dh)
  return fp8.quantize_rows(da), quantize_columns_fp8(da, tiles), quantize_columns_fp8(h, tiles)


def xla_only(aq, a_s, dh, tiles):
  h_c, da_r, da_c = fp8_experts.swiglu_backward_composed(fp8.quantize_columns)(aq, a_s, dh, tiles)
  return da_r, (fp8.token_contiguous(da_c[0], tiles), da_c[1]), (fp8.token_contiguous(h_c[0], tiles), h_c[1])


VARIANTS = {"custom call (shipped)": shipped, "XLA + column calls": xla_and_column_calls, "XLA only": xla_only}


def _bytes(out):
  return [np.asarray(jax.lax.bitcast_convert_type(v, jnp.uint8) if v.dtype == fp8.E4M3 else v).view(np.uint8)
          for v in jax.tree.leaves(out)]


def time_and_compare(variants, args, moved, width=24, device_calls=0):
  """Times each variant (a jitted function of args) and prints its ms, the bandwidth that moving `moved` bytes in
  that time is, and how many of its output bytes differ from the first variant's. The ms is the wall time of a call
  waited for (timeit): it holds the call's dispatch and the wait, tens of microseconds that can dwarf a small
  kernel. With device_calls, a profiler trace of that many calls back to back (device_trace.trace_calls) gives the
  device time too, the GPU's busy time per call (the union of the call's kernels, the gaps between calls left out),
  and the bandwidth is from it."""
  ref = None
  for name, jf in variants.items():
    ms = timeit(jf, *args)
    device = ""
    if device_calls:
      trace = device_trace.trace_calls(jf, args, calls=device_calls)
      us = trace["busy_us"] / device_calls if "busy_us" in trace else float("nan")
      device, ms_bw = f"  {us:9.1f} us device", us * 1e-3
    else:
      ms_bw = ms
    out = _bytes(jf(*args))
    ref = out if ref is None else ref
    n = sum(int(np.count_nonzero(o != r)) for o, r in zip(out, ref))
    total = sum(o.size for o in out)
    print(f"{name:{width}s} {ms:8.3f} ms wall{device}  {moved / (ms_bw * 1e-3) / 1e12:5.2f} TB/s equivalent  "
          f"{'same' if n == 0 else f'{n} of {total} bytes differ'}")


def main(rows=131072, F=1024, G=16):
  rng = np.random.default_rng(0)
  sizes = rng.multinomial(rows, rng.dirichlet(np.ones(G) * 2))
  gs = jnp.asarray(sizes, jnp.int32)
  a = jnp.asarray(rng.standard_normal((rows, 2 * F)) * 2, jnp.float32)
  aq, a_s = jax.jit(fp8.quantize_rows)(a)
  dh = jnp.asarray(rng.standard_normal((rows, F)), jnp.float32)
  moved = rows * (2 * F + 2 * F // 32 + 4 * F) + rows * (2 * F + 2 * F // 32) + 3 * F * rows   # read + written, ~
  print(f"rows {rows}, F {F}, G {G}; ms per call (median of 15); at least {moved / 2**30:.2f} GiB read + written "
        "by the shipped kernel")
  jitted = {name: jax.jit(lambda aq, a_s, dh, gs, f=f: f(aq, a_s, dh, fp8.column_tiles(aq.shape[0], gs)))
            for name, f in VARIANTS.items()}
  time_and_compare(jitted, (aq, a_s, dh, gs), moved)


if __name__ == "__main__":
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--rows", type=int, default=131072)
  ap.add_argument("--F", type=int, default=1024)
  ap.add_argument("--G", type=int, default=16)
  args = ap.parse_args()
  main(args.rows, args.F, args.G)
