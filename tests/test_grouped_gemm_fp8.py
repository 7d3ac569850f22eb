"""The FP8 block-scaled grouped GEMM (grouped_gemm.grouped_matmul_fp8) on its CPU handler, the emulation of the Hopper
kernel: against fp8_numpy's restatement of the emulation (chunk sums exact, rounded to float32, the kernel's
promotion) within float32 rounding, against the dequantized float64 product, with skewed and empty groups and rows
past the groups; and the refusals. tests/gpu/test_gpu_grouped_gemm_fp8.py runs the same cases on the kernel."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8_numpy
from jax_moe_overlap import fp8
from jax_moe_overlap.grouped_gemm import grouped_matmul_fp8

CASES = [  # (M, K, N, group sizes): skew, empty groups, partial tiles, rows past the last group
    (70, 128, 128, [50, 0, 13]),           # 7 tail rows
    (96, 256, 384, [1, 0, 90, 5]),
    (40, 384, 256, [0, 0, 0]),             # no rows at all: every row past the groups
]


# Jitted: one program per shape, where the eager calls compile each of their operations for each case's shapes.
_quantize_rows = jax.jit(fp8.quantize_rows)
_quantize_weight = jax.jit(fp8.quantize_weight)


def operands(case, seed):
  """Quantized operands of a case as the layer makes them: lhs rows quantized 1 x 128 (rows of very different
  magnitudes: per-row scales over 2^-8 .. 2^8), rhs [G, N, K] as fp8.quantize_weight gives Fp8Weight.values; the
  rows past the groups hold garbage (large finite values) that must not reach the output."""
  M, K, N, sizes = case
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((M, K)).astype(np.float32) * np.exp2(rng.integers(-8, 9, (M, 1))).astype(np.float32)
  w = (rng.standard_normal((len(sizes), K, N)) / np.sqrt(K)).astype(np.float32)
  w *= np.exp2(rng.integers(-3, 4, (len(sizes), K // 128, 1, N // 128, 1))).repeat(128, 2).repeat(128, 4).reshape(
      w.shape)   # a different magnitude per 128 x 128 block
  lq, ls = _quantize_rows(jnp.asarray(x))
  wq = _quantize_weight(jnp.asarray(w))
  lq = np.asarray(lq).copy()
  lq[sum(sizes):] = np.asarray(300.0, ml_dtypes.float8_e4m3fn)      # garbage past the groups
  return lq, np.asarray(ls), np.asarray(wq.values), np.asarray(wq.scales), sizes


def dequantized_f64(lq, ls, rq, rs, sizes):
  """The dequantized operands' product in float64 (the FP8 GEMM's exact value), zero past the groups."""
  M, K = lq.shape
  a = lq.astype(np.float64) * np.repeat(ls, 128, axis=1)
  out = np.zeros((M, rq.shape[1]))
  off = 0
  for g, n in enumerate(sizes):
    w = rq[g].astype(np.float64) * np.repeat(np.repeat(rs[g], 128, 0), 128, 1)      # [N, K]
    out[off:off + n] = a[off:off + n] @ w.T
    off += n
  return out


def _call(lq, ls, rq, rs, sizes, out_dtype, device=None):
  args = [jnp.asarray(v) for v in (lq, ls, rq, rs, np.asarray(sizes, np.int32))]
  if device is not None:
    args = [jax.device_put(a, device) for a in args]
  return np.asarray(jax.jit(lambda *a: grouped_matmul_fp8(*a, preferred_element_type=out_dtype))(*args)
                    .astype(jnp.float32))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_handler_is_the_emulation(case, out_dtype):
  lq, ls, rq, rs, sizes = operands(case, seed=len(case[3]))
  got = _call(lq, ls, rq, rs, sizes, out_dtype)
  want = fp8_numpy.block_scaled_grouped_gemm(lq, ls, rq, rs, sizes).astype(np.float32)
  if out_dtype == jnp.bfloat16:
    want = want.astype(ml_dtypes.bfloat16).astype(np.float32)
  np.testing.assert_array_equal(got, want)
  assert not np.any(got[sum(sizes):])
  exact = dequantized_f64(lq, ls, rq, rs, sizes)
  tol = 1e-6 if out_dtype == jnp.float32 else 2.0 ** -8
  assert np.max(np.abs(got - exact)) <= tol * max(np.max(np.abs(exact)), 1e-30) * 4, case
  if sum(sizes):
    assert np.max(np.abs(got)) > 0


def test_matches_the_recipes_ragged_dot_backend():
  """The same quantized operands through the recipe's XLA backend (dequantize, ragged_dot in float32) agree within
  float32 rounding."""
  from jax_moe_overlap import fp8_experts
  lq, ls, rq, rs, sizes = operands(CASES[1], seed=7)
  w = fp8.Fp8Weight(jnp.asarray(rq), jnp.asarray(rs))
  gs = jnp.asarray(sizes, jnp.int32)
  got = fp8_experts.KERNELS.rows(jnp.asarray(lq), jnp.asarray(ls), w, gs)
  want = fp8_experts.RAGGED.rows(jnp.asarray(lq), jnp.asarray(ls), w, gs)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_refusals():
  lq, ls, rq, rs, sizes = operands(CASES[0], seed=0)
  args = [jnp.asarray(v) for v in (lq, ls, rq, rs)]
  gs = jnp.asarray(sizes, jnp.int32)
  with pytest.raises(TypeError, match=r"lhs and rhs must be float8_e4m3fn and their scales float32"):
    grouped_matmul_fp8(args[0].astype(jnp.bfloat16), *args[1:], gs)
  with pytest.raises(TypeError, match=r"preferred_element_type must be float32 or bfloat16"):
    grouped_matmul_fp8(*args, gs, preferred_element_type=jnp.float16)
  with pytest.raises(ValueError, match=r"K and N must be positive multiples of 128 .* got K=64, N=128"):
    grouped_matmul_fp8(args[0][:, :64], args[1][:, :0], args[2][:, :, :64], args[3][:, :, :0], gs)
  with pytest.raises(ValueError, match=r"do not fit lhs \[M, K\], lhs_scales \[M, K/128\]"):
    grouped_matmul_fp8(args[0], args[1][:-1], *args[2:], gs)
  with pytest.raises(Exception, match=r"group 0 has 71 rows; group sizes must be >= 0 and sum to at most 70"):
    jax.block_until_ready(grouped_matmul_fp8(*args, jnp.asarray([71, 0, 0], jnp.int32)))
