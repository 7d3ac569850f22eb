"""The overlap layer on CUDA with its expert axis over processes (jax.distributed on localhost, one rank per
process): the workspace's blocks cross processes through CUDA IPC, its group memory through POSIX shared memory.

Placements: two processes sharing GPU 0 (the one-GPU machine; a process per rank, time-sliced on the device), and
where there are several GPUs one process per GPU, which is also compared bitwise with the same mesh driven by one
process. Each checks bfloat16 and float32 forward and gradients (jax.vjp through moe_experts) against the float32
reference (1e-2 relative), repeated calls bitwise identical, and no shared-memory name left behind; on GPU 0, the
FP8 layer with its returns fused (bfloat16, against the FP8 recipe's oracle within 1e-2). A peer process
killed between calls makes the survivor fail (the routing counts' exchange, stage "counts") within about two
timeouts (the kernel's wait, then the next call's recovery barrier, which reports it), naming the peer and its
process, and the survivor's release does not wait for the dead peer (with the custom calls outside CUDA graphs: inside
one a failure stops the device, test_gpu_command_buffers.py). Every subprocess wait is bounded. In this
process, over every visible GPU (R = 1 on a one-GPU machine): the CUDA exchange_counts path of the layer equals the
all_gather one bit for bit.
"""

import glob
import re

import pytest

import layer_checks as checks  # tests/layer_checks.py (tests/ is on pytest's pythonpath)
from gpu_common import gpu_devices, gpu_mesh, requires_gpu, run_processes

pytestmark = requires_gpu
GPUS = len(gpu_devices())
# XLA's default command buffer kinds without CUSTOM_CALL.
NO_CUSTOM_CALL_GRAPHS = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN,DYNAMIC_SLICE_FUSION"
PLACEMENTS = ["one_gpu"] + (["own_gpu"] if GPUS >= 2 else [])


def _shm_left(outs) -> list[str]:
  prefixes = {m for _, out in outs for m in re.findall(r"^shm (/jmo-[0-9a-f]+)$", out, re.M)}
  assert prefixes, [out[-2000:] for _, out in outs]
  return [f for p in prefixes for f in glob.glob(f"/dev/shm{p}-*")]


@pytest.mark.watchdog_s(900)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_expert_axis_over_processes_matches_the_reference(placement, tmp_path):
  env = {}
  if placement == "own_gpu":
    # The same mesh driven by one process holding both GPUs: the multi-process run must equal it bitwise.
    oracle = str(tmp_path / "one_process.npz")
    [(rc, out)] = run_processes(1, "all_gpus", "equal", JMO_GPUS="2", JMO_OUT=oracle)
    assert rc == 0 and ": match (spans_processes=False)" in out, out[-4000:]
    env["JMO_ORACLE"] = oracle
  outs = run_processes(2, placement, "equal", **env)
  for rc, out in outs:
    assert rc == 0 and ": match (spans_processes=True)" in out, out[-4000:]
    if placement == "own_gpu":
      assert ": bitwise" in out, out[-4000:]
    assert "freeing them anyway" not in out, out[-4000:]  # the release found every peer's mappings closed
  assert _shm_left(outs) == []


@pytest.mark.watchdog_s(600)
def test_fp8_fused_combine_over_processes_matches_the_recipe():
  """quantization="fp8" with GEMM2 and the way back as one expert_combine on e4m3 operands (the fused FP8 combine,
  switched on in the processes), two processes sharing GPU 0 (a rank each: the consumer's pushes cross processes
  through CUDA IPC): forward and gradients within 1e-2 of the recipe's oracle, repeated calls bitwise identical."""
  outs = run_processes(2, "one_gpu", "fp8")
  for rc, out in outs:
    assert rc == 0 and ": fused combine" in out and ": match (spans_processes=True)" in out, out[-4000:]
  assert _shm_left(outs) == []


@pytest.mark.watchdog_s(600)
def test_fp8_fused_dispatch_over_processes_matches_the_recipe():
  """quantization="fp8" with the dispatches fused as well (dispatch_gemm's FP8 kernel, switched on in the processes:
  x's packed rows with GEMM1, dy's with dh = dy W2^T), D = 512, two processes sharing GPU 0 (the pushers' rows cross
  processes through CUDA IPC): forward and gradients within 1e-2 of the recipe's oracle, repeated calls bitwise
  identical."""
  outs = run_processes(2, "one_gpu", "fp8_dispatch")
  for rc, out in outs:
    assert rc == 0 and ": fused dispatch" in out and ": match (spans_processes=True)" in out, out[-4000:]
  assert _shm_left(outs) == []


@pytest.mark.watchdog_s(600)
def test_scaled_dgrad_dispatch_gemm_over_processes_keeps_the_bits():
  """The backward's dgrad dispatch_gemm scaling dy's rows by the gates (expert_block.SCALE_IN_DISPATCH)
  against the [T k, D] array of gates * dy, two processes sharing GPU 0 (the scaled pushes cross processes through
  CUDA IPC): bfloat16 outputs and gradients bitwise the same, within 1e-2 of the float32 reference."""
  outs = run_processes(2, "one_gpu", "scaled_dgrad")
  for rc, out in outs:
    assert rc == 0 and ": scaled dgrad bitwise" in out, out[-4000:]
  assert _shm_left(outs) == []


@pytest.mark.watchdog_s(600)
def test_a_process_that_begins_its_first_call_late_is_waited_for():
  # The last process begins its first call 6 s after the other, past its 2 s timeout_ms: the group's first call
  # waits up to first_call_timeout_ms (60 s by default) for it; later calls keep the 2 s bound.
  outs = run_processes(2, "one_gpu", "late_first_call", JMO_TIMEOUT_MS="2000", JMO_LATE_S="6")
  for rc, out in outs:
    assert rc == 0 and ": match (spans_processes=True)" in out, out[-4000:]
  assert _shm_left(outs) == []


@pytest.mark.watchdog_s(600)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_peer_killed_between_calls_fails_the_survivor_within_the_timeout(placement):
  timeout_s = 3.0
  # The recovery outside CUDA graphs: the custom calls are kept out of XLA's command buffers (a failure inside one
  # stops the device instead: test_gpu_command_buffers.py).
  outs = run_processes(2, placement, "killed_between_calls", limit_s=240, JMO_TIMEOUT_MS=str(int(timeout_s * 1000)),
                       XLA_FLAGS=NO_CUSTOM_CALL_GRAPHS)
  lost_rank, lost = map(int, re.search(r"^losing rank (\d+) in process (\d+)$", outs[0][1], re.M).groups())
  assert outs[lost][0] == -9, outs[lost][1][-4000:]
  rc, out = outs[1 - lost]
  line = next((l for l in out.splitlines() if l.startswith("failed after")), None)
  assert rc == 0 and line is not None, out[-4000:]
  # The counts kernel's wait expires (one timeout); the next call meets the recovery barrier, which the dead peer
  # never reaches (a second timeout), and reports the first failure.
  assert float(line.split()[2]) < 2 * timeout_s + 10.0, line
  assert "DEADLINE_EXCEEDED" in line and "stage counts" in line, line
  assert f"waiting for peer {lost_rank}:" in line and f"peer rank {lost_rank} is in process {lost}" in line, line
  released = next((l for l in out.splitlines() if l.startswith("released after")), None)
  assert released is not None and float(released.split()[2]) < 5.0, out[-4000:]
  assert _shm_left(outs) == []


def test_counts_through_the_workspace_equal_all_gather_in_one_process(monkeypatch):
  checks.check_counts_through_the_workspace(gpu_mesh(GPUS), monkeypatch, num_experts=8 * GPUS)
