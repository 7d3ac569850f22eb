"""The analytical resource manager in Python: the same wave-quantized model as
``ffi/include/jax_moe_overlap/resource_model.h`` (which the kernels evaluate on the device at kernel start), for
tests, plots and reports.

``makespan_us(params, segments, n, k, elem_bytes, consumer_ctas)`` models one expert_combine call;
``choose_consumer_ctas(...)`` returns the consumer CTA count with the smallest modelled makespan. Both compute
exactly what the C++/CUDA code computes, operation by operation (tests/test_resource.py checks bit equality).

``params`` are calibrated per GPU and producer variant by ``benchmarks/calibrate.py`` and shipped as JSON under
``jax_moe_overlap/calibration/<gpu name>.json``; ``calibration_for(name, sms)`` finds the file for a device and says
why none applies (then the kernels use a fixed consumer count: ``fallback_consumer_ctas``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Sequence

from jax_moe_overlap import env as _env

# What the device kernel considers: C in [1, min(MAX_MODEL_CTAS, budget - 1)] (one warp of candidates).
MAX_MODEL_CTAS = 32
CALIBRATION_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration")


@dataclasses.dataclass(frozen=True)
class ModelParams:
  """Calibrated constants (see resource_model.h). Bandwidths in GB/s (= bytes/ns), times in microseconds."""

  sms: int
  ctas_per_sm: int
  tile_m: int
  tile_n: int
  tile_us_base: float
  tile_us_per_k: float
  cta_gbps: float
  link_gbps: float
  seg_us: float

  def native(self):
    """The C++ struct (``_jmo.ModelParams``, built by name): what create_cuda_workspace and the model functions take."""
    from jax_moe_overlap import _jmo
    return _jmo.ModelParams(**dataclasses.asdict(self))

  def as_list(self) -> list[float]:
    """The 9 numbers in the order of the C++ struct: the loopback harness's --model flag."""
    return [float(getattr(self, f.name)) for f in dataclasses.fields(self)]


@dataclasses.dataclass(frozen=True)
class Segment:
  rows: int
  remote: bool  # True: the consumer pushes the rows (the CUDA kernel pushes every segment, its own ones too)


def _ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def _prefixes(p: ModelParams, segments: Sequence[Segment], n: int, elem_bytes: int):
  cum = pushed = nbytes = 0
  pre = []
  for s in segments:
    if s.rows <= 0:
      continue
    cum += _ceil_div(s.rows, p.tile_m) * _ceil_div(n, p.tile_n)
    if not s.remote:
      continue
    pre.append((cum, pushed, nbytes))
    pushed += 1
    nbytes += s.rows * n * elem_bytes
  return [(c, pushed - a, nbytes - b) for c, a, b in pre], cum


def _makespan_from(p: ModelParams, pre, total_tiles: int, k: int, c: int) -> float:
  producers = (p.sms - c) * p.ctas_per_sm
  tile_us = p.tile_us_base + p.tile_us_per_k * float(k)
  rate = min(float(c) * p.cta_gbps, p.link_gbps)
  us_per_byte = 1e-3 / rate
  us = float(_ceil_div(total_tiles, producers)) * tile_us
  for cum, pushed_from, bytes_from in pre:
    term = float(_ceil_div(cum, producers)) * tile_us + (float(pushed_from) * p.seg_us + float(bytes_from) * us_per_byte)
    us = max(us, term)
  return us


def makespan_us(p: ModelParams, segments: Sequence[Segment], n: int, k: int, elem_bytes: int,
                consumer_ctas: int) -> float:
  """Modelled time of one call with ``consumer_ctas`` consumer CTAs; raises ValueError if infeasible."""
  if consumer_ctas < 1 or consumer_ctas >= p.sms:
    raise ValueError(f"consumer_ctas must be in [1, {p.sms - 1}] on a device with {p.sms} SMs, got {consumer_ctas}")
  pre, total = _prefixes(p, segments, n, elem_bytes)
  return _makespan_from(p, pre, total, k, consumer_ctas)


def choose_consumer_ctas(p: ModelParams, segments: Sequence[Segment], n: int, k: int, elem_bytes: int,
                         max_ctas: int = MAX_MODEL_CTAS) -> int:
  """The consumer CTA count in [1, min(max_ctas, sms - 1)] minimising the model (smallest on ties)."""
  if p.sms < 2:
    raise ValueError(f"the model needs at least 2 SMs (a consumer and a producer), got {p.sms}")
  pre, total = _prefixes(p, segments, n, elem_bytes)
  best, best_us = 1, _makespan_from(p, pre, total, k, 1)
  for c in range(2, min(max_ctas, p.sms - 1) + 1):
    us = _makespan_from(p, pre, total, k, c)
    if us < best_us:
      best, best_us = c, us
  return best


def device_segments(seg_rows, rank: int) -> list[Segment]:
  """The kernel's view of one rank's call: segments of ``seg_rows [E_local, R]`` in the producer's order (remote
  first, the most loaded destination first, then by source and expert; own segments last). Only remote segments
  are pushed: the CUDA producer stores the rank's own segments in place. Mirrors protocol.h SegmentBefore."""
  E_l = len(seg_rows)
  R = len(seg_rows[0]) if E_l else 0
  to_rank = [sum(int(seg_rows[e][s]) for e in range(E_l)) for s in range(R)]
  keys = sorted(((s == rank, -to_rank[s], s, e) for e in range(E_l) for s in range(R)))
  return [Segment(int(seg_rows[e][s]), s != rank) for _, _, s, e in keys if int(seg_rows[e][s]) > 0]


