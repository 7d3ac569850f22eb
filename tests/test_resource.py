"""The analytical resource model as the extension exposes it (the C++ header the kernels use): its properties and
the recurrence it unrolls; the calibration loader and its fallback; and the per-call consumer options (consumer_ctas,
serialize)."""

import dataclasses
import glob
import json
import math
import os
import random
import types

import jax
import numpy as np
import pytest

import jax_moe_overlap as jmo
from benchmarks import bench_resource
from jax_moe_overlap import _jmo
from jax_moe_overlap import resource as rm
from jax_moe_overlap.call_site import RankInfo
from jax_moe_overlap.config import CallConfig
from jax_moe_overlap.workspace_backend import DeviceFacts
from cases import layer_inputs, mesh_of

# Shapes of an H200-like device; the constants only need to be plausible for these properties to be tested.
P = rm.ModelParams(sms=132, ctas_per_sm=1, tile_m=128, tile_n=128, tile_us_base=1.0, tile_us_per_k=0.002,
                   cta_gbps=12.0, link_gbps=370.0, seg_us=1.0)


def makespan(p, segs, n, k, eb, c):
  """The modelled time of one call with C = c consumer CTAs; segs: [(rows, remote)] in producer order. Negative
  where c is infeasible."""
  return _jmo.model_makespan_us(p.native(), segs, n, k, eb, c)


def choose(p, segs, n, k, eb, max_ctas=32):
  return _jmo.model_choose_consumer_ctas(p.native(), segs, n, k, eb, max_ctas)


def recurrence(p, segs, n, k, eb, c):
  """The sequential recurrence of resource_model.h's comment, in plain floats."""
  producers = (p.sms - c) * p.ctas_per_sm
  tile_us = p.tile_us_base + p.tile_us_per_k * k
  rate = min(c * p.cta_gbps, p.link_gbps)
  cum, cons = 0, 0.0
  for rows, remote in segs:
    if rows <= 0:
      continue
    cum += math.ceil(rows / p.tile_m) * math.ceil(n / p.tile_n)
    if remote:
      cons = max(cons, math.ceil(cum / producers) * tile_us) + p.seg_us + rows * n * eb / rate * 1e-3
  return max(math.ceil(cum / producers) * tile_us, cons)


def test_model_equals_the_recurrence_on_random_inputs():
  # The evaluated max-over-segments form equals the sequential recurrence, and the choice is the feasible C with the
  # smallest makespan (the smallest C on ties).
  rng = random.Random(0)
  for _ in range(200):
    p = dataclasses.replace(P, sms=rng.choice([16, 108, 132]), ctas_per_sm=rng.choice([1, 2]),
                            tile_m=rng.choice([64, 128]), tile_n=rng.choice([128, 256]),
                            tile_us_base=rng.uniform(0.2, 3), tile_us_per_k=rng.uniform(1e-4, 5e-3),
                            cta_gbps=rng.uniform(2, 30), link_gbps=rng.uniform(50, 450), seg_us=rng.uniform(0, 3))
    segs = [(rng.choice([0, 1, 63, 64, 65, 500, 2048]), int(rng.random() < 0.7)) for _ in range(rng.randint(1, 24))]
    n, k, eb = rng.choice([1024, 4096, 7168]), rng.choice([512, 2048, 14336]), rng.choice([2, 4])
    for c in (1, 2, 7, rng.randint(1, p.sms - 1), min(32, p.sms - 1)):
      assert makespan(p, segs, n, k, eb, c) == pytest.approx(recurrence(p, segs, n, k, eb, c), rel=1e-12)
    max_ctas = rng.choice([1, 5, 32, 200])
    times = [makespan(p, segs, n, k, eb, c) for c in range(1, min(max_ctas, p.sms - 1) + 1)]
    assert choose(p, segs, n, k, eb, max_ctas) == 1 + times.index(min(times))


def test_choice_on_near_ties_is_the_smallest_c():
  # Many candidates share a makespan when the producer dominates (wave quantization) or the link caps the rate.
  p = dataclasses.replace(P, cta_gbps=500.0, link_gbps=400.0, seg_us=0.0)
  rng = random.Random(1)
  for _ in range(100):
    segs = [(rng.choice([64, 128, 640]), 1) for _ in range(rng.randint(1, 8))]
    for n, k in ((128, 64), (4096, 2048), (8192, 16384)):
      c = choose(p, segs, n, k, 2)
      best = makespan(p, segs, n, k, 2, c)
      assert all(makespan(p, segs, n, k, 2, d) > best for d in range(1, c))
      assert all(makespan(p, segs, n, k, 2, d) >= best for d in range(c, 32))


def test_wave_boundaries():
  # One column tile per row band, 128-row tiles: P = sms - C producer CTAs.
  p = dataclasses.replace(P, tile_n=4096, seg_us=0.0)
  c = 4
  producers = p.sms - c
  t = p.tile_us_base + p.tile_us_per_k * 1024
  assert makespan(p, [(128 * producers, 0)], 4096, 1024, 2, c) == pytest.approx(t)
  assert makespan(p, [(128 * producers + 1, 0)], 4096, 1024, 2, c) == pytest.approx(2 * t)


def test_monotone_in_load():
  base = [(512, 1), (256, 1), (128, 0)]
  more = [(1024, 1), (256, 1), (128, 0)]
  for c in (1, 4, 16):
    assert makespan(P, more, 4096, 2048, 2, c) >= makespan(P, base, 4096, 2048, 2, c)


