"""Expert tensor parallelism in the loopback harness (issue 32; docs/design.md, "Expert tensor parallelism").

A case with ``tensor`` = TP > 1 runs the exchange group of ``impl="overlap"`` with a tensor axis on one GPU: R = R_e
TP ranks, rank g = r TP + t (expert rank r, tensor rank t). What the kernels see is built by the layer's own
functions (``jax_moe_overlap.tensor_parallel``):

* the routing: each rank's [T, k] expert ids and gates become its [T, k TP] shard slots by ``shard_slots`` (choice j
  of expert e -> slots j TP + s, the shard experts of e on the TP ranks of e's expert rank, each with gate j), and
  their plans come from plan.py as any case's (``cases.make_plans``);
* the weights: whole experts split as the layer lays them out on its (expert, tensor) mesh (``operand_specs``):
  expert_combine's w [E, K, N] (the layer's w2, K = F) by rows, dispatch_gemm's w1 [E, D, 2F] through its view
  [E, D, 2, F] (``w1_view``) along F, then ``gate_up_shards`` -> [E_l, D, 2F / TP] (the rank's gate columns, then
  its up columns: what GEMM1 and the SwiGLU take);
* expert_combine's lhs: each (token, choice) has one whole row of K values (the hidden activations the whole expert
  computes on it), and its shard slot s is received with its s-th K / TP columns (w2's rows on tensor rank s).

The references (``references``) are the whole experts', in float32: y[t] = sum_j g_j h_(t, j) W[e_j] over the
choices the capacity keeps (``kept``: the layer's rule stated independently of plan.py), and dispatch_gemm's GEMM1
x W1[e] of the whole expert, of which rank g must hold the gate and the up columns t F / TP ... (t + 1) F / TP - 1.
So a pass shows that the kernels' partial sums over the shards reproduce the unsplit experts (within the dtype's
tolerance), next to check.py's per-slot partials (from each rank's own operands) and its exact dispatch.

With ``gather_rs`` the shards' partials are summed by GEMM2 + GatherRS (docs/design.md, "GatherRS") instead of
expert_combine's per-slot return: each rank gets the gate of each of its recv rows and the table of the recv rows of
every source's tokens (``gather_tables``: what the layer's metadata dispatch gives it, stated here from the plans), and
``gather_sums`` restates the operator's float32 sums in its order, from the GEMM rows the call returns, for the
bitwise check.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from tools.loopback.cases import Case, RankData, Values, make_plans, random_values, route

AXES = ("expert", "tensor")  # the layer's mesh axes, as tensor_parallel.operand_specs names them here


@dataclasses.dataclass
class Whole:
  """A rank's routing and rows as the layer sees them, before the slot expansion, and the whole experts."""
  ids: np.ndarray       # [T, k] expert ids
  gates: np.ndarray     # [T, k] float32
  h: Values             # [T, k, K]: each choice's whole row of expert_combine's lhs
  w: Values             # [E, K, N]: expert_combine's w (every rank's the same arrays)
  w1: Values | None     # dispatch_gemm: [E, D, 2F] (gate | up)


_JIT: dict[str, Any] = {}


