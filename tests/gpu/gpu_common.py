"""Shared helpers of the GPU tests: skip cleanly where there is no GPU (CI), run the loopback harness."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

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


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
