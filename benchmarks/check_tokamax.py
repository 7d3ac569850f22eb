"""Is tokamax's mosaic ragged_dot right, forward and backward, on the shapes we compare against?

For each (rows, K, N, groups) of the layer benchmarks' GEMMs, on bf16 inputs with random balanced group sizes that
cover every row: out = ragged_dot(x, w, gs), and the VJP of <out, cot> for a random cotangent (dx, dw), each against
the same groups at HIGHEST precision on float32 copies (references.static_ragged_dot). Prints one row per shape with the
three max-relative errors (max |got - ref| / max |ref|); bf16 results are expected near 1e-2 or below.

  python3 -m benchmarks.check_tokamax [--out tokamax_check.jsonl]
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import baselines
from benchmarks import bench_layer
from benchmarks import common
from benchmarks import references


def layer_gemms():
  """(name, rows, K, N, groups): GEMM1 (N = 2F) and GEMM2 of each of bench_layer.py's shapes (rows = T k)."""
  out = []
  for name, T, D, F, E, k in bench_layer.shapes(quick=False):
    out += [(f"{name} gemm1", T * k, D, 2 * F, E), (f"{name} gemm2", T * k, F, D, E)]
  return out


SHAPES = layer_gemms()


def vjp_of(fn, x, w, gs, cot):
  out, pull = jax.vjp(lambda a, b: fn(a, b, gs), x, w)
  return (out,) + pull(cot.astype(out.dtype))


def main():
  ap = common.shape_parser("tokamax_check.jsonl", quick=False)
  args = ap.parse_args()
  tokamax_fn, why = baselines.tokamax_ragged_dot()
  if tokamax_fn is None:
    sys.exit(why)
  table = common.Table(["shape", "group_sizes", "err_out", "err_dx", "err_dw"])
  for name, rows, K, N, G in SHAPES:
    if not common.shape_selected(args, name):
      continue
    kx, kw, kc = jax.random.split(jax.random.PRNGKey(rows + K + N + G), 3)
    ids = np.random.default_rng(G).integers(0, G, rows)
    gs = jnp.asarray(np.bincount(ids, minlength=G).astype(np.int32))
    x = jax.random.normal(kx, (rows, K), jnp.bfloat16)
    w = (jax.random.normal(kw, (G, K, N), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
    cot = jax.random.normal(kc, (rows, N), jnp.float32)
    ref_fn = references.static_ragged_dot(np.asarray(gs))
    got = jax.jit(lambda a, b, g, c: vjp_of(tokamax_fn, a, b, g, c))(x, w, gs, cot)
    ref = jax.jit(lambda a, b, g, c: vjp_of(ref_fn, a, b, g, c))(x.astype(jnp.float32), w.astype(jnp.float32), gs,
                                                                   cot)
    errs = [references.max_rel_err(g_, r_) for g_, r_ in zip(got, ref)]
    table.add(shape=name, group_sizes=f"{int(gs.min())}..{int(gs.max())} x{G}",
              **{k: f"{e:.1e}" for k, e in zip(("err_out", "err_dx", "err_dw"), errs)})
    del got, ref
  table.finish(args.out)


if __name__ == "__main__":
  main()