def test_coupling_consumer_waits_for_the_last_tile():
  # A single remote segment: its push can start only when the producer is done with it, so the makespan is the
  # production time plus the whole push, not the larger of the two.
  p = dataclasses.replace(P, seg_us=0.0)
  n, k, c = 4096, 2048, 8
  produce = makespan(p, [(4096, 0)], n, k, 2, c)
  push = 4096 * n * 2 / min(c * p.cta_gbps, p.link_gbps) * 1e-3
  assert makespan(p, [(4096, 1)], n, k, 2, c) == pytest.approx(produce + p.seg_us + push)


def test_no_remote_tiles_needs_one_consumer_cta():
  assert choose(P, [(2048, 0), (1024, 0)], 4096, 2048, 2) == 1


def test_communication_heavy_picks_more_ctas_than_compute_heavy():
  segs = [(256, 1)] * 32
  c_comm = choose(P, segs, 8192, 256, 2)       # small K: cheap tiles, many bytes
  c_comp = choose(P, segs, 1024, 16384, 2)
  assert c_comm > c_comp >= 1


def test_no_rows_at_all():
  assert makespan(P, [], 4096, 2048, 2, 3) == 0.0
  assert choose(P, [], 4096, 2048, 2) == 1
  assert choose(P, [(0, 1)], 4096, 2048, 2) == 1


def test_two_sms_leave_one_candidate():
  p = dataclasses.replace(P, sms=2)
  segs = [(4096, 1)] * 4
  assert choose(p, segs, 8192, 64, 2) == 1
  assert makespan(p, segs, 8192, 64, 2, 1) > 0 and makespan(p, segs, 8192, 64, 2, 2) < 0  # C = 2 leaves no producer


