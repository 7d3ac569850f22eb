"""MoE blocks configured like published models (their routing as published, their sizes scaled down).

  python examples/configs.py      # builds each on the local devices (4 virtual CPUs without a GPU), runs a step

Use one as the feed-forward block of an NNX model (``jmo.MoEBlock`` returns y alone and records its auxiliary loss):

  self.ffn = jmo.MoEBlock(deepseek_style(d_model), mesh=mesh, impl="overlap", rngs=rngs)
  ...
  y, inter = nnx.capture(model, nnx.Intermediate)(tokens)
  loss = task_loss(y) + jmo.total_aux_loss(inter)
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
from flax import nnx  # pylint: disable=wrong-import-position

import jax_moe_overlap as jmo  # pylint: disable=wrong-import-position


def deepseek_style(emb_dim: int = 1024, dtype=jnp.bfloat16) -> jmo.MoEConfig:
  """DeepSeek-V3's routing: sigmoid scores; a per-expert bias that steers the selection only, updated from each
  step's load instead of a load-balance loss; 8 groups of experts of which each token searches 4; top-8 gates
  renormalised and scaled by 2.5; one shared expert. (DeepSeek-V3: 256 routed experts of width 2048 at
  emb_dim 7168.)"""
  return jmo.MoEConfig(emb_dim=emb_dim, moe_mlp_dim=emb_dim // 2, num_experts=64, num_experts_per_tok=8,
                       routed_score_func="sigmoid", routed_bias=True, routed_bias_update_rate=1e-3,
                       n_routing_groups=8, topk_routing_group=4, norm_topk_prob=True, routed_scaling_factor=2.5,
                       shared_experts=1, load_balance_loss_weight=0.0, capacity_factor=None, dtype=dtype)


def mixtral_style(emb_dim: int = 1024, dtype=jnp.bfloat16) -> jmo.MoEConfig:
  """Mixtral's routing: softmax over the top-2 of 8 experts (= softmax over all, renormalised over the top 2), a
  Switch load-balance loss, no shared expert. (Mixtral 8x7B: experts of width 14336 at emb_dim 4096.)"""
  return jmo.MoEConfig(emb_dim=emb_dim, moe_mlp_dim=emb_dim * 7 // 2, num_experts=8, num_experts_per_tok=2,
                       routed_score_func="softmax", norm_topk_prob=True, load_balance_loss_weight=0.02,
                       capacity_factor=None, dtype=dtype)


def qwen3_style(emb_dim: int = 1024, dtype=jnp.bfloat16) -> jmo.MoEConfig:
  """Qwen3-MoE's routing: softmax over 128 experts, top-8 renormalised (norm_topk_prob), a load-balance loss, no
  shared expert. (Qwen3-30B-A3B: experts of width 768 at emb_dim 2048.)"""
  return jmo.MoEConfig(emb_dim=emb_dim, moe_mlp_dim=emb_dim * 3 // 8, num_experts=128, num_experts_per_tok=8,
                       routed_score_func="softmax", norm_topk_prob=True, load_balance_loss_weight=0.001,
                       capacity_factor=None, dtype=dtype)


STYLES = {"deepseek": deepseek_style, "mixtral": mixtral_style, "qwen3": qwen3_style}


def main():
  devices = jax.local_devices()
  mesh = jax.make_mesh((len(devices),), ("expert",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
  on_cpu = devices[0].platform == "cpu"
  for name, style in STYLES.items():
    cfg = style(emb_dim=64 if on_cpu else 1024, dtype=jnp.float32 if on_cpu else jnp.bfloat16)
    block = jmo.MoEBlock(cfg, mesh=mesh, impl="overlap", rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(0), (len(devices) * 64, cfg.emb_dim))
    y, inter = nnx.jit(lambda b, x: nnx.capture(b, nnx.Intermediate)(x))(block, x)
    params = sum(int(a.size) for a in jax.tree.leaves(nnx.state(block, nnx.Param)))
    print(f"{name:9s} E={cfg.num_experts:3d} top-{cfg.num_experts_per_tok} {cfg.routed_score_func:7s} "
          f"groups={cfg.n_routing_groups:2d} shared={cfg.shared_experts} | {params / 1e6:.2f}M params | "
          f"y {y.shape} {y.dtype} | aux loss {float(jmo.total_aux_loss(inter)):.4f}")


if __name__ == "__main__":
  main()
