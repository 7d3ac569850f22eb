"""engines.py, the Python side of "which GEMM engine runs here and takes these operands", and the fusion decision of
the expert block that reads it (on a stand-in CUDA call site: the CUDA branches run without a GPU)."""

import types

import jax
import jax.numpy as jnp
import pytest

from jax_moe_overlap import engines
from jax_moe_overlap import expert_block
from jax_moe_overlap.call_site import RankInfo
from jax_moe_overlap.config import CallConfig
from jax_moe_overlap.workspace_backend import DeviceFacts


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


def _site(platform, compute_capability, sm_budget, config=CallConfig()):
  ws = types.SimpleNamespace(platform=platform, handle=1, ranks=2,
                             device=DeviceFacts(compute_capability=compute_capability, sm_budget=sm_budget,
                                                consumer_policy="test", calibration=None))
  return RankInfo(ws, config)


def test_fuses_dispatch_on_a_hopper_call_site():
  info = _site("gpu", (9, 0), 132)
  assert info.dispatch_pushers == 8
  x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)

  def fuses(x, w_shape, swiglu, transpose_rhs, dtype=jnp.bfloat16):
    w = jax.ShapeDtypeStruct(w_shape, dtype)
    return expert_block._fuses_dispatch(x, w, info, swiglu=swiglu, transpose_rhs=transpose_rhs)

  assert fuses(x, (4, 128, 256), swiglu=True, transpose_rhs=False)       # GEMM1: D = 128, F = 128
  assert not fuses(x, (4, 128, 96), swiglu=True, transpose_rhs=False)    # F = 48: not the epilogue's
  assert fuses(x, (4, 64, 128), swiglu=False, transpose_rhs=True)        # backward: w2 [E, F = 64, D = 128]
  assert not fuses(x, (4, 48, 128), swiglu=False, transpose_rhs=True)    # F = 48
  x32 = jax.ShapeDtypeStruct((64, 128), jnp.float32)
  assert not fuses(x32, (4, 128, 256), swiglu=True, transpose_rhs=False, dtype=jnp.float32)


def test_fusion_is_decided_by_the_call_site():
  x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((4, 128, 256), jnp.bfloat16)
  for info in (_site("gpu", (8, 0), 108), _site("gpu", (9, 0), 132, CallConfig(serialize=True)),
               _site("cpu", None, None)):
    assert info.dispatch_pushers == 0
    assert not expert_block._fuses_dispatch(x, w, info, swiglu=True, transpose_rhs=False)
  # Pinned on a CPU workspace: any operands (float32, widths no engine tiles).
  cpu = _site("cpu", None, None, CallConfig(dispatch_pushers=2))
  w_odd = jax.ShapeDtypeStruct((4, 30, 14), jnp.float32)
  assert expert_block._fuses_dispatch(jax.ShapeDtypeStruct((8, 30), jnp.float32), w_odd, cpu, swiglu=True,
                                      transpose_rhs=False)
