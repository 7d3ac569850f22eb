"""benchmarks.bench_tp_layer's correctness check for the quick shape on 4 CPU devices (expert=2, tensor=2): every row
(overlap, gather_rs, serialized, collective, xla, and ep_only on a 1-D mesh of the 4) agrees with the float32 reference, forward
and forward+backward, before anything would be timed."""

import pytest

from benchmarks import bench_tp_layer

pytestmark = pytest.mark.slow  # twelve layer programs and two references


def test_quick_shape_checks_every_row(tmp_path):
  table = bench_tp_layer.main(["--quick", "--devices", "4", "--check-only", "--out", str(tmp_path / "rows.jsonl")])
  got = {(r["pass"], r["impl"]): r for r in table.rows}
  assert set(got) == {(p, i) for p in ("fwd", "fwdbwd") for i in bench_tp_layer.IMPLS}
  for row in got.values():
    assert float(row["max_rel_err"]) < 1e-2, row
    assert (row["ep"], row["tp"]) == ((4, 1) if row["impl"] == "ep_only" else (2, 2)), row
  assert (tmp_path / "rows.jsonl").read_text().count("\n") == 1 + len(got)


def test_the_gather_rs_row_runs_gather_rs_and_overlap_the_per_slot_return():
  # At the quick shape (top-2, bf16, TP = 2) the library's rule picks the per-slot return; the gather_rs row pins
  # GEMM2 + GatherRS, forward and backward: their programs hold those calls.
  two_d, one_d = bench_tp_layer.meshes(2, 2)
  _, T, D, F, E, k = bench_tp_layer.QUICK[0]
  tp_args, _, ct, _ = bench_tp_layer.operands(T, D, F, E, k, "balanced", 0, two_d, one_d)
  text = {impl: bench_tp_layer.layer(impl, two_d, "fwdbwd").lower(*tp_args, ct).as_text()
          for impl in ("overlap", "gather_rs")}
  assert text["gather_rs"].count("@jmo_gather_rs(") == 2 and "@jmo_gather_rs(" not in text["overlap"]
  assert "@jmo_expert_combine(" in text["overlap"]
