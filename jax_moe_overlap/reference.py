"""The pure-JAX reference MoE expert layer: the test oracle and ``impl="reference"``.

It computes every expert densely on every token of the whole (global) batch and applies the same capacity rule as
the plan, written independently: a slot is kept when fewer than ``expert_cap`` earlier slots of its group chose the
same expert, in the global slot order (source rank, token, choice). No communication, no custom calls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe_overlap.primitives import swiglu


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
  h = swiglu(jnp.einsum("td,edf->etf", x, w1))
  out = jnp.einsum("etf,efd->etd", h, w2)                                      # [E, T, D]
  w = jnp.where(kept, gates, 0).astype(jnp.float32)
  combine = jnp.einsum("tk,tke->te", w, jax.nn.one_hot(expert_ids, E, dtype=jnp.float32))  # [T, E]
  y = jnp.einsum("te,etd->td", combine, out.astype(jnp.float32))
  return y.astype(x.dtype), jnp.sum(~kept).astype(jnp.int32)