def kernel_consumer_ctas(p: ModelParams, seg_rows, rank: int, n: int, k: int, elem_bytes: int, max_ctas: int,
                         pinned: int = 0) -> int:
  """The consumer CTA count the CUDA kernel uses for one rank's call (resource_manager.cuh ConsumersOfCall): 0 when nothing
  is pushed (no remote segment: every CTA produces), else ``pinned`` if given, else the model's choice."""
  segs = device_segments(seg_rows, rank)
  if not any(s.remote for s in segs):
    return 0
  return pinned if pinned > 0 else choose_consumer_ctas(p, segs, n, k, elem_bytes, max_ctas)


# ---------------------------------------------------------------------------------------------------------------
# Calibration files


def calibration_file_name(gpu_name: str) -> str:
  """'NVIDIA H200' -> 'nvidia_h200.json'."""
  return re.sub(r"[^a-z0-9]+", "_", gpu_name.lower()).strip("_") + ".json"


def load_params(path: str) -> ModelParams:
  """Reads calibrated constants written by benchmarks/calibrate.py (extra keys, e.g. provenance, are ignored)."""
  with open(path) as f:
    data = json.load(f)
  missing = [f.name for f in dataclasses.fields(ModelParams) if f.name not in data]
  if missing:
    raise ValueError(f"jax_moe_overlap: calibration file {path} lacks {missing}")
  ints = ("sms", "ctas_per_sm", "tile_m", "tile_n")
  p = ModelParams(**{f.name: (int if f.name in ints else float)(data[f.name]) for f in dataclasses.fields(ModelParams)})
  problems = validate_params(p)
  if problems:
    raise ValueError(f"jax_moe_overlap: calibration file {path}: {'; '.join(problems)}")
  return p


def validate_params(p: ModelParams) -> list[str]:
  """What is wrong with a parameter set (empty if it is usable)."""
  out = []
  if p.sms < 2 or p.ctas_per_sm < 1 or p.tile_m < 1 or p.tile_n < 1:
    out.append(f"sms >= 2, ctas_per_sm, tile_m, tile_n >= 1 needed (got {p.sms}, {p.ctas_per_sm}, {p.tile_m}, "
               f"{p.tile_n})")
  for name in ("tile_us_base", "tile_us_per_k", "seg_us"):
    v = getattr(p, name)
    if not (math.isfinite(v) and v >= 0):
      out.append(f"{name} must be finite and >= 0, got {v}")
  for name in ("cta_gbps", "link_gbps"):
    v = getattr(p, name)
    if not (math.isfinite(v) and v > 0):
      out.append(f"{name} must be finite and > 0, got {v}")
  if p.tile_us_base + p.tile_us_per_k <= 0:
    out.append("tile time must be positive")
  return out


@dataclasses.dataclass(frozen=True)
class Calibration:
  """Which consumer policy a device gets: ``params`` (the model, chosen on the device per call) or None with
  ``reason`` saying why the fixed fallback count is used."""

  params: ModelParams | None
  source: str   # the file used, or "" when none
  reason: str   # human-readable: what the kernels will do and why


def fallback_consumer_ctas(sms: int) -> int:
  """The fixed consumer count without a calibration: an eighth of the SMs (the seed's default was 14 of 108)."""
  return max(1, sms // 8)


def calibration_for(gpu_name: str, sms: int, directory: str | None = None,
                    tile_m: int | None = None, tile_n: int | None = None) -> Calibration:
  """The shipped calibration of GPU ``gpu_name`` with ``sms`` SMs, or why there is none.

  ``$JMO_CALIBRATION`` (a path) overrides the lookup; ``$JMO_CALIBRATION=none`` disables the model. A file whose
  SM count or tile shape differs from the device's kernels is not used (the fallback is, and ``reason`` says so).
  """
  env = _env.calibration()
  if env.lower() == "none":
    return Calibration(None, "", f"resource model disabled by $JMO_CALIBRATION=none: fixed consumer CTAs "
                                 f"C = {fallback_consumer_ctas(sms)} (SMs / 8)")
  path = env or os.path.join(directory or CALIBRATION_DIR, calibration_file_name(gpu_name))
  fallback = f"fixed consumer CTAs C = {fallback_consumer_ctas(sms)} (SMs / 8)"
  if not os.path.exists(path):
    return Calibration(None, "", f"no resource-model calibration for GPU {gpu_name!r} (looked for {path}; "
                                 f"benchmarks/calibrate.py writes one): {fallback}")
  try:
    p = load_params(path)
  except (ValueError, OSError, json.JSONDecodeError, TypeError) as e:
    return Calibration(None, path, f"calibration {path} unusable ({e}): {fallback}")
  if p.sms != sms:
    return Calibration(None, path, f"calibration {path} was measured on {p.sms} SMs but GPU {gpu_name!r} has "
                                   f"{sms}: {fallback}")
  if (tile_m is not None and p.tile_m != tile_m) or (tile_n is not None and p.tile_n != tile_n):
    return Calibration(None, path, f"calibration {path} describes {p.tile_m}x{p.tile_n} tiles but the kernels use "
                                   f"{tile_m}x{tile_n}: {fallback}")
  return Calibration(p, path, f"resource model from {path}: consumer CTAs chosen per call on the device")
