"""expert_combine alone at expert parallelism R = every visible device: GEMM2, the push of every finished band to
its source rank, and the weighted combine, with the kernels' own per-rank record of each call.

A mesh of R devices on axis "expert" (all local devices, or ``--devices N``). Per rank: T tokens route top-k over
all E experts (``common.topk_routing``, balanced or stress skew), so about (R-1)/R of the rows a rank computes belong
to tokens of other ranks and are pushed to them. Inputs per rank, as the layer would hand them to GEMM2: h [cap, F]
rows in recv order (random bf16), its E/R experts' w2 [E/R, F, D], the gates of its T tokens; the dropless plan is
built once, outside the timing (as in bench_fused.py, which is this at R = 1). Every implementation's output is
compared with a float32 reference (each rank's rows by ragged_dot at HIGHEST precision, all-gathered, combined per
token; err = max |y - ref| / max |ref|) before it is timed (median of batches of back-to-back calls,
``common.time_fn``):

  ours         expert_combine, consumer CTA count C chosen by the resource manager (CallConfig())
  serialized   CallConfig(serialize=True): the same kernels, the consumer starts after the producer's last tile
  C=<c>        CallConfig(consumer_ctas=c) for each c of --ctas: an oracle sweep over C on real links
  oracle       the fastest C=<c> row (C: its c)
  bare gemm    grouped_matmul alone on each rank's rows (no communication, no combine; err against the reference
               rows)

Columns: ms per call of the whole group; vs_ours = ms / ours' ms (> 1: ours is faster); remote_MB per rank (rank 0
first, joined by "/"): the bytes the plan sends to other ranks (rows of remote segments x D x 2); wall_GBps: the
most any rank sends / ms. Then, after timing, one more call and ``Workspace.last_call_stats()`` (per rank, joined by
"/"; GPU only: empty on CPU, whose handlers record no spans):

  C           consumer CTAs the call used (the manager's pick for ours)
  prod_us     the producer's span: first tile start to last tile finish (%globaltimer of the rank's GPU)
  cons_us     the consumer's span: first push start to last push finish. Overlapped, it starts with the kernel and
              includes its waits for tiles; serialized, it starts after the last tile (the push alone)
  overlap_us  prod_us + cons_us - (last finish - first start): how long both ran at once (negative: a gap)
  outside_us  ms - the call's device span (BeginKernel start to CombineKernel end; where a record lacks them, the
              expert kernel's recorded work): launch gaps and host time between back-to-back calls
  push_GBps   the bytes the consumer pushed / cons_us
A note names any rank whose recorded pushed bytes differ from the plan's remote bytes. The JSON lines (--out) hold
the same rows plus ``stats``: every rank's CallStats (workspace_cuda.py) in full.

  python3 -m benchmarks.bench_ep_combine --out $OUT/ep_combine.jsonl                  # all GPUs
  python3 -m benchmarks.bench_ep_combine --quick --ctas 4,8                             # CPU dry run, 4 devices
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import common
from benchmarks import references
from benchmarks.common import AXIS, of_rank, rank_map
from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap.ops import CallConfig, RankInfo, Workspace, WorkspaceSizes, expert_combine, grouped_matmul

DTYPE = jnp.bfloat16
TOLERANCE = 2e-2  # bf16 outputs against the float32 reference
DEFAULT_SHAPES = "seed T=8192 N=4096 E=8,mixtral gemm2"
QUICK_SHAPE = ("quick", 64, 64, 64, 8, 2)  # (name, T per rank, K = F, N = D, E, k): a CPU dry run
COLUMNS = ["shape", "skew", "impl", "ms", "vs_ours", "err", "remote_MB", "wall_GBps", "C", "prod_us", "cons_us",
           "overlap_us", "outside_us", "push_GBps", "note"]


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="one tiny shape (a CPU dry run)")
  ap.add_argument("--shapes", default=DEFAULT_SHAPES,
                  help="comma-separated substrings of common.GEMM2_SHAPES names: only shapes whose name holds one")
  ap.add_argument("--skews", default="balanced,stress")
  ap.add_argument("--ctas", default="4,8,12,16,24,32", help="pinned consumer CTA counts C to time ('' for none)")
  ap.add_argument("--devices", type=int, default=None, help="mesh size R (default: all local devices)")
  ap.add_argument("--max-call-s", type=float, default=None,
                  help="do not time an implementation whose checked call took longer than this (seconds)")
  ap.add_argument("--out", default="ep_combine.jsonl")
  args = ap.parse_args(argv)
  args.ctas = [int(c) for c in args.ctas.split(",") if c]
  return args


def selected_shapes(args) -> list[tuple]:
  """(name, T per rank, F, D, E, k) of the run."""
  if args.quick:
    return [QUICK_SHAPE]
  return [s for s in common.gemm2_shapes(quick=False) if any(p in s[0] for p in args.shapes.split(","))]


# ----------------------------------------------------------------------------------------------------------------
# One shape and skew on the mesh: plan, operands, reference


@dataclasses.dataclass
class Case:
  """Everything the implementations of one (shape, skew) share. Global arrays, sharded over the mesh's ranks:
  arg_sets: 2 x (h [R cap, F], w2 [E, F, D], gates [R T, k] float32, plan with a leading [R] on every field);
  ref_rows [R cap, D] / ref_y [R T, D] float32: the reference GEMM rows / outputs; remote_bytes [R] (host): bytes
  each rank's plan sends to the other ranks."""

  name: str
  skew: str
  mesh: jax.sharding.Mesh
  ws: Workspace
  arg_sets: list
  ref_rows: jax.Array
  ref_y: jax.Array
  remote_bytes: np.ndarray


