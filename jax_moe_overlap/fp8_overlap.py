"""``impl="overlap"`` under ``quantization="fp8"``: DeepSeek-V3's recipe (``fp8_experts.py``) with the rows crossing in
the workspace's ``dispatch`` custom call (docs/design.md, "FP8").

Unfused (where ``call_site.FP8_FUSED_COMBINE_ON_GPU`` is off on a GPU), the expert block is
``fp8_exchange.fp8_combined_exchange`` (the ``custom_vjp`` of impl="collective" under FP8) on a ``WorkspaceRoute``,
whose row moves are the dispatch custom call instead of XLA collectives:

  forward   x quantized 1 x 128 with power-of-two scales on the token's owner and packed (``fp8.pack_rows``: D + D / 32
            bytes a row), dispatched as uint8 rows (the dispatch moves them unchanged, as bytes), unpacked at the
            experts as the recipe's GEMM1 operand (``recipe_forward``: GEMM1 FP8, SwiGLU, h quantized, GEMM2 FP8
            writing the compute dtype); the expert rows go back to their slots' owners in the compute dtype by the
            same custom call on the way back's routing (``plan.packed_return``: each recv row to its slot's row
            among its source's kept slots), and each token sums its slots with the gates there
            (``slot_combine.combine_slots``, float32, j = 0..k-1).
  backward  the slots' output gradients (gates * dy, in the compute dtype, as the combine's backward gives them)
            quantized 1 x 128 with power-of-two scales straight from dy (``slot_combine.quantized_slot_gradients``:
            no slot rows written) and dispatched as packed rows, read by the recipe's
            dgrad as they land (``recipe_backward``); the input gradient goes back to the token owners in the compute
            dtype by the way back, and each token sums its slots' (the transpose of ``xla_path.token_slots``).

The rows the experts read, the GEMMs and every sum are impl="collective"'s under FP8, in the same order (only the
transport differs, and both move rows unchanged), so outputs and gradients equal that impl's bit for bit
(``tests/test_fp8_overlap.py``). With a tensor axis the slots are the tensor shard slots (``tensor_parallel.py``):
each shard's partial output comes back per slot in the compute dtype, where impl="collective" sums the partials in
float32 (a reduce-scatter), so the two agree to the compute dtype's rounding.

Fused (``fp8_combined_experts``, where the call site says ``fp8_fused_combine``: every CPU's): GEMM2 and the return
are one ``expert_combine_fp8`` call (the overlapped operator with the FP8 grouped GEMM as its producer), and in the
backward the input gradient's GEMM da W1^T and its return another, with the same values and gradients as the unfused
block.

Dispatch fused (on both paths, where the call site says ``fp8_fused_dispatch``: a pinned ``dispatch_pushers`` on CPUs,
GPUs once ``call_site.FP8_FUSED_DISPATCH_ON_GPU``, and the kernel takes d_model): x's packed rows are dispatched and
multiplied by GEMM1 with the recipe's SwiGLU in one ``dispatch_gemm_fp8`` call, each tile reading its rows' values
and scales where they landed (``WorkspaceRoute.dispatch_gemm1``), and in the backward the slots' packed output
gradients with dh = dy W2^T in another (``WorkspaceRoute.dispatch_dgrad``); the backward unpacks the recv rows the
calls kept for the weight gradients. The same bits as the two calls.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_overlap import engines
from jax_moe_overlap import fp8
from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap.call_site import RankInfo
from jax_moe_overlap.fp8_exchange import experts_gemm1, fp8_combined_exchange, slot_gradients_at_experts
from jax_moe_overlap.fp8_experts import Gemms, recipe_dgrad_operands, recipe_gemms, recipe_kept, recipe_weights
from jax_moe_overlap.slot_combine import gate_gradients
from jax_moe_overlap.workspace_calls import dispatch, dispatch_gemm_fp8, dispatch_rows, expert_combine_fp8
from jax_moe_overlap.xla_path import move_rows, token_slots


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WorkspaceRoute:
  """Where one rank's rows go and come back through the workspace's dispatch custom call: the row moves
  ``fp8_exchanged_experts`` asks of a route (``xla_path.Route``'s, the send buffer being the packed kept slots).

  plan: this rank's ``plan.Plan``. send_row, send_slot: [P] ``plan.packed_rows``: each kept slot's row among this
  rank's kept slots (P: not kept), and the slot at each such row. ret_dest_rank, ret_dest_row: [cap]
  ``plan.packed_return``: each recv row's way back. cap: the recv rows; k: slots per token; info: the call site.
  """

  plan: plan_lib.Plan
  send_row: jax.Array
  send_slot: jax.Array
  ret_dest_rank: jax.Array
  ret_dest_row: jax.Array
  cap: int = dataclasses.field(metadata=dict(static=True))
  k: int = dataclasses.field(metadata=dict(static=True))
  info: RankInfo = dataclasses.field(metadata=dict(static=True))

  @property
  def expert_rows(self) -> jax.Array:
    return self.plan.expert_rows

  @property
  def stays_local(self) -> bool:
    """False: the rows go through the dispatch custom call (as bytes, packed: ``fp8_exchange``); a one-rank group
    takes ``xla_path.Route`` instead (``api._moe_local``)."""
    return False

  @property
  def moves_words(self) -> bool:
    """False: the dispatch custom call takes packed rows as bytes (uint8, ``fp8.pack_rows``)."""
    return False

  def fuses_dispatch_gemm(self, d_model: int, n: int) -> bool:
    """Whether a dispatch of packed rows of d_model channels and the GEMM of n columns after it run as one
    ``dispatch_gemm_fp8`` call: where the call site fuses them (``RankInfo.fp8_fused_dispatch``) and its kernel
    takes them (``engines.fp8_dispatch_gemm_operands``)."""
    return self.info.fp8_fused_dispatch and engines.fp8_dispatch_gemm_operands(self.info.workspace.platform, d_model,
                                                                               n)

  def dispatch_gemm1(self, packed, w1, w2, gemms, keep: bool):
    """Packed quantized token rows [T, D + D/32] -> ``fp8_exchange.experts_gemm1``'s (h_rows, w2q, kept) by one
    ``dispatch_gemm_fp8`` call (the rows dispatched as ``dispatch_tokens`` sends them, GEMM1 and the recipe's SwiGLU
    on them where they land); kept holds the packed recv rows (unpacked by the backward) and a quantized, or None
    for both without keep."""
    (w1q, w2q), kept_weights = recipe_weights(w1, w2, gemms, keep)
    x_recv, h_rows, a_rows = dispatch_gemm_fp8(packed, self._token_of_slot(), w1q, self.plan, self.cap, self.info,
                                               swiglu=True, keep_recv=keep, keep_a=keep,
                                               send_once=self.info.send_once)
    return h_rows, w2q, recipe_kept(x_recv, a_rows, w1, w2, kept_weights, self.expert_rows)

  def dispatch_dgrad(self, packed, w2t: fp8.Fp8Weight):
    """Packed quantized send-buffer rows [P, D + D/32] (``dispatch``'s) -> (their recv rows [cap, D + D/32], packed,
    for dW2; dh = dy W2^T [cap, F] float32) by one ``dispatch_gemm_fp8`` call (w2t: W2^T's ``Fp8Weight``)."""
    P = self.send_row.shape[0]
    d_recv, dh, _ = dispatch_gemm_fp8(packed, jnp.minimum(self.send_row, P - 1), w2t, self.plan, self.cap, self.info)
    return d_recv, dh

  def slot_rows(self, x):
    """Token rows [T, C] -> slot rows [T k, C] (its transpose: the sum over a token's slots)."""
    return token_slots(x, self.k)

  def _token_of_slot(self):
    """[T k] int32: each slot's token row (slot t k + j is token t's)."""
    return jnp.arange(self.send_row.shape[0], dtype=jnp.int32) // self.k

  def dispatch_tokens(self, x):
    """Token rows [T, C] -> this rank's recv rows [cap, C]: each slot reads its token's row in the custom call
    (no slot rows are built), sent once per destination rank where the call site says so."""
    return dispatch(x, self._token_of_slot(), self.plan, self.cap, self.info, send_once=self.info.send_once)

  def dispatch(self, send):
    """Packed kept-slot rows [P, C] (``send_row``'s order) -> this rank's recv rows [cap, C]."""
    P = self.send_row.shape[0]
    return dispatch(send, jnp.minimum(self.send_row, P - 1), self.plan, self.cap, self.info)

  def combine_rows(self, out):
    """Recv rows [cap, C] -> this rank's kept slots' rows [P, C] as they came back (``send_row``'s order, zero past
    them): every row moved back where ``dispatch`` took it from."""
    P = self.send_row.shape[0]
    return dispatch_rows(out, jnp.arange(self.cap, dtype=jnp.int32), self.ret_dest_rank, self.ret_dest_row,
                     self.plan.ret_rows, P, self.info)

  def from_send_buffer(self, send):
    """Packed kept-slot rows [P, C] -> slot rows [P, C], zero for a slot not kept (its gradient the gather back,
    ``xla_path.move_rows``)."""
    return move_rows(send, self.send_row, self.send_slot)

  @property
  def is_kept(self) -> jax.Array:
    """[T k] bool: whether each slot was kept (has a row in the send buffer)."""
    return self.plan.slot_ret_row >= 0


def workspace_route(slot_ids, counts, rank, expert_cap: int, plan: plan_lib.Plan, cap: int,
                    info: RankInfo) -> WorkspaceRoute:
  """The ``WorkspaceRoute`` of this rank's plan: slot_ids [T, k], counts [R_src, R_dst, E_local], rank and expert_cap
  as ``plan.plan_over_axis`` took and returned them; cap: the recv rows."""
  dest_rank, dest_row = plan_lib.packed_return(counts, rank, expert_cap, cap)
  send_row, send_slot = plan_lib.packed_rows(slot_ids, counts, rank, expert_cap, plan)
  return WorkspaceRoute(plan, send_row, send_slot, dest_rank, dest_row, cap, slot_ids.shape[1], info)


def fp8_expert_block(x, gates, w1, w2, route: WorkspaceRoute, quantization: str = "fp8"):
  """Per-rank FP8 expert block. x [T, D] (D a multiple of 128), gates [T, k] float32 (the route's slots per token),
  w1 [E_local, D, 2F], w2 [E_local, F, D] (master weights or ``fp8.Fp8Weight``; with a tensor axis this rank's
  shards) -> y [T, D] in x's dtype."""
  gemms = recipe_gemms("kernels", quantization)
  if route.info.fp8_fused_combine:  # (call_site.fp8_fused_combine)
    return fp8_combined_experts(x, gates, w1, w2, route, gemms)
  return fp8_combined_exchange(x, gates, route.is_kept, w1, w2, route, gemms=gemms).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def fp8_combined_experts(x, gates, w1, w2, route: WorkspaceRoute, gemms: Gemms):
  """``fp8_expert_block`` with GEMM2 overlapped with the way back: x's rows dispatched in FP8 and GEMM1 as in
  ``fp8_exchange.fp8_combined_exchange``, then one ``expert_combine_fp8`` call (GEMM2 on e4m3 h and w2, each finished
  band shipped to its slots' owner, the gate-weighted sum in float32, j = 0..k-1). The same values as the unfused
  block's (the same GEMM rows, rounded to x's dtype, summed in the same order), and its backward: the gates' gradient
  and the slots' output gradients as ``slot_combine.combine_slots`` differentiates them (quantized straight from
  dy: ``quantized_slot_gradients``), dispatched in FP8 to the recipe's backward
  (``fp8_experts.recipe_dgrad_operands``), and dx = da W1^T returned by a second ``expert_combine_fp8`` (unit gates:
  each token's kept slots summed in float32)."""
  return _combined_forward(x, gates, w1, w2, route, gemms, want_slots=False)[0]


def _combined_forward(x, gates, w1, w2, route, gemms, want_slots=True):
  (hq, hs), w2q, kept = experts_gemm1(x, w1, w2, route, gemms, keep=want_slots)
  y, slot_out = expert_combine_fp8(hq, hs, w2q, gates, route.plan, route.info, want_slots, x.dtype)
  return y, (kept, route, jnp.zeros((x.shape[0], 0), x.dtype), slot_out, gates)


def _combined_backward(gemms, residuals, dy):
  kept, route, x_like, slot_out, gates = residuals
  dy = dy.astype(jnp.float32)  # (the cotangent of combine_slots' float32 sum, as the unfused block's)
  d_gates = gate_gradients(slot_out, gates, route.is_kept, dy)
  dy_rows, dh = slot_gradients_at_experts(dy, gates, route.is_kept, slot_out.dtype, kept, route, gemms)
  da_rows, w1_t, dw1, dw2 = recipe_dgrad_operands(gemms, kept, dy_rows, x_like.dtype, dh)
  # dx = da W1^T overlapped with its way back: each token sums its kept slots' rows (unit gates, float32, in slot
  # order), as the forward's return.
  dx, _ = expert_combine_fp8(*da_rows, w1_t, jnp.ones(gates.shape, jnp.float32), route.plan, route.info, False,
                             x_like.dtype)
  return dx, d_gates, dw1, dw2, jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), route)


fp8_combined_experts.defvjp(_combined_forward, _combined_backward)
