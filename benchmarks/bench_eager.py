"""Eager calls of ``moe_experts`` (outside ``jit``): the first call (which compiles) and the median of later ones, for
the overlap and xla impls, each checked against the float32 reference first.

  python -m benchmarks.bench_eager                                   # every visible GPU, T=4096 D=1024 F=512 E=8
  python -m benchmarks.bench_eager --devices 4 --tokens 64 --d-model 16 --d-ff 32   # on 4 virtual CPU devices
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe_overlap as jmo
from benchmarks import common

MAX_ERR = 2e-2  # bf16 outputs against the float32 reference


def main(argv=None):
  common.virtual_cpu_devices(sys.argv if argv is None else argv)  # a CPU run: --devices N, else 4
  ap = argparse.ArgumentParser()
  ap.add_argument("--devices", type=int, default=None, help="mesh size (default: all devices)")
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--d-model", type=int, default=1024)
  ap.add_argument("--d-ff", type=int, default=512)
  ap.add_argument("--experts", type=int, default=8)
  ap.add_argument("--top-k", type=int, default=2)
  ap.add_argument("--calls", type=int, default=6, help="eager calls per impl (the first compiles)")
  ap.add_argument("--impls", default="overlap,xla")
  ap.add_argument("--out", default=None, help="JSON-lines file for the rows")
  args = ap.parse_args(argv)
  mesh = common.expert_mesh(args.devices, "expert")
  T, D, F, E, k = args.tokens, args.d_model, args.d_ff, args.experts, args.top_k
  x, ids, gates, w1, w2 = common.layer_operands(T, D, F, E, k)
  ref, _ = jmo.moe_experts(x.astype(jnp.float32), ids, gates, w1.astype(jnp.float32), w2.astype(jnp.float32),
                           mesh=mesh, impl="reference")
  meta = dict(common.environment(), command=common.command_line(), tokens=T, d_model=D, d_ff=F, experts=E, top_k=k,
              devices=mesh.devices.size)
  print(json.dumps(meta))
  rows = []
  for impl in args.impls.split(","):
    times = []
    for _ in range(args.calls):
      t0 = time.perf_counter()
      y, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl=impl)
      y.block_until_ready()
      times.append(time.perf_counter() - t0)
    err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
    row = dict(meta, impl=impl, first_ms=times[0] * 1e3, later_median_ms=float(np.median(times[1:])) * 1e3,
               max_rel_err=err, correct=err < MAX_ERR)
    rows.append(row)
    print(f"eager {impl}: first {row['first_ms']:.1f} ms, later median {row['later_median_ms']:.2f} ms, "
          f"max rel err vs float32 {err:.2e}{'' if row['correct'] else ' (WRONG)'}")
  if args.out:
    with open(args.out, "a") as f:
      for row in rows:
        f.write(json.dumps(row) + "\n")
  return rows


if __name__ == "__main__":
  main()
