"""fp8.py's quantizer against its NumPy / ml_dtypes twin (fp8_numpy.py), bit for bit, and its stated properties:
rounding to nearest even, saturation, power-of-two scales, all-zero tiles, non-finite input, the round-trip error
bound, the 128 x 1 tiles of ragged groups, the exact transposed copy of a quantized weight."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8_numpy as ref
import jax_moe_overlap as jmo
from jax_moe_overlap import fp8


def wide_range(shape, seed):
  """Random values whose magnitude spans 2^-30 .. 2^30 from tile to tile and 2^-12 .. 1 within a tile."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  x *= np.exp2(rng.integers(-12, 1, shape)).astype(np.float32)
  x *= np.exp2(rng.integers(-30, 31, shape[:-1] + (1,))).astype(np.float32)
  return x


def bits(a):
  return np.asarray(a).view(np.uint8)


def e4m3_grid():
  """Every finite e4m3 value, ascending."""
  v = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  return np.unique(v[np.isfinite(v)])


def test_round_e4m3_is_round_to_nearest_even_with_saturation():
  grid = e4m3_grid()
  mids = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)   # ties: exact in float32
  v = np.concatenate([grid, mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf)),
                      np.float32([449.0, 463.9, 464.0, 500.0, 1e9, 3e38, -449.0, -1e9, -3e38])])
  got = bits(jax.jit(fp8.round_e4m3)(v))
  np.testing.assert_array_equal(got, bits(np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn)))
  q = np.asarray(fp8.round_e4m3(v)).astype(np.float32)
  assert np.all(np.abs(q) <= 448) and np.all(q[-6:-3] == 448) and np.all(q[-3:] == -448)
  # A tie goes to the neighbour with an even mantissa (last bit 0).
  tie = np.asarray(fp8.round_e4m3(mids[grid[:-1] > 0]))
  assert np.all(bits(tie) % 2 == 0)


@pytest.mark.parametrize("pow2", [False, True])
def test_rows_bitwise_against_numpy(pow2):
  x = wide_range((6, 5, 384), 1)
  q, s = jax.jit(lambda x: fp8.quantize_rows(x, pow2))(x)
  q_ref, s_ref = ref.rows(x, pow2)
  np.testing.assert_array_equal(bits(q), bits(q_ref))
  np.testing.assert_array_equal(np.asarray(s), s_ref)
  np.testing.assert_array_equal(np.asarray(fp8.dequantize_rows(q, s)), ref.rows_qdq(x, pow2))
  assert q.dtype == jnp.float8_e4m3fn and s.shape == (6, 5, 3) and s.dtype == jnp.float32


def test_rows_of_bfloat16_quantize_their_float32_values():
  x = wide_range((4, 256), 2).astype(jnp.bfloat16)
  q, s = fp8.quantize_rows(jnp.asarray(x), pow2=True)
  q_ref, s_ref = ref.rows(np.asarray(x).astype(np.float32), True)
  np.testing.assert_array_equal(bits(q), bits(q_ref))
  np.testing.assert_array_equal(np.asarray(s), s_ref)


def test_power_of_two_scales_are_the_least_power_of_two_that_fits():
  x = wide_range((64, 256), 3)
  x[0, :128] = 448.0 * 2.0 ** -5          # amax / 448 exactly a power of two: kept
  x[1, :128] = np.float32(448.0 * 2.0 ** 3 * 1.0000001)
  _, s = fp8.quantize_rows(jnp.asarray(x), pow2=True)
  s = np.asarray(s, np.float64)
  amax = np.abs(x.reshape(64, 2, 128)).max(-1).astype(np.float64)
  m, _ = np.frexp(s)
  assert np.all(m == 0.5)                                      # powers of two
  assert np.all(s * 448 >= amax) and np.all(s * 224 < amax)    # the least that holds the tile
  assert s[0, 0] == 2.0 ** -5 and s[1, 0] == 2.0 ** 4
  # Their dequantized values are exact in bfloat16.
  d = np.asarray(fp8.dequantize_rows(*fp8.quantize_rows(jnp.asarray(x), pow2=True)))
  np.testing.assert_array_equal(d.astype(ml_dtypes.bfloat16).astype(np.float32), d)


def test_zero_tiles_and_tiny_tiles():
  x = wide_range((3, 256), 4)
  x[0] = 0.0
  x[1, :128] = -0.0
  x[2, 128:] = 1e-37                       # amax / 448 below 2^-126: the floor
  q, s = fp8.quantize_rows(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(s)[0], [2.0 ** -126] * 2)
  assert np.asarray(s)[2, 1] == np.float32(2.0 ** -126)
  np.testing.assert_array_equal(np.asarray(fp8.dequantize_rows(q, s))[:2, :128], 0.0)
  np.testing.assert_array_equal(bits(q), bits(ref.rows(x)[0]))
  # A zero weight block likewise.
  w = np.zeros((1, 128, 256), np.float32)
  w[0, :, 128:] = 1.0
  wq, ws = fp8.quantize_blocks(jnp.asarray(w))
  np.testing.assert_array_equal(np.asarray(ws), np.float32([[[2.0 ** -126, 1 / 448]]]))
  np.testing.assert_array_equal(np.asarray(fp8.dequantize_blocks(wq, ws)), w)


