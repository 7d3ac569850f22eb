"""Eager calls of moe_experts and MoE (outside jit) compile once per static configuration and match jitted calls."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_moe_overlap as jmo
from cases import layer_inputs, mesh_of
from child_process import run_script

E, D, F = 8, 16, 24
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compilations():
  """Counts XLA backend compilations (jax.monitoring's compile-duration event) inside the block."""
  seen = []

  def listener(event, duration, **kwargs):
    del duration, kwargs
    if event == COMPILE_EVENT:
      seen.append(event)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def _check_second_call_compiles_nothing(call):
  first = call()
  with count_compilations() as compiled:
    second = call()
    jax.block_until_ready(second)
  assert not compiled, f"the second eager call compiled {len(compiled)} programs"
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
    np.testing.assert_array_equal(a, b)
  return first


def test_eager_moe_experts_compiles_once_and_matches_jit():
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(64, D, F, E, 2, "skewed", 1)
  y, dropped = _check_second_call_compiles_nothing(lambda: jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh))
  y_jit, dropped_jit = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh))(x, ids, gates, w1, w2)
  np.testing.assert_array_equal(y, y_jit)
  assert int(dropped) == int(dropped_jit) == 0
  y_ref, _ = _check_second_call_compiles_nothing(
      lambda: jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl="reference"))
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)


