"""The resource benchmarks' own logic, without a GPU: the workload list, the regret / best-fixed-C summary and the
calibration fit."""

import json
import os

import pytest

from benchmarks import bench_resource
from benchmarks import calibrate
from jax_moe_overlap import resource as rm


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


# The fake gather_rs run: per rank C, its consumer moves the traffic the model counts at GATHER_GBPS[C] x RANK_SPEED[r]
# per CTA (rank 2 the median of the four: lb.median takes the upper middle).
GATHER_GBPS = {1: 20.0, 2: 15.0}
RANK_SPEED = (0.8, 1.5, 1.0, 0.9)  # (their mean is not the median)


def fake_gather_run(args):
  """The harness's RESULT lines of calibrate.measure_gather's run: each rank's plan (seg_rows [E_l, R] flattened,
  ranks holding different rows) and one timed variant per pinned C (and the manager's two, which it skips)."""
  arg = lambda name: int(args[args.index(name) + 1])  # noqa: E731
  R, TP, T, k, N = (arg(f) for f in ("--ranks", "--tensor", "--tokens", "--top-k", "--n-dim"))
  E_l = arg("--experts") // (R // TP)
  plans = [[(300 + 50 * r + 7 * i) for i in range(E_l * R)] for r in range(R)]
  traffic = [R * (T * N * 4 + T * k * TP * 4) + sum(plans[r]) * (N * 2 + 4) for r in range(R)]
  out = [dict(kind="plan", rank=r, ranks=R, budget=33, seg_rows=plans[r]) for r in range(R)]
  for c, ser in [(c, False) for c in GATHER_GBPS] + [(0, False), (0, True)]:
    spans = [traffic[r] * 1e-3 / (c * GATHER_GBPS[c] * RANK_SPEED[r]) if c else 1.0 for r in range(R)]
    out.append(dict(kind="timed", consumers=c, serialize=int(ser), median_us=max(spans) + 50.0, producer_span_us=900.0,
                    consumer_span_us=max(spans), rank_consumer_span_us=spans, chosen=[c or 16] * R))
  return {"results": out, "command": "fake " + " ".join(args), "stdout": ""}


def test_calibrate_gather_alone_merges_into_a_calibration(tmp_path, monkeypatch, capsys):
  """--only gather: the regret-gather suite's 2 x 2 bf16 case at HBM speed, C = 1 and 2 pinned, per-call spans; per
  rank the model's traffic (the plan's rows, counted by _jmo.model_gather_traffic_bytes) / span / C, the median over
  the ranks, the lower C value; printed, and with --merge-into written into the file, its other constants kept."""
  calls = []
  monkeypatch.setattr(calibrate.lb, "run", lambda args, timeout=300, log=None: calls.append(args) or fake_gather_run(
      [str(a) for a in args]))
  cal = tmp_path / "cal.json"
  with open(os.path.join(rm.CALIBRATION_DIR, "nvidia_h200.json")) as f:
    shipped = json.load(f)
  cal.write_text(json.dumps(shipped))
  calibrate.main(["--only", "gather", "--merge-into", str(cal), "--reps", "3"])
  args = [str(a) for a in calls[0]]
  assert len(calls) == 1 and "--per-call-stats" in args and "--serialize" not in args and "--link-gbps" not in args
  assert [args[args.index(f) + 1] for f in ("--ranks", "--tensor", "--tokens", "--k-dim", "--n-dim", "--experts",
                                            "--sweep-consumers")] == ["4", "2", "1024", "14336", "4096", "8", "1,2"]
  doc = json.loads(cal.read_text())
  assert doc["gather_gbps"] == pytest.approx(GATHER_GBPS[2]) and rm.load_params(str(cal)).gather_gbps == pytest.approx(
      GATHER_GBPS[2])
  assert {k: v for k, v in doc.items() if k not in ("gather_gbps", "gather_note", "raw")} == {
      k: v for k, v in shipped.items() if k not in ("gather_gbps", "raw")}
  assert {k: v for k, v in doc["raw"].items() if k != "gather_run"} == shipped["raw"]
  by_c = doc["raw"]["gather_run"]["by_c"]
  assert by_c["1"]["gbps_per_cta"] == pytest.approx(GATHER_GBPS[1])
  assert [x["gbps_per_cta"] for x in by_c["2"]["ranks"]] == pytest.approx([15.0 * s for s in RANK_SPEED])
  out = capsys.readouterr().out
  assert "gather_gbps 15.00 (the lower over C = 1, 2)" in out and f"wrote gather_gbps 15.00 into {cal}" in out
  with pytest.raises(SystemExit):  # --merge-into belongs to --only gather
    calibrate.main(["--merge-into", str(cal)])


