"""The routers against straightforward NumPy implementations of the published rules (Switch/Mixtral/Qwen3-MoE
softmax top-k, DeepSeek-V3 sigmoid + selection bias + group-limited top-k, norm_topk_prob, routed_scaling_factor),
the auxiliary losses, token masks and the bias update."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_overlap as jmo

T, E = 48, 16


def numpy_route(logits, k, func, bias, n_groups, topk_groups, norm, scale):
  """Token by token, as the papers and the published model code describe it."""
  logits = np.asarray(logits, np.float64)
  ids = np.zeros((T, k), np.int64)
  gates = np.zeros((T, k))
  for t in range(T):
    z = logits[t]
    s = np.exp(z - z.max()) / np.exp(z - z.max()).sum() if func == "softmax" else 1 / (1 + np.exp(-z))
    sel = s + (bias if bias is not None else 0)
    allowed = list(range(E))
    if n_groups > 0:
      size = E // n_groups
      group_score = [sum(sorted(sel[g * size:(g + 1) * size])[::-1][:2]) for g in range(n_groups)]
      best = sorted(range(n_groups), key=lambda g: (-group_score[g], g))[:topk_groups]
      allowed = [e for e in range(E) if e // size in best]
    chosen = sorted(allowed, key=lambda e: (-sel[e], e))[:k]
    w = s[chosen]
    if norm:
      w = w / w.sum()
    ids[t], gates[t] = chosen, w * scale
  return ids, gates


def numpy_losses(logits, ids, func, mask):
  logits = np.asarray(logits, np.float64)[mask]
  ids = ids[mask]
  n, k = ids.shape
  if func == "softmax":
    s = np.exp(logits - logits.max(1, keepdims=True))
  else:
    s = 1 / (1 + np.exp(-logits))
  p = s / s.sum(1, keepdims=True)
  f = np.array([(ids == e).sum() for e in range(E)]) / (n * k)
  lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
  return E * np.sum(f * p.mean(0)), np.mean(lse ** 2), f


CASES = [
    # func, k, bias, n_groups, topk_groups, norm, scale
    ("softmax", 2, False, -1, -1, True, 1.0),      # Mixtral
    ("softmax", 8, False, -1, -1, False, 1.0),     # Qwen3-MoE with norm_topk_prob off
    ("softmax", 1, False, -1, -1, False, 1.0),     # Switch top-1: the gate is the probability
    ("sigmoid", 4, True, 4, 2, True, 2.5),         # DeepSeek-V3
    ("sigmoid", 3, False, 8, 3, False, 1.0),       # groups without bias, groups of 2
    ("softmax", 2, True, 16, 4, True, 1.0),        # groups of one expert
    ("sigmoid", 6, True, -1, -1, True, 1.5),
]


@pytest.mark.parametrize("func,k,use_bias,n_groups,topk_groups,norm,scale", CASES)
def test_route_matches_numpy(func, k, use_bias, n_groups, topk_groups, norm, scale):
  rng = np.random.default_rng(k * 7 + n_groups)
  logits = jnp.asarray(rng.normal(size=(T, E)) * 2, jnp.float32)
  bias = jnp.asarray(rng.normal(size=E) * 0.3, jnp.float32) if use_bias else None
  cfg = jmo.MoEConfig(emb_dim=8, moe_mlp_dim=8, num_experts=E, num_experts_per_tok=k, routed_score_func=func,
                      routed_bias=use_bias, n_routing_groups=n_groups, topk_routing_group=topk_groups,
                      norm_topk_prob=norm, routed_scaling_factor=scale)
  mask = rng.random(T) > 0.2
  r = jax.jit(lambda l, b, m: jmo.route(l, cfg, b, m))(logits, bias, jnp.asarray(mask))
  ids_np, gates_np = numpy_route(logits, k, func, None if bias is None else np.asarray(bias, np.float64),
                                 n_groups, topk_groups, norm, scale)
  ids, gates = np.asarray(r.expert_ids), np.asarray(r.gates)
  np.testing.assert_array_equal(ids[mask], ids_np[mask])
  np.testing.assert_allclose(gates[mask], gates_np[mask], rtol=2e-6, atol=1e-7)
  np.testing.assert_array_equal(ids[~mask], -1)
  np.testing.assert_array_equal(gates[~mask], 0)
  lb, z, f = numpy_losses(logits, ids_np, func, mask)
  np.testing.assert_allclose(float(r.load_balance_loss), lb, rtol=1e-5)
  np.testing.assert_allclose(float(r.router_z_loss), z, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(r.expert_load), f, rtol=1e-6, atol=1e-7)


def test_bias_selects_but_does_not_weigh():
  """A large bias on expert 3 makes every token pick it, with the gate of its unbiased score."""
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(T, E)), jnp.float32)
  cfg = jmo.MoEConfig(emb_dim=8, moe_mlp_dim=8, num_experts=E, num_experts_per_tok=2, routed_score_func="sigmoid",
                      routed_bias=True, norm_topk_prob=False)
  bias = jnp.zeros(E).at[3].set(100.0)
  r = jmo.route(logits, cfg, bias)
  assert np.all(np.asarray(r.expert_ids) == 3, axis=1).sum() == 0
  assert np.all(np.any(np.asarray(r.expert_ids) == 3, axis=1))
  j = np.argmax(np.asarray(r.expert_ids) == 3, axis=1)
  np.testing.assert_allclose(np.asarray(r.gates)[np.arange(T), j], jax.nn.sigmoid(logits[:, 3]), rtol=1e-6)


def test_gradients_reach_the_logits_through_the_gates_only():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(T, E)), jnp.float32)
  cfg = jmo.MoEConfig(emb_dim=8, moe_mlp_dim=8, num_experts=E, num_experts_per_tok=2, routed_score_func="sigmoid",
                      routed_bias=True, norm_topk_prob=True, routed_scaling_factor=2.0)
  bias = jnp.asarray(rng.normal(size=E), jnp.float32)
  g_logits, g_bias = jax.grad(lambda l, b: jnp.sum(jmo.route(l, cfg, b).gates ** 2), argnums=(0, 1))(logits, bias)
  assert float(jnp.max(jnp.abs(g_logits))) > 0
  np.testing.assert_array_equal(np.asarray(g_bias), 0)


def test_update_routing_bias():
  load = jnp.asarray([0.5, 0.25, 0.25, 0.0])
  b = jmo.update_routing_bias(jnp.zeros(4), load, 0.1)
  np.testing.assert_allclose(np.asarray(b), [-0.1, 0.0, 0.0, 0.1])


def test_bias_update_balances_a_skewed_router():
  """Aux-loss-free balancing: repeated updates from the load even out a router that prefers a few experts."""
  rng = np.random.default_rng(2)
  logits = jnp.asarray(rng.normal(size=(512, E)) + np.linspace(2, -2, E), jnp.float32)
  cfg = jmo.MoEConfig(emb_dim=8, moe_mlp_dim=8, num_experts=E, num_experts_per_tok=2, routed_score_func="sigmoid",
                      routed_bias=True, routed_bias_update_rate=0.02)
  bias = jnp.zeros(E)
  first = None
  for _ in range(300):
    load = jmo.route(logits, cfg, bias).expert_load
    first = load if first is None else first
    bias = jmo.update_routing_bias(bias, load, cfg.routed_bias_update_rate)
  assert float(jnp.max(first)) > 3 / E
  assert float(jnp.max(load)) < 1.6 / E


@pytest.mark.parametrize("kwargs,match", [
    (dict(routed_score_func="tanh"), "routed_score_func"),
    (dict(n_routing_groups=4), "both n_routing_groups and topk_routing_group"),
    (dict(n_routing_groups=5, topk_routing_group=2), "equal groups"),
    (dict(n_routing_groups=8, topk_routing_group=1, num_experts_per_tok=3), "exceeds"),
    (dict(routed_bias_update_rate=0.1), "routed_bias is False"),
    (dict(num_experts_per_tok=17), "top-k must be in"),
    (dict(routed_bias=True, routed_bias_update_rate=-1e-3), "routed_bias_update_rate must be a finite number >= 0"),
    (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor must be a finite number > 0"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor must be a finite number > 0"),
    (dict(load_balance_loss_weight=float("inf")), "load_balance_loss_weight must be a finite number >= 0"),
    (dict(router_z_loss_weight=-1.0), "router_z_loss_weight must be a finite number >= 0"),
    (dict(shared_mlp_dim=64), "shared_experts is 0"),
    (dict(norm_topk_prob="no"), "norm_topk_prob must be a bool"),
    (dict(routed_bias=1), "routed_bias must be a bool"),
])
def test_config_rejects(kwargs, match):
  base = dict(emb_dim=8, moe_mlp_dim=8, num_experts=E, num_experts_per_tok=2)
  with pytest.raises((ValueError, TypeError), match=match):
    jmo.MoEConfig(**{**base, **kwargs})


def test_bias_and_load_of_the_wrong_kind_are_named():
  logits = jnp.asarray(np.random.default_rng(4).normal(size=(T, E)), jnp.float32)
  plain = jmo.MoEConfig(emb_dim=8, moe_mlp_dim=8, num_experts=E, num_experts_per_tok=2)
  biased = jmo.MoEConfig(emb_dim=8, moe_mlp_dim=8, num_experts=E, num_experts_per_tok=2, routed_bias=True)
  with pytest.raises(ValueError, match="config.routed_bias is False"):
    jmo.route(logits, plain, jnp.zeros(E))
  with pytest.raises(ValueError, match=rf"the routing bias must be a floating-point \[num_experts={E}\]"):
    jmo.route(logits, biased, jnp.zeros(E - 1))
  with pytest.raises(ValueError, match="the routing bias must be a floating-point"):
    jmo.route(logits, biased, jnp.zeros(E, jnp.int32))
  load = jmo.route(logits, biased, jnp.zeros(E)).expert_load
  with pytest.raises(ValueError, match=rf"expert_load must be a floating-point \[num_experts={E}\]"):
    jmo.update_routing_bias(jnp.zeros(E), load[:-1], 1e-3)
  with pytest.raises(ValueError, match="the routing bias must be a floating-point"):
    jmo.update_routing_bias(jnp.zeros(E, jnp.int32), load, 1e-3)
  with pytest.raises(ValueError, match="rate must be >= 0"):
    jmo.update_routing_bias(jnp.zeros(E), load, -1e-3)


def test_all_combinations_of_the_switches_run():
  logits = jnp.asarray(np.random.default_rng(3).normal(size=(T, E)), jnp.float32)
  for func, norm, groups in itertools.product(("softmax", "sigmoid"), (False, True), (-1, 4)):
    cfg = jmo.MoEConfig(emb_dim=8, moe_mlp_dim=8, num_experts=E, num_experts_per_tok=4, routed_score_func=func,
                        norm_topk_prob=norm, n_routing_groups=groups, topk_routing_group=2 if groups > 0 else -1)
    r = jmo.route(logits, cfg)
    ids = np.asarray(r.expert_ids)
    assert all(len(set(row)) == 4 for row in ids)
    if norm:
      np.testing.assert_allclose(np.asarray(r.gates).sum(1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("func", ["softmax", "sigmoid"])
def test_a_masked_token_with_non_finite_logits_changes_nothing(func):
  """Garbage padding: a masked token whose logits are NaN or Inf gives the same routing, losses and gradients as a
  masked token of finite logits (its weight in every loss is 0, but 0 * NaN is NaN)."""
  cfg = jmo.MoEConfig(emb_dim=8, moe_mlp_dim=8, num_experts=8, num_experts_per_tok=2, routed_score_func=func)
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((16, 8)), jnp.float32)
  mask = jnp.ones((16,), bool).at[3].set(False).at[9].set(False)

  def f(lg):
    r = jmo.route(lg, cfg, None, mask)
    return r.load_balance_loss + r.router_z_loss + jnp.sum(r.gates), r

  (_, clean), g_clean = jax.value_and_grad(f, has_aux=True)(logits)
  (_, bad), g_bad = jax.value_and_grad(f, has_aux=True)(logits.at[3, 2].set(jnp.nan).at[9].set(jnp.inf))
  for name in ("expert_ids", "gates", "load_balance_loss", "router_z_loss", "expert_load"):
    np.testing.assert_array_equal(getattr(clean, name), getattr(bad, name), err_msg=name)
  assert np.isfinite(np.asarray(g_bad)).all()
  np.testing.assert_array_equal(np.delete(np.asarray(g_clean), [3, 9], 0), np.delete(np.asarray(g_bad), [3, 9], 0))
