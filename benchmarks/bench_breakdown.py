"""Where the time of one MoE expert layer goes at EP=1: each stage of the forward pass timed on its own, beside the
whole layer (the stages do not sum to it exactly: the whole layer also pays launch gaps, and XLA fuses across
stages).

  plan            routing plan from the expert ids (counts, all_gather, sorts, offsets)
  dispatch        jmo_dispatch: token rows to the experts' recv rows
  gemm1           jmo_grouped_matmul x_recv [cap, D] @ w1 [E, D, 2F] -> float32
  swiglu          silu(a[:, :F]) * a[:, F:] in float32, cast to the model dtype
  expert_combine  jmo_expert_combine: GEMM2 + flags + consumer push + weighted combine
  layer           moe_experts(impl="overlap") forward

  python3 -m benchmarks.bench_breakdown --out /tmp/breakdown.jsonl
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_moe_overlap as jmo
from benchmarks import common
from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap.ops import (CallConfig, RankInfo, Workspace, WorkspaceSizes, dispatch, expert_combine,
                                 grouped_matmul, swiglu)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default="8192,2048,2048,8,2;8192,2048,2048,32,2",
                  help="';'-separated T,D,F,E,k")
  ap.add_argument("--out", default="breakdown.jsonl")
  args = ap.parse_args()
  mesh = jax.make_mesh((1,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
  smap = lambda f, n: jax.shard_map(f, mesh=mesh, in_specs=(P(),) * n, out_specs=P(), check_vma=False)
  table = common.Table(["shape", "stage", "ms", "share_of_layer"])
  for spec in args.shapes.split(";"):
    T, D, F, E, k = (int(v) for v in spec.split(","))
    name = f"T={T} D={D} F={F} E={E} k={k}"
    ks = jax.random.split(jax.random.PRNGKey(T + E), 5)
    x = jax.random.normal(ks[0], (T, D), jnp.float32).astype(jnp.bfloat16)
    ids = jnp.asarray(common.topk_routing(T, E, k, "balanced"))
    gates = jax.nn.softmax(jax.random.normal(ks[1], (T, k)), -1).astype(jnp.float32)
    w1 = (jax.random.normal(ks[2], (E, D, 2 * F)) / np.sqrt(D)).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[3], (E, F, D)) / np.sqrt(F)).astype(jnp.bfloat16)
    cap_e = plan_lib.expert_capacity(T, 1, k, E, None)
    cap = plan_lib.recv_capacity(T, 1, k, E, cap_e)
    info = RankInfo(Workspace.get(mesh, "expert", WorkspaceSizes(row_bytes=D * 2, recv_rows=cap, ret_rows=T * k,
                                                                 num_segments=E)), CallConfig())
    make_plan = lambda i: plan_lib.make_plan(i, plan_lib.local_counts(i, E).reshape(1, 1, E), jnp.int32(0), cap_e)
    pl = jax.jit(smap(make_plan, 1))(ids)
    x_recv = jax.jit(smap(lambda x, pl: dispatch(x, jnp.arange(T * k, dtype=jnp.int32) // k, pl, cap, info), 2))(
        x, pl)
    a = grouped_matmul(x_recv, w1, pl.expert_rows, preferred_element_type=jnp.float32)
    h = swiglu(a).astype(jnp.bfloat16)
    stages = {
        "plan": (smap(make_plan, 1), (ids,)),
        "dispatch": (smap(lambda x, pl: dispatch(x, jnp.arange(T * k, dtype=jnp.int32) // k, pl, cap, info), 2),
                     (x, pl)),
        "gemm1": (lambda xr, w, g: grouped_matmul(xr, w, g, preferred_element_type=jnp.float32),
                  (x_recv, w1, pl.expert_rows)),
        "swiglu": (lambda a: swiglu(a).astype(jnp.bfloat16), (a,)),
        "expert_combine": (smap(lambda h, w, g, pl: expert_combine(h, w, g, pl, info, want_slots=False)[0], 4),
                           (h, w2, gates, pl)),
        "layer": (lambda *a: jmo.moe_experts(*a, mesh=mesh)[0], (x, ids, gates, w1, w2)),
    }
    times = {s: common.time_fn(jax.jit(f), [a]) * 1e3 for s, (f, a) in stages.items()}
    for s, ms in times.items():
      table.add(shape=name, stage=s, ms=f"{ms:.3f}", share_of_layer=f"{ms / times['layer']:.2f}")
  table.finish(args.out)


if __name__ == "__main__":
  main()
