"""Step 4's gate-weighted sum of the slots' rows, and its backward: the slots' output gradients and the gates'.

``combine_slots`` sums each token's k returned rows with their gates (float32, j = 0..k-1) and differentiates by a
written-out rule (``slot_gradients``, ``gate_gradients``) that gives autodiff's values of that formula bit for bit.
``quantized_slot_gradients`` is the same slots' gradients as the FP8 recipe dispatches them (1 x 128 tiles with
power-of-two scales, in the send buffer's row order), computed from the tokens' gradient without the [T k, D] rows:
the FP8 layer's backward reads dy once for the tiles' amaxes and once for the e4m3 rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_overlap import fp8


@jax.custom_vjp
def combine_slots(slot_out, gates, is_kept):
  """The slots' rows back [T k, D] -> y [T, D] float32, the choices summed j = 0..k-1 (a slot not kept adds
  nothing). Its backward is written out: the slots' gradient is one broadcast product [T k, D], where the transpose
  of the per-choice slices would build k zero-padded [T, k, D] float32 arrays and sum them."""
  return _slots_sum(slot_out, gates, is_kept)


def kept_gates(gates, is_kept):
  """[T, k] float32: each slot's gate, 0 where the slot was not kept (is_kept [T k] or [T, k])."""
  return jnp.where(is_kept.reshape(gates.shape), gates.astype(jnp.float32), 0)


def _slots_sum(slot_out, gates, is_kept):
  T, k = gates.shape
  slot_out = slot_out.astype(jnp.float32).reshape(T, k, -1)
  w = kept_gates(gates, is_kept)
  y = w[:, 0, None] * slot_out[:, 0]
  for j in range(1, k):
    y = y + w[:, j, None] * slot_out[:, j]
  return y


def _slot_gradient(w, dy, k: int):
  """The float32 gradient of a slot's row from its kept gate w and its token's gradient dy (broadcast): w dy, a zero
  +0 where k > 1, as the transpose of the sum of k zero-padded slices makes it (XLA drops an added +0)."""
  d = w * dy
  return jnp.where(d == 0, 0.0, d) if k > 1 else d


def slot_gradients(gates, is_kept, dy, dtype):
  """The slots' output gradients [T k, D] in ``dtype`` (the slots' rows' dtype) from dy [T, D] float32."""
  T, k = gates.shape
  d = _slot_gradient(kept_gates(gates, is_kept)[:, :, None], dy[:, None, :], k)
  return d.reshape(T * k, -1).astype(dtype)


def gate_gradients(slot_out, gates, is_kept, dy):
  """The gates' gradient [T, k] in gates' dtype: sum_d dy[t, d] slot_out[t k + j, d] (float32) where the slot was kept,
  0 where not."""
  T, k = gates.shape
  s = slot_out.astype(jnp.float32).reshape(T, k, -1)
  d_w = jnp.stack([jnp.sum(dy * s[:, j], axis=-1) for j in range(k)], axis=1)  # (per choice: the formula's sums)
  return jnp.where(is_kept.reshape(gates.shape), d_w, 0).astype(gates.dtype)


def _combine_slots_fwd(slot_out, gates, is_kept):
  return _slots_sum(slot_out, gates, is_kept), (slot_out, gates, is_kept)


def _combine_slots_bwd(res, dy):
  slot_out, gates, is_kept = res
  return (slot_gradients(gates, is_kept, dy, slot_out.dtype), gate_gradients(slot_out, gates, is_kept, dy),
          np.zeros(is_kept.shape, jax.dtypes.float0))


combine_slots.defvjp(_combine_slots_fwd, _combine_slots_bwd)


def quantized_slot_gradients(dy, gates, is_kept, slot_of_row, dtype):
  """The slots' output gradients as the send buffer holds them, quantized 1 x 128 with power-of-two scales: bit for
  bit ``fp8.quantize_rows(move(slot_gradients(gates, is_kept, dy, dtype)), pow2=True)`` where ``move`` takes row i
  from slot slot_of_row[i] (a zero row where that is T k or more, as ``xla_path.move_rows`` gives it, or negative),
  without writing the slots' rows.

  dy [T, D] float32 (D a multiple of 128), gates [T, k], is_kept [T k], slot_of_row [N] int32 -> (q [N, D] e4m3,
  s [N, D / 128] float32). A slot's row is w dy[t] rounded to ``dtype``; rounding is monotone and odd, so the amax of
  one of its tiles is |w| times the amax of dy[t]'s tile, rounded alike: the scales come from dy's tile amaxes
  [T, D / 128], and the e4m3 rows from one elementwise pass over dy's rows."""
  T, k = gates.shape
  D = dy.shape[1]
  valid = (slot_of_row >= 0) & (slot_of_row < T * k)
  slot = jnp.where(valid, slot_of_row, 0)
  w = jnp.where(valid, kept_gates(gates, is_kept).reshape(T * k)[slot], 0)[:, None]     # [N, 1]
  token = slot // k
  dy = dy.astype(jnp.float32)
  amax = fp8.tile_amax(dy.reshape(T, D // fp8.TILE, fp8.TILE), -1)                      # [T, D / 128]
  row_amax = fp8.rounded(_slot_gradient(jnp.abs(w), amax[token], k), dtype)
  s = fp8.tile_scale(jnp.where(valid[:, None], row_amax, 0), pow2=True)
  rows = jnp.where(valid[:, None], fp8.rounded(_slot_gradient(w, dy[token], k), dtype), 0)
  return fp8.quantize_rows_by(rows, s), s
