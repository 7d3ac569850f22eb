"""The analytical resource manager in Python: the same wave-quantized model as
``ffi/include/jax_moe_overlap/resource_model.h`` (which the kernels use), for tests, plots and host-side choices.

``makespan_us(params, segments, n, k, elem_bytes, consumer_ctas)`` models one expert_combine call;
``choose_consumer_ctas(...)`` returns the consumer CTA count with the smallest modelled makespan. ``params`` are
calibrated per GPU and producer variant by the benchmark suite and stored as JSON (``load_params``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Sequence


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


@dataclasses.dataclass(frozen=True)
class Segment:
  rows: int
  remote: bool


def load_params(path: str) -> ModelParams:
  """Reads calibrated constants written by the benchmark suite."""
  with open(path) as f:
    data = json.load(f)
  return ModelParams(**{f.name: data[f.name] for f in dataclasses.fields(ModelParams)})


def makespan_us(p: ModelParams, segments: Sequence[Segment], n: int, k: int, elem_bytes: int,
                consumer_ctas: int) -> float:
  """Modelled time of one call with ``consumer_ctas`` consumer CTAs; raises ValueError if infeasible."""
  if consumer_ctas < 1 or consumer_ctas >= p.sms:
    raise ValueError(f"consumer_ctas must be in [1, {p.sms - 1}] on a device with {p.sms} SMs, got {consumer_ctas}")
  producers = (p.sms - consumer_ctas) * p.ctas_per_sm
  col_tiles = math.ceil(n / p.tile_n)
  tile_us = p.tile_us_base + p.tile_us_per_k * k
  rate = min(consumer_ctas * p.cta_gbps, p.link_gbps)
  cum_tiles = 0
  consumer_us = 0.0
  for s in segments:
    if s.rows <= 0:
      continue
    cum_tiles += math.ceil(s.rows / p.tile_m) * col_tiles
    if not s.remote:
      continue
    ready_us = math.ceil(cum_tiles / producers) * tile_us
    consumer_us = max(consumer_us, ready_us) + p.seg_us + s.rows * n * elem_bytes / rate * 1e-3
  producer_us = math.ceil(cum_tiles / producers) * tile_us
  return max(producer_us, consumer_us)


def choose_consumer_ctas(p: ModelParams, segments: Sequence[Segment], n: int, k: int, elem_bytes: int,
                         max_ctas: int = 32) -> int:
  """The consumer CTA count in [1, min(max_ctas, sms - 1)] minimising the model (smallest on ties)."""
  best, best_us = 1, makespan_us(p, segments, n, k, elem_bytes, 1)
  for c in range(2, min(max_ctas, p.sms - 1) + 1):
    us = makespan_us(p, segments, n, k, elem_bytes, c)
    if us < best_us:
      best, best_us = c, us
  return best
