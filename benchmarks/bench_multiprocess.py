"""The layer's forward + backward with its expert axis over the processes of a jax.distributed job on localhost
(CPU, each process with its own virtual devices), timed per call, against the same global mesh in one process.

  python -m benchmarks.bench_multiprocess                      # 2 x 2 and 4 x 1 processes x devices, and 1 x 4
  python -m benchmarks.bench_multiprocess --layouts 2x2 --calls 30

Each job checks its output against the float32 reference before timing. A job that is not done within --limit-s, or
one of whose processes fails, is killed whole (benchmarks.launch_job) and its layout reported as failed. Prints one
table; --out writes JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from benchmarks import common
from benchmarks import launch_job


def _child(argv: list[str]) -> None:
  """One process of a job started by launch_job (its --num-processes, --process-id and --coordinator appended)."""
  ap = argparse.ArgumentParser()
  for flag in ("--local", "--calls", "--tokens-per-rank", "--num-processes", "--process-id"):
    ap.add_argument(flag, type=int, required=True)
  ap.add_argument("--coordinator", required=True)
  a = ap.parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", a.local)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if a.num_processes > 1:
    jax.distributed.initialize(coordinator_address=a.coordinator, num_processes=a.num_processes,
                               process_id=a.process_id, initialization_timeout=120)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import jax_moe_overlap as jmo  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap.reference import moe_experts_reference  # pylint: disable=g-import-not-at-top

  E, D, F, k = 8, 64, 128, 2
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("expert",))
  T = a.tokens_per_rank * mesh.size
  x, ids, gates, w1, w2 = (np.asarray(v) for v in common.layer_operands(T, D, F, E, k))
  put = lambda v, spec: jax.make_array_from_callback(v.shape, NamedSharding(mesh, spec), lambda i: v[i])
  tok, wsp = P("expert"), P("expert")
  args = (put(x, tok), put(gates, tok), put(w1, wsp), put(w2, wsp), put(ids, tok))

  def loss(x, g, w1, w2, ids):
    y, _ = jmo.moe_experts(x, ids, g, w1, w2, mesh=mesh)  # impl="overlap", dropless
    return jnp.sum(y.astype(jnp.float32) ** 2), y

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
  t0 = time.perf_counter()
  (_, y), _ = jax.block_until_ready(step(*args))
  first_ms = (time.perf_counter() - t0) * 1e3
  y = np.asarray(multihost_utils.process_allgather(y, tiled=True), np.float32)
  f32 = lambda v: jnp.asarray(v, jnp.float32)
  ref = np.asarray(moe_experts_reference(f32(x), jnp.asarray(ids), f32(gates), f32(w1), f32(w2), T, mesh.size)[0])
  err = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
  times = []
  for _ in range(a.calls):
    t0 = time.perf_counter()
    jax.block_until_ready(step(*args))  # one call at a time: gloo collectives of many programs in flight can stall
    times.append(time.perf_counter() - t0)
  if a.process_id == 0:
    print("RESULT " + json.dumps(dict(rel_err=err, median_ms=float(np.median(times)) * 1e3, first_ms=first_ms)),
          flush=True)


def run_job(nproc: int, local: int, calls: int, tokens_per_rank: int, limit_s: float) -> dict:
  """Runs the job through launch_job (every process killed at limit_s, or when one fails) and returns process 0's
  RESULT, or {"error": ...}."""
  command = [sys.executable, "-m", "benchmarks.bench_multiprocess", "--child", "--local", str(local), "--calls",
             str(calls), "--tokens-per-rank", str(tokens_per_rank)]
  with tempfile.TemporaryDirectory() as logs:
    status = launch_job.run(command, nproc, limit_s, logs, local_ids=False, report=False)
    with open(os.path.join(logs, "process-0.log")) as f:
      lines = [l for l in f.read().splitlines() if l.startswith("RESULT ")]
  if status == 124:
    return {"error": f"not done within {limit_s:.0f} s"}
  if status != 0 or not lines:
    return {"error": f"a process exited with status {status}"}
  return json.loads(lines[-1][len("RESULT "):])


def main(argv=None):
  if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
    _child(sys.argv[2:])
    return
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--layouts", default="1x4,2x2,4x1", help="comma list of PROCESSESxDEVICES")
  ap.add_argument("--calls", type=int, default=20)
  ap.add_argument("--tokens-per-rank", type=int, default=64)
  ap.add_argument("--limit-s", type=float, default=240)
  ap.add_argument("--out", default=None)
  a = ap.parse_args(argv)
  meta = dict(common.environment(), command=common.command_line(), tokens_per_rank=a.tokens_per_rank, calls=a.calls)
  rows = []
  print("| processes x devices | first call (compiles) ms | later calls, median ms | rel. error vs float32 |\n|---|---|---|---|")
  for layout in a.layouts.split(","):
    nproc, local = (int(v) for v in layout.split("x"))
    r = run_job(nproc, local, a.calls, a.tokens_per_rank, a.limit_s)
    rows.append(dict(meta, layout=layout, **r))
    if "error" in r:
      print(f"| {layout} | failed: {r['error']} | | |")
    else:
      print(f"| {layout} | {r['first_ms']:.0f} | {r['median_ms']:.2f} | {r['rel_err']:.1e} |")
  if a.out:
    with open(a.out, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
  main()
