"""engines.py, the Python side of "which GEMM engine runs here and takes these operands"."""

import jax
import pytest

from jax_moe_overlap import engines


def test_wgmma_runs_on_hopper_only():
  assert engines.wgmma_runs_on((9, 0))
  assert not any(engines.wgmma_runs_on(cc) for cc in ((8, 0), (8, 9), (10, 0), (12, 0), None))


@pytest.mark.parametrize("bf16,K,N,want", [(True, 64, 64, True), (True, 2048, 7168, True), (False, 64, 64, False),
                                           (True, 96, 64, False), (True, 64, 32, False)])
def test_wgmma_operands(bf16, K, N, want):
  assert engines.wgmma_operands(bf16, K, N) == want


@pytest.mark.parametrize("bf16,K,F,want", [(True, 256, 192, True), (True, 64, 32, True), (True, 256, 48, False),
                                           (True, 200, 192, False), (False, 256, 192, False)])
def test_swiglu_epilogue_operands(bf16, K, F, want):
  assert engines.swiglu_epilogue_operands(bf16, K, F) == want


def test_dispatch_gemm_operands():
  # CPU: any operands the layer takes; CUDA: the wgmma engine's, and with the SwiGLU its epilogue's (N = 2F).
  assert engines.dispatch_gemm_operands("cpu", False, 30, 7, swiglu=False)
  assert engines.dispatch_gemm_operands("cpu", True, 30, 7, swiglu=True)
  assert engines.dispatch_gemm_operands("gpu", True, 128, 256, swiglu=True)
  assert engines.dispatch_gemm_operands("gpu", True, 128, 64, swiglu=False)
  assert engines.dispatch_gemm_operands("gpu", True, 128, 64, swiglu=True)         # F = 32, the epilogue's least
  assert not engines.dispatch_gemm_operands("gpu", True, 128, 129, swiglu=True)    # 2F must be even
  assert not engines.dispatch_gemm_operands("gpu", True, 128, 96, swiglu=True)     # 2F a multiple of 64
  assert not engines.dispatch_gemm_operands("gpu", False, 128, 256, swiglu=False)  # bfloat16 only
  assert not engines.dispatch_gemm_operands("gpu", True, 96, 256, swiglu=False)


def test_no_fused_swiglu_without_a_gpu():
  assert not any(d.platform == "gpu" for d in jax.local_devices())
  assert not engines.first_gpu_runs_wgmma()
  assert not engines.swiglu_fused(True, 256, 192)  # operands the epilogue takes, but no Hopper GPU here
