"""Expert tensor parallelism: the MoE expert layer (post-router) on an (expert=EP, tensor=TP) mesh, forward and
forward+backward, at Mixtral-like shapes (E = 8 experts of d_ff 14336, top-2, d_model 4096) and 4,096-16,384 tokens.

Rows (every one on the same global inputs, bfloat16):

overlap      moe_experts(impl="overlap", tensor_axis="tensor"): the shard slots of tensor_parallel.py on the custom
             calls (each choice dispatched to every member of its expert's tensor group), the shards' partials summed
             as the library chooses (call_site.tensor_reduce: at these shapes the per-slot return, expert_combine
             overlapped with GEMM2).
gather_rs    overlap with CallConfig(tensor_reduce="gather_rs"): GEMM2 + GatherRS (each rank's partials gathered
             per token and reduce-scattered over the group, overlapped with GEMM2), forward and backward.
serialized   overlap with CallConfig(serialize=True): no overlap anywhere, the same results.
collective   impl="collective": all_gather over the tensor axis, XLA's exchange over the expert axis with this
             library's grouped GEMMs, psum_scatter over the tensor axis.
xla          impl="xla": the same with lax.ragged_dot.
ep_only      overlap on a 1-D expert mesh of the same EP TP devices, whole experts (no tensor axis): what expert
             parallelism alone does on these devices where E allows it (E divisible by EP TP).

Nothing is timed before it agrees with the float32 reference on the same inputs (the sparse expert-parallel one of
benchmarks/references.py, on a 1-D mesh of the same devices): relative error of y and, for fwd+bwd, of the gradients
wrt x, gates, w1, w2 of sum(y * ct), within --rtol. Each row reports ms (median, benchmarks.common.time_fn) and
overlap's speed-up over it (ratio > 1: overlap faster).

  python3 -m benchmarks.bench_tp_layer                        # EP = 2, TP = 2 on 4 GPUs, the Mixtral-like shapes
  python3 -m benchmarks.bench_tp_layer --quick --devices 4    # a CPU try-out (4 virtual devices, small shapes)
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common import virtual_cpu_devices

if __name__ == "__main__":
  virtual_cpu_devices(sys.argv)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_moe_overlap as jmo  # noqa: E402
from benchmarks import references  # noqa: E402
from benchmarks.common import AXIS, Table, rows_kept_on_sigterm, time_fn, topk_routing  # noqa: E402
from jax_moe_overlap.plan import expert_capacity  # noqa: E402

IMPLS = ("overlap", "gather_rs", "serialized", "collective", "xla", "ep_only")
# (name, global tokens, d_model, d_ff, experts, top-k): Mixtral-like at --tokens
MIXTRAL = (4096, 14336, 8, 2)
QUICK = [("quick T=256", 256, 128, 256, 8, 2)]


def parse_args(argv):
  ap = argparse.ArgumentParser()
  ap.add_argument("--ep", type=int, default=2, help="expert axis size")
  ap.add_argument("--tp", type=int, default=2, help="tensor axis size")
  ap.add_argument("--devices", type=int, default=None, help="CPU try-out: virtual devices (default 4)")
  ap.add_argument("--quick", action="store_true", help="one small shape")
  ap.add_argument("--tokens", default="4096,8192,16384", help="global token counts of the Mixtral-like shapes")
  ap.add_argument("--impls", default=",".join(IMPLS))
  ap.add_argument("--passes", default="fwd,fwdbwd")
  ap.add_argument("--skew", default="balanced", help="routing skew: balanced, moderate or stress")
  ap.add_argument("--rtol", type=float, default=1e-2)
  ap.add_argument("--check-only", action="store_true", help="check every row against the reference; time nothing")
  ap.add_argument("--out", default="/tmp/bench_tp_layer.jsonl")
  return ap.parse_args(argv)


def meshes(ep: int, tp: int):
  devs = jax.devices()[:ep * tp]
  if len(devs) < ep * tp:
    raise SystemExit(f"--ep {ep} --tp {tp} needs {ep * tp} devices; {len(jax.devices())} here")
  auto = jax.sharding.AxisType.Auto
  two_d = jax.sharding.Mesh(np.array(devs).reshape(ep, tp), (AXIS, "tensor"), axis_types=(auto, auto))
  one_d = jax.sharding.Mesh(np.array(devs), (AXIS,), axis_types=(auto,))
  return two_d, one_d


def operands(T, D, F, E, k, skew, seed, two_d, one_d):
  """Global bf16 inputs on the (expert, tensor) mesh (w1 as its [E, D, 2, F] view) and the same values on the 1-D
  mesh; the cotangent ct."""
  ks = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(ks[0], (T, D), jnp.bfloat16)
  ids = jnp.asarray(topk_routing(T, E, k, skew, seed))
  gates = jax.nn.softmax(jax.random.normal(ks[1], (T, k)), -1)
  w1 = (jax.random.normal(ks[2], (E, D, 2 * F)) / np.sqrt(D)).astype(jnp.bfloat16)
  w2 = (jax.random.normal(ks[3], (E, F, D)) / np.sqrt(F)).astype(jnp.bfloat16)
  ct = jax.random.normal(ks[4], (T, D), jnp.float32)
  put = lambda a, mesh, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))  # noqa: E731
  tok = (AXIS, "tensor")
  tp_args = (put(x, two_d, tok), put(ids, two_d, tok), put(gates, two_d, tok),
             put(w1.reshape(E, D, 2, F), two_d, AXIS, None, None, "tensor"), put(w2, two_d, AXIS, "tensor"))
  ep_args = tuple(put(a, one_d, AXIS) for a in (x, ids, gates, w1, w2))
  return tp_args, ep_args, put(ct, two_d, tok), put(ct, one_d, AXIS)


def layer(impl, mesh, passes):
  """(x, ids, gates, w1, w2, ct) -> y (fwd) or (y, grads) (fwdbwd), jitted."""
  tensor = None if impl == "ep_only" else "tensor"
  config = jmo.CallConfig(serialize=impl == "serialized", tensor_reduce="gather_rs" if impl == "gather_rs" else "auto")
  base = "overlap" if impl in ("serialized", "ep_only", "gather_rs") else impl

  def y_of(x, ids, gates, w1, w2):
    return jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl=base, config=config, tensor_axis=tensor)[0]

  if passes == "fwd":
    return jax.jit(lambda x, ids, gates, w1, w2, ct: y_of(x, ids, gates, w1, w2))

  def loss(x, gates, w1, w2, ids, ct):
    y = y_of(x, ids, gates, w1, w2)
    return jnp.sum(y.astype(jnp.float32) * ct), y

  grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
  return jax.jit(lambda x, ids, gates, w1, w2, ct: (lambda out: (out[0][1], out[1]))(grads(x, gates, w1, w2, ids,
                                                                                          ct)))


def reference(one_d, ids_host, E, k, passes):
  """The float32 sparse reference on the 1-D mesh: (x, ids, gates, w1, w2, ct) -> y or (y, grads)."""
  R = one_d.size
  cap = expert_capacity(ids_host.shape[0] // R, R, k, E, None)
  experts = np.arange(E)
  blocks = references.reference_blocks(ids_host, experts, R, E)
  f = references.sparse_reference_layer(one_d, E, cap, blocks)
  ex = jax.device_put(jnp.asarray(experts, jnp.int32), NamedSharding(one_d, P(AXIS)))

  def y_of(x, ids, gates, w1, w2):
    return f(x.astype(jnp.float32), ids, gates.astype(jnp.float32), w1.astype(jnp.float32),
             w2.astype(jnp.float32), ex)

  if passes == "fwd":
    return jax.jit(lambda x, ids, gates, w1, w2, ct: y_of(x, ids, gates, w1, w2))

  def loss(x, gates, w1, w2, ids, ct):
    y = y_of(x, ids, gates, w1, w2)
    return jnp.sum(y * ct), y

  grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
  return jax.jit(lambda x, ids, gates, w1, w2, ct: (lambda out: (out[0][1], out[1]))(grads(x, gates, w1, w2, ids,
                                                                                          ct)))


def errors(got, want) -> list[float]:
  """Relative errors of y (and each gradient), w1's gradient compared in the [E, D, 2F] layout."""
  return [references.rel_err(a.reshape(b.shape) if a.shape != b.shape else a, b)
          for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))]