@pytest.mark.parametrize("pow2", [False, True])
def test_non_finite_input_stays_non_finite(pow2):
  x = wide_range((3, 256), 5)
  x[0, 3] = np.nan
  x[1, 7] = np.inf
  x[2, 200] = -np.inf
  d = np.asarray(fp8.dequantize_rows(*fp8.quantize_rows(jnp.asarray(x), pow2)))
  assert np.isnan(d[0, :128]).all() and np.isnan(d[1, 7]) and np.isnan(d[2, 200])
  np.testing.assert_array_equal(np.isfinite(d[:, 128:])[:2], True)       # the other tiles as usual
  np.testing.assert_array_equal(d[2, :128], ref.rows_qdq(x, pow2)[2, :128])


def test_round_trip_error_is_half_an_e4m3_step():
  """|x - dequantize(quantize(x))| <= 2^-4 |x| where x / s is an e4m3 normal (>= 2^-6), else <= 2^-10 s (the
  subnormal step 2^-9 halved), plus the float32 roundings of x / s and q s (2^-23 relative)."""
  x = wide_range((32, 512), 6)
  q, s = fp8.quantize_rows(jnp.asarray(x))
  d = np.asarray(fp8.dequantize_rows(q, s), np.float64)
  srow = np.repeat(np.asarray(s, np.float64), 128, axis=-1)
  bound = np.maximum(2.0 ** -4 * np.abs(x), 2.0 ** -10 * srow) * (1 + 2.0 ** -20)
  assert np.all(np.abs(d - x) <= bound)
  assert np.abs(d - x).max() > 0                                 # it does round


def test_blocks_bitwise_against_numpy_and_the_transposed_copy_is_exact():
  w = wide_range((3, 256, 384), 7)
  q, s = jax.jit(fp8.quantize_blocks)(w)
  q_ref, s_ref = ref.blocks(w)
  np.testing.assert_array_equal(bits(q), bits(q_ref))
  np.testing.assert_array_equal(np.asarray(s), s_ref)
  assert s.shape == (3, 2, 3)
  # The K-major copy (Fp8Weight) holds the blocks of w^T: the same values and scales, transposed.
  fw = fp8.quantize_weight(jnp.asarray(w))
  assert fw.shape == (3, 256, 384) and fw.values.shape == (3, 384, 256) and fw.scales.shape == (3, 3, 2)
  np.testing.assert_array_equal(bits(fw.values), bits(np.swapaxes(q_ref, 1, 2)))
  np.testing.assert_array_equal(np.asarray(fw.scales), np.swapaxes(s_ref, 1, 2))
  np.testing.assert_array_equal(np.asarray(fw.dequantize()), ref.blocks_qdq(w))


