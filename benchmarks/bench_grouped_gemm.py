"""Grouped GEMM (the producer's job) on one GPU: our kernel vs dense cuBLAS vs jax.lax.ragged_dot vs tokamax.

Every grouped method's output on the first input set is compared with lax.ragged_dot's (column max_err_vs_xla:
max abs difference over max |xla|, bf16 outputs) before it is timed.

For each shape: ``rows`` routed rows [rows, K] @ per-group weights [G, K, N] in bfloat16, grouped by ``group_sizes``.
Dense is one [rows, K] @ [K, N] GEMM: the same FLOPs with no grouping, the ceiling a grouped GEMM aims at.

  python3 -m benchmarks.bench_grouped_gemm --quick --out /tmp/gemm.jsonl
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import baselines
from benchmarks import common
from jax_moe_overlap import ops


def shapes(quick: bool):
  """(name, rows, K, N, groups): the seed paper's sweep, Mixtral-8x7B-like, DeepSeek-V3-like."""
  out = []
  for tokens in ((8192,) if quick else (8192, 16384)):
    for n in (4096, 8192):
      for groups in ((8, 64) if quick else (4, 8, 16, 32, 64)):
        out.append((f"seed T={tokens} N={n} E={groups}", tokens * 2, 2048, n, groups))
  out.append(("mixtral gemm1", 8192 * 2, 4096, 2 * 14336, 8))
  out.append(("mixtral gemm2", 8192 * 2, 14336, 4096, 8))
  out.append(("deepseek EP8 gemm2", 8192 * 8, 2048, 7168, 32))
  out.append(("deepseek EP32 gemm2", 8192 * 8, 2048, 7168, 8))
  return out


class Transposed:
  """A method that takes the weights as [G, N, K]: the benchmark hands it a transposed copy."""

  def __init__(self, fn):
    self.fn = fn


def make_methods():
  methods = {
      "dense": lambda x, w, gs: jnp.dot(x, w[0]),
      "lax.ragged_dot": lambda x, w, gs: jax.lax.ragged_dot(x, w, gs),
  }
  tokamax_fn, why = baselines.tokamax_ragged_dot()
  if tokamax_fn:
    methods["tokamax.mosaic"] = tokamax_fn
  else:
    print(why)
  if ops.with_cuda():
    # Our tile engine (the producer's) as the bare grouped-GEMM custom call, with the weights as stored and, as the
    # input gradient reads them, transposed ([G, N, K] passed in; the transposed copy is made outside the timing).
    methods["ours"] = ops.grouped_matmul
    methods["ours (w^T)"] = Transposed(lambda x, wt, gs: ops.grouped_matmul(x, wt, gs, transpose_rhs=True))
  return methods


def main():
  ap = common.shape_parser("grouped_gemm.jsonl", skews="balanced,moderate,stress")
  ap.add_argument("--methods", default="", help="comma-separated method names (dense is always kept)")
  args = ap.parse_args()
  methods = make_methods()
  if args.methods:
    keep = set(args.methods.split(",")) | {"dense"}
    methods = {k: v for k, v in methods.items() if k in keep}
  table = common.Table(["shape", "skew", "method", "ms", "tflops", "vs_dense", "max_err_vs_xla"])
  for name, rows, k, n, groups in shapes(args.quick):
    if not common.shape_selected(args, name):
      continue
    for skew in args.skews.split(","):
      gs = jnp.asarray(common.group_sizes(rows, groups, skew))
      keys = jax.random.split(jax.random.PRNGKey(rows + n + groups), 3)
      arg_sets = [(jax.random.normal(kk, (rows, k), jnp.bfloat16),
                   (jax.random.normal(kk, (groups, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16), gs)
                  for kk in keys]
      flops = 2.0 * rows * k * n
      dense_ms = None
      xla_out = None
      for mname, fn in methods.items():
        sets = arg_sets
        if isinstance(fn, Transposed):
          fn = fn.fn
          sets = [(x, jnp.swapaxes(w, 1, 2).copy(), g) for x, w, g in arg_sets]
        err = ""
        try:
          if mname == "lax.ragged_dot":  # the reference for every other grouped method (same bf16 output)
            xla_out = np.asarray(jax.jit(fn)(*sets[0]).astype(jnp.float32))
          elif mname != "dense" and xla_out is not None:
            got = np.asarray(jax.jit(fn)(*sets[0]).astype(jnp.float32))
            err = f"{np.max(np.abs(got - xla_out)) / np.max(np.abs(xla_out)):.1e}"
          sec = common.time_fn(jax.jit(fn), sets)
        except Exception as e:  # pylint: disable=broad-except
          table.add(shape=name, skew=skew, method=mname, ms=f"error: {type(e).__name__}")
          continue
        ms = sec * 1e3
        if mname == "dense":
          dense_ms = ms
        table.add(shape=name, skew=skew, method=mname, ms=f"{ms:.3f}", tflops=f"{flops / sec / 1e12:.0f}",
                  vs_dense=f"{dense_ms / ms:.2f}" if dense_ms else "", max_err_vs_xla=err)
  table.finish(args.out)


if __name__ == "__main__":
  main()
