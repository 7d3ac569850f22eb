"""The analytical resource model: its properties, and the Python mirror against the C++ header the kernels use."""

import dataclasses
import math
import random

import pytest

from jax_moe_overlap import _jmo
from jax_moe_overlap import resource as rm

# Shapes of an H200-like device; the constants only need to be plausible for these properties to be tested.
P = rm.ModelParams(sms=132, ctas_per_sm=1, tile_m=128, tile_n=128, tile_us_base=1.0, tile_us_per_k=0.002,
                   cta_gbps=12.0, link_gbps=370.0, seg_us=1.0)


def cpp_makespan(p, segs, n, k, eb, c):
  return _jmo.model_makespan_us(_vec(p), [(s.rows, int(s.remote)) for s in segs], n, k, eb, c)


def cpp_choose(p, segs, n, k, eb, max_ctas):
  return _jmo.model_choose_consumer_ctas(_vec(p), [(s.rows, int(s.remote)) for s in segs], n, k, eb, max_ctas)


def _vec(p):
  return [float(getattr(p, f.name)) for f in dataclasses.fields(p)]


def test_python_mirror_matches_cpp_on_random_inputs():
  rng = random.Random(0)
  for _ in range(300):
    p = dataclasses.replace(P, sms=rng.choice([16, 108, 132]), ctas_per_sm=rng.choice([1, 2]),
                            tile_m=rng.choice([64, 128]), tile_n=rng.choice([128, 256]),
                            tile_us_base=rng.uniform(0.2, 3), tile_us_per_k=rng.uniform(1e-4, 5e-3),
                            cta_gbps=rng.uniform(2, 30), link_gbps=rng.uniform(50, 450), seg_us=rng.uniform(0, 3))
    segs = [rm.Segment(rng.choice([0, 1, 63, 64, 65, 500, 2048]), rng.random() < 0.7)
            for _ in range(rng.randint(1, 24))]
    n, k, eb = rng.choice([1024, 4096, 7168]), rng.choice([512, 2048, 14336]), rng.choice([2, 4])
    for c in (1, 2, 7, min(32, p.sms - 1)):
      assert math.isclose(rm.makespan_us(p, segs, n, k, eb, c), cpp_makespan(p, segs, n, k, eb, c), rel_tol=1e-12)
    assert rm.choose_consumer_ctas(p, segs, n, k, eb, 32) == cpp_choose(p, segs, n, k, eb, 32)


def test_wave_boundaries():
  # One column tile per row band, 128-row tiles: P = sms - C producer CTAs.
  p = dataclasses.replace(P, tile_n=4096, seg_us=0.0)
  c = 4
  producers = p.sms - c
  t = p.tile_us_base + p.tile_us_per_k * 1024
  one_wave = [rm.Segment(128 * producers, False)]
  two_waves = [rm.Segment(128 * producers + 1, False)]
  assert rm.makespan_us(p, one_wave, 4096, 1024, 2, c) == pytest.approx(t)
  assert rm.makespan_us(p, two_waves, 4096, 1024, 2, c) == pytest.approx(2 * t)


def test_monotone_in_load():
  base = [rm.Segment(512, True), rm.Segment(256, True), rm.Segment(128, False)]
  more = [rm.Segment(1024, True), rm.Segment(256, True), rm.Segment(128, False)]
  for c in (1, 4, 16):
    assert rm.makespan_us(P, more, 4096, 2048, 2, c) >= rm.makespan_us(P, base, 4096, 2048, 2, c)


def test_coupling_consumer_waits_for_the_last_tile():
  # A single remote segment: its push can start only when the producer is done with it, so the makespan is the
  # production time plus the whole push, not the larger of the two.
  p = dataclasses.replace(P, seg_us=0.0)
  seg = [rm.Segment(4096, True)]
  n, k, c = 4096, 2048, 8
  produce = rm.makespan_us(p, [rm.Segment(4096, False)], n, k, 2, c)
  push = 4096 * n * 2 / min(c * p.cta_gbps, p.link_gbps) * 1e-3
  assert rm.makespan_us(p, seg, n, k, 2, c) == pytest.approx(produce + p.seg_us + push)


def test_no_remote_tiles_needs_one_consumer_cta():
  segs = [rm.Segment(2048, False), rm.Segment(1024, False)]
  assert rm.choose_consumer_ctas(P, segs, 4096, 2048, 2) == 1


def test_communication_heavy_picks_more_ctas_than_compute_heavy():
  comm_heavy = [rm.Segment(256, True) for _ in range(32)]        # small K: cheap tiles, many bytes
  compute_heavy = [rm.Segment(256, True) for _ in range(32)]
  c_comm = rm.choose_consumer_ctas(P, comm_heavy, 8192, 256, 2)
  c_comp = rm.choose_consumer_ctas(P, compute_heavy, 1024, 16384, 2)
  assert c_comm > c_comp >= 1


def test_single_segment_and_infeasible_counts():
  segs = [rm.Segment(100, True)]
  assert 1 <= rm.choose_consumer_ctas(P, segs, 4096, 2048, 2) <= 32
  with pytest.raises(ValueError, match=r"consumer_ctas must be in \[1, 131\]"):
    rm.makespan_us(P, segs, 4096, 2048, 2, 132)
  with pytest.raises(ValueError):
    rm.makespan_us(P, segs, 4096, 2048, 2, 0)
  assert cpp_makespan(P, segs, 4096, 2048, 2, 132) < 0  # the C++ side reports infeasible as negative
