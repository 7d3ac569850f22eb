"""This library's custom calls inside XLA:GPU command buffers (CUDA graphs), in child processes whose XLA_FLAGS turn
command buffers on (custom calls included, from the first command on) or off (benchmarks/decode_step.GRAPH_FLAGS).
The children are tests/gpu/command_buffer_main.py, whose docstring says what each case prints.

* A decode step of three MoE layers (impl "overlap", bfloat16, 8 tokens per rank), 100 steps each feeding the next,
  gives bitwise the same outputs at every step with graphs on and off: in one process on GPU 0, and with the expert
  axis over two processes sharing GPU 0 (CUDA IPC). Graphs on must really capture the custom calls: their handlers
  ran on a capturing stream (the extension counts that) and ran fewer times than the calls made, since a replay runs
  no host code; graphs off: never captured, one host run per call. The first layer matches the float32 reference.
* A failure inside a graph never returns numbers: an expert id out of range (one process) and a rank held back three
  timeouts (two processes) stop the device in the failing call itself, its synchronization raises, the next call
  raises too, nothing hangs, and ``jmo.recorded_failures()`` still names what happened. Without graphs the same bad
  input is reported by the next call, which resets the group, and the call after works (the rule outside graphs).
* A call traced into a graph while its group is aborted reports the recorded failure at once (it may not
  synchronize to reset the group); the next call outside a graph resets it.

Both settings run with autotuning off (--xla_gpu_autotune_level=0) so that XLA's own kernels (the routers' dots) are
the same in every process. Skips where there is no GPU.
"""

import json
import re

import numpy as np
import pytest

from benchmarks.decode_step import GRAPH_FLAGS
from gpu_common import requires_gpu, run_processes

pytestmark = requires_gpu

STEPS = 100
TARGETS = ("jmo_dispatch", "jmo_dispatch_gemm", "jmo_expert_combine", "jmo_exchange_counts", "jmo_gather_rs",
           "jmo_grouped_matmul", "jmo_grouped_matmul_swiglu", "jmo_grouped_matmul_swiglu_grad")


def _flags(graphs: str) -> str:
  return f"{GRAPH_FLAGS[graphs]} --xla_gpu_autotune_level=0"


def _run(nproc: int, case: str, graphs: str, limit_s: float = 300, **env):
  placement = "one_gpu" if nproc > 1 else "all_gpus"
  return run_processes(nproc, placement, case, limit_s=limit_s, script="command_buffer_main.py",
                       XLA_FLAGS=_flags(graphs), JMO_GPUS="1", **env)


def _calls(out: str) -> dict:
  m = re.search(r"^handler calls: (\{.*\})$", out, re.M)
  assert m, out[-3000:]
  return json.loads(m.group(1))


def _line(out: str, what: str) -> str:
  m = re.search(rf"^{re.escape(what)}: (.*)$", out, re.M)
  assert m, (what, out[-3000:])
  return m.group(1)


def _error_text(out: str, what: str) -> str:
  return _line(out, f"{what}: error text")


def _decode_steps(nproc: int, tmp_path):
  """Runs the "steps" case with graphs off and on; returns {graphs: [(npz of the steps, output) by process]}."""
  runs = {}
  for graphs in ("off", "on"):
    outs = []
    # (A minute's bound on every wait: the processes' first steps wait for each other's compilation.)
    job = _run(nproc, "steps", graphs, limit_s=420, JMO_STEPS=str(STEPS), JMO_TIMEOUT_MS="60000",
               JMO_OUT=str(tmp_path / f"{graphs}-{{pid}}.npz"))
    for i, (rc, out) in enumerate(job):
      assert rc == 0 and f"process {i}: done" in out and "finite outputs: True" in out, out[-4000:]
      outs.append((np.load(tmp_path / f"{graphs}-{i}.npz"), out))
    runs[graphs] = outs
  return runs


def _check_bitwise_and_capture(runs):
  for (on, on_out), (off, off_out) in zip(runs["on"], runs["off"]):
    assert sorted(on.files) == sorted(off.files) and len(off.files) >= STEPS, (on.files[:4], off.files[:4])
    differ = [k for k in off.files if on[k].tobytes() != off[k].tobytes()]
    assert not differ, f"{len(differ)} of {len(off.files)} step outputs differ with graphs on, first {differ[:3]}"
    calls_on, calls_off = _calls(on_out), _calls(off_out)
    used = [t for t in TARGETS if calls_off[t][0] > 0]
    assert used and all(calls_off[t][1] == 0 for t in used), calls_off  # off: nothing captured
    assert all(calls_off[t][0] % STEPS == 0 for t in used), calls_off   # one host run per call
    for t in used:
      runs_on, captured_on = calls_on[t]
      assert captured_on >= 1, (t, calls_on)  # traced into a CUDA graph
      assert runs_on < calls_off[t][0], (t, calls_on, calls_off)  # and replayed without its host side
    print("handler runs over", STEPS, "steps: graphs off", calls_off, "graphs on", calls_on)


