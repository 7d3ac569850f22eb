"""The pure-JAX reference MoE expert layer: the test oracle and ``impl="reference"``.

``moe_experts_reference`` computes every expert densely on every token of the whole (global) batch and applies the
same capacity rule as the plan, written independently: a slot is kept when fewer than ``expert_cap`` earlier slots of
its group chose the same expert, in the global slot order (source rank, token, choice). No communication, no custom
calls. Its cost grows with T E (every token through every expert): at DeepSeek-like sizes (E = 256, top-8) that is 32x
the routed work and float32 weight gradients of tens of GB.

``moe_experts_sparse_reference`` is the same layer (same capacity rule, the same y, dropped count and gradients up to
float32 rounding) at the cost of the routed rows only, T k per GEMM, always in float32 at precision HIGHEST:
``routed_combine`` runs each expert's slots in fixed-size blocks under a ``lax.scan``. The benchmarks check big
shapes with it (run expert-parallel); tests/test_reference.py holds it equal to the dense oracle.

``moe_experts_fp8_reference`` is the layer under ``quantization="fp8"``: the kept slots gathered into one row per
slot, grouped by expert in the global slot order (the order the plan lays each expert's rows out in on its rank, so
the recipe's 128-row tiles of an expert's rows are the expert-parallel paths' tiles), through the FP8 recipe with
dense float32 GEMMs (``fp8_experts.DENSE``), and combined as above.

Skipped slots (expert id -1) select nothing in all of them: they contribute zero, take no capacity and are not
dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import numpy as np

from jax_moe_overlap.expert_gemms import swiglu
from jax_moe_overlap.fp8_experts import fp8_expert_mlp, recipe_gemms


def kept_mask(expert_ids: jax.Array, num_experts: int, expert_cap: int, ranks: int) -> jax.Array:
  """[T_global, k] ids (tokens in rank-major order, ``ranks`` groups of T) -> [T_global, k] bool kept."""
  del ranks  # global token order already is (rank, local token)
  tg, k = expert_ids.shape
  onehot = jax.nn.one_hot(expert_ids.reshape(tg * k), num_experts, dtype=jnp.int32)  # [P_global, E]
  earlier = jnp.cumsum(onehot, axis=0) - onehot
  pos = jnp.sum(earlier * onehot, axis=1)
  return (pos < expert_cap).reshape(tg, k)


def moe_experts_reference(x, expert_ids, gates, w1, w2, expert_cap: int, ranks: int):
  """Global MoE expert layer.

  Args:
    x: [T_global, D] tokens; expert_ids: [T_global, k] int32; gates: [T_global, k] float.
    w1: [E, D, 2F]; w2: [E, F, D].
  Returns:
    y [T_global, D] in x's dtype, and the number of dropped slots (int32 scalar).
  """
  E = w1.shape[0]
  kept = kept_mask(expert_ids, E, expert_cap, ranks)
  # Every token passes through every expert here, so what a token does not reach (skipped slots, dropped slots,
  # experts it did not pick) is masked by selection, not multiplied by a zero weight: 0 * NaN is NaN, which would
  # give a token with a non-finite x (or a NaN gate on a skipped slot) NaN in its y and in the gradients of experts
  # it never reaches, where the routed impls, which never compute those rows, give zeros. Each expert sees only the
  # tokens it takes (zeros elsewhere), forward and backward.
  routed = jax.nn.one_hot(jnp.where(kept, expert_ids, -1), E, dtype=jnp.float32)      # [T, k, E]
  reached = jnp.transpose(jnp.any(routed > 0, axis=1))                                   # [E, T]
  x_e = jnp.where(reached[:, :, None], x[None], jnp.zeros((), x.dtype))                   # [E, T, D]
  h = swiglu(jnp.einsum("etd,edf->etf", x_e, w1))
  out = jnp.einsum("etf,efd->etd", h, w2)                                      # [E, T, D]
  w = jnp.where(kept & (expert_ids >= 0), gates, 0).astype(jnp.float32)
  combine = jnp.einsum("tk,tke->te", w, routed)                                          # [T, E]
  out = jnp.where(reached[:, :, None], out.astype(jnp.float32), 0)
  y = jnp.einsum("te,etd->td", combine, out)
  return y.astype(x.dtype), jnp.sum(~kept).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------------------
# The sparse float32 oracle: the same layer at the cost of the routed work (T k rows per GEMM, not T E).


def _sort_slots(flat: jax.Array, num_experts: int):
  """[P] expert ids -> (order [P]: slot indices sorted by expert, stable; key [P]: the id, E for ids outside
  [0, E); counts [E] int32 slots per expert; first [E] int32: each expert's first place in ``order``)."""
  key = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts).astype(jnp.int32)
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  counts = jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)[:num_experts]
  return order, key, counts, jnp.cumsum(counts) - counts


