"""FP8 rows on the wire: the local experts of ``impl="xla"``, ``impl="collective"`` and ``impl="overlap"`` (where its
returns are unfused; its fused path shares ``experts_gemm1``) under ``quantization="fp8"``, with the rows the experts
read crossing the exchange in FP8 (DeepSeek-V3's recipe, arXiv 2412.19437, section 3.3.3; docs/design.md, "FP8").
The exchange is a route's: ``xla_path.Route`` (XLA collectives) or ``fp8_overlap.WorkspaceRoute`` (the workspace's
dispatch custom call).

``fp8_combined_exchange`` runs from a rank's token rows to their sum over the slots that come back to it (the
combine, ``slot_combine.combine_slots``), as one ``custom_vjp``:

  forward   x [T, D] quantized 1 x 128 with power-of-two scales on the token's owner, once per token (before the
            tensor axis's gather and the k copies of the dispatch); the e4m3 values and their float32 scales cross
            the exchange as one packed row of D + D / 32 bytes (``fp8.pack_rows``; 2D bytes in bfloat16; on a route
            whose rows stay on the device, values and scales each moved by itself, unpacked) and land on
            the expert's rank as the recipe's GEMM1 operand, unchanged (``experts_gemm1``: where the route fuses
            the dispatch with GEMM1, one dispatch_gemm call reads the packed rows where they land); the expert
            outputs come back in the compute dtype (the combine stays in it).
  backward  the output gradient of the rows that came back (gate * dy, rounded to the compute dtype, the combine's
            backward) quantized 1 x 128 with power-of-two scales on the token's owner straight from dy
            (``slot_combine.quantized_slot_gradients``: the [T k, D] rows are never written), dispatched packed the
            same way (the transpose of the combine's exchange is the dispatch) and read by the recipe's dgrad
            dh = dy W2^T as it lands (``experts_dy``: fused as the forward's where the route fuses it;
            ``fp8_experts.recipe_backward``); the input gradient returns to the token owners in the compute dtype,
            by the transpose of the compute dtype's dispatch (``jax.linear_transpose``: the exchange back and, with
            a tensor axis, the reduce-scatter).

A 1 x 128 tile lies within one row, and the exchange moves rows unchanged: the rows quantized on the sender are, bit
for bit, the rows the recipe would quantize on the expert's rank after an exchange in the compute dtype, so the
layer's outputs and gradients are those of that order (``tests/test_fp8_exchange.py`` holds them equal bit for bit).

The ``custom_vjp`` spans the exchanges because the quantized rows are no differentiable values (the cotangent of an
e4m3 array would be e4m3): JAX differentiates neither the quantizer nor the packed bytes. It spans the combine so that
the backward quantizes the slots' gradients from dy's rows and their gates. The packed rows are uint8
for every exchange (XLA:CPU's all_to_all moves float8_e4m3fn too, but a byte row carries the values and the scales in
one exchange per direction).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_overlap import fp8
from jax_moe_overlap.fp8_experts import Gemms, recipe_backward, recipe_dgrad_weight, recipe_ffn_columns, recipe_gemm1
from jax_moe_overlap.slot_combine import combine_slots, gate_gradients, quantized_slot_gradients


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def fp8_combined_exchange(x, gates, is_kept, w1, w2, route, gemms: Gemms):
  """The FP8 recipe on the experts of this rank's tokens, their rows exchanged in FP8, and the rows back summed per
  token with their gates (``slot_combine.combine_slots``).

  Args:
    x: [T, D] this rank's token rows, float32 or bfloat16 (D a multiple of 128). gates: [T', K] float32 and
      is_kept: [T' K] bool, the route's slots (T': the tensor group's tokens; K slots per token). w1: [E_local, D, 2F]
      and w2: [E_local, F, D] this rank's experts (master weights or ``fp8.Fp8Weight``). route: how rows move, an
      ``xla_path.Route`` or a ``fp8_overlap.WorkspaceRoute`` (``dispatch_tokens``: token rows to recv rows,
      ``dispatch``: send-buffer rows to recv rows, ``combine_rows``: recv rows back to the send buffer,
      ``from_send_buffer``: send-buffer rows to slot rows, ``send_slot``: the slot at each send-buffer row,
      ``slot_rows``: token rows to slot rows, whose transpose sums a token's slots; ``expert_rows``: the recv rows of
      each local expert; ``stays_local``: whether no row leaves the device; ``moves_words``: whether byte rows may
      move as 4-byte words). gemms: ``fp8_experts.RAGGED`` or
      ``KERNELS``.
  Returns:
    y [T', D] float32: sum_j gates[t, j] times slot (t, j)'s expert output where kept, j = 0..K-1.
  """
  return _combined_forward(x, gates, is_kept, w1, w2, route, gemms, keep=False)[0]


def moved(move, route, q, s):
  """Quantized rows (q [N, C] e4m3, s [N, C / 128] float32) moved by ``move`` (``route.dispatch_tokens`` or
  ``route.dispatch``) -> (q, s) at the experts. Packed into one byte row each (``fp8.pack_rows``) where rows cross
  an exchange, so that a row's values and scales travel together; on a route whose rows never leave the device
  (``route.stays_local``) each array is moved by itself: the same rows in the same places (a row no slot fills is
  zero either way: zero values and a zero scale), without the packed copy written and sliced apart. Where XLA moves
  them (``route.moves_words``), bytes move as 4-byte words (C is a multiple of 128, so a packed row's C + C / 32
  bytes are too): compilers may widen an e4m3 gather to float16 (XLA:CPU does), and one of single bytes computes an
  index per byte (XLA:GPU does), where a word moves four; the workspace's dispatch takes the packed bytes."""
  if route.stays_local:
    return _moved_as_words(move, q), move(s)
  packed = fp8.pack_rows(q, s)
  return fp8.unpack_rows(_moved_as_words(move, packed) if route.moves_words else move(packed))


def _moved_as_words(move, rows):
  """Rows [N, W] of 1-byte elements (W a multiple of 4) moved by ``move`` as [N, W / 4] uint32 words."""
  N, W = rows.shape
  words = move(jax.lax.bitcast_convert_type(rows.reshape(N, W // 4, 4), jnp.uint32))
  return jax.lax.bitcast_convert_type(words, rows.dtype).reshape(-1, W)


def experts_gemm1(x, w1, w2, route, gemms, keep: bool = True):
  """x's rows quantized 1 x 128 with power-of-two scales on their owner, moved to the experts and through GEMM1 and
  the SwiGLU there: (h quantized 1 x 128 (values, scales), w2 as GEMM2 reads it, what the backward keeps; without
  keep the backward's rows may be left out). Moved and multiplied by two calls (``moved``, then
  ``fp8_experts.recipe_gemm1``), or where the route fuses them (``route.fuses_dispatch_gemm``: the workspace's
  dispatch_gemm on packed rows, ``fp8_overlap.WorkspaceRoute``) one: the same rows, GEMM and epilogue, the same
  bits in every row the layer reads."""
  xq, xs = fp8.quantize_rows(x, pow2=True)
  n = w1.values.shape[1] if isinstance(w1, fp8.Fp8Weight) else w1.shape[2]  # GEMM1's columns, 2F
  if route.fuses_dispatch_gemm(x.shape[1], n):
    return route.dispatch_gemm1(fp8.pack_rows(xq, xs), w1, w2, gemms, keep)
  return recipe_gemm1(*moved(route.dispatch_tokens, route, xq, xs), w1, w2, route.expert_rows, gemms, keep)


def experts_dy(dyq, dys, kept, route, gemms):
  """The output gradients of the send buffer's rows (dyq [P, D] e4m3, dys [P, D / 128] float32: quantized 1 x 128
  with power-of-two scales on their owner) moved to the experts: (dy's rows there as
  ``fp8_experts.recipe_dgrad_operands`` takes them, dh = dy W2^T float32 or None). Moved by ``moved``, dh left to the
  recipe; or where the route fuses the dispatch with the GEMM after it, one dispatch_gemm call on the packed rows
  computing dh as they land (``route.dispatch_dgrad``), its packed recv rows kept for dW2: the same bits."""
  if route.fuses_dispatch_gemm(dyq.shape[1], recipe_ffn_columns(kept)):
    return route.dispatch_dgrad(fp8.pack_rows(dyq, dys), recipe_dgrad_weight(kept, gemms))
  return moved(route.dispatch, route, dyq, dys), None


def slot_gradients_at_experts(dy, gates, is_kept, dtype, kept, route, gemms):
  """The slots' output gradients (``quantized_slot_gradients``: from dy [T, D] float32 and the slots' gates, rounded
  to ``dtype``) quantized on their owner and moved to the experts: ``experts_dy``'s (dy's rows there, dh or None).
  On a route whose rows stay on the device, quantized straight into the experts' rows instead (each recv row's slot
  moved through the route, a recv row no slot fills a zero row with a zero scale, as ``moved`` leaves it): the same
  rows without writing the send buffer's and moving their bytes."""
  if route.stays_local:
    slot_of_row = route.dispatch((route.send_slot + 1)[:, None])[:, 0] - 1   # -1: a recv row no slot fills
    q, s = quantized_slot_gradients(dy, gates, is_kept, slot_of_row, dtype)
    return (q, jnp.where(slot_of_row[:, None] >= 0, s, 0)), None
  return experts_dy(*quantized_slot_gradients(dy, gates, is_kept, route.send_slot, dtype), kept, route, gemms)


def _combined_forward(x, gates, is_kept, w1, w2, route, gemms, keep=True):
  h_rows, w2q, kept = experts_gemm1(x, w1, w2, route, gemms, keep)
  slot_out = route.from_send_buffer(route.combine_rows(gemms.rows(*h_rows, w2q, route.expert_rows, x.dtype)))
  # x_like: x's row count and dtype (an empty array) for the transpose of its dispatch.
  x_like = jnp.zeros((x.shape[0], 0), x.dtype)
  return combine_slots(slot_out, gates, is_kept), (kept, route, x_like, slot_out, gates, is_kept)


def _combined_backward(gemms, residuals, dy):
  kept, route, x_like, slot_out, gates, is_kept = residuals
  d_gates = gate_gradients(slot_out, gates, is_kept, dy)
  dy_rows, dh = slot_gradients_at_experts(dy, gates, is_kept, slot_out.dtype, kept, route, gemms)
  dx_recv, dw1, dw2 = recipe_backward(gemms, kept, dy_rows, x_like.dtype, dh)
  # The transpose of x's way to the experts in the compute dtype: each recv row back to its send row, then to its
  # slot (route.combine_rows and from_send_buffer move rows: the transposes of dispatch and send_buffer), then
  # JAX's transpose of slot_rows (the sum over a token's slots, and with a tensor axis the reduce-scatter).
  x_shape = jax.ShapeDtypeStruct((x_like.shape[0], dx_recv.shape[1]), x_like.dtype)
  (dx,) = jax.linear_transpose(route.slot_rows, x_shape)(route.from_send_buffer(route.combine_rows(dx_recv)))
  return (dx, d_gates, np.zeros(is_kept.shape, jax.dtypes.float0), dw1, dw2,
          jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), route))


fp8_combined_exchange.defvjp(_combined_forward, _combined_backward)
