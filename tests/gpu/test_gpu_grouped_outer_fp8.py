"""The FP8 weight-gradient GEMM (grouped_outer_fp8) on Hopper's e4m3 wgmma kernel against its CPU emulation (the
CPU handler's rule restated in NumPy, fp8_numpy.outer_fp8) and the dequantized float64 product: operands quantized
128 x 1 by fp8.quantize_columns with per-channel and per-row magnitudes spread widely, skewed and empty groups,
partial tiles, rows past the groups, the output's memory poisoned (NaN) first; bitwise repeats. On a GPU that is not a
Hopper one the call must fail naming the requirement. Skips where there is no GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_numpy
import test_grouped_outer_fp8 as base  # tests/test_grouped_outer_fp8.py (tests/ is on pytest's pythonpath)
from gpu_common import gpu_devices, requires_gpu
from test_gpu_grouped_gemm_fp8 import TOL, _poison_allocator, requires_hopper, _hopper

from jax_moe_overlap import fp8
from jax_moe_overlap.grouped_gemm import grouped_outer_fp8

pytestmark = requires_gpu

BIG = [  # (M, K, N, sizes)
    (4096, 1024, 2048, [2000, 0, 1, 127, 129, 1500, 0, 300]),   # skew, empty groups, 39 rows past the groups
    (2048, 256, 384, [256, 512, 0, 1024, 256]),                 # exact tiles; N % 256 == 128 (a half tile)
    (3000, 2048, 1408, [2999]),                                 # one group, K and N of a Mixtral-like wgrad
]


def _call(lhs, rhs, tiles, gs, out_dtype, device):
  put = lambda v: jax.device_put(v, device)
  return np.asarray(jax.jit(lambda l, r, t, g: grouped_outer_fp8(l, r, t, g, preferred_element_type=out_dtype))(
      jax.tree.map(put, lhs), jax.tree.map(put, rhs), jax.tree.map(put, tiles), put(gs)).astype(jnp.float32))


@requires_hopper
@pytest.mark.parametrize("case", base.CASES + BIG)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_the_emulation(case, out_dtype):
  lhs, rhs, tiles, gs = base.operands(case, seed=case[0] + case[1])
  sizes, K, N = case[3], case[1], case[2]
  _poison_allocator((len(sizes), K, N), out_dtype)
  got = _call(lhs, rhs, tiles, gs, out_dtype, gpu_devices()[0])
  emu = fp8_numpy.outer_fp8(np.asarray(lhs[0]), base.group_scales(lhs[1], sizes), np.asarray(rhs[0]),
                            base.group_scales(rhs[1], sizes), sizes)
  a = np.asarray(fp8.dequantize_columns(*lhs, tiles), np.float64)
  b = np.asarray(fp8.dequantize_columns(*rhs, tiles), np.float64)
  off = np.concatenate([[0], np.cumsum(sizes)])
  exact = np.stack([a[off[g]:off[g + 1]].T @ b[off[g]:off[g + 1]] for g in range(len(sizes))])
  scale = max(float(np.max(np.abs(exact))), 1e-30)
  assert np.max(np.abs(got - emu)) <= TOL[out_dtype] * scale, (case, np.max(np.abs(got - emu)) / scale)
  assert np.max(np.abs(got - exact)) <= TOL[out_dtype] * scale, case
  for g, n in enumerate(sizes):
    if n == 0:
      assert not np.any(got[g]), f"group {g} has no rows: its gradient must be zero"
  assert np.all(np.isfinite(got))
  np.testing.assert_array_equal(got, _call(lhs, rhs, tiles, gs, out_dtype, gpu_devices()[0]))


def test_other_gpus_refuse_naming_the_requirement():
  if _hopper():
    pytest.skip("a Hopper GPU runs the kernel (test_kernel_matches_the_emulation)")
  lhs, rhs, tiles, gs = base.operands(base.CASES[0], seed=0)
  with pytest.raises(Exception, match=r"needs Hopper FP8 tensor cores \(compute capability 9.x"):
    _call(lhs, rhs, tiles, gs, jnp.float32, gpu_devices()[0])
