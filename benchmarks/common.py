"""Shared pieces of the benchmark suite: timing, shapes, routings, result tables.

Timing (METHOD.md): warm up, then time batches of back-to-back asynchronous calls (so per-call dispatch overlaps the
device work), rotate among several input sets (so repeated runs do not measure the L2), and report the median over
batches. Every number printed comes with the command line that produced it (``command_line()``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shlex
import statistics
import sys
import time

import jax
import numpy as np


def command_line() -> str:
  return " ".join(shlex.quote(a) for a in ["python3"] + sys.argv)


def environment() -> dict:
  dev = jax.devices()[0]
  return dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), device=getattr(dev, "device_kind", str(dev)),
              jax=jax.__version__, python=platform.python_version(), command=command_line())


def time_fn(fn, arg_sets, *, warmup: int = 3, batches: int = 15, per_batch: int = 5) -> float:
  """Median seconds per call of ``fn(*args)`` over ``batches`` batches, cycling through ``arg_sets``.

  Slow functions (> 50 ms a call after warm-up) get 5 batches of 1 call, to keep a sweep inside its time limit.
  """
  for i in range(warmup):
    jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*arg_sets[0]))
  if time.perf_counter() - t0 > 0.05:
    batches, per_batch = 5, 1
  times = []
  for b in range(batches):
    t0 = time.perf_counter()
    out = None
    for i in range(per_batch):
      out = fn(*arg_sets[(b * per_batch + i) % len(arg_sets)])
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / per_batch)
  return statistics.median(times)


SKEWS = {"balanced": 0.0, "moderate": 0.8, "stress": 2.0}  # Zipf exponent of the expert popularity


def expert_probs(groups: int, skew: str, seed: int = 0) -> np.ndarray:
  """Popularity of ``groups`` experts, Zipf(``SKEWS[skew]``), in a seeded random order (the heavy one moves)."""
  p = 1.0 / (np.arange(groups) + 1.0) ** SKEWS[skew]
  p = p / p.sum()
  rng = np.random.default_rng(seed)
  return p[rng.permutation(groups)]


def group_sizes(rows: int, groups: int, skew: str, seed: int = 0) -> np.ndarray:
  """Rows per group summing to ``rows``: 'balanced', 'moderate' (Zipf 0.8) or 'stress' (Zipf 2.0) skew."""
  p = expert_probs(groups, skew, seed)
  sizes = np.floor(p * rows).astype(np.int64)
  sizes[np.argmax(p)] += rows - sizes.sum()
  return sizes.astype(np.int32)


def topk_routing(tokens: int, groups: int, k: int, skew: str, seed: int = 0) -> np.ndarray:
  """[tokens, k] int32 expert ids, distinct within a token, drawn without replacement from ``expert_probs``.

  Gumbel top-k (exact sampling without replacement, vectorised). As a token takes an expert at most once, the
  heaviest expert gets at most 1/k of the slots even when its Zipf share is larger.
  """
  p = expert_probs(groups, skew, seed)
  rng = np.random.default_rng(seed + 1)
  keys = np.log(p)[None, :] + rng.gumbel(size=(tokens, groups))
  return np.argsort(-keys, axis=1)[:, :k].astype(np.int32)


@dataclasses.dataclass
class Table:
  """Rows of results printed as an aligned table and written as JSON lines."""

  columns: list
  rows: list = dataclasses.field(default_factory=list)

  def add(self, **kw):
    self.rows.append(kw)
    print("  " + "  ".join(f"{c}={kw[c]}" for c in self.columns if kw.get(c) not in (None, "")), flush=True)

  def render(self) -> str:
    cells = [[str(r.get(c, "")) for c in self.columns] for r in self.rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(self.columns)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(self.columns, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(x.ljust(w) for x, w in zip(row, widths)) + " |" for row in cells]
    return "\n".join(lines)

  def save(self, path: str, meta: dict):
    with open(path, "w") as f:
      f.write(json.dumps(dict(meta=meta)) + "\n")
      for r in self.rows:
        f.write(json.dumps(r) + "\n")

  def finish(self, path: str):
    """Writes the rows (with the environment and command line first) and prints the table last."""
    meta = environment()
    self.save(path, meta)
    print(f"\n{meta}\n")
    print(self.render())


def tokamax_ragged_dot():
  """(fn, None) with fn(lhs, rhs, group_sizes) = tokamax.ragged_dot(..., implementation="mosaic") (the best grouped
  GEMM a JAX user has on Hopper today, MaxText's GPU choice), or (None, why) when tokamax does not import."""
  try:
    import tokamax  # pylint: disable=g-import-not-at-top
  except Exception as e:  # pylint: disable=broad-except
    return None, f"tokamax unavailable: {type(e).__name__}: {e}"
  return (lambda a, b, g: tokamax.ragged_dot(a, b, g, implementation="mosaic")), None
