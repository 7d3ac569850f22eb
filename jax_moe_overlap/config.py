"""``MoEConfig``: the static description of one MoE block, with MaxText's names where MaxText has the option.

Examples (the experts' widths scaled down; the routing as published):

  DeepSeek-V3 style: sigmoid scores, a selection-only bias updated from the load, 8 groups of which 4 are searched,
  top-8 renormalised and scaled by 2.5, one shared expert::

    MoEConfig(emb_dim=1024, moe_mlp_dim=512, num_experts=64, num_experts_per_tok=8, routed_score_func="sigmoid",
              routed_bias=True, routed_bias_update_rate=1e-3, n_routing_groups=8, topk_routing_group=4,
              norm_topk_prob=True, routed_scaling_factor=2.5, shared_experts=1, load_balance_loss_weight=0.0)

  Mixtral / Qwen3-MoE style: softmax over all experts, top-k renormalised, no shared expert::

    MoEConfig(emb_dim=1024, moe_mlp_dim=3584, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)

  Qwen2-MoE style (Qwen1.5-MoE-A2.7B's sizes and routing): softmax, top-4 of 60 not renormalised, one shared expert of width
  5632 scaled per token by sigmoid(x @ shared_expert_gate)::

    MoEConfig(emb_dim=2048, moe_mlp_dim=1408, num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
              shared_experts=1, shared_mlp_dim=5632, shared_expert_gate=True)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jax_moe_overlap.checks import check_dtype, check_experts

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """One MoE feed-forward block.

  Sizes:
    emb_dim: model width D. moe_mlp_dim: hidden width F of one routed expert (SwiGLU: gate and up are F wide).
    num_experts: E routed experts. num_experts_per_tok: k experts per token.
    shared_experts: number of shared (always-on) experts; their dense SwiGLU path is shared_experts * moe_mlp_dim
      wide (as MaxText and DeepSeek-V3 size it) unless shared_mlp_dim gives the width. 0: none.
    shared_expert_gate: scale the shared path per token by sigmoid(x @ g), with g a learned [D, 1] weight:
      y = routed(x) + sigmoid(x @ g) * shared(x), as Qwen2-MoE and Qwen3-Next do (the weight is their
      ``shared_expert_gate``: ``mlp.shared_expert_gate.weight`` [1, D] in Hugging Face checkpoints,
      ``shared_expert_gate/kernel`` [D, 1] in MaxText's Qwen3-Next block). Needs shared experts.
  Capacity:
    capacity_factor: None or any value <= 0 (MaxText's -1): dropless. Else each expert takes at most
      ceil(cf * tokens * k / E) rows per call; later slots (in global token order) are dropped.
  Router (``routing.route``):
    routed_score_func: "softmax" (Mixtral, Qwen3-MoE) or "sigmoid" (DeepSeek-V3) scores of the router logits.
    routed_bias: a per-expert bias added to the scores for the *selection* only (DeepSeek-V3's auxiliary-loss-free
      balancing); the gates use the unbiased scores. Kept as a non-trainable ``RoutingBias`` variable, updated by
      ``routing.update_routing_bias`` with routed_bias_update_rate from each step's load.
    n_routing_groups, topk_routing_group: group-limited routing: the experts form n_routing_groups equal groups,
      each token searches its topk_routing_group best groups (a group's score: the sum of its two best selection
      scores) and picks its k experts among them. -1: off.
    norm_topk_prob: divide the k selected scores by their sum. routed_scaling_factor: multiplies the gates after.
    load_balance_loss_weight, router_z_loss_weight: weights of the Switch load-balance loss and the ST-MoE z-loss
      in the total auxiliary loss that the drop-in block records (``MoEBlock``; ``total_aux_loss`` sums the layers).
      This library's load-balance loss is 1.0 for a balanced router; Hugging Face's ``load_balancing_loss_func``
      (weighted by ``router_aux_loss_coef``) and MaxText's ``load_balance_loss`` (weighted by MaxText's own
      ``load_balance_loss_weight``) score k = num_experts_per_tok there, and both stand for all L MoE layers at once
      (HF pools every layer's tokens into one loss; MaxText averages the layers' losses). So the same penalty takes
      load_balance_loss_weight = k * coef / L here: exactly for one layer against HF, and against MaxText when each
      call holds one sequence (MaxText takes the statistics per sequence and averages over the batch).
  Dtypes:
    dtype: compute dtype of the experts (float32 or bfloat16). weight_dtype: dtype the parameters are kept in.
    The router always computes in float32.
  """

  emb_dim: int
  moe_mlp_dim: int
  num_experts: int
  num_experts_per_tok: int
  capacity_factor: float | None = None
  routed_score_func: str = "softmax"
  routed_bias: bool = False
  routed_bias_update_rate: float = 0.0
  n_routing_groups: int = -1
  topk_routing_group: int = -1
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 1.0
  shared_experts: int = 0
  shared_mlp_dim: int | None = None
  shared_expert_gate: bool = False
  load_balance_loss_weight: float = 0.01
  router_z_loss_weight: float = 0.0
  dtype: Any = jnp.float32
  weight_dtype: Any = jnp.float32

  def __post_init__(self):
    for name in ("emb_dim", "moe_mlp_dim", "num_experts", "num_experts_per_tok"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"jax_moe_overlap: MoEConfig.{name} must be a positive int, got {v!r}")
    check_experts(self.num_experts, self.num_experts_per_tok, 1, "")
    if self.routed_score_func not in SCORE_FUNCS:
      raise ValueError(f"jax_moe_overlap: MoEConfig.routed_score_func must be one of {SCORE_FUNCS}, got "
                       f"{self.routed_score_func!r}")
    if (self.n_routing_groups > 0) != (self.topk_routing_group > 0):
      raise ValueError("jax_moe_overlap: group-limited routing needs both n_routing_groups and topk_routing_group "
                       f"(> 0), got {self.n_routing_groups} and {self.topk_routing_group}")
    if self.n_routing_groups > 0:
      G = self.n_routing_groups
      if self.num_experts % G or self.topk_routing_group > G:
        raise ValueError(f"jax_moe_overlap: {self.num_experts} experts do not form {G} equal groups of which "
                         f"topk_routing_group={self.topk_routing_group} are searched")
      if self.num_experts_per_tok > self.topk_routing_group * (self.num_experts // G):
        raise ValueError(f"jax_moe_overlap: num_experts_per_tok={self.num_experts_per_tok} exceeds the "
                         f"{self.topk_routing_group * (self.num_experts // G)} experts of the searched groups")
    if self.shared_experts < 0 or (self.shared_mlp_dim is not None and self.shared_mlp_dim < 1):
      raise ValueError(f"jax_moe_overlap: shared_experts must be >= 0 and shared_mlp_dim positive or None, got "
                       f"{self.shared_experts} and {self.shared_mlp_dim}")
    if self.shared_expert_gate and self.shared_experts == 0:
      raise ValueError("jax_moe_overlap: shared_expert_gate scales the shared experts' output, but shared_experts is 0")
    if self.routed_bias_update_rate and not self.routed_bias:
      raise ValueError("jax_moe_overlap: routed_bias_update_rate is set but routed_bias is False")
    check_dtype("MoEConfig.dtype", self.dtype)

  @property
  def dropless(self) -> bool:
    return self.capacity_factor is None or self.capacity_factor <= 0

  @property
  def expert_capacity_factor(self) -> float | None:
    """The capacity factor as ``moe_experts`` takes it (None: dropless)."""
    return None if self.dropless else float(self.capacity_factor)

  @property
  def shared_width(self) -> int:
    """Hidden width of the shared experts' dense SwiGLU path (0: none)."""
    if self.shared_experts == 0:
      return 0
    return self.shared_mlp_dim if self.shared_mlp_dim is not None else self.shared_experts * self.moe_mlp_dim
