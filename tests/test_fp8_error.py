"""benchmarks/fp8_error.py at one tiny shape: its table's structure, and the FP8 layer's error against float64 above
bfloat16's (the operands are quantized) and within the bound tests/test_fp8_layer.py holds the FP8 oracle to."""

import math

import jax
import pytest

from benchmarks import fp8_error
from benchmarks.references import FP8_ERROR_BOUND, FP8_ERROR_FLOOR


def test_table_of_one_tiny_shape(capsys):
  text = fp8_error.main(["--custom", "128,128,8,2", "--tokens", "64"])
  out = capsys.readouterr().out
  assert out.startswith("command: ") and f"jax {jax.__version__}" in out and out.rstrip().endswith(text)
  header, rule, *rows = text.splitlines()
  assert [c.strip() for c in header.strip("|").split("|")] == fp8_error.COLUMNS
  assert set(rule) == {"|", "-"}
  assert len(rows) == 1
  cells = [c.strip() for c in rows[0].strip("|").split("|")]
  assert cells[:6] == ["custom", "64", "128", "128", "8", "2"]
  for name, cell in zip(fp8_error.OUTPUTS, cells[6:], strict=True):
    fp8, bf16 = (float(v) for v in cell.split(" / "))
    assert math.isfinite(fp8) and math.isfinite(bf16), (name, cell)
    assert 0 < bf16 < fp8, (name, cell)             # quantized: FP8 errs more than bfloat16 rounding
    assert FP8_ERROR_FLOOR < fp8 < FP8_ERROR_BOUND, (name, cell)


def test_shapes_that_select_none_are_refused():
  with pytest.raises(SystemExit):
    fp8_error.main(["--shapes", "no-such-shape"])
