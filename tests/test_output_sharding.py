"""y has x's sharding: every public entry (``moe_experts``, ``MoE``, ``MoEBlock``) and every impl, on meshes with
Explicit and with Auto axes, with batch axes and with a tensor axis, eager and under jit (docs/design.md, "y has x's
sharding"). Under jit on Auto axes a traced x carries no sharding: there y takes the layer's token layout, which is
x's for an x laid out as the layer takes its tokens (the case checked there)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_moe_overlap as jmo
from cases import layer_inputs, moe_config

T, D, F, E, K = 32, 16, 32, 4, 2
IMPLS = ("overlap", "collective", "xla", "reference")
# (mesh shape, batch_axes, tensor_axis)
MESHES = {"expert": ({"expert": 4}, (), None), "data_expert": ({"data": 2, "expert": 2}, ("data",), None),
          "expert_tensor": ({"expert": 2, "tensor": 2}, (), "tensor")}


def _mesh(shape, explicit):
  kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  devs = np.array(jax.devices("cpu")[:4]).reshape(tuple(shape.values()))
  return jax.sharding.Mesh(devs, tuple(shape), axis_types=(kind,) * len(shape))


def _layouts(batch_axes, tensor_axis, explicit):
  """x's layouts to try: the layer's token layout; on Explicit axes (where y follows x's type) replicated too."""
  tokens = P((*batch_axes, "expert", *((tensor_axis,) if tensor_axis else ())))
  return {"tokens": tokens, "replicated": P()} if explicit else {"tokens": tokens}


def _check_functional(mesh_name, explicit, impl, modes=("eager", "jit")):
  shape, batch_axes, tensor_axis = MESHES[mesh_name]
  mesh = _mesh(shape, explicit)
  x0, ids, gates, w1, w2 = layer_inputs(T, D, F, E, K, "balanced", 0)
  w1, w2 = (jax.device_put(w, NamedSharding(mesh, P("expert"))) for w in (w1, w2))
  ids, gates = (jax.device_put(a, NamedSharding(mesh, P())) for a in (ids, gates))

  def layer(x, ids, gates, w1, w2):
    return jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl=impl, batch_axes=batch_axes,
                           tensor_axis=tensor_axis)[0]

  for (name, spec), mode in itertools.product(_layouts(batch_axes, tensor_axis, explicit).items(), modes):
    x = jax.device_put(x0, NamedSharding(mesh, spec))
    with jax.set_mesh(mesh):
      y = (layer if mode == "eager" else jax.jit(layer))(x, ids, gates, w1, w2)
    what = (mesh_name, "explicit" if explicit else "auto", impl, name, mode, y.sharding, x.sharding)
    assert y.sharding.is_equivalent_to(x.sharding, 2), what
    assert float(jnp.max(jnp.abs(y))) > 0.01, what


def _check_modules(mesh_name, explicit, impl, classes):
  """x [4, T / 4, D] with its leading axis laid out as the layer's tokens (replicated too on Explicit axes)."""
  shape, batch_axes, tensor_axis = MESHES[mesh_name]
  mesh = _mesh(shape, explicit)
  cfg = moe_config(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=K)
  x0 = layer_inputs(T, D, F, E, K, "balanced", 1)[0].reshape(4, T // 4, D)
  calls = {jmo.MoE: lambda m, x: m(x)[0], jmo.MoEBlock: lambda m, x: nnx.capture(m, nnx.Intermediate)(x)[0]}
  for cls in classes:
    with jax.set_mesh(mesh):
      m = cls(cfg, mesh=mesh, impl=impl, batch_axes=batch_axes, tensor_axis=tensor_axis, rngs=nnx.Rngs(0))
    for name, spec in _layouts(batch_axes, tensor_axis, explicit).items():
      x = jax.device_put(x0, NamedSharding(mesh, spec))
      with jax.set_mesh(mesh):
        y = nnx.jit(calls[cls])(m, x)
      what = (cls.__name__, mesh_name, "explicit" if explicit else "auto", impl, name, y.sharding, x.sharding)
      assert y.shape == x.shape and y.sharding.is_equivalent_to(x.sharding, 3), what


def test_reference_under_jit_on_auto_axes_keeps_x_sharding():
  # The dense oracle computes every token on every device; its y still comes out laid out as x.
  _check_functional("data_expert", False, "reference", modes=("jit",))


@pytest.mark.slow  # 4 impls x 3 meshes x 2 axis types: about 25 small compilations per impl
@pytest.mark.parametrize("impl", IMPLS)
def test_every_entry_and_impl_keeps_x_sharding(impl):
  for mesh_name, explicit in itertools.product(MESHES, (False, True)):
    _check_functional(mesh_name, explicit, impl)
    # MoEBlock is MoE's call plus its records: on the mesh with every axis kind only.
    _check_modules(mesh_name, explicit, impl, (jmo.MoE, jmo.MoEBlock) if mesh_name == "expert_tensor" else (jmo.MoE,))


def test_eager_module_call_on_auto_axes_keeps_a_committed_x_sharding():
  """An eager MoEBlock call on Auto axes with x [B, S, D] sharded over both leading axes: y gets x's sharding back
  (the layer's [T, D] y, reshaped, had only the leading axis' share)."""
  mesh = _mesh({"data": 2, "expert": 2}, explicit=False)
  cfg = moe_config(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=K)
  m = jmo.MoEBlock(cfg, mesh=mesh, batch_axes=("data",), rngs=nnx.Rngs(0))
  x = jax.device_put(layer_inputs(T, D, F, E, K, "balanced", 2)[0].reshape(4, T // 4, D),
                     NamedSharding(mesh, P("data", "expert")))
  call = lambda m, x: nnx.capture(m, nnx.Intermediate)(x)[0]
  y = call(m, x)
  assert y.shape == x.shape and y.sharding.is_equivalent_to(x.sharding, 3), (y.sharding, x.sharding)
  np.testing.assert_allclose(np.asarray(y), np.asarray(nnx.jit(call)(m, x)), rtol=1e-6, atol=1e-6)
