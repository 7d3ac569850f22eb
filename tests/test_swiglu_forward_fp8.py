"""The FP8 recipe's SwiGLU forward in one custom call (grouped_gemm.swiglu_forward_fp8, jmo_swiglu_forward_fp8) on its
CPU handler:

- bit for bit fp8.quantize_rows' rule (tests/fp8_numpy.py: float32 division, ml_dtypes' rounding) of h and of a,
  h computed by the formula of ffi/common/swiglu.h in numpy float32, each operation rounded on its own, with the exp
  the handler calls (the C library's expf, through ctypes), including zero rows (what the layer's rows past the
  groups hold) and non-finite values;
- against the jnp composition the recipe defines it by (fp8_experts.swiglu_forward_composed: swiglu and two
  quantize_rows, run by XLA), where only XLA's exp differs from expf and its quantize_rows multiplies by the scale's
  reciprocal: a's scales bit for bit, h's within 2^-20 relative, each value byte equal or one e4m3 step off, rarely;
- KERNELS runs the call on CPUs and GPUs alike (one call in the program lowered for either);
- inputs sharded on Auto and Explicit meshes; bitwise repeats; the refusals.
tests/gpu/test_gpu_swiglu_forward_fp8.py holds the CUDA kernel to the CPU handler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fp8_numpy
from test_swiglu_backward_fp8 import _expf, assert_e4m3_close, bits  # the C library's expf; e4m3 checks

from jax_moe_overlap import fp8, fp8_experts
from jax_moe_overlap.grouped_gemm import swiglu_forward_fp8

CASES = [  # (M, F, zero rows at the end)
    (40, 128, 5),    # one channel block
    (33, 256, 0),    # two channel blocks, no zero row
]


def inputs(case, seed):
  """a [M, 2F] float32 of many magnitudes (per row and per channel), its last rows zero (the layer's rows past the
  groups). The gates stay above -60 or so, where the logistic is a normal float32 (below about -87 it is subnormal,
  which XLA:CPU's threads flush to zero and the GPU keeps)."""
  M, F, zero = case
  rng = np.random.default_rng(seed)
  a = rng.standard_normal((M, 2 * F)) * np.exp2(rng.integers(-3, 3, (M, 1))) * 3
  a *= np.exp2(rng.integers(-3, 4, (1, 2 * F)))
  a[:, :F] = np.clip(a[:, :F], -60, None)
  a[M - zero:] = 0
  return jnp.asarray(a, jnp.float32)


def swiglu_numpy(a):
  """h [M, F] float32 by the formula of ffi/common/swiglu.h, each operation rounded once, exp by the C library's
  expf."""
  a = np.asarray(a)
  F = a.shape[1] // 2
  gate, up = a[:, :F], a[:, F:]
  one = np.float32(1)
  with np.errstate(over="ignore", invalid="ignore"):   # exp(-gate) = inf for gate < -88.7: sig = 0, as in the handler
    sig = one / (one + _expf(-gate))
    return (gate * sig) * up


def expected(a):
  with np.errstate(invalid="ignore"):
    return fp8_numpy.rows(swiglu_numpy(a)), fp8_numpy.rows(np.asarray(a))


def assert_bitwise(got, want, what):
  for name, g, w in zip(("values", "scales"), got, want):
    np.testing.assert_array_equal(bits(g), bits(w), err_msg=f"{what} {name}")


@pytest.mark.parametrize("case", CASES)
def test_equals_quantize_rows_of_the_swiglu_formula_bit_for_bit(case):
  M, F, zero = case
  a = inputs(case, seed=M + F)
  h_rows, a_rows = jax.jit(swiglu_forward_fp8)(a)
  assert h_rows[0].shape == (M, F) and h_rows[0].dtype == fp8.E4M3 and h_rows[1].shape == (M, F // 128)
  assert a_rows[0].shape == (M, 2 * F) and a_rows[0].dtype == fp8.E4M3 and a_rows[1].shape == (M, 2 * F // 128)
  want_h, want_a = expected(a)
  assert_bitwise(h_rows, want_h, "h")
  assert_bitwise(a_rows, want_a, "a")
  # Not vacuous: the values are there; a zero row gives zero bytes and scales 2^-126.
  live = M - zero
  assert np.count_nonzero(bits(h_rows[0])[:live]) > 0.9 * live * F
  assert np.count_nonzero(bits(a_rows[0])[:live]) > 0.9 * live * 2 * F
  for q, s in (h_rows, a_rows):
    assert not bits(q)[live:].any()
    np.testing.assert_array_equal(np.asarray(s)[live:], np.float32(fp8.SCALE_FLOOR))
  # a's half is quantize_rows itself, whatever the platform's exp.
  np.testing.assert_array_equal(bits(a_rows[1]), bits(jax.jit(fp8.quantize_rows)(a)[1]))


def test_non_finite_values():
  """An infinity or a NaN in a tile: its scale non-finite and its values NaN where fp8.py says (the infinity itself
  for an infinite scale; every value for a NaN), in h as in a, bit for bit the numpy rule."""
  M, F = 4, 128
  a = np.asarray(inputs((M, F, 0), seed=1)).copy()
  a[0, 3] = np.inf          # a gate: h = inf * up there (inf or NaN)
  a[1, F + 7] = np.nan      # an up: h NaN there
  a[2, 200] = -np.inf
  h_rows, a_rows = jax.jit(swiglu_forward_fp8)(jnp.asarray(a))
  want_h, want_a = expected(a)
  assert_bitwise(h_rows, want_h, "h")
  assert_bitwise(a_rows, want_a, "a")
  s = np.asarray(a_rows[1])
  assert np.isinf(s[0, 0]) and np.isnan(s[1, 1]) and np.isinf(s[2, 1]) and np.all(np.isfinite(s[3]))
  assert np.all(np.isnan(np.asarray(h_rows[0], np.float32)[1]))


@pytest.mark.parametrize("case", CASES)
def test_close_to_the_jnp_composition(case):
  """fp8_experts.swiglu_forward_composed (what DENSE and RAGGED run) differs from the call by XLA's exp (a last-bit
  difference of the logistic, so a few ulps of h: h's scales within 2^-20 relative) and by quantize_rows' reciprocal
  (see `expected` of tests/test_swiglu_backward_fp8.py): a's scales are the same product, bit for bit."""
  a = inputs(case, seed=7)
  got = jax.jit(swiglu_forward_fp8)(a)
  want = jax.jit(fp8_experts.swiglu_forward_composed)(a)
  for name, g, w in zip(("h", "a"), got, want):
    assert_e4m3_close(g[0], w[0], name)
  np.testing.assert_allclose(np.asarray(got[0][1]), np.asarray(want[0][1]), rtol=2.0**-20, atol=0)
  np.testing.assert_array_equal(bits(got[1][1]), bits(want[1][1]))


def test_kernels_run_the_call_on_cpus_and_gpus():
  a = inputs(CASES[0], seed=3)
  lowered = jax.jit(fp8_experts.KERNELS.swiglu_forward).trace(a)
  assert lowered.lower().as_text().count("jmo_swiglu_forward_fp8") == 1
  for u, v in zip(jax.tree.leaves(jax.jit(fp8_experts.KERNELS.swiglu_forward)(a)),
                  jax.tree.leaves(jax.jit(swiglu_forward_fp8)(a))):
    np.testing.assert_array_equal(bits(u), bits(v))
  for_gpu = lowered.lower(lowering_platforms=("cuda",)).as_text()
  assert for_gpu.count("jmo_swiglu_forward_fp8") == 1


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_inputs_sharded_on_auto_and_explicit_meshes(axis_type):
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:4]), ("x",), axis_types=(axis_type,))
  case = (64, 128, 4)
  a = inputs(case, seed=5)
  want = jax.jit(swiglu_forward_fp8)(a)
  with jax.set_mesh(mesh):
    got = jax.jit(swiglu_forward_fp8)(jax.device_put(a, NamedSharding(mesh, P("x", None))))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(bits(g), bits(w))


