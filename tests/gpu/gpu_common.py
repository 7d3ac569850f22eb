"""Shared helpers of the GPU tests: skip cleanly where there is no GPU (CI), run the loopback harness, run the
processes of a multi-process job."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import pytest


def gpu_devices():
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []


def is_hopper() -> bool:
  """Whether the first GPU is a Hopper (sm_90) one: where the wgmma engine and dispatch_gemm run."""
  from jax_moe_overlap import engines  # pylint: disable=g-import-not-at-top
  return engines.first_gpu_runs_wgmma()


def gemm_engine(dtype, K: int, N: int, **operands) -> str | None:
  """The GEMM engine the CUDA ops select on the first GPU for these operands (SelectGemmEngine, through _jmo;
  operands: transpose_rhs, swiglu, outer, M as _jmo.select_gemm_engine takes them)."""
  from jax_moe_overlap import _jmo, workspace_cuda  # pylint: disable=g-import-not-at-top
  cc = workspace_cuda.device_info(gpu_devices()[0].local_hardware_id).compute_capability
  return _jmo.select_gemm_engine(tuple(cc), np.dtype(dtype).name, K, N, **operands)


def rank_counts() -> list[int]:
  """The expert-parallel sizes R the multi-rank GPU tests run at: every visible GPU, and 1 as well when there are
  several ([1] without a GPU, where the tests are collected and skip)."""
  return sorted({1, max(1, len(gpu_devices()))})


def gpu_mesh(R: int) -> jax.sharding.Mesh:
  """A 1-D mesh, axis "expert", over the first R GPUs: real expert parallelism (peer writes between GPUs) at R > 1."""
  return jax.sharding.Mesh(np.array(gpu_devices()[:R]), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))


def skip_reason() -> str | None:
  """Why the GPU tests cannot run here, or None."""
  from jax_moe_overlap import _jmo  # pylint: disable=g-import-not-at-top
  if not gpu_devices():
    return ("no GPU visible to jax (CI has none; on a GPU machine run with JAX_PLATFORMS=cuda,cpu, since "
            "tests/conftest.py defaults JAX_PLATFORMS to cpu)")
  if not _jmo.with_cuda:
    return "the extension was built without the CUDA kernels (nvcc was not found when it was built)"
  return None


requires_gpu = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))


HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def run_loopback(args, timeout: float, wrapper=()) -> subprocess.CompletedProcess:
  """Runs the loopback harness (python -m tools.loopback.run, from the repository root) with `args`, under
  `wrapper` (e.g. compute-sanitizer and its options) if given; prints the output's tail. Fails the test if the
  harness's runner is not built (tools/CMakeLists.txt; tests/gpu/build_gpu.sh builds it)."""
  if not glob.glob(os.path.join(REPO, "tools", "loopback", "_jmo_loopback*.so")):
    pytest.fail("the loopback runner is not built: cmake -S tools -B build/tools && cmake --build build/tools, then "
                "copy build/tools/_jmo_loopback*.so into tools/loopback/ (tests/gpu/build_gpu.sh does both)")
  cmd = [str(w) for w in wrapper] + [sys.executable, "-m", "tools.loopback.run"] + [str(a) for a in args]
  env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="32")
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO, check=False)
  print(proc.stdout[-20000:])
  print(proc.stderr[-5000:])
  return proc


def compute_sanitizer() -> str | None:
  return shutil.which("compute-sanitizer") or next(
      (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)


def rel_err(a, b) -> float:
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_processes(nproc: int, placement: str, case: str, limit_s: float = 300, script: str = "multiprocess_gpu_main.py",
                  **env_extra):
  """Runs the processes of one job (tests/gpu/<script>, argv: process_id num_processes port placement case);
  returns [(exit status, output)] by process. The children get this process's environment without its XLA_FLAGS,
  then env_extra (which may set them). A child still running at limit_s is killed (SIGKILL). Outputs go to files,
  not pipes: a child blocked on a full pipe would stall its peers."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env.update(env_extra)
  # The child imports helpers of tests/gpu and tests/: after whatever PYTHONPATH has (the installed package first).
  env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), HERE, os.path.dirname(HERE)) if p)
  port = str(_free_port())
  logs = [tempfile.TemporaryFile(mode="w+") for _ in range(nproc)]
  procs = [subprocess.Popen([sys.executable, os.path.join(HERE, script), str(i), str(nproc), port, placement, case],
                            cwd=HERE, env=env, stdout=logs[i], stderr=subprocess.STDOUT)
           for i in range(nproc)]
  deadline = time.monotonic() + limit_s
  try:
    for p in procs:
      try:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=30)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  outs = []
  for i, (p, log) in enumerate(zip(procs, logs)):
    log.seek(0)
    outs.append((p.returncode, log.read()))
    log.close()
    print(f"--- process {i} (exit status {p.returncode}):\n{outs[-1][1][-6000:]}")
  return outs
