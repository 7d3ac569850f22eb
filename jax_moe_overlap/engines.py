"""Which GEMM engine runs on a device and takes given operands: every place the Python side needs that rule asks here.

The CUDA handlers choose the engine of each call themselves (docs/design.md, "GEMM engines"); the host needs the same
answer beforehand where it shapes a call: whether ``grouped_matmul_swiglu`` may leave out the preactivation, and
whether the layer runs the dispatch and GEMM1 as one ``dispatch_gemm`` call. The rules here state what the handlers
check (SwiGluFused, WgmmaProducerApplies), so a new architecture or dtype changes them in this file only.

  wgmma_runs_on(cc)                   the wgmma engine (and dispatch_gemm's CUDA kernel) runs on this GPU: Hopper
  wgmma_operands(bf16, K, N)          it takes a GEMM [M, K] x [K, N]: bfloat16, K and N multiples of 64
  swiglu_epilogue_operands(bf16, K, F)  its SwiGLU epilogue takes GEMM1 [M, K] x [K, 2F]: also F a multiple of 32
  swiglu_fused(bf16, K, F)            grouped_matmul_swiglu applies the SwiGLU in its epilogue on this process's GPUs
  dispatch_gemm_operands(platform, bf16, K, N, swiglu)  a dispatch_gemm call takes these operands on this platform
"""

from __future__ import annotations

import functools

import jax

from jax_moe_overlap import _jmo
from jax_moe_overlap import workspace_cuda


def wgmma_runs_on(compute_capability: tuple[int, int] | None) -> bool:
  """Whether the wgmma engine runs on a GPU of this compute capability (Hopper, sm_90; None: not a CUDA device)."""
  return compute_capability is not None and compute_capability[0] == 9


def wgmma_operands(bf16: bool, K: int, N: int) -> bool:
  """Whether the wgmma engine takes a GEMM of contraction K and N output columns: bfloat16, both multiples of 64."""
  return bool(bf16) and K % 64 == 0 and N % 64 == 0


def swiglu_epilogue_operands(bf16: bool, K: int, F: int) -> bool:
  """Whether the wgmma engine's SwiGLU epilogue takes GEMM1's operands, lhs [M, K] and w [K, 2F]: the engine's
  (2F a multiple of 64) and whole 16-column stores of h (F a multiple of 32)."""
  return wgmma_operands(bf16, K, 2 * F) and F % 32 == 0


def first_gpu_runs_wgmma() -> bool:
  """Whether JAX's first local GPU runs the wgmma engine (False where this process has no GPU or no CUDA build)."""
  gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
  if not (_jmo.with_cuda and gpus):
    return False
  return wgmma_runs_on(workspace_cuda.device_info(int(gpus[0].local_hardware_id)).compute_capability)


@functools.cache
def swiglu_fused(bf16: bool, K: int, F: int) -> bool:
  """Whether ``grouped_matmul_swiglu`` applies the SwiGLU in its GEMM's epilogue on this process's GPUs (the CUDA
  handler's SwiGluFused): only then may it leave out the preactivation. False where JAX's devices are not GPUs."""
  return swiglu_epilogue_operands(bf16, K, F) and first_gpu_runs_wgmma()


def dispatch_gemm_operands(platform: str, bf16: bool, K: int, N: int, swiglu: bool) -> bool:
  """Whether a ``dispatch_gemm`` call takes its operands, rows [S, K] and w giving N output columns: on CPU any the
  layer takes (the handler computes with the bare grouped GEMMs' loops); on CUDA the wgmma engine's, and with
  ``swiglu`` (N = 2F) what its SwiGLU epilogue takes."""
  if platform == "cpu":
    return True
  if swiglu:
    return N % 2 == 0 and swiglu_epilogue_operands(bf16, K, N // 2)
  return wgmma_operands(bf16, K, N)