@pytest.mark.slow
def test_larger_case_bit_for_bit_and_repeatable():
  case = (1000, 384, 37)
  a = inputs(case, seed=11)
  got = jax.jit(swiglu_forward_fp8)(a)
  for name, g, w in zip(("h", "a"), got, expected(a)):
    assert_bitwise(g, w, name)
  again = jax.jit(swiglu_forward_fp8)(a)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(again)):
    np.testing.assert_array_equal(bits(g), bits(w))


def test_refusals():
  a = jnp.ones((8, 256), jnp.float32)
  with pytest.raises(TypeError, match=r"swiglu_forward_fp8: a must be a float32 \[M, 2F\] array, got bfloat16"):
    swiglu_forward_fp8(a.astype(jnp.bfloat16))
  with pytest.raises(TypeError, match=r"a must be a float32 \[M, 2F\] array"):
    swiglu_forward_fp8(jnp.ones((2, 8, 256), jnp.float32))
  with pytest.raises(ValueError, match=r"F \(half of a's 192 channels\) must be a positive multiple of 128"):
    swiglu_forward_fp8(jnp.ones((8, 192), jnp.float32))
  with pytest.raises(ValueError, match=r"F \(half of a's 128 channels\) must be a positive multiple of 128"):
    swiglu_forward_fp8(jnp.ones((8, 128), jnp.float32))
  with pytest.raises(ValueError, match=r"F \(half of a's 0 channels\)"):
    swiglu_forward_fp8(jnp.ones((8, 0), jnp.float32))