def test_eager_grad_and_outer_jit_reuse_the_program():
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(64, D, F, E, 2, "balanced", 2)

  def loss(x, w1):
    return jnp.sum(jnp.sin(jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh)[0]))

  grad = jax.grad(loss, argnums=(0, 1))
  g_eager = _check_second_call_compiles_nothing(lambda: grad(x, w1))
  g_jit = jax.jit(grad)(x, w1)
  for a, b in zip(g_eager, g_jit):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_eager_call_on_explicit_mesh():
  devs = np.array(jax.devices("cpu")[:4])
  mesh = jax.sharding.Mesh(devs, ("expert",), axis_types=(jax.sharding.AxisType.Explicit,))
  x, ids, gates, w1, w2 = layer_inputs(64, D, F, E, 2, "skewed", 3)
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert"))
  xs, ids_s, gates_s = (jax.device_put(a, spec) for a in (x, ids, gates))
  y, _ = _check_second_call_compiles_nothing(lambda: jmo.moe_experts(xs, ids_s, gates_s, w1, w2, mesh=mesh))
  assert y.sharding.is_equivalent_to(xs.sharding, 2)
  y_ref, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh_of(4), impl="reference")
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
def test_eager_grad_on_explicit_mesh_under_set_mesh():
  # JAX's own rule for Explicit axes: an eager jax.grad whose loss lives on an Explicit mesh runs inside
  # jax.set_mesh (its ones_like cotangent is placed on the mesh); the README says so. Every impl, x not placed.
  devs = np.array(jax.devices("cpu")[:4])
  mesh = jax.sharding.Mesh(devs, ("expert",), axis_types=(jax.sharding.AxisType.Explicit,))
  x, ids, gates, w1, w2 = layer_inputs(64, D, F, E, 2, "skewed", 5)
  loss = lambda impl: lambda x, w1: jnp.sum(jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl=impl)[0] ** 2)
  with jax.set_mesh(mesh):
    ref = jax.grad(loss("reference"), argnums=(0, 1))(x, w1)
    for impl in ("overlap", "xla"):
      for a, b in zip(jax.grad(loss(impl), argnums=(0, 1))(x, w1), ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
def test_eager_module_call_reuses_the_expert_program():
  mesh = mesh_of(4)
  m = jmo.MoE(jmo.MoEConfig(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=2), mesh=mesh,
              rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(4), (2, 32, D))
  m(x)
  # The router runs op by op (XLA caches each op's executable); the expert layer reuses its compiled program.
  with count_compilations() as compiled:
    y, _ = m(x)
  assert not compiled, f"the second eager MoE call compiled {len(compiled)} programs"
  y_jit, _ = nnx.jit(lambda m, x: m(x))(m, x)
  np.testing.assert_allclose(y, y_jit, rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
def test_eager_vjp_on_a_data_by_expert_mesh_of_eight():
  """An eager jax.vjp on a (data 2, expert 4) mesh of 8 CPU devices, ten times: its programs hold XLA collectives
  beside the workspace calls, so it needs the calls to wait off XLA's threads (ffi/cpu/async_call.h); a pool that
  runs out does so at random, hence the repeats."""
  out = run_script("eager_meshes_main.py", "vjp")
  assert "overlap vjp: match" in out, out


def test_release_after_a_failed_program_frees_and_warns():
  out = run_script("release_after_failure_main.py", timeout=300)
  assert "released after a failure" in out


@pytest.mark.slow  # 8 devices in a second process; 27 eager calls, each compiled again under jit and as the oracle
def test_eager_forward_vjp_grad_of_every_impl_on_every_test_mesh():
  out = run_script("eager_meshes_main.py", "all")
  assert out.count(": match") == 9, out


@pytest.mark.slow  # the default pass keeps the eager module grad on an Explicit mesh under set_mesh (the test below)
def test_eager_grad_of_the_weights_with_a_committed_x_under_set_mesh():
  """An eager grad of the weights alone on an Explicit mesh: x is concrete and committed (the module's bfloat16 cast
  of x places it under jax.set_mesh), y is traced. y keeps the program's layout; reading a traced y's sharding raised
  an AttributeError."""
  devs = np.array(jax.devices("cpu")[:4])
  mesh = jax.sharding.Mesh(devs, ("expert",), axis_types=(jax.sharding.AxisType.Explicit,))
  m = jmo.MoE(jmo.MoEConfig(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=2), mesh=mesh,
              rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(6), (32, D))
  loss = lambda m: jnp.sum(m(x)[0] * jnp.cos(jnp.arange(D)))
  with jax.set_mesh(mesh):
    g = nnx.grad(loss)(m)
    g_jit = nnx.jit(nnx.grad(loss))(m)
  for name in ("router", "w1", "w2"):
    np.testing.assert_allclose(np.asarray(g[name][...]), np.asarray(g_jit[name][...]), rtol=1e-5, atol=1e-6)


def test_eager_module_grad_of_a_plain_x_on_explicit_mesh_under_set_mesh():
  """An eager jax.grad of a [B, S, D] x that is on no mesh (a plain array, as the README's snippet makes it) through
  the module on an Explicit mesh, under jax.set_mesh: the layer places x on its mesh first, so the transpose of its
  [..., D] -> [T, D] reshape has a sharding to take (without one JAX refuses it: ShardingTypeError "This reshape is
  not supported"). The gradient is the reference's."""
  devs = np.array(jax.devices("cpu")[:4])
  mesh = jax.sharding.Mesh(devs, ("expert",), axis_types=(jax.sharding.AxisType.Explicit,))
  cfg = jmo.MoEConfig(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=2, dtype=jnp.float32)
  x = jax.random.normal(jax.random.PRNGKey(7), (2, 16, D))
  grads = {}
  with jax.set_mesh(mesh):
    for impl in ("overlap", "reference"):
      m = jmo.MoE(cfg, mesh=mesh, impl=impl, rngs=nnx.Rngs(0))
      grads[impl] = jax.grad(lambda x: jnp.sum(m(x)[0] ** 2))(x)
  assert grads["overlap"].shape == x.shape
  np.testing.assert_allclose(grads["overlap"], grads["reference"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the default pass's longest test (about 37 s on 2 cores): CI's slow pass runs it
def test_overlap_under_disable_jit_and_workspace_calls_in_an_eager_shard_map():
  """impl="overlap" under jax.disable_jit() runs its forward program compiled (the reference's result); a gradient
  taken there and a workspace call in an eager shard_map are refused naming the fix. Compiled op by op, each would
  crash XLA:CPU's compiler (a segmentation fault): a fresh process, so that such a crash fails this test alone."""
  out = run_script("disable_jit_main.py", timeout=300)
  for line in ("moe_experts under disable_jit: match", "MoE on an Explicit mesh under disable_jit: match",
               "grad under disable_jit: refused", "eager shard_map of a workspace call: refused"):
    assert line in out, out
