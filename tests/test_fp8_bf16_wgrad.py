"""quantization="fp8_bf16_wgrad" (fp8_experts.bf16_wgrad): the recipe's forward and dgrads, the two weight gradients on
bfloat16 operands. Its forward, dx and gate gradient equal quantization="fp8"'s bit for bit; its weight gradients stay
within the FP8 error bound of the float64 layer and closer to it than the FP8 wgrads; every impl gives the same
results (impl="overlap" bit for bit impl="collective"'s); impl="collective"'s program has no FP8 wgrad and no 128 x 1
quantization left."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe_overlap as jmo
from cases import layer_inputs, moe_config, rel_err
from test_fp8_exchange import bits
from test_fp8_layer import FP8_ERROR_BOUND, FP8_ERROR_FLOOR, float64_layer, grads_fn, mesh_of

E, K, T, D, F = 8, 2, 64, 128, 128
NAMES = ("y", "dx", "dgates", "dw1", "dw2")
BF16_WGRAD = "fp8_bf16_wgrad"


def inputs(seed, axis_type="auto"):
  mesh = mesh_of(4, axis_type)
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, K, "skewed", seed, dtype=jnp.bfloat16)
  w1, w2 = w1.astype(jnp.float32), w2.astype(jnp.float32)
  cot = np.random.default_rng(seed + 1).standard_normal((T, D)).astype(np.float32)
  if axis_type == "explicit":
    x = jax.device_put(x, NamedSharding(mesh, P("expert")))
    w1, w2 = (jax.device_put(w, NamedSharding(mesh, P("expert"))) for w in (w1, w2))
  return mesh, x, ids, gates, w1, w2, cot


def run(mesh, ids, cot, impl, quantization, args, cf=None):
  (_, y), g = grads_fn(mesh, ids, jnp.asarray(cot), impl, quantization, cf)(*args)
  return (y, *g)


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
def test_only_the_weight_gradients_change():
  """impl="xla" (the recipe's XLA backend): y, dx and dgates are "fp8"'s bits; dw1 and dw2 are within the FP8 bound
  of the float64 layer and nearer to it than "fp8"'s (their operands lose 2^-9 to bfloat16, not 2^-4 to e4m3)."""
  mesh, x, ids, gates, w1, w2, cot = inputs(3)
  got = run(mesh, ids, cot, "xla", BF16_WGRAD, (x, gates, w1, w2))
  fp8 = run(mesh, ids, cot, "xla", "fp8", (x, gates, w1, w2))
  for n, a, b in zip(NAMES[:3], got, fp8):
    np.testing.assert_array_equal(bits(a), bits(b), err_msg=n)
  assert got[3].dtype == got[4].dtype == jnp.float32
  want = float64_layer(x, ids, gates, w1, w2, cot, T * K)
  for i in (3, 4):
    ours, theirs = rel_err(got[i], want[i]), rel_err(fp8[i], want[i])
    assert rel_err(got[i], fp8[i]) > FP8_ERROR_FLOOR, NAMES[i]
    assert ours < theirs < FP8_ERROR_BOUND, (NAMES[i], ours, theirs)


@pytest.mark.parametrize("axis_type", ["auto", pytest.param("explicit", marks=pytest.mark.slow)])
def test_collective_matches_xla(axis_type):
  """impl="collective" (the FP8 grouped GEMM's emulation, the wgrads by the bfloat16 grouped outer product) against
  impl="xla": the same operands, float32 rounding apart."""
  mesh, x, ids, gates, w1, w2, cot = inputs(6, axis_type)
  got = run(mesh, ids, cot, "collective", BF16_WGRAD, (x, gates, w1, w2))
  want = run(mesh, ids, cot, "xla", BF16_WGRAD, (x, gates, w1, w2))
  wide = float64_layer(x, ids, gates, w1, w2, cot, T * K)
  if axis_type == "explicit":
    assert jax.typeof(got[0]).sharding.spec == jax.typeof(x).sharding.spec
  for n, a, b, c in zip(NAMES, got, want, wide):
    assert float(jnp.max(jnp.abs(b.astype(jnp.float32)))) > 0, n
    assert rel_err(a, b) < 1e-2, (n, rel_err(a, b))
    assert FP8_ERROR_FLOOR < rel_err(a, c) < FP8_ERROR_BOUND, (n, rel_err(a, c))
  assert rel_err(got[0], want[0]) < 1e-3


def test_collective_program_has_no_fp8_wgrad():
  mesh, x, ids, gates, w1, w2, cot = inputs(0)
  text = grads_fn(mesh, ids, jnp.asarray(cot), "collective", BF16_WGRAD).lower(x, gates, w1, w2).as_text()
  assert text.count("jmo_grouped_matmul_swiglu_fp8") == 1, "GEMM1 with the SwiGLU forward (CPUs: fused)"
  assert text.count("jmo_grouped_matmul_fp8") == 3, "GEMM2 and the two dgrads in FP8"
  for gone in ("jmo_grouped_outer_fp8", "jmo_quantize_columns_fp8", "jmo_swiglu_backward_fp8"):
    assert gone not in text, gone


@pytest.mark.slow
def test_overlap_and_reference():
  """impl="overlap" gives impl="collective"'s bits (the same quantized rows, another transport); impl="reference"
  (dense float32 GEMMs) agrees with impl="xla" to float32 rounding."""
  mesh, x, ids, gates, w1, w2, cot = inputs(9)
  args = (x, gates, w1, w2)
  overlap, collective = (run(mesh, ids, cot, i, BF16_WGRAD, args, cf=0.75) for i in ("overlap", "collective"))
  for n, a, b in zip(NAMES, overlap, collective):
    np.testing.assert_array_equal(bits(a), bits(b), err_msg=n)
  reference, xla = (run(mesh, ids, cot, i, BF16_WGRAD, args, cf=0.75) for i in ("reference", "xla"))
  for n, a, b in zip(NAMES, reference, xla):
    assert rel_err(a, b) < 1e-3, (n, rel_err(a, b))


@pytest.mark.slow
def test_module_on_the_default_impl():
  """MoE with quantization="fp8_bf16_wgrad" and no impl given (impl="overlap") equals impl="collective" bit for bit,
  its output and parameter gradients."""
  cfg = moe_config(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=K, quantization=BF16_WGRAD,
                   dtype=jnp.bfloat16, capacity_factor=1.0)
  x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 32, D)).astype(np.float32)).astype(jnp.bfloat16)

  def grads(impl):
    kw = {} if impl is None else dict(impl=impl)
    m = jmo.MoE(cfg, mesh=mesh_of(4), rngs=nnx.Rngs(0), **kw)
    loss = lambda m, x: jnp.sum(jnp.sin(m(x)[0].astype(jnp.float32)))
    return nnx.jit(nnx.value_and_grad(loss))(m, x)

  for a, b in zip(jax.tree.leaves(grads(None)), jax.tree.leaves(grads("collective"))):
    assert float(jnp.max(jnp.abs(b.astype(jnp.float32)))) > 0
    np.testing.assert_array_equal(bits(a), bits(b))
