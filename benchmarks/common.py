"""Shared pieces of the benchmark suite: timing, shapes, routings, result tables.

Timing (METHOD.md): warm up, then time batches of back-to-back asynchronous calls (so per-call dispatch overlaps the
device work), rotate among several input sets (so repeated runs do not measure the L2), and report the median over
batches. Every number printed comes with the command line that produced it (``command_line()``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import shlex
import signal
import statistics
import sys
import time

import jax
import jax.numpy as jnp
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


def virtual_cpu_devices(argv: list[str], default: int = 4) -> None:
  """Asks XLA:CPU for ``--devices N`` (from ``argv``, else ``default``) virtual devices: a CPU try-out of a
  multi-device benchmark. Only the host platform is affected (on a GPU machine the mesh is still the GPUs). Call it
  before jax first uses a backend; an XLA_FLAGS that already sets the count is left alone."""
  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return
  n = argv[argv.index("--devices") + 1] if "--devices" in argv[:-1] else str(default)
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"


def expert_mesh(n: int | None, axis: str) -> jax.sharding.Mesh:
  """A 1-D mesh with axis ``axis`` over the first ``n`` devices (None: all of them)."""
  devs = jax.devices()
  if n is not None:
    if n > len(devs):
      raise SystemExit(f"--devices {n}: only {len(devs)} devices here")
    devs = devs[:n]
  return jax.sharding.Mesh(np.array(devs), (axis,), axis_types=(jax.sharding.AxisType.Auto,))


@contextlib.contextmanager
def rows_kept_on_sigterm(table: "Table", path: str, name: str):
  """Runs the body; SIGTERM (``timeout``'s signal in a time-limited device run) stops it, and either way the rows
  done so far are written to ``path`` and printed (``table.finish``)."""

  def stop(signum, _):
    raise SystemExit(f"{name}: stopped by signal {signum}: writing the rows done so far")

  signal.signal(signal.SIGTERM, stop)
  try:
    yield table
  finally:
    table.finish(path)


# ----------------------------------------------------------------------------------------------------------------
# GEMM2 of the MoE layer (expert outputs -> d_model rows) and the weighted combine: bench_fused, bench_ep_combine

# (name, tokens per rank T, K = F, N = D, experts E, top-k): the seed sweep's GEMM2 (K = F = 2048), Mixtral-like and
# DeepSeek-like (E_l = 32 at EP = 1).
GEMM2_SHAPES = [("seed T=8192 N=4096 E=8", 8192, 2048, 4096, 8, 2),
                ("seed T=8192 N=4096 E=64", 8192, 2048, 4096, 64, 2),
                ("seed T=16384 N=8192 E=16", 16384, 2048, 8192, 16, 2),
                ("mixtral gemm2", 8192, 14336, 4096, 8, 2),
                ("deepseek E_l=32 gemm2", 8192, 2048, 7168, 32, 8)]


def gemm2_shapes(quick: bool) -> list[tuple]:
  """GEMM2_SHAPES; with ``quick`` the first two (the seed shapes at T = 8192)."""
  return GEMM2_SHAPES[:2] if quick else list(GEMM2_SHAPES)


def gemm2_operands(seed: int, rows: int, tokens: int, F: int, D: int, E: int, k: int, dtype=jnp.bfloat16,
                   sharding=None):
  """Random (poison-free) operands of GEMM2 + combine: h [rows, F] and w2 [E, F, D] (scaled by 1/sqrt(F)) in
  ``dtype``, gates [tokens, k] float32 (softmax rows). ``sharding``: of all three (generated under jit with it, so
  no device holds a whole global array), or None."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  gen = lambda: (jax.random.normal(ks[0], (rows, F), jnp.float32).astype(dtype),
                 (jax.random.normal(ks[1], (E, F, D), jnp.float32) / np.sqrt(F)).astype(dtype),
                 jax.nn.softmax(jax.random.normal(ks[2], (tokens, k)), -1).astype(jnp.float32))
  return jax.jit(gen, out_shardings=None if sharding is None else (sharding,) * 3)()


def weighted_combine(out_rows, slot_row, gates):
  """y[t] = sum_j gates[t, j] * out_rows[slot_row[t*k + j]] in float32, in out_rows' dtype (every slot kept: the
  benchmarks' plans are dropless). out_rows [M, N], slot_row [T*k] int32, gates [T, k] float32 -> y [T, N]."""
  T, k = gates.shape
  per_slot = jnp.take(out_rows, slot_row, axis=0).astype(jnp.float32).reshape(T, k, -1)
  return jnp.einsum("tk,tkd->td", gates, per_slot).astype(out_rows.dtype)


def reference_rows(h, w2, group_sizes):
  """The float32 reference of a grouped GEMM2: jax.lax.ragged_dot of h [M, F] and w2 [G, F, N] upcast, at HIGHEST
  precision -> [M, N] float32 (rows past the groups zero)."""
  return jax.lax.ragged_dot(h.astype(jnp.float32), w2.astype(jnp.float32), group_sizes,
                            precision=jax.lax.Precision.HIGHEST)


@jax.jit
def _max_rel_err(got, ref):
  got, ref = got.astype(jnp.float32), ref.astype(jnp.float32)
  return jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref))


def max_rel_err(got, ref) -> float:
  """max |got - ref| / max |ref| of two arrays of one shape, in float32 where they are (on the devices: outputs are
  GBs); NaN if got has a NaN."""
  return float(_max_rel_err(got, ref))


def static_ragged_dot(group_sizes: np.ndarray):
  """fn(lhs [M, K], rhs [G, K, N], group_sizes) -> [M, N]: jax.lax.ragged_dot's result for the host ``group_sizes``
  [G] baked in as static row ranges (the group_sizes argument is ignored), at HIGHEST precision.

  A float32 reference near each group's own cost. jax.lax.ragged_dot runs every row against every group
  (dense-masked), G times the work: at DeepSeek-like sizes in float32 it took minutes. One dot per group has G
  different shapes, and XLA autotunes each one: at G = 32 forward+backward, that compile did not finish in 220 s
  on an H200. So the groups are gathered (static indices) into one [G, max group, K] batch, zero rows padding the
  short ones, and multiplied as one batched dot; the rows are gathered back. Rows past the groups' sum come out
  zero, as in ragged_dot. Gathers and one dot differentiate as ragged_dot does."""
  sizes = np.asarray(group_sizes).astype(np.int64)
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  width = max(int(sizes.max(initial=0)), 1)
  j = np.arange(width)

  def fn(lhs, rhs, group_sizes_unused=None):
    del group_sizes_unused
    m = lhs.shape[0]
    # Row (g, j) of the batch is lhs row starts[g] + j, or the appended zero row m past the group's end.
    take = np.where(j[None, :] < sizes[:, None], starts[:, None] + j[None, :], m)
    lhs0 = jnp.concatenate([lhs, jnp.zeros((1, lhs.shape[1]), lhs.dtype)])
    prod = jnp.einsum("gmk,gkn->gmn", lhs0[take], rhs, precision=jax.lax.Precision.HIGHEST)
    # Output row r is batch row (g, r - starts[g]) of its group g, or the appended zero row past the groups' sum.
    rows = np.arange(m)
    g = np.minimum(np.searchsorted(np.cumsum(sizes), rows, side="right"), len(sizes) - 1)
    back = np.where(rows < sizes.sum(), g * width + rows - starts[g], len(sizes) * width)
    flat = jnp.concatenate([prod.reshape(-1, prod.shape[2]), jnp.zeros((1, prod.shape[2]), prod.dtype)])
    return flat[back]
  return fn


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
