"""Flax NNX MoE modules: a router, routed SwiGLU experts sharded over one mesh axis, optional shared experts.

``MoE(config, mesh=..., rngs=...)`` returns ``(y, MoEAux)``; ``MoEBlock`` is the same module as a drop-in
feed-forward block: it returns ``y`` alone and records its auxiliary loss with ``nnx.sow``.

Parameters (``checkpoint.py`` converts them to and from MaxText's and the per-expert published layouts):
  router [D, E]; routing_bias [E] (a ``RoutingBias``, not trained by gradients; only with ``routed_bias``);
  w1 [E, D, 2F] (gate and up projections, concatenated on the last axis), or with a ``tensor_axis`` its view
  [E, D, 2, F] (gate, up: the layout whose F axis splits over the tensor axis with both halves split alike;
  ``reshape(E, D, 2F)`` gives the [E, D, 2F] layout, element for element); w2 [E, F, D];
  shared_w1 [D, 2S], shared_w2 [S, D] (only with shared experts); shared_expert_gate [D, 1] (only with
  ``MoEConfig.shared_expert_gate``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_moe_overlap import routing as routing_lib
from jax_moe_overlap import tensor_parallel as tp_lib
from jax_moe_overlap.api import explicit_mesh, explicit_spec, like_committed, moe_experts
from jax_moe_overlap.checks import (check_batch_axes, check_layer, check_master_weight, check_outside_shard_map,
                                    check_token_mask)
from jax_moe_overlap.config import CallConfig, MoEConfig
from jax_moe_overlap.expert_gemms import swiglu


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEAux:
  """Router statistics of one call, for the training loop.

  load_balance_loss: Switch-Transformer auxiliary loss E * sum_e f_e * p_e (1.0 when perfectly balanced).
  router_z_loss: mean over tokens of logsumexp(logits)^2 (ST-MoE).
  dropped_fraction: fraction of (token, choice) slots dropped by the capacity rule.
  expert_load: [E] fraction of the selections that chose each expert (``routing.update_routing_bias``'s input).
  """

  load_balance_loss: jax.Array
  router_z_loss: jax.Array
  dropped_fraction: jax.Array
  expert_load: jax.Array


class RoutingBias(nnx.Variable):
  """The selection-only routing bias: not a ``nnx.Param``, so optimizers and gradients leave it alone."""


class MoE(nnx.Module):
  """Mixture-of-Experts feed-forward block, expert-parallel over mesh axis ``expert_axis``.

  ``impl="overlap"`` runs the experts and the all-to-alls in this library's custom calls inside ``shard_map`` (over
  an expert axis that spans hosts, as ``"collective"``); ``impl="collective"`` as XLA collectives and this library's
  grouped GEMMs; ``impl="xla"`` as XLA collectives and ``lax.ragged_dot``; ``impl="reference"`` densely in plain JAX
  (the oracle). Layers of equal sizes share one peer workspace (see ``Workspace``).

  Args:
    config: a ``MoEConfig``.
    mesh: the device mesh; expert_axis: its expert-parallel axis name (E divisible by its size).
    impl: "overlap", "collective", "xla" or "reference". call_config: ``CallConfig`` (timeouts) of the custom calls.
    batch_axes: mesh axes other than expert_axis the tokens are also sharded over (``moe_experts``' batch_axes).
    tensor_axis: expert tensor parallelism (``moe_experts``' tensor_axis): each expert's hidden width split over this
      mesh axis; w1 is then kept as its [E, D, 2, F] view, sharded over (expert_axis, -, -, tensor_axis), and w2 over
      (expert_axis, tensor_axis, -). None: experts whole on their device.
    rngs: parameter initialisation.

  Call: ``y, aux = moe(x, token_mask=None)`` with x [..., D] (the number of tokens divisible by the token shards) and an
  optional bool mask of x's leading shape (False: a padding token; it selects no expert, costs nothing and gets
  y = 0 from the routed experts); y has x's shape, dtype and sharding; aux is a ``MoEAux``. With
  ``routed_bias_update_rate`` > 0 and the module in training mode (``deterministic`` False), each call updates the
  routing bias from its load.
  """

  def __init__(self, config: MoEConfig, *, mesh: jax.sharding.Mesh, rngs: nnx.Rngs, expert_axis: str = "expert",
               impl: str = "overlap", call_config: CallConfig | None = None, batch_axes: tuple[str, ...] = (),
               tensor_axis: str | None = None):
    if not isinstance(config, MoEConfig):
      raise TypeError(f"jax_moe_overlap: MoE takes a MoEConfig as its first argument, got {config!r}")
    self.batch_axes = check_layer(config, mesh, expert_axis, impl, batch_axes, tensor_axis)
    self.config, self.mesh, self.expert_axis, self.tensor_axis, self.impl = config, mesh, expert_axis, tensor_axis, impl
    self.call_config = call_config or CallConfig()
    self.deterministic = False
    values = _param_initializer(config, mesh, expert_axis, tensor_axis)(
        tuple(rngs.params() for _ in range(_num_keys(config))))
    self.router = nnx.Param(values["router"])
    self.routing_bias = RoutingBias(values["routing_bias"]) if config.routed_bias else None
    # The experts' sharding as metadata too (nnx.get_partition_spec); the values already have it.
    w1_spec, w2_spec = expert_specs(expert_axis, tensor_axis)
    self.w1 = nnx.Param(values["w1"], out_sharding=tuple(w1_spec), eager_sharding=False)
    self.w2 = nnx.Param(values["w2"], out_sharding=tuple(w2_spec), eager_sharding=False)
    if config.shared_width:
      self.shared_w1 = nnx.Param(values["shared_w1"])
      self.shared_w2 = nnx.Param(values["shared_w2"])
    else:
      self.shared_w1 = self.shared_w2 = None
    self.shared_expert_gate = nnx.Param(values["shared_expert_gate"]) if config.shared_expert_gate else None

  def route(self, x2d: jax.Array, token_mask: jax.Array | None = None) -> routing_lib.Routing:
    """x2d [T, D] -> ``Routing`` (expert ids, gates, losses, load)."""
    if token_mask is not None:
      # A padding token's features never reach the router: its logits are discarded, but the router weights'
      # gradient x^T dlogits multiplies its zero cotangent by its x, and 0 * NaN is NaN (garbage padding).
      x2d = jnp.where(token_mask[:, None], x2d, jnp.zeros((), x2d.dtype))
    logits = x2d.astype(jnp.float32) @ self._dense_weight(self.router[...], x2d).astype(jnp.float32)
    bias = self.routing_bias[...] if self.routing_bias is not None else None
    return routing_lib.route(logits, self.config, bias, token_mask)

  def shared(self, x2d: jax.Array) -> jax.Array:
    """The shared experts' dense SwiGLU path on [T, D] tokens (float32 accumulation), in the compute dtype. It
    reads only x, so XLA is free to run it while the routed tokens are in flight. With ``shared_expert_gate`` each
    token's output is scaled by sigmoid(x @ shared_expert_gate), its logit computed in float32 as the router's."""
    dt = self.config.dtype
    w1, w2 = (self._dense_weight(w[...], x2d).astype(dt) for w in (self.shared_w1, self.shared_w2))
    a = jnp.dot(x2d.astype(dt), w1, preferred_element_type=jnp.float32)
    y = jnp.dot(swiglu(a).astype(dt), w2, preferred_element_type=jnp.float32)
    if self.shared_expert_gate is not None:
      g = self._dense_weight(self.shared_expert_gate[...], x2d).astype(jnp.float32)
      y = jax.nn.sigmoid(x2d.astype(jnp.float32) @ g) * y
    return y

  def _dense_weight(self, w: jax.Array, x2d: jax.Array) -> jax.Array:
    """A replicated weight applied to tokens sharded over an Explicit mesh is placed on that mesh (replicated), so
    its gradient, a contraction over the sharded tokens, has a sharding to take (a sum over the ranks)."""
    if _explicit_in(x2d) and jax.typeof(w).sharding.mesh != jax.typeof(x2d).sharding.mesh:
      return jax.sharding.reshard(w, jax.sharding.NamedSharding(self.mesh, P()))
    return w

  def update_routing_bias(self, expert_load: jax.Array) -> None:
    """One step of DeepSeek-V3's bias update from an [E] load (``MoEAux.expert_load``, or its mean over steps)."""
    if self.routing_bias is None:
      raise ValueError("jax_moe_overlap: this MoE has no routing bias (MoEConfig.routed_bias is False)")
    self.routing_bias[...] = routing_lib.update_routing_bias(self.routing_bias[...], expert_load,
                                                             self.config.routed_bias_update_rate)

  def __call__(self, x: jax.Array, token_mask: jax.Array | None = None):
    cfg = self.config
    check_outside_shard_map(type(self).__name__)
    if x.shape[-1] != cfg.emb_dim:
      raise ValueError(f"jax_moe_overlap: MoE expects inputs [..., {cfg.emb_dim}], got {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"jax_moe_overlap: MoE takes floating-point inputs, got {x.dtype}")
    check_token_mask(token_mask, x.shape[:-1])
    x = self._onto_explicit_mesh(x)
    token_mask = None if token_mask is None else self._onto_explicit_mesh(token_mask)
    # The tokens' split over the token shards, before _flatten lays them out that way (whose reshape on Explicit
    # axes would otherwise refuse them first, without naming the rule).
    check_batch_axes(self.mesh, self.expert_axis, self.batch_axes, math.prod(x.shape[:-1]), self.tensor_axis)
    x2d = self._flatten(x)
    mask = None if token_mask is None else self._flatten(token_mask, features=False)
    r = self.route(x2d, mask)
    dt = cfg.dtype
    # Quantized experts read the master weights (quantized per call, their gradients in weight_dtype), the others
    # the weights cast to the compute dtype.
    for name in ("w1", "w2"):
      check_master_weight(type(self).__name__, name, getattr(self, name).get_value())
    w1, w2 = (w[...] if cfg.quantization else w[...].astype(dt) for w in (self.w1, self.w2))
    y, dropped = moe_experts(x2d.astype(dt), r.expert_ids, r.gates, w1, w2, mesh=self.mesh,
                             axis_name=self.expert_axis, capacity_factor=cfg.expert_capacity_factor, impl=self.impl,
                             config=self.call_config, batch_axes=self.batch_axes, tensor_axis=self.tensor_axis,
                             quantization=cfg.quantization)
    if self.shared_w1 is not None:
      y = (y.astype(jnp.float32) + self.shared(x2d)).astype(dt)
    if cfg.routed_bias_update_rate and not self.deterministic:
      self.update_routing_bias(r.expert_load)
    aux = MoEAux(r.load_balance_loss, r.router_z_loss,
                 dropped.astype(jnp.float32) / (x2d.shape[0] * cfg.num_experts_per_tok), r.expert_load)
    return self._unflatten(y.astype(x.dtype), x), aux

  def _onto_explicit_mesh(self, a: jax.Array) -> jax.Array:
    """On a mesh with Explicit axes, an input on no mesh (a plain array, such as ``jax.random.normal``'s) placed on
    the layer's mesh, replicated: the layer's reshapes and their transposes (an eager ``jax.grad`` of x) then have
    a sharding to take on both sides; y comes back with that (replicated) sharding, as before."""
    if not jax.typeof(a).sharding.mesh.empty or not explicit_mesh(self.mesh):
      return a
    return jax.sharding.reshard(a, NamedSharding(self.mesh, P()))

  def _flatten(self, a: jax.Array, features: bool = True) -> jax.Array:
    """[..., D] -> [T, D] ([...] -> [T] without ``features``); on an Explicit mesh, tokens sharded as the layer takes
    them (``tensor_parallel.operand_specs``: over the batch, expert and tensor axes), as a reshape of, say, a
    sequence-sharded x has no sharding of its own to take."""
    new = (-1, a.shape[-1]) if features else (-1,)
    if _explicit_in(a):
      tokens = tp_lib.operand_specs(self.expert_axis, self.tensor_axis, self.batch_axes)[0][0]
      spec = explicit_spec(self.mesh, P(tokens, *([None] * (len(new) - 1))))
      return jnp.reshape(a, new, out_sharding=jax.sharding.NamedSharding(self.mesh, spec))
    return a.reshape(new)

  def _unflatten(self, y: jax.Array, x: jax.Array) -> jax.Array:
    """[T, D] -> x's shape, and on an Explicit mesh x's sharding; on Auto axes an eager call's committed x gets its
    own sharding back too (the [T, D] y has x2d's, which a reshape does not carry back onto x's axes)."""
    if _explicit_in(x):
      return jnp.reshape(y, x.shape, out_sharding=jax.typeof(x).sharding)
    return like_committed(y.reshape(x.shape), x)


class MoEBlock(MoE):
  """``MoE`` as a drop-in feed-forward block: ``y = block(x)`` (x's shape, dtype and sharding), so it replaces a
  dense MLP of an NNX model in one line.

  Each call records with ``nnx.sow`` (collection ``nnx.Intermediate``): ``moe_aux_loss``, the weighted auxiliary loss
  ``load_balance_loss_weight * load_balance_loss + router_z_loss_weight * router_z_loss``, and ``moe_aux``, the
  call's ``MoEAux``. Collect them with ``y, inter = nnx.capture(model, nnx.Intermediate)(x)`` and add
  ``total_aux_loss(inter)`` to the training loss. Outside ``nnx.capture`` (inference) nothing is recorded: no module
  attribute that would grow call after call, nor flax's deprecation warning for one.
  """

  def __call__(self, x: jax.Array, token_mask: jax.Array | None = None) -> jax.Array:
    y, aux = super().__call__(x, token_mask)
    cfg = self.config
    self.sow(nnx.Intermediate, "moe_aux_loss", cfg.load_balance_loss_weight * aux.load_balance_loss +
             cfg.router_z_loss_weight * aux.router_z_loss, capture_noop=True)
    self.sow(nnx.Intermediate, "moe_aux", aux, capture_noop=True)
    return y


def total_aux_loss(intermediates) -> jax.Array:
  """The sum of every ``moe_aux_loss`` record in ``intermediates`` (the ``nnx.Intermediate`` state from
  ``nnx.capture(model, nnx.Intermediate)`` or ``nnx.pop(model, nnx.Intermediate)``), a scalar: layers stacked under
  ``nnx.scan`` record an array of their losses, each of which counts; 0.0 when there is none."""
  total = jnp.zeros((), jnp.float32)
  for path, leaf in jax.tree_util.tree_leaves_with_path(intermediates):
    if any(getattr(key, "key", None) == "moe_aux_loss" for key in path):
      # Summed whole: layers stacked by nnx.scan / nnx.vmap record one [L] array, one loss per layer.
      total = total + jnp.sum(leaf)
  return total


def _num_keys(config: MoEConfig) -> int:
  """Random keys the parameters take: router, w1, w2, the two shared-expert matrices when there are any, and the
  shared expert's gate when it has one."""
  return 3 + (2 if config.shared_width else 0) + (1 if config.shared_expert_gate else 0)


def expert_specs(expert_axis: str, tensor_axis: str | None) -> tuple[P, P]:
  """The PartitionSpecs of the module's w1 and w2: over the expert axis; with a tensor axis, w1's [E, D, 2, F] view
  and w2 split over it along F as well."""
  if tensor_axis is None:
    return P(expert_axis, None, None), P(expert_axis, None, None)
  return tp_lib.operand_specs(expert_axis, tensor_axis, ())[1:]


@functools.lru_cache(maxsize=None)
def _param_initializer(config: MoEConfig, mesh: jax.sharding.Mesh, expert_axis: str, tensor_axis: str | None):
  """The jit-compiled initializer of one layer's parameters: keys -> {name: array}, each array created with its
  sharding on the mesh (w1 and w2 split over expert_axis and tensor_axis, the rest replicated), so that no parameter
  is ever whole on one device and the first call of the layer finds its parameters where it needs them (no
  resharding, no second compilation). Cached per (config, mesh, axes): layers of one configuration share one
  compiled initializer. Under a trace (``nnx.eval_shape``, a jitted model constructor) the shardings become the
  values' sharding constraints. With a tensor axis w1 is drawn as [E, D, 2F] (the draws of a layer without one, up
  to the rounding of the compiled initializer) and kept as its [E, D, 2, F] view."""
  D, F, E, S, wd = config.emb_dim, config.moe_mlp_dim, config.num_experts, config.shared_width, config.weight_dtype
  w1_spec, w2_spec = expert_specs(expert_axis, tensor_axis)
  replicated = NamedSharding(mesh, P())
  shardings = {"router": replicated, "w1": NamedSharding(mesh, w1_spec), "w2": NamedSharding(mesh, w2_spec)}
  if config.routed_bias:
    shardings.update(routing_bias=replicated)
  if S:
    shardings.update(shared_w1=replicated, shared_w2=replicated)
  if config.shared_expert_gate:
    shardings.update(shared_expert_gate=replicated)

  def init(keys):
    fan_in = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=0)  # fan-in per expert
    w1 = fan_in(keys[1], (E, D, 2 * F), wd)
    values = {"router": nnx.initializers.normal(0.02)(keys[0], (D, E), wd),
              "w1": w1 if tensor_axis is None else tp_lib.w1_view(w1), "w2": fan_in(keys[2], (E, F, D), wd)}
    if config.routed_bias:
      values.update(routing_bias=jnp.zeros((E,), jnp.float32))
    if S:
      dense = nnx.initializers.lecun_normal()
      values.update(shared_w1=dense(keys[3], (D, 2 * S), wd), shared_w2=dense(keys[4], (S, D), wd))
    if config.shared_expert_gate:
      values.update(shared_expert_gate=nnx.initializers.lecun_normal()(keys[-1], (D, 1), wd))
    return values

  return jax.jit(init, out_shardings=shardings)


def _explicit_in(a: jax.Array) -> bool:
  """Whether a's sharding type names a mesh with Explicit axes."""
  return explicit_mesh(jax.typeof(a).sharding.mesh)