def test_more_consumers_never_slow_the_push_until_the_link():
  # With the producer out of the way (tiny tiles), the makespan falls as C grows, until C * cta_gbps reaches the link.
  p = dataclasses.replace(P, tile_us_base=1e-6, tile_us_per_k=0.0, seg_us=0.0)
  segs = [(2048, 1)] * 8
  times = [makespan(p, segs, 4096, 64, 2, c) for c in range(1, 40)]
  knee = int(p.link_gbps // p.cta_gbps)
  assert all(a > b for a, b in zip(times[:knee - 1], times[1:knee]))
  assert choose(p, segs, 4096, 64, 2) == min(32, knee + 1)


def test_device_segments_order():
  # seg_rows [E_local=2, R=3] of rank 1: remote sources first, the most loaded destination first, own (1) last.
  segs = bench_resource.device_segments([[5, 7, 0], [1, 2, 30]], rank=1)
  assert segs == [(30, 1), (5, 1), (1, 1), (7, 0), (2, 0)]  # own rows are stored in place, not pushed
  assert bench_resource.device_segment_sources([[5, 7, 0], [1, 2, 30]], rank=1) == [(30, 2), (5, 0), (1, 0), (7, 1),
                                                                                   (2, 1)]


def test_expert_major_segments_and_terms():
  # seg_rows [E_local=2, R=3] of rank 1 in the expert-major producer's order: the table's segments by expert, stably;
  # an expert's first segment carries the expert's rows (its rows tiled as one range), the others none.
  grid = [[5, 7, 0], [1, 2, 30]]
  segs, tile_rows = bench_resource.device_segments_expert_major(grid, rank=1)
  assert segs == [(5, 1), (7, 0), (30, 1), (1, 1), (2, 0)] and tile_rows == [12, 0, 33, 0, 0]
  # The terms: every segment of an expert ready once the expert's tiles are (the recurrence with tiles counted at
  # tile_rows), on random inputs.
  rng = random.Random(1)
  for _ in range(100):
    p = dataclasses.replace(P, sms=rng.choice([16, 66, 132]), tile_m=rng.choice([64, 128]),
                            tile_us_base=rng.uniform(0.2, 3), tile_us_per_k=rng.uniform(1e-4, 5e-3),
                            cta_gbps=rng.uniform(2, 30), seg_us=rng.uniform(0, 3))
    E, R, rank = rng.randint(1, 8), rng.randint(2, 4), 0
    grid = [[rng.choice([0, 1, 100, 129, 600]) for _ in range(R)] for _ in range(E)]
    segs, tile_rows = bench_resource.device_segments_expert_major(grid, rank)
    if not segs:
      continue
    n, k, eb, c = 2048, 2048, 2, rng.randint(1, min(32, p.sms - 1))
    producers, tile_us = p.sms - c, p.tile_us_base + p.tile_us_per_k * k
    cum, cons = 0, 0.0
    for (rows, remote), tr in zip(segs, tile_rows):
      cum += math.ceil(tr / p.tile_m) * math.ceil(n / p.tile_n)
      if remote:
        cons = max(cons, math.ceil(cum / producers) * tile_us) + p.seg_us + rows * n * eb / min(
            c * p.cta_gbps, p.link_gbps) * 1e-3
    want = max(math.ceil(cum / producers) * tile_us, cons)
    assert _jmo.model_makespan_us(p.native(), segs, n, k, eb, c, tile_rows) == pytest.approx(want, rel=1e-12)
    assert bench_resource.kernel_consumer_ctas(p, grid, rank, n, k, eb, 32, expert_major=True) == (
        _jmo.model_choose_consumer_ctas(p.native(), segs, n, k, eb, 32, tile_rows) if any(r for _, r in segs) else 0)
  with pytest.raises(ValueError, match="one entry per segment"):
    _jmo.model_makespan_us(P.native(), [(10, 1), (20, 0)], n, k, eb, 2, [10])


def test_kernel_consumer_ctas_is_zero_without_remote_rows():
  # EP = 1 (one source), or a rank whose every routed row is its own: nothing to push, so no consumer CTA.
  kernel_consumer_ctas = bench_resource.kernel_consumer_ctas
  assert kernel_consumer_ctas(P, [[100], [7]], 0, 4096, 2048, 2, 32) == 0
  assert kernel_consumer_ctas(P, [[0, 9], [0, 4]], 1, 4096, 2048, 2, 32, pinned=5) == 0
  assert kernel_consumer_ctas(P, [[3, 9], [0, 4]], 1, 4096, 2048, 2, 32, pinned=5) == 5
  grid = [[300, 9000], [2000, 40]]
  assert kernel_consumer_ctas(P, grid, 1, 4096, 2048, 2, 32) == choose(
      P, bench_resource.device_segments(grid, 1), 4096, 2048, 2, 32)


def test_single_segment_and_infeasible_counts():
  segs = [(100, 1)]
  assert 1 <= choose(P, segs, 4096, 2048, 2) <= 32
  assert makespan(P, segs, 4096, 2048, 2, 131) > 0
  assert makespan(P, segs, 4096, 2048, 2, 132) < 0  # C in [1, sms - 1]: infeasible is reported as negative
  assert makespan(P, segs, 4096, 2048, 2, 0) < 0


# ---------------------------------------------------------------------------------------------------------------
# Calibration files


def _write(tmp_path, name, **over):
  data = dict(dataclasses.asdict(dataclasses.replace(P, tile_m=64)), gpu_name="Test GPU", note="provenance")
  data.update(over)
  path = tmp_path / name
  path.write_text(json.dumps(data))
  return path


def test_calibration_file_name():
  assert rm.calibration_file_name("NVIDIA H200") == "nvidia_h200.json"
  assert rm.calibration_file_name("NVIDIA A100-SXM4-80GB") == "nvidia_a100_sxm4_80gb.json"


def test_calibration_found_and_used(tmp_path, monkeypatch):
  monkeypatch.delenv("JMO_CALIBRATION", raising=False)
  _write(tmp_path, "test_gpu.json")
  cal = rm.calibration_for("Test GPU", 132, directory=str(tmp_path), tile_m=64, tile_n=128)
  assert cal.params == dataclasses.replace(P, tile_m=64)
  assert "resource model from" in cal.reason and cal.source.endswith("test_gpu.json")


@pytest.mark.parametrize("case,over,sms,want", [
    ("missing", None, 132, r"no resource-model calibration for GPU 'Test GPU'"),
    ("other sms", {}, 108, r"measured on 132 SMs but GPU 'Test GPU' has 108"),
    ("tile shape", {"tile_n": 256}, 132, r"describes 64x256 tiles but the kernels use 64x128"),
    ("negative rate", {"cta_gbps": -1.0}, 132, r"unusable .*cta_gbps must be finite and > 0"),
    ("lacks a key", {"seg_us": None}, 132, r"unusable"),
])
def test_calibration_fallback(tmp_path, monkeypatch, case, over, sms, want):
  monkeypatch.delenv("JMO_CALIBRATION", raising=False)
  if over is not None:
    path = _write(tmp_path, "test_gpu.json", **over)
    if case == "lacks a key":
      data = json.loads(path.read_text())
      del data["seg_us"]
      path.write_text(json.dumps(data))
  cal = rm.calibration_for("Test GPU", sms, directory=str(tmp_path), tile_m=64, tile_n=128)
  assert cal.params is None
  assert __import__("re").search(want, cal.reason), cal.reason
  assert f"fixed consumer CTAs C = {max(1, sms // 8)}" in cal.reason


def test_calibration_env_override(tmp_path, monkeypatch):
  path = _write(tmp_path, "anything.json")
  monkeypatch.setenv("JMO_CALIBRATION", str(path))
  assert rm.calibration_for("Other GPU", 132, directory="/nonexistent").params is not None
  monkeypatch.setenv("JMO_CALIBRATION", "none")
  cal = rm.calibration_for("Test GPU", 132, directory=str(tmp_path))
  assert cal.params is None and "disabled" in cal.reason


def test_the_calls_link_lowers_the_ceiling_only():
  # ModelWithLink: the lower of the calibrated ceiling and the call's link; no link (0) or a faster one changes nothing.
  for link, want in ((0.0, 370.0), (1000.0, 370.0), (46.25, 46.25)):
    assert _jmo.model_with_link(P.native(), link).link_gbps == want
  # With a slow link the consumer choice stops where C * cta_gbps reaches it (12 GB/s per CTA, 30 GB/s: C <= 3), and
  # a slower link never asks for more consumers.
  segs = [(2048, 1)] * 8 + [(4096, 0)]
  slow = dataclasses.replace(P, link_gbps=_jmo.model_with_link(P.native(), 30.0).link_gbps)
  assert choose(slow, segs, 4096, 256, 2) <= 3 <= choose(P, segs, 4096, 256, 2)
  picks = [choose(dataclasses.replace(P, link_gbps=g), segs, 4096, 256, 2) for g in (10, 20, 40, 80, 160, 370)]
  assert picks == sorted(picks)


# ---------------------------------------------------------------------------------------------------------------
# dispatch_gemm's pushing CTAs P (resource_model.h PushersMakespanUs, ChooseDispatchPushers)

PP = dataclasses.replace(P, tile_n=256, pusher_gbps=17.3)


def pushers_us(p, push_bytes, rows, k, n, q, round_rows=0, rounds=0):
  return _jmo.model_pushers_makespan_us(p.native(), push_bytes, rows, k, n, round_rows, q, rounds)


def choose_pushers(p, push_bytes, rows, k, n, max_pushers=32, round_rows=0, rounds=0):
  return _jmo.model_choose_dispatch_pushers(p.native(), push_bytes, rows, k, n, round_rows, max_pushers, rounds)


def pushers_formula(p, push_bytes, rows, k, n, q, round_rows=0, rounds=0):
  """resource_model.h's dispatch model in plain Python floats (the same IEEE operations in the same order)."""
  t = p.tile_us_base + p.tile_us_per_k * k
  tiles = float(math.ceil(rows / p.tile_m) * math.ceil(n / p.tile_n)) if rows > 0 else 0.0
  push = p.seg_us + push_bytes * (1e-3 / min(q * p.pusher_gbps, p.link_gbps)) if push_bytes > 0 else 0.0
  work = math.ceil((tiles + q * push / t) / p.sms) * t
  if push_bytes <= 0:
    return work
  round_tiles = math.ceil(round_rows / p.tile_m) * math.ceil(n / p.tile_n) if round_rows > 0 else 0
  ready = push + max(1, -(-round_tiles // p.sms)) * t
  one_round = (push + -p.seg_us) / rounds if rounds > 0 else 0.0
  return max(work, ready) + max(one_round + -t, 0.0)


def test_pushers_model_equals_its_formula_on_random_inputs():
  # Bitwise: the extension's C++ (the device's code) and the formula; the choice is the feasible P with the smallest
  # time, the smallest P on ties.
  rng = random.Random(1)
  for _ in range(300):
    p = dataclasses.replace(PP, sms=rng.choice([2, 3, 16, 33, 66, 132]), link_gbps=rng.choice([20.0, 46.25, 185.0,
                            1745.0]), pusher_gbps=rng.choice([5.0, 17.3, 41.0]))
    rows = rng.randrange(0, 200000)
    push = rng.randrange(0, rows + 1) * rng.choice([256, 4096])
    k, n = rng.choice([256, 2048, 7168]), rng.choice([256, 4096, 28672])
    per_round = rng.choice([0, 1, 128, 896, 4096, rows // 4])
    rounds = rng.choice([0, 1, 4, 5, 16, 64])
    us = [pushers_us(p, push, rows, k, n, q, per_round, rounds) for q in range(1, min(32, p.sms - 1) + 1)]
    assert us == [pushers_formula(p, push, rows, k, n, q, per_round, rounds) for q in range(1, len(us) + 1)]
    assert choose_pushers(p, push, rows, k, n, round_rows=per_round, rounds=rounds) == 1 + us.index(min(us))
  assert pushers_us(PP, 1 << 20, 4096, 2048, 4096, 0) < 0 and pushers_us(PP, 1 << 20, 4096, 2048, 4096, 132) < 0


def test_pushers_without_a_rate_or_without_rows():
  # No pusher rate: no choice (0: the launch keeps DefaultPushers). Nothing to push (EP = 1): one pusher, the fewest.
  assert choose_pushers(dataclasses.replace(PP, pusher_gbps=0.0), 1 << 24, 8192, 2048, 4096) == 0
  assert choose_pushers(PP, 0, 8192, 2048, 4096) == 1


def test_pushers_link_limited_stop_at_the_link():
  # A tiny GEMM: the transfer is everything, so P grows until P * pusher_gbps reaches the link and no further (more
  # pushers would only take SMs from the GEMM).
  for link in (46.25, 92.5, 185.0, 370.0):
    p = dataclasses.replace(PP, link_gbps=link)
    want = math.ceil(link / p.pusher_gbps)
    assert choose_pushers(p, 64 << 20, 128, 256, 256) == min(want, 32)


def test_pushers_compute_limited_take_one():
  # A GEMM far longer than the transfer even at one pusher: one pusher (the others all multiply).
  assert choose_pushers(PP, 16 << 20, 65536, 7168, 28672) == 1


def test_pushers_grow_with_the_rows_to_push_and_shrink_with_the_gemm():
  by_bytes = [choose_pushers(PP, mib << 20, 8192, 2048, 4096) for mib in (1, 4, 16, 64, 256)]
  assert by_bytes == sorted(by_bytes) and by_bytes[0] < by_bytes[-1]
  by_k = [choose_pushers(PP, 32 << 20, 8192, k, 4096) for k in (256, 1024, 4096, 16384)]
  assert by_k == sorted(by_k, reverse=True) and by_k[0] > by_k[-1]
  # and never more than the link can use
  assert all(q <= math.ceil(PP.link_gbps / PP.pusher_gbps) for q in by_bytes + by_k)


def test_pushers_grow_when_the_last_round_is_a_large_share():
  # The GEMM's tiles of the last push round start only once the push is over: with few rounds (EP = 8, 2048 tokens
  # per rank: 4 rounds of 896 rows) one pusher that the transfer's total alone would allow leaves that round's tiles
  # for the end, so the model takes more; with many rounds (a small last round) the choice is the old one. (The
  # shipped H200 calibration's tile times, on an eighth of the GPU.)
  p = dataclasses.replace(PP, sms=16, link_gbps=46.25, pusher_gbps=21.3, tile_us_base=2.395, tile_us_per_k=0.0108,
                          seg_us=0.43)
  push, rows = 3584 * 4096, 4147
  assert choose_pushers(p, push, rows, 2048, 4096, round_rows=128) == 1
  many = choose_pushers(p, push, rows, 2048, 4096, round_rows=896)
  assert 1 < many <= math.ceil(p.link_gbps / p.pusher_gbps)
  tails = [choose_pushers(p, push, rows, 2048, 4096, round_rows=r) for r in (0, 128, 512, 896, 1792)]
  assert tails == sorted(tails)


def test_pushers_cover_a_round_longer_than_a_tile():
  # The remote tiles trail the arrivals by a round: a round's push beyond one tile time is added (lag). EP = 8 at 2048
  # tokens per rank (the loopback's R = 8 case on the shipped H200 calibration: 16 SMs, 46.25 GB/s; the ranks whose
  # rows to a destination straddle five 128-row blocks: 5 rounds of 717 rows, where the last-round term alone keeps
  # P = 1): one pusher's round is ~6 tile times, so the lag takes P above 1, never past the link's rate; with many
  # rounds (EP = 2 at 4096 tokens: 32 rounds of 128 rows) a round is under a tile and the choice is the one without it.
  p = dataclasses.replace(PP, sms=16, link_gbps=46.25, pusher_gbps=21.3, tile_us_base=2.395, tile_us_per_k=0.0108,
                          seg_us=0.43)
  push, rows = 3584 * 4096, 4147
  without = choose_pushers(p, push, rows, 2048, 4096, round_rows=717)
  lagged = choose_pushers(p, push, rows, 2048, 4096, round_rows=717, rounds=5)
  assert without == 1 < lagged <= math.ceil(p.link_gbps / p.pusher_gbps)
  t = p.tile_us_base + p.tile_us_per_k * 2048
  for q in (1, 2, 3):
    lag = pushers_us(p, push, rows, 2048, 4096, q, 717, 5) - pushers_us(p, push, rows, 2048, 4096, q, 717)
    one_round = push * (1e-3 / min(q * p.pusher_gbps, p.link_gbps)) / 5
    assert lag == pytest.approx(max(one_round - t, 0.0), rel=1e-9)
  p2 = dataclasses.replace(p, sms=66, link_gbps=185.0)
  assert choose_pushers(p2, 4096 * 4096, 8220, 2048, 4096, round_rows=128, rounds=32) == choose_pushers(
      p2, 4096 * 4096, 8220, 2048, 4096, round_rows=128)


def test_pushers_from_a_plan_count_the_rounds_of_the_largest_destination():
  # PusherInputsFromPlan (the kernel's inputs): rank 1 of 3 sends positions [0, 300) to rank 0, [300, 310) to itself
  # and [310, 700) to rank 2: 690 rows pushed; rank 0's rows take blocks 0-2 (3 rounds), rank 2's blocks 2-5 (4
  # rounds), so a round holds ceil(690 / 4) = 173 rows.
  p = dataclasses.replace(PP, sms=16, link_gbps=46.25, pusher_gbps=21.3)
  send_start = [0, 300, 310, 700]
  got = _jmo.model_choose_dispatch_pushers_for_plan(p.native(), send_start, 1, 900, 4096, 2048, 4096, 32)
  assert got == choose_pushers(p, 690 * 4096, 900, 2048, 4096, round_rows=173, rounds=4)
  with pytest.raises(ValueError, match="send_start"):
    _jmo.model_choose_dispatch_pushers_for_plan(p.native(), send_start, 3, 900, 4096, 2048, 4096, 32)


# ---------------------------------------------------------------------------------------------------------------
# gather_rs's consumer CTAs C (resource_model.h GatherModelSources, GatherMakespanFromSources)

PG = dataclasses.replace(P, tile_n=256, cta_gbps=29.6, link_gbps=92.5, seg_us=0.43)


def gather_us(p, segs, rank, R, T, Q, n, k, eb, c):
  return _jmo.model_gather_makespan_us(p.native(), segs, rank, R, T, Q, n, k, eb, c)


def choose_gather(p, segs, rank, R, T, Q, n, k, eb, max_ctas=32):
  return _jmo.model_choose_gather_consumer_ctas(p.native(), segs, rank, R, T, Q, n, k, eb, max_ctas)


def gather_recurrence(p, segs, rank, R, T, Q, n, k, eb, c):
  """gather_rs's model as resource_model.h's comment states it, in plain floats: the consumer's order
  (gather_consumer.cuh OrderGatherSources: the sources with no row here by index, then the others in producer
  order) and the forward recurrence c_s = max(c_{s-1}, r_s) + d_s."""
  producers = (p.sms - c) * p.ctas_per_sm
  tile_us = p.tile_us_base + p.tile_us_per_k * k
  cum, rows, last, with_rows = 0, {}, {}, []
  for r, s in segs:
    if r <= 0:
      continue
    cum += math.ceil(r / p.tile_m) * math.ceil(n / p.tile_n)
    if s not in rows:
      with_rows.append(s)
      rows[s] = 0
    rows[s] += r
    last[s] = cum
  rate = p.gather_gbps if p.gather_gbps > 0 else 2 * p.cta_gbps  # one consumer CTA's traffic per ns
  cons = 0.0
  for s in [s for s in range(R) if s not in rows] + with_rows:
    ready = math.ceil(last.get(s, 0) / producers) * tile_us
    traffic = T * n * 4 + T * Q * 4 + rows.get(s, 0) * (n * eb + 4)
    link = T * n * 4 if s != rank else 0
    cons = max(cons, ready) + p.seg_us + max(traffic * 1e-3 / (c * rate), link * 1e-3 / p.link_gbps)
  return max(math.ceil(cum / producers) * tile_us, cons)


def random_gather_call(rng):
  """A rank's gather_rs call: (rows, source) segments in producer order (bench_resource.device_segment_sources of a
  random seg_rows [E_l, R] with empty segments), rank, R, T, Q, N, K, eb."""
  R = rng.choice([2, 4, 8, 16])
  rank = rng.randrange(R)
  E_l = rng.randint(1, 4)
  empty = rng.choice([0.0, 0.4, 0.95])
  seg_rows = [[0 if rng.random() < empty else rng.choice([1, 63, 64, 300, 2048]) for _ in range(R)]
              for _ in range(E_l)]
  segs = bench_resource.device_segment_sources(seg_rows, rank)
  return (segs, rank, R, rng.choice([1, 64, 1024]), rng.choice([1, 2, 4, 8]), rng.choice([128, 1024, 4096]),
          rng.choice([128, 7168]), rng.choice([2, 4]))


def test_gather_model_equals_its_recurrence_on_random_inputs():
  # The evaluated form (sources in the consumer's order, one reverse pass per C) equals the forward recurrence, and
  # the choice is the feasible C with the smallest time (the smallest C on ties).
  rng = random.Random(3)
  for _ in range(300):
    p = dataclasses.replace(PG, sms=rng.choice([2, 16, 33, 132]), tile_m=rng.choice([64, 128]),
                            cta_gbps=rng.uniform(5, 40), link_gbps=rng.choice([15.0, 46.25, 92.5, 1745.0]),
                            seg_us=rng.uniform(0, 2), gather_gbps=rng.choice([0.0, rng.uniform(3, 80)]))
    call = random_gather_call(rng)
    cs = range(1, min(32, p.sms - 1) + 1)
    us = [gather_us(p, *call, c) for c in cs]
    for c, u in zip(cs, us):
      assert u == pytest.approx(gather_recurrence(p, *call, c), rel=1e-12)
    assert choose_gather(p, *call) == 1 + us.index(min(us))
    assert gather_us(p, *call, 0) < 0 and gather_us(p, *call, p.sms) < 0


def test_gather_sources_with_no_row_here_go_first_and_cost_their_zeros():
  # Rank 0 of 4 holds rows of source 2 only: sources 1 and 3 (no row here) ship zero partials at once, before
  # source 2's, and rank 0's own partial (no row here either) is one of them; their bytes count.
  p, T, n = PG, 1024, 4096
  only = [(4096, 2)]
  assert gather_us(p, only, 0, 4, T, 4, n, 7168, 2, 4) == pytest.approx(
      gather_recurrence(p, only, 0, 4, T, 4, n, 7168, 2, 4), rel=1e-12)
  # More ranks with nothing here: more partials to ship, never less time.
  assert gather_us(p, only, 0, 8, T, 4, n, 7168, 2, 4) > gather_us(p, only, 0, 4, T, 4, n, 7168, 2, 4)


def test_gather_link_limited_stops_at_the_link():
  # A tiny GEMM: the partials are everything, shipped one source after another. A remote source's traffic a runs at
  # 2 C cta_gbps until its l bytes reach the link's rate (C >= knee); from there on only this rank's own partial (no
  # link) still gains from more consumers.
  seg_rows = [[64, 64, 64, 64]]
  segs = bench_resource.device_segment_sources(seg_rows, 1)
  T, n, eb = 4096, 4096, 2
  traffic, link_bytes = T * n * 4 + T * 4 * 4 + 64 * (n * eb + 4), T * n * 4
  for link in (15.0, 46.25, 92.5):
    p = dataclasses.replace(PG, link_gbps=link, seg_us=0.0, tile_us_base=1e-9, tile_us_per_k=0.0)
    knee = math.ceil(traffic * link / (2 * p.cta_gbps * link_bytes))  # the fewest C whose rate reaches the link's
    remote = [gather_us(p, segs, 1, 4, T, 4, n, 64, eb, c) - traffic * 1e-3 / (2 * c * p.cta_gbps)
              for c in range(1, 33)]  # the makespan less the own partial's work: the remote sources' work
    assert remote[knee - 1:] == pytest.approx([3 * link_bytes * 1e-3 / link] * (32 - knee + 1), rel=1e-9)
    assert all(r > remote[-1] * (1 + 1e-9) for r in remote[:knee - 1])


def test_gather_consumers_grow_with_the_partials_and_shrink_with_the_gemm():
  # A loopback rank of an H200 (33 SMs, the shipped tile time): a longer GEMM (K) leaves the partials more time, so
  # fewer consumers; more tokens (bigger partials, whatever the rows here) ask for more. (Not monotone in the link:
  # this rank's own partial, last and off the link, gains from every consumer once a slow link has held the others.)
  p = dataclasses.replace(PG, sms=33, tile_us_base=2.4, tile_us_per_k=0.0108)
  segs = bench_resource.device_segment_sources([[1024] * 4], 1)
  by_k = [choose_gather(p, segs, 1, 4, 1024, 4, 4096, k, 2) for k in (256, 1024, 3584, 7168, 14336)]
  assert by_k == sorted(by_k, reverse=True) and by_k[0] > by_k[-1]
  by_t = [choose_gather(p, segs, 1, 4, t, 4, 4096, 7168, 2) for t in (64, 256, 1024, 4096)]
  assert by_t == sorted(by_t) and by_t[0] < by_t[-1]


def test_gather_rate_is_the_calibrated_one_else_twice_the_copy_rate():
  # gather_gbps = 0 (an older calibration): the model takes 2 cta_gbps, the same doubles as gather_gbps = 2 cta_gbps
  # set (x 2 is exact), so the choice is the one before the field existed; a calibrated rate replaces it.
  rng = random.Random(5)
  for _ in range(100):
    call = random_gather_call(rng)
    p = dataclasses.replace(PG, sms=rng.choice([16, 33, 132]), cta_gbps=rng.uniform(5, 40))
    q = dataclasses.replace(p, gather_gbps=2 * p.cta_gbps)
    assert [gather_us(p, *call, c) for c in range(1, 16)] == [gather_us(q, *call, c) for c in range(1, 16)]
    assert choose_gather(p, *call) == choose_gather(q, *call)
  segs = bench_resource.device_segment_sources([[1024] * 4], 1)
  p = dataclasses.replace(PG, sms=33, tile_us_base=2.4, tile_us_per_k=0.0108)
  assert gather_us(dataclasses.replace(p, gather_gbps=15.0), segs, 1, 4, 1024, 4, 4096, 7168, 2, 3) != gather_us(
      p, segs, 1, 4, 1024, 4, 4096, 7168, 2, 3)


def test_gather_consumers_grow_as_their_rate_falls():
  # Rank 0 of 2 holding 122880 rows of its own tokens only (T = 1, Q = 1, N = 256: one column tile), 33 SMs, a tile
  # time of 1 us, no per-source cost, a link that never binds. Source 1's zero partial (no row here) goes first, at
  # once, and is done long before the GEMM's 960 tiles are; the own source's partial can start only when the GEMM
  # ends, at G(C) = ceil(960 / (33 - C)) us, and costs its traffic a = 1028 + 122880 (2 N + 4) bytes at C g. So the
  # makespan is G(C) + X / C with X = a / g in us: C = 2 beats 1 when X > 2 (G: 30 -> 31), C = 3 beats 2 when X > 6
  # (31 -> 32), C = 4 beats 3 when X > 24 (32 -> 34), and at X = 60 the best is C = 7 (37 + 8.6 us).
  segs = bench_resource.device_segment_sources([[122880, 0]], 0)
  p = dataclasses.replace(PG, sms=33, tile_us_base=1.0, tile_us_per_k=0.0, seg_us=0.0, link_gbps=1e9)
  a = 1 * 256 * 4 + 1 * 1 * 4 + 122880 * (256 * 2 + 4)
  call = (segs, 0, 2, 1, 1, 256, 0, 2)
  chosen = []
  for x in (1.0, 4.0, 12.0, 60.0):
    q = dataclasses.replace(p, gather_gbps=a * 1e-3 / x)
    assert gather_us(q, *call, 3) == pytest.approx(32 + x / 3, rel=1e-12)
    chosen.append(choose_gather(q, *call))
  assert chosen == [1, 2, 3, 7]


def test_gather_refuses_segments_that_are_no_producer_order():
  with pytest.raises(ValueError, match="producer order"):
    choose_gather(PG, [(64, 1), (64, 2), (64, 1)], 0, 4, 64, 4, 128, 128, 2)
  with pytest.raises(ValueError, match="producer order"):
    choose_gather(PG, [(64, 4)], 0, 4, 64, 4, 128, 128, 2)
  with pytest.raises(ValueError, match="rank 4 of 4 ranks"):
    choose_gather(PG, [(64, 1)], 4, 4, 64, 4, 128, 128, 2)


def test_kernel_gather_consumer_ctas():
  # GatherConsumersOfCall on the host: pinned wins; the fixed C where no segment is another rank's (every source still
  # needs its partial); else the model's choice from the segments in producer order.
  f = bench_resource.kernel_gather_consumer_ctas
  own_only = [[0, 90], [0, 7]]  # rank 1 holds rows of its own tokens only
  assert f(PG, own_only, 1, 64, 4, 4096, 7168, 2, 32, fixed=16) == 16
  assert f(PG, own_only, 1, 64, 4, 4096, 7168, 2, 32, fixed=16, pinned=3) == 3
  grid = [[300, 9000], [2000, 40]]
  assert f(PG, grid, 1, 1024, 4, 4096, 7168, 2, 32, fixed=16, pinned=5) == 5
  assert f(PG, grid, 1, 1024, 4, 4096, 7168, 2, 32, fixed=16) == choose_gather(
      PG, bench_resource.device_segment_sources(grid, 1), 1, 2, 1024, 4, 4096, 7168, 2, 32)


def test_fallback_count():
  assert [rm.fallback_consumer_ctas(s) for s in (4, 8, 108, 132)] == [1, 1, 13, 16]


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(rm.CALIBRATION_DIR, "*.json"))))
def test_shipped_calibrations_are_valid(path):
  p = rm.load_params(path)
  # A compiled producer's tile (mma.sync 64 x 128, wgmma 128 x 256), whole bands, one CTA per SM.
  assert (p.tile_m, p.tile_n) in ((64, 128), (128, 256)) and p.tile_m % _jmo.band_rows == 0 and p.ctas_per_sm == 1
  with open(path) as f:
    assert rm.calibration_file_name(json.load(f)["gpu_name"]) == os.path.basename(path)
  assert p.pusher_gbps > 0  # dispatch_gemm's P is the model's where the calibration has its rate


def test_a_calibration_without_a_pusher_rate_loads_with_none(tmp_path):
  data = {f.name: getattr(P, f.name) for f in dataclasses.fields(P) if f.name not in ("pusher_gbps", "gather_gbps")}
  (tmp_path / "old.json").write_text(json.dumps(data))
  assert rm.load_params(str(tmp_path / "old.json")).pusher_gbps == 0.0
  assert rm.validate_params(dataclasses.replace(P, pusher_gbps=-1.0))


def test_a_calibration_with_and_without_a_gather_rate(tmp_path):
  # An older file (no gather_gbps) reads as 0: gather_rs's model keeps 2 cta_gbps. A file with one carries it to the
  # C++ struct; a negative or infinite one is refused by name.
  data = {f.name: getattr(P, f.name) for f in dataclasses.fields(P) if f.name != "gather_gbps"}
  (tmp_path / "old.json").write_text(json.dumps(data))
  assert rm.load_params(str(tmp_path / "old.json")).gather_gbps == 0.0
  (tmp_path / "new.json").write_text(json.dumps(dict(data, gather_gbps=14.5)))
  p = rm.load_params(str(tmp_path / "new.json"))
  assert p.gather_gbps == 14.5 and p.native().gather_gbps == 14.5 and p.as_list()[-1] == 14.5
  for bad in (-1.0, math.inf):
    assert any("gather_gbps" in s for s in rm.validate_params(dataclasses.replace(P, gather_gbps=bad)))
  (tmp_path / "bad.json").write_text(json.dumps(dict(data, gather_gbps=-2.0)))
  with pytest.raises(ValueError, match="gather_gbps must be finite and >= 0"):
    rm.load_params(str(tmp_path / "bad.json"))


# ---------------------------------------------------------------------------------------------------------------
# Per-call consumer options


@pytest.mark.parametrize("kw", [dict(consumer_ctas=-1), dict(consumer_ctas=True), dict(consumer_ctas=2.5),
                                dict(serialize=1), dict(serialize="yes")])
def test_call_config_validation(kw):
  with pytest.raises(ValueError, match=r"CallConfig\.(consumer_ctas|serialize) must be"):
    CallConfig(**kw)


def test_pinned_count_checked_against_the_sm_budget():
  # Checked once, when the call site is set up (RankInfo), before anything is traced.
  gpu = types.SimpleNamespace(platform="cuda", handle=1, ranks=2,
                              device=DeviceFacts(compute_capability=(9, 0), sm_budget=33, consumer_policy="test",
                                                 calibration=None))
  attrs = RankInfo(gpu, CallConfig(consumer_ctas=32, serialize=True)).attrs()
  assert attrs["consumer_ctas"] == 32 and attrs["consumer_ctas"].dtype == np.int32
  assert attrs["serialize"] == np.bool_(True) and attrs["serialize"].dtype == np.bool_
  with pytest.raises(ValueError, match=r"consumer_ctas=33 leaves no producer CTA: .* SM budget of 33 CTAs, so pin C "
                                       r"in \[1, 32\]"):
    RankInfo(gpu, CallConfig(consumer_ctas=33))


def _run(config, impl="overlap"):
  x, ids, gates, w1, w2 = layer_inputs(64, 16, 24, 8, 2, "skewed", 3)
  fn = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh_of(4), config=config, impl=impl))
  y, _ = fn(x, ids, gates, w1, w2)
  g = jax.jit(jax.grad(lambda x, w1, w2: jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh_of(4),
                                                          config=config)[0].sum(), argnums=(0, 1, 2)))(x, w1, w2)
  return np.asarray(y), [np.asarray(v) for v in g]


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
def test_serialized_and_pinned_calls_give_identical_results_on_cpu():
  y0, g0 = _run(CallConfig())
  for cfg in (CallConfig(serialize=True), CallConfig(consumer_ctas=7), CallConfig(consumer_ctas=3, serialize=True)):
    y, g = _run(cfg)
    np.testing.assert_array_equal(y, y0)
    for a, b in zip(g, g0):
      np.testing.assert_array_equal(a, b)
  y_ref, _ = _run(CallConfig(), impl="reference")
  assert np.abs(y0 - y_ref).max() <= 1e-4 * max(1.0, np.abs(y_ref).max())


def test_custom_call_rejects_a_negative_count():
  # Past the Python check (the frozen dataclass forced), the handler's own check answers, and the next call works.
  cfg = CallConfig(timeout_ms=2000)
  object.__setattr__(cfg, "consumer_ctas", -2)
  with pytest.raises(Exception, match=r"consumer_ctas must be 0 \(the resource manager's choice\) or a positive CTA "
                                      r"count, got -2"):
    _run(cfg)
  y, _ = _run(CallConfig())
  assert np.isfinite(y).all()