@pytest.mark.watchdog_s(900)
def test_decode_step_bitwise_with_and_without_graphs_one_process(tmp_path):
  runs = _decode_steps(1, tmp_path)
  _check_bitwise_and_capture(runs)
  for graphs in ("on", "off"):
    err = float(_line(runs[graphs][0][1], "reference").split()[-1])
    assert err < 1e-2, (graphs, err)


@pytest.mark.watchdog_s(900)
def test_decode_step_bitwise_with_and_without_graphs_two_processes_one_gpu(tmp_path):
  runs = _decode_steps(2, tmp_path)
  _check_bitwise_and_capture(runs)
  # Over processes the routing counts cross through the workspace (exchange_counts), captured as well.
  assert _calls(runs["on"][0][1])["jmo_exchange_counts"][1] >= 1


@pytest.mark.watchdog_s(600)
def test_bad_input_inside_a_graph_stops_the_failing_call():
  [(rc, out)] = _run(1, "bad_input", "on")
  assert rc == 0, out[-4000:]
  for i in range(5):
    assert _line(out, f"good call {i}") == "returned", out[-4000:]
  assert _line(out, "bad call").startswith("failed after"), out[-4000:]
  assert _line(out, "next call").startswith("failed after"), out[-4000:]  # the device stays stopped
  assert "names expert id 8" in _line(out, "recorded"), out[-4000:]
  calls = _calls(out)
  assert calls["jmo_dispatch"][1] >= 1 and calls["jmo_expert_combine"][1] >= 1, calls


@pytest.mark.watchdog_s(600)
def test_bad_input_outside_graphs_is_reported_by_the_next_call():
  [(rc, out)] = _run(1, "bad_input", "off")
  assert rc == 0, out[-4000:]
  # The next workspace call reports the failure: the bad call's own second layer, or else the next call's first.
  if _line(out, "bad call") == "returned":
    assert _line(out, "next call").startswith("failed after"), out[-4000:]
    assert "names expert id 8" in _error_text(out, "next call"), out[-4000:]
  else:
    assert "names expert id 8" in _error_text(out, "bad call"), out[-4000:]
    assert _line(out, "next call") == "returned", out[-4000:]
  assert _line(out, "third call") == "returned", out[-4000:]
  assert all(c[1] == 0 for c in _calls(out).values()), out[-4000:]


@pytest.mark.watchdog_s(600)
def test_call_traced_while_the_group_is_aborted_reports_the_failure():
  [(rc, out)] = _run(1, "aborted_at_record", "on")
  assert rc == 0, out[-4000:]
  assert _line(out, "on warm-up 1") == "returned" and _line(out, "on warm-up 2") == "returned", out[-4000:]
  assert _line(out, "off bad call") == "returned", out[-4000:]  # outside a graph: left for the next call
  assert _line(out, "graph call").startswith("failed after"), out[-4000:]
  graph_calls = json.loads(_line(out, "graph call handler calls"))
  text = _error_text(out, "graph call")
  if graph_calls["jmo_dispatch"][1] >= 1:  # traced into a graph: reported without a reset
    assert "recorded into a CUDA graph" in text and "names expert id 8" in text, text
    assert _line(out, "off call 1").startswith("failed after"), out[-4000:]  # the reset, reporting it again
    assert "names expert id 8" in _error_text(out, "off call 1"), out[-4000:]
    assert _line(out, "off call 2") == "returned", out[-4000:]
  elif "has been reset" in text:  # XLA ran the calls outside the graph: the ordinary report and reset
    assert "names expert id 8" in text, text
    assert _line(out, "off call 2") == "returned", out[-4000:]
  else:  # a replay without a new trace: the captured calls found the group aborted and stopped the device
    assert "recorded" in out and "names expert id 8" in _line(out, "recorded"), out[-4000:]


@pytest.mark.watchdog_s(600)
def test_timeout_inside_a_graph_stops_the_waiting_process():
  # Process 1 stops calling after five steps; process 0's next step is a replay of the graph, whose wait for peer 1
  # expires: the call fails (the device stopped), never returns silently, and the record names the peer.
  timeout_ms = 2000
  outs = _run(2, "timeout", "on", limit_s=240, JMO_TIMEOUT_MS=str(timeout_ms))
  for rc, out in outs:
    assert rc == 0 and _line(out, "good steps") == "returned", out[-4000:]
  out = outs[0][1]
  stalled = _line(out, "stalled call")
  assert stalled.startswith("failed after"), out[-4000:]
  assert float(stalled.split()[2]) < timeout_ms / 1000 + 30, stalled
  recorded = _line(out, "recorded")
  assert "timed out" in recorded and "waiting for peer 1" in recorded, recorded
