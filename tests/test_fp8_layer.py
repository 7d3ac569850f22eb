"""quantization="fp8": the recipe (fp8_experts.py) against its NumPy twin, the oracle (impl="reference") against the
unquantized float64 layer, impl="xla" against the oracle (forward and gradients, on meshes with Auto and Explicit
axes), pre-quantized weights, the module, and the refusals."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8_numpy
import jax_moe_overlap as jmo
from benchmarks.references import FP8_ERROR_BOUND, FP8_ERROR_FLOOR, float64_layer, grads_fn
from cases import layer_inputs, moe_config, rel_err
from jax_moe_overlap import _jmo, fp8_experts
from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap.reference import kept_mask

E, K, T = 8, 2, 64
AXIS_TYPES = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}


def mesh_of(n, axis_type="auto"):
  return jax.make_mesh((n,), ("expert",), axis_types=(AXIS_TYPES[axis_type],), devices=jax.devices("cpu")[:n])


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
@pytest.mark.parametrize("gemms", [fp8_experts.DENSE, fp8_experts.RAGGED],
                         ids=lambda g: g.name)
def test_recipe_matches_its_numpy_twin(gemms):
  """fp8_expert_mlp forward and backward against fp8_numpy.recipe (float64 GEMMs on the same quantized operands).
  They differ by float32 rounding in the GEMMs, and where that moves a value across an e4m3 rounding boundary, by
  one e4m3 step of it (rare); a different rule for any operand (its tile, its scale, power of two or not, kept or
  recomputed) differs by several percent."""
  rng = np.random.default_rng(0)
  M, D, F, sizes = 384, 128, 256, [130, 0, 70, 128]
  x = rng.standard_normal((M, D)).astype(np.float32)
  x[sum(sizes):] = 0.0
  w1 = (rng.standard_normal((4, D, 2 * F)) / np.sqrt(D)).astype(np.float32)
  w2 = (rng.standard_normal((4, F, D)) / np.sqrt(F)).astype(np.float32)
  d_out = rng.standard_normal((M, D)).astype(np.float32)
  d_out[sum(sizes):] = 0.0
  gs = jnp.asarray(sizes, jnp.int32)
  out, vjp = jax.vjp(lambda x, w1, w2: fp8_experts.fp8_expert_mlp(x, w1, w2, gs, gemms), x, w1, w2)
  got = [out, *vjp(jnp.asarray(d_out))]
  want = fp8_numpy.recipe(x, w1, w2, sizes, d_out)
  for name, a, b in zip(("out", "dx", "dw1", "dw2"), got, want):
    assert rel_err(a, b) < 1e-3, name
    assert float(jnp.max(jnp.abs(a))) > 0, name
  np.testing.assert_array_equal(np.asarray(got[0])[sum(sizes):], 0.0)
  np.testing.assert_array_equal(np.asarray(got[1])[sum(sizes):], 0.0)


# In the slow pass: by default the oracle is held to impl="xla" (test_xla_matches_the_oracle, within 1e-3) and
# impl="collective" to the float64 layer's error floor and bound (test_collective_matches_xla).
@pytest.mark.parametrize("d,f", [pytest.param(128, 128, marks=pytest.mark.slow),
                                 pytest.param(256, 128, marks=pytest.mark.slow),
                                 pytest.param(128, 256, marks=pytest.mark.slow)])
def test_oracle_error_against_float64(d, f, capsys):
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(T, d, f, E, K, "skewed", 1)
  cot = np.random.default_rng(2).standard_normal((T, d)).astype(np.float32)
  (_, y), grads = grads_fn(mesh, ids, cot, "reference")(x, gates, w1, w2)
  want = float64_layer(x, ids, gates, w1, w2, cot, T * K)
  errs = {n: rel_err(a, b) for n, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), (y, *grads), want)}
  with capsys.disabled():
    print(f"\nfp8 oracle vs float64, D={d} F={f} T={T} E={E} k={K}: " +
          ", ".join(f"{n} {e:.3f}" for n, e in errs.items()))
  for n, e in errs.items():
    assert FP8_ERROR_FLOOR < e < FP8_ERROR_BOUND, (n, e)


@pytest.mark.parametrize("axis_type,cf", [("auto", 0.5), pytest.param("explicit", None, marks=pytest.mark.slow),
                                          pytest.param("auto", None, marks=pytest.mark.slow),
                                          pytest.param("explicit", 0.5, marks=pytest.mark.slow)])
def test_xla_matches_the_oracle(axis_type, cf):
  """The two impls quantize the same rows with the same tiles (each expert's rows in the global slot order), so
  they differ only by float32 rounding in the GEMMs (and, rarely, one e4m3 step where that crosses a boundary)."""
  mesh = mesh_of(4, axis_type)
  x, ids, gates, w1, w2 = layer_inputs(T, 128, 128, E, K, "skewed", 3, dtype=jnp.bfloat16)
  w1, w2 = w1.astype(jnp.float32), w2.astype(jnp.float32)            # master weights
  cot = jnp.asarray(np.random.default_rng(4).standard_normal((T, 128)).astype(np.float32))
  if axis_type == "explicit":
    x = jax.device_put(x, NamedSharding(mesh, P("expert")))
    w1, w2 = (jax.device_put(w, NamedSharding(mesh, P("expert"))) for w in (w1, w2))
  (_, y), g = grads_fn(mesh, ids, cot, "xla", cf=cf)(x, gates, w1, w2)
  (_, y_ref), g_ref = grads_fn(mesh, ids, cot, "reference", cf=cf)(x, gates, w1, w2)
  assert y.dtype == jnp.bfloat16 and g[0].dtype == jnp.bfloat16 and g[2].dtype == jnp.float32
  if axis_type == "explicit":
    assert y.sharding.is_equivalent_to(x.sharding, 2)
  assert rel_err(y, y_ref) < 1e-3
  for a, b in zip(g, g_ref):
    assert float(jnp.max(jnp.abs(b))) > 0
    assert rel_err(a, b) < 1e-3
  if cf is not None:   # dropped slots: zero gate gradient in both
    kept = np.asarray(kept_mask(ids, E, plan_lib.expert_capacity(T // 4, 4, K, E, cf), 4))
    assert (~kept).any()
    np.testing.assert_array_equal(np.asarray(g[1])[~kept], 0.0)


@pytest.mark.parametrize("axis_type", ["auto", pytest.param("explicit", marks=pytest.mark.slow)])
def test_collective_matches_xla(axis_type, capsys):
  """impl="collective" runs the recipe on the FP8 grouped GEMM's quantized operands (on CPU its emulation, ffi/cpu/
  grouped_gemm.cc), impl="xla" on dequantized operands with ragged_dot: the same quantized operands, so they differ
  by float32 rounding in the row GEMMs (and, rarely, one e4m3 step where that crosses a boundary) and in the
  gradients also by the wgrad operands' rounding to bfloat16 (KERNELS has no FP8 outer GEMM: at most 2^-9 per
  element). Both stay within the FP8 error bound of the float64 layer."""
  mesh = mesh_of(4, axis_type)
  x, ids, gates, w1, w2 = layer_inputs(T, 128, 128, E, K, "skewed", 6, dtype=jnp.bfloat16)
  w1, w2 = w1.astype(jnp.float32), w2.astype(jnp.float32)
  cot = np.random.default_rng(7).standard_normal((T, 128)).astype(np.float32)
  if axis_type == "explicit":
    x = jax.device_put(x, NamedSharding(mesh, P("expert")))
    w1, w2 = (jax.device_put(w, NamedSharding(mesh, P("expert"))) for w in (w1, w2))
  (_, y), g = grads_fn(mesh, ids, jnp.asarray(cot), "collective")(x, gates, w1, w2)
  (_, y_xla), g_xla = grads_fn(mesh, ids, jnp.asarray(cot), "xla")(x, gates, w1, w2)
  assert y.dtype == jnp.bfloat16 and g[0].dtype == jnp.bfloat16 and g[2].dtype == jnp.float32
  names = ("y", "dx", "dgates", "dw1", "dw2")
  close = {n: rel_err(a, b) for n, a, b in zip(names, (y, *g), (y_xla, *g_xla))}
  want = float64_layer(x, ids, gates, w1, w2, cot, T * K)
  errs = {n: rel_err(a, b) for n, a, b in zip(names, (y, *g), want)}
  with capsys.disabled():
    print(f"\nfp8 collective ({axis_type}): vs xla " + ", ".join(f"{n} {e:.1e}" for n, e in close.items()) +
          "; vs float64 " + ", ".join(f"{n} {e:.3f}" for n, e in errs.items()))
  for n in names:
    assert close[n] < 1e-2, (n, close[n])
    assert FP8_ERROR_FLOOR < errs[n] < FP8_ERROR_BOUND, (n, errs[n])
  assert close["y"] < 1e-3


def test_collective_runs_the_fp8_custom_call():
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(T, 128, 128, E, K, "balanced", 0)
  cot = jnp.ones((T, 128), jnp.float32)
  text = grads_fn(mesh, ids, cot, "collective").lower(x, gates, w1, w2).as_text()
  assert text.count("jmo_grouped_matmul_swiglu_fp8") == 1, "GEMM1 with h quantized for GEMM2 and a for the backward"
  assert text.count("jmo_grouped_matmul_fp8") == 3, "GEMM2 and the two dgrads"
  assert text.count("jmo_grouped_outer_fp8") == 2, "the two wgrads"
  assert text.count("jmo_quantize_columns_fp8") == 2, "x and dy, quantized into the wgrads' layout by the call"
  assert text.count("jmo_swiglu_backward_fp8") == 1, "h and da, in every layout the backward reads, by one call"
  assert "jmo_swiglu_forward_fp8" not in text, "in GEMM1's epilogue on CPUs"
  # Every GEMM of the program is an FP8 custom call: no dot is left, and no bf16 grouped_outer.
  assert "dot_general" not in text and "@jmo_grouped_outer(" not in text


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
def test_deterministic():
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(T, 128, 128, E, K, "balanced", 5, dtype=jnp.bfloat16)
  cot = jnp.ones((T, 128), jnp.float32)
  f = grads_fn(mesh, ids, cot, "xla")
  a, b = f(x, gates, w1, w2), f(x, gates, w1, w2)
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.slow  # test_reference keeps the dense oracle's non-finite token check in the default pass
def test_a_non_finite_token_reaches_only_its_experts_weight_gradients():
  """A NaN in one token's x gives NaN in its own row of dx and in the weight gradients of its own experts only, in
  the oracle as in the xla impl (the oracle's grouped products select each expert's rows rather than multiplying a
  0/1 mask: 0 * NaN is NaN)."""
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(T, 128, 128, E, K, "balanced", 8)
  x = x.at[3, 5].set(jnp.nan)
  cot = jnp.ones((T, 128), jnp.float32)
  own = sorted(int(e) for e in np.asarray(ids)[3])
  for impl in ("reference", "xla"):
    _, (dx, _, dw1, dw2) = grads_fn(mesh, ids, cot, impl)(x, gates, w1, w2)
    assert np.flatnonzero(np.isnan(np.asarray(dx)).any(1)).tolist() == [3], impl
    for dw in (dw1, dw2):
      assert np.flatnonzero(np.isnan(np.asarray(dw)).any((1, 2))).tolist() == own, impl


@pytest.mark.slow  # the default pass keeps the recipe, oracle and xla checks
@pytest.mark.parametrize("axis_type,impls", [("explicit", ("xla",)), ("auto", ("xla", "reference"))])
def test_prequantized_weights_equal_per_call_quantization(axis_type, impls):
  mesh = mesh_of(4, axis_type)
  x, ids, gates, w1, w2 = layer_inputs(T, 128, 128, E, K, "skewed", 6, dtype=jnp.bfloat16)
  x = jax.device_put(x, NamedSharding(mesh, P("expert")))
  w1, w2 = (jax.device_put(w.astype(jnp.float32), NamedSharding(mesh, P("expert"))) for w in (w1, w2))
  q1, q2 = jax.jit(jmo.quantize_weights)(w1, w2)
  for q in (q1, q2):
    for leaf in (q.values, q.scales):
      assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, P("expert")), 3)
      assert {s.data.shape[0] for s in leaf.addressable_shards} == {E // 4}
  for impl in impls:
    run = jax.jit(lambda x, w1, w2, impl=impl: jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl=impl,
                                                               quantization="fp8")[0])
    np.testing.assert_array_equal(np.asarray(run(x, q1, q2), np.float32), np.asarray(run(x, w1, w2), np.float32))
    # The input gradient flows; a gradient with respect to the pre-quantized weights is refused.
    dx = jax.jit(jax.grad(lambda x, q1: jnp.sum(run(x, q1, q2).astype(jnp.float32))))(x, q1)
    dx_master = jax.jit(jax.grad(lambda x: jnp.sum(run(x, w1, w2).astype(jnp.float32))))(x)
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx_master, np.float32))
    with pytest.raises(ValueError, match="gradients with respect to a pre-quantized Fp8Weight"):
      jax.grad(lambda x, q1: jnp.sum(run(x, q1, q2).astype(jnp.float32)), argnums=(0, 1))(x, q1)


@pytest.mark.slow  # the default pass keeps the recipe, oracle and xla checks
@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_module_xla_matches_reference(axis_type):
  mesh = mesh_of(4, axis_type)
  cfg = moe_config(emb_dim=128, moe_mlp_dim=128, num_experts=8, num_experts_per_tok=2, dtype=jnp.bfloat16,
                   quantization="fp8", shared_experts=1)
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 16, 128)).astype(jnp.bfloat16)

  def loss(m, x):
    y, aux = m(x)
    return jnp.sum(jnp.sin(y.astype(jnp.float32))) + 0.1 * aux.load_balance_loss

  forward = nnx.jit(lambda m, x: m(x)[0])
  res, y = {}, {}
  for impl in ("xla", "reference"):
    m = jmo.MoE(cfg, mesh=mesh, impl=impl, rngs=nnx.Rngs(0))
    res[impl] = nnx.jit(lambda m, x: nnx.value_and_grad(loss)(m, x))(m, x)
    y[impl] = forward(m, x)
  (v, g), (v_ref, g_ref) = res["xla"], res["reference"]
  assert y["xla"].dtype == jnp.bfloat16 and y["xla"].shape == x.shape
  assert rel_err(y["xla"], y["reference"]) < 1e-2
  assert abs(float(v) - float(v_ref)) < 1e-2 * abs(float(v_ref))
  for name in ("router", "w1", "w2", "shared_w1"):
    assert g[name][...].dtype == jnp.float32                       # the master weights' dtype
    assert float(jnp.max(jnp.abs(g_ref[name][...]))) > 0, name
    assert rel_err(g[name][...], g_ref[name][...]) < 1e-2, name
  # The FP8 layer differs from the unquantized one by the quantization, no more.
  m = jmo.MoE(jmo.MoEConfig(**{**cfg.__dict__, "quantization": None}), mesh=mesh, impl="xla", rngs=nnx.Rngs(0))
  assert FP8_ERROR_FLOOR < rel_err(y["xla"], forward(m, x)) < FP8_ERROR_BOUND


def test_fp8_needs_multiples_of_128():
  with pytest.raises(ValueError, match=r"d_model \(emb_dim\) and d_ff \(moe_mlp_dim\) must be multiples of 128, "
                                       r"got d_model=64, d_ff=128"):
    jmo.MoEConfig(emb_dim=64, moe_mlp_dim=128, num_experts=8, num_experts_per_tok=2, quantization="fp8")
  x, ids, gates, w1, w2 = layer_inputs(T, 128, 96, E, K, "balanced", 0)
  with pytest.raises(ValueError, match=r"multiples of 128, got d_model=128, d_ff=96"):
    jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh_of(4), impl="xla", quantization="fp8")


def test_refusals():
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(T, 128, 128, E, K, "balanced", 0)
  with pytest.raises(ValueError,
                     match=r"quantization must be None \(no quantization\), 'fp8' or 'fp8_bf16_wgrad', got 'int8'"):
    jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl="xla", quantization="int8")
  with pytest.raises(ValueError, match=r"quantization must be None"):
    jmo.MoEConfig(emb_dim=128, moe_mlp_dim=128, num_experts=8, num_experts_per_tok=2, quantization="e4m3")
  q1, q2 = jmo.quantize_weights(w1, w2)
  with pytest.raises(TypeError, match=r"w1 is a pre-quantized Fp8Weight, which only the FP8 quantizations take"):
    jmo.moe_experts(x, ids, gates, q1, w2, mesh=mesh, impl="xla")
  bad = jmo.Fp8Weight(q1.values.astype(jnp.bfloat16), q1.scales)
  with pytest.raises(TypeError, match=r"an Fp8Weight holds float8_e4m3fn values \[E, N, K\]"):
    jmo.moe_experts(x, ids, gates, bad, q2, mesh=mesh, impl="xla", quantization="fp8")
  with pytest.raises(ValueError, match=r"weight shapes w1 \(8, 128, 256\), w2 \(8, 128, 256\) do not fit"):
    jmo.moe_experts(x, ids, gates, q1, jmo.quantize_weights(w1, w1)[1], mesh=mesh, impl="xla", quantization="fp8")
  # An Fp8Weight restored as a dict of its arrays (orbax without a target), or nothing at all.
  for w in ({"values": q1.values, "scales": q1.scales}, None):
    with pytest.raises(TypeError, match=r"w1 must be an array or an Fp8Weight, got"):
      jmo.moe_experts(x, ids, gates, w, q2, mesh=mesh, impl="xla", quantization="fp8")


def test_quantize_weights_takes_the_layers_weights_only():
  """quantize_weights holds its weights to moe_experts' FP8 rules where it is called, naming them: float32 or
  bfloat16 master weights, w1 [E, D, 2F] and w2 [E, F, D] that fit each other, D and F multiples of 128 (rather
  than a tile error about an axis of 2F, or an Fp8Weight that no call takes)."""
  x, ids, gates, w1, w2 = layer_inputs(T, 128, 128, E, K, "balanced", 0)
  with pytest.raises(TypeError, match=r"quantize_weights: w1 is float16: quantization='fp8' quantizes the master "
                                      r"weights in it; supported: float32, bfloat16"):
    jmo.quantize_weights(w1.astype(jnp.float16), w2)
  with pytest.raises(ValueError, match=r"weight shapes w1 \(8, 128, 128\), w2 \(8, 128, 256\) do not fit d_model=128"):
    jmo.quantize_weights(w2, w1)
  _, _, _, w1_96, w2_96 = layer_inputs(T, 128, 96, E, K, "balanced", 0)
  with pytest.raises(ValueError, match=r"d_model \(emb_dim\) and d_ff \(moe_mlp_dim\) must be multiples of 128, "
                                       r"got d_model=128, d_ff=96"):
    jmo.quantize_weights(w1_96, w2_96)


def test_gradients_through_quantize_weights_are_refused():
  """moe_experts gives pre-quantized weights zero cotangents, so differentiating the master weights through
  quantize_weights would give zeros: refused, naming the way to train. A gradient with respect to x only, the
  weights quantized inside the differentiated function, flows as usual."""
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(T, 128, 128, E, K, "balanced", 0)

  def loss(x, w1):
    y, _ = jmo.moe_experts(x, ids, gates, *jmo.quantize_weights(w1, w2), mesh=mesh, impl="xla", quantization="fp8")
    return jnp.sum(y)
  with pytest.raises(ValueError, match=r"quantize_weights is for inference: moe_experts gives pre-quantized weights "
                                       r"zero cotangents.* pass the master weights with quantization='fp8'"):
    jax.grad(loss, argnums=1)(x, w1)
  dx = jax.jit(jax.grad(loss))(x, w1)
  assert float(jnp.max(jnp.abs(dx))) > 0
  # Differentiating with respect to the Fp8Weights themselves: refused too (their scales enter y, so the zero
  # cotangent would be a wrong gradient); x's gradient with them held fixed flows.
  q1, q2 = jmo.quantize_weights(w1, w2)

  def loss_q(x, q1):
    return jnp.sum(jmo.moe_experts(x, ids, gates, q1, q2, mesh=mesh, impl="xla", quantization="fp8")[0])
  with pytest.raises(ValueError, match=r"gradients with respect to a pre-quantized Fp8Weight are not computed"):
    jax.grad(loss_q, argnums=1)(x, q1)
  np.testing.assert_array_equal(jax.jit(jax.grad(loss_q))(x, q1), dx)


def test_module_refuses_prequantized_parameters_by_name():
  """A module's w1 or w2 set to an Fp8Weight is refused when the module is called, with the rule the checkpoint
  converters state (the parameters are the master weights), not an error about indexing an Fp8Weight."""
  cfg = moe_config(emb_dim=128, moe_mlp_dim=128, num_experts=8, num_experts_per_tok=2, quantization="fp8")
  m = jmo.MoE(cfg, mesh=mesh_of(4), impl="xla", rngs=nnx.Rngs(0))
  m.w2 = nnx.Param(jmo.quantize_weights(m.w1[...], m.w2[...])[1])
  with pytest.raises(TypeError, match=r"MoE: w2 is a pre-quantized Fp8Weight; MoE's parameters are the master "
                                      r"weights, float arrays"):
    m(jnp.ones((4, 16, 128), jnp.float32))


def test_prequantized_weight_layouts():
  """w1's Fp8Weight may be of its [E, D, 2, F] view (values [E, 2, F, D]: quantize_weights of the view, which keeps a
  tensor split): the call equals the whole form's bit for bit. 4-D values given for w2 are refused with the layout
  moe_experts takes, naming the argument, not a failed unpacking."""
  from jax_moe_overlap import tensor_parallel
  x, ids, gates, w1, w2 = layer_inputs(T, 128, 128, E, K, "balanced", 0)
  q1, q2 = jmo.quantize_weights(w1, w2)
  v1 = tensor_parallel.w1_view(q1)
  run = lambda a, b: jmo.moe_experts(x, ids, gates, a, b, mesh=mesh_of(4), impl="xla", quantization="fp8")[0]
  np.testing.assert_array_equal(np.asarray(run(v1, q2), np.float32), np.asarray(run(q1, q2), np.float32))
  with pytest.raises(TypeError, match=r"w2: an Fp8Weight holds float8_e4m3fn values \[E, N, K\] and float32 scales "
                                      r"\[E, N / 128, K / 128\] .* got float8_e4m3fn\[8, 2, 128, 128\] and "
                                      r"float32\[8, 2, 1, 1\]"):
    run(q1, v1)


def test_fp8_master_weights_must_be_float32_or_bfloat16():
  """The FP8 layer quantizes the master weights in weight_dtype (no cast to the compute dtype), and takes float32 or
  bfloat16 ones: MoEConfig refuses another weight_dtype under quantization when it is built, naming the field, as
  it refuses D or F off the 128 grid, not at the first call with an error about w1."""
  sizes = dict(emb_dim=128, moe_mlp_dim=128, num_experts=8, num_experts_per_tok=2)
  with pytest.raises(TypeError, match=r"MoEConfig.weight_dtype is float16: quantization='fp8' quantizes the master "
                                      r"weights in it; supported: float32, bfloat16"):
    jmo.MoEConfig(**sizes, weight_dtype=jnp.float16, quantization="fp8")
  jmo.MoEConfig(**sizes, weight_dtype=jnp.float16)                          # unquantized: cast to dtype per call
  jmo.MoEConfig(**sizes, weight_dtype=jnp.bfloat16, quantization="fp8_bf16_wgrad")


def test_gpu_without_fp8_tensor_cores_is_refused():
  """The device rule, on stand-in meshes of GPUs of compute capability 8.0, 8.9 and 9.0 (the test machines have no
  GPU): impl "collective" and "overlap" run the FP8 grouped GEMM, on Hopper only."""
  from jax_moe_overlap.checks import check_fp8_impl
  gpu = types.SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100",
                              __str__=lambda self: "cuda:0")
  mesh = types.SimpleNamespace(devices=np.array([gpu, gpu]))
  check_fp8_impl("xla", mesh)             # the emulation runs anywhere
  hopper = types.SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H200")
  ada = types.SimpleNamespace(platform="gpu", compute_capability="8.9", device_kind="NVIDIA L40S")
  for impl in ("collective", "overlap"):   # both run the FP8 grouped GEMM
    if _jmo.with_cuda:  # the FP8 grouped GEMM's device rule comes from the extension's CUDA build
      for device in (gpu, ada):
        with pytest.raises(ValueError, match=rf"impl='{impl}' runs the FP8 grouped GEMM: the FP8 grouped GEMM needs "
                                             r"Hopper FP8 tensor cores \(compute capability 9.x"):
          check_fp8_impl(impl, types.SimpleNamespace(devices=np.array([device])))
      check_fp8_impl(impl, types.SimpleNamespace(devices=np.array([hopper])))
    else:
      with pytest.raises(ValueError, match=rf"impl='{impl}' runs the FP8 grouped GEMM: this build of "
                                           r"jax_moe_overlap has no CUDA kernels"):
        check_fp8_impl(impl, types.SimpleNamespace(devices=np.array([hopper])))


def test_what_the_forward_keeps():
  """The recipe's residuals: per row x in e4m3 with its 1 x 128 scales and the SwiGLU input a likewise (D + 2F bytes
  and (D + 2F) / 32 bytes of scales), against x and a in bfloat16 (2 D + 4 F bytes: the preactivation kept in the
  compute dtype) of the unquantized expert MLP; and the quantized weights (one byte per element and a scale per
  128 x 128 block)."""
  M, D, F, G = 512, 256, 384, 4
  x = jax.ShapeDtypeStruct((M, D), jnp.bfloat16)
  w1, w2 = jax.ShapeDtypeStruct((G, D, 2 * F), jnp.float32), jax.ShapeDtypeStruct((G, F, D), jnp.float32)
  gs = jax.ShapeDtypeStruct((G,), jnp.int32)
  _, kept = jax.eval_shape(lambda *a: fp8_experts._fp8_expert_mlp_fwd(*a, fp8_experts.RAGGED), x, w1, w2, gs)
  nbytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(kept))
  weights = 3 * G * D * F * (1 + 4 / 128 ** 2)
  assert nbytes == M * (D + 2 * F) * (1 + 4 / 128) + weights + 4 * G
  from jax_moe_overlap import expert_gemms
  _, kept_bf16 = jax.eval_shape(expert_gemms._expert_mlp_fwd, x, w1.update(dtype=jnp.bfloat16),
                                w2.update(dtype=jnp.bfloat16), gs)
  rows_bf16 = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(kept_bf16)[:2])
  assert rows_bf16 == M * (2 * D + 4 * F)
