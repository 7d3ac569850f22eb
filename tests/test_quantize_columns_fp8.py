"""The FP8 wgrad operands' quantizer (grouped_gemm.quantize_columns_fp8, the custom call jmo_quantize_columns_fp8) on
its CPU handler: bit for bit fp8.quantize_columns followed by fp8.token_contiguous (the XLA scatter and transpose it
replaces), values and scales, on skewed and empty groups, partial tiles, rows past the last group holding large
values, float32 and bfloat16 rows; e4m3's rounding ties, subnormals, signed zeros, NaN and infinities; row-quantized
rows (e4m3 values and 1 x 128 scales) bit for bit the call on their dequantized float32 rows, non-finite values and
scales, zero rows, subnormal products; the recipe's gradients on the custom call equal those on the XLA layout bit for
bit, and those with x and dy given to the call dequantized; the refusals.
tests/gpu/test_gpu_quantize_columns_fp8.py holds the CUDA kernel to the same bits."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jax_moe_overlap import _ffi, fp8, fp8_experts
from jax_moe_overlap.grouped_gemm import QUANTIZE_COLUMNS_FP8, grouped_outer_fp8, quantize_columns_fp8

CASES = [  # (M, C, group sizes): skew, empty groups, partial tiles, rows past the last group
    (300, 256, [0, 130, 150]),           # 20 rows past the groups
    (520, 128, [1, 0, 3, 385, 0, 128]),  # one-row groups, a group of exactly one tile, 3 rows past
    (256, 384, [256]),                   # whole tiles, no row past
    (40, 128, [0, 0]),                   # no rows at all: every tile empty
]


def rows(case, dtype, seed):
  """[M, C] of very different magnitudes per channel and row (many scales); the rows past the groups hold values
  far above the groups' (zero bytes once quantized: they must not reach a tile's amax or any value)."""
  M, C, sizes = case
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((M, C)) * np.exp2(rng.integers(-6, 7, (1, C))) * np.exp2(rng.integers(-4, 5, (M, 1)))
  x[sum(sizes):] = 3e38 if dtype == jnp.float32 else 1e38
  return jnp.asarray(x.astype(np.float32), dtype)


ROW_CASES = [  # (M, C, group sizes) of row-quantized rows: C a multiple of 256, the call's item for that form
    (300, 256, [0, 130, 150]),           # 20 rows past the groups
    (520, 512, [1, 0, 3, 385, 0, 128]),  # one-row groups, a group of exactly one tile, 3 rows past
    (256, 256, [256]),                   # whole tiles, no row past
    (40, 256, [0, 0]),                   # no rows at all: every tile empty
]


def quantized_rows(case, seed):
  """``rows`` (float32) as the recipe holds x and dy: fp8.quantize_rows(pow2=True) (the rows past the groups too)."""
  return jax.jit(lambda x: fp8.quantize_rows(x, pow2=True))(rows(case, jnp.float32, seed))


def dequantized_path(xq, xs, tiles):
  """The row form's definition: the call on the rows dequantize_rows gives."""
  return quantize_columns_fp8(fp8.dequantize_rows(xq, xs), tiles)


def xla_path(x, tiles):
  """What the recipe ran before the custom call: fp8.quantize_columns, then the scatter to the padded rows and the
  transpose (fp8.token_contiguous)."""
  q, s = fp8.quantize_columns(x, tiles)
  return fp8.token_contiguous(q, tiles), s


def bits(a):
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def assert_same(x, sizes):
  tiles = fp8.column_tiles(x.shape[0], jnp.asarray(sizes, jnp.int32))
  q, s = jax.jit(quantize_columns_fp8)(x, tiles)
  want_q, want_s = jax.jit(xla_path)(x, tiles)
  assert q.dtype == fp8.E4M3 and q.shape == (x.shape[1], 128 * tiles.count)
  assert s.dtype == jnp.float32 and s.shape == (tiles.count, x.shape[1])
  np.testing.assert_array_equal(bits(q), bits(want_q))
  np.testing.assert_array_equal(bits(s), bits(want_s))
  return np.asarray(q).view(np.uint8), np.asarray(s)


