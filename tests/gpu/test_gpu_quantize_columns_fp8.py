"""The FP8 wgrad operands' quantizer (grouped_gemm.quantize_columns_fp8) on its CUDA kernel, bit for bit against the
CPU handler, and against fp8.quantize_columns + fp8.token_contiguous (the XLA scatter and transpose) run on the same
GPU bit for bit but where XLA:GPU's inexact float32 division explains a byte (_xla_division_differences): values and
scales, float32 and bfloat16 rows, skewed and empty groups, partial tiles, rows past the groups holding
huge values, the outputs' memory poisoned first (unwritten bytes show); e4m3's rounding ties, subnormals and
non-finite values; bitwise repeats; the recipe's gradients on the GPU equal those on the XLA layout bit for bit.
Row-quantized rows (xq, xs) on their kernel (QuantizeColumnsLean<RowsE4m3>): bit for bit the CPU handler on them and
the float32 kernel on dequantize_rows(xq, xs) run on the GPU, with non-finite values and scales and zero rows (a NaN's
sign and payload aside), subnormal products (against the GPU's float32 path only: XLA:CPU flushes them); the recipe
with fp8_experts.ROW_QUANTIZED_COLUMNS_ON_GPU forced on. On a GPU that is not a Hopper one the call must fail naming
the requirement. Skips where there is no GPU."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import test_quantize_columns_fp8 as base  # tests/test_quantize_columns_fp8.py (tests/ is on pytest's pythonpath)
from gpu_common import gpu_devices, requires_gpu
from test_gpu_grouped_gemm_fp8 import _hopper, _poison_allocator, requires_hopper

from jax_moe_overlap import fp8
from jax_moe_overlap import fp8_experts
from jax_moe_overlap.grouped_gemm import quantize_columns_fp8

pytestmark = requires_gpu

BIG = [  # (M, C, sizes)
    (4096, 1024, [2000, 0, 1, 127, 129, 1500, 0, 300]),        # skew, empty groups, 39 rows past the groups
    (3000, 2048, [2999]),                                      # one group, the width of a Mixtral-like wgrad
    (20480, 1152, list(np.random.default_rng(1).multinomial(20000, np.ones(16) / 16))),   # 16 groups, 480 past
]


def _run(f, x, tiles, device):
  put = lambda v: jax.device_put(v, device)
  q, s = jax.jit(f)(put(x), jax.tree.map(put, tiles))
  return np.asarray(q).view(np.uint8), np.asarray(s)


def _kernel(x, tiles):
  M, C = x[0].shape if isinstance(x, tuple) else x.shape
  _poison_allocator((C, 128 * tiles.count), jnp.float32)   # NaN bytes where the kernel would leave any unwritten
  _poison_allocator((tiles.count, C), jnp.float32)
  return _run(quantize_columns_fp8, x, tiles, gpu_devices()[0])


# e4m3's finite positive values, ascending (bytes 0x00 .. 0x7E).
_E4M3_POS = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _xla_division_differences(q, gq, x, s, tiles):
  """The bytes where the kernel's q differs from XLA's on the GPU, each of which must be explained by XLA:GPU's float32
  division: XLA emits div.full.f32 (within 2 ulp, not correctly rounded: openxla/xla#37181) where the kernel and the
  CPU handler divide as IEEE does, so the two roundings to e4m3 may part only where x / s lies within a few float32
  ulps of a midpoint between two e4m3 values, and then by one step of e4m3. Returns the count of differing bytes."""
  diff = np.argwhere(q != gq)
  if diff.size == 0:
    return 0
  padded = np.asarray(tiles.padded_row)
  row_at = np.full(q.shape[1], -1, np.int64)
  inside = padded < q.shape[1]
  row_at[padded[inside]] = np.nonzero(inside)[0]
  xf = np.asarray(jnp.asarray(x, jnp.float32)).astype(np.float64)
  for c, p in diff:
    i = row_at[p]
    assert i >= 0, f"channel {c}, padded place {p}: no row lands there, yet the bytes differ ({q[c, p]}, {gq[c, p]})"
    y = abs(xf[i, c] / np.float64(s[p // 128, c]))
    k = np.searchsorted(_E4M3_POS, y)
    assert 0 < k < _E4M3_POS.size, f"row {i}, channel {c}: x / s = {y} is not between two e4m3 values"
    mid = (_E4M3_POS[k - 1] + _E4M3_POS[k]) / 2
    a, b = int(q[c, p]), int(gq[c, p])
    assert abs(y - mid) <= 4 * 2.0**-24 * y and (a ^ b) & 0x80 == 0 and abs((a & 0x7F) - (b & 0x7F)) == 1, (
        f"row {i}, channel {c}: kernel byte {a:#04x}, XLA:GPU {b:#04x}, x / s = {y!r}, nearest midpoint {mid!r}")
  return len(diff)


def _compare(x, sizes, nan_sign_free=False):
  """The kernel's outputs against the CPU handler (bit for bit; with nan_sign_free, a NaN's sign aside: x86 makes
  inf / inf a negative NaN, the GPU a positive one) and against the jnp definition run by XLA on the GPU: the scales bit
  for bit, the values bit for bit but where XLA:GPU's division explains the difference
  (_xla_division_differences)."""
  tiles = fp8.column_tiles(x.shape[0], jnp.asarray(sizes, jnp.int32))
  q, s = _kernel(x, tiles)
  gq, gs = _run(base.xla_path, x, tiles, gpu_devices()[0])
  cq, cs = _run(quantize_columns_fp8, x, tiles, jax.devices("cpu")[0])
  kq, ks = q, s
  if nan_sign_free:
    nan_q = (q & 0x7F) == 0x7F
    np.testing.assert_array_equal(nan_q, (cq & 0x7F) == 0x7F)
    kq, cq = np.where(nan_q, 0, q), np.where(nan_q, 0, cq)
    np.testing.assert_array_equal(np.isnan(s), np.isnan(cs))
    ks, cs = np.where(np.isnan(s), 0, s), np.where(np.isnan(cs), 0, cs)
  np.testing.assert_array_equal(kq, cq)
  np.testing.assert_array_equal(ks.view(np.uint32), cs.view(np.uint32))
  np.testing.assert_array_equal(s.view(np.uint32), gs.view(np.uint32))
  differing = _xla_division_differences(q, gq, x, s, tiles)
  assert differing <= 1e-2 * q.size, f"{differing} of {q.size} bytes differ from XLA:GPU's"
  return q, s, tiles


@requires_hopper
@pytest.mark.parametrize("case", base.CASES + BIG)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_equals_the_cpu_handler_and_the_xla_path(case, dtype):
  x = base.rows(case, dtype, seed=case[0] + case[1])
  q, s, tiles = _compare(x, case[2])
  if sum(case[2]):
    assert np.count_nonzero(q) > 0.9 * sum(case[2]) * case[1]
  q2, s2 = _kernel(x, tiles)
  np.testing.assert_array_equal(q, q2)
  np.testing.assert_array_equal(s.view(np.uint32), s2.view(np.uint32))


@requires_hopper
def test_kernel_rounding_ties_subnormals_and_non_finite_values():
  v = base._e4m3_cases()
  C, per_tile = 256, 127
  tiles_needed = -(-v.size // (per_tile * C)) + 1
  M = 128 * tiles_needed
  x = np.zeros((M, C), np.float32)
  t = x.reshape(tiles_needed, 128, C)
  t[:, 1:, :] = np.resize(v, (tiles_needed, per_tile, C))
  t[:, 0, :] = np.float32(447.99997)
  t[-1, 5, 0], t[-1, 9, 1], t[-1, 9, 2], t[-1, 3, 3], t[-1, 7, 2] = np.nan, np.inf, -np.inf, -np.nan, np.inf
  _compare(jnp.asarray(x), [M], nan_sign_free=True)


@requires_hopper
def test_recipe_gradients_equal_the_xla_layout_path_on_the_gpu():
  """The layer takes the call on GPUs: the recipe's gradients equal the XLA layout path's bit for bit."""
  with jax.default_device(gpu_devices()[0]):
    base.recipe_gradients_equal_the_xla_layout_path(fp8_experts.ROW_QUANTIZED_COLUMNS_ON_GPU)


ROW_BIG = [  # (M, C, sizes) of row-quantized rows: C a multiple of 256
    BIG[0], BIG[1],
    (20480, 1280, list(np.random.default_rng(1).multinomial(20000, np.ones(16) / 16))),   # 16 groups, 480 past
]


def _from_rows(x, tiles):
  return quantize_columns_fp8(x, tiles)          # x = (xq, xs)


def _dequantized(x, tiles):
  return base.dequantized_path(*x, tiles)        # the float32 kernel on XLA's dequantize_rows


def _same_bits(a, b, nan_free):
  """Equal bytes (e4m3 values) or words (scales); with nan_free, NaNs compared as NaNs (sign and payload aside)."""
  if nan_free:
    nan_a, nan_b = ((a & 0x7F) == 0x7F, (b & 0x7F) == 0x7F) if a.dtype == np.uint8 else (np.isnan(a), np.isnan(b))
    np.testing.assert_array_equal(nan_a, nan_b)
    a, b = np.where(nan_a, 0, a), np.where(nan_b, 0, b)
  np.testing.assert_array_equal(a.view(np.uint32) if a.dtype == np.float32 else a,
                                b.view(np.uint32) if b.dtype == np.float32 else b)


def _compare_rows(xq, xs, sizes, cpu=True, nan_free=False):
  """The row form's kernel (outputs poisoned first) against the float32 kernel on dequantize_rows run on the same GPU
  and, with cpu, the CPU handler on the same rows; bitwise repeat."""
  x = (np.asarray(xq), np.asarray(xs))
  tiles = fp8.column_tiles(x[0].shape[0], jnp.asarray(sizes, jnp.int32))
  q, s = _kernel(x, tiles)
  fq, fs = _run(_dequantized, x, tiles, gpu_devices()[0])
  _same_bits(q, fq, nan_free)
  _same_bits(s, fs, nan_free)
  if cpu:
    cq, cs = _run(_from_rows, x, tiles, jax.devices("cpu")[0])
    _same_bits(q, cq, nan_free)
    _same_bits(s, cs, nan_free)
  q2, s2 = _kernel(x, tiles)
  np.testing.assert_array_equal(q, q2)
  np.testing.assert_array_equal(s.view(np.uint32), s2.view(np.uint32))
  return q, s


@requires_hopper
@pytest.mark.parametrize("case", base.ROW_CASES + ROW_BIG)
def test_row_quantized_kernel_equals_the_cpu_handler_and_the_float32_path(case):
  M, C, sizes = case
  with jax.default_device(jax.devices("cpu")[0]):
    xq, xs = base.quantized_rows(case, seed=M + C)
  q, _ = _compare_rows(xq, xs, sizes)
  if sum(sizes):
    assert np.count_nonzero(q) > 0.9 * sum(sizes) * C


@requires_hopper
def test_row_quantized_kernel_non_finite_zero_and_tiny():
  """base.odd_rows: scales down to 2^-100 (no subnormal product) against the CPU handler too; down to 2^-126
  (subnormal products, which the kernel keeps as XLA:GPU's multiply does) against the GPU's float32 path only."""
  _compare_rows(*base.odd_rows(least_scale_log2=-100), nan_free=True)
  _compare_rows(*base.odd_rows(least_scale_log2=-126), cpu=False, nan_free=True)


@requires_hopper
def test_recipe_with_row_quantized_columns_on_the_gpu(monkeypatch):
  """fp8_experts.ROW_QUANTIZED_COLUMNS_ON_GPU forced on: x and dy reach the call row-quantized on the GPU, and the
  gradients equal those of the dequantizing recipe and of the XLA layout path bit for bit."""
  monkeypatch.setattr(fp8_experts, "ROW_QUANTIZED_COLUMNS_ON_GPU", True)
  jax.clear_caches()  # no program traced with the flag off (same functions, same shapes) may be reused
  with jax.default_device(gpu_devices()[0]):
    base.recipe_gradients_take_the_row_quantized_operands()
    base.recipe_gradients_equal_the_xla_layout_path(True)


def test_other_gpus_refuse_naming_the_requirement():
  if _hopper():
    pytest.skip("a Hopper GPU runs the kernel (test_kernel_equals_the_cpu_handler_and_the_xla_path)")
  tiles = fp8.column_tiles(256, jnp.asarray([100, 50], jnp.int32))
  with pytest.raises(Exception, match=r"needs Hopper FP8 tensor cores \(compute capability 9.x"):
    _run(quantize_columns_fp8, jnp.ones((256, 128), jnp.float32), tiles, gpu_devices()[0])
