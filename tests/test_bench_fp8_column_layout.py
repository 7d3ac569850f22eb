"""benchmarks/bench_fp8_column_layout.py: every variant of the FP8 wgrad operand preparation it times gives the shipped
path's bytes (the custom call's; it prints DIFF otherwise), on skewed groups with rows past the last group."""

from benchmarks import bench_fp8_column_layout as bench


def test_every_variant_equals_the_shipped_path(capsys):
  bench.main(M=700, G=5, rows=600, widths=(256,))
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("C ")]
  assert len(lines) == len(bench.VARIANTS) and all(l.endswith("same") for l in lines), lines
