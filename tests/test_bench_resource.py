"""The resource benchmarks' own logic, without a GPU: the workload list, the regret / best-fixed-C summary and the
calibration fit."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import bench_resource  # noqa: E402
import calibrate  # noqa: E402


def test_workloads_cover_the_seed_sweep():
  wls = bench_resource.workloads(quick=False)
  assert len(wls) >= 12
  assert {w["tokens"] for w in wls} == {8192, 16384} and {w["n"] for w in wls} == {4096, 8192}
  assert {w["skew"] for w in wls} == {"balanced", "moderate", "stress"}
  assert all(w["k"] == 2048 and w["top_k"] == 2 and 4 <= w["experts"] <= 64 for w in wls)
  assert len(set(map(lambda w: tuple(sorted(w.items())), wls))) == len(wls)


def test_summary_regret_and_best_fixed():
  rows = [dict(times_us={1: 10.0, 2: 8.0, 4: 9.0}, manager_us=8.0, regret=0.0, mirror_agrees=True),
          dict(times_us={1: 20.0, 2: 30.0, 4: 18.0}, manager_us=19.8, regret=0.1, mirror_agrees=True)]
  s = bench_resource.summarize(rows)
  assert s["best_fixed_c"] == 4  # totals: C=1 30, C=2 38, C=4 27
  assert s["speedup_vs_best_fixed_total"] == pytest.approx(27 / 27.8)
  assert s["mean_regret"] == pytest.approx(0.05) and s["worst_regret"] == pytest.approx(0.1)
  assert s["mirror_agrees"]


def test_grid_and_fit():
  assert bench_resource._grid([1, 2, 3, 4, 5, 6], 3) == [[1, 2, 3], [4, 5, 6]]
  base, slope = calibrate.fit_line([512, 1024, 2048], [1.5, 2.0, 3.0])
  assert base == pytest.approx(1.0) and slope == pytest.approx(1 / 1024)
