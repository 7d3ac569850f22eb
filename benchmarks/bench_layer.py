"""Whole MoE expert layer at EP=1 (one GPU), forward and forward+backward: ours vs the XLA path MaxText uses.

ours         jax_moe_overlap.moe_experts(impl="overlap"): dispatch + grouped GEMM1 + expert_combine custom calls.
collective   moe_experts(impl="collective"), the multi-host path: the exchange in XLA collectives (ragged_all_to_all),
             the experts in this library's grouped GEMMs (grouped_matmul_swiglu, grouped_matmul).
jmo-xla      moe_experts(impl="xla"): the same exchange, the experts in jax.lax.ragged_dot.
xla          sort slots by expert, jax.lax.ragged_dot GEMM1, SwiGLU, ragged_dot GEMM2, unsort, weighted sum.
tokamax      the same with tokamax.ragged_dot(implementation="mosaic") (MaxText's GPU choice), when installed.

Columns vs_xla and vs_ours: the xla row's ms / the row's ms, the ours row's ms / the row's ms.

ideal        (forward only) max(reading every expert weight once, the two GEMMs as dense jnp.dot at the same FLOPs),
             each timed here: what no forward pass can beat on this GPU (weight reads bound decode sizes, FLOPs the
             rest). Column vs_ideal = ideal ms / the row's ms.

Nothing is timed before it agrees with the float32 reference (the xla path on float32 copies of the inputs, its
grouped GEMMs at HIGHEST precision on static group rows, references.layer_reference; for fwd+bwd its gradients wrt x,
gates, w1, w2) on the first input set: column err = the largest max |got - ref| / max |ref| over the outputs; above
2e-2 (bf16) the row says "wrong result, not timed". --decode runs decode-sized shapes instead (256 tokens: weight
reads and the fixed costs of a call, not its FLOPs, dominate), forward only unless --passes says otherwise.

  python3 -m benchmarks.bench_layer --quick --out /tmp/layer.jsonl
  python3 -m benchmarks.bench_layer --decode --out /tmp/layer_decode.jsonl
  python3 -m benchmarks.bench_layer --quick --impls xla,ours,collective,jmo-xla --out /tmp/layer_collective.jsonl
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

import jax_moe_overlap as jmo
from benchmarks import baselines
from benchmarks import common
from benchmarks import references


def shapes(quick: bool, decode: bool = False):
  """(name, tokens, D, F, E, k)."""
  if decode:
    return [("decode mixtral-like T=256", 256, 4096, 14336, 8, 2),
            ("decode deepseek-like T=256", 256, 7168, 2048, 32, 8)]
  out = [("seed-like", 8192, 2048, 2048, 8, 2), ("seed-like E=32", 8192, 2048, 2048, 32, 2)]
  if not quick:
    out += [("seed-like T=16k", 16384, 2048, 4096, 16, 2), ("mixtral-like", 4096, 4096, 14336, 8, 2),
            ("deepseek-like E_l=32", 4096, 7168, 2048, 32, 8)]
  return out


MAX_ERR = 2e-2  # bf16 outputs and gradients against the float32 reference


def ideal_fwd_ms(arg_sets) -> tuple[float, float]:
  """(ms to read every weight once, ms of the forward's two GEMMs as dense dots at the same FLOPs) on these inputs.

  The read is a float32-accumulated sum of w1 and w2 (bandwidth-bound); the dense GEMMs are [T*k, D] @ w1[0] and
  [T*k, F] @ w2[0] (expert 0's weights only: the FLOPs without the weight traffic)."""
  read = jax.jit(lambda w1, w2: jnp.sum(w1, dtype=jnp.float32) + jnp.sum(w2, dtype=jnp.float32))
  dense = jax.jit(lambda xs, h, w1, w2: (jnp.dot(xs, w1[0]), jnp.dot(h, w2[0])))
  dense_sets = []
  for x, ids, _, w1, w2 in arg_sets:
    rows = ids.size
    xs = jnp.tile(x, (ids.shape[1], 1))[:rows]
    h = jnp.tile(x[:, :1], (ids.shape[1], w2.shape[1]))[:rows]  # [rows, F], nonzero
    dense_sets.append((xs, h, w1, w2))
  return (common.time_fn(read, [(a[3], a[4]) for a in arg_sets]) * 1e3, common.time_fn(dense, dense_sets) * 1e3)


def pass_fn(f, pname: str):
  """jit of f (fwd) or of the gradients of sum(f(...)^2) wrt x, gates, w1, w2 (fwd+bwd)."""
  if pname == "fwd":
    return jax.jit(f)
  return jax.jit(jax.grad(lambda x, ids, g, w1, w2: jnp.sum(f(x, ids, g, w1, w2).astype(jnp.float32) ** 2),
                          argnums=(0, 2, 3, 4)))


def error_vs(ref_outs, got) -> float:
  """The largest max-relative error of got's outputs against the reference's."""
  return max(references.max_rel_err(g, r) for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref_outs)))


