"""benchmarks/step_repeat.py on CPU: the example's gradients repeat bit for bit within a process and match another
process's digests; a digest that differs is named, and fewer than two repeats are refused."""

import json

import pytest

from benchmarks import step_repeat

pytestmark = pytest.mark.slow

TINY = ["--d-model", "128", "--d-ff", "128", "--layers", "2", "--quantization", "fp8"]


def test_repeats_agree_and_a_changed_digest_is_named(tmp_path, capsys):
  first = tmp_path / "first.json"
  out = step_repeat.main(["--repeats", "2", "--out", str(first), "--", *TINY])
  assert out["within"] == {} and out["between"] == []
  names = list(out["digests"])
  assert names[0] == "loss" and any("w1" in n for n in names) and any("embed" in n for n in names), names
  digests = json.loads(first.read_text())
  assert digests == out["digests"]
  changed = next(n for n in names if "w2" in n)
  digests[changed] = "0" * 16
  other = tmp_path / "other.json"
  other.write_text(json.dumps(digests))
  again = step_repeat.main(["--repeats", "2", "--against", str(other), "--", *TINY])
  assert again["within"] == {} and again["between"] == [changed]
  printed = capsys.readouterr().out
  assert f"{changed} " in printed and "differs from --against" in printed
  assert f"{len(names) - 1} of {len(names)} the same as" in printed


def test_fewer_than_two_repeats_are_refused():
  with pytest.raises(SystemExit, match="at least 2"):
    step_repeat.main(["--repeats", "1", "--", *TINY])


def test_first_difference_counts_and_sizes_the_change():
  import numpy as np  # pylint: disable=import-outside-toplevel
  a = np.array([1.0, 2.0, 4.0], np.float32)
  b = np.array([1.0, 2.5, 4.0], np.float32)
  assert step_repeat.first_difference(a, b) == "1 of 3 values differ, max rel 2.5e-01"


def test_repeat_differences_names_each_array_that_does_not_repeat():
  import numpy as np  # pylint: disable=import-outside-toplevel
  same = np.arange(4, dtype=np.float32)
  runs = [{"loss": np.float32(1.0), "w": same, "v": same}, {"loss": np.float32(1.0), "w": same, "v": same},
          {"loss": np.float32(1.0), "w": same, "v": same + np.float32([0, 0, 0, 1])}]
  assert step_repeat.repeat_differences(runs) == {"v": "1 of 4 values differ, max rel 3.3e-01"}
  assert step_repeat.repeat_differences(runs[:2]) == {}
