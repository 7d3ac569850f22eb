"""impl="xla" and skipped slots (expert id -1) against the dense reference, forward and gradients, on 4 devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_overlap as jmo
from jax_moe_overlap import xla_path
from cases import layer_inputs, mesh_of, rel_err

E, D, F, K, T = 8, 16, 24, 2, 32


def with_skips(ids, seed, fraction=0.3):
  """Marks a random `fraction` of the slots -1, and every slot of tokens 0..3 (whole padding tokens)."""
  rng = np.random.default_rng(seed)
  ids = np.array(ids)
  ids[rng.random(ids.shape) < fraction] = -1
  ids[:4] = -1
  return jnp.asarray(ids)


def loss(impl, mesh, ids, cf):
  def f(x, gates, w1, w2):
    y, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, capacity_factor=cf, impl=impl)
    return jnp.sum(jnp.sin(y.astype(jnp.float32)))
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))


# Dropless impl="xla" against the reference: also tests/test_moe_block.py (the module, forward and gradients).
@pytest.mark.parametrize("kind,cf", [pytest.param("skewed", None, marks=pytest.mark.slow),
                                     pytest.param("skewed", 0.5, marks=pytest.mark.slow),
                                     ("all_to_one", 1.0), pytest.param("empty_experts", 0.5, marks=pytest.mark.slow)])
def test_xla_matches_reference(kind, cf):
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, K, kind, 3)
  y, dropped = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh, capacity_factor=cf, impl="xla"))(
      x, ids, gates, w1, w2)
  y_ref, dropped_ref = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, capacity_factor=cf, impl="reference")
  assert int(dropped) == int(dropped_ref)
  assert rel_err(y, y_ref) < 1e-5
  v, g = loss("xla", mesh, ids, cf)(x, gates, w1, w2)
  v_ref, g_ref = loss("reference", mesh, ids, cf)(x, gates, w1, w2)
  assert abs(float(v) - float(v_ref)) < 1e-4 * max(1.0, abs(float(v_ref)))
  for a, b in zip(g, g_ref):
    assert rel_err(a, b) < 1e-5


# Each impl dropless and with drops; the default pass takes each impl once and each capacity rule (each case
# compiles its programs).
@pytest.mark.parametrize("impl,cf", [("overlap", None), pytest.param("overlap", 0.75, marks=pytest.mark.slow),
                                     pytest.param("xla", None, marks=pytest.mark.slow), ("xla", 0.75),
                                     pytest.param("reference", None, marks=pytest.mark.slow), ("reference", 0.75)])
def test_skipped_slots(impl, cf):
  """A -1 slot contributes zero and is not dropped: the layer equals the one where its gate is zero (id kept,
  so that slot is routed), apart from the capacity the routed slot takes; with cf=None that is exact."""
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, K, "skewed", 5)
  sk = with_skips(ids, 5)
  y, dropped = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh, capacity_factor=cf, impl=impl))(
      x, sk, gates, w1, w2)
  # NumPy oracle: per token, sum of gate * expert MLP over kept, non-skipped slots; capacity per expert in the
  # global slot order counts non-skipped slots only.
  xn, gn, w1n, w2n, idn = (np.asarray(a, np.float64) for a in (x, gates, w1, w2, sk))
  cap = T * 1 if cf is None else max(1, min(int(np.ceil(cf * T * K / E)), T))
  used = np.zeros(E, int)
  y_np = np.zeros((T, D))
  n_dropped = 0
  for t in range(T):
    for j in range(K):
      e = int(idn[t, j])
      if e < 0:
        continue
      if used[e] >= cap:
        n_dropped += 1
        continue
      used[e] += 1
      a = xn[t] @ w1n[e]
      h = a[:F] / (1 + np.exp(-a[:F])) * a[F:]
      y_np[t] += gn[t, j] * (h @ w2n[e])
  assert int(dropped) == n_dropped
  assert rel_err(y, y_np) < 1e-5
  np.testing.assert_array_equal(np.asarray(y[:4]), 0)
  v, g = loss(impl, mesh, sk, cf)(x, gates, w1, w2)
  v_ref, g_ref = loss("reference", mesh, sk, cf)(x, gates, w1, w2)
  assert abs(float(v) - float(v_ref)) < 1e-4 * max(1.0, abs(float(v_ref)))
  for a, b in zip(g, g_ref):
    assert rel_err(a, b) < 1e-5
  # Skipped slots get no gradient: their gates' cotangents are zero, as are padding tokens' dx.
  np.testing.assert_array_equal(np.asarray(g[1])[np.asarray(sk) < 0], 0)
  np.testing.assert_array_equal(np.asarray(g[0][:4]), 0)


def test_all_skipped():
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, K, "skewed", 1)
  sk = jnp.full_like(ids, -1)
  for impl in ("overlap", "xla", "reference"):
    y, dropped = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh, impl=impl))(x, sk, gates, w1, w2)
    assert int(dropped) == 0
    np.testing.assert_array_equal(np.asarray(y), 0)


@pytest.mark.parametrize("bad", [-2, E])
def test_other_out_of_range_ids_stay_errors(bad):
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, K, "skewed", 1)
  with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 8\)"):
    jmo.moe_experts(x, ids.at[2, 1].set(bad), gates, w1, w2, mesh=mesh)


def test_xla_bf16_close_to_reference():
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, K, "skewed", 2, dtype=jnp.bfloat16)
  y = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh, impl="xla")[0])(x, ids, gates, w1, w2)
  y_ref = jmo.moe_experts(*(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a
                            for a in (x, ids, gates, w1, w2)), mesh=mesh, impl="reference")[0]
  assert y.dtype == jnp.bfloat16
  assert rel_err(y, y_ref) < 2e-2


@pytest.mark.parametrize("impl,axis_type", [("xla", "Auto"), ("collective", "Explicit")])
def test_one_rank_moves_rows_without_a_collective(impl, axis_type):
  """An expert axis of one rank: the exchange is a gather within the device (no all-to-all in the program), with
  drops, the layer and its gradients equal to the reference's."""
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("expert",),
                           axis_types=(getattr(jax.sharding.AxisType, axis_type),))
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, K, "skewed", 7)
  fwd = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh, capacity_factor=0.75, impl=impl))
  hlo = fwd.lower(x, ids, gates, w1, w2).as_text()
  assert "all_to_all" not in hlo and "all-to-all" not in hlo
  y, dropped = fwd(x, ids, gates, w1, w2)
  y_ref, dropped_ref = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, capacity_factor=0.75, impl="reference")
  assert int(dropped) == int(dropped_ref) > 0
  assert rel_err(y, y_ref) < 1e-5
  v, g = loss(impl, mesh, ids, 0.75)(x, gates, w1, w2)
  v_ref, g_ref = loss("reference", mesh, ids, 0.75)(x, gates, w1, w2)
  assert abs(float(v) - float(v_ref)) < 1e-4 * max(1.0, abs(float(v_ref)))
  for a, b in zip(g, g_ref):
    assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("impl,devices", [("xla", 1), ("collective", 4)])
