"""The expert weights' quantizer (grouped_gemm.quantize_weight_fp8, the custom call jmo_quantize_weight_fp8) on its CPU
handler: transposed, fp8.quantize_weight; not transposed, fp8.transpose_weight(fp8.quantize_weight(w)), the
dgrads' weights. Held bit for bit to the NumPy twin of fp8.py's rule (fp8_numpy.blocks: IEEE division x / s, as the
handler and the kernel divide) and to XLA's fp8.quantize_weight, which XLA:CPU compiles into x * (1 / s) (its
simplifier rewrites a division by a broadcast into a multiplication by the broadcast reciprocal): where that product
and the quotient round to different e4m3 bytes (x / s within a float32 ulp of a midpoint between two e4m3 values, a
few bytes in 10^5 of random data), XLA's byte must be the product's and the call's the quotient's, and nowhere else
may they differ. On e4m3's rounding ties, saturation, zero and negative-zero blocks, subnormals, NaN and infinities,
whose blocks take scales that are powers of two (x / s and x * (1 / s) then agree), bit for bit. float32 and bfloat16
weights, several E, K != N; both layouts from one call (quantize_weight_fp8_pair) bit for bit the two calls; the
refusals; the recipe (moe_experts, quantization="fp8", impl="collective") with the call bit for bit the recipe with
XLA's quantizer, switches on or off, and what its forward keeps.
tests/gpu/test_gpu_quantize_weight_fp8.py holds the CUDA kernel to the same bits."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fp8_numpy
from jax_moe_overlap import fp8, fp8_experts
from jax_moe_overlap.grouped_gemm import QUANTIZE_WEIGHT_FP8, quantize_weight_fp8, quantize_weight_fp8_pair
from test_fp8_layer import grads_fn, mesh_of
from test_quantize_columns_fp8 import _e4m3_cases
from cases import layer_inputs

SHAPES = [(1, 128, 128), (3, 256, 384), (2, 384, 128)]


def weights(shape, dtype, seed):
  """[E, K, N] of very different magnitudes from block to block and within a block (many scales, some blocks whose
  amax lies far above most of their values)."""
  rng = np.random.default_rng(seed)
  w = rng.standard_normal(shape) * np.exp2(rng.integers(-8, 3, shape))
  E, K, N = shape
  w = w.reshape(E, K // 128, 128, N // 128, 128) * np.exp2(rng.integers(-20, 21, (E, K // 128, 1, N // 128, 1)))
  return jnp.asarray(w.reshape(shape).astype(np.float32), dtype)


def bits(a):
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def call(w, transposed=True):
  return jax.jit(lambda w: quantize_weight_fp8(w, transposed=transposed))(w)


def xla(w, transposed=True):
  return jax.jit(lambda w: fp8_experts.xla_quantize_weight(w, transposed))(w)


def twin(w, transposed=True):
  """fp8_numpy.blocks of W^T (transposed) or of W: (q bytes, s)."""
  w32 = np.asarray(jnp.asarray(w, jnp.float32))
  q, s = fp8_numpy.blocks(np.swapaxes(w32, -1, -2) if transposed else w32)
  return q.view(np.uint8), s


def reciprocal_explained(got, want, w, transposed):
  """The bytes where the call's values `got` differ from XLA:CPU's `want` (both Fp8Weight): each must be e4m3(x / s)
  in the call and e4m3(x * float32(1 / s)) in XLA's. Returns their count."""
  q, gq = bits(got.values), bits(want.values)
  diff = np.argwhere(q != gq)
  w32 = np.asarray(jnp.asarray(w, jnp.float32))
  x_all = np.swapaxes(w32, -1, -2) if transposed else w32
  s_all = np.asarray(got.scales)
  for e, r, c in diff:
    x, s = x_all[e, r, c], s_all[e, r // 128, c // 128]
    quotient = np.clip(np.float32(x) / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    product = np.clip(np.float32(x) * (np.float32(1) / s), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert q[e, r, c] == quotient and gq[e, r, c] == product, (
        f"[{e}, {r}, {c}]: x={x!r}, s={s!r}: call {q[e, r, c]:#04x}, XLA {gq[e, r, c]:#04x}, x / s -> {quotient:#04x}, "
        f"x * (1 / s) -> {product:#04x}")
  return len(diff)


def assert_matches(w, transposed, twin_too=True):
  got, want = call(w, transposed), xla(w, transposed)
  E, K, N = w.shape
  rows, cols = (N, K) if transposed else (K, N)
  assert got.values.dtype == fp8.E4M3 and got.values.shape == (E, rows, cols) == want.values.shape
  assert got.scales.dtype == jnp.float32 and got.scales.shape == (E, rows // 128, cols // 128) == want.scales.shape
  np.testing.assert_array_equal(bits(got.scales), bits(want.scales))
  differing = reciprocal_explained(got, want, w, transposed)
  if twin_too:
    q, s = twin(w, transposed)
    np.testing.assert_array_equal(bits(got.values), q)
    np.testing.assert_array_equal(bits(got.scales), bits(s))
  return got, differing


# Each shape once in the default pass, each dtype and each layout among them (every case checks both layouts against
# each other); the other nine cases in the slow pass.
DEFAULT_WEIGHT_CASES = {(True, "float32", 0), (False, "bfloat16", 1), (True, "bfloat16", 2)}


@pytest.mark.parametrize("transposed,dtype,shape", [
    pytest.param(t, dtype, shape, id=f"{'transposed' if t else 'w_layout'}-{jnp.dtype(dtype).name}-shape{i}",
                 marks=() if (t, jnp.dtype(dtype).name, i) in DEFAULT_WEIGHT_CASES else pytest.mark.slow)
    for t in (True, False) for dtype in (jnp.float32, jnp.bfloat16) for i, shape in enumerate(SHAPES)])
def test_equals_quantize_weight_and_its_transpose(shape, dtype, transposed):
  w = weights(shape, dtype, seed=sum(shape))
  got, differing = assert_matches(w, transposed)
  assert differing <= 1e-4 * got.values.size
  assert np.count_nonzero(bits(got.values)) > 0.5 * got.values.size      # not vacuous: values are there
  assert len(np.unique(bits(got.scales))) > 0.5 * got.scales.size        # and many scales
  # The two forms are each other's transpose, bit for bit.
  other = call(w, not transposed)
  np.testing.assert_array_equal(bits(got.values), np.swapaxes(bits(other.values), 1, 2))
  np.testing.assert_array_equal(bits(got.scales), np.swapaxes(bits(other.scales), 1, 2))


def test_xla_cpu_differs_where_its_reciprocal_does():
  """The reason the comparisons with XLA allow explained bytes: on these weights XLA:CPU's x * (1 / s) and the call's
  x / s part somewhere (so reciprocal_explained is exercised), while the twin, which divides, equals the call."""
  w = weights((3, 256, 384), jnp.bfloat16, seed=0)
  _, differing = assert_matches(w, True)
  assert differing > 0


def test_no_quotient_of_a_finite_block_exceeds_448():
  """Why the saturation (the clip at 448) is never reached by a finite block's values: r = float32(1 / 448) lies
  above 1 / 448, so s = float32(amax * r) >= amax / 448 for every amax (here 10^5 of them, s * 448 exact in
  float64), and |x| / s <= 448. The edge blocks check the top of the range: quotients in (432, 448] give 448."""
  rng = np.random.default_rng(4)
  a = (rng.uniform(1, 2, 100_000) * np.exp2(rng.integers(-100, 100, 100_000))).astype(np.float32)
  s = (a * fp8.E4M3_MAX_INV).astype(np.float32)
  assert np.all(s.astype(np.float64) * 448 >= a.astype(np.float64))


def edge_weights():
  """w [2, 256, 384] float32 of 12 blocks: (e, kb, nb) block i. Blocks 0-5: every e4m3 value, the midpoints between
  neighbours and the float32 next to each, e4m3 and float32 subnormals, signed zeros, times 2^k, with one value
  447.99997 * 2^k, so that the block's scale is exactly 2^k; block 6 all zeros (scale 2^-126); block 7 all negative
  zeros; block 8 the top of e4m3's range: 447.99997 * 8 (scale 8) and values below it down to the midpoint between
  416 and 448 (quotients in [432, 448)), both signs, among random powers of two; block 9 a NaN among random values;
  block 10 +inf, -inf and random values; block 11 float32 subnormals only (scale 2^-126)."""
  w = np.zeros((2, 2, 128, 3, 128), np.float32)
  blocks = [w[e, kb, :, nb, :] for e in range(2) for kb in range(2) for nb in range(3)]
  cases = _e4m3_cases()
  rng = np.random.default_rng(3)
  for i, k in enumerate([0, -3, 5, -20, 17, -60]):
    b = np.resize(cases, 128 * 128).reshape(128, 128)
    b[rng.integers(0, 128), rng.integers(0, 128)] = np.float32(447.99997)
    blocks[i][...] = b * np.float32(2.0 ** k)
  blocks[7][...] = -0.0
  for i in (8, 9, 10):
    blocks[i][...] = np.exp2(rng.integers(-20, 2, (128, 128))).astype(np.float32)   # powers of two: exact quotients
  top = np.float32(8) * np.linspace(432, 447.99997, 200, dtype=np.float32)
  blocks[8][:4, :100] = np.concatenate([top, -top]).reshape(4, 100)
  blocks[8][4, 0] = np.float32(447.99997 * 8)
  blocks[9][17, 40] = np.nan
  blocks[10][3, 5], blocks[10][100, 127], blocks[10][64, 64] = np.inf, -np.inf, np.inf
  blocks[11][...] = np.float32(2.0 ** -140) * rng.integers(-50, 50, (128, 128)).astype(np.float32)
  return w.reshape(2, 256, 384)


@pytest.mark.parametrize("transposed", [True, False], ids=["transposed", "w_layout"])
def test_rounding_ties_saturation_zeros_subnormals_and_non_finite(transposed):
  """The edge blocks (edge_weights) bit for bit the twin's, and XLA's quantize_weight's (every byte: their quotients
  are exact either way), but for two blocks. Block 11 against XLA only: XLA:CPU runs its programs, and the custom
  calls it holds, with float32 subnormals flushed to zero (the twin does not), so those subnormals quantize to zero
  bytes here, as XLA:CPU's own quantizer makes them (on GPUs neither flushes: the GPU test compares the kernel with
  XLA:GPU there). Block 9 (a NaN) by fp8.py's rule, which the call, the twin and XLA's quantize_weight keep: a NaN
  makes its block's scale NaN and every value of the block NaN."""
  w = edge_weights()
  got, want = call(jnp.asarray(w), transposed), xla(jnp.asarray(w), transposed)
  q_twin, s_twin = twin(w, transposed)
  in_w_layout = (lambda a: a) if not transposed else (lambda a: np.swapaxes(a, 1, 2))

  def by_block(a):  # [E, K, N] or its scales [E, K / 128, N / 128] -> edge_weights' block order
    if a.shape[-1] == 3:
      return a.reshape(12)
    return a.reshape(2, 2, 128, 3, 128).transpose(0, 1, 3, 2, 4).reshape(12, 128, 128)

  qb, wb = by_block(in_w_layout(bits(got.values))), by_block(w)
  sb = by_block(in_w_layout(bits(got.scales)))
  not_subnormal = np.arange(12) != 11
  np.testing.assert_array_equal(qb, by_block(in_w_layout(bits(want.values))))
  np.testing.assert_array_equal(sb, by_block(in_w_layout(bits(want.scales))))
  np.testing.assert_array_equal(qb[not_subnormal], by_block(in_w_layout(q_twin))[not_subnormal])
  np.testing.assert_array_equal(sb, by_block(in_w_layout(bits(s_twin))))
  scales = sb.view(np.float32)
  np.testing.assert_array_equal(scales[:6], np.exp2([0, -3, 5, -20, 17, -60]).astype(np.float32))
  assert scales[6] == scales[7] == scales[11] == np.float32(fp8.SCALE_FLOOR)
  assert np.isnan(scales[9]) and np.isinf(scales[10]) and np.all(np.isfinite(np.delete(scales, [9, 10])))
  # The rule's outcomes, block by block.
  grid = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  mids = (grid[:-1] + grid[1:]) / 2
  for i, k in enumerate([0, -3, 5, -20, 17, -60]):
    at_mid = np.isin(np.abs(wb[i]), mids * np.float32(2.0 ** k))
    assert at_mid.sum() > 100 and np.all(qb[i][at_mid] % 2 == 0)        # ties go to the even neighbour
  assert not qb[6].any() and np.all(qb[7] == 0x80)                       # zeros; negative zeros keep their sign
  top = np.abs(wb[8]) >= 432 * 8
  assert top.sum() == 401 and np.all((qb[8][top] & 0x7F) == 0x7E)        # the top of the range: 448, never NaN
  assert np.all((qb[9] & 0x7F) == 0x7F)                                   # a NaN makes its block NaN
  finite = np.isfinite(wb[10])
  assert np.all((qb[10][finite] & 0x7F) == 0) and np.all((qb[10][~finite] & 0x7F) == 0x7F)   # x / inf: 0; inf: NaN


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pair_is_both_layouts_bit_for_bit(dtype):
  """quantize_weight_fp8_pair: the forward's form and the dgrads' from one call, each bit for bit its own call's, on
  random weights of many scales and on the edge blocks (ties, saturation, zeros, subnormals, NaN, infinities)."""
  for w in (weights((3, 256, 384), dtype, seed=5), jnp.asarray(edge_weights(), dtype)):
    wq, wt = jax.jit(quantize_weight_fp8_pair)(w)
    for got, want in ((wq, call(w, True)), (wt, call(w, False))):
      assert got.values.shape == want.values.shape and got.scales.shape == want.scales.shape
      np.testing.assert_array_equal(bits(got.values), bits(want.values))
      np.testing.assert_array_equal(bits(got.scales), bits(want.scales))
    assert np.count_nonzero(bits(wt.values)) > 0.5 * wt.values.size   # not vacuous


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_pair_on_sharded_weights(axis_type):
  """quantize_weight_fp8_pair on a weight sharded over its experts, on an Auto and on an Explicit mesh: the bits of
  the unsharded call."""
  w = weights((4, 256, 384), jnp.bfloat16, seed=9)
  want = jax.jit(quantize_weight_fp8_pair)(w)
  mesh = jax.make_mesh((4,), ("x",), axis_types=(axis_type,), devices=jax.devices("cpu")[:4])
  with jax.set_mesh(mesh):
    got = jax.jit(quantize_weight_fp8_pair)(jax.device_put(w, NamedSharding(mesh, P("x"))))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize("shape,dtype,what", [
    ((2, 100, 128), jnp.float32, r"must be a multiple of 128, got 100"),
    ((2, 128, 200), jnp.bfloat16, r"must be a multiple of 128, got 200"),
    ((2, 0, 128), jnp.float32, r"K and N must be positive multiples of 128, got K=0"),
])
def test_bad_shapes_refused(shape, dtype, what):
  for quantize in (quantize_weight_fp8, quantize_weight_fp8_pair):
    with pytest.raises(ValueError, match=what):
      quantize(jnp.ones(shape, dtype))


@pytest.mark.parametrize("w", [jnp.ones((128, 128)), jnp.ones((1, 128, 128), jnp.float16),
                               jnp.ones((1, 128, 128), jnp.int32)], ids=["2d", "float16", "int32"])
def test_bad_operands_refused(w):
  with pytest.raises(TypeError, match=r"quantize_weight_fp8: w must be a float32 or bfloat16 \[E, K, N\] array"):
    quantize_weight_fp8(w)


def test_handler_refuses_bad_shapes():
  """The shape check both handlers share (ffi/common/grouped_gemm_signature.h), reached past the wrapper."""
  from jax_moe_overlap import _ffi
  _ffi.register()
  none = (jax.ShapeDtypeStruct((0,), fp8.E4M3), jax.ShapeDtypeStruct((0,), jnp.float32))

  def run(out, w, both=False):
    jax.block_until_ready(jax.ffi.ffi_call(QUANTIZE_WEIGHT_FP8, out)(w, transposed=True, both=both))

  out = (jax.ShapeDtypeStruct((1, 128, 96), fp8.E4M3), jax.ShapeDtypeStruct((1, 1, 0), jnp.float32)) + none
  with pytest.raises(Exception, match=r"quantize_weight_fp8: K and N \(w's last two axes\) must be positive multiples "
                                      r"of 128 \(whole 128 x 128 blocks\), got K=96, N=128"):
    run(out, jnp.ones((1, 96, 128)))
  first = (jax.ShapeDtypeStruct((1, 256, 128), fp8.E4M3), jax.ShapeDtypeStruct((1, 2, 1), jnp.float32))
  with pytest.raises(Exception, match=r"inconsistent results: expected q \[E, N, K\]"):
    run((jax.ShapeDtypeStruct((1, 128, 256), fp8.E4M3), jax.ShapeDtypeStruct((1, 1, 2), jnp.float32)) + none,
        jnp.ones((1, 128, 256)))
  # The second pair: the other layout with both, empty without.
  with pytest.raises(Exception, match=r"expected q2 \[E, K, N\], s \[E, K/128, N/128\] for w \[1, 128, 256\]"):
    run(first + first, jnp.ones((1, 128, 256)), both=True)
  with pytest.raises(Exception, match=r"expected q2 \[0\], s2 \[0\] for w \[1, 128, 256\] without both"):
    run(first + (jax.ShapeDtypeStruct((1, 128, 256), fp8.E4M3), jax.ShapeDtypeStruct((1, 1, 2), jnp.float32)),
        jnp.ones((1, 128, 256)))


def _layer(switch_on, xla_quantizer=False, pair=True):
  """y and the gradients of moe_experts(quantization="fp8", impl="collective") on a 4-device CPU mesh, with
  BACKWARD_REQUANTIZES_WEIGHTS as given (whether the backward re-quantizes the master weights), with
  FORWARD_QUANTIZES_DGRAD_WEIGHTS as `pair`, and the weights quantized by the call or, with xla_quantizer, by XLA's
  fp8.quantize_weight; the program's text; the weights."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(fp8_experts, "BACKWARD_REQUANTIZES_WEIGHTS", switch_on)
    mp.setattr(fp8_experts, "FORWARD_QUANTIZES_DGRAD_WEIGHTS", pair)
    if xla_quantizer:
      mp.setattr(fp8_experts, "quantize_weight_fp8",
                 lambda w, transposed=True: fp8_experts.xla_quantize_weight(w, transposed))
      mp.setattr(fp8_experts, "quantize_weight_fp8_pair",
                 lambda w: (fp8_experts.xla_quantize_weight(w), fp8_experts.xla_quantize_weight(w, False)))
    jax.clear_caches()  # no program traced under other settings (same functions, same shapes) may be reused
    mesh = mesh_of(4)
    x, ids, gates, w1, w2 = layer_inputs(64, 128, 256, 8, 2, "skewed", 11, dtype=jnp.bfloat16)
    cot = jnp.asarray(np.random.default_rng(12).standard_normal((64, 128)).astype(np.float32))
    f = grads_fn(mesh, ids, cot, "collective")
    (_, y), g = f(x, gates, w1, w2)
    text = f.lower(x, gates, w1, w2).as_text()
  jax.clear_caches()
  return [np.asarray(a) for a in (y, *g)], text, (w1, w2)


@pytest.fixture(scope="module")
def layer_with_xla_quantizer():
  """The recipe with XLA's quantizer, on weights where it and the call agree bit for bit (checked: where they part,
  by XLA's reciprocal, the layers differ by that byte's products)."""
  want, text, (w1, w2) = _layer(False, xla_quantizer=True)
  assert QUANTIZE_WEIGHT_FP8 not in text
  for w in (w1, w2):
    for transposed in (True, False):
      np.testing.assert_array_equal(bits(call(w, transposed).values), bits(xla(w, transposed).values))
  return want


# The shipped switches (the pair form) in the default pass; the two other settings in the slow pass.
@pytest.mark.parametrize("switch_on,pair,calls,both", [
    pytest.param(False, True, 2, 2, id="pair"),
    pytest.param(False, False, 2, 0, id="transposes", marks=pytest.mark.slow),
    pytest.param(True, True, 4, 0, id="requantizes", marks=pytest.mark.slow)])
def test_layer_with_the_call_equals_the_layer_with_xla_quantizer(layer_with_xla_quantizer, switch_on, pair, calls,
                                                                 both):
  """The recipe on CPU takes the call for the forward's weights and the dgrads' from one read of each (2 calls of the
  pair form), or for the forward's alone, the backward transposing them (2 calls), or with BACKWARD_REQUANTIZES_WEIGHTS
  for the dgrads' too, from the master weights (4): y and every gradient bit for bit what it gives with XLA's
  quantizer."""
  got, text, _ = _layer(switch_on, pair=pair)
  assert text.count(QUANTIZE_WEIGHT_FP8) == calls
  assert text.count("both = true") == both
  for name, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), got, layer_with_xla_quantizer):
    np.testing.assert_array_equal(a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32),
                                  b.view(np.uint16 if b.dtype.itemsize == 2 else np.uint32), err_msg=name)


@pytest.mark.slow  # BACKWARD_REQUANTIZES_WEIGHTS is off in the library; its other settings' tests are slow too
def test_what_the_forward_keeps_with_the_switch_on(monkeypatch):
  """With BACKWARD_REQUANTIZES_WEIGHTS the forward keeps the master weights themselves (the arrays the caller passed: no
  memory of its own) instead of their quantized copies, 3 E D F bytes of e4m3 values and a float32 scale per
  128 x 128 block fewer; a pre-quantized weight is kept as given. Off, the quantized copies: the dgrads' (made by
  the forward from the same read as its own, FORWARD_QUANTIZES_DGRAD_WEIGHTS) or, with that off, the forward's; the
  same bytes either way."""
  M, D, F, G = 256, 128, 256, 4
  x, _, _, w1, w2 = layer_inputs(M, D, F, G, 2, "balanced", 1)
  gs = jnp.asarray([64, 64, 64, 64], jnp.int32)

  def kept_of():
    return fp8_experts._fp8_expert_mlp_fwd(x, w1, w2, gs, fp8_experts.KERNELS)[1]

  def nbytes(tree):
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))

  monkeypatch.setattr(fp8_experts, "BACKWARD_REQUANTIZES_WEIGHTS", True)
  kept_on = kept_of()
  assert kept_on[2] is w1 and kept_on[3] is w2
  pre = fp8.quantize_weight(w1)
  kept_pre = fp8_experts._fp8_expert_mlp_fwd(x, pre, w2, gs, fp8_experts.KERNELS)[1]
  assert kept_pre[2] is pre and kept_pre[3] is w2
  monkeypatch.setattr(fp8_experts, "BACKWARD_REQUANTIZES_WEIGHTS", False)
  kept_off = kept_of()
  # The dgrads' copies, made by the forward's one read of each weight: the transposes of the forward's copies.
  assert all(isinstance(k, fp8_experts.DgradWeight) for k in kept_off[2:4])
  for k, w in zip(kept_off[2:4], (w1, w2)):
    np.testing.assert_array_equal(bits(k.weight.values), bits(call(w, False).values))
  monkeypatch.setattr(fp8_experts, "FORWARD_QUANTIZES_DGRAD_WEIGHTS", False)
  kept_forward = kept_of()
  assert isinstance(kept_forward[2], fp8.Fp8Weight) and isinstance(kept_forward[3], fp8.Fp8Weight)
  quantized = 3 * G * D * F * (1 + 4 / 128 ** 2)
  own = lambda kept: nbytes(kept) - nbytes([k for k in kept[2:4] if k is w1 or k is w2])  # noqa: E731
  assert own(kept_off) - own(kept_on) == own(kept_forward) - own(kept_on) == quantized


@pytest.mark.parametrize("switch_on", [False, True], ids=["switch_off", "switch_on"])
def test_pair_kernel_on_cpus_and_on_gpus_by_its_switch(monkeypatch, switch_on):
  """KERNELS.quantize_weight_pair lowered for CPUs runs the pair form's call; for GPUs only with
  WEIGHT_PAIR_KERNEL_ON_GPU (else the single-layout call and XLA's transpose of it); the same bits either way."""
  monkeypatch.setattr(fp8_experts, "WEIGHT_QUANTIZER_ON_GPU", True)
  monkeypatch.setattr(fp8_experts, "WEIGHT_PAIR_KERNEL_ON_GPU", switch_on)
  w = weights((2, 256, 128), jnp.bfloat16, seed=2)
  traced = jax.jit(lambda w: fp8_experts.KERNELS.quantize_weight_pair(w)).trace(w)   # (a fresh function: a fresh trace)
  assert traced.lower().as_text().count("both = true") == 1
  for_gpu = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert for_gpu.count(QUANTIZE_WEIGHT_FP8) == 1 and for_gpu.count("both = true") == (1 if switch_on else 0)
  wq, wt = jax.jit(fp8_experts.KERNELS.quantize_weight_pair)(w)
  np.testing.assert_array_equal(bits(wq.values), bits(call(w, True).values))
  np.testing.assert_array_equal(bits(wt.values), bits(call(w, False).values))


@pytest.mark.parametrize("switch_on", [False, True], ids=["switch_off", "switch_on"])
def test_kernels_take_the_call_on_cpus_and_on_gpus_by_the_switch(monkeypatch, switch_on):
  """KERNELS.quantize_weight lowered for CPUs runs the call; for GPUs only with WEIGHT_QUANTIZER_ON_GPU (else XLA's
  quantize_weight, no custom call). Both layouts."""
  monkeypatch.setattr(fp8_experts, "WEIGHT_QUANTIZER_ON_GPU", switch_on)
  w = weights((2, 256, 128), jnp.bfloat16, seed=1)
  for transposed in (True, False):
    traced = jax.jit(lambda w: fp8_experts.KERNELS.quantize_weight(w, transposed)).trace(w)
    assert traced.lower().as_text().count(QUANTIZE_WEIGHT_FP8) == 1
    for_gpu = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert for_gpu.count(QUANTIZE_WEIGHT_FP8) == (1 if switch_on else 0)
