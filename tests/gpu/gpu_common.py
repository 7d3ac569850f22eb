"""Shared helpers of the GPU tests: skip cleanly where there is no GPU (CI), find the loopback harness."""

from __future__ import annotations

import glob
import os
import shutil

import jax
import numpy as np
import pytest


def gpu_devices():
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []


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


def loopback_binary() -> str | None:
  """The jmo_loopback program: $JMO_LOOPBACK_BIN, else the first one under build*/ of the checkout."""
  env = os.environ.get("JMO_LOOPBACK_BIN")
  if env:
    return env
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  found = sorted(glob.glob(os.path.join(root, "build*", "**", "jmo_loopback"), recursive=True))
  return found[0] if found else None


def compute_sanitizer() -> str | None:
  return shutil.which("compute-sanitizer") or next(
      (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)


def rel_err(a, b) -> float:
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
