"""Which GEMM engine runs on a device and takes given operands, as far as the host must know it beforehand.

The CUDA ops choose the engine of each call in C++ (``SelectGemmEngine``, ffi/cuda/gemm/engine.cc; docs/design.md,
"GEMM engines"); the host needs the same answer where it shapes a call: whether ``grouped_matmul_swiglu`` may leave
out the preactivation, and whether the layer runs the dispatch and GEMM1 as one ``dispatch_gemm`` call. Every
function here asks the extension (``_jmo.select_gemm_engine``, ``gemm_engine_device_refusal``,
``gemm_engine_operand_refusal``) instead of restating a rule, so a new architecture or dtype changes the C++ rules
only. A build without the CUDA kernels (``_jmo.with_cuda`` false) has no GPU engine: every question about one
answers False there (and ``dispatch_gemm_operands`` still answers for the CPU handler, which takes any operands).

  wgmma_runs_on(cc)                   the wgmma engine (and dispatch_gemm's CUDA kernel) runs on this GPU
  wgmma_operands(bf16, K, N)          it takes a GEMM [M, K] x [K, N]
  swiglu_epilogue_operands(bf16, K, F)  its SwiGLU epilogue takes GEMM1 [M, K] x [K, 2F]
  swiglu_fused(bf16, K, F)            grouped_matmul_swiglu applies the SwiGLU in its epilogue on this process's GPUs
  swiglu_grad_fused(bf16, K, F, transpose_rhs)  grouped_matmul_swiglu_grad runs (its SwiGLU-gradient epilogue) there
  dispatch_gemm_operands(platform, bf16, K, N, swiglu)  a dispatch_gemm call takes these operands on this platform
  fp8_gemm_device_refusal(cc)         why the FP8 grouped GEMM (grouped_matmul_fp8) does not run on this GPU, or None
  fp8_dispatch_gemm_operands(platform, D, N)  dispatch_gemm_fp8 takes packed rows of D channels and w of N columns
"""

from __future__ import annotations

import functools

import jax

from jax_moe_overlap import _jmo
from jax_moe_overlap import workspace_cuda

# The engine names of the extension (GemmEngineName, ffi/cuda/gemm/engine.cc).
WGMMA = "wgmma bf16"


def _dtype(bf16: bool) -> str:
  return "bfloat16" if bf16 else "float32"


def wgmma_runs_on(compute_capability: tuple[int, int] | None) -> bool:
  """Whether the wgmma engine runs on a GPU of this compute capability (None: not a CUDA device)."""
  return (bool(_jmo.with_cuda) and compute_capability is not None and
          _jmo.gemm_engine_device_refusal(WGMMA, tuple(compute_capability)) is None)


def wgmma_operands(bf16: bool, K: int, N: int) -> bool:
  """Whether the wgmma engine takes a GEMM of contraction K and N output columns (w in either layout)."""
  return bool(_jmo.with_cuda) and _jmo.gemm_engine_operand_refusal(WGMMA, _dtype(bf16), K, N) is None


def swiglu_epilogue_operands(bf16: bool, K: int, F: int) -> bool:
  """Whether the wgmma engine's SwiGLU epilogue takes GEMM1's operands, lhs [M, K] and w [K, 2F]."""
  return (bool(_jmo.with_cuda) and
          _jmo.gemm_engine_operand_refusal(WGMMA, _dtype(bf16), K, 2 * F, swiglu=True) is None)


def _first_gpu_compute_capability() -> tuple[int, int] | None:
  """JAX's first local GPU's compute capability; None where this process has no GPU or no CUDA build."""
  gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
  if not (_jmo.with_cuda and gpus):
    return None
  return tuple(workspace_cuda.device_info(int(gpus[0].local_hardware_id)).compute_capability)


def first_gpu_runs_wgmma() -> bool:
  """Whether JAX's first local GPU runs the wgmma engine (False where this process has no GPU or no CUDA build)."""
  return wgmma_runs_on(_first_gpu_compute_capability())


@functools.cache
def swiglu_fused(bf16: bool, K: int, F: int) -> bool:
  """Whether ``grouped_matmul_swiglu`` applies the SwiGLU in its GEMM's epilogue on this process's GPUs (an engine
  of the first GPU has the epilogue for these operands, as the CUDA handler selects): only then may it leave out the
  preactivation. False where JAX's devices are not GPUs."""
  cc = _first_gpu_compute_capability()
  return cc is not None and _jmo.select_gemm_engine(cc, _dtype(bf16), K, 2 * F, swiglu=True) is not None


@functools.cache
def swiglu_grad_fused(bf16: bool, K: int, F: int, transpose_rhs: bool) -> bool:
  """Whether ``grouped_matmul_swiglu_grad`` runs on this process's GPUs for a backward GEMM of contraction K and F
  output columns (w stored [F, K] with transpose_rhs): an engine of the first GPU has the SwiGLU-gradient epilogue
  for these operands, as the CUDA handler selects. Where it does not, the layer runs ``grouped_matmul`` and the
  gradient apart. False where JAX's devices are not GPUs."""
  cc = _first_gpu_compute_capability()
  return cc is not None and _jmo.select_gemm_engine(cc, _dtype(bf16), K, F, transpose_rhs=transpose_rhs,
                                                    swiglu_grad=True) is not None


def dispatch_gemm_operands(platform: str, bf16: bool, K: int, N: int, swiglu: bool) -> bool:
  """Whether a ``dispatch_gemm`` call takes its operands, rows [S, K] and w giving N output columns: on CPU any the
  layer takes (the handler computes with the bare grouped GEMMs' loops); on CUDA the wgmma engine's, and with
  ``swiglu`` (N = 2F) what its SwiGLU epilogue takes."""
  if platform == "cpu":
    return True
  return bool(_jmo.with_cuda) and _jmo.gemm_engine_operand_refusal(WGMMA, _dtype(bf16), K, N, swiglu=swiglu) is None


def fp8_gemm_device_refusal(compute_capability: tuple[int, int]) -> str | None:
  """Why ``grouped_matmul_fp8`` does not run on a GPU of this compute capability (None: it runs): the extension's
  rule (Fp8GroupedGemmDeviceRefusal, ffi/cuda/gemm/engine.cc), or that this build has no CUDA kernels."""
  if not _jmo.with_cuda:
    return "this build of jax_moe_overlap has no CUDA kernels (built without nvcc, or JMO_CUDA=off)"
  return _jmo.fp8_gemm_device_refusal(tuple(compute_capability))


def fp8_dispatch_gemm_operands(platform: str, d_model: int, N: int) -> bool:
  """Whether a ``dispatch_gemm_fp8`` call takes packed e4m3 rows of d_model channels and w of N columns on this
  platform: on CPU any the FP8 layer takes (whole 1 x 128 tiles); on CUDA the kernel's rule
  (Fp8DispatchGemmOperandRefusal, ffi/cuda/gemm/engine.cc: d_model a multiple of 512), where the FP8 grouped GEMM
  runs at all (its device rule the call checks)."""
  if platform == "cpu":
    return True
  return bool(_jmo.with_cuda) and _jmo.fp8_dispatch_gemm_operand_refusal(d_model, N) is None
