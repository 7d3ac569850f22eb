"""Flax NNX ``MoE`` module: top-k router + SwiGLU experts, expert-parallel over one mesh axis."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jax_moe_overlap.api import moe_experts
from jax_moe_overlap.primitives import CallConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEAux:
  """Router statistics of one call, for the training loop.

  load_balance_loss: Switch-Transformer auxiliary loss E * sum_e f_e * p_e (1.0 when perfectly balanced).
  router_z_loss: mean over tokens of logsumexp(logits)^2 (ST-MoE).
  dropped_fraction: fraction of (token, choice) slots dropped by the capacity rule.
  """

  load_balance_loss: jax.Array
  router_z_loss: jax.Array
  dropped_fraction: jax.Array


class MoE(nnx.Module):
  """Mixture-of-Experts feed-forward block.

  Tokens and experts are sharded over ``mesh`` axis ``expert_axis``; with ``impl="overlap"`` the expert compute and
  the all-to-alls run in this library's custom calls inside ``shard_map``, with ``impl="reference"`` as plain JAX.
  Layers of equal sizes share one peer workspace (see ``Workspace``).

  Args:
    d_model: model width D. d_ff: expert hidden width F. num_experts: E (divisible by the axis size). top_k: k.
    mesh: the device mesh; expert_axis: its expert-parallel axis name.
    capacity_factor: None (dropless) or rows per expert = ceil(cf * tokens * k / E); overflow slots are dropped.
    dtype: compute dtype of the experts (float32 or bfloat16); parameters are kept in param_dtype.
    config: CallConfig (timeouts) of the custom calls.
    batch_axes: mesh axes other than expert_axis the tokens are also sharded over (``moe_experts``' batch_axes).

  Call: ``y, aux = moe(x)`` with x [..., D] (the number of tokens divisible by the axis size); y has x's shape and
  dtype; aux is a ``MoEAux``.
  """

  def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int, *, mesh: jax.sharding.Mesh,
               expert_axis: str = "expert", capacity_factor: float | None = None, impl: str = "overlap",
               dtype=jnp.float32, param_dtype=jnp.float32, config: CallConfig = CallConfig(), rngs: nnx.Rngs,
               batch_axes: tuple[str, ...] = ()):
    if expert_axis not in mesh.axis_names:
      raise ValueError(f"jax_moe_overlap: the mesh has axes {tuple(mesh.axis_names)} but no axis named "
                       f"{expert_axis!r} for expert parallelism")
    R = mesh.shape[expert_axis]
    if num_experts % R:
      raise ValueError(f"jax_moe_overlap: {num_experts} experts cannot be split evenly over the {R} devices of "
                       f"mesh axis {expert_axis!r}")
    if not 1 <= top_k <= num_experts:
      raise ValueError(f"jax_moe_overlap: top_k must be in [1, num_experts={num_experts}], got {top_k}")
    if impl not in ("overlap", "reference"):
      raise ValueError(f"jax_moe_overlap: impl must be 'overlap' or 'reference', got {impl!r}")
    if jnp.dtype(dtype) not in (jnp.float32, jnp.bfloat16):
      raise TypeError(f"jax_moe_overlap: dtype must be float32 or bfloat16, got {jnp.dtype(dtype)}")
    self.d_model, self.d_ff, self.num_experts, self.top_k = d_model, d_ff, num_experts, top_k
    self.mesh, self.expert_axis, self.capacity_factor, self.impl = mesh, expert_axis, capacity_factor, impl
    self.dtype, self.config, self.batch_axes = dtype, config, tuple(batch_axes)
    init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=0)  # fan-in per expert
    self.router = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (d_model, num_experts), param_dtype))
    self.w1 = nnx.Param(init(rngs.params(), (num_experts, d_model, 2 * d_ff), param_dtype),
                        out_sharding=(expert_axis, None, None), eager_sharding=False)
    self.w2 = nnx.Param(init(rngs.params(), (num_experts, d_ff, d_model), param_dtype),
                        out_sharding=(expert_axis, None, None), eager_sharding=False)

  def route(self, x2d: jax.Array):
    """x2d [T, D] -> (expert_ids [T, k] int32, gates [T, k] float32, aux losses)."""
    logits = x2d.astype(jnp.float32) @ self.router[...].astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, ids = jax.lax.top_k(probs, self.top_k)
    gates = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    E = self.num_experts
    frac_routed = jnp.mean(jax.nn.one_hot(ids, E, dtype=jnp.float32).sum(axis=1), axis=0) / self.top_k
    load_balance = E * jnp.sum(frac_routed * jnp.mean(probs, axis=0))
    z_loss = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return ids.astype(jnp.int32), gates, load_balance, z_loss

  def __call__(self, x: jax.Array):
    shape = x.shape
    if shape[-1] != self.d_model:
      raise ValueError(f"jax_moe_overlap: MoE expects inputs [..., {self.d_model}], got {shape}")
    x2d = x.reshape(-1, self.d_model)
    ids, gates, lb, z = self.route(x2d)
    y, dropped = moe_experts(x2d.astype(self.dtype), ids, gates, self.w1[...].astype(self.dtype),
                             self.w2[...].astype(self.dtype), mesh=self.mesh, axis_name=self.expert_axis,
                             capacity_factor=self.capacity_factor, impl=self.impl, config=self.config,
                             batch_axes=self.batch_axes)
    aux = MoEAux(lb, z, dropped.astype(jnp.float32) / (x2d.shape[0] * self.top_k))
    return y.reshape(shape).astype(x.dtype), aux