def main(argv=None) -> Table:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  two_d, one_d = meshes(args.ep, args.tp)
  impls = [i for i in args.impls.split(",") if i]
  table = Table(["shape", "pass", "impl", "ep", "tp", "ms", "overlap_speedup", "max_rel_err"])
  with rows_kept_on_sigterm(table, args.out, "bench_tp_layer"):
    shapes = QUICK if args.quick else [(f"mixtral T={t}", int(t), *MIXTRAL) for t in args.tokens.split(",")]
    for name, T, D, F, E, k in shapes:
      tp_args, ep_args, ct_tp, ct_ep = operands(T, D, F, E, k, args.skew, 0, two_d, one_d)
      ids_host = np.asarray(ep_args[1])
      for passes in args.passes.split(","):
        want = reference(one_d, ids_host, E, k, passes)(*ep_args, ct_ep)
        times = {}
        for impl in impls:
          if impl == "ep_only" and E % one_d.size:
            continue
          run_args = (*ep_args, ct_ep) if impl == "ep_only" else (*tp_args, ct_tp)
          mesh = one_d if impl == "ep_only" else two_d
          fn = layer(impl, mesh, passes)
          errs = errors(fn(*run_args), want)
          if not max(errs) < args.rtol:
            raise SystemExit(f"{name} {passes} {impl}: relative errors {errs} (y, dx, dgates, dw1, dw2) exceed "
                             f"{args.rtol}: not timed")
          ep, tp = (args.ep * args.tp, 1) if impl == "ep_only" else (args.ep, args.tp)
          row = dict(shape=name, **{"pass": passes}, impl=impl, ep=ep, tp=tp, max_rel_err=f"{max(errs):.1e}")
          if not args.check_only:
            times[impl] = time_fn(fn, [run_args])
            row.update(ms=round(times[impl] * 1e3, 3),
                       overlap_speedup=round(times[impl] / times["overlap"], 3) if "overlap" in times else "")
          table.add(**row)
  return table


if __name__ == "__main__":
  main()
