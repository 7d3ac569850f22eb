"""The layer's forward + backward with its expert axis over the processes of a jax.distributed job on localhost
(CPU, each process with its own virtual devices), timed per call, against the same global mesh in one process.

  python -m benchmarks.bench_multiprocess                      # 2 x 2 and 4 x 1 processes x devices, and 1 x 4
  python -m benchmarks.bench_multiprocess --layouts 2x2 --calls 30

Each job checks its output against the float32 reference before timing. A child of a job that is not done within
--limit-s is killed and the layout reported as failed. Prints one table; --out writes JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

from benchmarks import common


def _child(pid: int, nproc: int, port: int, local: int, calls: int, tokens_per_rank: int) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", local)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if nproc > 1:
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=nproc, process_id=pid,
                               initialization_timeout=120)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import jax_moe_overlap as jmo  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap.reference import moe_experts_reference  # pylint: disable=g-import-not-at-top

  E, D, F, k = 8, 64, 128, 2
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("expert",))
  T = tokens_per_rank * mesh.size
  x, ids, gates, w1, w2 = (np.asarray(a) for a in common.layer_operands(T, D, F, E, k))
  put = lambda a, spec: jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])
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
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  ref = np.asarray(moe_experts_reference(f32(x), jnp.asarray(ids), f32(gates), f32(w1), f32(w2), T, mesh.size)[0])
  err = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
  times = []
  for _ in range(calls):
    t0 = time.perf_counter()
    jax.block_until_ready(step(*args))  # one call at a time: gloo collectives of many programs in flight can stall
    times.append(time.perf_counter() - t0)
  if pid == 0:
    print("RESULT " + json.dumps(dict(rel_err=err, median_ms=float(np.median(times)) * 1e3, first_ms=first_ms)),
          flush=True)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_job(nproc: int, local: int, calls: int, tokens_per_rank: int, limit_s: float) -> dict:
  """Starts the job's processes, waits for them (at most limit_s, then kills them) and returns process 0's RESULT,
  or {"error": ...}."""
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.bench_multiprocess", "--child",
                             *map(str, (i, nproc, port, local, calls, tokens_per_rank))],
                            stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            text=True) for i in range(nproc)]
  deadline = time.monotonic() + limit_s
  out = ""
  try:
    out, _ = procs[0].communicate(timeout=max(1.0, deadline - time.monotonic()))
    for p in procs[1:]:
      p.wait(timeout=max(1.0, deadline - time.monotonic()))
  except subprocess.TimeoutExpired:
    return {"error": f"not done within {limit_s:.0f} s"}
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait(timeout=30)
  lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
  if procs[0].returncode != 0 or not lines:
    return {"error": f"process 0 exited with status {procs[0].returncode}"}
  return json.loads(lines[-1][len("RESULT "):])


def main(argv=None):
  if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
    _child(*map(int, sys.argv[2:8]))
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
