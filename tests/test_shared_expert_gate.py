"""The gated shared expert (``MoEConfig.shared_expert_gate``) against Qwen2-MoE's published block.

The oracle is Hugging Face's ``Qwen2MoeSparseMoeBlock`` (transformers 5.x, modeling_qwen2_moe.py) written out in
float32 JAX from its published tensors and names, independent of this library's router and expert code:

  probs = softmax(x @ gate.weight^T); w, idx = top_k(probs, k); w /= sum(w) if norm_topk_prob
  routed = sum_j w_j * down_proj[idx_j](silu(gate_proj[idx_j](x)) * up_proj[idx_j](x))
  y = routed + sigmoid(x @ shared_expert_gate.weight^T) * shared_expert(x)

Its weights reach ``MoE`` through ``checkpoint.from_per_expert``; forward and gradients (of x and of every
published tensor, mapped through the same converter) are compared for each impl on meshes of both axis types.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_moe_overlap as jmo
from jax_moe_overlap import checkpoint
from cases import rel_err

E, K, D, F, S, T = 8, 2, 16, 12, 20, 64
HI = jax.lax.Precision.HIGHEST


def _qwen2_tensors(seed):
  """One Qwen2-MoE layer's published tensors (names relative to its ``mlp.`` prefix), random float32."""
  rng = np.random.default_rng(seed)
  t = {"gate.weight": rng.normal(size=(E, D)), "shared_expert.gate_proj.weight": rng.normal(size=(S, D)) / 4,
       "shared_expert.up_proj.weight": rng.normal(size=(S, D)) / 4,
       "shared_expert.down_proj.weight": rng.normal(size=(D, S)) / 4,
       "shared_expert_gate.weight": rng.normal(size=(1, D)) / 2}
  for i in range(E):
    t[f"experts.{i}.gate_proj.weight"] = rng.normal(size=(F, D)) / 4
    t[f"experts.{i}.up_proj.weight"] = rng.normal(size=(F, D)) / 4
    t[f"experts.{i}.down_proj.weight"] = rng.normal(size=(D, F)) / 4
  return {k: v.astype(np.float32) for k, v in t.items()}


def _linear(x, w):
  """torch.nn.functional.linear without bias: x @ w^T."""
  return jnp.dot(x, w.T, precision=HI)


def _mlp(x, t, name):
  """Qwen2MoeMLP: down_proj(silu(gate_proj(x)) * up_proj(x))."""
  return _linear(jax.nn.silu(_linear(x, t[f"{name}.gate_proj.weight"])) * _linear(x, t[f"{name}.up_proj.weight"]),
                 t[f"{name}.down_proj.weight"])


def qwen2_moe_block(t, x, norm_topk_prob, gated=True):
  """Qwen2MoeSparseMoeBlock.forward on [T, D] tokens (float32); gated=False drops the shared expert's gate."""
  probs = jax.nn.softmax(_linear(x, t["gate.weight"]), axis=-1)
  w, idx = jax.lax.top_k(probs, K)
  if norm_topk_prob:
    w = w / jnp.sum(w, axis=-1, keepdims=True)
  routed = jnp.zeros_like(x)
  for e in range(E):
    weight_e = jnp.sum(jnp.where(idx == e, w, 0.0), axis=-1)          # this token's weight of expert e (0: not chosen)
    routed = routed + weight_e[:, None] * _mlp(x, t, f"experts.{e}")
  shared = _mlp(x, t, "shared_expert")
  if gated:
    shared = jax.nn.sigmoid(_linear(x, t["shared_expert_gate.weight"])) * shared
  return routed + shared


def _config(norm_topk_prob):
  return jmo.MoEConfig(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm_topk_prob,
                       shared_experts=1, shared_mlp_dim=S, shared_expert_gate=True, dtype=jnp.float32,
                       weight_dtype=jnp.float32)


CASES = [(impl, axis, False) for impl in ("overlap", "xla", "reference") for axis in ("auto", "explicit")]
CASES += [("overlap", "explicit", True)]
# The default pass keeps impl="overlap" and the reference on Explicit axes (jax.make_mesh's default); the Auto ones,
# impl="xla" and norm_topk_prob (test_routing checks it by default) run in the slow pass.
DEFAULT_CASES = (("overlap", "explicit", False), ("reference", "explicit", False))
CASES = [c if c in DEFAULT_CASES else pytest.param(*c, marks=pytest.mark.slow) for c in CASES]


@pytest.mark.parametrize("impl,axis_type,norm_topk_prob", CASES)
def test_matches_qwen2_moe_block(impl, axis_type, norm_topk_prob):
  types = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
  mesh = jax.make_mesh((4,), ("expert",), axis_types=(types[axis_type],))
  t = _qwen2_tensors(0)
  x = jax.random.normal(jax.random.PRNGKey(1), (T, D), jnp.float32)
  cot = jax.random.normal(jax.random.PRNGKey(2), (T, D), jnp.float32)
  m = jmo.MoE(_config(norm_topk_prob), mesh=mesh, impl=impl, rngs=nnx.Rngs(0))
  checkpoint.load_params(m, checkpoint.from_per_expert({f"mlp.{k}": v for k, v in t.items()}, prefix="mlp."))

  want, (g_t, g_x) = jax.value_and_grad(lambda t, x: jnp.sum(qwen2_moe_block(t, x, norm_topk_prob) * cot),
                                        argnums=(0, 1))(t, x)
  want_y = qwen2_moe_block(t, x, norm_topk_prob)
  # The gate matters here: the block without it is far from the block with it.
  assert rel_err(qwen2_moe_block(t, x, norm_topk_prob, gated=False), want_y) > 0.1

  def loss(m, x):
    y, _ = m(x)
    return jnp.sum(y * cot), y

  (got, y), (g_m, g_mx) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(m, x)
  assert rel_err(y, want_y) < 1e-5
  assert rel_err(got, want) < 1e-5
  assert rel_err(g_mx, g_x) < 1e-5
  want_grads = checkpoint.from_per_expert({f"mlp.{k}": np.asarray(v) for k, v in g_t.items()}, prefix="mlp.")
  assert sorted(want_grads) == ["router", "shared_expert_gate", "shared_w1", "shared_w2", "w1", "w2"]
  for name, g in want_grads.items():
    assert float(np.max(np.abs(g))) > 0, name
    assert rel_err(g_m[name][...], g) < 1e-5, name


def test_config_rules():
  with pytest.raises(ValueError, match="shared_expert_gate scales the shared experts' output, but shared_experts is 0"):
    jmo.MoEConfig(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=K, shared_expert_gate=True)
  mesh = jax.make_mesh((4,), ("expert",))
  m = jmo.MoE(_config(False), mesh=mesh, impl="xla", rngs=nnx.Rngs(0))
  assert m.shared_expert_gate[...].shape == (D, 1)
  plain = jmo.MoE(jmo.MoEConfig(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=K, shared_experts=1),
                  mesh=mesh, impl="xla", rngs=nnx.Rngs(0))
  assert plain.shared_expert_gate is None
