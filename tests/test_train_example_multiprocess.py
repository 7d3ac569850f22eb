"""examples/train_moe.py as a jax.distributed job: 2 CPU processes of 2 devices each train like one process of 4
(the same global mesh, data and steps), and the job's flags are checked before anything starts; and
benchmarks.launch_job, which starts such jobs, kills every process when one fails."""

import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
import train_moe  # examples/train_moe.py
from cpu_flags import cpu_xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_moe.py"
TINY = ["--steps", "5", "--layers", "2", "--d-model", "64", "--heads", "4", "--d-ff", "128", "--experts", "8",
        "--top-k", "2", "--seq-len", "32", "--batch-size", "8", "--eval-batches", "2", "--seed", "1", "--no-progress",
        "--plot", ""]


def _train(tmp_path, processes: int, devices_each: int) -> dict:
  """Runs the script as `processes` CPU processes of `devices_each` devices (through benchmarks.launch_job when
  several); returns process 0's history."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(devices_each))
  out = tmp_path / f"history-{processes}x{devices_each}.json"
  logs = tmp_path / f"logs-{processes}x{devices_each}"
  train = [sys.executable, str(SCRIPT), *TINY, "--history-out", str(out)]
  launch = [sys.executable, "-m", "benchmarks.launch_job", "--processes", str(processes), "--no-local-ids",
            "--limit-s", "400", "--logs", str(logs), "--"]
  proc = subprocess.run(launch + train if processes > 1 else train, cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=450, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  if processes > 1:
    first = (logs / "process-0.log").read_text()
    assert f"in {processes} processes" in first, first[-2000:]
    assert "check: an MoE layer through the custom calls on 4 devices" in first, first[-2000:]
    for i in range(1, processes):   # only process 0 reports
      assert "train loss" not in (logs / f"process-{i}.log").read_text()
  return json.loads(out.read_text())


@pytest.mark.slow  # three processes that each compile the training step
def test_two_processes_train_like_one(tmp_path):
  one = _train(tmp_path, 1, 4)
  two = _train(tmp_path, 2, 2)
  assert two["processes"] == 2 and two["devices"] == 4 and one["devices"] == 4
  assert len(two["losses"]) == 5 and np.all(np.isfinite(two["losses"]))
  # The same programs on the same global mesh; only the collectives' transport differs (gloo across processes).
  np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
  np.testing.assert_allclose(two["dropped"], one["dropped"], atol=1e-6)
  np.testing.assert_allclose(two["eval_loss"], one["eval_loss"], rtol=1e-5)


@pytest.mark.parametrize("flags,message", [
    (["--num-processes", "2"], "needs --process-id in 0..1 and --coordinator"),
    (["--num-processes", "2", "--process-id", "2", "--coordinator", "localhost:1"], "needs --process-id in 0..1"),
    (["--process-id", "1"], "belong to a job of several processes"),
    (["--num-processes", "0"], "at least 1"),
    (["--num-processes", "2", "--process-id", "0", "--coordinator", "localhost:1", "--ckpt-dir", "/tmp/x"],
     "checkpoints from one process only"),
])
def test_job_flags_are_checked_first(flags, message):
  with pytest.raises(SystemExit, match=message):
    train_moe.main(TINY + flags)


def test_launch_job_kills_the_job_when_a_process_fails(tmp_path):
  """Process 1 exits with 3 at once while process 0 would wait a minute: the launcher returns 3 within seconds,
  having killed process 0, and says so per process."""
  from benchmarks import launch_job  # pylint: disable=g-import-not-at-top
  prog = ("import sys, time; i = sys.argv[sys.argv.index('--process-id') + 1]; "
          "assert '--local-device-ids' in sys.argv; print('process', i, flush=True); "
          "sys.exit(3) if i == '1' else time.sleep(60)")
  t0 = time.monotonic()
  status = launch_job.run([sys.executable, "-c", prog], processes=2, limit_s=30, logs=str(tmp_path))
  assert status == 3 and time.monotonic() - t0 < 20
  assert (tmp_path / "process-1.log").read_text().strip() == "process 1"
  status = launch_job.run([sys.executable, "-c", "import time; time.sleep(60)"], processes=2, limit_s=1,
                          logs=str(tmp_path), local_ids=False)
  assert status == 124
