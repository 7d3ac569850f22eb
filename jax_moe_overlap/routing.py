"""Token-choice top-k routers: router logits -> expert ids, gates and the router's auxiliary losses.

The rules, as published:

* Scores: ``softmax`` over the experts (Switch, Mixtral, Qwen3-MoE) or an element-wise ``sigmoid`` (DeepSeek-V3).
* Selection: the k largest *selection scores*, which are the scores plus an optional per-expert routing bias
  (DeepSeek-V3's auxiliary-loss-free balancing: the bias steers which experts are chosen, never the gate values).
* Group-limited selection (DeepSeek-V3): the E experts form G equal groups; a group's score is the sum of its two
  largest selection scores (its largest when a group holds one expert); the ``topk_routing_group`` best groups stay
  and the k experts are chosen among their experts only.
* Gates: the unbiased scores of the chosen experts, divided by their sum when ``norm_topk_prob`` (with softmax
  scores this is Mixtral's softmax over the top-k logits), then multiplied by ``routed_scaling_factor``.
* Losses: the Switch load-balance loss E * sum_e f_e p_e (f_e: the fraction of the selections that chose e; p_e: the
  mean over tokens of e's score, normalised per token so that it sums to 1) and the ST-MoE z-loss, the mean over
  tokens of logsumexp(logits)^2. A perfectly balanced router has load-balance loss 1.0.
* Bias update (DeepSeek-V3): after a step, b_e += rate * sign(mean load - load_e): underloaded experts become more
  likely to be selected.

Tokens masked out by ``token_mask`` (padding) select nothing: their expert ids are -1 (skipped slots: no transfer,
no GEMM rows, zero output) and they count in neither loss nor load.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_moe_overlap.checks import check_expert_vector, check_router_logits, check_token_mask
from jax_moe_overlap.plan import SKIP


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
  """One router call's result.

  expert_ids: [T, k] int32 (-1 for masked tokens). gates: [T, k] float32 (0 for masked tokens).
  load_balance_loss, router_z_loss: [] float32 (see the module docstring).
  expert_load: [E] float32 fraction of the selections of the call that chose each expert (sums to 1, or 0 when
    every token is masked); the input of ``update_routing_bias``.
  """

  expert_ids: jax.Array
  gates: jax.Array
  load_balance_loss: jax.Array
  router_z_loss: jax.Array
  expert_load: jax.Array


def scores_of(logits: jax.Array, score_func: str) -> jax.Array:
  """[T, E] float32 logits -> [T, E] scores."""
  if score_func == "softmax":
    return jax.nn.softmax(logits, axis=-1)
  if score_func == "sigmoid":
    return jax.nn.sigmoid(logits)
  raise ValueError(f"jax_moe_overlap: unknown routed_score_func {score_func!r}")


def select(selection: jax.Array, k: int, n_groups: int = -1, topk_groups: int = -1) -> jax.Array:
  """[T, E] selection scores -> [T, k] int32 ids of the k largest, among the ``topk_groups`` best of ``n_groups``
  groups when both are > 0 (ties: the lower id first, as ``lax.top_k``)."""
  if n_groups > 0:
    T, E = selection.shape
    grouped = selection.reshape(T, n_groups, E // n_groups)
    best, _ = jax.lax.top_k(grouped, min(2, E // n_groups))
    _, groups = jax.lax.top_k(jnp.sum(best, axis=-1), topk_groups)                   # [T, topk_groups]
    keep = jnp.sum(jax.nn.one_hot(groups, n_groups, dtype=jnp.int32), axis=1) > 0   # [T, G]
    selection = jnp.where(jnp.repeat(keep, E // n_groups, axis=1), selection, -jnp.inf)
  _, ids = jax.lax.top_k(selection, k)
  return ids.astype(jnp.int32)


def route(logits: jax.Array, config, bias: jax.Array | None = None,
          token_mask: jax.Array | None = None) -> Routing:
  """Routes [T, E] router logits (computed in float32) by ``config`` (a ``MoEConfig``).

  Args:
    logits: [T, E] router logits. bias: [E] floating selection-only routing bias (None: none); only with
      ``config.routed_bias`` (a bias given to a config without it is refused). token_mask: [T] bool, False for tokens
      that select nothing (None: all select).
  """
  check_router_logits(logits, config.num_experts)
  if bias is not None:
    if not config.routed_bias:
      raise ValueError("jax_moe_overlap: route got a routing bias, but config.routed_bias is False: set "
                       "MoEConfig(routed_bias=True) or pass bias=None")
    check_expert_vector("the routing bias", bias, config.num_experts)
  check_token_mask(token_mask, logits.shape[:1])
  logits = logits.astype(jnp.float32)
  T, E = logits.shape
  k = config.num_experts_per_tok
  valid = jnp.ones((T,), bool) if token_mask is None else token_mask.astype(bool)
  # A masked token's logits are replaced by zeros before anything reads them: its ids and gates are overwritten
  # below and its weight in the losses is 0, but 0 * NaN is NaN, so a padding token holding NaN or Inf (garbage
  # padding) would make load_balance_loss and the gradients through the masked rows NaN, whatever its weight.
  logits = jnp.where(valid[:, None], logits, 0)
  scores = scores_of(logits, config.routed_score_func)
  selection = scores if bias is None else scores + jax.lax.stop_gradient(bias.astype(jnp.float32))[None, :]
  ids = select(jax.lax.stop_gradient(selection), k, config.n_routing_groups, config.topk_routing_group)
  gates = jnp.take_along_axis(scores, ids, axis=-1)
  if config.norm_topk_prob:
    gates = gates / (jnp.sum(gates, axis=-1, keepdims=True) + 1e-20)
  gates = gates * config.routed_scaling_factor

  w = valid.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(w), 1.0)
  chosen = jnp.sum(jax.nn.one_hot(ids, E, dtype=jnp.float32), axis=1) * w[:, None]   # [T, E]
  expert_load = jnp.sum(chosen, axis=0) / (n * k)
  probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
  load_balance = E * jnp.sum(jax.lax.stop_gradient(expert_load) * (jnp.sum(probs * w[:, None], axis=0) / n))
  z_loss = jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * w) / n
  ids = jnp.where(valid[:, None], ids, SKIP)
  gates = jnp.where(valid[:, None], gates, 0.0)
  return Routing(ids, gates, load_balance, z_loss, jax.lax.stop_gradient(expert_load))


def update_routing_bias(bias: jax.Array, expert_load: jax.Array, rate: float) -> jax.Array:
  """DeepSeek-V3's bias update from one step's [E] load: b + rate * sign(mean(load) - load). A load within float32
  rounding of the mean counts as equal to it (the load is a count over a total: exact in integers). bias and
  expert_load: floating [E] (an integer bias could not hold the steps); rate >= 0."""
  check_expert_vector("the routing bias", bias, None)
  check_expert_vector("expert_load", expert_load, bias.shape[0])
  if not isinstance(rate, jax.Array) and not rate >= 0:
    raise ValueError(f"jax_moe_overlap: the bias update's rate must be >= 0, got {rate!r}")
  load = expert_load.astype(jnp.float32)
  mean = jnp.mean(load)
  diff = mean - load
  step = jnp.where(jnp.abs(diff) > 1e-5 * jnp.abs(mean), jnp.sign(diff), 0.0)
  return (bias.astype(jnp.float32) + rate * step).astype(bias.dtype)