def shard_slots(case: Case, ids: np.ndarray, gates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """[T, k] ids and gates -> [T, k TP] shard slot ids (int32) and gates (float32): the layer's
  ``tensor_parallel.shard_slots``, under JAX on the CPU."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap import tensor_parallel  # pylint: disable=g-import-not-at-top
  if "shard_slots" not in _JIT:
    _JIT["shard_slots"] = jax.jit(tensor_parallel.shard_slots, static_argnums=(2, 3, 4))
  with jax.default_device(jax.devices("cpu")[0]):
    v, g = _JIT["shard_slots"](ids.astype(np.int32), gates.astype(np.float32), case.experts, case.expert_ranks,
                               case.tensor)
  return np.asarray(v, np.int32), np.asarray(g, np.float32)


def rank_block(a: np.ndarray, spec, case: Case, rank: int) -> np.ndarray:
  """Rank `rank`'s block of the whole array `a` laid out by the PartitionSpec `spec` (over AXES) on the mesh of
  expert_ranks x tensor devices, rank = r tensor + t: what shard_map hands that device."""
  sizes = dict(zip(AXES, (case.expert_ranks, case.tensor)))
  coords = dict(zip(AXES, divmod(rank, case.tensor)))
  index = []
  for dim, entry in enumerate(tuple(spec) + (None,) * (a.ndim - len(spec))):
    names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    n, i = 1, 0
    for name in names:
      n, i = n * sizes[name], i * sizes[name] + coords[name]
    size = a.shape[dim] // n
    index.append(slice(i * size, (i + 1) * size))
  return np.ascontiguousarray(a[tuple(index)])


def rank_weights(case: Case, rank: int, w: Values, w1: Values | None) -> tuple[Values, Values | None]:
  """The whole experts' w [E, K, N] and w1 [E, D, 2F] -> rank `rank`'s expert_combine w [E_l, K / TP, N] and
  dispatch_gemm w1 [E_l, D, 2F / TP], split by the layer's layout functions."""
  from jax_moe_overlap import tensor_parallel as tp  # pylint: disable=g-import-not-at-top
  _, w1_spec, w2_spec = tp.operand_specs(AXES[0], AXES[1], ())
  w_rank = Values(rank_block(w.data, w2_spec, case, rank))
  if w1 is None:
    return w_rank, None
  w1_rank = Values(np.ascontiguousarray(tp.gate_up_shards(rank_block(tp.w1_view(w1.data, np.reshape), w1_spec, case,
                                                                     rank))))
  return w_rank, w1_rank


def make_data_set(case: Case, rng: np.random.Generator) -> list[RankData]:
  """One data set of a tensor-parallel case: every rank's routing expanded to shard slots, plans, operands."""
  R, T, k, TP, E, D, K, N = (case.ranks, case.tokens, case.top_k, case.tensor, case.experts, case.d_model,
                             case.k_dim, case.n_dim)
  ids = [route(rng, case, g) for g in range(R)]
  gates = [rng.uniform(0.1, 1.0, (T, k)).astype(np.float32) for _ in range(R)]
  slots = [shard_slots(case, i, g) for i, g in zip(ids, gates)]
  plans = make_plans(case, [v for v, _ in slots])
  w = random_values(rng, (E, K, N), 1.0 / math.sqrt(K), case.f32)
  w1 = random_values(rng, (E, D, K), 1.0 / math.sqrt(D), case.f32) if case.dg else None
  xs = [random_values(rng, (T, D), 1.0, case.f32) for _ in range(R)]
  hs = [random_values(rng, (T, k, K), 1.0, case.f32) for _ in range(R)]
  out = []
  for d in range(R):
    # lhs row of each shard slot received: its (token, choice)'s whole row, the slot's shard s of the columns; the
    # received rows only (the runner pads them to cap rows of NaN, as cases.make_data's).
    lhs = Values(np.zeros((int(plans[d]["recv_rows"]), K // TP), hs[0].data.dtype))
    for s in range(R):
      pl = plans[s]
      sel = np.nonzero((pl["slot_dest_rank"] == d) & (pl["slot_dest_row"] >= 0))[0]
      rows, choice, shard = pl["slot_dest_row"][sel], sel // TP, sel % TP
      lhs.data[rows] = hs[s].data.reshape(T * k, TP, K // TP)[choice, shard]
    w_rank, w1_rank = rank_weights(case, d, w, w1)
    out.append(RankData(plans[d], slots[d][0], xs[d], lhs, w_rank, slots[d][1].reshape(-1), w1_rank,
                        Whole(ids[d], gates[d], hs[d], w, w1)))
  if case.gather_rs:
    for d, (row_gate, token_rows) in enumerate(gather_tables(case, out)):
      out[d].row_gate, out[d].token_rows = row_gate, token_rows
  return out


def gather_tables(case: Case, data: list[RankData]) -> list[tuple[np.ndarray, np.ndarray]]:
  """Per rank d, gather_rs's row_gate [cap] float32 (the gate of the slot each recv row serves, 0 past the received
  rows) and token_rows [R, T, Q] int32 (the recv row here of slot q of source s's token t, -1: none), from the
  sources' plans and shard gates: what gather_rs_block._recv_tables builds from the dispatched metadata."""
  R, T, Q, cap = case.ranks, case.tokens, case.slot_top_k, case.cap
  out = [(np.zeros(cap, np.float32), np.full((R, T, Q), -1, np.int32)) for _ in range(R)]
  for s, src in enumerate(data):
    dest, row = src.plan["slot_dest_rank"], src.plan["slot_dest_row"]
    for d in range(R):
      p = np.nonzero((dest == d) & (row >= 0))[0]
      out[d][0][row[p]] = src.gates[p]
      out[d][1][s].reshape(-1)[p] = row[p]
  return out


def gather_sums(case: Case, data: list[RankData], rows: list[np.ndarray]) -> list[np.ndarray]:
  """Every rank's y in float32 as GatherRS computes it from the GEMM rows `rows` (rank g's [cap, N] float32 values
  of its rows output): rank g's partial of source s's token t is sum over q = 0, 1, ..., Q - 1 of row_gate[i] *
  rows[i] (i = token_rows[s, t, q] >= 0) from 0, and s sums the partials in rank order 0, 1, ..., R - 1 from 0; every
  product and sum rounded to float32 on its own (numpy's float32 operations), as the CPU handler and the kernel do."""
  R, T, Q, N = case.ranks, case.tokens, case.slot_top_k, case.n_dim
  ys = []
  for s in range(R):
    y = np.zeros((T, N), np.float32)
    for g in range(R):
      part = np.zeros((T, N), np.float32)
      for q in range(Q):
        i = data[g].token_rows[s, :, q]
        m = i >= 0
        part[m] = part[m] + data[g].row_gate[i[m]][:, None] * rows[g][i[m]]
      y = y + part
    ys.append(y)
  return ys


def kept(case: Case, ids: list[np.ndarray]) -> list[np.ndarray]:
  """Every rank's [T, k] bool: the choices the capacity keeps. The layer's rule, stated without plan.py: each expert
  takes at most expert_cap rows, first come first served in the group's global slot order (source rank, token,
  choice); every shard of an expert keeps the expert's."""
  taken = np.zeros(case.experts, np.int64)
  out = []
  for i in ids:
    keep = np.zeros(i.size, bool)
    for p, e in enumerate(i.reshape(-1).tolist()):
      keep[p] = taken[e] < case.expert_cap
      taken[e] += 1
    out.append(keep.reshape(i.shape))
  return out


def references(case: Case, data: list[RankData], out: list) -> None:
  """Fills each rank's y (check.Expected; tokens t % check_stride == 0) and, with dispatch_gemm, its GEMM1 rows
  (a, a_checked) from the whole experts in float32."""
  R, T, k, TP, K = case.ranks, case.tokens, case.top_k, case.tensor, case.k_dim
  stride = case.check_stride
  keep = kept(case, [d.whole.ids for d in data])
  for s, src in enumerate(data):
    wh = src.whole
    use = keep[s] & (np.arange(T) % stride == 0)[:, None]
    part = np.zeros((T, k, case.n_dim), np.float32)
    for e in np.unique(wh.ids[use]):
      sel = use & (wh.ids == e)
      part[sel] = wh.h.rows(sel) @ wh.w.rows(e)
    out[s].y = (part * wh.gates[:, :, None]).sum(axis=1, dtype=np.float32)
  if not case.dg:
    return
  F = K // 2
  for s, src in enumerate(data):
    pl, wh = src.plan, src.whole
    for d in range(R):
      sel = np.nonzero((pl["slot_dest_rank"] == d) & (pl["slot_dest_row"] >= 0))[0]
      choice = sel // TP
      token = choice // k
      sel, choice, token = (a[token % stride == 0] for a in (sel, choice, token))
      experts = wh.ids.reshape(-1)[choice]
      t = d % TP
      for e in np.unique(experts):
        m = experts == e
        a = src.x.rows(token[m]) @ wh.w1.rows(e)                         # [rows, 2F] gate | up, whole expert
        a = a.reshape(-1, 2, TP, F // TP)[:, :, t].reshape(-1, 2 * F // TP)  # rank d's gate and up columns
        rows = pl["slot_dest_row"][sel[m]]
        out[d].a[rows] = a
        out[d].a_checked[rows] = True
