"""benchmarks/train_switch_ab.py on CPU: the runs interleave the two settings, each child sets the switch before
training (its own process), and the loss curves of a switch that CPUs ignore are the same bits in every run."""

import pytest

from benchmarks import train_switch_ab as ab

TINY = ["--d-model", "128", "--d-ff", "128", "--steps", "3", "--skip-check", "--no-progress", "--plot", "",
        "--quantization", "fp8"]


@pytest.mark.slow  # trains in child processes
def test_two_settings_interleaved_with_the_same_losses(capsys):
  out = ab.main(["--switch", "jax_moe_overlap.fp8_experts.ROW_QUANTIZED_COLUMNS_ON_GPU", "--rounds", "2", "--",
                 *TINY])
  assert [r["value"] for r in out["runs"]] == ["False", "True", "True", "False"]
  assert out["same_losses"], out["runs"]
  assert all(len(r["losses"]) == 3 and r["median_step_s"] > 0 for r in out["runs"]), out["runs"]
  assert "the same bits in every run" in capsys.readouterr().out


@pytest.mark.slow  # trains in child processes
def test_a_switch_the_module_lacks_fails_naming_it():
  with pytest.raises(RuntimeError, match="has no attribute NO_SUCH_SWITCH"):
    ab.main(["--switch", "jax_moe_overlap.fp8_experts.NO_SUCH_SWITCH", "--rounds", "1", "--", *TINY])


def test_malformed_values_are_refused_before_any_run():
  with pytest.raises(SystemExit, match="two settings"):
    ab.main(["--switch", "x.Y", "--values", "True", "--", *TINY])
  with pytest.raises(SystemExit, match="is not a Python literal"):
    ab.main(["--switch", "x.Y", "--values", "True,notaliteral(", "--", *TINY])


@pytest.mark.parametrize("curves, same, repeatable, word", [
    ({"False": [[1.0, 2.0], [1.0, 2.0]], "True": [[1.0, 2.0], [1.0, 2.0]]}, True, True, "the same bits in every run"),
    ({"False": [[1.0, 2.0], [1.0, 2.0]], "True": [[1.0, 2.5], [1.0, 2.5]]}, False, True, "DIFFERENT between"),
    ({"False": [[1.0, 2.0], [1.0, 2.1]], "True": [[1.0, 2.0], [1.0, 2.0]]}, False, False, "not deterministic"),
])
def test_the_verdict_tells_a_switch_from_a_step_that_does_not_repeat(curves, same, repeatable, word):
  runs = [{"value": v, "losses": c} for v, cs in curves.items() for c in cs]
  got = ab.compare_losses(runs)
  assert got[:2] == (same, repeatable) and word in got[2], got
