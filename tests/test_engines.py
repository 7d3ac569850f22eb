"""The GEMM engine selection (ffi/cuda/gemm/engine.cc) as the extension exposes it, engines.py, the Python side that
asks it, and the fusion decision of the expert block that reads it (on a stand-in CUDA call site: the CUDA branches
run without a GPU). The rules are the CUDA build's: on a build without it every GPU question answers "no engine"."""

import types

import jax
import jax.numpy as jnp
import pytest

from jax_moe_overlap import _jmo
from jax_moe_overlap import engines
from jax_moe_overlap import expert_block
from jax_moe_overlap.call_site import RankInfo
from jax_moe_overlap.config import CallConfig
from jax_moe_overlap.workspace_backend import DeviceFacts

requires_cuda_build = pytest.mark.skipif(not _jmo.with_cuda, reason="a build without CUDA has no GPU engine rules")

HOPPER, AMPERE, BLACKWELL, TURING = (9, 0), (8, 0), (10, 0), (7, 5)
WGMMA, MMA, SIMT = "wgmma bf16", "mma.sync bf16", "simt fp32"


@requires_cuda_build
@pytest.mark.parametrize("cc,dtype,K,N,kw,want", [
    (HOPPER, "bfloat16", 384, 256, {}, WGMMA),
    (AMPERE, "bfloat16", 384, 256, {}, MMA),
    (BLACKWELL, "bfloat16", 384, 256, {}, MMA),       # wgmma is Hopper's only
    (TURING, "bfloat16", 384, 256, {}, SIMT),         # no mma.sync bf16 before sm_80
    (HOPPER, "float32", 384, 256, {}, SIMT),          # the tensor-core engines take bfloat16 only
    (HOPPER, "bfloat16", 200, 136, {}, MMA),          # K, N not multiples of 64
    (HOPPER, "bfloat16", 200, 140, {}, SIMT),         # w's rows of 140 elements: not a multiple of 8
    (HOPPER, "bfloat16", 200, 140, {"transpose_rhs": True}, MMA),  # w's rows hold K = 200
    (HOPPER, "bfloat16", 204, 136, {"transpose_rhs": True}, SIMT),
    (HOPPER, "bfloat16", 768, 256, {"transpose_rhs": True}, WGMMA),
    (HOPPER, "bfloat16", 0, 256, {}, MMA),            # no k-step: wgmma needs every extent >= 1
    (HOPPER, "bfloat16", 256, 384, {"swiglu": True}, WGMMA),
    (HOPPER, "bfloat16", 256, 96, {"swiglu": True}, None),   # F = 48: no engine has this epilogue
    (AMPERE, "bfloat16", 256, 384, {"swiglu": True}, None),
    (HOPPER, "bfloat16", 256, 384, {"swiglu": True, "transpose_rhs": True}, None),
    (HOPPER, "bfloat16", 256, 384, {"swiglu_grad": True, "transpose_rhs": True}, WGMMA),  # dh = d_out W2^T, F = 384
    (HOPPER, "bfloat16", 256, 384, {"swiglu_grad": True}, WGMMA),
    (HOPPER, "bfloat16", 256, 96, {"swiglu_grad": True, "transpose_rhs": True}, None),  # F = 96: not a multiple of 64
    (HOPPER, "float32", 256, 384, {"swiglu_grad": True, "transpose_rhs": True}, None),
    (AMPERE, "bfloat16", 256, 384, {"swiglu_grad": True, "transpose_rhs": True}, None),
    (HOPPER, "bfloat16", 256, 384, {"outer": True, "M": 512}, WGMMA),
    (HOPPER, "bfloat16", 256, 384, {"outer": True, "M": 0}, MMA),   # the outer form reduces over M rows
    (HOPPER, "bfloat16", 256, 136, {"outer": True, "M": 512}, MMA),
])
def test_select_gemm_engine(cc, dtype, K, N, kw, want):
  assert _jmo.select_gemm_engine(cc, dtype, K, N, **kw) == want


