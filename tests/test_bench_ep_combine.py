"""benchmarks.bench_ep_combine's dry run on 4 CPU devices: every implementation agrees with the float32 reference
and is timed, the oracle row is the fastest pinned C, the stats columns stay empty (the CPU handlers record no
spans), and the plan pushes about (R-1)/R of a balanced routing's rows to peers; the stats columns from CallStats."""

import functools
import json

import numpy as np
import pytest

from benchmarks import bench_ep_combine
from benchmarks import common
from jax_moe_overlap import workspace_cuda

STATS_COLUMNS = ("C", "prod_us", "cons_us", "overlap_us", "outside_us", "push_GBps")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
  out = tmp_path_factory.mktemp("ep_combine") / "ep_combine.jsonl"
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(common, "time_fn", functools.partial(common.time_fn, warmup=1, batches=2, per_batch=1))
    bench_ep_combine.main(["--quick", "--ctas", "4,8", "--out", str(out)])
  lines = [json.loads(l) for l in out.read_text().splitlines()]
  assert "command" in lines[0]["meta"]
  return {(r["skew"], r["impl"]): r for r in lines[1:]}


@pytest.mark.parametrize("skew", ["balanced", "stress"])
def test_every_impl_checked_and_timed(rows, skew):
  impls = [i for s, i in rows if s == skew]
  assert impls == ["ours", "serialized", "C=4", "C=8", "oracle", "bare gemm"]
  for impl in impls:
    r = rows[(skew, impl)]
    assert float(r["ms"]) > 0, r
    if impl != "oracle":
      assert float(r["err"]) < 2e-2, r
    assert all(r[c] == "" for c in STATS_COLUMNS if impl != "oracle"), r  # CPU: no spans
    assert "stats" not in r, r
  ours = float(rows[(skew, "ours")]["ms"])
  assert float(rows[(skew, "serialized")]["vs_ours"]) == pytest.approx(float(rows[(skew, "serialized")]["ms"]) / ours,
                                                                        abs=0.01)


@pytest.mark.parametrize("skew", ["balanced", "stress"])
def test_oracle_is_the_fastest_pinned_c(rows, skew):
  pinned = {c: float(rows[(skew, f"C={c}")]["ms"]) for c in (4, 8)}
  best = min(pinned, key=pinned.get)
  r = rows[(skew, "oracle")]
  assert r["C"] == str(best) and float(r["ms"]) == pinned[best], r


def test_balanced_routing_pushes_most_rows_to_peers(rows):
  r = rows[("balanced", "ours")]
  _, T, _, D, _, k = bench_ep_combine.QUICK_SHAPE
  pushed = np.array([float(v) for v in r["remote_MB"].split("/")]) * 1e6
  assert len(pushed) == 4
  np.testing.assert_allclose(pushed / (T * k * D * 2), 3 / 4, atol=0.1)   # (R-1)/R of each rank's rows
  assert float(r["wall_GBps"]) == pytest.approx(pushed.max() / float(r["ms"]) / 1e6, rel=0.01)


def test_remote_bytes_from_the_plan():
  class Plan:  # seg_rows [R, E_l, R_src]: rank 0 computes 3 + 1 rows of rank 1, rank 1 computes 2 rows of rank 0
    seg_rows = np.array([[[5, 3], [0, 1]], [[2, 4], [0, 0]]])
  np.testing.assert_array_equal(bench_ep_combine.remote_bytes(Plan, 10), [40, 20])


def test_stats_cells():
  raw = dict(consumers=8, pushed_bytes=40_000_000, producer_start_ns=1000, producer_end_ns=401000,
             consumer_start_ns=3000, consumer_end_ns=503000)
  stats = [workspace_cuda.call_stats(0, raw), workspace_cuda.call_stats(1, dict(raw, consumer_start_ns=2**64 - 1))]
  cells = bench_ep_combine.stats_cells(stats, wall_ms=0.6, remote=np.array([40_000_000, 5]))
  assert cells == dict(C="8/8", prod_us="400/400", cons_us="500/-", overlap_us="398/-", outside_us="98/200",
                       push_GBps="80/-", note="rank 1 pushed 40000000 B, plan 5 B")
  assert bench_ep_combine.stats_cells(None, 1.0, np.zeros(2)) == {}
