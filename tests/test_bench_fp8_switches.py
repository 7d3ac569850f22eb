"""benchmarks/bench_fp8_switches.py on a small shape on CPU: every setting times, each fp8 setting's outputs are the
all-off setting's bits (on CPUs every switch takes the custom calls: the settings differ only on GPUs) but for dh in
bfloat16 (a rounding the other settings do not have), the shipped switch values are restored, and the budget skips
what is left once spent."""

import json

import pytest

from benchmarks import bench_fp8_switches as bench

pytestmark = pytest.mark.slow


def _rows(path):
  with open(path) as f:
    return [json.loads(line) for line in f][1:]


def test_every_setting_times_and_restores_the_switches(monkeypatch, tmp_path):
  shipped = bench.shipped_switches()
  settings = ["bf16", "off", "fused", "fused+wq", "fused+wq+rq", "fused+wq+rq+pair", "fused+wq+rq+fq",
              "fused+wq+rq+pair+dh", "fused+wq+rq+dh", "fused+wq+rq+fq+dh"]
  monkeypatch.setattr(bench, "plan", lambda quick: [("tiny", 64, 256, 128, 4, 2, settings)])
  out = tmp_path / "sw.jsonl"
  bench.main(["--passes", "fwd+bwd", "--out", str(out)])
  rows = _rows(out)
  assert [r["setting"] for r in rows] == settings
  assert all(float(r["ms"]) > 0 for r in rows), rows
  assert [r.get("vs_off") for r in rows[2:7]] == ["bitwise"] * 5, rows
  assert all(r["vs_off"].startswith("max-rel") for r in rows[7:]), rows   # dh rounded to bfloat16
  assert bench.shipped_switches() == shipped
  assert shipped["DGRAD_IN_COMPUTE_DTYPE"] and shipped["FORWARD_QUANTIZES_DGRAD_WEIGHTS"]


def test_settings_selects_what_runs(monkeypatch, tmp_path):
  monkeypatch.setattr(bench, "plan", lambda quick: [("tiny", 64, 128, 128, 4, 2, ["bf16", "off", "fused", "wq"])])
  out = tmp_path / "sw.jsonl"
  bench.main(["--passes", "fwd", "--settings", "wq", "--out", str(out)])
  assert [r["setting"] for r in _rows(out)] == ["bf16", "off", "wq"]


def test_the_budget_skips_what_is_left(monkeypatch, tmp_path):
  monkeypatch.setattr(bench, "plan", lambda quick: [("tiny", 64, 128, 128, 4, 2, ["bf16", "off"])])
  out = tmp_path / "sw.jsonl"
  bench.main(["--passes", "fwd", "--budget", "1e-9", "--out", str(out)])
  assert [r["ms"] for r in _rows(out)] == ["skipped (budget spent)"] * 2
