"""The routing plan: every offset that dispatch and expert_combine need, as a pure function of the routing.

One expert-parallel group has ``R`` ranks; rank ``r`` holds ``T`` tokens and the ``E_local = E / R`` experts
``r*E_local ... (r+1)*E_local - 1``. Each token picks ``k`` experts, giving ``P = T*k`` *slots*; slot
``p = t*k + j`` is token ``t``'s ``j``-th choice.

Layouts:

* **send order** (on the source rank): slots sorted stably by (destination rank, local expert). A slot's position
  in this order is also its row in the source's ``ret`` buffer, where its expert output comes back.
* **recv** (on the destination rank): rows grouped by (local expert ``e``, source rank ``s``), segment ``(e, s)``
  contiguous, in the sender's order inside a segment, segments packed in ``(e, s)`` order.
* **send once** (``slot_primary``): of a token's kept slots routed to one *other* rank, the first in the send order
  (the lowest expert id) is the *primary*: its row crosses the link, and the token's other slots for that rank take
  their recv rows' bytes from the primary's recv row on the receiver (docs/design.md, "Send once"). The recv layout
  is the same either way.

Capacity (Switch-Transformer semantics, deterministic): every expert takes at most ``expert_capacity`` rows per
call, first come first served in the global slot order ``(source rank, slot index)``. Dropped slots contribute
zero to the output, are counted, and are identical in the reference implementation (``reference.py``).

Skipped slots: expert id ``SKIP`` (-1) means "no selection" (a padding token, or a router that picks fewer than k
experts). Such a slot is in no count, takes no capacity, moves no row and computes nothing; it contributes zero to
the output and is not counted as dropped. It carries ``slot_dest_rank = rank`` (any valid rank would do) and
``slot_dest_row = slot_ret_row = -1``, which the custom calls skip like a dropped slot.

Because both sides compute the same plan from the gathered count matrix ``C[R_src, R_dst, E_local]``, no per-row
metadata crosses the wire.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

SKIP = -1  # the expert id of a skipped slot


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Plan:
  """Per-rank routing plan. All arrays are int32.

  Sender side (this rank's ``P = T*k`` slots, in slot order):
    slot_dest_rank: [P] rank that owns the slot's expert (this rank for a skipped slot); -1 marks an invalid id
      (outside [0, E) and not ``SKIP``).
    slot_dest_row: [P] row in that rank's recv buffer, -1 if the slot was dropped; for an invalid id the id itself
      (the custom calls name it in their error).
    slot_ret_row: [P] row in this rank's ret buffer where the slot's output returns, -1 if dropped.
    ret_rows: [] number of kept slots (rows this rank receives back in expert_combine).
    send_order: [P] the slot at each send position (the inverse of the send order).
    send_start: [R + 1] first send position of the rows for each destination rank; send_start[R] = the slots that
      are not skipped. (dispatch_gemm pushes the send order in 128-position blocks.)
    slot_primary: [P] the slot whose row carries this slot's bytes to its destination (send once): for a kept slot
      routed to another rank, the kept slot of the same token and destination first in the send order (itself, if it
      is that slot); every other slot (kept by this rank, dropped, skipped, invalid) names itself.
  Receiver side (this rank's local experts):
    seg_rows: [E_local, R] kept rows of segment (local expert e, source rank s).
    seg_ret_off: [E_local, R] first ret row of that segment on its source rank.
    expert_rows: [E_local] rows per local expert in recv (the grouped GEMM's group sizes).
    recv_rows: [] total rows this rank receives in dispatch.
  dropped: [] slots of this rank dropped by the capacity rule (skipped slots are not dropped).
  """

  slot_dest_rank: jax.Array
  slot_dest_row: jax.Array
  slot_ret_row: jax.Array
  ret_rows: jax.Array
  send_order: jax.Array
  send_start: jax.Array
  slot_primary: jax.Array
  seg_rows: jax.Array
  seg_ret_off: jax.Array
  expert_rows: jax.Array
  recv_rows: jax.Array
  dropped: jax.Array


def expert_capacity(tokens_per_rank: int, ranks: int, top_k: int, num_experts: int,
                    capacity_factor: float | None) -> int:
  """Rows one expert may take per call. ``None`` means dropless: every token of the group, once."""
  dropless = tokens_per_rank * ranks
  if capacity_factor is None:
    return dropless
  if capacity_factor <= 0:
    raise ValueError(f"jax_moe_overlap: capacity_factor must be positive or None (dropless), got {capacity_factor}")
  cap = math.ceil(capacity_factor * tokens_per_rank * ranks * top_k / num_experts)
  return max(1, min(cap, dropless))


def recv_capacity(tokens_per_rank: int, ranks: int, top_k: int, experts_per_rank: int, expert_cap: int) -> int:
  """Static rows of a rank's recv buffer: no more than its experts' capacity, nor than every slot of the group."""
  return min(experts_per_rank * expert_cap, tokens_per_rank * ranks * top_k)


def local_counts(expert_ids: jax.Array, num_experts: int) -> jax.Array:
  """[T, k] global expert ids -> [E] slot counts of this rank (reshape to [R, E_local] for the gather).

  Skipped slots (id ``SKIP``) count nowhere. Other ids outside [0, E) count as expert 0, exactly as ``make_plan``
  treats them, so every rank's plan stays consistent while the custom call on the offending rank reports them.
  """
  ids = expert_ids.reshape(-1)
  key = _group_key(ids, num_experts)
  return jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)[:num_experts]


def _group_key(ids: jax.Array, num_experts: int) -> jax.Array:
  """The send-order key of each slot: its expert id; ``num_experts`` (after every expert) for a skipped slot; 0 for
  an invalid id (it is reported by the custom calls)."""
  ids = ids.astype(jnp.int32)
  return jnp.where(ids == SKIP, num_experts, jnp.where((ids >= 0) & (ids < num_experts), ids, 0))


def exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
  return jnp.cumsum(x, axis=axis) - x


def kept_counts(counts: jax.Array, expert_cap: int) -> jax.Array:
  """[R_src, R_dst, E_local] slot counts -> the rows of each (source, expert) group that the capacity keeps: first
  come first served over source ranks, per expert."""
  counts = counts.astype(jnp.int32)
  return jnp.clip(expert_cap - exclusive_cumsum(counts, axis=0), 0, counts)


def plan_over_axis(expert_ids: jax.Array, num_experts: int, axis_name: str, expert_cap: int,
                   gather: Callable[[jax.Array], jax.Array] | None = None):
  """Inside ``shard_map`` over ``axis_name``: gathers every rank's ``local_counts`` and computes this rank's plan.
  Returns (counts [R_src, R_dst, E_local] int32, rank [] int32, ``Plan``). The one place the counts cross ranks, for
  every expert-parallel path (the custom calls' and the pure-JAX one).

  gather: [R_dst, E_local] -> [R_src, R_dst, E_local], every rank's counts in rank order; default
  ``jax.lax.all_gather`` over the axis (the custom calls pass ``workspace_calls.gather_counts``, which picks it or the
  workspace's own bounded exchange).
  """
  R = jax.lax.axis_size(axis_name)
  rank = jax.lax.axis_index(axis_name).astype(jnp.int32)
  counts = local_counts(expert_ids, num_experts).reshape(R, num_experts // R)
  if gather is None:
    counts_all = jax.lax.all_gather(counts, axis_name)                      # [R_src, R_dst, E_local]
  else:
    counts_all = gather(counts)
  return counts_all, rank, make_plan(expert_ids, counts_all, rank, expert_cap)


def make_plan(expert_ids: jax.Array, counts: jax.Array, rank: jax.Array, expert_cap: int) -> Plan:
  """Computes this rank's plan.

  Args:
    expert_ids: [T, k] int32 global expert ids of this rank's tokens.
    counts: [R_src, R_dst, E_local] int32 slot counts of every rank of the group (gathered ``local_counts``).
    rank: [] int32 this rank's position on the expert axis.
    expert_cap: static rows per expert (``expert_capacity``).
  """
  T, k = expert_ids.shape
  R, _, E_l = counts.shape
  P = T * k
  counts = counts.astype(jnp.int32)
  kept = kept_counts(counts, expert_cap)

  raw = expert_ids.reshape(P).astype(jnp.int32)
  E = R * E_l
  skipped = raw == SKIP
  valid = (raw >= 0) & (raw < E)
  key = _group_key(raw, E)                                   # skipped slots sort after every group
  flat = jnp.minimum(key, E - 1)
  dest = flat // E_l
  e_loc = flat % E_l
  # Stable sort by group id (d, e) = global expert id: the send order. pos = slot's index in the send order.
  order = jnp.argsort(key, stable=True)
  pos = jnp.zeros((P,), jnp.int32).at[order].set(jnp.arange(P, dtype=jnp.int32))
  my_counts = counts[rank].reshape(E)                         # [E] counts of this rank, (d, e) order
  send_start = exclusive_cumsum(my_counts)                   # first send position of each group
  pos_in_group = pos - send_start[flat]
  my_kept = kept[rank].reshape(E)
  is_kept = (pos_in_group < my_kept[flat]) & ~skipped

  # recv_off[d, e, s]: first recv row of segment (e, s) on rank d (segments packed in (e, s) order).
  kept_des = jnp.transpose(kept, (1, 2, 0))                    # [d, e, s]
  recv_off = exclusive_cumsum(kept_des.reshape(R, E_l * R)).reshape(R, E_l, R)
  dest_row = recv_off[dest, e_loc, rank] + pos_in_group

  # seg_ret_off[e, s] = first send position of group (rank, e) on source s.
  send_start_all = exclusive_cumsum(counts.reshape(R, R * E_l)).reshape(R, R, E_l)  # [s, d, e]
  seg_ret_off = jnp.transpose(send_start_all[:, rank, :], (1, 0))                     # [e, s]
  seg_rows = jnp.transpose(kept[:, rank, :], (1, 0))                                  # [e, s]
  ret_rows = jnp.sum(my_kept)

  # slot_primary: per token, among its kept slots with the same remote destination, the one first in send order.
  remote = is_kept & valid & (dest != rank)
  tok_dest, tok_pos, tok_remote = dest.reshape(T, k), pos.reshape(T, k), remote.reshape(T, k)
  same = (tok_dest[:, :, None] == tok_dest[:, None, :]) & tok_remote[:, None, :]      # [T, j, j'] j' may carry j
  first = jnp.argmin(jnp.where(same, tok_pos[:, None, :], P), axis=2).astype(jnp.int32)  # [T, j]
  own = jnp.arange(P, dtype=jnp.int32)
  slot_primary = jnp.where(remote, (own // k) * k + first.reshape(P), own)
  return Plan(
      slot_dest_rank=jnp.where(valid, dest, jnp.where(skipped, rank, -1)).astype(jnp.int32),
      slot_dest_row=jnp.where(valid | skipped, jnp.where(is_kept, dest_row, -1), raw).astype(jnp.int32),
      slot_ret_row=jnp.where(is_kept, pos, -1).astype(jnp.int32),
      ret_rows=ret_rows.astype(jnp.int32),
      send_order=order.astype(jnp.int32),
      send_start=jnp.concatenate([send_start.reshape(R, E_l)[:, 0], jnp.sum(my_counts, keepdims=True)]
                                 ).astype(jnp.int32),
      slot_primary=slot_primary.astype(jnp.int32),
      seg_rows=seg_rows.astype(jnp.int32),
      seg_ret_off=seg_ret_off.astype(jnp.int32),
      expert_rows=jnp.sum(seg_rows, axis=1).astype(jnp.int32),
      recv_rows=jnp.sum(seg_rows).astype(jnp.int32),
      dropped=(P - jnp.sum(skipped) - ret_rows).astype(jnp.int32),
  )


def packed_rows(expert_ids: jax.Array, counts: jax.Array, rank: jax.Array, expert_cap: int,
                plan: Plan) -> tuple[jax.Array, jax.Array]:
  """(packed_row [P], packed_slot [P]) int32: each kept slot's row among this rank's kept slots in the send order
  (the send order without its dropped and skipped slots: its row in a packed send buffer, and where its expert
  output lands in a packed return, ``packed_return``), P for a slot not kept; and the inverse, the slot at each
  packed row, P past the kept slots (a scatter of P indices, not of rows, so that both ways of a row can be
  gathers). expert_ids [T, k], counts [R_src, R_dst, E_local] and expert_cap as ``make_plan`` took them, ``plan``
  its result."""
  P = plan.slot_ret_row.shape[0]
  R, _, E_l = counts.shape
  my_counts = counts[rank].reshape(R * E_l).astype(jnp.int32)
  my_kept = kept_counts(counts, expert_cap)[rank].reshape(R * E_l)
  group = jnp.clip(expert_ids.reshape(P).astype(jnp.int32), 0, R * E_l - 1)   # a kept slot's expert: its group
  # slot_ret_row is the slot's place in the whole send order; the slots dropped from the groups before its own
  # are the gaps before it.
  row = jnp.where(plan.slot_ret_row >= 0, plan.slot_ret_row - exclusive_cumsum(my_counts - my_kept)[group],
                  P).astype(jnp.int32)
  return row, jnp.full((P,), P, jnp.int32).at[row].set(jnp.arange(P, dtype=jnp.int32), mode="drop")


def packed_return(counts: jax.Array, rank: jax.Array, expert_cap: int, rows: int) -> tuple[jax.Array, jax.Array]:
  """The way back of this rank's ``rows`` recv rows (the plan's recv layout: segments (local expert e, source s) in
  (e, s) order, the sender's order inside each): (dest_rank [rows], dest_row [rows]) int32, each kept recv row's
  source rank and its row there among the source's packed rows (``packed_rows`` on the source); this rank and -1
  past the kept rows."""
  kept = kept_counts(counts, expert_cap)                                     # [s, d, e]
  R, _, E_l = kept.shape
  seg = jnp.transpose(kept[:, rank, :], (1, 0)).reshape(E_l * R)           # rows of segment (e, s) here
  ends = jnp.cumsum(seg)
  i = jnp.arange(rows, dtype=jnp.int32)
  idx = jnp.minimum(jnp.searchsorted(ends, i, side="right"), E_l * R - 1).astype(jnp.int32)
  e, s = idx // R, idx % R
  # Segment (e, s) starts on source s after the kept rows of its groups (destination d, expert e') before (rank, e).
  start = exclusive_cumsum(kept.reshape(R, R * E_l), axis=1).reshape(R, R, E_l)[s, rank, e]
  inside = i < ends[-1]
  return (jnp.where(inside, s, rank).astype(jnp.int32),
          jnp.where(inside, start + i - (ends - seg)[idx], -1).astype(jnp.int32))
