"""What the CUDA-graph support does without a GPU: every CUDA handler declares XLA's command-buffer trait (read from
the handlers as XLA reads it at registration), XLA_FLAGS that would let a CUDA graph reorder the workspace calls are
refused for CUDA call sites, and the decode step and benchmark that the GPU checks run (tests/gpu/
test_gpu_command_buffers.py, benchmarks/bench_decode.py) compute the layer and time it on CPU devices."""

import dataclasses
import json
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


@pytest.mark.slow  # a benchmark's plumbing: decode steps compiled and timed on CPU
def test_bench_decode_measures_each_token_count(monkeypatch):
  monkeypatch.setattr(sys, "argv", ["bench_decode.py"])
  args = bench_decode.parse(["--layers", "1", "--d-model", "64", "--d-ff", "64", "--experts", "4", "--tokens", "1,8",
                             "--batches", "1", "--synced", "2"])
  rows = bench_decode.measure(args, "off")
  assert [r["T"] for r in rows] == [1, 8]
  for r in rows:
    assert float(r["ms_chained"]) > 0 and float(r["ms_synced"]) > 0 and len(r["first_step_sha256"]) == 16, r
    assert float(r["host_runs"]) == 0  # no CUDA handler ran
    assert float(r["err_bf16"]) <= bench_decode.max_err(None), r
    assert "fp8_ms_chained" not in r, r  # the FP8 step only with --quantization fp8


def _fp8_args(*extra):
  return bench_decode.parse(["--layers", "2", "--d-model", "256", "--d-ff", "128", "--experts", "4", "--top-k", "2",
                             "--tokens", "1,8", "--batches", "1", "--synced", "2", "--quantization", "fp8", *extra])


@pytest.mark.slow  # a benchmark's plumbing: decode steps compiled and timed on CPU
def test_bench_decode_times_the_prequantized_step_beside_bf16(monkeypatch):
  monkeypatch.setattr(sys, "argv", ["bench_decode.py"])
  args = _fp8_args("--tokens", "1")
  rows = bench_decode.measure(args, "off")
  assert [r["T"] for r in rows] == [1]
  # One expert's weights: w1 [256, 256] and w2 [128, 256]: 2 bytes a weight in bf16, 1 in FP8 plus a float32 scale
  # per 128 x 128 block (4 + 2 blocks).
  weights = 256 * 256 + 128 * 256
  bf16_bytes, fp8_bytes = 2 * weights, weights + 4 * 6
  for r in rows:
    for q in ("bf16", "fp8"):
      assert float(r[f"err_{q}"]) <= bench_decode.max_err(None if q == "bf16" else "fp8"), r
      assert r[f"experts_{q}"] == 4, r  # one token to k = 2 distinct experts in each of the 2 layers
    assert float(r["bf16_read_MB"]) * 1e6 == pytest.approx(r["experts_bf16"] * bf16_bytes, abs=0.01e6), r
    assert float(r["fp8_read_MB"]) * 1e6 == pytest.approx(r["experts_fp8"] * fp8_bytes, abs=0.01e6), r
    assert args.hbm_tbps is None and r["hbm_tbps"] == "" and "fp8_bound_ms" not in r, r  # a CPU: no bound known
  rows = bench_decode.measure(_fp8_args("--tokens", "1", "--hbm-tbps", "2.5"), "off")
  for r in rows:
    hbm = 2.5e12
    assert r["hbm_tbps"] == 2.5, r
    assert float(r["fp8_bound_ms"]) == pytest.approx(r["experts_fp8"] * fp8_bytes / hbm * 1e3, rel=1e-3), r
    for prefix in ("", "fp8_"):
      assert float(r[prefix + "ms_chained"]) > 0 and float(r[prefix + "ms_synced"]) > 0, r
      assert float(r[prefix + "host_runs"]) == 0, r
    assert float(r["fp8_of_bound"]) == pytest.approx(float(r["fp8_bound_ms"]) / float(r["fp8_ms_chained"]), abs=0.01)
    # The FP8 step computes other values than the bf16 one (its weights are the quantized ones).
    assert r["fp8_first_step_sha256"] != r["first_step_sha256"], r


def test_bench_decode_bound_takes_the_gpus_hbm_bandwidth():
  args = bench_decode.parse([])
  assert bench_decode.hbm_tbps(args, "NVIDIA H200") == 4.8
  assert bench_decode.hbm_tbps(args, "NVIDIA H100 80GB HBM3") == 3.35
  assert bench_decode.hbm_tbps(args, "cpu") is None
  assert bench_decode.hbm_tbps(bench_decode.parse(["--hbm-tbps", "2"]), "NVIDIA H200") == 2.0


def test_bench_decode_times_nothing_that_disagrees_with_its_oracle(monkeypatch):
  """The check compares the step's layers with an oracle computed apart: a layer 10 % off is caught, in bf16 and in
  FP8, and neither step is timed."""
  monkeypatch.setattr(sys, "argv", ["bench_decode.py"])
  real = jmo.moe_experts

  def off_by_a_tenth(*a, impl="overlap", **kw):
    y, dropped = real(*a, impl=impl, **kw)
    return (y * 1.1 if impl == "overlap" else y), dropped

  monkeypatch.setattr(jmo, "moe_experts", off_by_a_tenth)
  rows = bench_decode.measure(_fp8_args("--tokens", "8"), "off")
  assert [r["T"] for r in rows] == [8]
  for q, prefix in (("bf16", ""), ("fp8", "fp8_")):
    assert float(rows[0][f"err_{q}"]) == pytest.approx(0.1, rel=0.2), rows
    assert rows[0][prefix + "ms_chained"].startswith("wrong result"), rows
    assert f"{q}_of_bound" not in rows[0] and prefix + "first_step_sha256" not in rows[0], rows


@pytest.mark.slow  # two child processes, each compiling both steps again
def test_bench_decode_writes_both_settings_rows(tmp_path):
  """The parent's table from both settings' child processes (on CPU the graph flags change nothing): each T a row
  per setting, the same first-step bits in both, FP8's speedup over bf16 in each."""
  out = tmp_path / "decode.jsonl"
  bench_decode.main(["--layers", "1", "--d-model", "128", "--d-ff", "128", "--experts", "4", "--top-k", "2",
                     "--tokens", "8", "--batches", "1", "--synced", "1", "--quantization", "fp8", "--out", str(out)])
  rows = [json.loads(line) for line in out.read_text().splitlines()[1:]]
  assert [(r["T"], r["graphs"]) for r in rows] == [(8, "off"), (8, "on")], rows
  for r in rows:
    assert r["same_bits"] == "yes" and r["fp8_same_bits"] == "yes", r
    assert float(r["fp8_speedup"]) == pytest.approx(float(r["ms_chained"]) / float(r["fp8_ms_chained"]), abs=0.01)
  assert rows[1]["speedup"] != "" and rows[0]["speedup"] == "", rows
