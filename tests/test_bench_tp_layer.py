"""benchmarks.bench_tp_layer's correctness check for the quick shape on 4 CPU devices (expert=2, tensor=2): every row
(overlap, serialized, collective, xla, and ep_only on a 1-D mesh of the 4) agrees with the float32 reference, forward
and forward+backward, before anything would be timed."""

import pytest

from benchmarks import bench_tp_layer

pytestmark = pytest.mark.slow  # ten layer programs and two references


def test_quick_shape_checks_every_row(tmp_path):
  table = bench_tp_layer.main(["--quick", "--devices", "4", "--check-only", "--out", str(tmp_path / "rows.jsonl")])
  got = {(r["pass"], r["impl"]): r for r in table.rows}
  assert set(got) == {(p, i) for p in ("fwd", "fwdbwd") for i in bench_tp_layer.IMPLS}
  for row in got.values():
    assert float(row["max_rel_err"]) < 1e-2, row
    assert (row["ep"], row["tp"]) == ((4, 1) if row["impl"] == "ep_only" else (2, 2)), row
  assert (tmp_path / "rows.jsonl").read_text().count("\n") == 1 + len(got)
