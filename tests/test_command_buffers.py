"""What the CUDA-graph support does without a GPU: every CUDA handler declares XLA's command-buffer trait (read from
the handlers as XLA reads it at registration), XLA_FLAGS that would let a CUDA graph reorder the workspace calls are
refused for CUDA call sites, and the decode step and benchmark that the GPU checks run (tests/gpu/
test_gpu_command_buffers.py, benchmarks/bench_decode.py) compute the layer and time it on CPU devices."""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_overlap as jmo
from benchmarks import bench_decode
from benchmarks import decode_step as ds
from jax_moe_overlap import _jmo
from jax_moe_overlap import command_buffers
from jax_moe_overlap.call_site import RankInfo
from jax_moe_overlap.workspace_backend import DeviceFacts


@pytest.mark.skipif(not _jmo.with_cuda, reason="built without the CUDA kernels")
def test_every_cuda_handler_declares_the_command_buffer_trait():
  traits = _jmo.cuda_handler_traits()
  assert set(traits) == set(_jmo.cuda_registrations()), traits
  bit = _jmo.ffi_trait_command_buffer_compatible
  assert bit == 1  # XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE of the FFI headers built against
  assert all(t & bit for t in traits.values()), traits
  # The host-run counters start at zero per target and count nothing without a GPU call.
  assert set(command_buffers.handler_calls()) == set(traits)


@pytest.mark.parametrize("flags,refused", [
    ("", False),
    ("--xla_gpu_command_buffer_scheduling_mode=LHS", False),
    ("--xla_gpu_command_buffer_scheduling_mode=SERIALIZE", False),
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT", True),
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT_REGIONS --xla_gpu_graph_min_graph_size=1", True),
    ("--xla_gpu_graph_enable_concurrent_region=true", True),
    ("--xla_gpu_graph_enable_concurrent_region=false", False),
    # The last occurrence wins.
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT --xla_gpu_command_buffer_scheduling_mode=LHS", False),
    # Custom calls kept out of command buffers: any scheduling is fine.
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT --xla_gpu_enable_command_buffer=FUSION,CUBLAS", False),
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT --xla_gpu_enable_command_buffer=-CUSTOM_CALL", False),
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT --xla_gpu_enable_command_buffer=", False),
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL", True),
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT --xla_gpu_enable_command_buffer=+CUSTOM_CALL", True),
])
def test_scheduling_that_could_reorder_workspace_calls_is_named(flags, refused):
  why = command_buffers.scheduling_refusal(flags)
  assert (why is not None) == refused, (flags, why)
  if refused:
    assert "program order" in why and "-CUSTOM_CALL" in why, why


@dataclasses.dataclass
class _CudaWorkspaceStub:
  """What RankInfo reads of a workspace, as a CUDA one would say it."""

  platform: str = "gpu"
  ranks: int = 2
  device: DeviceFacts = DeviceFacts(compute_capability=(9, 0), sm_budget=66, consumer_policy="fixed",
                                    calibration=None)


def test_cuda_call_sites_refuse_concurrent_command_buffer_scheduling(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT")
  with pytest.raises(ValueError, match=r"jax_moe_overlap: .*CONCURRENT.*program order"):
    RankInfo(_CudaWorkspaceStub(), jmo.CallConfig())
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_command_buffer_scheduling_mode=LHS")
  RankInfo(_CudaWorkspaceStub(), jmo.CallConfig())  # XLA's default scheduling keeps program order: accepted
  # CPU call sites: XLA:CPU has no command buffers.
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT")
  RankInfo(_CudaWorkspaceStub(platform="cpu", device=DeviceFacts(None, None, "cpu", None)), jmo.CallConfig())


def test_decode_step_layers_match_the_reference():
  mesh = jax.make_mesh((4,), (ds.AXIS,))
  model = ds.DecodeModel(layers=2, d_model=64, d_ff=64, experts=8, top_k=2)
  params = ds.init_params(model, mesh)
  x0 = ds.first_tokens(model, 16, mesh)
  assert x0.dtype == jnp.bfloat16 and params[0]["w1"].shape == (8, 64, 128)
  y = jax.jit(lambda x, p: ds.moe(x, p, model, mesh))(x0, params[0])
  f32 = {k: v.astype(jnp.float32) for k, v in params[0].items()}
  with jax.default_matmul_precision("highest"):
    y_ref = jax.jit(lambda x, p: ds.moe(x, p, model, mesh, impl="reference"))(x0.astype(jnp.float32), f32)
  y, y_ref = np.asarray(y, np.float32), np.asarray(y_ref)
  assert np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref) < 1e-2
  step = ds.make_step(model, mesh)
  x1, x1_again = step(params, x0), step(params, x0)
  assert x1.dtype == x0.dtype and x1.shape == x0.shape and x1.sharding == x0.sharding
  assert np.asarray(x1).tobytes() == np.asarray(x1_again).tobytes()  # the same inputs give the same bits
  rms = np.sqrt(np.mean(np.asarray(x1, np.float32) ** 2, axis=-1))
  np.testing.assert_allclose(rms, 1.0, rtol=2e-2)  # each layer ends in an RMS norm
  assert jmo.recorded_failures() == []  # CPU workspaces report their failures themselves


def test_bench_decode_measures_each_token_count(monkeypatch):
  monkeypatch.setattr(sys, "argv", ["bench_decode.py"])
  args = bench_decode.parse(["--layers", "1", "--d-model", "64", "--d-ff", "64", "--experts", "4", "--tokens", "1,8",
                             "--batches", "1", "--synced", "2"])
  rows = bench_decode.measure(args, "off")
  assert [r["T"] for r in rows] == [1, 8]
  for r in rows:
    assert float(r["ms_chained"]) > 0 and float(r["ms_synced"]) > 0 and len(r["first_step_sha256"]) == 16, r
    assert float(r["host_runs"]) == 0  # no CUDA handler ran