def test_gradients_move_rows_by_gathers(impl, devices):
  """Every row move of the route (token -> slots -> send buffer -> recv rows and back) is a one-to-one map whose
  gradient is the gather through its inverse: the layer's gradient program scatters no rows (XLA:GPU's scatter-add
  of rows is many times slower than a gather), and equals the reference's, with drops and skipped slots."""
  mesh = mesh_of(devices) if devices > 1 else jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("expert",))
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, K, "skewed", 11)
  ids = with_skips(ids, 11, 0.2)
  f = loss(impl, mesh, ids, 0.75)
  hlo = f.lower(x, gates, w1, w2).compile().as_text()
  rows_scattered = [l for l in hlo.splitlines() if " scatter(" in l and not l.split("=")[1].strip().startswith("s32[")]
  assert not rows_scattered, rows_scattered
  v, g = f(x, gates, w1, w2)
  v_ref, g_ref = loss("reference", mesh, ids, 0.75)(x, gates, w1, w2)
  assert abs(float(v) - float(v_ref)) < 1e-4 * max(1.0, abs(float(v_ref)))
  for a, b in zip(g, g_ref):
    assert rel_err(a, b) < 1e-5


def test_move_rows_gradient_is_the_inverse_gather():
  """move_rows' gradient equals JAX's own transpose of the same gather (the scatter-add) on a one-to-one map with
  rows no output takes and outputs no row fills."""
  from jax_moe_overlap.xla_path import move_rows
  rng = np.random.default_rng(5)
  rows = jnp.asarray(rng.standard_normal((7, 3)), jnp.float32)
  index = jnp.asarray([4, 7, 0, 2, 9, 6], jnp.int32)            # rows 1, 3 and 5 taken by none; outputs 1, 4 zero
  inverse = jnp.asarray([2, 7, 3, 7, 0, 7, 5], jnp.int32)
  ct = jnp.asarray(rng.standard_normal((6, 3)), jnp.float32)
  np.testing.assert_array_equal(move_rows(rows, index, inverse), jnp.take(rows, index, axis=0, mode="fill", fill_value=0))
  got = jax.vjp(lambda r: move_rows(r, index, inverse), rows)[1](ct)[0]
  want = jax.vjp(lambda r: jnp.take(r, index, axis=0, mode="fill", fill_value=0), rows)[1](ct)[0]
  np.testing.assert_array_equal(got, want)
