"""Tokens sharded over batch axes too (``moe_experts(..., batch_axes=...)``): shared by test_batch_axes.py (4 CPU
devices) and batch_axes_main.py (8, in a child process)."""

import math

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe_overlap as jmo
from cases import layer_inputs
from jax_moe_overlap.plan import expert_capacity
from jax_moe_overlap.reference import moe_experts_reference

E, D, F = 8, 16, 24


def mesh_of_shape(shape: dict[str, int]) -> jax.sharding.Mesh:
  n = math.prod(shape.values())
  devs = np.array(jax.devices("cpu")[:n]).reshape(tuple(shape.values()))
  return jax.sharding.Mesh(devs, tuple(shape), axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def _loss(mesh, batch_axes, cf, ids, impl):
  def loss(x, gates, w1, w2):
    y, dropped = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, capacity_factor=cf, impl=impl,
                                 batch_axes=batch_axes)
    return jnp.sum(jnp.sin(y) * jnp.arange(y.size).reshape(y.shape) / y.size), (y, dropped)
  return loss


def _oracle(x, ids, gates, w1, w2, groups, ranks, cf):
  """Each group of T / groups consecutive tokens is its own expert-parallel layer (written without vmap)."""
  t = x.shape[0] // groups
  cap_e = expert_capacity(t // ranks, ranks, ids.shape[1], E, cf)
  ys, dropped = [], 0
  for b in range(groups):
    s = slice(b * t, (b + 1) * t)
    y, d = moe_experts_reference(x[s], ids[s], gates[s], w1, w2, cap_e, ranks)
    ys.append(y)
    dropped += int(d)
  return jnp.concatenate(ys), dropped


def check_matches_reference(shape: dict[str, int], batch_axes, cf=None, kind="skewed", tokens=64, seed=0):
  mesh = mesh_of_shape(shape)
  R, B = shape["expert"], math.prod(shape[a] for a in batch_axes)
  x, ids, gates, w1, w2 = layer_inputs(tokens, D, F, E, 2, kind, seed)
  out = {}
  for impl in ("overlap", "reference"):
    grad_fn = jax.value_and_grad(_loss(mesh, batch_axes, cf, ids, impl), argnums=(0, 1, 2, 3), has_aux=True)
    (_, (y, dropped)), grads = jax.jit(grad_fn)(x, gates, w1, w2)
    out[impl] = (y, dropped, grads)
  y, dropped, grads = out["overlap"]
  y_ref, dropped_ref, grads_ref = out["reference"]
  y_oracle, dropped_oracle = _oracle(x, ids, gates, w1, w2, B, R, cf)
  # Every device holds its own T / (B R) tokens: no group recomputes another's.
  assert {s.data.shape for s in y.addressable_shards} == {(tokens // (B * R), D)}, y.sharding
  assert int(dropped) == int(dropped_ref) == dropped_oracle
  np.testing.assert_allclose(y_ref, y_oracle, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(y, y_oracle, rtol=1e-5, atol=1e-5)
  for name, g, g_ref in zip(("x", "gates", "w1", "w2"), grads, grads_ref):
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5, err_msg=f"gradient of {name}")
  return int(dropped)
