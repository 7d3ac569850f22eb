"""The differentiable expert block of one rank: dispatch -> GEMM1 + SwiGLU -> expert_combine, with a ``custom_vjp``.

Its backward pass uses the same two custom calls: ``gates * dy`` is dispatched like tokens (dy's rows, each slot's
scaled by its gate as the dispatch moves it: ``row_scale``), and ``dx`` is ``expert_combine`` of the GEMM1 input
gradient with ``W1^T`` (``transpose_rhs``: W1 read transposed in place, no copy) and unit gates. Where the call site
fuses the dispatch with the GEMM after it (``RankInfo.dispatch_pushers``) and the operands take dispatch_gemm's engine
(``engines.dispatch_gemm_operands``), the forward's dispatch and GEMM1, and the backward's dispatch of ``gates * dy``
(dy's rows scaled by the pushers) and ``d_out W2^T``, each run as one ``dispatch_gemm`` call. The forward's dispatch
sends a token's row once per destination rank where the call site says so (``RankInfo.send_once``); the backward's sends
one row per slot, since ``gates * dy`` differs per slot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_overlap import engines
from jax_moe_overlap import expert_gemms
from jax_moe_overlap.call_site import RankInfo
from jax_moe_overlap.plan import Plan
from jax_moe_overlap.workspace_calls import dispatch, dispatch_gemm, expert_combine


# Whether the backward's dispatch of gates * dy, fused with the dgrad GEMM or not, scales dy's rows by the gates as
# it moves them (row_scale: the same bits, no [T k, D] array of gates * dy written and read back). False: that array
# (for A/B measurements).
SCALE_IN_DISPATCH = True


def fuses_dispatch(x, w, info: RankInfo, swiglu: bool, transpose_rhs: bool) -> bool:
  """Whether a dispatch of rows x and the GEMM with w after it run as one dispatch_gemm: chosen for the call site
  (``info.dispatch_pushers``) and taken by the engine (``engines.dispatch_gemm_operands``)."""
  if info.dispatch_pushers <= 0:
    return False
  K, N = (w.shape[2], w.shape[1]) if transpose_rhs else (w.shape[1], w.shape[2])
  bf16 = x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16
  return engines.dispatch_gemm_operands(info.workspace.platform, bf16, K, N, swiglu)


def dispatch_and_gemm1(x, gates, w1, plan, cap, info, keep_a: bool):
  """Tokens to their experts' ranks, then GEMM1 and its SwiGLU: (x_recv [cap, D] or None, h [cap, F] in x's dtype,
  a [cap, 2F] in ``expert_gemms.kept_preactivation_dtype`` or None). keep_a: keep what the backward pass reads,
  x_recv and a (the forward alone needs neither, so without it the fused call writes neither)."""
  T, k = gates.shape
  slot_src_row = jnp.arange(T * k, dtype=jnp.int32) // k
  if fuses_dispatch(x, w1, info, swiglu=True, transpose_rhs=False):
    return dispatch_gemm(x, slot_src_row, w1, plan, cap, info, swiglu=True, keep_recv=keep_a, keep_a=keep_a,
                         a_dtype=expert_gemms.kept_preactivation_dtype(x.dtype), send_once=info.send_once)
  x_recv = dispatch(x, slot_src_row, plan, cap, info, send_once=info.send_once)
  return ((x_recv if keep_a else None), *expert_gemms.gemm1_swiglu(x_recv, w1, plan.expert_rows, keep_a))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def expert_block(x, gates, w1, w2, plan: Plan, cap: int, info: RankInfo):
  """Per-rank expert block. x [T, D], gates [T, k] f32, w1 [E_local, D, 2F], w2 [E_local, F, D] -> y [T, D]."""
  _, h, _ = dispatch_and_gemm1(x, gates, w1, plan, cap, info, keep_a=False)
  y, _ = expert_combine(h, w2, gates, plan, info, want_slots=False)  # no per-slot rows without a backward pass
  return y


def _expert_block_fwd(x, gates, w1, w2, plan, cap, info):
  x_recv, h, a = dispatch_and_gemm1(x, gates, w1, plan, cap, info, keep_a=True)
  y, slot_out = expert_combine(h, w2, gates, plan, info, want_slots=True)
  return y, (x_recv, a, h, slot_out, gates, w1, w2, plan)


def _expert_block_bwd(cap, info, res, dy):
  x_recv, a, h, slot_out, gates, w1, w2, plan = res
  T, k = gates.shape
  dy_slot = jnp.repeat(dy, k, axis=0)                                     # [P, D], slot p = t*k + j
  d_gates = jnp.sum(dy_slot.astype(jnp.float32) * slot_out.astype(jnp.float32), axis=-1).reshape(T, k)
  slot_gate = gates.reshape(T * k).astype(jnp.float32)
  fused = fuses_dispatch(dy, w2, info, swiglu=False, transpose_rhs=True)
  slot_rows = jnp.arange(T * k, dtype=jnp.int32)
  if SCALE_IN_DISPATCH:
    # gates * dy scaled by the dispatch as it moves dy's rows (row_scale): the same rows, no [T k, D] array.
    src, src_row, row_scale = dy, slot_rows // k, slot_gate
  else:
    src, src_row, row_scale = (slot_gate[:, None] * dy_slot.astype(jnp.float32)).astype(dy.dtype), slot_rows, None
  if fused:
    # The dispatch of gates * dy with dh = d_out W2^T (in expert_gemms.dgrad_dtype, as the unfused path writes it),
    # as the forward's dispatch with GEMM1; d_out is kept for the weight gradient dW2.
    d_out, dh, _ = dispatch_gemm(src, src_row, w2, plan, cap, info, transpose_rhs=True,
                                 out_dtype=expert_gemms.dgrad_dtype(dy.dtype), row_scale=row_scale)
  else:
    d_out, dh = dispatch(src, src_row, plan, cap, info, row_scale=row_scale), None
  da, dw1, dw2 = expert_gemms.expert_grads(x_recv, a, h, d_out, w1, w2, plan.expert_rows, dh)
  # dx = da @ W1^T per expert: W1 [E_local, D, 2F] is read transposed in place (no [E_local, 2F, D] copy).
  dx, _ = expert_combine(da, w1, jnp.ones_like(gates, jnp.float32), plan, info, want_slots=False, transpose_rhs=True)
  plan_ct = jax.tree.map(lambda v: np.zeros(v.shape, jax.dtypes.float0), plan)
  return dx, d_gates.astype(gates.dtype), dw1, dw2, plan_ct


expert_block.defvjp(_expert_block_fwd, _expert_block_bwd)