def test_calibrate_end_to_end_on_a_fake_harness(tmp_path, monkeypatch):
  """calibrate.main against a fake loopback harness with known constants: the tile-time line, the push rate while the
  producer runs (what the model uses), the rate alone (kept in raw), the link ceiling and the per-segment cost come
  back out of the JSON it writes, and the dispatch_gemm pusher rate (the median over the ranks)."""
  tile_base, tile_per_k, alone, overlapped, seg_us, sms = 2.5, 0.011, 42.0, 30.0, 0.5, 132
  calls = []

  def arg(args, name):
    return int(args[args.index(name) + 1])

  def fake_run(args, timeout=300, log=None):
    args = [str(a) for a in args]
    calls.append(args)
    if "--gather-rs" in args:
      return fake_gather_run(args)
    if "--dispatch-gemm" in args:  # 8 pushers per rank moving 16 MB in 100, 125 and 120 us
      ranks = [dict(rank=r, pushers=8, bytes=16e6, push_us=us, gbps_per_pusher=16e6 / us * 1e-3 / 8)
               for r, us in enumerate((100.0, 125.0, 120.0))]
      return {"results": [dict(kind="dispatch_gemm_push", link_gbps=0.0, ranks=ranks)]}
    R, N, K, T = arg(args, "--ranks"), arg(args, "--n-dim"), arg(args, "--k-dim"), arg(args, "--tokens")
    if R == 1:  # tile time: every row local, all SMs produce
      tiles = -(-T * 2 // 8 // 128) * 8 * -(-N // 256)
      span = -(-tiles // sms) * (tile_base + tile_per_k * K)
      return {"results": [dict(kind="timed", consumers=0, producer_span_us=span, consumer_span_us=0.0)]}
    pushed = T * 2 * N * 2 * R  # every row to the other rank, both ranks
    cs = ([int(c) for c in args[args.index("--sweep-consumers") + 1].split(",")] if "--sweep-consumers" in args
          else [arg(args, "--consumers")])
    rows = []
    for c in cs:
      rate = (alone if "--serialize" in args else overlapped) * c * R  # GB/s of both ranks together
      span = pushed / rate * 1e-3
      if arg(args, "--experts") > 8 * R:  # the many-small-segments run adds seg_us per segment
        span += seg_us * arg(args, "--experts") / R
      rows.append(dict(kind="timed", consumers=c, producer_span_us=1.0, consumer_span_us=span, pushed_bytes=pushed))
    return {"results": rows}

  monkeypatch.setattr(calibrate.lb, "run", fake_run)
  monkeypatch.setattr(calibrate.lb, "device_info", lambda k, n: dict(
      kind="device", name="Fake GPU", sms=sms, tile_m=128, tile_n=256, producer="wgmma bf16", cc="9.0"))
  out = calibrate.main(["--out", str(tmp_path / "fake.json"), "--reps", "1"])
  with open(out) as f:
    doc = json.load(f)
  assert doc["tile_us_base"] == pytest.approx(tile_base) and doc["tile_us_per_k"] == pytest.approx(tile_per_k)
  assert doc["cta_gbps"] == pytest.approx(overlapped) and doc["raw"]["cta_gbps_alone"] == pytest.approx(alone)
  assert doc["link_gbps"] == pytest.approx(alone * 32 * 2)
  assert doc["seg_us"] == pytest.approx(seg_us)
  assert doc["pusher_gbps"] == pytest.approx(16e6 / 120.0 * 1e-3 / 8)
  assert doc["gather_gbps"] == pytest.approx(GATHER_GBPS[2]) and rm.load_params(out).gather_gbps == doc["gather_gbps"]
  overlap_runs = [a for a in calls if "--serialize" not in a and "--dispatch-gemm" not in a and "--gather-rs" not in a]
  assert len(overlap_runs) == 1 and arg(overlap_runs[0], "--k-dim") == 2048 and arg(overlap_runs[0], "--consumers") == 4


def test_bench_resource_writes_each_workload_as_it_finishes(tmp_path, monkeypatch):
  """bench_resource.main against a fake harness whose manager picks what the host model picks: every workload's
  row is in --out as soon as it is measured (a run stopped by a time limit keeps them), then the summary."""
  cal = os.path.join(rm.CALIBRATION_DIR, "nvidia_h200.json")
  R, cs = 2, [1, 2, 4]
  out = tmp_path / "resource.jsonl"
  seen = []

  def fake_run(args, timeout=300, log=None):
    args = [str(a) for a in args]
    E, N, K = (int(args[args.index(f) + 1]) for f in ("--experts", "--n-dim", "--k-dim"))
    # Every rank sends 100 rows to each expert of every rank.
    seg_rows = [100] * (E // R * R)
    p = bench_resource.model_for_ranks(rm.load_params(cal), R)
    p_rank = bench_resource.dataclasses.replace(p, sms=66, ctas_per_sm=1)
    chosen = [bench_resource.kernel_consumer_ctas(p_rank, bench_resource._grid(seg_rows, R), r, N, K, 2, 32)
              for r in range(R)]
    if seen:  # the rows of earlier workloads are already on disk while this one runs
      assert sum(1 for line in open(out) if json.loads(line)["kind"] == "workload") == len(seen)
    seen.append(E)
    timed = [dict(kind="timed", consumers=c, serialize=0, median_us=1000.0 + 10 * c, chosen=[c] * R) for c in cs]
    timed += [dict(kind="timed", consumers=0, serialize=0, median_us=1005.0, chosen=chosen),
              dict(kind="timed", consumers=0, serialize=1, median_us=1500.0, chosen=chosen)]
    plans = [dict(kind="plan", rank=r, ranks=R, budget=66, seg_rows=seg_rows) for r in range(R)]
    return {"results": timed + plans + [dict(kind="decision", table_ns=7000.0, decision_ns=2000.0, choice=chosen[0])]}

  monkeypatch.setattr(bench_resource.lb, "run", fake_run)
  monkeypatch.setattr(bench_resource.lb, "device_info", lambda *a: dict(
      kind="device", name="NVIDIA H200", sms=132, tile_m=128, tile_n=256, producer="wgmma bf16", cc="9.0"))
  rows, summary = bench_resource.main(["--calibration", cal, "--ranks", str(R), "--ctas", "1,2,4", "--quick",
                                       "--out", str(out)])
  lines = [json.loads(line) for line in open(out)]
  assert [r["kind"] for r in lines] == ["header"] + ["workload"] * 4 + ["summary"]
  assert len(rows) == 4 and all(r["mirror_agrees"] and r["oracle_c"] == 1 for r in rows)
  assert summary["mean_regret"] == pytest.approx(1005 / 1010 - 1)  # the manager beat the sampled C (it picked 3)
