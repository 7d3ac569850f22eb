"""The expert layer through the custom calls (impl="overlap") against the pure-JAX reference, on 1-4 CPU devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_overlap as jmo
import layer_checks
from cases import ROUTINGS, layer_inputs, mesh_of

E, D, F = 8, 16, 24


@functools.lru_cache(maxsize=None)
def _value_and_grads(impl, R, cf):
  """Jitted (x, ids, gates, w1, w2) -> ((loss, (y, dropped)), grads wrt x, gates, w1, w2) of the layer on R devices;
  the routing is an argument, so one compilation serves every routing of a shape."""
  mesh = mesh_of(R)

  def loss(x, gates, w1, w2, ids):
    y, dropped = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, capacity_factor=cf, impl=impl)
    # A non-linear read-out, so that every output element gets its own cotangent.
    return jnp.sum(jnp.sin(y.astype(jnp.float32)) * jnp.arange(y.size).reshape(y.shape) / y.size), (y, dropped)

  grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
  return jax.jit(lambda x, ids, gates, w1, w2: grads(x, gates, w1, w2, ids))


def run_both(R, k, kind, cf=None, tokens_per_rank=16, seed=0, dtype=jnp.float32):
  x, ids, gates, w1, w2 = layer_inputs(tokens_per_rank * R, D, F, E, k, kind, seed, dtype)
  out = {}
  for impl in ("overlap", "reference"):
    args = (x, gates, w1, w2)
    if impl == "reference":  # the oracle always runs in float32
      args = tuple(a.astype(jnp.float32) for a in args)
    (_, (y, dropped)), grads = _value_and_grads(impl, R, cf)(args[0], ids, *args[1:])
    out[impl] = (y, dropped, grads)
  return out


# Every routing on each (R, k); the default pass takes each R and each k once (each pair compiles its programs), the
# slow pass the other pairs.
DEFAULT_R_K = ((1, 4), (2, 2), (4, 1))


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("R,k", [pytest.param(R, k, marks=() if (R, k) in DEFAULT_R_K else pytest.mark.slow)
                                 for R in (1, 2, 4) for k in (1, 2, 4)])
def test_forward_and_grads_match_reference(R, k, kind):
  out = run_both(R, k, kind, seed=R * 100 + k)
  y, dropped, grads = out["overlap"]
  y_ref, dropped_ref, grads_ref = out["reference"]
  assert int(dropped) == int(dropped_ref) == 0  # dropless by default
  assert float(jnp.max(jnp.abs(y_ref))) > 0.1
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for name, g, g_ref in zip(("x", "gates", "w1", "w2"), grads, grads_ref):
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5, err_msg=f"gradient of {name}")


# Each R and each capacity factor but 0.5 once in the default pass (each pair compiles its two programs): R = 2 at
# 1.0, R = 4 at 0.25; the other pairs in the slow pass.
DEFAULT_R_CF = ((2, 1.0), (4, 0.25))


@pytest.mark.parametrize("R,cf", [pytest.param(R, cf, marks=() if (R, cf) in DEFAULT_R_CF else pytest.mark.slow)
                                  for cf in (1.0, 0.5, 0.25) for R in (2, 4)])
def test_capacity_overflow_drops_identically(R, cf):
  out = run_both(R, 2, "skewed", cf=cf, seed=7)
  y, dropped, grads = out["overlap"]
  y_ref, dropped_ref, grads_ref = out["reference"]
  assert int(dropped) > 0, "this routing must overflow the capacity"
  assert int(dropped) == int(dropped_ref)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for g, g_ref in zip(grads, grads_ref):
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["skewed", pytest.param("one_rank", marks=pytest.mark.slow)])
def test_bfloat16_within_tolerance(kind):
  # The GPU suite's check (tests/layer_checks.py, also run by tests/gpu/test_gpu_layer.py) on 4 CPU devices: bf16
  # forward and gradients within 1e-2 of the float32 reference, every output computed into a NaN-poisoned buffer.
  layer_checks.check_layer(mesh_of(4), kind, seed=3)


# R = 4, two calls and fused, in the default pass; the one-rank case in the slow pass.
@pytest.mark.parametrize("R,fused", [pytest.param(1, False, marks=pytest.mark.slow), (4, False), (4, True)])
def test_scaled_dispatch_keeps_the_gradients_bits(R, fused, monkeypatch):
  # expert_block's backward dispatches dy's rows scaled by the gates as they move (row_scale; fused: dispatch_gemm's,
  # as CallConfig(dispatch_pushers=2) runs it on CPU) instead of the [T k, D] array of gates * dy: bf16 layer outputs
  # and gradients bit for bit the same either way, drops included.
  from jax_moe_overlap import expert_block  # pylint: disable=g-import-not-at-top
  mesh = mesh_of(R)
  x, ids, gates, w1, w2 = layer_inputs(16 * R, D, F, E, 2, "skewed", 41, jnp.bfloat16)
  config = jmo.CallConfig(dispatch_pushers=2) if fused else jmo.CallConfig()

  def loss(x, gates, w1, w2):
    y, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, capacity_factor=0.5, config=config)
    return jnp.sum(jnp.sin(y.astype(jnp.float32)) * jnp.arange(y.size).reshape(y.shape) / y.size)

  out = {}
  for scaled in (False, True):
    monkeypatch.setattr(expert_block, "SCALE_IN_DISPATCH", scaled)
    jmo.api._programs.clear()  # pylint: disable=protected-access  (traced anew: the switch is read when tracing)
    out[scaled] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, gates, w1, w2)
  for a, b in zip(jax.tree.leaves(out[False]), jax.tree.leaves(out[True])):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  assert float(jnp.max(jnp.abs(out[True][1][1]))) > 0  # the gates' gradient is not all zero


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
def test_dispatch_pushers_fuses_on_cpu_too():
  # CallConfig(dispatch_pushers=2) runs dispatch_gemm's CPU handler: the bits of the two calls with the bare grouped
  # GEMM calls, jmo_grouped_matmul_swiglu as GEMM1 and jmo_grouped_matmul for the backward's d_out W2^T
  # (tests/gpu/test_gpu_layer.py runs the same check on the fused kernel; tests/test_dispatch_gemm.py has the CPU
  # cases).
  layer_checks.check_dispatch_gemm(mesh_of(4))


def test_call_config_rejects_bad_dispatch_pushers():
  for bad in (-1, 1.5, True, "2"):
    with pytest.raises(ValueError, match="dispatch_pushers"):
      jmo.CallConfig(dispatch_pushers=bad)


def test_two_expert_groups_on_a_2x2_mesh():
  # A (data, expert) mesh: two independent expert groups of 2 ranks, each with its own workspace group.
  devs = np.array(jax.devices("cpu")[:4]).reshape(2, 2)
  mesh = jax.sharding.Mesh(devs, ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  x, ids, gates, w1, w2 = layer_inputs(32, D, F, E, 2, "skewed", 11)
  f = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh, axis_name="expert"))
  y, dropped = f(x, ids, gates, w1, w2)
  y_ref, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, axis_name="expert", impl="reference")
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  assert int(dropped) == 0


def test_hundred_calls_bitwise_identical_and_correct():
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(64, D, F, E, 2, "skewed", 5)
  f = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh)[0])
  y_ref, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl="reference")
  first = np.asarray(f(x, ids, gates, w1, w2))
  np.testing.assert_allclose(first, y_ref, rtol=1e-5, atol=1e-5)
  outs = [f(x, ids, gates, w1, w2) for _ in range(100)]  # 100 epochs back to back, no resets
  for y in outs:
    np.testing.assert_array_equal(np.asarray(y), first)


def test_changing_routing_between_calls():
  # Consecutive calls with different routings (and so different offsets) reuse the workspace safely.
  mesh = mesh_of(4)
  f = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh, capacity_factor=1.0))
  for i, kind in enumerate(["skewed", "all_to_one", "balanced", "empty_experts", "skewed"] * 4):
    x, ids, gates, w1, w2 = layer_inputs(64, D, F, E, 2, kind, 40 + i)
    y, dropped = f(x, ids, gates, w1, w2)
    y_ref, dropped_ref = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, capacity_factor=1.0, impl="reference")
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5, err_msg=f"call {i} ({kind})")
    assert int(dropped) == int(dropped_ref)


@pytest.mark.parametrize("slow_rank", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_one_rank_held_back(slow_rank):
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(64, D, F, E, 2, "skewed", 9)
  cfg = jmo.CallConfig(timeout_ms=20_000, delay_rank=slow_rank, delay_us=50_000)
  f = jax.jit(jax.value_and_grad(
      lambda *a: jnp.sum(jmo.moe_experts(a[0], ids, a[1], a[2], a[3], mesh=mesh, config=cfg)[0] ** 2),
      argnums=(0, 2)))
  loss, grads = f(x, gates, w1, w2)
  g = jax.jit(jax.value_and_grad(
      lambda *a: jnp.sum(jmo.moe_experts(a[0], ids, a[1], a[2], a[3], mesh=mesh, impl="reference")[0] ** 2),
      argnums=(0, 2)))
  loss_ref, grads_ref = g(x, gates, w1, w2)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
  for a, b in zip(grads, grads_ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_workspace_is_shared_per_sizes_and_named_by_handle():
  # A call gets the smallest cached workspace of its mesh and axis that fits, so start from none: earlier tests
  # leave larger ones that would fit every size asked for here.
  jmo.release_workspaces()
  mesh = mesh_of(2)
  sizes = jmo.workspace.WorkspaceSizes(row_bytes=64, recv_rows=32, ret_rows=16, num_segments=8)
  a = jmo.Workspace.get(mesh, "expert", sizes)
  b = jmo.Workspace.get(mesh, "expert", sizes)
  c = jmo.Workspace.get(mesh, "expert", sizes.__class__(64, 64, 16, 8))
  assert a is b and a is not c and a.handle != c.handle
  assert jmo.Workspace.get(mesh, "expert", sizes) is a  # the smaller one still fits: it is picked, not c
  assert a.ranks == 2 and a.groups == 1 and a.platform == "cpu"


def test_independent_layers_in_one_program_share_the_workspace():
  # Two layers of the same sizes with no data dependence between them: XLA:CPU would start their workspace calls in
  # any order per device; the token chain (ordering.py) gives every device the same order, and each call runs as its
  # own epoch of the shared workspace. Without the chain the devices' calls meet out of order and time out.
  mesh = mesh_of(4)
  a = layer_inputs(64, D, F, E, 2, "skewed", 21)
  b = layer_inputs(64, D, F, E, 2, "balanced", 22)

  @jax.jit
  def two(a, b):
    return jmo.moe_experts(*a, mesh=mesh)[0], jmo.moe_experts(*b, mesh=mesh)[0]

  ref_a = jmo.moe_experts(*a, mesh=mesh, impl="reference")[0]
  ref_b = jmo.moe_experts(*b, mesh=mesh, impl="reference")[0]
  for _ in range(10):
    ya, yb = two(a, b)
    np.testing.assert_allclose(ya, ref_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(yb, ref_b, rtol=1e-5, atol=1e-5)