def main():
  ap = common.shape_parser("layer.jsonl")
  ap.add_argument("--decode", action="store_true", help="decode-sized shapes (256 tokens) instead")
  ap.add_argument("--passes", default=None, help="comma list of fwd, fwd+bwd (default: both; fwd with --decode)")
  ap.add_argument("--impls", default="",
                  help="comma list of implementations to run (default: all): xla,ours,collective,jmo-xla,tokamax")
  args = ap.parse_args()
  passes = (args.passes or ("fwd" if args.decode else "fwd,fwd+bwd")).split(",")
  mesh = jax.make_mesh((1,), ("expert",))
  impls = {"xla": baselines.xla_layer(jax.lax.ragged_dot), "ours": lambda *a: jmo.moe_experts(*a, mesh=mesh)[0]}
  for name, impl in (("collective", "collective"), ("jmo-xla", "xla")):
    impls[name] = lambda *a, impl=impl: jmo.moe_experts(*a, mesh=mesh, impl=impl)[0]
  tokamax_fn, why = baselines.tokamax_ragged_dot()
  if tokamax_fn:
    impls["tokamax"] = baselines.xla_layer(tokamax_fn)
  else:
    print(why)
  if args.impls:
    impls = {n: f for n, f in impls.items() if n in args.impls.split(",")}
  table = common.Table(["shape", "pass", "impl", "ms", "vs_xla", "vs_ours", "vs_ideal", "err"])
  for name, T, D, F, E, k in shapes(args.quick, args.decode):
    if not common.shape_selected(args, name):
      continue
    rng = np.random.default_rng(T + E)
    arg_sets = []
    for s in range(2):
      key = jax.random.PRNGKey(s)
      ks = jax.random.split(key, 4)
      ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32))
      arg_sets.append((jax.random.normal(ks[0], (T, D), jnp.bfloat16), ids,
                       jax.nn.softmax(jax.random.normal(ks[1], (T, k)), -1),
                       (jax.random.normal(ks[2], (E, D, 2 * F)) / np.sqrt(D)).astype(jnp.bfloat16),
                       (jax.random.normal(ks[3], (E, F, D)) / np.sqrt(F)).astype(jnp.bfloat16)))
    for pname in passes:
      base = ours = ideal = None
      if pname == "fwd":
        read_ms, dense_ms = ideal_fwd_ms(arg_sets)
        ideal = max(read_ms, dense_ms)
        print(f"  {name}: ideal forward = max(weight read {read_ms:.3f} ms, dense GEMMs {dense_ms:.3f} ms)", flush=True)
        table.add(shape=name, **{"pass": pname}, impl="ideal", ms=f"{ideal:.3f}", vs_ideal="1.00")
      ref_outs = pass_fn(references.layer_reference(np.asarray(arg_sets[0][1]), E), pname)(*arg_sets[0])
      for iname, f in impls.items():
        fn = pass_fn(f, pname)
        try:
          err = error_vs(ref_outs, fn(*arg_sets[0]))
          if not err <= MAX_ERR:  # (NaN too)
            table.add(shape=name, **{"pass": pname}, impl=iname, ms="wrong result, not timed", err=f"{err:.1e}")
            continue
          ms = common.time_fn(fn, arg_sets) * 1e3
        except Exception as e:  # pylint: disable=broad-except
          table.add(shape=name, **{"pass": pname}, impl=iname, ms=f"error: {type(e).__name__}: {str(e)[:80]}")
          continue
        if iname == "xla":
          base = ms
        if iname == "ours":
          ours = ms
        table.add(shape=name, **{"pass": pname}, impl=iname, ms=f"{ms:.3f}",
                  vs_xla=f"{base / ms:.2f}" if base else "", vs_ours=f"{ours / ms:.2f}" if ours else "",
                  vs_ideal=f"{ideal / ms:.2f}" if ideal else "", err=f"{err:.1e}")
      del ref_outs
  table.finish(args.out)


if __name__ == "__main__":
  main()
