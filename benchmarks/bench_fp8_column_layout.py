"""The FP8 weight gradient's operand preparation, timed alone on one GPU: fp8.quantize_columns (128 x 1 tiles per
group) and the token-contiguous layout the wgrad kernel reads ([C, Mp], each group from a multiple of 128), by the
custom call the recipe runs (grouped_gemm.quantize_columns_fp8: one kernel) and by XLA ops in variants: scatters
(fp8.token_contiguous, the path the custom call replaced), gathers through the inverse map, the gathered rows
materialized, amax by scatter with the layout by gather, and x gathered once into the padded layout. Every variant's
output bytes are checked equal to the first's (the "same" column). docs/performance.md, "Where the FP8 step goes",
quotes it; in a whole training step XLA may lay the XLA variants' arrays out differently (it does for the gathers),
so this times the ops alone.

  python3 -m benchmarks.bench_fp8_column_layout      # M = 163840 rows, G = 16, C = 1024 and 2048, bf16 in
  python3 -m benchmarks.bench_fp8_column_layout --dtype float32   # the recipe's wgrad operands are float32
"""
import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_overlap import fp8
from jax_moe_overlap.grouped_gemm import quantize_columns_fp8

T = fp8.TILE
ob = jax.lax.optimization_barrier


def source_rows(tiles, gs):
  """[128 count] int32: the row at each place of the padded layout (M where none), the inverse of padded_row."""
  M = tiles.padded_row.shape[0]
  return jnp.full((T * tiles.count,), M, jnp.int32).at[tiles.padded_row].set(jnp.arange(M, dtype=jnp.int32),
                                                                               mode="drop")


def gather(rows, src, fill=0, bar=False):
  g = jnp.take(rows, src, axis=0, mode="fill", fill_value=fill)
  return ob(g) if bar else g


def q_rows(xf, t, s):
  row_s = jnp.take(s, t.row_tile, axis=0, mode="fill", fill_value=1.0)
  return jnp.where((t.row_tile < t.count)[:, None], fp8._quantize(xf, row_s), jnp.zeros((), fp8.E4M3))


def q_gather(x, t, src, bar=False):
  xf = x.astype(jnp.float32)
  amax = gather(jnp.abs(xf), src, 0.0, bar).reshape(t.count, T, -1).max(axis=1)
  s = fp8.tile_scale(amax)
  return q_rows(xf, t, s), s


def lay_scatter(q, t):
  return jax.lax.bitcast_convert_type(fp8.token_contiguous(q, t), jnp.uint8)


def lay_gather(q, src, bar=False):
  return gather(jax.lax.bitcast_convert_type(q, jnp.uint8), src, 0, bar).T


def padded_first(x, t, src):   # x gathered once into the padded layout; amax, quantize, transpose there
  xf = gather(x, src, 0, True).astype(jnp.float32).reshape(t.count, T, -1)
  s = fp8.tile_scale(jnp.abs(xf).max(axis=1))
  q = fp8._quantize(xf, s[:, None, :]).reshape(T * t.count, -1)
  return jax.lax.bitcast_convert_type(q, jnp.uint8).T


def variant(name):
  def f(x, gs):
    t = fp8.column_tiles(x.shape[0], gs)
    src = ob(source_rows(t, gs))
    if name == "custom call (shipped)":
      return jax.lax.bitcast_convert_type(quantize_columns_fp8(x, t)[0], jnp.uint8)
    if name == "scatters":
      return lay_scatter(fp8.quantize_columns(x, t)[0], t)
    if name == "gathers":
      return lay_gather(q_gather(x, t, src)[0], src)
    if name == "gathers, rows materialized":
      return lay_gather(q_gather(x, t, src, True)[0], src, True)
    if name == "amax by scatter, layout by gather":
      return lay_gather(fp8.quantize_columns(x, t)[0], src, True)
    return padded_first(x, t, src)
  return f


VARIANTS = {n: variant(n) for n in ("custom call (shipped)", "scatters", "gathers", "gathers, rows materialized",
                                    "amax by scatter, layout by gather", "padded layout first")}


def timeit(f, *a, n=15):
  """Median wall ms of n calls after two warm-up calls, each waited for."""
  jax.block_until_ready(f(*a))
  jax.block_until_ready(f(*a))
  ts = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*a))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts) * 1e3


def main(M=163840, G=16, rows=131072, widths=(1024, 2048), dtype=jnp.bfloat16):
  rng = np.random.default_rng(0)
  sizes = rng.multinomial(rows, rng.dirichlet(np.ones(G) * 2))
  gs = jnp.asarray(sizes, jnp.int32)
  print(f"M {M}, G {G}, rows {sizes.sum()}, {jnp.dtype(dtype).name} in; ms per call (median of 15); 'same': equal "
        "to the first variant (XLA:GPU's float32 division is not correctly rounded, openxla/xla#37181, so the XLA "
        "variants may part from the custom call by one e4m3 step where x / s lies next to a midpoint)")
  for C in widths:
    x = jnp.asarray(rng.standard_normal((M, C)), dtype)
    ref = None
    for name, f in VARIANTS.items():
      jf = jax.jit(f)
      ms = timeit(jf, x, gs)
      out = np.asarray(jf(x, gs))
      ref = out if ref is None else ref
      n = np.count_nonzero(out != ref)
      print(f"C {C:5d}  {name:36s} {ms:8.3f} ms  {'same' if n == 0 else f'{n} of {out.size} bytes differ'}")


if __name__ == "__main__":
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the rows' dtype")
  main(dtype=jnp.dtype(ap.parse_args().dtype))
