"""Loads the native extension and registers its XLA FFI targets with JAX (once per process)."""

from __future__ import annotations

import functools

import jax

from jax_moe_overlap import _jmo

DISPATCH = "jmo_dispatch"
EXPERT_COMBINE = "jmo_expert_combine"
DISPATCH_GEMM = "jmo_dispatch_gemm"  # CPU, and CUDA on Hopper
EXCHANGE_COUNTS = "jmo_exchange_counts"
GATHER_RS = "jmo_gather_rs"
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


def build_info() -> dict:
  """What the installed extension was compiled with.

  Keys: ``cuda`` (bool: the CUDA kernels are compiled in), ``cuda_version`` (the CUDA toolkit's, "" without CUDA),
  ``cuda_archs`` (the GPU targets, e.g. ``["sm_80", "sm_90a", "compute_80"]``:
  machine code ``sm_*``, PTX ``compute_*``; empty without CUDA), ``cuda_compiler``, ``cxx_compiler``, ``build_type``,
  ``jax_version`` (the jax whose FFI headers the build used), ``xla_ffi_api`` (their XLA FFI API version), and
  ``extension`` (the path of the loaded extension module).
  """
  info: dict = dict(_jmo.build_info())
  info["cuda"] = info["cuda"] == "1"
  info["cuda_archs"] = info["cuda_archs"].split()
  info["extension"] = _jmo.__file__
  return info
