"""Runs the loopback harness (tools/loopback/run.py) for the resource-manager benchmarks and parses its
`RESULT {json}` lines. The harness drives the CUDA kernels directly (R ranks sharing one GPU); it needs its runner
built (tools/CMakeLists.txt; tests/gpu/build_gpu.sh builds it) and computes its plans with JAX on the CPU.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command() -> list[str]:
  """The harness as a command, run from the repository root."""
  return [sys.executable, "-m", "tools.loopback.run"]


class LoopbackError(RuntimeError):
  pass


def run(args: list[str], timeout: float = 300, log=None) -> dict:
  """Runs the harness with `args`; returns {"results": [parsed RESULT dicts], "stdout": ..., "seconds": ...}.

  Raises LoopbackError (with the output's tail) if the harness fails: a FAIL line means a correctness check did not
  hold, and its numbers must not be used.
  """
  cmd = command() + [str(a) for a in args]
  env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="32")
  t0 = time.time()
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False)
  secs = time.time() - t0
  if log is not None:
    log.write(f"$ {shlex.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    log.flush()
  if proc.returncode != 0:
    raise LoopbackError(f"{shlex.join(cmd)} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
  results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
  return {"results": results, "stdout": proc.stdout, "seconds": secs, "command": shlex.join(cmd)}


def device_info(k_dim: int = 200, n_dim: int = 136) -> dict:
  """The GPU, and the producer engine + tile that bf16 calls of K = k_dim, N = n_dim take on it."""
  args = ["--device-info", "--k-dim", str(k_dim), "--n-dim", str(n_dim)]
  return [r for r in run(args)["results"] if r["kind"] == "device"][0]


def params_arg(params) -> str:
  """--model value from a ModelParams (jax_moe_overlap.resource) or an 11-list (10: no gather rate, 9: nor a pusher
  rate)."""
  vals = params.as_list() if hasattr(params, "as_list") else list(params)
  return ",".join(repr(float(v)) for v in vals)


def tuning_args(tuning) -> list[str]:
  """The harness flags of a consumer tuning (jax_moe_overlap.config.ConsumerTuning): how its consumer pushes."""
  args = [] if tuning.bulk_copy else ["--plain-copy"]
  return args + ["--push-slots", str(tuning.slots), "--push-read-lag", str(tuning.read_lag),
                 "--push-issuers", str(tuning.issuers)]


def median(xs):
  xs = sorted(xs)
  return xs[len(xs) // 2] if xs else float("nan")
