"""The FP8 recipe's SwiGLU backward in one custom call (grouped_gemm.swiglu_backward_fp8, jmo_swiglu_backward_fp8) on
its CPU handler:

- bit for bit the quantizers of fp8.py (quantize_rows of da; quantize_columns + token_contiguous of da and of h),
  restated in numpy float32, on da and h computed by the formula of ffi/common/swiglu.h in numpy float32, each
  operation rounded on its own, with the exp the handler calls (the C library's expf, through ctypes): the call is
  exactly those three quantizations of that SwiGLU backward, in one pass;
- against the jnp composition the recipe defines it by (fp8_experts.swiglu_backward_composed: jax.vjp of swiglu, run
  by XLA), where only XLA's exp differs from expf (and its quantize_rows multiplies by the scale's reciprocal): the
  scales within 2^-16 relative, each value byte equal or one e4m3 step off, and rarely;
- skewed and empty groups, partial tiles, rows past the groups holding large values (zero bytes and scales 2^-126 in
  da's rows, nowhere in the columns), one and several channel blocks; inputs sharded on Auto and Explicit meshes;
  bitwise repeats; dh in bfloat16 (the compute dtype's dgrad) bit for bit its float32 values; the refusals.
tests/gpu/test_gpu_swiglu_backward_fp8.py holds the CUDA kernel to the CPU handler."""

import ctypes
import ctypes.util

import ml_dtypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jax_moe_overlap import fp8, fp8_experts
from jax_moe_overlap.grouped_gemm import swiglu_backward_fp8

CASES = [  # (M, F, group sizes)
    (300, 128, [0, 130, 150]),           # 20 rows past the groups, an empty group, partial tiles
    (260, 256, [1, 0, 3, 128, 100]),     # one-row groups, a group of exactly one tile, two channel blocks, 28 past
    (128, 128, [128]),                   # one whole tile, no row past
    (40, 128, [0, 0]),                   # no rows at all: every tile empty, every row past
]

_libm = ctypes.CDLL(ctypes.util.find_library("m"))
_libm.expf.restype = ctypes.c_float
_libm.expf.argtypes = [ctypes.c_float]
_expf = np.vectorize(lambda v: np.float32(_libm.expf(float(v))), otypes=[np.float32])


def inputs(case, seed):
  """(aq, a_s, dh): a of many magnitudes quantized 1 x 128, dh of many magnitudes; the rows past the groups hold
  large values in a and dh (the call must ignore them). The gates stay above -60 or so, where the logistic is a normal
  float32: below about -87 it is subnormal, which XLA:CPU's threads flush to zero (the CPU handler runs on them) and
  the GPU keeps."""
  M, F, sizes = case
  rng = np.random.default_rng(seed)
  a = rng.standard_normal((M, 2 * F)) * np.exp2(rng.integers(-3, 3, (M, 1))) * 3
  dh = rng.standard_normal((M, F)) * np.exp2(rng.integers(-6, 7, (1, F))) * np.exp2(rng.integers(-4, 5, (M, 1)))
  rows = sum(sizes)
  a[rows:] = 1e4
  dh[rows:] = 1e30
  aq, a_s = fp8.quantize_rows(jnp.asarray(a, jnp.float32))
  return aq, a_s, jnp.asarray(dh, jnp.float32)


def swiglu_numpy(aq, a_s, dh, rows):
  """(h, da) in float32 by the formula of ffi/common/swiglu.h, each operation rounded once, exp by the C library's
  expf; rows past `rows` zero (the layer's dh and a are zero there)."""
  a = np.asarray(fp8.dequantize_rows(aq, a_s))
  F = a.shape[1] // 2
  gate, up, d = a[:, :F], a[:, F:], np.asarray(dh)
  one = np.float32(1)
  with np.errstate(over="ignore"):   # exp(-gate) = inf for gate < -88.7: sig = 0, as in the handler
    e = _expf(-gate)
  sig = one / (one + e)
  silu = gate * sig
  j = d * up
  h = silu * up
  da = np.concatenate([j * sig + (gate * j) * (sig * (one - sig)), silu * d], axis=1)
  h[rows:], da[rows:] = 0, 0
  return h, da


