"""GEMM1 of the FP8 recipe with its SwiGLU forward in one custom call (grouped_gemm.grouped_matmul_swiglu_fp8,
jmo_grouped_matmul_swiglu_fp8) on its CPU handler:

- bit for bit the two calls it replaces, swiglu_forward_fp8(grouped_matmul_fp8(...)), on random e4m3 operands and
  scales: skewed and empty groups, group ends inside 128-row tiles, rows past the groups holding garbage (their
  outputs: zero values, scales 2^-126), F a multiple of 128 but not of 256, values that saturate e4m3 and non-finite
  accumulators;
- the refusals;
- the layer (moe_experts quantization="fp8", impl="collective"), whose KERNELS backend takes the fused call on CPUs,
  gives the bits of the same backend composing the two calls; its program holds the fused call on CPUs and the two
  calls on GPUs while fp8_experts.FUSED_GEMM1_SWIGLU_ON_GPU is off.
tests/gpu/test_gpu_grouped_matmul_swiglu_fp8.py holds the CUDA kernel to the two CUDA calls."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_moe_overlap as jmo
from cases import layer_inputs
from jax_moe_overlap import fp8, fp8_experts
from jax_moe_overlap.grouped_gemm import grouped_matmul_fp8, grouped_matmul_swiglu_fp8, swiglu_forward_fp8

CASES = [  # (M, K, F, group sizes)
    (70, 128, 128, [50, 0, 13]),              # F = 128 (not a multiple of 256); 7 rows past the groups
    (300, 256, 384, [1, 0, 200, 90]),         # skewed, an empty group, group ends inside tiles; F = 3 x 128
    (40, 128, 256, [0, 0]),                   # no rows at all: every row past the groups
]


def random_e4m3(rng, shape):
  """Random e4m3 bytes over the whole finite range (every exponent, both signs), NaN bytes (0x7F, 0xFF) excluded."""
  b = rng.integers(0, 256, shape, dtype=np.uint8)
  b[(b & 0x7F) == 0x7F] = 0x7E
  return b.view(ml_dtypes.float8_e4m3fn)


def operands(case, seed):
  """lhs [M, K], lhs scales [M, K/128] (magnitudes 2^-12 .. 2^-4 per tile), rhs [G, 2F, K], rhs scales
  [G, 2F/128, K/128] (2^-10 .. 2^-6 per block); the rows past the groups hold garbage that must not reach a
  stored value."""
  M, K, F, sizes = case
  rng = np.random.default_rng(seed)
  lq = random_e4m3(rng, (M, K))
  ls = np.exp2(rng.uniform(-12, -4, (M, K // 128))).astype(np.float32)
  rq = random_e4m3(rng, (len(sizes), 2 * F, K))
  rs = np.exp2(rng.uniform(-10, -6, (len(sizes), 2 * F // 128, K // 128))).astype(np.float32)
  ls[sum(sizes):] = 1e30       # garbage past the groups
  return lq, ls, rq, rs, np.asarray(sizes, np.int32)


def fused(lq, ls, rq, rs, sizes):
  return jax.jit(grouped_matmul_swiglu_fp8)(*map(jnp.asarray, (lq, ls, rq, rs, sizes)))


def composed(lq, ls, rq, rs, sizes):
  return jax.jit(lambda *a: swiglu_forward_fp8(grouped_matmul_fp8(*a)))(*map(jnp.asarray, (lq, ls, rq, rs, sizes)))


def bits(x):
  x = np.asarray(x)
  return x.view({1: np.uint8, 4: np.uint32}[x.dtype.itemsize])


def assert_bitwise(got, want):
  for what, g_rows, w_rows in zip(("h", "a"), got, want):
    for name, g, w in zip(("values", "scales"), g_rows, w_rows):
      assert g.shape == w.shape and g.dtype == w.dtype, (what, name, g.shape, w.shape)
      differ = int(np.count_nonzero(bits(g) != bits(w)))
      assert differ == 0, f"{what} {name}: {differ} of {bits(g).size} elements differ"


@pytest.mark.parametrize("case", CASES)
def test_bitwise_the_two_calls(case):
  M, K, F, sizes = case
  args = operands(case, seed=M + F)
  got = fused(*args)
  assert got[0][0].shape == (M, F) and got[0][0].dtype == fp8.E4M3 and got[0][1].shape == (M, F // 128)
  assert got[1][0].shape == (M, 2 * F) and got[1][0].dtype == fp8.E4M3 and got[1][1].shape == (M, 2 * F // 128)
  assert_bitwise(got, composed(*args))
  # Not vacuous: the groups' rows hold values; the rows past them zero bytes and scales 2^-126.
  live = int(sum(sizes))
  assert np.count_nonzero(bits(got[0][0])[:live]) >= 0.5 * live * F
  assert np.count_nonzero(bits(got[1][0])[:live]) >= 0.5 * live * 2 * F
  for q, s in got:
    assert not bits(q)[live:].any()
    np.testing.assert_array_equal(np.asarray(s)[live:], np.float32(fp8.SCALE_FLOOR))


@pytest.mark.parametrize("case", CASES[:2])
def test_without_a_the_same_h(case):
  """keep_a=False (inference: nothing differentiates GEMM1): a_rows None, no a in the program's results (the call's a
  results are empty), h bit for bit the call that keeps a."""
  args = tuple(map(jnp.asarray, operands(case, seed=7)))
  f = jax.jit(lambda *a: grouped_matmul_swiglu_fp8(*a, keep_a=False))
  h_rows, a_rows = f(*args)
  assert a_rows is None
  assert f"-> (tensor<{case[0]}x{case[2]}xf8E4M3FN>, tensor<{case[0]}x{case[2] // 128}xf32>, tensor<0x{2 * case[2]}x" \
      in f.lower(*args).as_text()  # (the call's results: h, then a's empty ones)
  assert_bitwise((h_rows,), (fused(*args)[0],))


def test_saturation_and_non_finite_accumulators():
  """Rows whose scales overflow the accumulators (inf and NaN in a, so in h and in the tiles' scales) and rows of
  one huge value per tile (the others then quantize to zero or a few steps, the amax to 448: e4m3's saturation
  point), bitwise the two calls."""
  M, K, F, sizes = 24, 256, 128, [10, 14]
  lq, ls, rq, rs, sizes = operands((M, K, F, sizes), seed=3)
  ls[0] = 3e38                                    # overflow: inf and NaN accumulators in row 0
  ls[1, 1] = np.inf                               # a non-finite scale in row 1
  lq[2:6] = np.asarray(0.0, ml_dtypes.float8_e4m3fn)
  lq[2:6, 5] = np.asarray(448.0, ml_dtypes.float8_e4m3fn)   # one value per row: a's tiles hold its products alone
  ls[2:6] = 2.0 ** 10
  got = fused(lq, ls, rq, rs, sizes)
  assert_bitwise(got, composed(lq, ls, rq, rs, sizes))
  a_s = np.asarray(got[1][1])
  assert not np.all(np.isfinite(a_s[0])) and not np.all(np.isfinite(a_s[1]))
  a_vals = np.abs(np.asarray(got[1][0], np.float32)[2:6])
  assert np.nanmax(a_vals) == 448.0


def test_refusals():
  lq, ls, rq, rs, sizes = operands((8, 128, 128, [8]), seed=1)
  with pytest.raises(TypeError, match=r"lhs and rhs must be float8_e4m3fn and their scales float32"):
    grouped_matmul_swiglu_fp8(jnp.asarray(lq, jnp.float32), ls, rq, rs, sizes)
  with pytest.raises(ValueError, match=r"F \(half of rhs's 384 channels\) must be a positive multiple of 128"):
    grouped_matmul_swiglu_fp8(lq, ls, np.zeros((1, 384, 128), ml_dtypes.float8_e4m3fn), np.ones((1, 3, 1),
                                                                                                 np.float32), sizes)
  with pytest.raises(ValueError, match=r"K and N must be positive multiples of 128 .* got K=64, N=256"):
    grouped_matmul_swiglu_fp8(lq[:, :64], ls, rq[:, :, :64], rs, sizes)
  with pytest.raises(ValueError, match=r"do not fit lhs \[M, K\], lhs_scales \[M, K/128\]"):
    grouped_matmul_swiglu_fp8(lq, ls[:4], rq, rs, sizes)
  with pytest.raises(Exception, match=r"grouped_matmul_swiglu_fp8: group 0 has 9 rows; group sizes must be >= 0"):
    jax.block_until_ready(fused(lq, ls, rq, rs, np.asarray([9], np.int32)))


def _layer_grads(mesh, ids, cot, args):
  def loss(x, gates, w1, w2):
    y, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl="collective", quantization="fp8")
    return jnp.sum(y.astype(jnp.float32) * cot), y
  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
  return f, f(*args)


@pytest.mark.slow  # the layer traced four times (two platforms, both switch settings) and run twice
def test_layer_bitwise_unchanged(monkeypatch):
  """moe_experts(quantization="fp8", impl="collective") with the fused GEMM1 (KERNELS on CPUs) against the same
  backend composing the two calls: the output and every gradient bit for bit."""
  mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices("cpu")[:2])
  x, ids, gates, w1, w2 = layer_inputs(64, 128, 128, 4, 2, "skewed", 4, dtype=jnp.bfloat16)
  cot = jnp.asarray(np.random.default_rng(5).standard_normal((64, 128)).astype(np.float32))
  args = (x, gates, w1, w2)
  f, with_fused = _layer_grads(mesh, ids, cot, args)
  text = f.lower(*args).as_text()
  assert text.count("jmo_grouped_matmul_swiglu_fp8") == 1 and text.count("jmo_swiglu_forward_fp8") == 0
  assert text.count("jmo_grouped_matmul_fp8") == 3, "GEMM2 and the two dgrads"
  for on in (True, False):  # GPUs take the fused call by FUSED_GEMM1_SWIGLU_ON_GPU, read when traced
    monkeypatch.setattr(fp8_experts, "FUSED_GEMM1_SWIGLU_ON_GPU", on)
    jax.clear_caches()
    for_gpu = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert for_gpu.count("jmo_grouped_matmul_swiglu_fp8") == on, on
    assert for_gpu.count("jmo_grouped_matmul_fp8") == 4 - on and for_gpu.count("jmo_swiglu_forward_fp8") == 1 - on
  monkeypatch.undo()
  monkeypatch.setitem(fp8_experts._GEMMS, ("kernels", "fp8"),
                      dataclasses.replace(fp8_experts.KERNELS, rows_swiglu=None))
  jax.clear_caches()  # the layer's inner traces, which read the backend when traced
  g, two_calls = _layer_grads(mesh, ids, cot, args)
  assert g.lower(*args).as_text().count("jmo_grouped_matmul_swiglu_fp8") == 0
  monkeypatch.undo()
  jax.clear_caches()  # no trace of the patched backend outlives the test
  for u, v in zip(jax.tree.leaves(with_fused), jax.tree.leaves(two_calls)):
    assert float(jnp.max(jnp.abs(u.astype(jnp.float32)))) > 0
    np.testing.assert_array_equal(bits(u.astype(jnp.float32)), bits(v.astype(jnp.float32)))


@pytest.mark.parametrize("impl", ["collective", "overlap"])
def test_layer_forward_alone_keeps_no_a(impl):
  """moe_experts(quantization="fp8") not differentiated (inference) runs GEMM1 without a (the call's a results
  empty; impl="overlap" with its dispatch unfused, on a mesh of two ranks), and its output is bit for bit the output
  of the differentiated program, which keeps a."""
  mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices("cpu")[:2])
  x, ids, gates, w1, w2 = layer_inputs(64, 128, 128, 4, 2, "skewed", 4, dtype=jnp.bfloat16)
  cot = jnp.asarray(np.random.default_rng(5).standard_normal((64, 128)).astype(np.float32))
  config = jmo.CallConfig()  # (dispatch_pushers 0: the library's choice, on CPUs the unfused dispatch under FP8)

  def forward(x, gates, w1, w2):
    return jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl=impl, quantization="fp8", config=config)[0]

  def loss(x, gates, w1, w2):
    y = forward(x, gates, w1, w2)
    return jnp.sum(y.astype(jnp.float32) * cot), y

  fwd = jax.jit(forward)
  calls = [l for l in fwd.lower(x, gates, w1, w2).as_text().splitlines() if "@jmo_grouped_matmul_swiglu_fp8(" in l]
  assert len(calls) == 1 and "tensor<0x256xf8E4M3FN>" in calls[0], calls
  y = fwd(x, gates, w1, w2)
  _, y_trained = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, gates, w1, w2)[0]
  assert float(jnp.max(jnp.abs(y.astype(jnp.float32)))) > 0
  np.testing.assert_array_equal(bits(y.astype(jnp.float32)), bits(y_trained.astype(jnp.float32)))


def test_expert_mlp_forward_alone_keeps_no_a():
  """fp8_experts.fp8_expert_mlp not differentiated: its GEMM1 call's a results empty, its output bit for bit the
  output of jax.vjp (the forward rule, which keeps a)."""
  M, K, F, sizes = 96, 128, 128, [40, 0, 50]
  rng = np.random.default_rng(11)
  x = jnp.asarray(rng.standard_normal((M, K)).astype(np.float32))
  w1 = jnp.asarray(rng.standard_normal((3, K, 2 * F)).astype(np.float32) / np.sqrt(K))
  w2 = jnp.asarray(rng.standard_normal((3, F, K)).astype(np.float32) / np.sqrt(F))
  gs = jnp.asarray(sizes, jnp.int32)
  mlp = jax.jit(lambda x, w1, w2: fp8_experts.fp8_expert_mlp(x, w1, w2, gs, fp8_experts.KERNELS))
  calls = [l for l in mlp.lower(x, w1, w2).as_text().splitlines() if "@jmo_grouped_matmul_swiglu_fp8(" in l]
  assert len(calls) == 1 and f"tensor<0x{2 * F}xf8E4M3FN>" in calls[0], calls
  y = mlp(x, w1, w2)
  y_vjp, _ = jax.jit(lambda x, w1, w2: jax.vjp(lambda *a: fp8_experts.fp8_expert_mlp(*a, gs, fp8_experts.KERNELS),
                                               x, w1, w2))(x, w1, w2)
  assert float(jnp.max(jnp.abs(y))) > 0
  np.testing.assert_array_equal(bits(y), bits(y_vjp))
