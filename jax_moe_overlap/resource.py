"""The resource manager's host side: its calibrated constants and where they come from.

The model itself (``ffi/include/jax_moe_overlap/resource_model.h``) runs on the device, in each expert_combine at
kernel start; the extension exposes it to Python as ``_jmo.model_makespan_us`` and ``_jmo.model_choose_consumer_ctas``
(for tests and benchmarks), taking a ``ModelParams.native()``.

gather_rs's consumer count has its own form: ``_jmo.model_gather_makespan_us`` and
``_jmo.model_choose_gather_consumer_ctas``, with ``_jmo.model_gather_traffic_bytes`` the traffic its rate
``gather_gbps`` is measured against. ``_jmo.model_choose_dispatch_pushers`` and ``_jmo.model_pushers_makespan_us``
are the same for dispatch_gemm's pushing CTAs (``_jmo.model_choose_dispatch_pushers_for_plan`` takes a call's
``send_start`` as the kernel does), and ``_jmo.model_with_link`` gives the model of a call over a link of a
given rate (what the launches evaluate).

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

from jax_moe_overlap import _jmo
from jax_moe_overlap import env as _env

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
  pusher_gbps: float = 0.0  # dispatch_gemm's pusher rate per CTA (0: not calibrated, the fixed pusher rule applies)
  gather_gbps: float = 0.0  # gather_rs's consumer traffic per CTA (0: not calibrated, the model takes 2 cta_gbps)

  def native(self):
    """The C++ struct (``_jmo.ModelParams``, built by name): what create_cuda_workspace and the model functions take."""
    return _jmo.ModelParams(**dataclasses.asdict(self))

  def as_list(self) -> list[float]:
    """The 11 numbers in the order of the C++ struct: the loopback harness's --model flag."""
    return [float(getattr(self, f.name)) for f in dataclasses.fields(self)]


def calibration_file_name(gpu_name: str) -> str:
  """'NVIDIA H200' -> 'nvidia_h200.json'."""
  return re.sub(r"[^a-z0-9]+", "_", gpu_name.lower()).strip("_") + ".json"


def load_params(path: str) -> ModelParams:
  """Reads calibrated constants written by benchmarks/calibrate.py (extra keys, e.g. provenance, are ignored)."""
  with open(path) as f:
    data = json.load(f)
  missing = [f.name for f in dataclasses.fields(ModelParams)
             if f.name not in data and f.default is dataclasses.MISSING]
  if missing:
    raise ValueError(f"jax_moe_overlap: calibration file {path} lacks {missing}")
  ints = ("sms", "ctas_per_sm", "tile_m", "tile_n")
  p = ModelParams(**{f.name: (int if f.name in ints else float)(data[f.name]) for f in dataclasses.fields(ModelParams)
                     if f.name in data})
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
  for name in ("pusher_gbps", "gather_gbps"):
    v = getattr(p, name)
    if not (math.isfinite(v) and v >= 0):
      out.append(f"{name} must be finite and >= 0 (0: not calibrated), got {v}")
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