@pytest.mark.parametrize("sizes", [[0, 5, 130, 128, 1], [300, 0, 0], [0, 0, 0], [127, 129, 1]])
def test_columns_bitwise_against_padded_groups(sizes):
  M = 320
  x = wide_range((M, 256), 8)
  x[sum(sizes):] = 0.0                     # rows past the groups hold zeros, as the layer's do
  gs = jnp.asarray(sizes, jnp.int32)
  tiles = fp8.column_tiles(M, gs)
  q, s = jax.jit(fp8.quantize_columns)(x, tiles)
  q_ref, s_ref = ref.columns(x, sizes)
  np.testing.assert_array_equal(bits(q), bits(q_ref))
  used = np.concatenate(s_ref) if sum(sizes) else np.zeros((0, 256), np.float32)
  np.testing.assert_array_equal(np.asarray(s)[:len(used)], used)
  np.testing.assert_array_equal(np.asarray(fp8.dequantize_columns(q, s, tiles)), ref.columns_qdq(x, sizes))
  assert tiles.count == -(-M // 128) + len(sizes)


def test_columns_ignore_what_lies_past_the_groups():
  x = wide_range((256, 128), 9)
  tiles = fp8.column_tiles(256, jnp.asarray([100, 50], jnp.int32))
  q, s = fp8.quantize_columns(jnp.asarray(x), tiles)
  x2 = x.copy()
  x2[150:] = 1e30
  q2, s2 = fp8.quantize_columns(jnp.asarray(x2), tiles)
  np.testing.assert_array_equal(bits(q), bits(q2))
  np.testing.assert_array_equal(np.asarray(s), np.asarray(s2))
  np.testing.assert_array_equal(np.asarray(fp8.dequantize_columns(q, s, tiles))[150:], 0.0)


def test_tiles_must_fit():
  with pytest.raises(ValueError, match=r"multiple of 128, got 96"):
    fp8.quantize_rows(jnp.zeros((2, 96)))
  with pytest.raises(ValueError, match=r"multiple of 128, got 64"):
    fp8.quantize_blocks(jnp.zeros((2, 128, 64)))
  with pytest.raises(TypeError,
                     match=r"quantize_weights: w2 must be a float \[E, F, D\] array, got float32\[128, 128\]"):
    jmo.quantize_weights(jnp.zeros((2, 128, 256)), jnp.zeros((128, 128)))


@pytest.mark.parametrize("tensor", [pytest.param(False, marks=pytest.mark.slow), True])  # (True splits both axes)
def test_sharded_on_explicit_axes(tensor):
  """jax.make_mesh's default axis type is Explicit, whose reshapes and gathers must be told their output's sharding.
  quantize_weights and Fp8Weight.dequantize on expert-sharded weights (with ``tensor``, F also split over a second
  axis, as a tensor-parallel layer keeps it; w1 also as its [E, D, 2, F] view, the module's layout there, whose
  Fp8Weight is the view's), eagerly and under jit, and the row quantizer on token-sharded rows, give the unsharded
  arrays' bits, the weights sharded over the experts and, with ``tensor``, their values and scales still split over
  the tensor axis along F (each device's part is whole 128 x 128 blocks)."""
  mesh = jax.make_mesh((2, 2), ("expert", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                       devices=jax.devices("cpu")[:4])
  E, D, F = 4, 256, 256   # every weight's both axes two blocks: two axes split in one reshape
  w1, w2 = wide_range((E, D, 2 * F), 11), wide_range((E, F, D), 12)
  on = lambda a, *spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))
  t = "tensor" if tensor else None
  sharded = (on(w1, "expert", None, t), on(w2, "expert", t, None))
  # w1's [E, D, 2, F] view, as a module with a tensor axis keeps it, split over the tensor axis along F.
  view = (on(w1.reshape(E, D, 2, F), "expert", None, None, t), sharded[1])
  want = jmo.quantize_weights(jnp.asarray(w1), jnp.asarray(w2))
  for quantize, args in ((jmo.quantize_weights, sharded), (jax.jit(jmo.quantize_weights), sharded),
                         (jmo.quantize_weights, view), (jax.jit(jmo.quantize_weights), view)):
    for got, ref_q in zip(quantize(*args), want):
      whole = lambda a, ref: np.asarray(a).reshape(ref.shape)   # the view's Fp8Weight as the whole form's
      np.testing.assert_array_equal(bits(whole(got.values, ref_q.values)), bits(ref_q.values))
      np.testing.assert_array_equal(whole(got.scales, ref_q.scales), np.asarray(ref_q.scales))
      assert got.values.sharding.spec[0] == "expert" and got.scales.sharding.spec[0] == "expert"
      if tensor:   # F (w1's 2F) still split over the tensor axis
        for a in (got.values, got.scales):
          assert "tensor" in tuple(a.sharding.spec)[1:], a.sharding
      for dequantize in (lambda q: q.dequantize(), jax.jit(lambda q: q.dequantize())):
        w = dequantize(got)
        assert w.shape == got.shape
        np.testing.assert_array_equal(np.asarray(w).reshape(ref_q.shape), np.asarray(ref_q.dequantize()))
        assert w.sharding.spec[0] == "expert"
  x = wide_range((16, D), 13)
  q, s = fp8.quantize_rows(on(x, ("expert", "tensor")), pow2=True)
  q_ref, s_ref = fp8.quantize_rows(jnp.asarray(x), pow2=True)
  np.testing.assert_array_equal(bits(q), bits(q_ref))
  np.testing.assert_array_equal(np.asarray(fp8.dequantize_rows(q, s)), np.asarray(fp8.dequantize_rows(q_ref, s_ref)))


@pytest.mark.parametrize("where", [(0, 0), (0, 1), (127, 127)])
def test_a_nan_makes_its_block_and_row_tile_nan(where):
  """fp8.py's rule for a NaN, wherever it lies in its tile: the tile's scale NaN, every value NaN, the other tiles as
  usual. XLA:CPU's max reduction over a 128 x 128 block drops a NaN at each of these places (jnp.max gives a finite
  amax), which ``fp8.tile_amax`` does not rely on."""
  w = wide_range((2, 128, 256), 3)
  w[0][where] = np.nan
  fw = jmo.quantize_weights(jnp.asarray(w), jnp.asarray(w[:, :, :128].transpose(0, 2, 1)))[0]
  assert np.isnan(np.asarray(fw.scales)[0, 0, 0]) and np.isnan(np.asarray(fw.values[0, :128], np.float32)).all()
  assert np.isfinite(np.asarray(fw.scales)[0, 1:]).all() and np.isfinite(np.asarray(fw.scales)[1]).all()
  q, s = fp8.quantize_rows(jnp.asarray(w[0]))
  r = where[0]
  assert np.isnan(np.asarray(s)[r, 0]) and np.isnan(np.asarray(q[r, :128], np.float32)).all()
  assert np.isfinite(np.delete(np.asarray(s), r, axis=0)).all() and np.isfinite(np.asarray(s)[r, 1])
