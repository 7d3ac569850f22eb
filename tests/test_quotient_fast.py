"""The division-free quotient of the CUDA quantizers (ffi/cuda/ops/e4m3.cuh's QuotientFast: q0 = x r, t = q0 s - x,
q = q0 - t r, each rounded once to float32, r = 1 / s) emulated exactly with float64 arithmetic, against IEEE float32
division x / s: bit for bit where |x / s| >= 2^-11, and the same e4m3 byte (saturating, nearest even) below, for every
finite bfloat16 x and random float32 x of every magnitude, at scales of the fast tiles (s >= 2^-62, and 2^-126 with
its values). It checks the header's argument on many more quotients than a GPU test runs; the kernels themselves are
held to the CPU handlers on GPUs (tests/gpu/test_gpu_quantize_weight_fp8.py and the other quantizers' tests)."""

import ml_dtypes
import numpy as np
import pytest

FAST_SCALE_MIN = np.float32(2.0 ** -62)   # e4m3.cuh's kFastScaleMin
SCALE_FLOOR = np.float32(2.0 ** -126)


def _rn32_of_sum(a, b):
  """float32 round-to-nearest-even of the exact a + b (a, b float64 arrays)."""
  s = a + b
  bv = s - a
  e = (a - (s - bv)) + (b - bv)            # TwoSum: s + e is a + b exactly
  r = s.astype(np.float32)                 # s's rounding, right unless s is a float32 midpoint and e is not 0
  res = s - r.astype(np.float64)           # exact
  up = np.nextafter(r, np.float32(np.inf))
  down = np.nextafter(r, np.float32(-np.inf))
  above_mid = (res == (up.astype(np.float64) - r) / 2) & (e > 0)
  below_mid = (res == -(r - down.astype(np.float64)) / 2) & (e < 0)
  return np.where(above_mid, up, np.where(below_mid, down, r))


def quotient_fast(x, s):
  """QuotientFast on float32 arrays x and s, each step rounded once as the device's fmul / fma round it."""
  x, s = x.astype(np.float32), s.astype(np.float32)
  r = np.float32(1) / s
  q0 = (x.astype(np.float64) * r).astype(np.float32)                        # an exact product, rounded once
  t = (q0.astype(np.float64) * s - x.astype(np.float64)).astype(np.float32)  # exact in float64, rounded once
  p = t.astype(np.float64) * r                                               # -t r: exact
  q = _rn32_of_sum(q0.astype(np.float64), -p)
  # fma(-t, r, q0) of an exact zero sum: -0 only where both addends are -0 (round to nearest)
  zero = (q0.astype(np.float64) - p) == 0
  neg = np.signbit(q0) & np.signbit((-t) * r)
  return np.where(zero, np.where(neg, np.float32(-0.0), np.float32(0.0)), q)


def _e4m3(v):
  return np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _scales(rng):
  return np.concatenate([
      (rng.uniform(1, 2, 24) * np.exp2(rng.integers(-62, 119, 24))).astype(np.float32),  # random significands
      np.float32(1.75) * np.exp2(np.arange(-60, 100, 23)).astype(np.float32),        # amax 448 * 1.75: s a power of 2
      np.array([FAST_SCALE_MIN, np.nextafter(FAST_SCALE_MIN, np.float32(1)), np.float32(2.0 ** 119)], np.float32),
      np.array([SCALE_FLOOR], np.float32)])


@pytest.mark.parametrize("seed", [0])
def test_quotient_fast_is_the_ieee_quotient(seed):
  rng = np.random.default_rng(seed)
  bf = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
  bf = bf[np.isfinite(bf)]
  checked = 0
  for s in _scales(rng):
    amax = s * np.float32(448) if s > SCALE_FLOOR else np.float32(448) * SCALE_FLOOR   # the tile's largest |x|
    xs = np.concatenate([
        bf, (rng.uniform(-1, 1, 20000) * amax).astype(np.float32),
        (rng.choice([-1, 1], 20000) * np.exp2(rng.uniform(-149, np.log2(amax), 20000))).astype(np.float32),
        np.array([0.0, -0.0], np.float32)])
    x = xs[np.abs(xs) <= amax]
    want, got = x / s, quotient_fast(x, np.full_like(x, s))
    big = np.abs(want) >= 2.0 ** -11
    wrong = np.flatnonzero(big & (want.view(np.uint32) != got.view(np.uint32)))
    assert wrong.size == 0, f"s={s!r}: x={x[wrong[0]]!r} gives {got[wrong[0]]!r}, x / s = {want[wrong[0]]!r}"
    bytes_wrong = np.flatnonzero(_e4m3(want[~big]) != _e4m3(got[~big]))
    assert bytes_wrong.size == 0, f"s={s!r}: x={x[~big][bytes_wrong[0]]!r}: e4m3 byte differs"
    checked += x.size
  assert checked > 1_000_000
