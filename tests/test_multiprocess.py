"""Several processes under jax.distributed on localhost CPU (gloo collectives), each running multiprocess_main.py.

Data axis across processes (expert axis inside each): matches a float32 oracle (outputs and gradients). Expert
axis across processes (a workspace in POSIX shared memory), also with a tensor axis (expert tensor parallelism):
outputs and gradients bitwise equal to the same program run as one process holding every device, and no
shared-memory name left behind. A peer process killed inside a
call makes the others fail within the timeout with an error naming its rank and process, and they exit with status
0; so does a peer process killed or stopped (SIGSTOP: hung) between calls, the others failing in the exchange of the
routing counts (stage "counts"), which goes through the workspace rather than gloo's unbounded all_gather. An
expert axis over processes of different hosts runs as impl="collective" (XLA collectives, no workspace) and matches
the oracle; a workspace over it is refused before anything is allocated, naming impl="collective".
"""

import glob
import os
import re
import socket
import subprocess
import sys
import time

import pytest


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_processes(nproc: int, local: int, case: str, calls: int = 3, limit_s: float = 240, hung: int | None = None,
                  **env_extra):
  """Runs the processes of one job; returns [(exit status, output)] by process. Each child is killed (SIGKILL)
  when the job runs past limit_s. ``hung``: a process that stops itself; it is killed once the others have exited
  (or the job ran past limit_s)."""
  here = os.path.dirname(os.path.abspath(__file__))
  env = dict(os.environ, JMO_CALLS=str(calls), **env_extra)
  env.pop("XLA_FLAGS", None)
  port = str(_free_port())
  procs = [subprocess.Popen([sys.executable, os.path.join(here, "multiprocess_main.py"), str(i), str(nproc), port,
                             str(local), case], cwd=here, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for i in range(nproc)]
  outs = [None] * nproc
  deadline = time.monotonic() + limit_s
  try:
    for i in [i for i in range(nproc) if i != hung] + ([hung] if hung is not None else []):
      p = procs[i]
      try:
        rc = p.wait(timeout=0 if i == hung else max(1.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        p.kill()
        rc = p.wait(timeout=30)
      outs[i] = (rc, p.stdout.read())
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return outs


def _shm_left(outs) -> list[str]:
  prefixes = {m for _, out in outs for m in re.findall(r"^shm (/jmo-[0-9a-f]+)$", out, re.M)}
  assert prefixes, [out[-2000:] for _, out in outs]
  return [f for p in prefixes for f in glob.glob(f"/dev/shm{p}-*")]


# Every variant compiles the programs again in each process: the slow pass.
@pytest.mark.parametrize("nproc,local,calls", [pytest.param(2, 2, 100, marks=pytest.mark.slow),
                                              pytest.param(4, 1, 3, marks=pytest.mark.slow)])
def test_data_axis_across_processes_matches_the_oracle(nproc, local, calls):
  for rc, out in run_processes(nproc, local, "data_across", calls):
    assert rc == 0 and ": match" in out, out


def _expert_across(nproc, local, calls, tmp_path, case="expert_across"):
  oracle = str(tmp_path / "one_process.npz")
  [(rc, out)] = run_processes(1, nproc * local, case, calls, JMO_OUT=oracle)
  assert rc == 0 and ": match" in out, out
  outs = run_processes(nproc, local, case, calls, JMO_ORACLE=oracle)
  for rc, out in outs:
    assert rc == 0 and ": match" in out and ": bitwise" in out, out
  assert _shm_left(outs) == []


# 4 processes of one device: test_expert_axis_across_processes_100_consecutive_calls.
@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
@pytest.mark.parametrize("nproc,local", [(2, 1), (2, 2)])
def test_expert_axis_across_processes_is_bitwise_the_one_process_run(nproc, local, tmp_path):
  _expert_across(nproc, local, 3, tmp_path)


@pytest.mark.slow  # child processes; the expert axis across processes stays in the default pass
@pytest.mark.parametrize("case", ["fp8_across", "fp8_across_unfused"])
def test_fp8_expert_axis_across_processes_is_bitwise_the_one_process_run(case, tmp_path):
  # quantization="fp8": the packed e4m3 rows dispatched with the GEMM after them (dispatch_gemm_fp8) and the fused
  # returns (expert_combine on e4m3 operands), forward and backward, over a shared-memory workspace spanning two
  # processes of two devices.
  # fp8_across_unfused: the dispatches unfused (dispatch calls moving the packed rows).
  _expert_across(2, 2, 2, tmp_path, case=case)


@pytest.mark.slow  # child processes; the expert axis across processes stays in the default pass
@pytest.mark.parametrize("nproc,local", [(2, 2), (4, 1)])
def test_tensor_axis_across_processes_is_bitwise_the_one_process_run(nproc, local, tmp_path):
  # Expert tensor parallelism on (expert=2, tensor=2): one expert rank per process (2 x 2), or one rank per process
  # (4 x 1: every tensor group spans two processes); the workspace's group is the four devices of both axes, across
  # the processes.
  _expert_across(nproc, local, 3, tmp_path, case="tensor_across")


@pytest.mark.slow
@pytest.mark.parametrize("nproc,local", [(2, 2), (4, 1)])
def test_expert_axis_across_processes_100_consecutive_calls(nproc, local, tmp_path):
  _expert_across(nproc, local, 100, tmp_path)


@pytest.mark.parametrize("nproc,local", [(2, 1), pytest.param(4, 1, marks=pytest.mark.slow)])
def test_killed_peer_inside_a_call_fails_the_others_within_the_timeout(nproc, local):
  timeout_s = 3.0
  outs = run_processes(nproc, local, "killed_peer", JMO_TIMEOUT_MS=str(int(timeout_s * 1000)))
  dead = nproc - 1
  assert outs[dead][0] == -9, outs[dead][1]
  for rc, out in outs[:dead]:
    line = next((l for l in out.splitlines() if l.startswith("failed after")), None)
    assert rc == 0 and line is not None, out
    assert float(line.split()[2]) < timeout_s + 5.0, line
    assert "DEADLINE_EXCEEDED" in line and f"is in process {dead}" in line, line
  assert _shm_left(outs) == []


@pytest.mark.slow  # child processes compiling the layer again
def test_a_process_that_begins_its_first_call_late_is_waited_for():
  # The last process begins its first call 4 s after the others, past their 1 s timeout_ms: the group's first call
  # waits up to first_call_timeout_ms (60 s by default) for it.
  outs = run_processes(2, 1, "late_first_call", JMO_TIMEOUT_MS="1000", JMO_LATE_S="4")
  for rc, out in outs:
    assert rc == 0 and ": match" in out, out
  assert _shm_left(outs) == []


# A peer lost between calls in the slow pass: the default one keeps the peer killed inside a call.
@pytest.mark.parametrize("case,nproc", [pytest.param("killed_between_calls", 2, marks=pytest.mark.slow),
                                        pytest.param("stopped_between_calls", 2, marks=pytest.mark.slow),
                                        pytest.param("stopped_between_calls", 4, marks=pytest.mark.slow)])
def test_peer_lost_between_calls_fails_the_others_within_the_timeout(case, nproc):
  timeout_s = 2.0
  lost = nproc - 1
  outs = run_processes(nproc, 1, case, limit_s=120, hung=lost if case.startswith("stopped") else None,
                       JMO_TIMEOUT_MS=str(int(timeout_s * 1000)))
  assert outs[lost][0] == -9, outs[lost][1]
  for rc, out in outs[:lost]:
    line = next((l for l in out.splitlines() if l.startswith("failed after")), None)
    assert rc == 0 and line is not None, out
    assert float(line.split()[2]) < timeout_s + 5.0, line
    assert "DEADLINE_EXCEEDED" in line and "stage counts" in line, line
    assert f"waiting for peer {lost}:" in line and f"peer rank {lost} is in process {lost}" in line, line
  assert _shm_left(outs) == []


@pytest.mark.slow
def test_collective_impl_across_processes_is_bitwise_the_one_process_run(tmp_path):
  oracle = str(tmp_path / "one_process.npz")
  [(rc, out)] = run_processes(1, 2, "expert_across", 1, JMO_OUT=oracle, JMO_IMPL="collective")
  assert rc == 0 and ": match" in out, out
  for rc, out in run_processes(2, 1, "expert_across", 1, JMO_ORACLE=oracle, JMO_IMPL="collective"):
    assert rc == 0 and ": match" in out and ": bitwise" in out and "shm /" not in out, out


@pytest.mark.slow  # a 2-process run of its own; the default pass keeps the bitwise and the killed-peer runs
def test_expert_axis_over_different_hosts_runs_the_collective_impl():
  for rc, out in run_processes(2, 1, "different_hosts", calls=1, limit_s=120):
    line = next((l for l in out.splitlines() if l.startswith("refused:")), None)
    assert rc == 0 and ": match" in out and ": no workspace" in out and line is not None, out
    assert "different hosts" in line and "process 1 on another-host" in line and 'impl="collective"' in line, line
