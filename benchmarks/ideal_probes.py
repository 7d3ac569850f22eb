"""The probes of bench_ep_layer's ideal: ours' expert compute alone, its communication alone and its dispatches
alone, each with its check (what each measures: bench_ep_layer's module docstring).

  compute_probe     expert_mlp on rows a rank already holds, with ours' per-rank group sizes.
  comm_probe_args   the layer's inputs with the expert width shrunk to COMM_PROBE_F: ours on them moves the same rows.
  dispatch_probe    ours' plan and dispatches, nothing else.
  wire_rows         the rows one of ours' transfers moves between ranks, from the plan of the routing.

``shape`` arguments are bench_ep_layer's Shape (fields tokens_per_rank, d, f, experts, k).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.common import AXIS
from benchmarks.references import Verdict
from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap.ops import CallConfig, RankInfo, Workspace, WorkspaceSizes, dispatch, expert_mlp

COMM_PROBE_F = 64     # expert width of the communication probe: K and N % 64 == 0 keep the wgmma engine


@functools.partial(jax.jit, static_argnums=(1,))
def _shrink_experts(ws, f: int):
  """(w1 [E, D, 2F], w2 [E, F, D]) -> ([E, D, 2f], [E, f, D]): the first f columns of w1's gate and up halves."""
  w1, w2 = ws
  F = w2.shape[1]
  return jnp.concatenate([w1[..., :f], w1[..., F:F + f]], axis=-1), w2[:, :f]


def comm_probe_args(args, f: int = COMM_PROBE_F):
  """The layer's inputs (x, ids, gates, w1, w2, ct) with the expert width F shrunk to min(f, F): ours on them moves
  the same rows (the routing, x and D are unchanged) with next to no GEMM work."""
  x, ids, gates, w1, w2, ct = args
  w1s, w2s = _shrink_experts((w1, w2), min(f, w2.shape[1]))
  return x, ids, gates, w1s, w2s, ct


