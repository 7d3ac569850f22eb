"""Meshes mixing Explicit and Auto axes (jax.make_mesh's axis_types per axis): the layer, its gradients and the
module match impl="reference", on a data x expert mesh with batch axes and an expert x tensor mesh, either axis
Explicit. A sharding in the types names Explicit axes only (``api.explicit_spec``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_moe_overlap as jmo
from cases import layer_inputs, moe_config

T, D, F, E, K = 32, 16, 32, 8, 2
# name: (axis sizes, axis types, batch_axes, tensor_axis)
MESHES = {
    "data_auto-expert_explicit": ({"data": 2, "expert": 2}, (AxisType.Auto, AxisType.Explicit), ("data",), None),
    "data_explicit-expert_auto": ({"data": 2, "expert": 2}, (AxisType.Explicit, AxisType.Auto), ("data",), None),
    "expert_explicit-tensor_auto": ({"expert": 2, "tensor": 2}, (AxisType.Explicit, AxisType.Auto), (), "tensor"),
    "expert_auto-tensor_explicit": ({"expert": 2, "tensor": 2}, (AxisType.Auto, AxisType.Explicit), (), "tensor"),
}


def _mesh(name):
  shape, types, _, _ = MESHES[name]
  devs = np.array(jax.devices("cpu")[:4]).reshape(tuple(shape.values()))
  return jax.sharding.Mesh(devs, tuple(shape), axis_types=types)


def _grads(mesh, name, impl, x, ids, gates, w1, w2):
  _, _, batch_axes, tensor_axis = MESHES[name]

  def loss(x, w1, w2):
    y, dropped = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl=impl, batch_axes=batch_axes,
                                 tensor_axis=tensor_axis)
    return jnp.sum(y * jnp.cos(x)), (y, dropped)

  with jax.set_mesh(mesh):
    (_, (y, dropped)), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w1, w2)
  return y, dropped, g


# The default pass: impl="overlap" on one mesh with the expert axis Explicit (batch axes) and one with it Auto (a
# tensor axis); the other two meshes and the other impls in the slow pass.
DEFAULT_MESHES = ("data_auto-expert_explicit", "expert_auto-tensor_explicit")


@pytest.mark.parametrize("impl", ["overlap", pytest.param("collective", marks=pytest.mark.slow),
                                  pytest.param("xla", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", [n if n in DEFAULT_MESHES else pytest.param(n, marks=pytest.mark.slow)
                                  for n in MESHES])
def test_layer_and_gradients_match_reference(name, impl):
  mesh = _mesh(name)
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, K, "skewed", 5)
  y, dropped, g = _grads(mesh, name, impl, x, ids, gates, w1, w2)
  y_ref, dropped_ref, g_ref = _grads(mesh, name, "reference", x, ids, gates, w1, w2)
  assert float(jnp.max(jnp.abs(y))) > 0.01
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  assert int(dropped) == int(dropped_ref)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_module_on_a_mixed_mesh_matches_reference():
  mesh = _mesh("data_auto-expert_explicit")
  cfg = moe_config(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=K)
  x = jax.device_put(layer_inputs(T, D, F, E, K, "balanced", 6)[0].reshape(4, T // 4, D),
                     NamedSharding(mesh, P(("data", "expert"))))
  with jax.set_mesh(mesh):
    m = jmo.MoE(cfg, mesh=mesh, batch_axes=("data",), rngs=nnx.Rngs(0))

  def loss(m, x):
    return jnp.sum(m(x)[0] ** 2)

  with jax.set_mesh(mesh):
    v, g = nnx.jit(nnx.value_and_grad(loss))(m, x)
    m.impl = "reference"
    v_ref, g_ref = nnx.jit(nnx.value_and_grad(loss))(m, x)
  np.testing.assert_allclose(v, v_ref, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["expert_auto-tensor_explicit", "data_explicit-expert_auto"])
def test_checkpoint_round_trips_on_a_mixed_mesh(name):
  from jax_moe_overlap import checkpoint  # pylint: disable=g-import-not-at-top
  mesh = _mesh(name)
  _, _, batch_axes, tensor_axis = MESHES[name]
  cfg = moe_config(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=K)
  with jax.set_mesh(mesh):
    src, dst = (jmo.MoE(cfg, mesh=mesh, batch_axes=batch_axes, tensor_axis=tensor_axis, rngs=nnx.Rngs(seed))
                for seed in (0, 1))
  params = checkpoint.params_of(src)
  for layout in ("maxtext", "per_expert", "transformers"):
    to, back = getattr(checkpoint, f"to_{layout}"), getattr(checkpoint, f"from_{layout}")
    checkpoint.load_params(dst, back(to(params)))
    for name_, value in checkpoint.params_of(dst).items():
      np.testing.assert_array_equal(np.asarray(value), np.asarray(params[name_]), err_msg=f"{layout} {name_}")
