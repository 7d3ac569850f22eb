"""The Flax NNX MoE module: overlap vs reference through nnx.jit, gradients of every parameter, several layers."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe_overlap as jmo
from cases import mesh_of, moe_config, rel_err


class TwoLayerMoE(nnx.Module):
  """Two MoE layers of equal sizes (sharing one workspace) with residuals, to exercise several layers per step."""

  def __init__(self, mesh, impl, dtype, capacity_factor, rngs):
    cfg = jmo.MoEConfig(emb_dim=16, moe_mlp_dim=32, num_experts=8, num_experts_per_tok=2, dtype=dtype,
                        capacity_factor=capacity_factor)
    self.a = jmo.MoE(cfg, mesh=mesh, impl=impl, rngs=rngs)
    self.b = jmo.MoE(cfg, mesh=mesh, impl=impl, rngs=rngs)

  def __call__(self, x):
    ya, aux_a = self.a(x)
    x = x + ya
    yb, aux_b = self.b(x)
    return x + yb, (aux_a, aux_b)


def _step(model, x, target):
  def loss_fn(m):
    y, (aux_a, aux_b) = m(x)
    aux = aux_a.load_balance_loss + aux_b.load_balance_loss + 1e-3 * (aux_a.router_z_loss + aux_b.router_z_loss)
    return jnp.mean((y.astype(jnp.float32) - target) ** 2) + 0.01 * aux, (aux_a, aux_b)
  return nnx.value_and_grad(loss_fn, has_aux=True)(model)


# R = 4 dropless in the default run; the other pairs in the slow one (tests/test_moe.py covers the capacity rule).
@pytest.mark.parametrize("R,capacity_factor", [(4, None), pytest.param(2, 1.0, marks=pytest.mark.slow),
                                               pytest.param(2, None, marks=pytest.mark.slow),
                                               pytest.param(4, 1.0, marks=pytest.mark.slow)])
def test_module_forward_and_grads_match_reference(R, capacity_factor):
  mesh = mesh_of(R)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 16 * R, 16))
  target = jax.random.normal(jax.random.PRNGKey(2), x.shape)
  res = {}
  for impl in ("overlap", "reference"):
    model = TwoLayerMoE(mesh, impl, jnp.float32, capacity_factor, nnx.Rngs(0))  # same seed: same parameters
    (loss, (aux_a, _)), grads = nnx.jit(_step)(model, x, target)
    res[impl] = (loss, aux_a, grads)
  (loss, aux, grads), (loss_r, aux_r, grads_r) = res["overlap"], res["reference"]
  np.testing.assert_allclose(loss, loss_r, rtol=1e-5)
  np.testing.assert_allclose(aux.dropped_fraction, aux_r.dropped_fraction)
  if capacity_factor is None:
    assert float(aux.dropped_fraction) == 0.0
  flat, flat_r = jax.tree.leaves(grads), jax.tree.leaves(grads_r)
  assert len(flat) == 6  # router, w1, w2 of both layers
  for g, g_r in zip(flat, flat_r):
    assert float(jnp.max(jnp.abs(g_r))) > 0
    np.testing.assert_allclose(g, g_r, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
def test_module_bfloat16_and_router_learns():
  mesh = mesh_of(4)
  x = jax.random.normal(jax.random.PRNGKey(3), (64, 16))
  target = jax.random.normal(jax.random.PRNGKey(4), x.shape)
  res = {}
  for impl, dtype in (("overlap", jnp.bfloat16), ("reference", jnp.float32)):
    model = TwoLayerMoE(mesh, impl, dtype, None, nnx.Rngs(5))
    (loss, _), grads = nnx.jit(_step)(model, x, target)
    res[impl] = (loss, grads)
  assert rel_err(res["overlap"][0], res["reference"][0]) < 1e-2
  for g, g_r in zip(jax.tree.leaves(res["overlap"][1]), jax.tree.leaves(res["reference"][1])):
    assert rel_err(g, g_r) < 3e-2
  router_grad = res["overlap"][1]["a"]["router"][...]
  assert float(jnp.max(jnp.abs(router_grad))) > 0  # gates get gradients: the router learns


def test_module_on_explicit_mesh():
  devs = np.array(jax.devices("cpu")[:4])
  mesh = jax.sharding.Mesh(devs, ("expert",), axis_types=(jax.sharding.AxisType.Explicit,))
  m = jmo.MoE(moe_config(emb_dim=16, moe_mlp_dim=32, num_experts=8, num_experts_per_tok=2), mesh=mesh,
              rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 32, 16))
  y, aux = nnx.jit(lambda m, x: m(x))(m, x)
  # Tokens already sharded over the expert axis, for both implementations.
  xs = jax.device_put(x.reshape(64, 16), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert")))
  ys, _ = nnx.jit(lambda m, x: m(x))(m, xs)
  m.impl = "reference"
  ys_ref, _ = nnx.jit(lambda m, x: m(x))(m, xs)
  np.testing.assert_allclose(ys, ys_ref, rtol=1e-5, atol=1e-5)
  m.impl = "overlap"
  m.impl = "reference"
  y_ref, _ = nnx.jit(lambda m, x: m(x))(m, x)
  assert y.shape == x.shape
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)


@contextlib.contextmanager
def backend_compilations():
  """The names of the functions XLA compiles inside the block (jax.monitoring's backend-compile events)."""
  names = []

  def listener(event, duration_secs, **kwargs):
    del duration_secs
    if event == "/jax/core/compile/backend_compile_duration":
      names.append(kwargs.get("fun_name"))

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_parameters_are_created_sharded_and_only_the_first_call_compiles(axis_type):
  """The README's construction: every parameter is created on the mesh with the sharding the layer computes with
  (each device holds E / 4 experts, never all of them), so the first jitted call finds them in place and the second
  and third compile nothing; a second layer of the same configuration reuses the compiled initializer."""
  types = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
  mesh = jax.make_mesh((4,), ("expert",), axis_types=(types[axis_type],), devices=jax.devices("cpu")[:4])
  cfg = moe_config(emb_dim=16, moe_mlp_dim=8, num_experts=8, num_experts_per_tok=2, shared_experts=1,
                   shared_expert_gate=True, routed_bias=True)
  m = jmo.MoE(cfg, mesh=mesh, rngs=nnx.Rngs(0))
  for name in ("router", "routing_bias", "w1", "w2", "shared_w1", "shared_w2", "shared_expert_gate"):
    a = getattr(m, name)[...]
    experts = name in ("w1", "w2")
    assert a.sharding.is_equivalent_to(NamedSharding(mesh, P("expert") if experts else P()), a.ndim), name
    assert {s.data.shape[0] for s in a.addressable_shards} == {a.shape[0] // 4 if experts else a.shape[0]}, name
  with backend_compilations() as compiled:
    jmo.MoE(cfg, mesh=mesh, rngs=nnx.Rngs(1))
  assert "jit(init)" not in compiled, compiled
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 8, 16))
  step = nnx.jit(lambda m, x: m(x))
  counts = []
  for _ in range(3):
    with backend_compilations() as compiled:
      y, _ = step(m, x)
      jax.block_until_ready(y)
    counts.append(len(compiled))
  assert counts[0] >= 1 and counts[1:] == [0, 0], counts
  assert m.w1[...].sharding.is_equivalent_to(NamedSharding(mesh, P("expert")), 3)


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_padding_token_with_nan_features_changes_no_gradient(impl):
  """Garbage padding: a masked token whose x holds a NaN gives the same y, aux and gradients as one of finite x (the
  router weights' gradient x^T dlogits multiplies a zero cotangent by x, and 0 * NaN is NaN)."""
  cfg = moe_config(emb_dim=16, moe_mlp_dim=24, num_experts=8, num_experts_per_tok=2)
  m = jmo.MoE(cfg, mesh=mesh_of(4), impl=impl, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 16, 16))
  mask = jnp.ones((2, 16), bool).at[0, 5].set(False)

  def loss(m, x):
    y, aux = m(x, mask)
    return jnp.sum(y * y) + aux.load_balance_loss + aux.router_z_loss, (y, aux)

  step = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
  (l0, (y0, _)), g0 = step(m, x)
  (l1, (y1, _)), g1 = step(m, x.at[0, 5, 3].set(jnp.nan))
  np.testing.assert_array_equal(l0, l1)
  np.testing.assert_array_equal(y0, y1)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_array_equal(a, b)
