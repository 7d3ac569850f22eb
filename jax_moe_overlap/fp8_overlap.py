"""``impl="overlap"`` under ``quantization="fp8"``: DeepSeek-V3's recipe (``fp8_experts.py``) with the rows crossing in
the workspace's ``dispatch`` custom call (docs/design.md, "FP8").

The expert block is ``fp8_exchange.fp8_exchanged_experts`` (the ``custom_vjp`` of impl="collective" under FP8) on a
``WorkspaceRoute``, whose row moves are the dispatch custom call instead of XLA collectives:

  forward   x quantized 1 x 128 with power-of-two scales on the token's owner and packed (``fp8.pack_rows``: D + D / 32
            bytes a row), dispatched as uint8 rows (the dispatch moves them unchanged, as bytes), unpacked at the
            experts as the recipe's GEMM1 operand (``recipe_forward``: GEMM1 FP8, SwiGLU, h quantized, GEMM2 FP8
            writing the compute dtype); the expert rows go back to their slots' owners in the compute dtype by the
            same custom call on the way back's routing (``plan.packed_return``: each recv row to its slot's row
            among its source's kept slots), and each token sums its slots with the gates there
            (``xla_path.combine_slots``, float32, j = 0..k-1).
  backward  the slots' output gradients (gates * dy, in the compute dtype, as JAX's transpose of the combine gives
            them) quantized 1 x 128 with power-of-two scales and dispatched as packed rows, read by the recipe's
            dgrad as they land (``recipe_backward``); the input gradient goes back to the token owners in the compute
            dtype by the way back, and each token sums its slots' (the transpose of ``xla_path.token_slots``).

The rows the experts read, the GEMMs and every sum are impl="collective"'s under FP8, in the same order (only the
transport differs, and both move rows unchanged), so outputs and gradients equal that impl's bit for bit
(``tests/test_fp8_overlap.py``). With a tensor axis the slots are the tensor shard slots (``tensor_parallel.py``):
each shard's partial output comes back per slot in the compute dtype, where impl="collective" sums the partials in
float32 (a reduce-scatter), so the two agree to the compute dtype's rounding.

Not fused (what docs/design.md lists as left): the dispatch with GEMM1 (``dispatch_gemm`` takes float32 and bfloat16
rows) and GEMM2 with the return (``expert_combine``'s producer takes float32 and bfloat16 operands), so the return is
a dispatch of GEMM2's finished rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap.call_site import RankInfo
from jax_moe_overlap.fp8_exchange import fp8_exchanged_experts
from jax_moe_overlap.fp8_experts import recipe_gemms
from jax_moe_overlap.workspace_calls import dispatch, dispatch_rows
from jax_moe_overlap.xla_path import combine_slots, move_rows, token_slots


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

  def slot_rows(self, x):
    """Token rows [T, C] -> slot rows [T k, C] (its transpose: the sum over a token's slots)."""
    return token_slots(x, self.k)

  def dispatch_tokens(self, x):
    """Token rows [T, C] -> this rank's recv rows [cap, C]: each slot reads its token's row in the custom call
    (no slot rows are built), sent once per destination rank where the call site says so."""
    slot_src_row = jnp.arange(self.send_row.shape[0], dtype=jnp.int32) // self.k
    return dispatch(x, slot_src_row, self.plan, self.cap, self.info, send_once=self.info.send_once)

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
  slot_out = route.from_send_buffer(fp8_exchanged_experts(x, w1, w2, route, gemms=gemms))
  return combine_slots(slot_out, gates, route.plan.slot_ret_row >= 0).astype(x.dtype)
