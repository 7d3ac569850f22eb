"""The examples: a short training run of a tiny MoE transformer on 4 CPU devices, overlap vs reference, checkpoint
resume, and generation from the checkpoint. The scripts run in this process (their main(argv)), so that runs of the
same model share compiled steps."""

import generate  # examples/generate.py (examples/ is on pytest's pythonpath, as a script's own folder is)
import numpy as np
import pytest
import train_moe  # examples/train_moe.py

STEPS = 30
TINY = ["--steps", str(STEPS), "--layers", "2", "--d-model", "64", "--heads", "4", "--d-ff", "128",
        "--experts", "8", "--top-k", "2", "--capacity-factor", "1.25", "--seq-len", "32", "--batch-size", "8",
        "--lr", "3e-3", "--eval-batches", "4", "--seed", "0", "--no-progress"]


@pytest.fixture(scope="module")
def overlap_run(tmp_path_factory):
  """The uninterrupted 30-step run with impl=overlap; it leaves a checkpoint of step 30 and a loss-curve PNG."""
  d = tmp_path_factory.mktemp("overlap")
  out = train_moe.main(TINY + ["--impl", "overlap", "--ckpt-dir", str(d / "ckpt"), "--plot", str(d / "loss.png")])
  return out, d


def test_loss_falls_clearly(overlap_run):
  out, d = overlap_run
  losses = np.asarray(out["losses"])
  assert losses.shape == (STEPS,) and np.all(np.isfinite(losses))
  assert abs(losses[0] - np.log(256)) < 0.5, losses[0]          # starts near uniform over bytes
  assert losses[-5:].mean() < 0.8 * losses[0], losses            # ~5.5 -> ~3.1 in 30 steps
  assert out["eval_loss"] < 0.8 * losses[0], out["eval_loss"]    # and on the held-out text
  dropped = np.asarray(out["dropped"])
  assert np.all((dropped >= 0) & (dropped < 0.5)), dropped
  png = (d / "loss.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.slow  # a second 30-step run; tests/test_moe.py compares the two layers call by call
def test_overlap_and_reference_train_the_same(overlap_run):
  out, _ = overlap_run
  ref = train_moe.main(TINY + ["--impl", "reference", "--plot", ""])
  # Same init, data and routing; only float32 summation order differs between the custom calls and plain JAX.
  np.testing.assert_allclose(ref["losses"], out["losses"], rtol=0, atol=2e-3)
  np.testing.assert_allclose(ref["dropped"], out["dropped"], rtol=0, atol=1e-2)
  np.testing.assert_allclose(ref["eval_loss"], out["eval_loss"], rtol=0, atol=2e-3)


def test_resume_continues_the_same_curve(overlap_run, tmp_path):
  out, _ = overlap_run
  ckpt = str(tmp_path / "ckpt")
  first = train_moe.main(TINY + ["--ckpt-dir", ckpt, "--stop-at", "15", "--plot", ""])
  assert len(first["losses"]) == 15
  with pytest.raises(SystemExit):     # an existing checkpoint is never silently overwritten or ignored
    train_moe.main(TINY + ["--ckpt-dir", ckpt, "--plot", ""])
  resumed = train_moe.main(TINY + ["--ckpt-dir", ckpt, "--resume", "--plot", ""])
  # The history of the first 15 steps comes from the checkpoint; steps 16..30 are recomputed after the restore.
  assert len(resumed["losses"]) == STEPS
  np.testing.assert_allclose(resumed["losses"], out["losses"], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(resumed["eval_loss"], out["eval_loss"], rtol=1e-6)


def test_generate_from_checkpoint(overlap_run, capsys):
  _, d = overlap_run
  ckpt = str(d / "ckpt")
  greedy = generate.main(["--ckpt-dir", ckpt, "--prompt", "the ", "--max-new-tokens", "16"])
  assert len(greedy) == 1 and len(greedy[0]) == 16
  samples = generate.main(["--ckpt-dir", ckpt, "--prompt", "the ", "--max-new-tokens", "32", "--temperature", "1",
                           "--num-samples", "3", "--seed", "1"])
  assert len(samples) == 3 and all(len(s) == 32 for s in samples)
  assert len(set(samples)) > 1                                   # sampling, not greedy
  # The restored model has learned the byte distribution of English text: an untrained one samples about uniformly
  # from 256 bytes (~37% of them printable ASCII); this one almost only printable ASCII.
  text = b"".join(samples)
  printable = sum(32 <= b < 127 or b in (9, 10) for b in text) / len(text)
  assert printable > 0.9, text
  assert "the " in capsys.readouterr().out


@pytest.mark.slow
def test_training_script_runs_as_a_program(tmp_path):
  """The README's first command goes through the script's own argument parsing (sys.argv), which the in-process
  tests above bypass: run it as a program, briefly, and check it trains and reports its throughput."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_moe.py")
  proc = subprocess.run([sys.executable, script, "--steps", "3", "--no-progress", "--skip-check", "--plot", ""],
                        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "throughput impl=overlap" in proc.stdout and "step 3: train loss" in proc.stdout, proc.stdout[-3000:]