@requires_cuda_build
def test_refusals_name_the_rule():
  assert _jmo.gemm_engine_device_refusal(WGMMA, HOPPER) is None
  assert "Hopper" in _jmo.gemm_engine_device_refusal(WGMMA, AMPERE)
  assert "8.0" in _jmo.gemm_engine_device_refusal(MMA, TURING)
  assert _jmo.gemm_engine_device_refusal(SIMT, TURING) is None
  assert _jmo.gemm_engine_operand_refusal(WGMMA, "bfloat16", 128, 64) is None
  assert "multiples of 64" in _jmo.gemm_engine_operand_refusal(WGMMA, "bfloat16", 100, 64)
  assert "dtype" in _jmo.gemm_engine_operand_refusal(WGMMA, "float32", 128, 64)
  assert "not transposed" in _jmo.gemm_engine_operand_refusal(WGMMA, "bfloat16", 128, 64, transpose_rhs=True,
                                                              swiglu=True)
  assert "SwiGLU" in _jmo.gemm_engine_operand_refusal(MMA, "bfloat16", 128, 64, swiglu=True)
  assert "multiple of 8" in _jmo.gemm_engine_operand_refusal(MMA, "bfloat16", 128, 60)
  assert "SwiGLU" in _jmo.gemm_engine_operand_refusal(MMA, "bfloat16", 128, 64, swiglu_grad=True)
  assert "dtype" in _jmo.gemm_engine_operand_refusal(WGMMA, "float32", 128, 64, swiglu_grad=True)
  with pytest.raises(ValueError, match="one epilogue"):
    _jmo.select_gemm_engine(HOPPER, "bfloat16", 128, 64, swiglu=True, swiglu_grad=True)
  with pytest.raises(ValueError, match=r"dtype 'float16' is none of float32 or bfloat16"):
    _jmo.select_gemm_engine(HOPPER, "float16", 128, 64)
  with pytest.raises(ValueError, match=r"no GEMM engine is named 'tcgen05'"):
    _jmo.gemm_engine_device_refusal("tcgen05", BLACKWELL)


@requires_cuda_build
def test_engines_asks_the_extension():
  # Every operand question of engines.py is the extension's wgmma rule, on any shape.
  for bf16 in (True, False):
    for K in (0, 32, 64, 96, 128, 200, 2048):
      for N in (32, 64, 96, 128, 136, 7168):
        dt = "bfloat16" if bf16 else "float32"
        assert engines.wgmma_operands(bf16, K, N) == (_jmo.select_gemm_engine(HOPPER, dt, K, N) == WGMMA)
        assert engines.dispatch_gemm_operands("gpu", bf16, K, N, swiglu=True) == (
            _jmo.select_gemm_engine(HOPPER, dt, K, N, swiglu=True) == WGMMA)
        if N % 2 == 0:
          assert engines.swiglu_epilogue_operands(bf16, K, N // 2) == (
              _jmo.select_gemm_engine(HOPPER, dt, K, N, swiglu=True) == WGMMA)


def test_no_gpu_engine_without_cuda(monkeypatch):
  # A build without the CUDA kernels has no rules to ask: every GPU engine question answers no; the CPU handler of
  # dispatch_gemm still takes any operands.
  monkeypatch.setattr(engines, "_jmo", types.SimpleNamespace(with_cuda=False))
  assert not engines.wgmma_runs_on(HOPPER)
  assert not engines.wgmma_operands(True, 128, 64)
  assert not engines.swiglu_epilogue_operands(True, 256, 192)
  assert not engines.dispatch_gemm_operands("gpu", True, 128, 256, swiglu=True)
  assert not engines.swiglu_grad_fused.__wrapped__(True, 256, 192, True)
  assert engines.dispatch_gemm_operands("cpu", True, 30, 7, swiglu=True)
  assert not engines.first_gpu_runs_wgmma()


@requires_cuda_build
def test_wgmma_runs_on_hopper_only():
  assert engines.wgmma_runs_on((9, 0))
  assert not any(engines.wgmma_runs_on(cc) for cc in ((8, 0), (8, 9), (10, 0), (12, 0), None))


@requires_cuda_build
@pytest.mark.parametrize("bf16,K,N,want", [(True, 64, 64, True), (True, 2048, 7168, True), (False, 64, 64, False),
                                           (True, 96, 64, False), (True, 64, 32, False)])
def test_wgmma_operands(bf16, K, N, want):
  assert engines.wgmma_operands(bf16, K, N) == want


@requires_cuda_build
@pytest.mark.parametrize("bf16,K,F,want", [(True, 256, 192, True), (True, 64, 32, True), (True, 256, 48, False),
                                           (True, 200, 192, False), (False, 256, 192, False)])
def test_swiglu_epilogue_operands(bf16, K, F, want):
  assert engines.swiglu_epilogue_operands(bf16, K, F) == want


@requires_cuda_build
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


@requires_cuda_build
def test_fuses_dispatch_on_a_hopper_call_site():
  info = _site("gpu", (9, 0), 132)
  assert info.dispatch_pushers == 8
  x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)

  def fuses(x, w_shape, swiglu, transpose_rhs, dtype=jnp.bfloat16):
    w = jax.ShapeDtypeStruct(w_shape, dtype)
    return expert_block.fuses_dispatch(x, w, info, swiglu=swiglu, transpose_rhs=transpose_rhs)

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
    assert not expert_block.fuses_dispatch(x, w, info, swiglu=True, transpose_rhs=False)
  # Pinned on a CPU workspace: any operands (float32, widths no engine tiles).
  cpu = _site("cpu", None, None, CallConfig(dispatch_pushers=2))
  w_odd = jax.ShapeDtypeStruct((4, 30, 14), jnp.float32)
  assert expert_block.fuses_dispatch(jax.ShapeDtypeStruct((8, 30), jnp.float32), w_odd, cpu, swiglu=True,
                                      transpose_rhs=False)
