"""The FP8 weight-gradient GEMM (grouped_gemm.grouped_outer_fp8) on its CPU handler, the emulation of the Hopper
kernel: bit for bit against fp8_numpy's restatement (chunk sums exact, rounded to float32, the per-element
promotion), close to the dequantized float64 product, with skewed and empty groups, partial tiles and rows past the
groups; and the refusals. tests/gpu/test_gpu_grouped_outer_fp8.py runs the same cases on the kernel."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8_numpy
from jax_moe_overlap import fp8
from jax_moe_overlap.grouped_gemm import grouped_outer_fp8

CASES = [  # (M, K, N, group sizes): skew, empty groups, partial tiles, rows past the last group
    (300, 128, 256, [0, 130, 150]),        # 20 rows past the groups
    (240, 256, 128, [1, 0, 3, 200]),
    (40, 128, 128, [0, 0]),                # no rows at all
]


# Jitted: one program per shape, where the eager calls compile each of their operations for each case's shapes.
_quantize_columns = jax.jit(fp8.quantize_columns)
_dequantize_columns = jax.jit(fp8.dequantize_columns)


def operands(case, seed):
  """(lhs, rhs, tiles, group sizes) as the recipe's backward makes them: rows of very different magnitudes per
  channel and row (many scales), quantized 128 x 1 per group by fp8.quantize_columns; rows past the groups hold large
  values before quantization (quantize_columns zeroes them)."""
  M, K, N, sizes = case
  rng = np.random.default_rng(seed)
  def rows(C):
    x = rng.standard_normal((M, C)) * np.exp2(rng.integers(-6, 7, (1, C))) * np.exp2(rng.integers(-4, 5, (M, 1)))
    x[sum(sizes):] = 1e4
    return jnp.asarray(x.astype(np.float32))
  gs = jnp.asarray(sizes, jnp.int32)
  tiles = fp8.column_tiles(M, gs)
  return _quantize_columns(rows(K), tiles), _quantize_columns(rows(N), tiles), tiles, gs


def group_scales(s, sizes):
  """quantize_columns' scales [tiles.count, C] as fp8_numpy.columns gives them: a list of each group's [tiles_g, C]."""
  out, base = [], 0
  for n in sizes:
    t = -(-int(n) // 128)
    out.append(np.asarray(s)[base:base + t])
    base += t
  return out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_handler_is_the_emulation(case, out_dtype):
  (lq, ls), (rq, rs), tiles, gs = operands(case, seed=len(case[3]))
  sizes = case[3]
  got = np.asarray(jax.jit(lambda l, r, t, g: grouped_outer_fp8(l, r, t, g, preferred_element_type=out_dtype))(
      (lq, ls), (rq, rs), tiles, gs).astype(jnp.float32))
  lq_np, rq_np = np.asarray(lq), np.asarray(rq)
  want = fp8_numpy.outer_fp8(lq_np, group_scales(ls, sizes), rq_np, group_scales(rs, sizes), sizes)
  if out_dtype == jnp.bfloat16:
    want = want.astype(ml_dtypes.bfloat16).astype(np.float32)
  np.testing.assert_array_equal(got, want)
  for g, n in enumerate(sizes):
    if n == 0:
      assert not np.any(got[g]), g
  # The dequantized operands' product in float64.
  lhs = np.asarray(_dequantize_columns(lq, ls, tiles), np.float64)
  rhs = np.asarray(_dequantize_columns(rq, rs, tiles), np.float64)
  off = np.concatenate([[0], np.cumsum(sizes)])
  exact = np.stack([lhs[off[g]:off[g + 1]].T @ rhs[off[g]:off[g + 1]] for g in range(len(sizes))])
  tol = 1e-6 if out_dtype == jnp.float32 else 2.0 ** -8
  assert np.max(np.abs(got - exact)) <= tol * max(np.max(np.abs(exact)), 1e-30) * 4, case
  if sum(sizes):
    assert np.max(np.abs(got)) > 0


def test_refusals():
  (lq, ls), (rq, rs), tiles, gs = operands(CASES[0], seed=0)
  with pytest.raises(TypeError, match=r"lhs and rhs must be float8_e4m3fn and their scales float32"):
    grouped_outer_fp8((lq.astype(jnp.bfloat16), ls), (rq, rs), tiles, gs)
  with pytest.raises(TypeError, match=r"preferred_element_type must be float32 or bfloat16"):
    grouped_outer_fp8((lq, ls), (rq, rs), tiles, gs, preferred_element_type=jnp.float16)
  with pytest.raises(ValueError, match=r"K and N must be positive multiples of 128, got K=64, N=256"):
    grouped_outer_fp8((lq[:, :64], ls[:, :64]), (rq, rs), tiles, gs)
  with pytest.raises(ValueError, match=r"must be \[tiles.count, K\] and \[tiles.count, N\]"):
    grouped_outer_fp8((lq, ls[:-1]), (rq, rs), tiles, gs)
  with pytest.raises(Exception, match=r"group 2 has 600 rows; group sizes must be >= 0 and, each rounded up"):
    jax.block_until_ready(grouped_outer_fp8((lq, ls), (rq, rs), tiles, jnp.asarray([0, 130, 600], jnp.int32)))
