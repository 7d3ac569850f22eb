"""What the recv buffer's padding costs one rank's expert compute.

Dropless, a rank's recv buffer has a static row count for the worst case (every slot of the group routed to its
experts: ``plan.recv_capacity``), while the rows that arrive are about T * k under balanced routing. Every step that
runs over the whole buffer pays for the padding: the grouped GEMMs zero the rows past their groups, and XLA's SwiGLU
runs on every row. This times, on one GPU, each step of ``expert_mlp`` (GEMM1, SwiGLU + cast, GEMM2) and the whole
forward at the recv capacities of EP = 1, 2 and 8 for the same kept rows (the seed shape per rank: 8192 tokens,
top-2, D 2048, F 2048, 4 local experts, 16,384 kept rows); and GEMM1 with its SwiGLU as one call
(``grouped_matmul_swiglu``, fused on Hopper), without and with the preactivation the backward pass keeps.

  python -m benchmarks.bench_recv_padding [--out results.jsonl]
"""
import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from jax_moe_overlap import expert_gemms, grouped_gemm, plan

D, F, E_LOCAL, TOKENS, TOP_K = 2048, 2048, 4, 8192, 2


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="")
  args = ap.parse_args(argv)
  kept = TOKENS * TOP_K
  rows = []
  for ranks in (1, 2, 8):
    cap = plan.recv_capacity(TOKENS, ranks, TOP_K, E_LOCAL, plan.expert_capacity(TOKENS, ranks, TOP_K,
                                                                                E_LOCAL * ranks, None))
    sets = []
    for s in range(3):
      k = jax.random.split(jax.random.key(s), 3)
      x = jax.random.normal(k[0], (cap, D), jnp.bfloat16)
      w1 = (jax.random.normal(k[1], (E_LOCAL, D, 2 * F), jnp.float32) / np.sqrt(D)).astype(jnp.bfloat16)
      w2 = (jax.random.normal(k[2], (E_LOCAL, F, D), jnp.float32) / np.sqrt(F)).astype(jnp.bfloat16)
      sets.append((x, w1, w2, jnp.full((E_LOCAL,), kept // E_LOCAL, jnp.int32)))
    gemm1 = jax.jit(lambda x, w1, w2, gs: grouped_gemm.grouped_matmul(x, w1, gs, preferred_element_type=jnp.float32))
    a_sets = [(gemm1(*s),) for s in sets]
    act = jax.jit(lambda a: expert_gemms.swiglu(a).astype(jnp.bfloat16))
    h_sets = [(act(*a), s[2], s[3]) for a, s in zip(a_sets, sets)]
    gemm2 = jax.jit(lambda h, w2, gs: grouped_gemm.grouped_matmul(h, w2, gs))
    mlp = jax.jit(expert_gemms.expert_mlp)
    fused = {keep: jax.jit(lambda x, w1, w2, gs, keep=keep: grouped_gemm.grouped_matmul_swiglu(
        x, w1, gs, keep_preactivation=keep)) for keep in (False, True)}
    r = {"question": "recv padding cost", "ranks": ranks, "recv_rows": cap, "kept_rows": kept,
         "gemm1_ms": common.time_fn(gemm1, sets) * 1e3, "swiglu_ms": common.time_fn(act, a_sets) * 1e3,
         "gemm2_ms": common.time_fn(gemm2, h_sets) * 1e3, "expert_mlp_ms": common.time_fn(mlp, sets) * 1e3,
         "gemm1_swiglu_ms": common.time_fn(fused[False], sets) * 1e3,
         "gemm1_swiglu_keep_a_ms": common.time_fn(fused[True], sets) * 1e3,
         **common.environment(), "command": common.command_line()}
    rows.append(r)
  print("| EP | recv rows | kept rows | GEMM1 ms | SwiGLU + cast ms | GEMM2 ms | GEMM1 + SwiGLU in one call ms | "
        "the same keeping a ms | expert_mlp fwd ms |\n|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['ranks']} | {r['recv_rows']} | {r['kept_rows']} | {r['gemm1_ms']:.3f} | {r['swiglu_ms']:.3f} | "
          f"{r['gemm2_ms']:.3f} | {r['gemm1_swiglu_ms']:.3f} | {r['gemm1_swiglu_keep_a_ms']:.3f} | "
          f"{r['expert_mlp_ms']:.3f} |")
  if args.out:
    with open(args.out, "a") as f:
      for r in rows:
        f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
  main()
