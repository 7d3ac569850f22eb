"""The command lines of the examples (examples/train_moe.py, examples/generate.py) and of benchmarks.launch_job, which
starts the training example as a job of several processes: what they accept, refuse and print, without training."""

import sys
import tempfile

import generate  # examples/generate.py (examples/ is on pytest's pythonpath)
import pytest
import train_moe  # examples/train_moe.py

from benchmarks import launch_job


def test_abbreviated_flags_are_refused():
  """--preset keeps the flags given by their full names; an abbreviation is an error, not a flag the preset then
  overrides."""
  for parse, argv in [(train_moe.parse_args, ["--preset", "gpu", "--batch", "4"]),
                      (train_moe.parse_args, ["--step", "5"]),
                      (generate.parse_args, ["--ckpt", "/tmp/x"])]:
    with pytest.raises(SystemExit) as e:
      parse(argv)
    assert e.value.code == 2, argv
  args = train_moe.parse_args(["--preset", "gpu", "--batch-size", "4", "--steps=5"])
  assert (args.batch_size, args.steps, args.d_model) == (4, 5, train_moe.PRESETS["gpu"]["d_model"])


@pytest.mark.parametrize("parse, says", [
    (train_moe.parse_args, ["(default: 10% of --steps)", "(default: one 'expert' axis over all devices)",
                            "model width (default: 64)"]),
    (generate.parse_args, ["(default: the latest)", "(default: the one the checkpoint was trained with)"]),
])
def test_help_states_each_default_once(parse, says, capsys):
  with pytest.raises(SystemExit) as e:
    parse(["--help"])
  assert e.value.code == 0
  text = " ".join(capsys.readouterr().out.split())
  assert "(default: None)" not in text and all(text.count(s) == 1 for s in says), text


def test_warmup_as_long_as_the_run_is_noted():
  """A warm-up of --steps or more never reaches the peak learning rate (step s of 0 .. steps - 1 trains at
  lr * s / warmup): the run says so in one line; a shorter one, and a run of no step, say nothing."""
  note = train_moe.warmup_note(train_moe.parse_args(["--steps", "5", "--warmup", "5"]))
  assert "never reaches its peak --lr 0.003" in note and "trains at 0.0024" in note, note
  assert train_moe.warmup_note(train_moe.parse_args(["--steps", "5", "--warmup", "4"])) is None
  assert train_moe.warmup_note(train_moe.parse_args(["--steps", "0"])) is None
  assert train_moe.warmup_note(train_moe.parse_args([])) is None          # 10% of the steps


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_launch_job_help_needs_no_command(flag, capsys):
  with pytest.raises(SystemExit) as e:
    launch_job.main([flag])
  assert e.value.code == 0
  assert "--processes" in capsys.readouterr().out
  with pytest.raises(SystemExit, match="the command follows '--'"):
    launch_job.main(["--processes", "2"])


def test_launch_job_logs_go_to_a_fresh_temporary_directory(tmp_path, monkeypatch, capsys):
  """Without --logs the processes' logs go to a new directory under the temporary directory, which is printed, not
  into the current directory (a repository's work tree); --logs DIR still takes DIR."""
  cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
  cwd.mkdir()
  tmp.mkdir()
  monkeypatch.chdir(cwd)
  monkeypatch.setattr(tempfile, "tempdir", str(tmp))
  command = ["--processes", "1", "--no-local-ids", "--", sys.executable, "-c", "print('hello')"]
  assert launch_job.main(command) == 0
  assert not list(cwd.iterdir())
  (logs,) = tmp.glob("launch_job-*")
  assert "hello" in (logs / "process-0.log").read_text()
  assert f"logs go to {logs}" in capsys.readouterr().out
  assert launch_job.main(["--logs", str(tmp_path / "mine")] + command) == 0
  assert "hello" in (tmp_path / "mine" / "process-0.log").read_text()
