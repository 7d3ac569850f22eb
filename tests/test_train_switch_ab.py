"""benchmarks/train_switch_ab.py on CPU: the runs interleave the two settings, each child sets the switch before
training (its own process), and the loss curves of a switch that CPUs ignore are the same bits in every run."""

import pytest

from benchmarks import train_switch_ab as ab

pytestmark = pytest.mark.slow

TINY = ["--d-model", "128", "--d-ff", "128", "--steps", "3", "--skip-check", "--no-progress", "--plot", "",
        "--quantization", "fp8"]


def test_two_settings_interleaved_with_the_same_losses(capsys):
  out = ab.main(["--switch", "jax_moe_overlap.fp8_experts.ROW_QUANTIZED_COLUMNS_ON_GPU", "--rounds", "2", "--",
                 *TINY])
  assert [r["value"] for r in out["runs"]] == ["False", "True", "True", "False"]
  assert out["same_losses"], out["runs"]
  assert all(len(r["losses"]) == 3 and r["median_step_s"] > 0 for r in out["runs"]), out["runs"]
  assert "the same bits in every run" in capsys.readouterr().out


def test_a_switch_the_module_lacks_fails_naming_it():
  with pytest.raises(RuntimeError, match="has no attribute NO_SUCH_SWITCH"):
    ab.main(["--switch", "jax_moe_overlap.fp8_experts.NO_SUCH_SWITCH", "--rounds", "1", "--", *TINY])


def test_malformed_values_are_refused_before_any_run():
  with pytest.raises(SystemExit, match="two settings"):
    ab.main(["--switch", "x.Y", "--values", "True", "--", *TINY])
  with pytest.raises(SystemExit, match="is not a Python literal"):
    ab.main(["--switch", "x.Y", "--values", "True,notaliteral(", "--", *TINY])
