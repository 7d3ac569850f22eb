"""quantization="fp8" with expert tensor parallelism (tensor_axis): impl="xla" on an (expert=2, tensor=2) mesh,
each device running the recipe on its F / 2 shard, against the FP8 oracle (impl="reference", whole experts) and
against impl="xla" without a tensor axis, forward and gradients, on Auto and Explicit axes; pre-quantized weights
split over the tensor axis by the layer, and kept split by quantize_weights (of w1's view); the module; the refusal
of F / TP not a multiple of 128 by every impl (impl="overlap" with a tensor axis against impl="collective":
tests/test_fp8_overlap.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe_overlap as jmo
from cases import layer_inputs, moe_config, rel_err
from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap.reference import kept_mask
from tensor_parallel_checks import mesh_of_shape

E, K, T, D, F = 8, 2, 64, 128, 256      # F / 2 = 128: one 128-wide tile of each shard's gate, up and h
EXPERT_TENSOR = {"expert": 2, "tensor": 2}
# Forward and gradients differ from the oracle by float32 rounding in the GEMMs (and, rarely, one e4m3 step where
# that crosses a rounding boundary; test_fp8_layer's bound), and by the split of the sums over F: each shard's
# partial output and partial input gradient is rounded to the layer's dtype before the partials are summed.
BOUND = {jnp.float32: 1e-3, jnp.bfloat16: 1e-2}


def grads_fn(mesh, ids, cotangent, impl, tensor_axis="tensor", cf=None):
  """jit of ((loss, (y, dropped)), (dx, dgates, dw1, dw2)) of sum(y * cotangent) through moe_experts, fp8."""
  def loss(x, gates, w1, w2):
    y, dropped = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl=impl, capacity_factor=cf,
                                 tensor_axis=tensor_axis, quantization="fp8")
    return jnp.sum(y.astype(jnp.float32) * cotangent), (y, dropped)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def inputs(dtype, seed, explicit_mesh=None, view=False):
  """x, ids, gates in ``dtype`` and float32 master weights (w1 whole or as its [E, D, 2, F] view); on an Explicit
  mesh x over (expert, tensor) and the weights over the experts."""
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, K, "skewed", seed, dtype=dtype)
  w1, w2 = w1.astype(jnp.float32), w2.astype(jnp.float32)
  if view:
    w1 = w1.reshape(E, D, 2, F)
  if explicit_mesh is not None:
    x = jax.device_put(x, NamedSharding(explicit_mesh, P(("expert", "tensor"))))
    w1, w2 = (jax.device_put(w, NamedSharding(explicit_mesh, P("expert"))) for w in (w1, w2))
  return x, ids, gates, w1, w2


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
@pytest.mark.parametrize("explicit,dtype,cf", [(False, jnp.float32, None), (True, jnp.bfloat16, 0.5),
                                              (False, jnp.bfloat16, 0.5), (True, jnp.float32, None)])
def test_xla_matches_the_oracle(explicit, dtype, cf):
  mesh = mesh_of_shape(EXPERT_TENSOR, explicit)
  x, ids, gates, w1, w2 = inputs(dtype, 3, mesh if explicit else None, view=not explicit)
  cot = jnp.asarray(np.random.default_rng(4).standard_normal((T, D)).astype(np.float32))
  f = grads_fn(mesh, ids, cot, "xla", cf=cf)
  (_, (y, dropped)), g = f(x, gates, w1, w2)
  (_, (y_ref, dropped_ref)), g_ref = grads_fn(mesh, ids, cot, "reference", cf=cf)(x, gates, w1, w2)
  assert y.dtype == dtype and g[0].dtype == dtype and g[2].dtype == g[3].dtype == jnp.float32
  assert g[2].shape == w1.shape and g[3].shape == w2.shape
  if explicit:
    assert y.sharding.is_equivalent_to(x.sharding, 2)
  assert int(dropped) == int(dropped_ref)
  assert rel_err(y, y_ref) < BOUND[dtype]
  for name, a, b in zip(("dx", "dgates", "dw1", "dw2"), g, g_ref):
    assert float(jnp.max(jnp.abs(b))) > 0, name
    assert rel_err(a, b) < BOUND[dtype], name
  if cf is not None:   # dropped slots: zero gate gradient in both
    kept = np.asarray(kept_mask(ids, E, plan_lib.expert_capacity(T // 4, 4, K, E, cf), 4))
    assert (~kept).any() and int(dropped) == int((~kept).sum())
    np.testing.assert_array_equal(np.asarray(g[1])[~kept], 0.0)
  # Same inputs, same bits.
  (_, (y2, _)), g2 = f(x, gates, w1, w2)
  for a, b in zip((y, *g), (y2, *g2)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.slow  # the default pass keeps the xla-vs-oracle check and the refusals
def test_shards_quantize_the_whole_experts_tiles():
  """The tensor-parallel recipe against the recipe on whole experts through the same impl (impl="xla" on the 4
  devices as one expert axis, the same capacity group): float32 inputs, so the only differences are float32
  roundings, the split sums over F included. Tiles or blocks other than the whole expert's (scales from other
  amaxes) would move values by e4m3 steps (2^-4 relatively), far above the bound."""
  mesh = mesh_of_shape(EXPERT_TENSOR)
  flat = mesh_of_shape({"expert": 4})
  x, ids, gates, w1, w2 = inputs(jnp.float32, 5)
  cot = jnp.asarray(np.random.default_rng(6).standard_normal((T, D)).astype(np.float32))
  (_, (y, _)), g = grads_fn(mesh, ids, cot, "xla")(x, gates, w1, w2)
  (_, (y_flat, _)), g_flat = grads_fn(flat, ids, cot, "xla", tensor_axis=None)(x, gates, w1, w2)
  for name, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), (y, *g), (y_flat, *g_flat)):
    assert rel_err(a, b) < 1e-4, name


@pytest.mark.slow  # the default pass keeps the xla-vs-oracle check and the refusals
@pytest.mark.parametrize("explicit", [True, False])
def test_prequantized_weights_split_over_the_tensor_axis(explicit):
  """Fp8Weights of w1 and w2 (values [E, N, K], scales [E, N / 128, K / 128]) split over the tensor axis on F as
  the float weights do: the same bits as the call that quantizes the master weights, the same input gradient; held
  fixed by stop_gradient, the weights may be arguments of the differentiated function."""
  mesh = mesh_of_shape(EXPERT_TENSOR, explicit)
  x, ids, gates, w1, w2 = inputs(jnp.bfloat16, 7, mesh if explicit else None)
  q1, q2 = jax.jit(jmo.quantize_weights)(w1, w2)
  run = jax.jit(lambda x, w1, w2: jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl="xla", tensor_axis="tensor",
                                                  quantization="fp8")[0])
  y = run(x, q1, q2)
  assert float(jnp.max(jnp.abs(y.astype(jnp.float32)))) > 0
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(run(x, w1, w2), np.float32))
  held = lambda x, q1: jnp.sum(run(x, jax.lax.stop_gradient(q1), q2).astype(jnp.float32))
  dx, dq1 = jax.jit(jax.grad(held, argnums=(0, 1)))(x, q1)
  dx_master = jax.jit(jax.grad(lambda x: jnp.sum(run(x, w1, w2).astype(jnp.float32))))(x)
  np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx_master, np.float32))
  assert not np.any(np.asarray(dq1.scales)) and not np.any(np.asarray(dq1.values, np.float32))
  assert dq1.values.shape == q1.values.shape and dq1.scales.shape == q1.scales.shape


_OTHER_IMPLS = ("xla", "reference", "collective")


# impl="overlap" on Explicit axes in the default pass; on Auto axes, and the other impls, in the slow pass.
@pytest.mark.parametrize("explicit,impls", [pytest.param(False, ("overlap",), marks=pytest.mark.slow),
                                            (True, ("overlap",)),
                                            pytest.param(False, _OTHER_IMPLS, marks=pytest.mark.slow),
                                            pytest.param(True, _OTHER_IMPLS, marks=pytest.mark.slow)])
def test_prequantized_view_keeps_the_tensor_split(explicit, impls):
  """quantize_weights of w1's [E, D, 2, F] view split over the tensor axis along F (and of w2 so split): Fp8Weights
  that keep that split (values [E, 2, F, D] and [E, D, F] with F over the tensor axis: each device holds a quarter of
  the values on the 2 x 2 mesh, where the [E, D, 2F] form holds half), the same blocks as w1's whole form, and the
  layer on them gives the bits of the call that quantizes the master weights."""
  mesh = mesh_of_shape(EXPERT_TENSOR, explicit)
  x, ids, gates, w1, w2 = inputs(jnp.bfloat16, 7, mesh if explicit else None, view=True)
  w1 = jax.device_put(w1, NamedSharding(mesh, P("expert", None, None, "tensor")))
  w2 = jax.device_put(w2, NamedSharding(mesh, P("expert", "tensor", None)))
  q1, q2 = jax.jit(jmo.quantize_weights)(w1, w2)
  assert q1.shape == (E, D, 2, F) and q1.values.shape == (E, 2, F, D) and q1.scales.shape == (E, 2, F // 128, D // 128)
  for q, f_axis in ((q1.values, 2), (q1.scales, 2), (q2.values, 2)):
    assert tuple(q.sharding.spec)[f_axis] == "tensor", q.sharding
    assert {s.data.nbytes for s in q.addressable_shards} == {q.nbytes // 4}
  whole1, _ = jmo.quantize_weights(np.asarray(w1).reshape(E, D, 2 * F), np.asarray(w2))
  np.testing.assert_array_equal(np.asarray(q1.values).reshape(E, 2 * F, D).view(np.uint8),
                                np.asarray(whole1.values).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(q1.scales).reshape(whole1.scales.shape), np.asarray(whole1.scales))
  for impl in impls:
    run = jax.jit(lambda x, w1, w2, impl=impl: jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl=impl,
                                                               tensor_axis="tensor", quantization="fp8")[0])
    y = np.asarray(run(x, q1, q2), np.float32)
    assert np.max(np.abs(y)) > 0
    np.testing.assert_array_equal(y, np.asarray(run(x, w1, w2), np.float32), err_msg=impl)


@pytest.mark.slow  # the default pass keeps the xla-vs-oracle check and the refusals
def test_module_with_a_tensor_axis_matches_reference():
  """The module (w1 kept as its [E, D, 2, F] view, sharded over the tensor axis) in float32 compute: the shards'
  partials differ from the oracle's whole sums by float32 rounding only, so no e4m3 rounding moves (in bfloat16 the
  partials' roundings move the loss's output gradient, and with it some of the gradients' e4m3 roundings: the layer
  test above bounds that case)."""
  mesh = mesh_of_shape(EXPERT_TENSOR, explicit=True)
  cfg = moe_config(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=K, dtype=jnp.float32,
                   quantization="fp8")
  x = jax.device_put(jax.random.normal(jax.random.PRNGKey(1), (4, 16, D)),
                     NamedSharding(mesh, P(("expert", "tensor"))))

  def loss(m, x):
    y, aux = m(x)
    return jnp.sum(jnp.sin(y)) + 0.1 * aux.load_balance_loss, y

  step = nnx.jit(lambda m, x: nnx.value_and_grad(loss, has_aux=True)(m, x))
  m = jmo.MoE(cfg, mesh=mesh, impl="xla", tensor_axis="tensor", rngs=nnx.Rngs(0))
  assert m.w1[...].shape == (E, D, 2, F)
  assert {s.data.shape for s in m.w1[...].addressable_shards} == {(E // 2, D, 2, F // 2)}
  (v, y), g = step(m, x)
  m.impl = "reference"
  (v_ref, y_ref), g_ref = step(m, x)
  assert y.shape == x.shape and y.sharding.is_equivalent_to(x.sharding, x.ndim)
  assert rel_err(y, y_ref) < 1e-5
  assert abs(float(v) - float(v_ref)) < 1e-5 * abs(float(v_ref))
  for name in ("router", "w1", "w2"):
    assert float(jnp.max(jnp.abs(g_ref[name][...]))) > 0, name
    assert rel_err(g[name][...], g_ref[name][...]) < 1e-5, name
  assert tuple(g["w1"][...].sharding.spec) == ("expert", None, None, "tensor")
  # And the FP8 module differs from the unquantized one by the quantization, no more.
  m = jmo.MoE(jmo.MoEConfig(**{**cfg.__dict__, "quantization": None}), mesh=mesh, impl="xla", tensor_axis="tensor",
              rngs=nnx.Rngs(0))
  assert 2.0 ** -10 < rel_err(y, nnx.jit(lambda m, x: m(x)[0])(m, x)) < 2.0 ** -3


def test_refusals():
  mesh = mesh_of_shape(EXPERT_TENSOR)
  # F = 128 over 2 devices: 64 columns per shard, half a tile.
  x, ids, gates, w1, w2 = layer_inputs(T, D, 128, E, K, "balanced", 0)
  rule = (r"quantization='fp8' with tensor_axis 'tensor' needs .* d_ff \(moe_mlp_dim\) / 2 must be a multiple of "
          r"128, got d_ff=128, 128 / 2 = 64")
  jmo.release_workspaces()
  for impl in ("xla", "reference", "collective", "overlap"):
    with pytest.raises(ValueError, match=rule):
      jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl=impl, tensor_axis="tensor", quantization="fp8")
  with pytest.raises(ValueError, match=rule):
    jmo.moe_experts(x, ids, gates, *jmo.quantize_weights(w1, w2), mesh=mesh, impl="xla", tensor_axis="tensor",
                    quantization="fp8")
  cfg = moe_config(emb_dim=D, moe_mlp_dim=128, num_experts=E, num_experts_per_tok=K, quantization="fp8")
  for impl in ("xla", "overlap"):
    with pytest.raises(ValueError, match=rule):
      jmo.MoE(cfg, mesh=mesh, impl=impl, tensor_axis="tensor", rngs=nnx.Rngs(0))
  assert jmo.Workspace.cached() == []   # refused before overlap's workspace exists