def make_plans(mesh, ids, E: int, cap_e: int) -> plan_lib.Plan:
  """ids [R T, k] -> every rank's dropless plan, stacked: each field gets a leading [R] (sharded over the ranks)."""

  def local(ids):
    _, _, plan = plan_lib.plan_over_axis(ids, E, AXIS, cap_e)
    return jax.tree.map(lambda a: a[None], plan)

  return rank_map(mesh, local)(ids)


def remote_bytes(plan: plan_lib.Plan, row_bytes: int) -> np.ndarray:
  """[R] bytes each rank pushes to the others: its rows of segments whose source is another rank, x row_bytes."""
  seg = np.asarray(plan.seg_rows, np.int64)  # [R, E_l, R_src]
  own = np.stack([seg[r, :, r] for r in range(seg.shape[0])])
  return (seg.sum(axis=(1, 2)) - own.sum(axis=1)) * row_bytes


def make_case(mesh, shape: tuple, skew: str) -> Case:
  name, T, F, D, E, k = shape
  R = mesh.shape[AXIS]
  cap_e = plan_lib.expert_capacity(T, R, k, E, None)
  cap = plan_lib.recv_capacity(T, R, k, E // R, cap_e)
  row_bytes = D * jnp.dtype(DTYPE).itemsize
  ws = Workspace.get(mesh, AXIS, WorkspaceSizes(row_bytes=row_bytes, recv_rows=cap, ret_rows=T * k,
                                                num_segments=E))
  sharding = NamedSharding(mesh, P(AXIS))
  ids = jax.device_put(jnp.asarray(common.topk_routing(R * T, E, k, skew)), sharding)
  plans = make_plans(mesh, ids, E, cap_e)
  arg_sets = [common.gemm2_operands(T + E + s, R * cap, R * T, F, D, E, k, DTYPE, sharding) + (plans,)
              for s in range(2)]
  ref_rows, ref_y = references.combine_reference(mesh, cap, *arg_sets[0])
  return Case(name, skew, mesh, ws, arg_sets, ref_rows, ref_y, remote_bytes(plans, row_bytes))


# ----------------------------------------------------------------------------------------------------------------
# Implementations: (h, w2, gates, plans) -> y [R T, D] (the bare GEMM: its rows [R cap, D])


def fused(mesh, ws: Workspace, config: CallConfig):
  info = RankInfo(ws, config)
  return rank_map(mesh, lambda h, w2, g, pl: expert_combine(h, w2, g, of_rank(pl), info, want_slots=False)[0])


def bare_gemm(mesh):
  return rank_map(mesh, lambda h, w2, g, pl: grouped_matmul(h, w2, of_rank(pl).expert_rows))


class Impl(NamedTuple):
  fn: object
  combines: bool  # an expert_combine (y against ref_y, stats recorded), else the bare GEMM (rows against ref_rows)


def implementations(case: Case, ctas: list[int]) -> dict[str, Impl]:
  impls = {"ours": Impl(fused(case.mesh, case.ws, CallConfig()), True),
           "serialized": Impl(fused(case.mesh, case.ws, CallConfig(serialize=True)), True)}
  for c in ctas:
    impls[f"C={c}"] = Impl(fused(case.mesh, case.ws, CallConfig(consumer_ctas=c)), True)
  impls["bare gemm"] = Impl(bare_gemm(case.mesh), False)
  return impls


# ----------------------------------------------------------------------------------------------------------------
# Rows


def joined(values, fmt: str = "{:.0f}") -> str:
  """Per-rank values as 'v0/v1/...' ('-' for a rank without one)."""
  return "/".join("-" if v is None else fmt.format(v) for v in values)


def stats_cells(stats, wall_ms: float, remote: np.ndarray) -> dict:
  """The stats columns of one row from ``Workspace.last_call_stats()`` (a CallStats per rank; None on CPU: no
  cells) after a call whose median time was wall_ms; the note names ranks whose pushed bytes differ from the plan's
  ``remote`` bytes."""
  if stats is None:
    return {}
  wall_us = wall_ms * 1e3
  cells = dict(C=joined([s.consumers for s in stats], "{}"), prod_us=joined([s.producer_us for s in stats]),
               cons_us=joined([s.consumer_us for s in stats]), overlap_us=joined([s.overlap_us for s in stats]),
               outside_us=joined([None if (s.call_us or s.busy_us) is None else wall_us - (s.call_us or s.busy_us)
                                  for s in stats]),
               push_GBps=joined([s.push_gbps for s in stats]))
  off = [f"rank {s.rank} pushed {s.pushed_bytes} B, plan {int(b)} B" for s, b in zip(stats, remote)
         if s.pushed_bytes != b]
  if off:
    cells["note"] = "; ".join(off)
  return cells


def timed_call_s(fn, args) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def measure(case: Case, impl: Impl, max_call_s: float | None) -> dict:
  """One implementation's cells: checked, then timed, then (an expert_combine) one more call's per-rank stats."""
  fn = impl.fn
  try:
    err = references.max_rel_err(fn(*case.arg_sets[0]), case.ref_y if impl.combines else case.ref_rows)
    if not err < TOLERANCE:
      return dict(err=f"{err:.1e}", ms="wrong result, not timed")
    call_s = timed_call_s(fn, case.arg_sets[0])
    if max_call_s and call_s > max_call_s:
      return dict(err=f"{err:.1e}", ms="skipped", note=f"one call took {call_s:.2f} s (> --max-call-s)")
    ms = common.time_fn(fn, case.arg_sets) * 1e3
    stats = None
    if impl.combines:
      jax.block_until_ready(fn(*case.arg_sets[0]))
      stats = case.ws.last_call_stats()
  except Exception as ex:  # pylint: disable=broad-except  (e.g. a pinned C past the SM budget: keep the sweep)
    return dict(ms=f"error: {type(ex).__name__}: {str(ex).splitlines()[0][:160]}")
  cells = dict(err=f"{err:.1e}", ms=f"{ms:.3f}", **stats_cells(stats, ms, case.remote_bytes))
  if impl.combines:
    cells["wall_GBps"] = f"{case.remote_bytes.max() / ms / 1e6:.4g}"
  if stats is not None:
    cells["stats"] = [dataclasses.asdict(s) for s in stats]
  return cells


def oracle_cells(rows: dict, ctas: list[int]) -> dict:
  """The oracle row: the fastest timed C=<c> row's ms and c (empty ms if none was timed)."""
  timed = {c: float(rows[f"C={c}"]["ms"]) for c in ctas if _is_number(rows.get(f"C={c}", {}).get("ms"))}
  if not timed:
    return dict(ms="none timed")
  best = min(timed, key=timed.get)
  return dict(ms=f"{timed[best]:.3f}", C=str(best), note=f"fastest pinned C of {sorted(timed)}")


def _is_number(s) -> bool:
  try:
    float(s)
    return True
  except (TypeError, ValueError):
    return False


def run_case(case: Case, ctas: list[int], max_call_s: float | None, table: common.Table) -> None:
  """Every implementation's row of one case, the oracle's before the bare GEMM's, each added as soon as it is
  measured (so a time-limited run keeps it), with vs_ours where both are timed."""
  rows = {}

  def add(name: str, cells: dict):
    rows[name] = row = dict.fromkeys(COLUMNS, "")
    row.update(shape=case.name, skew=case.skew, impl=name, **cells)
    if name != "bare gemm":
      row["remote_MB"] = joined(case.remote_bytes / 1e6, "{:.4g}")
    if _is_number(rows["ours"]["ms"]) and _is_number(row["ms"]):
      row["vs_ours"] = f"{float(row['ms']) / float(rows['ours']['ms']):.2f}"
    table.add(**row)

  for name, impl in implementations(case, ctas).items():
    if name == "bare gemm":
      add("oracle", oracle_cells(rows, ctas))
    add(name, measure(case, impl, max_call_s))


def run(args, table: common.Table) -> common.Table:
  mesh = common.expert_mesh(args.devices, AXIS)
  R = mesh.shape[AXIS]
  print(f"mesh: {R} x {jax.devices()[0].device_kind} on axis {AXIS!r}; pinned C {args.ctas}")
  for shape in selected_shapes(args):
    if shape[4] % R:
      print(f"{shape[0]}: skipped, {shape[4]} experts do not split over {R} ranks")
      continue
    for skew in args.skews.split(","):
      case = make_case(mesh, shape, skew)
      print(f"\n{shape[0]} {skew}, R={R}: remote MB per rank {joined(case.remote_bytes / 1e6, '{:.4g}')}; "
            f"consumer policy: {case.ws.device.consumer_policy} (started at {time.strftime('%H:%M:%S')})")
      run_case(case, args.ctas, args.max_call_s, table)
      del case
  return table


def main(argv=None):
  """Runs the sweep; on SIGTERM it stops and still writes --out and prints the rows done so far."""
  common.virtual_cpu_devices(sys.argv if argv is None else argv)  # a CPU dry run: --devices N, else 4
  args = parse_args(argv)
  with common.rows_kept_on_sigterm(common.Table(COLUMNS), args.out, "bench_ep_combine") as table:
    run(args, table)


if __name__ == "__main__":
  main()