def slot_kept(expert_ids: jax.Array, num_experts: int, expert_cap: int) -> jax.Array:
  """``kept_mask`` by sorting ([T, k] ids -> [T, k] bool): a slot is kept when fewer than ``expert_cap`` earlier
  slots (in the order token, choice) chose the same expert; a slot whose id lies outside [0, E) counts as kept (and
  computes nothing), as in ``kept_mask``. O(T k log(T k)) work and O(T k) memory instead of the [T k, E] one-hot."""
  T, k = expert_ids.shape
  order, key, _, first = _sort_slots(expert_ids.reshape(T * k), num_experts)
  skey = key[order]
  pos = jnp.arange(T * k, dtype=jnp.int32) - first[jnp.minimum(skey, num_experts - 1)]
  kept_sorted = (pos < expert_cap) | (skey == num_experts)
  return jnp.zeros((T * k,), bool).at[order].set(kept_sorted).reshape(T, k)


def expert_blocks(slot_experts: jax.Array, num_experts: int, block_rows: int, num_blocks: int | None = None):
  """The block layout of ``routed_combine``: each expert's slots in ``block_rows``-row blocks, blocks by expert.

  Args:
    slot_experts: [T, k] int ids; a slot whose id lies outside [0, num_experts) is skipped.
    num_blocks: static number of blocks nb; None: ceil(T k / B) + E, enough for any ids (an expert with c slots
      takes ceil(c / B) blocks). ``blocks_needed`` counts them for concrete ids.
  Returns:
    block_expert [nb] int32 (the expert of each block; blocks past the last used one name expert E - 1 and hold
    empty rows), block_slot [nb, B] int32 (the flat slot t k + j in each row; T k for an empty row), slot_row
    [T, k] int32 (each slot's row in the flat [nb B] layout; nb B for a skipped slot or one that did not fit in nb
    blocks), slot_fits [T, k] bool (False: a valid slot that did not fit).
  """
  T, k = slot_experts.shape
  P, E, B = T * k, num_experts, block_rows
  nb = -(-P // B) + E if num_blocks is None else num_blocks
  order, key, counts, first = _sort_slots(slot_experts.reshape(P), E)
  blocks = -(-counts // B)
  block_end = jnp.cumsum(blocks)
  skey = key[order]
  e = jnp.minimum(skey, E - 1)
  row = (block_end[e] - blocks[e]) * B + jnp.arange(P, dtype=jnp.int32) - first[e]   # the sorted slots' rows
  row = jnp.where((skey < E) & (row < nb * B), row, nb * B)
  block_slot = jnp.full((nb * B,), P, jnp.int32).at[row].set(order, mode="drop").reshape(nb, B)
  b = jnp.arange(nb, dtype=jnp.int32)
  block_expert = jnp.minimum(jnp.searchsorted(block_end, b, side="right"), E - 1).astype(jnp.int32)
  slot_row = jnp.zeros((P,), jnp.int32).at[order].set(row).reshape(T, k)
  valid = (key < E).reshape(T, k)
  return block_expert, block_slot, slot_row, ~valid | (slot_row < nb * B)


def blocks_needed(slot_experts, num_experts: int, block_rows: int) -> int:
  """The blocks ``expert_blocks`` fills for concrete ids: sum over experts of ceil(slots / block_rows)."""
  ids = np.asarray(slot_experts).ravel()
  counts = np.bincount(ids[(ids >= 0) & (ids < num_experts)], minlength=num_experts)
  return int(np.sum(-(-counts // block_rows)))


def routed_combine(x, slot_experts, slot_weights, w1, w2, *, block_rows: int = 128, num_blocks: int | None = None):
  """y[t] = sum_j slot_weights[t, j] * SwiGLU-MLP_{slot_experts[t, j]}(x[t]), sparse, in float32.

  Every GEMM runs in float32 at precision HIGHEST on the slots routed to the expert only: a ``lax.scan`` over blocks
  of ``block_rows`` rows of one expert (``expert_blocks``), each a fixed-size gather of x and the expert's weights
  (cast to float32 one expert at a time), its body rematerialised under ``jax.checkpoint`` (the backward pass keeps
  no per-block activations: it stores [nb, B, D] float32 block outputs and nothing of the size of x or the weights
  per block). Blocks past the last used one run on empty (zero) rows: an exact ``num_blocks`` saves their cost. (A
  ``lax.cond`` skipping them would make the scan's linearisation store its operands, x and the weights, per
  block.) The sum over j runs in the fixed order j = 0..k-1. Differentiable in x, slot_weights, w1 and w2 (the
  weight gradients accumulate over blocks in the weights' dtype: pass float32 weights to differentiate them);
  jit-able (all shapes static). Work per row of the nb B rows: 6 D F flops forward; a gradient adds 4 D F (GEMM1
  recomputed) + 2 D F (the cotangent of the SwiGLU output), and 4 D F for dx, 6 D F for dw1 and dw2 when asked
  for.

  Args:
    x: [T, D] float. slot_experts: [T, k] int; a slot whose id lies outside [0, E) contributes exactly nothing.
    slot_weights: [T, k] float. w1: [E, D, 2F]; w2: [E, F, D] (any float dtype: read in float32).
    block_rows: B, rows per GEMM. num_blocks: static blocks of the scan, see ``expert_blocks``; a slot that does
      not fit makes its token's y NaN (a loud failure, never a silent drop).
  Returns:
    y [T, D] float32.
  """
  T, k = slot_experts.shape
  E, D = w1.shape[0], x.shape[1]
  hi = jax.lax.Precision.HIGHEST
  block_expert, block_slot, slot_row, fits = expert_blocks(slot_experts, E, block_rows, num_blocks)

  @jax.checkpoint
  def block(e, slots):
    xb = jnp.take(x, slots // k, axis=0, mode="fill", fill_value=0).astype(jnp.float32)          # [B, D]
    w1e = jax.lax.dynamic_index_in_dim(w1, e, keepdims=False).astype(jnp.float32)
    w2e = jax.lax.dynamic_index_in_dim(w2, e, keepdims=False).astype(jnp.float32)
    return jnp.dot(swiglu(jnp.dot(xb, w1e, precision=hi)), w2e, precision=hi)                    # [B, D]

  def step(carry, blk):
    e, slots = blk
    return carry, block(e, slots)

  _, out = jax.lax.scan(step, None, (block_expert, block_slot))
  out = out.reshape(-1, D)                                                                     # [nb B, D]
  valid = (slot_experts >= 0) & (slot_experts < E)
  y = jnp.zeros((T, D), jnp.float32)
  for j in range(k):
    o = jnp.take(out, slot_row[:, j], axis=0, mode="fill", fill_value=0)                       # [T, D]
    o = jnp.where(fits[:, j, None], o, jnp.nan)
    y = y + jnp.where(valid[:, j, None], slot_weights[:, j, None].astype(jnp.float32) * o, 0)
  return y


def moe_experts_sparse_reference(x, expert_ids, gates, w1, w2, expert_cap: int, ranks: int, *,
                                 block_rows: int = 128, num_blocks: int | None = None):
  """``moe_experts_reference`` at the cost of the routed work: the same layer and capacity rule, sparse, float32.

  Args and returns as ``moe_experts_reference`` (y [T_global, D] in x's dtype, dropped int32), plus block_rows and
  num_blocks of ``routed_combine``. The GEMMs run in float32 (precision HIGHEST) whatever x's dtype; dropped slots
  (``slot_kept``, equal to ``kept_mask``) compute nothing and their gates get zero gradient, as in the dense oracle.
  """
  del ranks  # global token order already is (rank, local token)
  kept = slot_kept(expert_ids, w1.shape[0], expert_cap)
  y = routed_combine(x, jnp.where(kept, expert_ids, -1), jnp.where(kept, gates, 0), w1, w2,
                     block_rows=block_rows, num_blocks=num_blocks)
  return y.astype(x.dtype), jnp.sum(~kept).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------------------
# The FP8 oracle: the layer under quantization="fp8".


def moe_experts_fp8_reference(x, expert_ids, gates, w1, w2, expert_cap: int, ranks: int, quantization: str = "fp8"):
  """``moe_experts_reference`` under ``quantization="fp8"``: args and returns as there, w1 and w2 float master
  weights or ``fp8.Fp8Weight``. Each kept slot is one row of the recipe (``fp8_experts.fp8_expert_mlp`` with dense
  GEMMs), the rows grouped by expert in the global slot order; y sums a token's k rows times their gates in float32
  in the order j = 0..k-1. Differentiable (the recipe's backward for the expert GEMMs)."""
  del ranks  # global token order already is (rank, local token)
  T, k = expert_ids.shape
  E = w1.shape[0]
  kept = kept_mask(expert_ids, E, expert_cap, 1)
  routed = kept & (expert_ids >= 0) & (expert_ids < E)
  order, key, counts, _ = _sort_slots(jnp.where(routed, expert_ids, -1).reshape(T * k), E)
  rows = (key[order] < E)[:, None]
  x_rows = jnp.where(rows, jnp.take(x, order // k, axis=0), 0).astype(x.dtype)            # [T k, D] by expert
  out = fp8_expert_mlp(x_rows, w1, w2, counts, recipe_gemms("dense", quantization))
  slot_out = jnp.zeros_like(out).at[order].set(out).reshape(T, k, -1).astype(jnp.float32)
  w = jnp.where(routed, gates, 0).astype(jnp.float32)
  y = w[:, 0, None] * slot_out[:, 0]
  for j in range(1, k):
    y = y + w[:, j, None] * slot_out[:, j]
  return y.astype(x.dtype), jnp.sum(~kept).astype(jnp.int32)
