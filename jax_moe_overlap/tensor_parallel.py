"""Expert tensor parallelism (``tensor_axis``; docs/design.md, "Expert tensor parallelism"): the layer's layout over a
tensor axis (``w1_view``, ``operand_specs``, ``weight_spec``, ``gate_up_shards``, every expert-parallel impl), and for
``impl="overlap"`` the tensor shards of the experts as the experts of one exchange group (``shard_slots``).

The expert axis (R devices) and the tensor axis (TP devices) together form one exchange group of R TP ranks, rank
g = r TP + t (``jax.lax.axis_index`` of the tuple (expert axis, tensor axis)). Rank g holds, of the experts
r E_l ... (r + 1) E_l - 1 (E_l = E / R), the t-th F / TP columns of the gate and of the up projection and the t-th
F / TP rows of w2: its E_l *shard experts*, numbered as the experts of an expert-parallel group of R TP ranks,
shard expert v = g E_l + e_local.

A token's choice j of expert e becomes TP slots, j TP + s for s = 0..TP-1, the choices of the shard experts of e
on the TP ranks of its owner's tensor group, each with the choice's gate (``shard_slots``). The expert-parallel
machinery then runs unchanged on R TP ranks, TP E experts and k TP choices: the dispatch sends a token's row to
every member of its expert's tensor group, GEMM1 and the SwiGLU are local to a shard (its gate and up columns are
the same F / TP hidden units), GEMM2 gives each shard's partial sum of the expert's output, and the combine returns
the partials to the token's owner and sums its k TP slots in slot order, y[t] = sum_j sum_s g_j partial_{j, s}: for
each choice the shards in tensor order 0, 1, ..., TP - 1, in float32, so the output is bitwise the same call after
call. The partials cross in the layer's dtype (the combine's rows).

Capacity: every shard expert of e receives the same slots in the same global slot order, so each keeps and drops
exactly the slots the expert keeps and drops (all members of a tensor group hold the same rows); each dropped slot
is counted TP times by the plan, once per shard.

Backward (``expert_block``'s, unchanged): a shard slot's gate gradient is dy . its partial, and ``shard_slots``'
gate gradient sums a choice's TP of them in tensor order; dx is the combine of the shards' partial input gradients
da W1_shard^T with unit gates, summed over a token's k TP slots in the same order; each rank's weight gradients are
those of its shards.

FP8 (``quantization="fp8"``: impl "xla", "collective" and "overlap", whose shard slots are these; the reference
computes whole experts): F / TP is a multiple of 128, so a
shard's 128 x 128 weight blocks and its 1 x 128 tiles of a and h are tiles of the whole expert's, and each rank runs
the recipe on its shard (master weights quantized per call, or its part of a pre-quantized ``fp8.Fp8Weight``, laid
out by ``w1_view`` and ``weight_spec``). The result is the unsplit recipe's but for where its sums over F split: the
forward's partial outputs and the backward's partial input gradients, each in the layer's dtype, summed in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_moe_overlap import fp8
from jax_moe_overlap.plan import SKIP, Plan

# The shard expert id of an expert id outside [0, E) other than SKIP: outside [0, E TP) and not SKIP, so the plan
# marks the slot invalid and the custom calls report it (``name_expert_ids`` puts the original id in the report).
_INVALID = SKIP - 1


def gate_up_shards(w1):
  """A rank's w1 as the grouped GEMMs take it: [E_l, D, 2, F_l] (the [E, D, 2, F] view's shard: gate, up) ->
  [E_l, D, 2 F_l] (its gate columns, then its up columns: the SwiGLU's halves of the same F_l hidden units). An
  ``fp8.Fp8Weight`` in the view ``w1_view`` gives it (values [E_l, 2, F_l, D], scales [E_l, 2, F_l / 128, D / 128])
  -> the Fp8Weight of those [E_l, D, 2 F_l] columns. [E, D, 2F] (and a 3-D Fp8Weight) as given."""
  if isinstance(w1, fp8.Fp8Weight):
    return fp8.Fp8Weight(*(a.reshape(a.shape[0], -1, a.shape[-1]) for a in (w1.values, w1.scales)))
  return w1.reshape(w1.shape[0], w1.shape[1], -1)


def shard_expert_ids(expert_ids: jax.Array, num_experts: int, ranks: int, tensor: int) -> jax.Array:
  """[T, k] expert ids -> [T, k TP] shard expert ids: slot j TP + s is the shard of expert e on tensor rank s of
  e's expert rank, ((e // E_l) TP + s) E_l + e % E_l. SKIP stays SKIP; an id outside [0, E) becomes an invalid one."""
  T, k = expert_ids.shape
  e_local = num_experts // ranks
  e = expert_ids.astype(jnp.int32)[:, :, None]
  s = jnp.arange(tensor, dtype=jnp.int32)[None, None, :]
  v = ((e // e_local) * tensor + s) * e_local + e % e_local
  valid = (e >= 0) & (e < num_experts)
  v = jnp.where(valid, v, jnp.where(e == SKIP, SKIP, _INVALID))
  return v.reshape(T, k * tensor)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def repeat_gates(gates: jax.Array, tensor: int) -> jax.Array:
  """[T, k] gates -> [T, k TP], slot j TP + s carrying gate j. Its gradient sums a choice's TP slots in tensor
  order s = 0, 1, ..., TP - 1 (written out, not left to a reduction's order)."""
  return jnp.repeat(gates, tensor, axis=1)


def _repeat_gates_fwd(gates, tensor):
  return repeat_gates(gates, tensor), None


def _repeat_gates_bwd(tensor, _, ct):
  T = ct.shape[0]
  parts = ct.reshape(T, -1, tensor)
  total = parts[:, :, 0]
  for s in range(1, tensor):
    total = total + parts[:, :, s]
  return (total,)


repeat_gates.defvjp(_repeat_gates_fwd, _repeat_gates_bwd)


def shard_slots(expert_ids: jax.Array, gates: jax.Array, num_experts: int, ranks: int, tensor: int):
  """A rank's [T, k] routing -> its [T, k TP] shard slots: (shard expert ids, gates); the identity at TP = 1."""
  if tensor == 1:
    return expert_ids, gates
  return shard_expert_ids(expert_ids, num_experts, ranks, tensor), repeat_gates(gates, tensor)


def name_expert_ids(plan: Plan, expert_ids: jax.Array, tensor: int) -> Plan:
  """The plan of shard slots, its invalid slots naming the original expert id (what the custom calls report for a
  slot whose id lies outside [0, E)) instead of the shard id standing for it."""
  if tensor == 1:
    return plan
  original = jnp.repeat(expert_ids.astype(jnp.int32).reshape(-1), tensor)
  return dataclasses.replace(plan, slot_dest_row=jnp.where(plan.slot_dest_rank == -1, original,
                                                           plan.slot_dest_row).astype(jnp.int32))


def w1_view(w1, reshape=jnp.reshape):
  """w1 [E, D, 2F] (gate | up) or its view [E, D, 2, F] -> the view (the same elements in the same order): the
  layout that splits over a tensor axis along F with the gate's and the up projection's columns split alike. An
  ``fp8.Fp8Weight`` of w1 (values [E, 2F, D], scales [E, 2F / 128, D / 128]: W^T's rows are w1's columns) -> the
  Fp8Weight of the view, values [E, 2, F, D] and scales [E, 2, F / 128, D / 128] (F a multiple of 128: no block
  straddles the gate and the up halves). ``reshape(a, shape)`` reshapes each array (``jnp.reshape``, or one that
  names its output sharding)."""
  if isinstance(w1, fp8.Fp8Weight):
    if w1.values.ndim == 4:
      return w1
    return fp8.Fp8Weight(*(reshape(a, (a.shape[0], 2, a.shape[1] // 2, a.shape[2])) for a in (w1.values, w1.scales)))
  if w1.ndim == 4:
    return w1
  return reshape(w1, (w1.shape[0], w1.shape[1], 2, w1.shape[2] // 2))


def operand_specs(axis_name: str, tensor_axis: str | None, batch_axes: tuple[str, ...]):
  """The layer's layout on the mesh: (tokens, w1's [E, D, 2, F] view, w2 [E, F, D]). Tokens over
  (*batch_axes, axis_name, tensor_axis): every device holds distinct tokens; experts over axis_name and, with a
  tensor axis, their hidden width F over it."""
  tensor = (tensor_axis,) if tensor_axis is not None else ()
  return P((*batch_axes, axis_name, *tensor)), P(axis_name, None, None, tensor_axis), P(axis_name, tensor_axis, None)


def weight_spec(w, spec: P):
  """The layout of a weight argument whose float array (w1's view [E, D, 2, F] or w2 [E, F, D]) takes ``spec``: a
  float array takes ``spec``; an ``fp8.Fp8Weight`` stores W^T per expert (its values and its scales [E, ..., K],
  the contraction axis K last), so each takes ``spec`` with K's entry (axis 1) moved last."""
  if isinstance(w, fp8.Fp8Weight):
    moved = P(spec[0], *spec[2:], spec[1])
    return fp8.Fp8Weight(moved, moved)
  return spec