def compute_probe(mesh, shape, want_grads: bool):
  """(prepare, fn) of the compute-alone probe on global arrays.

  prepare(x, ids) -> (x_recv [R cap, D], group_sizes [R E_local] int32), sharded over the mesh: per rank, ``cap``
  (ours' static recv rows) copies of its own tokens and the rows per local expert of ours' plan for these routings.
  fn(x_recv, group_sizes, w1, w2) -> expert_mlp's [R cap, D] output, or for fwd+bwd its gradients wrt x_recv, w1,
  w2 for the cotangent x_recv (any [cap, D] data does).
  """
  R = mesh.shape[AXIS]
  E, k, T_l = shape.experts, shape.k, shape.tokens_per_rank
  cap_e = plan_lib.expert_capacity(T_l, R, k, E, None)
  cap = plan_lib.recv_capacity(T_l, R, k, E // R, cap_e)
  spec = P(AXIS)

  def local_prepare(x, ids):
    _, _, plan = plan_lib.plan_over_axis(ids, E, AXIS, cap_e)         # as ours
    return jnp.tile(x, (-(-cap // x.shape[0]), 1))[:cap], plan.expert_rows

  def local_mlp(x_recv, group_sizes, w1, w2):
    return expert_mlp(x_recv, w1, w2, group_sizes)

  mlp = jax.shard_map(local_mlp, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec, check_vma=False)

  def grads(x_recv, group_sizes, w1, w2):
    _, vjp = jax.vjp(lambda a, b, c: mlp(a, group_sizes, b, c), x_recv, w1, w2)
    return vjp(x_recv)

  prepare = jax.jit(jax.shard_map(local_prepare, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec),
                                  check_vma=False))
  return prepare, jax.jit(grads if want_grads else mlp)


def dispatch_probe(mesh, shape, want_grads: bool):
  """(prepare, fn) of the dispatch-alone probe on global arrays: ours' dispatches and nothing else.

  prepare(x, ids) -> fn's arguments: (x, ids), for fwd+bwd (x, ids, d_slot [T k, D]) with d_slot random rows in x's
  dtype (made untimed, sharded like the slots: rank r's [T_local k, D] are its own slots').
  fn(x, ids[, d_slot]) -> x_recv [R cap, D] (for fwd+bwd also d_recv [R cap, D]): per rank, ours' plan (the count
  all_gather and make_plan of api._moe_local) and ours' forward dispatch of the token rows (slot_src_row = slot // k),
  with cap_e, cap and the RankInfo built as moe_experts builds them (the same WorkspaceSizes: the same workspace). For
  fwd+bwd a second dispatch of d_slot with slot_src_row = slot emulates the backward's dispatch of d_slot [T k, D]
  (_expert_block_bwd): one call moves the same D-wide rows as ours' two dispatches of a fwd+bwd pass.
  """
  R = mesh.shape[AXIS]
  E, k, T_l = shape.experts, shape.k, shape.tokens_per_rank
  cap_e = plan_lib.expert_capacity(T_l, R, k, E, None)
  cap = plan_lib.recv_capacity(T_l, R, k, E // R, cap_e)
  spec = P(AXIS)

  def local(x, ids, *d_slot, info):
    _, _, plan = plan_lib.plan_over_axis(ids, E, AXIS, cap_e)         # as ours
    T = ids.shape[0]
    x_recv = dispatch(x, jnp.arange(T * k, dtype=jnp.int32) // k, plan, cap, info)
    if not d_slot:
      return x_recv
    return x_recv, dispatch(d_slot[0], jnp.arange(T * k, dtype=jnp.int32), plan, cap, info)

  def fn(x, ids, *d_slot):
    sizes = WorkspaceSizes(row_bytes=x.shape[1] * x.dtype.itemsize, recv_rows=cap, ret_rows=T_l * k,
                           num_segments=E)
    info = RankInfo(Workspace.get(mesh, AXIS, sizes), CallConfig())
    local_fn = jax.shard_map(functools.partial(local, info=info), mesh=mesh, in_specs=(spec,) * (2 + len(d_slot)),
                             out_specs=(spec, spec) if d_slot else spec, check_vma=False)
    return local_fn(x, ids.astype(jnp.int32), *d_slot)

  def prepare(x, ids):
    if not want_grads:
      return x, ids
    make = jax.jit(lambda: jax.random.normal(jax.random.PRNGKey(7), (x.shape[0] * k, x.shape[1])).astype(x.dtype),
                   out_shardings=NamedSharding(mesh, spec))
    return x, ids, make()

  return prepare, jax.jit(fn)


def plan_placements(ids: np.ndarray, R: int, shape) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """Where ours' plan (dropless, as moe_experts builds it) sends each kept slot of global routing ``ids`` [T, k]:
  per source rank s, (dest rank, dest row, slot) of its kept slots, from make_plan on the host's counts."""
  E, k, T_l = shape.experts, shape.k, shape.tokens_per_rank
  cap_e = plan_lib.expert_capacity(T_l, R, k, E, None)
  ids = ids.reshape(R, T_l, k)
  counts_all = jnp.asarray(np.stack([np.bincount(ids[s].ravel(), minlength=E).reshape(R, E // R)
                                     for s in range(R)]))
  placements = []
  for s in range(R):
    plan = plan_lib.make_plan(jnp.asarray(ids[s], jnp.int32), counts_all, jnp.int32(s), cap_e)
    rank, row = np.asarray(plan.slot_dest_rank), np.asarray(plan.slot_dest_row)
    kept = row >= 0
    placements.append((rank[kept], row[kept], np.flatnonzero(kept)))
  return placements


def wire_rows(ids: np.ndarray, R: int, shape) -> int:
  """Rows one of ours' transfers (a dispatch, or a return of expert_combine) moves between ranks for routing ``ids``:
  the plan's kept slots whose destination rank is not their source rank. Each is one D-wide row; a slot whose expert
  is on its own rank stays in the rank's memory and is not counted."""
  return sum(int(np.count_nonzero(rank != s)) for s, (rank, _, _) in enumerate(plan_placements(ids, R, shape)))


def dispatch_probe_verdict(fn, sets, ids_np, mesh, shape) -> Verdict:
  """The dispatch probe's check: fn on the first set, every row each rank received against the source row the plan
  sends there (bit-exact; the placement from make_plan per source rank, slot_dest_rank / slot_dest_row, as
  tests/test_expert_combine.py's reference), for fwd+bwd also d_recv's rows against d_slot's. Rows past what a rank
  received are not checked. call_s 0, as compute_probe_verdict."""
  R = mesh.shape[AXIS]
  k, T_l = shape.k, shape.tokens_per_rank
  try:
    outs = fn(*sets[0])
  except Exception as e:  # pylint: disable=broad-except
    return Verdict(False, f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
  outs = outs if isinstance(outs, tuple) else (outs,)
  placements = plan_placements(ids_np[0], R, shape)
  srcs = (sets[0][0], *sets[0][2:])                                   # x (row = slot // k), d_slot (row = slot)
  for name, src, out, per in zip(("x_recv", "d_recv"), srcs, outs, (k, 1)):
    got = np.asarray(out).reshape(R, -1, out.shape[-1])
    rows = T_l * k // per
    for s, (rank, row, slot) in enumerate(placements):
      want = np.asarray(src[s * rows:(s + 1) * rows])[slot // per]
      bad = np.flatnonzero(np.any(got[rank, row].view(np.uint8) != want.view(np.uint8), axis=-1))
      if bad.size:
        p = slot[bad[0]]
        return Verdict(False, f"{name}: {bad.size} rows from rank {s} differ from the rows the plan sends (first: "
                              f"slot {p} at rank {rank[bad[0]]} row {row[bad[0]]})")
  n = sum(len(p[0]) for p in placements)
  return Verdict(True, f"{n} rows per dispatch where the plan sends them, bit-exact")


def recv_rows_per_expert(ids: np.ndarray, R: int, E: int) -> np.ndarray:
  """[R, E_local] rows each rank receives per local expert (dropless), counted on the host: the probe's check."""
  return np.bincount(ids.ravel(), minlength=E).reshape(R, E // R)


def compute_probe_verdict(fn, sets, ids_np, R: int, E: int) -> Verdict:
  """The compute probe's check: its group sizes are the routings' recv rows per (rank, local expert), and fn runs on
  the first set with finite outputs (there is no reference for copies of tokens). call_s 0: that one call compiles
  fn, and the probe is our GEMMs alone, never the slow one of a sweep."""
  for (_, gs, *_), ids in zip(sets, ids_np):
    if not np.array_equal(np.asarray(gs).reshape(R, E // R), recv_rows_per_expert(ids, R, E)):
      return Verdict(False, "its group sizes differ from the rows the routing sends each (rank, local expert)")
  try:
    outs = jax.tree.leaves(fn(*sets[0]))
  except Exception as e:  # pylint: disable=broad-except
    return Verdict(False, f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
  if not all(bool(jnp.all(jnp.isfinite(o))) for o in outs):
    return Verdict(False, "non-finite output")
  return Verdict(True, "group sizes = the routings' recv rows")
