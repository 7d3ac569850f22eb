"""The differentiable expert block of one rank whose tensor shards' partials are summed by GatherRS
(``CallConfig.tensor_reduce``, ``call_site.tensor_reduce``; docs/design.md, "GatherRS"): dispatch -> GEMM1 +
SwiGLU -> gather_rs, with a ``custom_vjp``.

GatherRS applies the gates where the rows are, so each rank needs, for each of its recv rows, the gate and the
source slot the per-slot path keeps at the token's owner. One dispatch of a float32 metadata row per slot carries
them (``_slot_meta``: the gate, the slot's index, its place among its source's kept slots), and ``_recv_tables``
turns them into the call's operands: row_gate [cap] and token_rows [R, T, Q] (the recv row of slot q of source s's
token t here).

Backward:
- dy goes to the experts per slot, unscaled (a dispatch, or dispatch_gemm with dy W2^T), so that each rank has dy
  beside its GEMM2 rows; d_out = gate * dy and dh = gate * (dy W2^T) in float32;
- the gates' gradient: each rank's partial dot product dy . row per recv row, returned to the slot's source by a
  dispatch in the reverse direction (one float32 row per kept slot, at its place among the source's kept slots); a
  choice's TP shard partials are then summed in tensor order by ``tensor_parallel.repeat_gates``' gradient;
- dx = gather_rs of da W1^T (W1 read transposed) with unit gates: the same sum over the group in rank order.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_overlap import expert_gemms
from jax_moe_overlap.call_site import RankInfo
from jax_moe_overlap.expert_block import dispatch_and_gemm1, fuses_dispatch
from jax_moe_overlap.plan import Plan
from jax_moe_overlap.workspace_calls import dispatch, dispatch_gemm, gather_rs

# float32 columns of a metadata row (gate, slot, kept index, 0): 16 bytes, the dispatch's vector width on the GPU.
_META = 4


def _slot_meta(gates: jax.Array, plan: Plan):
  """[T, Q] gates of this rank's slots -> (meta [T Q, 4] float32: gate, slot index, kept index, 0; kept index [T Q]
  int32). A slot's kept index is its place among this rank's kept slots in send order (-1: dropped or skipped): the
  row the gates' gradient of the slot comes back to. Indices below 2^24 are exact in float32
  (``call_site.GATHER_RS_MAX_SLOTS``)."""
  P = gates.size
  kept = plan.slot_ret_row >= 0
  kept_by_pos = kept[plan.send_order].astype(jnp.int32)                        # at each send position
  kept_before = jnp.cumsum(kept_by_pos) - kept_by_pos
  kept_index = jnp.where(kept, kept_before[jnp.maximum(plan.slot_ret_row, 0)], -1).astype(jnp.int32)
  meta = jnp.stack([gates.reshape(P).astype(jnp.float32), jnp.arange(P, dtype=jnp.float32),
                    kept_index.astype(jnp.float32), jnp.zeros((P,), jnp.float32)], axis=1)
  return meta, kept_index


def _recv_tables(meta_recv: jax.Array, plan: Plan, ranks: int, T: int, Q: int):
  """The recv rows' metadata [cap, 4] -> (row_gate [cap] float32, token_rows [R, T, Q] int32, src [cap] int32: the
  source of each recv row, kept_index [cap] int32: its slot's place among the source's kept slots, valid [cap] bool:
  a received row). Recv rows are packed by (local expert, source) segment from row 0 (plan.py)."""
  cap = meta_recv.shape[0]
  i = jnp.arange(cap, dtype=jnp.int32)
  seg_end = jnp.cumsum(plan.seg_rows.reshape(-1))                               # (expert, source) order
  src = (jnp.searchsorted(seg_end, i, side="right") % ranks).astype(jnp.int32)
  valid = i < plan.recv_rows
  slot = meta_recv[:, 1].astype(jnp.int32)
  row_gate = jnp.where(valid, meta_recv[:, 0], 0.0)
  flat = jnp.where(valid, src * (T * Q) + slot, ranks * T * Q)
  token_rows = jnp.full((ranks * T * Q,), -1, jnp.int32).at[flat].set(i, mode="drop").reshape(ranks, T, Q)
  return row_gate, token_rows, src, meta_recv[:, 2].astype(jnp.int32), valid


def _forward(x, gates, w1, w2, plan, cap, info, keep: bool):
  T, Q = gates.shape
  x_recv, h, a = dispatch_and_gemm1(x, gates, w1, plan, cap, info, keep_a=keep)
  meta, kept_index = _slot_meta(gates, plan)
  meta_recv = dispatch(meta, jnp.arange(T * Q, dtype=jnp.int32), plan, cap, info)
  row_gate, token_rows, src, row_kept_index, valid = _recv_tables(meta_recv, plan, info.workspace.ranks, T, Q)
  y, rows = gather_rs(h, w2, row_gate, token_rows, plan, info, want_rows=keep)
  return y, (x_recv, a, h, rows, row_gate, token_rows, src, row_kept_index, valid, kept_index)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def gather_rs_block(x, gates, w1, w2, plan: Plan, cap: int, info: RankInfo):
  """Per-rank expert block with GatherRS. x [T, D], gates [T, Q] f32 (Q slots per token), w1 [E_local, D, 2F],
  w2 [E_local, F, D] -> y [T, D]."""
  y, _ = _forward(x, gates, w1, w2, plan, cap, info, keep=False)
  return y


def _gather_rs_block_fwd(x, gates, w1, w2, plan, cap, info):
  y, res = _forward(x, gates, w1, w2, plan, cap, info, keep=True)
  return y, (*res, gates, w1, w2, plan)


def _gather_rs_block_bwd(cap, info, res, dy):
  x_recv, a, h, rows, row_gate, token_rows, src, row_kept_index, valid, kept_index, gates, w1, w2, plan = res
  T, Q = gates.shape
  slot_src_row = jnp.arange(T * Q, dtype=jnp.int32) // Q
  # dy's rows are the tokens' (the gates are applied at the experts), so they cross once per rank as x's do.
  # (dh_raw = dy W2^T in expert_gemms.dgrad_dtype, as the per-slot block's dh.)
  dh_dtype = expert_gemms.dgrad_dtype(dy.dtype)
  if fuses_dispatch(dy, w2, info, swiglu=False, transpose_rhs=True):
    dy_recv, dh_raw, _ = dispatch_gemm(dy, slot_src_row, w2, plan, cap, info, transpose_rhs=True,
                                       out_dtype=dh_dtype, send_once=info.send_once)
  else:
    dy_recv = dispatch(dy, slot_src_row, plan, cap, info, send_once=info.send_once)
    dh_raw = expert_gemms.matmul(dy_recv, w2, plan.expert_rows, transpose_rhs=True, out_dtype=dh_dtype)
  g = row_gate[:, None]
  d_out = (g * dy_recv.astype(jnp.float32)).astype(dy.dtype)
  da, dw1, dw2 = expert_gemms.expert_grads(x_recv, a, h, d_out, w1, w2, plan.expert_rows,
                                           g * dh_raw.astype(jnp.float32))

  # The gates' gradient: this shard's partial dot per recv row, back to the slot's source at its kept index.
  part = jnp.sum(dy_recv.astype(jnp.float32) * rows.astype(jnp.float32), axis=-1)
  payload = jnp.zeros((cap, _META), jnp.float32).at[:, 0].set(jnp.where(valid, part, 0.0))
  rank = jax.lax.axis_index(info.workspace.axis_name).astype(jnp.int32)
  back_plan = dataclasses.replace(plan, slot_dest_rank=jnp.where(valid, src, rank),
                                  slot_dest_row=jnp.where(valid, row_kept_index, -1), recv_rows=plan.ret_rows)
  back = dispatch(payload, jnp.arange(cap, dtype=jnp.int32), back_plan, T * Q, info)      # [T Q, 4] at the source
  d_gates = jnp.where(kept_index >= 0, back[jnp.maximum(kept_index, 0), 0], 0.0).reshape(T, Q)

  dx, _ = gather_rs(da, w1, valid.astype(jnp.float32), token_rows, plan, info, want_rows=False, transpose_rhs=True)
  plan_ct = jax.tree.map(lambda v: np.zeros(v.shape, jax.dtypes.float0), plan)
  return dx, d_gates.astype(gates.dtype), dw1, dw2, plan_ct


gather_rs_block.defvjp(_gather_rs_block_fwd, _gather_rs_block_bwd)