# Each case once in the default pass, float32 and bfloat16 in turn; the other dtype of each in the slow pass.
@pytest.mark.parametrize("dtype,case", [
    pytest.param(dtype, case, id=f"{jnp.dtype(dtype).name}-case{i}",
                 marks=() if (i % 2 == 0) == (dtype == jnp.float32) else pytest.mark.slow)
    for dtype in (jnp.float32, jnp.bfloat16) for i, case in enumerate(CASES)])
def test_equals_quantize_columns_and_the_scatter_layout(case, dtype):
  M, C, sizes = case
  q, s = assert_same(rows(case, dtype, seed=M + C), sizes)
  # Not vacuous: the groups' values are there, and every place no row takes is zero (the tiles past the groups' too,
  # with the least scale).
  used = 128 * sum(-(-n // 128) for n in sizes)
  if sum(sizes):
    assert np.count_nonzero(q[:, :used]) > 0.9 * sum(sizes) * C
  taken = np.zeros(q.shape[1], bool)
  start = 0
  for n in sizes:
    taken[start:start + n] = True
    start += 128 * -(-n // 128)
  assert not q[:, ~taken].any()
  np.testing.assert_array_equal(s[used // 128:], np.float32(fp8.SCALE_FLOOR))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_rows_sharded_on_auto_and_explicit_meshes(axis_type):
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:4]), ("x",), axis_types=(axis_type,))
  x = rows(CASES[0], jnp.float32, seed=1)
  tiles = fp8.column_tiles(x.shape[0], jnp.asarray(CASES[0][2], jnp.int32))
  want_q, want_s = jax.jit(xla_path)(x, tiles)
  xq, xs = fp8.quantize_rows(x, pow2=True)
  want_rows = jax.jit(dequantized_path)(xq, xs, tiles)
  with jax.set_mesh(mesh):
    q, s = jax.jit(quantize_columns_fp8)(jax.device_put(x, NamedSharding(mesh, P(None, "x"))), tiles)
    rq, rs = jax.jit(quantize_columns_fp8)((jax.device_put(xq, NamedSharding(mesh, P(None, "x"))), xs), tiles)
  np.testing.assert_array_equal(bits(q), bits(want_q))
  np.testing.assert_array_equal(bits(s), bits(want_s))
  np.testing.assert_array_equal(bits(rq), bits(want_rows[0]))
  np.testing.assert_array_equal(bits(rs), bits(want_rows[1]))


def assert_rows_same(xq, xs, sizes):
  """The call on row-quantized rows (xq, xs) bit for bit the call on dequantize_rows(xq, xs) (and so fp8's
  quantize_columns + token_contiguous of those rows)."""
  tiles = fp8.column_tiles(xq.shape[0], jnp.asarray(sizes, jnp.int32))
  q, s = jax.jit(quantize_columns_fp8)((xq, xs), tiles)
  want_q, want_s = jax.jit(dequantized_path)(xq, xs, tiles)
  assert q.dtype == fp8.E4M3 and q.shape == (xq.shape[1], 128 * tiles.count)
  assert s.dtype == jnp.float32 and s.shape == (tiles.count, xq.shape[1])
  np.testing.assert_array_equal(bits(q), bits(want_q))
  np.testing.assert_array_equal(bits(s), bits(want_s))
  return np.asarray(q).view(np.uint8), np.asarray(s)


@pytest.mark.parametrize("case", ROW_CASES)
def test_row_quantized_rows_equal_their_dequantized_rows(case):
  """Skewed and empty groups, partial tiles, rows past the groups (their huge values quantized to e4m3 rows with
  large scales: they must reach no tile)."""
  M, C, sizes = case
  xq, xs = quantized_rows(case, seed=M + C)
  q, s = assert_rows_same(xq, xs, sizes)
  if sum(sizes):  # not vacuous: the groups' values are there
    assert np.count_nonzero(q) > 0.9 * sum(sizes) * C
  used = 128 * sum(-(-n // 128) for n in sizes)
  np.testing.assert_array_equal(s[used // 128:], np.float32(fp8.SCALE_FLOOR))
  # And the float32 rows the recipe quantized give other columns: the call did dequantize (not re-read the floats).
  tiles = fp8.column_tiles(M, jnp.asarray(sizes, jnp.int32))
  if sum(sizes):
    assert np.any(q != np.asarray(jax.jit(quantize_columns_fp8)(rows(case, jnp.float32, M + C), tiles)[0]).view(
        np.uint8))


def odd_rows(least_scale_log2=-126):
  """(xq, xs, sizes): every byte (NaN bytes 0x7F and 0xFF among them: channels 256..511 only), scales NaN, +-inf, 0
  (a zero row as fp8.unpack_rows gives it), negative, and powers of two down to 2^least_scale_log2 (channel block 0:
  that least scale only). At 2^-126 the products of small e4m3 values and their scales are float32 subnormals."""
  rng = np.random.default_rng(7)
  M, C = 384, 512
  b = rng.integers(0, 256, (M, C), dtype=np.uint8)
  b[:, :256][(b[:, :256] & 0x7F) == 0x7F] = 0x35
  s = np.exp2(rng.integers(least_scale_log2, 12, (M, C // 128))).astype(np.float32)
  s[:, 0] = np.float32(2.0 ** least_scale_log2)
  s[10, 1], s[150, 1], s[301, 1] = np.inf, -np.inf, np.nan
  s[20:22, 1] = 0.0
  s[40, 1] = -0.5
  return jax.lax.bitcast_convert_type(jnp.asarray(b), fp8.E4M3), jnp.asarray(s), [100, 0, 200, 60]


def test_row_quantized_non_finite_zero_and_tiny():
  """odd_rows, subnormal products included (XLA:CPU runs its threads, the custom call's too, flushing them to zero:
  the same bits either way)."""
  xq, xs, sizes = odd_rows()
  q, out_s = assert_rows_same(xq, xs, sizes)
  # Not vacuous: NaN bytes reach their tiles' scales; row 10's infinite scale makes tile 0's of block 1 non-finite
  # (inf, or NaN where a byte is zero); block 0's values are there.
  assert np.isnan(out_s[:, 256:]).any() and np.isfinite(out_s[:, :128]).all()
  assert not np.isfinite(out_s[0, 128:256]).any()
  assert np.count_nonzero(q[:128]) > 0.5 * sum(sizes) * 128


def test_recipe_gradients_take_the_row_quantized_operands():
  recipe_gradients_take_the_row_quantized_operands()


def recipe_gradients_take_the_row_quantized_operands():
  """KERNELS gives x and dy to the column quantizer row-quantized (D a multiple of 256; on CPUs, on GPUs with
  fp8_experts.ROW_QUANTIZED_COLUMNS_ON_GPU): the gradients equal, bit for bit, those of the same recipe that
  dequantizes them first (Gemms.row_columns None)."""
  dequantizing = dataclasses.replace(fp8_experts.KERNELS, row_columns=None)
  M, D, F = 300, 256, 128
  sizes = jnp.asarray([170, 0, 1, 100], jnp.int32)
  rng = np.random.default_rng(11)
  x = jnp.asarray(rng.standard_normal((M, D)) * (np.arange(M) < 271)[:, None], jnp.bfloat16)
  w1 = jnp.asarray(rng.standard_normal((4, D, 2 * F)) * 0.1, jnp.float32)
  w2 = jnp.asarray(rng.standard_normal((4, F, D)) * 0.1, jnp.float32)
  cot = jnp.asarray(rng.standard_normal((M, D)), jnp.float32)

  def grads(gemms):
    loss = lambda x, w1, w2: jnp.sum(fp8_experts.fp8_expert_mlp(x, w1, w2, sizes, gemms).astype(jnp.float32) * cot)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

  for name, a, b in zip(("dx", "dw1", "dw2"), grads(fp8_experts.KERNELS)(x, w1, w2), grads(dequantizing)(x, w1, w2)):
    np.testing.assert_array_equal(bits(np.asarray(a, np.float32)), bits(np.asarray(b, np.float32)), err_msg=name)
    assert np.any(np.asarray(a, np.float32) != 0), name
  assert len(_row_form_calls(grads(fp8_experts.KERNELS).lower(x, w1, w2).as_text())) == 2, "x and dy as e4m3 rows"
  assert not _row_form_calls(grads(dequantizing).lower(x, w1, w2).as_text())


def _row_form_calls(text):
  """The column quantizer's calls in a lowered program that take e4m3 rows."""
  return re.findall(QUANTIZE_COLUMNS_FP8 + r"\(.*\} : \(tensor<\d+x\d+xf8E4M3FN>", text)


def _e4m3_cases():
  """Values whose quantization tests the rounding: every e4m3 value, the midpoints between neighbours (ties to
  even) and the float32 next to each, subnormals of e4m3 and of float32, signed zeros."""
  e = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  e = np.unique(e[np.isfinite(e) & (e >= 0)])
  mids = (e[:-1] + e[1:]) / 2                                   # exact in float32
  up, down = np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0))
  tiny = np.float32(2.0 ** -10) * np.arange(1, 20, dtype=np.float32) / 4   # around the e4m3 subnormals' midpoints
  f32_sub = np.float32(2.0 ** -140) * np.arange(1, 5, dtype=np.float32)
  v = np.concatenate([e, mids, up, down, tiny, f32_sub, [0.0]]).astype(np.float32)
  return np.concatenate([v, -v])


def test_rounding_ties_subnormals_and_non_finite_values():
  """Each tile's first row holds 447.99997 (its scale is then exactly 1.0: float32(447.99997 / 448 by the rule) =
  1), so the other rows reach the e4m3 rounding unchanged; some tiles hold a NaN or an infinity (their scale NaN or
  infinite, their values NaN or zero, XLA's way)."""
  amax = np.float32(447.99997)
  assert np.float32(amax * fp8.E4M3_MAX_INV) == np.float32(1.0)
  v = _e4m3_cases()
  C = 256
  per_tile = 127
  tiles_needed = -(-v.size // (per_tile * C)) + 1
  M = 128 * tiles_needed
  x = np.zeros((M, C), np.float32)
  body = np.resize(v, (tiles_needed, per_tile, C))
  x.reshape(tiles_needed, 128, C)[:, 1:, :] = body
  x.reshape(tiles_needed, 128, C)[:, 0, :] = amax
  last = x.reshape(tiles_needed, 128, C)[-1]
  last[5, 0], last[9, 1], last[9, 2], last[3, 3] = np.nan, np.inf, -np.inf, -np.nan
  last[7, 2] = np.inf                                              # inf / inf: NaN
  q, s = assert_same(jnp.asarray(x), [M])
  assert np.all(s[:tiles_needed - 1] == 1.0)
  assert np.isnan(s[tiles_needed - 1, 0]) and np.isinf(s[tiles_needed - 1, 1])


def _row_layout(cols, tiles):
  """A token-contiguous (q_t [C, Mp], s) back in row layout (q [M, C], s): row r from its padded place; zero past
  the groups."""
  q_t, s = cols
  bits = jax.lax.bitcast_convert_type(q_t, jnp.uint8).T
  q = jnp.take(bits, tiles.padded_row, axis=0, mode="fill", fill_value=0)
  return jax.lax.bitcast_convert_type(q, fp8.E4M3), s


def _kernels_swiglu_backward_in_row_layout(aq, a_s, dh, tiles):
  h_cols, da_rows, da_cols = fp8_experts.KERNELS.swiglu_backward(aq, a_s, dh, tiles)
  return _row_layout(h_cols, tiles), da_rows, _row_layout(da_cols, tiles)


def test_recipe_gradients_equal_the_xla_layout_path():
  recipe_gradients_equal_the_xla_layout_path(row_quantized_columns=True)


def recipe_gradients_equal_the_xla_layout_path(row_quantized_columns):
  """KERNELS' wgrads quantize their operands by the custom call; the same recipe with quantize_columns and the
  XLA layout (grouped_outer_fp8 on row-layout operands) gives the same gradients bit for bit. The SwiGLU backward,
  whose da and h the wgrads read, is KERNELS' custom call in both (its outputs read back into row layout for the XLA
  one): its float32 exp is the C library's, XLA's composition has XLA's own, which may part in the last bit
  (tests/test_swiglu_backward_fp8.py holds the call to the composition); this test is about the layout of the wgrad
  operands, which must not change a bit. row_quantized_columns: whether the platform gives x and dy to the column
  quantizer row-quantized (CPUs; GPUs with fp8_experts.ROW_QUANTIZED_COLUMNS_ON_GPU)."""
  def outer(lhs, rhs, tiles, group_sizes, out_dtype=jnp.float32):
    return grouped_outer_fp8(lhs, rhs, tiles, group_sizes, preferred_element_type=out_dtype)

  xla_layout = fp8_experts.Gemms("kernels, XLA layout", fp8_experts.KERNELS.rows, fp8.quantize_columns, outer,
                                 fp8_experts.KERNELS.swiglu_forward, _kernels_swiglu_backward_in_row_layout)
  M, D, F = 300, 256, 128   # D a multiple of 256: KERNELS gives x and dy to the call row-quantized (CPUs)
  sizes = np.array([170, 0, 1, 100])
  rng = np.random.default_rng(5)
  x = rng.standard_normal((M, D)) * np.exp2(rng.integers(-3, 4, (1, D)))
  x[sizes.sum():] = 0.0
  x = jnp.asarray(x, jnp.bfloat16)
  w1 = jnp.asarray(rng.standard_normal((sizes.size, D, 2 * F)) * 0.1, jnp.float32)
  w2 = jnp.asarray(rng.standard_normal((sizes.size, F, D)) * 0.1, jnp.float32)
  cot = jnp.asarray(rng.standard_normal((M, D)), jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)

  def grads(gemms):
    loss = lambda x, w1, w2: jnp.sum(fp8_experts.fp8_expert_mlp(x, w1, w2, gs, gemms).astype(jnp.float32) * cot)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

  got, want = grads(fp8_experts.KERNELS)(x, w1, w2), grads(xla_layout)(x, w1, w2)
  for name, a, b in zip(("dx", "dw1", "dw2"), got, want):
    np.testing.assert_array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32),
                                  err_msg=name)
    assert np.any(np.asarray(a, np.float32) != 0), name
  text = grads(fp8_experts.KERNELS).lower(x, w1, w2).as_text()
  assert text.count("jmo_quantize_columns_fp8") == 2, "x and dy, the wgrads' other operands"
  assert text.count("jmo_swiglu_backward_fp8") == 1, "da and h, quantized into their layouts by the SwiGLU backward"
  assert len(_row_form_calls(text)) == (2 if row_quantized_columns else 0), "x and dy given as e4m3 rows or not"
  assert "scatter" not in text, "no XLA scatter lays out the wgrad operands"


def test_refusals():
  gs = jnp.asarray([100, 50], jnp.int32)
  tiles = fp8.column_tiles(256, gs)
  with pytest.raises(TypeError, match=r"x must be a float32 or bfloat16 \[M, C\] array"):
    quantize_columns_fp8(jnp.ones((256, 128), jnp.float16), tiles)
  with pytest.raises(ValueError, match=r"C must be a positive multiple of 128, got C=192"):
    quantize_columns_fp8(jnp.ones((256, 192), jnp.float32), tiles)
  with pytest.raises(ValueError, match=r"tiles were made for 256 rows, x has 255"):
    quantize_columns_fp8(jnp.ones((255, 128), jnp.float32), tiles)
  bad = fp8.column_tiles(256, jnp.asarray([100, 200], jnp.int32))
  with pytest.raises(Exception, match=r"group 1 has 200 rows; group sizes must be >= 0 and sum to at most 256"):
    jax.block_until_ready(quantize_columns_fp8(jnp.ones((256, 128), jnp.float32), bad))
  negative = fp8.column_tiles(256, jnp.asarray([-1, 2], jnp.int32))
  with pytest.raises(Exception, match=r"group 0 has -1 rows"):
    jax.block_until_ready(quantize_columns_fp8(jnp.ones((256, 128), jnp.float32), negative))


def test_row_quantized_refusals():
  tiles = fp8.column_tiles(256, jnp.asarray([100, 50], jnp.int32))
  xq, xs = fp8.quantize_rows(jnp.ones((256, 256), jnp.float32), pow2=True)
  with pytest.raises(ValueError, match=r"C must be a positive multiple of 256 when x is row-quantized .* got C=128"):
    quantize_columns_fp8((xq[:, :128], xs[:, :1]), tiles)
  with pytest.raises(ValueError, match=r"xs must be \[M, C / 128\] = \[256, 2\] for xq \[256, 256\], got \[256, 1\]"):
    quantize_columns_fp8((xq, xs[:, :1]), tiles)
  with pytest.raises(TypeError, match=r"row-quantized x must be \(xq \[M, C\] float8_e4m3fn, xs \[M, C / 128\] float32\)"):
    quantize_columns_fp8((jax.lax.bitcast_convert_type(xq, jnp.uint8), xs), tiles)
  with pytest.raises(TypeError, match=r"row-quantized x must be"):
    quantize_columns_fp8((xq, xs.astype(jnp.bfloat16)), tiles)
  with pytest.raises(TypeError, match=r"row-quantized x is the pair \(xq, xs\), got 3 arrays"):
    quantize_columns_fp8((xq, xs, xs), tiles)
  with pytest.raises(ValueError, match=r"tiles were made for 256 rows, x has 128"):
    quantize_columns_fp8((xq[:128], xs[:128]), tiles)
  bad = fp8.column_tiles(256, jnp.asarray([100, 200], jnp.int32))
  with pytest.raises(Exception, match=r"group 1 has 200 rows; group sizes must be >= 0 and sum to at most 256"):
    jax.block_until_ready(quantize_columns_fp8((xq, xs), bad))


def _raw_call(x, x_scales, tiles):
  _ffi.register()
  C = x.shape[1]
  out = (jax.ShapeDtypeStruct((C, 128 * tiles.count), fp8.E4M3), jax.ShapeDtypeStruct((tiles.count, C), jnp.float32))
  return jax.block_until_ready(jax.ffi.ffi_call(QUANTIZE_COLUMNS_FP8, out)(x, x_scales, tiles.group_sizes))


def test_the_handler_states_the_row_form_rules():
  """The handler's own checks (shared with the CUDA handler), past the Python wrapper's."""
  tiles = fp8.column_tiles(256, jnp.asarray([100, 50], jnp.int32))
  xq, xs = fp8.quantize_rows(jnp.ones((256, 256), jnp.float32), pow2=True)
  with pytest.raises(Exception, match=r"C \(x's channels\) must be a multiple of 256 when x is row-quantized"):
    _raw_call(xq[:, :128], xs[:, :1], tiles)
  with pytest.raises(Exception, match=r"x_scales must be \[M, C/128\] when x is e4m3 and \[M, 0\] otherwise"):
    _raw_call(xq, xs[:, :1], tiles)
  with pytest.raises(Exception, match=r"x_scales must be \[M, C/128\] when x is e4m3 and \[M, 0\] otherwise"):
    _raw_call(jnp.ones((256, 256), jnp.float32), xs, tiles)
  with pytest.raises(Exception, match=r"x must be float8_e4m3fn \(row-quantized\) or"):
    _raw_call(jnp.ones((256, 256), jnp.float16), jnp.zeros((256, 0), jnp.float32), tiles)
