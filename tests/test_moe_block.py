"""MoE(config) with every router option and shared experts: the three impls agree (forward and gradients of every
parameter), shared experts add a dense SwiGLU path, padding tokens cost nothing, and MoEBlock replaces a dense MLP
inside a small transformer, its aux loss collected through nnx.capture."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_moe_overlap as jmo
from cases import mesh_of, moe_config, rel_err

DEEPSEEK = moe_config(emb_dim=16, moe_mlp_dim=24, num_experts=8, num_experts_per_tok=3, routed_score_func="sigmoid",
                         routed_bias=True, routed_bias_update_rate=1e-3, n_routing_groups=4, topk_routing_group=2,
                         norm_topk_prob=True, routed_scaling_factor=2.5, shared_experts=1, capacity_factor=1.0)
MIXTRAL = moe_config(emb_dim=16, moe_mlp_dim=24, num_experts=8, num_experts_per_tok=2, capacity_factor=-1)


def _loss(m, x, mask):
  y, aux = m(x, mask)
  return jnp.sum(jnp.sin(y)) + 0.1 * aux.load_balance_loss + 0.01 * aux.router_z_loss, aux


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
@pytest.mark.parametrize("cfg", [DEEPSEEK, MIXTRAL], ids=["deepseek", "mixtral"])
def test_impls_agree_forward_and_grads(cfg):
  mesh = mesh_of(4)
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 16, 16))
  mask = jnp.arange(64).reshape(4, 16) % 7 != 3
  res = {}
  for impl in ("reference", "xla", "overlap"):
    m = jmo.MoE(cfg, mesh=mesh, impl=impl, rngs=nnx.Rngs(0))
    m.deterministic = True  # no bias update: the three see the same parameters
    if m.routing_bias is not None:
      m.routing_bias[...] = jax.random.normal(jax.random.PRNGKey(7), (cfg.num_experts,)) * 0.05
    (v, aux), g = nnx.jit(lambda m, x, mask: nnx.value_and_grad(_loss, has_aux=True)(m, x, mask))(m, x, mask)
    res[impl] = (v, aux, g)
  v_r, aux_r, g_r = res["reference"]
  names = sorted(k for k in g_r)
  assert "router" in names and "w1" in names
  assert ("shared_w1" in names) == (cfg.shared_experts > 0)
  for impl in ("xla", "overlap"):
    v, aux, g = res[impl]
    np.testing.assert_allclose(v, v_r, rtol=1e-5)
    np.testing.assert_allclose(aux.dropped_fraction, aux_r.dropped_fraction)
    for name in names:
      assert float(jnp.max(jnp.abs(g_r[name][...]))) > 0, name
      assert rel_err(g[name][...], g_r[name][...]) < 1e-4, (impl, name)


def test_shared_experts_add_a_dense_swiglu():
  mesh = mesh_of(4)
  cfg = moe_config(emb_dim=16, moe_mlp_dim=8, num_experts=8, num_experts_per_tok=2, shared_experts=2)
  m = jmo.MoE(cfg, mesh=mesh, impl="xla", rngs=nnx.Rngs(0))
  assert m.shared_w1.shape == (16, 32) and m.shared_w2.shape == (16, 16)
  x = jax.random.normal(jax.random.PRNGKey(2), (32, 16))
  forward = nnx.jit(lambda m, x: m(x))
  y, _ = forward(m, x)
  m.shared_w2[...] = jnp.zeros_like(m.shared_w2[...])
  y_routed, _ = forward(m, x)
  xn, w1, w2 = (np.asarray(a, np.float64) for a in (x, m.shared_w1[...], jax.random.normal(jax.random.PRNGKey(3),
                                                                                           (16, 16))))
  m.shared_w2[...] = jnp.asarray(w2, jnp.float32)
  y2, _ = forward(m, x)
  a = xn @ w1
  shared = (a[:, :16] / (1 + np.exp(-a[:, :16])) * a[:, 16:]) @ w2
  assert rel_err(np.asarray(y2) - np.asarray(y_routed), shared) < 1e-5
  assert rel_err(y, y_routed) > 1e-3


def test_block_records_its_aux_loss_only_inside_capture():
  # Outside nnx.capture (inference) a call records nothing: no Intermediate attribute on the module (it would grow
  # with every call and change the module's state under nnx.jit) and no deprecation warning; inside, both values.
  cfg = moe_config(emb_dim=16, moe_mlp_dim=8, num_experts=8, num_experts_per_tok=2, load_balance_loss_weight=0.01)
  block = jmo.MoEBlock(cfg, mesh=mesh_of(4), impl="xla", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(4), (8, 16))
  before = jax.tree.structure(nnx.state(block))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    block(x)
    block(x)
  assert jax.tree.structure(nnx.state(block)) == before and not nnx.state(block, nnx.Intermediate)
  _, inter = nnx.capture(block, nnx.Intermediate)(x)
  keys = {getattr(k, "key", None) for path, _ in jax.tree_util.tree_leaves_with_path(inter) for k in path}
  assert {"moe_aux_loss", "moe_aux"} <= keys and float(jmo.total_aux_loss(inter)) > 0


def test_total_aux_loss_of_layers_stacked_under_nnx_scan_is_a_scalar():
  # MaxText-style scanned layers: nnx.vmap creates the stacked parameters, nnx.scan applies them, and each sown
  # moe_aux_loss record is an [L] array (one loss per layer). total_aux_loss sums every layer's into one scalar, the
  # sum of the layers' losses called one at a time (it returned the [L] array, which a scalar loss broadcast to).
  L = 3
  cfg = moe_config(emb_dim=16, moe_mlp_dim=8, num_experts=8, num_experts_per_tok=2, load_balance_loss_weight=0.01)
  mesh = mesh_of(4)

  @nnx.split_rngs(splits=L)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs):
    return jmo.MoEBlock(cfg, mesh=mesh, impl="xla", rngs=rngs)

  @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
  def apply(layer, h):
    return h + layer(h)

  stack = create(nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(5), (8, 16))
  _, inter = nnx.jit(lambda s, x: nnx.capture(apply, nnx.Intermediate)(s, x))(stack, x)
  total = jmo.total_aux_loss(inter)
  graphdef, state = nnx.split(stack)
  h, expected = x, 0.0
  for i in range(L):
    layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
    y, one = nnx.capture(layer, nnx.Intermediate)(h)
    h, expected = h + y, expected + float(jmo.total_aux_loss(one))
  assert total.shape == () and expected > 0
  np.testing.assert_allclose(float(total), expected, rtol=1e-5)


def test_padding_tokens_cost_nothing():
  mesh = mesh_of(4)
  m = jmo.MoE(MIXTRAL, mesh=mesh, impl="overlap", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(4), (64, 16))
  mask = jnp.arange(64) < 40
  y, aux = m(x, mask)
  np.testing.assert_array_equal(np.asarray(y[40:]), 0)
  y_valid, _ = jmo.MoE(MIXTRAL, mesh=mesh, impl="reference", rngs=nnx.Rngs(0))(x, mask)
  assert rel_err(y, y_valid) < 1e-5
  assert float(aux.dropped_fraction) == 0.0
  np.testing.assert_allclose(float(jnp.sum(aux.expert_load)), 1.0, rtol=1e-6)


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
def test_bias_update_in_training_mode_only():
  mesh = mesh_of(4)
  m = jmo.MoE(DEEPSEEK, mesh=mesh, impl="xla", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(5), (32, 16))
  _, aux = nnx.jit(lambda m, x: m(x))(m, x)
  expected = jmo.update_routing_bias(jnp.zeros(8), aux.expert_load, DEEPSEEK.routed_bias_update_rate)
  np.testing.assert_allclose(np.asarray(m.routing_bias[...]), np.asarray(expected))
  m.eval()
  before = np.asarray(m.routing_bias[...])
  nnx.jit(lambda m, x: m(x))(m, x)
  np.testing.assert_array_equal(np.asarray(m.routing_bias[...]), before)


class Dense(nnx.Module):
  def __init__(self, d, f, rngs):
    self.up = nnx.Linear(d, 2 * f, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(f, d, use_bias=False, rngs=rngs)

  def __call__(self, x):
    g, u = jnp.split(self.up(x), 2, axis=-1)
    return self.down(jax.nn.silu(g) * u)


class Attention(nnx.Module):
  def __init__(self, d, heads, rngs):
    self.heads = heads
    self.qkv = nnx.Linear(d, 3 * d, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(d, d, use_bias=False, rngs=rngs)

  def __call__(self, x):
    B, T, D = x.shape
    q, k, v = jnp.split(self.qkv(x).reshape(B, T, 3 * self.heads, D // self.heads), 3, axis=2)
    return self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, T, D))


class TinyTransformer(nnx.Module):
  """Pre-norm attention + feed-forward blocks; `ffn` builds the feed-forward of each layer."""

  def __init__(self, ffn, rngs, d=16, layers=2):
    self.attn = nnx.List([Attention(d, 2, rngs) for _ in range(layers)])
    self.norm = nnx.List([nnx.RMSNorm(d, rngs=rngs) for _ in range(2 * layers)])
    self.ffn = nnx.List([ffn(rngs) for _ in range(layers)])

  def __call__(self, x):
    for i, (attn, ffn) in enumerate(zip(self.attn, self.ffn)):
      x = x + attn(self.norm[2 * i](x))
      x = x + ffn(self.norm[2 * i + 1](x))
    return x


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_drop_in_block_in_a_transformer(axis_type):
  types = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:4]), ("expert",), axis_types=(types[axis_type],))
  cfg = moe_config(emb_dim=16, moe_mlp_dim=24, num_experts=8, num_experts_per_tok=2, shared_experts=1,
                      load_balance_loss_weight=0.01, router_z_loss_weight=0.001)
  dense = TinyTransformer(lambda r: Dense(16, 24, r), nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(6), (4, 8, 16))
  if axis_type == "explicit":
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P("expert")))
  assert dense(x).shape == x.shape

  results = {}
  for impl in ("reference", "overlap"):
    model = TinyTransformer(lambda r: jmo.MoEBlock(cfg, mesh=mesh, impl=impl, rngs=r), nnx.Rngs(0))  # one line
    if axis_type == "explicit":  # the dense layers' weight gradients need their weights on the mesh
      nnx.update(model, jax.device_put(nnx.state(model), jax.sharding.NamedSharding(mesh, jax.P())))

    def loss(model, x):
      y, inter = nnx.capture(model, nnx.Intermediate)(x)
      return jnp.mean(y ** 2) + jmo.total_aux_loss(inter), (y, inter)

    (v, (y, inter)), g = nnx.jit(lambda m, x: nnx.value_and_grad(loss, has_aux=True)(m, x))(model, x)
    assert y.shape == x.shape
    if axis_type == "explicit":
      assert jax.typeof(y).sharding.spec == jax.typeof(x).sharding.spec
    aux_losses = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(inter)
                  if any(getattr(k, "key", None) == "moe_aux_loss" for k in path)]
    assert len(aux_losses) == 2
    total = float(sum(aux_losses))
    assert total > 0.01 and np.isclose(float(jmo.total_aux_loss(inter)), total)
    results[impl] = (v, g)
  np.testing.assert_allclose(results["overlap"][0], results["reference"][0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(results["overlap"][1]), jax.tree.leaves(results["reference"][1])):
    assert rel_err(a, b) < 1e-4


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
@pytest.mark.parametrize("impl", ["reference", "xla", "overlap"])
def test_y_has_x_sharding(impl):
  """On an Explicit mesh, outside jax.set_mesh, for tokens sharded by batch, by sequence, or replicated: y has
  exactly x's sharding (under jit, and eagerly for batch-sharded x), so the residual x + y works."""
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:4]), ("expert",),
                           axis_types=(jax.sharding.AxisType.Explicit,))
  m = jmo.MoE(MIXTRAL, mesh=mesh, impl=impl, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(8), (4, 16, 16))
  step = nnx.jit(lambda m, x: m(x)[0])
  for spec in (jax.P("expert"), jax.P(None, "expert"), jax.P()):
    xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
    for y in ((m(xs)[0],) if spec == jax.P("expert") else ()) + (step(m, xs),):
      assert y.sharding.is_equivalent_to(xs.sharding, 3), (spec, y.sharding)
      assert jax.typeof(y).sharding.spec == jax.typeof(xs).sharding.spec
      np.testing.assert_allclose(np.asarray(y + xs), np.asarray(y) + np.asarray(xs), rtol=1e-6)