def _quantize(x, s):
  """fp8._quantize in numpy: the float32 division as IEEE rounds it, then round_e4m3 (ml_dtypes: to nearest even)."""
  return np.clip(x / s, -fp8.E4M3_MAX, fp8.E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)


def _scale(amax):
  return np.maximum(amax * fp8.E4M3_MAX_INV, np.float32(fp8.SCALE_FLOOR))


def expected(h, da, sizes, count):
  """fp8.quantize_rows of da and fp8.quantize_columns + token_contiguous of da and h, restated in numpy float32:
  XLA:CPU's quantize_rows multiplies by a reciprocal of the scale (one float32 ulp off x / s now and then, which moves
  a value at an e4m3 midpoint to the other side), while the rule, the call and fp8.quantize_columns divide."""
  M, C = da.shape
  t = da.reshape(M, C // 128, 128)
  s = _scale(np.abs(t).max(axis=-1))
  rows = (_quantize(t, s[..., None]).reshape(M, C), s)

  def cols(v):
    q_t = np.zeros((v.shape[1], 128 * count), ml_dtypes.float8_e4m3fn)
    sc = np.full((count, v.shape[1]), np.float32(fp8.SCALE_FLOOR))
    first, tile = 0, 0
    for n in sizes:
      for i in range(0, n, 128):
        block = v[first + i:first + min(n, i + 128)]
        sc[tile] = _scale(np.abs(block).max(axis=0))
        q_t[:, 128 * tile:128 * tile + block.shape[0]] = _quantize(block, sc[tile]).T
        tile += 1
      first += n
    return q_t, sc

  return rows, cols(da), cols(h)


def bits(a):
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def assert_bitwise(got, want, what):
  for name, g, w in zip(("values", "scales"), got, want):
    np.testing.assert_array_equal(bits(g), bits(w), err_msg=f"{what} {name}")


def call(case, seed):
  M, F, sizes = case
  aq, a_s, dh = inputs(case, seed)
  tiles = fp8.column_tiles(M, jnp.asarray(sizes, jnp.int32))
  return (aq, a_s, dh, tiles), jax.jit(swiglu_backward_fp8)(aq, a_s, dh, tiles)


@pytest.mark.parametrize("case", CASES)
def test_equals_the_quantizers_of_the_swiglu_formula_bit_for_bit(case):
  M, F, sizes = case
  (aq, a_s, dh, tiles), (da_rows, da_cols, h_cols) = call(case, seed=M + F)
  assert da_rows[0].shape == (M, 2 * F) and da_rows[1].shape == (M, 2 * F // 128)
  assert da_cols[0].shape == (2 * F, 128 * tiles.count) and da_cols[1].shape == (tiles.count, 2 * F)
  assert h_cols[0].shape == (F, 128 * tiles.count) and h_cols[1].shape == (tiles.count, F)
  h, da = swiglu_numpy(aq, a_s, dh, sum(sizes))
  want_rows, want_da, want_h = expected(h, da, sizes, tiles.count)
  assert_bitwise(da_rows, want_rows, "da 1 x 128")
  assert_bitwise(da_cols, want_da, "da 128 x 1")
  assert_bitwise(h_cols, want_h, "h 128 x 1")
  # Not vacuous: the groups' values are there; the rows past them are zero rows; the places no row takes are zero.
  rows = sum(sizes)
  q = bits(da_rows[0])
  if rows:
    assert np.count_nonzero(q[:rows]) > 0.9 * rows * 2 * F
    assert np.count_nonzero(bits(h_cols[0])) > 0.9 * rows * F
  assert not q[rows:].any()
  np.testing.assert_array_equal(np.asarray(da_rows[1])[rows:], np.float32(fp8.SCALE_FLOOR))
  used = 128 * sum(-(-n // 128) for n in sizes)
  np.testing.assert_array_equal(np.asarray(h_cols[1])[used // 128:], np.float32(fp8.SCALE_FLOOR))


def assert_e4m3_close(got, want, what, fraction=1e-3):
  """e4m3 bytes equal, or one step apart with the same sign (a float32 ulp of a value, or of its quotient by the
  scale, moved across a rounding midpoint), at most `fraction` of them. Returns how many differ."""
  g, w = bits(got).astype(np.int32), bits(want).astype(np.int32)
  off = g != w
  assert np.all((g[off] ^ w[off]) & 0x80 == 0), (what, "sign")
  assert np.all(np.abs((g[off] & 0x7F) - (w[off] & 0x7F)) == 1), (what, "more than one e4m3 step")
  assert off.sum() <= fraction * g.size, (what, int(off.sum()), g.size)
  return int(off.sum())


@pytest.mark.parametrize("case", CASES[:2])
def test_close_to_the_jnp_composition(case):
  """The composition the recipe's XLA paths run (fp8_experts.swiglu_backward_composed) differs from the call by XLA's
  exp (and quantize_rows' reciprocal, see `expected`) only: each scale within 2^-16 relative (a last-bit difference
  of the logistic, amplified where d_gate's two terms cancel, near gate = -1.28), each value equal or one e4m3 step
  off."""
  M, F, sizes = case
  (aq, a_s, dh, tiles), (da_rows, da_cols, h_cols) = call(case, seed=7)
  rows = sum(sizes)
  dh0 = dh.at[rows:].set(0.0)   # the layer's dh and a are zero past the groups
  aq0, a_s0 = aq.at[rows:].set(jnp.zeros((), fp8.E4M3)), a_s.at[rows:].set(np.float32(fp8.SCALE_FLOOR))

  def composed(aq, a_s, dh):
    h_c, da_r, da_c = fp8_experts.swiglu_backward_composed(fp8.quantize_columns)(aq, a_s, dh, tiles)
    return da_r, (fp8.token_contiguous(da_c[0], tiles), da_c[1]), (fp8.token_contiguous(h_c[0], tiles), h_c[1])

  want = jax.jit(composed)(aq0, a_s0, dh0)
  for name, got, w in zip(("da 1 x 128", "da 128 x 1", "h 128 x 1"), (da_rows, da_cols, h_cols), want):
    assert_e4m3_close(got[0], w[0], name)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(w[1]), rtol=2.0**-16, atol=0, err_msg=name)
  # The call on the zeroed rows equals the call on the large ones: nothing past the groups is read.
  again = jax.jit(swiglu_backward_fp8)(aq0, a_s0, dh0, tiles)
  for got, w in zip(jax.tree.leaves((da_rows, da_cols, h_cols)), jax.tree.leaves(again)):
    np.testing.assert_array_equal(bits(got), bits(w))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_inputs_sharded_on_auto_and_explicit_meshes(axis_type):
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:4]), ("x",), axis_types=(axis_type,))
  case = CASES[1]
  (aq, a_s, dh, tiles), want = call(case, seed=3)
  with jax.set_mesh(mesh):
    got = jax.jit(swiglu_backward_fp8)(aq, a_s, jax.device_put(dh, NamedSharding(mesh, P(None, "x"))), tiles)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(bits(g), bits(w))


@pytest.mark.parametrize("case", CASES)
def test_bfloat16_dh_is_its_float32_values(case):
  """dh in bfloat16 (the dgrad in the compute dtype) gives the bits of its values widened to float32: the handler
  reads each bfloat16 exactly."""
  M, F, sizes = case
  aq, a_s, dh = inputs(case, seed=M + 7)
  dh16 = dh.astype(jnp.bfloat16)
  tiles = fp8.column_tiles(M, jnp.asarray(sizes, jnp.int32))
  f = jax.jit(swiglu_backward_fp8)
  got, want = f(aq, a_s, dh16, tiles), f(aq, a_s, dh16.astype(jnp.float32), tiles)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(bits(g), bits(w))
  if sum(sizes):
    assert np.count_nonzero(bits(got[0][0])) > 0   # not vacuous


@pytest.mark.parametrize("switch_on", [False, True], ids=["switch_off", "switch_on"])
def test_bfloat16_dh_kernel_on_gpus_by_its_switch(monkeypatch, switch_on):
  """KERNELS.swiglu_backward hands a bfloat16 dh to the call as it is on CPUs, and on GPUs only with
  BF16_DH_KERNEL_ON_GPU (else widened to float32 first: the same values)."""
  monkeypatch.setattr(fp8_experts, "BF16_DH_KERNEL_ON_GPU", switch_on)
  M, F, sizes = CASES[0]
  aq, a_s, dh = inputs(CASES[0], seed=5)
  tiles = fp8.column_tiles(M, jnp.asarray(sizes, jnp.int32))
  traced = jax.jit(lambda *a: fp8_experts.KERNELS.swiglu_backward(*a)).trace(aq, a_s, dh.astype(jnp.bfloat16), tiles)
  operand = f"tensor<{M}x{F}xbf16>"

  def call_line(text):
    return next(line for line in text.splitlines() if "jmo_swiglu_backward_fp8" in line and "custom_call" in line)

  assert operand in call_line(traced.lower().as_text())
  assert (operand in call_line(traced.lower(lowering_platforms=("cuda",)).as_text())) == switch_on


@pytest.mark.slow
def test_larger_case_bit_for_bit_and_repeatable():
  sizes = list(np.random.default_rng(2).multinomial(1900, np.ones(9) / 9)) + [0]
  case = (2000, 384, sizes)
  (aq, a_s, dh, tiles), got = call(case, seed=11)
  h, da = swiglu_numpy(aq, a_s, dh, sum(sizes))
  for name, g, w in zip(("da rows", "da cols", "h cols"), got, expected(h, da, sizes, tiles.count)):
    assert_bitwise(g, w, name)
  again = jax.jit(swiglu_backward_fp8)(aq, a_s, dh, tiles)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(again)):
    np.testing.assert_array_equal(bits(g), bits(w))


def test_refusals():
  M, F = 256, 128
  tiles = fp8.column_tiles(M, jnp.asarray([100, 50], jnp.int32))
  aq = jnp.zeros((M, 2 * F), fp8.E4M3)
  a_s = jnp.ones((M, 2), jnp.float32)
  dh = jnp.ones((M, F), jnp.float32)
  with pytest.raises(TypeError, match=r"aq must be a float8_e4m3fn \[M, 2F\] array, a_s float32 and dh float32 or "
                                     r"bfloat16"):
    swiglu_backward_fp8(aq.astype(jnp.float32), a_s, dh, tiles)
  with pytest.raises(TypeError, match=r"aq must be a float8_e4m3fn"):
    swiglu_backward_fp8(aq, a_s, dh.astype(jnp.float16), tiles)
  with pytest.raises(ValueError, match=r"F \(half of aq's 192 channels\) must be a positive multiple of 128"):
    swiglu_backward_fp8(jnp.zeros((M, 192), fp8.E4M3), jnp.ones((M, 1), jnp.float32), jnp.ones((M, 96)), tiles)
  with pytest.raises(ValueError, match=r"do not fit aq \[M, 2F\], a_s \[M, 2F / 128\], dh \[M, F\]"):
    swiglu_backward_fp8(aq, a_s, jnp.ones((M, 2 * F), jnp.float32), tiles)
  with pytest.raises(ValueError, match=r"tiles were made for 256 rows, aq has 255"):
    swiglu_backward_fp8(aq[:255], a_s[:255], dh[:255], tiles)
  bad = fp8.column_tiles(M, jnp.asarray([100, 200], jnp.int32))
  with pytest.raises(Exception, match=r"swiglu_backward_fp8: group 1 has 200 rows; group sizes must be >= 0 and sum to "
                                      r"at most 256 \(the rows of aq\)"):
    jax.block_until_ready(swiglu_backward_fp8(aq, a_s, dh, bad))
  negative = fp8.column_tiles(M, jnp.asarray([-1, 2], jnp.int32))
  with pytest.raises(Exception, match=r"group 0 has -1 rows"):
    jax.block_until_ready(swiglu_backward_fp8(aq, a_s, dh, negative))
