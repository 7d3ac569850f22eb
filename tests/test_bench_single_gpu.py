"""The single-GPU benchmarks' own checks run on CPU at tiny sizes, so they cannot rot between GPU sessions:
bench_fused's and bench_layer's implementations all agree with their float32 references (each row's err; a wrong
layer is not timed), bench_breakdown times every stage, and plot_results draws the PNGs from JSON lines and from the
key=value rows of a log cut short."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_breakdown  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import bench_fused  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import bench_layer  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import plot_results  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def _rows(path):
  with open(path) as f:
    return [r for r in map(json.loads, f) if "meta" not in r]


def test_bench_fused_checks_every_impl(tmp_path, monkeypatch):
  monkeypatch.setattr(bench_fused, "shapes", lambda quick: [("tiny", 64, 32, 48, 4, 2)])
  out = tmp_path / "fused.jsonl"
  monkeypatch.setattr(sys, "argv", ["bench_fused.py", "--out", str(out)])
  bench_fused.main()
  rows = _rows(out)
  impls = {r["impl"] for r in rows}
  assert {"ours", "serialized", "bare+combine", "bare gemm", "xla"} <= impls
  for r in rows:
    assert not r["ms"].startswith(("error", "wrong")), r
    if r["impl"] != "bare gemm":
      assert float(r["err"]) < 2e-2, r  # bf16 against the float32 reference


def test_bench_breakdown_times_every_stage(tmp_path, monkeypatch):
  out = tmp_path / "breakdown.jsonl"
  monkeypatch.setattr(sys, "argv", ["bench_breakdown.py", "--shapes", "64,32,32,4,2", "--out", str(out)])
  bench_breakdown.main()
  stages = {r["stage"]: float(r["ms"]) for r in _rows(out)}
  assert set(stages) == {"plan", "dispatch", "gemm1", "swiglu", "expert_combine", "layer"}
  assert all(ms > 0 for ms in stages.values())


def test_plot_results_from_jsonl_and_from_a_cut_log(tmp_path, monkeypatch):
  (tmp_path / "layer.jsonl").write_text(
      json.dumps({"meta": {}}) + "\n" +
      "\n".join(json.dumps(dict(shape="s", **{"pass": p}, impl=i, ms="1.0", vs_xla=v))
                for p in ("fwd", "fwd+bwd") for i, v in (("xla", "1.00"), ("ours", "2.50"))) + "\n")
  (tmp_path / "gemm.log").write_text(
      "noise\n  shape=seed T=8192 N=4096 E=8  skew=balanced  method=ours  ms=0.428  tflops=642  vs_dense=0.96\n")
  monkeypatch.setattr(sys, "argv", ["plot_results.py", str(tmp_path)])
  plot_results.main()
  assert (tmp_path / "layer_speedup.png").stat().st_size > 0
  assert (tmp_path / "grouped_gemm.png").stat().st_size > 0
  assert plot_results.read_rows(str(tmp_path), "gemm") == [
      dict(shape="seed T=8192 N=4096 E=8", skew="balanced", method="ours", ms="0.428", tflops="642",
           vs_dense="0.96")]


def _tiny_layer_shapes(quick, decode=False):
  del quick, decode
  return [("tiny", 64, 32, 48, 4, 2)]


def test_bench_layer_checks_every_impl_before_timing(tmp_path, monkeypatch):
  monkeypatch.setattr(bench_layer, "shapes", _tiny_layer_shapes)
  out = tmp_path / "layer.jsonl"
  monkeypatch.setattr(sys, "argv", ["bench_layer.py", "--out", str(out)])
  bench_layer.main()
  rows = _rows(out)
  assert {(r["pass"], r["impl"]) for r in rows} >= {(p, i) for p in ("fwd", "fwd+bwd") for i in ("xla", "ours")}
  for r in rows:
    assert float(r["ms"]) > 0 and float(r["err"]) < bench_layer.MAX_ERR, r  # bf16 against the float32 reference


def test_bench_layer_does_not_time_a_wrong_layer(tmp_path, monkeypatch):
  monkeypatch.setattr(bench_layer, "shapes", _tiny_layer_shapes)
  real = bench_layer.jmo.moe_experts
  monkeypatch.setattr(bench_layer.jmo, "moe_experts", lambda *a, **kw: (real(*a, **kw)[0] * 1.1, None))
  out = tmp_path / "layer.jsonl"
  monkeypatch.setattr(sys, "argv", ["bench_layer.py", "--passes", "fwd", "--out", str(out)])
  bench_layer.main()
  by_impl = {r["impl"]: r for r in _rows(out)}
  assert by_impl["ours"]["ms"] == "wrong result, not timed" and float(by_impl["ours"]["err"]) > 0.05, by_impl
  assert float(by_impl["xla"]["ms"]) > 0, by_impl
