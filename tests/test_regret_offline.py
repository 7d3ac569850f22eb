"""tools/loopback/regret_offline.py: it reads a run's REGRET lines, and with the constants the run used its host
mirror picks what the run's kernels picked (the committed H100 log of 2026-12-05, whose suites ran the H200's
constants), so that the picks of other constants can be judged against that run's pinned times."""

import os
import pathlib

import pytest

from tools.loopback import regret as regret_lib
from tools.loopback import regret_offline

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOG = ROOT / "benchmarks" / "results" / "2026-12-05-h100-calibration-and-regret.txt"
H200 = ROOT / "jax_moe_overlap" / "calibration" / "nvidia_h200.json"


def test_a_regret_line_is_read_whole():
  rows = regret_offline.read_log(
      "noise\nREGRET P model 2,3 (host mirror agrees) 623.4 us | best pinned P=3 599.4 us | regret 4.0% | pinned us "
      "1:918.8 2:619.7 3:599.4\nREGRET C model 1,1 (host mirror DIFFERS: 2,2) 520.4 us | best pinned C=12 490.2 us | "
      "regret 6.2% | pinned us 1:516.6 12:490.2\n")
  assert [(r.what, r.chosen, r.model_us, r.best, r.best_us) for r in rows] == [
      ("P", [2, 3], 623.4, 3, 599.4), ("C", [1, 1], 520.4, 12, 490.2)]
  assert rows[0].pinned_us == {1: 918.8, 2: 619.7, 3: 599.4}


def test_the_suites_own_lines_are_read():
  # The writer's format (regret.line, with the trailing fields it adds) read back: reader and writer cannot drift.
  row = {"what": "C", "chosen": [4, 3], "mirror": [4, 3], "mirror_agrees": True, "model_us": 315.8, "best": 4,
         "best_us": 314.0, "regret": 0.0057, "times_us": {"1": 601.9, "4": 314.0, "12": 339.8},
         "producer_start_us": {"model": 3.65, "pinned": 3.33}}
  for r in (row, {k: v for k, v in row.items() if k != "producer_start_us"}):
    [got] = regret_offline.read_log(regret_lib.line(r))
    assert (got.what, got.chosen, got.model_us, got.best, got.best_us) == ("C", [4, 3], 315.8, 4, 314.0)
    assert got.pinned_us == {1: 601.9, 4: 314.0, 12: 339.8}


def test_a_log_of_another_length_is_refused():
  with pytest.raises(ValueError, match="has 4 P cases but the log has 1 REGRET lines of them"):
    regret_offline.estimate("regret-push", regret_offline.read_log(
        "REGRET P model 2 (host mirror agrees) 1.0 us | best pinned P=2 1.0 us | regret 0.0% | pinned us 2:1.0"), 132)


def test_the_runs_constants_give_the_runs_picks(capsys):
  args = ["--suite", "regret-push", "--log", str(LOG), "--gpu", "NVIDIA H100 80GB HBM3", "--sms", "132",
          "--calibration", str(H200), "--check"]
  assert os.path.exists(LOG) and regret_offline.main(args) == 0
  out = capsys.readouterr().out
  assert "picks: the run's in every case" in out and "estimated regret" in out


@pytest.mark.slow  # the default pass keeps the regret-push run's picks and the readers' own checks
def test_a_suite_of_both_kinds_reads_each_kinds_lines(capsys):
  # regret-backward: the dgrad dispatch_gemm's P and the dx combine's C, their lines interleaved in the log as the
  # suite ran them (the committed 2026-12-07 run, whose constants are the library's H100 calibration).
  log = ROOT / "benchmarks" / "results" / "2026-12-07-scaled-dispatch-backward-regret.txt"
  args = ["--suite", "regret-backward", "--log", str(log), "--gpu", "NVIDIA H100 80GB HBM3", "--sms", "132", "--check"]
  assert regret_offline.main(args) == 0
  out = capsys.readouterr().out
  assert "picks: the run's in every case" in out and "over 10 of 12 cases" in out


@pytest.mark.slow  # the default pass keeps the regret-push run's picks and the readers' own checks
def test_gather_rs_lines_are_read_and_the_runs_constants_give_the_runs_picks(tmp_path, capsys):
  # regret-gather (the committed 2026-12-06 run of 3fed00a, its first pass: three bf16 cases under the H100's
  # calibration, then three float32 cases with the fixed C, which the constants do not decide and are left out).
  lines = (ROOT / "benchmarks" / "results" / "2026-12-06-producer-band-8.txt").read_text().splitlines()
  first = next(n for n, l in enumerate(lines) if l.startswith("REGRET C gather_rs model 5,5,5,5"))
  rows = regret_offline.read_log("\n".join(lines[first:first + 6]))
  assert [r.what for r in rows] == ["C gather_rs"] * 3 + ["C gather_rs (fixed policy)"] * 3
  assert (rows[1].chosen, rows[1].best, rows[1].best_us) == ([3, 4, 3, 3, 4, 3, 3, 3], 4, 6608.9)
  log = tmp_path / "gather.txt"
  log.write_text("\n".join(lines[first:first + 6]) + "\n")
  args = ["--suite", "regret-gather", "--log", str(log), "--gpu", "NVIDIA H100 80GB HBM3", "--sms", "132", "--check"]
  assert regret_offline.main(args) == 0
  out = capsys.readouterr().out
  assert "picks: the run's in every case" in out and "over 1 of 3 cases" in out


EXPERT_MAJOR_LOG = ROOT / "benchmarks" / "results" / "2026-12-06-expert-major-model.txt"


def _log_part(first: str, stop: str) -> str:
  """The committed 2026-12-06 log's lines from the one that starts with `first` to the one before `stop`."""
  lines = EXPERT_MAJOR_LOG.read_text().splitlines()
  i = next(n for n, l in enumerate(lines) if l.startswith(first))
  j = next(n for n in range(i + 1, len(lines)) if lines[n].startswith(stop))
  return "\n".join(lines[i:j]) + "\n"


@pytest.mark.parametrize("first,stop,picks_agree", [
    # call 2: the library's choice, in the expert-major producer's order where it goes so (the DeepSeek-like cases)
    ("## call 2", "### combine_time:", True),
    # call 1, the choice still in the table's order (the same kernels otherwise): the DeepSeek-like picks differ
    ("### regret_table:", "### combine_time:", False)])
def test_the_mirror_follows_the_expert_major_producer(tmp_path, capsys, first, stop, picks_agree):
  log = tmp_path / "regret.txt"
  log.write_text(_log_part(first, stop))
  args = ["--suite", "regret-combine", "--log", str(log), "--gpu", "NVIDIA H100 80GB HBM3", "--sms", "132", "--check"]
  assert regret_offline.main(args) == (0 if picks_agree else 1)
  out = capsys.readouterr().out
  if picks_agree:
    assert "picks: the run's in every case" in out
  else:  # exactly the three DeepSeek-like cases (64 experts), where the producer goes expert-major
    differ = out.split("picks other than the run's: ")[1]
    assert differ.count("E=64") == 3 and differ.count("R=") == 3
