"""Shared pieces of the benchmark suite: timing, meshes, shapes, routings, result tables.

Timing: warm up, then time batches of back-to-back asynchronous calls (so per-call dispatch overlaps the
device work), rotate among several input sets (so repeated runs do not measure the L2), and report the median over
batches. Every number printed comes with the command line that produced it (``command_line()``).
"""

from __future__ import annotations

import argparse
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
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

AXIS = "expert"  # the mesh axis of every multi-device benchmark: tokens and experts are sharded over it


def shape_parser(out: str, *, skews: str | None = None, quick: bool = True) -> argparse.ArgumentParser:
  """The options the single-GPU benchmarks share: --quick (unless ``quick`` is False), --skews (when ``skews``
  gives the default list), --out (the JSON-lines file) and --shapes (``shape_selected``)."""
  ap = argparse.ArgumentParser()
  if quick:
    ap.add_argument("--quick", action="store_true")
  if skews is not None:
    ap.add_argument("--skews", default=skews)
  ap.add_argument("--out", default=out)
  ap.add_argument("--shapes", default="", help="comma-separated substrings: only shapes whose name holds one")
  return ap


def shape_selected(args, name: str) -> bool:
  """Whether --shapes (comma-separated substrings; empty: all) selects the shape called ``name``."""
  return not args.shapes or any(p in name for p in args.shapes.split(","))


def command_line() -> str:
  """The command that runs this process again: ``python3 -m benchmarks.X ...`` for a module run with -m."""
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  head = ["python3", "-m", spec.name] if spec is not None and spec.name else ["python3", sys.argv[0]]
  return " ".join(shlex.quote(a) for a in head + sys.argv[1:])


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


# The collectives that exchange rows between ranks: XLA:CPU's padded exchange and the GPU's / TPU's (xla_path.py).
EXCHANGES = ("all_to_all", "ragged_all_to_all")


def exchanged_rows(fn, *args, collectives=EXCHANGES) -> list[tuple[str, str, int]]:
  """(collective, element type, bytes per row) of each exchange of rows in ``fn``'s program as traced on ``args``
  (a row: an operand's last axis; signed integer operands, the exchanges' offsets and sizes, left out: rows of bytes
  move as bytes or as 4-byte words, uint8 or uint32), in
  program order; ``collectives``: the primitives counted. Counted on the jaxpr, so the same on every platform."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in collectives:
        aval = eqn.invars[0].aval
        if not jnp.issubdtype(aval.dtype, jnp.signedinteger):
          found.append((eqn.primitive.name, str(aval.dtype), aval.shape[-1] * aval.dtype.itemsize))
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          if isinstance(sub, jax.extend.core.ClosedJaxpr):
            walk(sub.jaxpr)
          elif isinstance(sub, jax.extend.core.Jaxpr):
            walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


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


def rank_map(mesh, fn):
  """jit(shard_map(fn)) over ``AXIS``, every operand and output split on its first dimension."""
  spec = P(AXIS)
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def of_rank(stacked):
  """Inside rank_map: this rank's slice of a pytree stacked over the ranks (every leaf without its leading [1])."""
  return jax.tree.map(lambda a: a[0], stacked)


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
# GEMM2 of the MoE layer (expert outputs -> d_model rows): shapes and operands of bench_fused and bench_ep_combine

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


SKEWS = {"balanced": 0.0, "moderate": 0.8, "stress": 2.0}  # Zipf exponent of the expert popularity


def layer_operands(T: int, D: int, F: int, E: int, k: int, seed: int = 0):
  """Random bf16 operands of one expert layer after the router: x [T, D], expert_ids [T, k] (uniform over E), gates
  [T, k] (a softmax), w1 [E, D, 2F] and w2 [E, F, D] scaled by 1/sqrt(fan-in)."""
  ks = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(ks[0], (T, D), jnp.bfloat16)
  ids = jax.random.randint(ks[1], (T, k), 0, E).astype(jnp.int32)
  gates = jax.nn.softmax(jax.random.normal(ks[2], (T, k)), -1)
  w1 = (jax.random.normal(ks[3], (E, D, 2 * F)) / np.sqrt(D)).astype(jnp.bfloat16)
  w2 = (jax.random.normal(ks[4], (E, F, D)) / np.sqrt(F)).astype(jnp.bfloat16)
  return x, ids, gates, w1, w2


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

