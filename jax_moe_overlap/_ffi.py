"""Loads the native extension and registers its XLA FFI targets with JAX (once per process)."""

from __future__ import annotations

import functools

import jax

from jax_moe_overlap import _jmo

DISPATCH = "jmo_dispatch"
EXPERT_COMBINE = "jmo_expert_combine"
DISPATCH_GEMM = "jmo_dispatch_gemm"  # CUDA (Hopper) only
BAND_ROWS: int = _jmo.band_rows


@functools.cache
def register() -> None:
  """Registers the CPU handlers, and the CUDA handlers when the extension was built with nvcc."""
  for name, capsule in _jmo.cpu_registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  if _jmo.with_cuda:
    for name, capsule in _jmo.cuda_registrations().items():
      jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


def with_cuda() -> bool:
  """True when the CUDA kernels were compiled into the extension."""
  return bool(_jmo.with_cuda)
