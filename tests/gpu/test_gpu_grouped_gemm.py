"""The bare grouped GEMMs on the CUDA kernels against float64 numpy: the CPU suite's cases (tests/test_grouped_gemm.py)
plus shapes with many tiles per group, both tile engines (bf16 tensor cores, fp32 SIMT), the transposed-rhs and the
weight-gradient forms; and bitwise-identical repeats; and GEMM1 with its SwiGLU (on Hopper the fused epilogue: its
preactivation bitwise equal to the bare grouped GEMM's). Skips where there is no GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu_common import gpu_devices, requires_gpu
import test_grouped_gemm as base  # tests/test_grouped_gemm.py (tests/ is on pytest's pythonpath)

from jax_moe_overlap import engines
from jax_moe_overlap.grouped_gemm import grouped_matmul, grouped_outer

pytestmark = requires_gpu

BIG = [
    (2048, 256, 384, [700, 0, 13, 129, 1000, 6]),   # multi-tile groups, partial tiles, an empty group, 200 tail rows
    (1024, 512, 136, [128, 256, 512, 128]),          # exact tiles, N not a multiple of 128
    (512, 72, 200, [511]),                           # K not a multiple of 32, one tail row
]
DTYPES = [(jnp.float32, None, 1e-5), (jnp.bfloat16, jnp.float32, 1e-4), (jnp.bfloat16, None, 1e-2)]


def _on_gpu(*xs):
  return [jax.device_put(x, gpu_devices()[0]) for x in xs]


@pytest.mark.parametrize("case", base.CASES + BIG)
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("dtype,out_dtype,tol", DTYPES)
def test_grouped_matmul_gpu(case, transpose, dtype, out_dtype, tol):
  M, K, N, sizes = case
  G = len(sizes)
  lhs, rhs = base._inputs(M + K + 1, (M, K), (G, N, K) if transpose else (G, K, N), dtype=dtype)
  lhs, rhs, gs = _on_gpu(lhs, rhs, jnp.asarray(sizes, jnp.int32))
  fn = jax.jit(lambda a, b, s: grouped_matmul(a, b, s, transpose_rhs=transpose, preferred_element_type=out_dtype))
  out = fn(lhs, rhs, gs)
  ref = base._ref_matmul(base._f64(lhs), base._f64(rhs), sizes, transpose)
  err = base._rel(out.astype(jnp.float32), ref)
  assert err < tol, err
  assert np.all(np.asarray(out[sum(sizes):].astype(jnp.float32)) == 0.0)
  again = fn(lhs, rhs, gs)
  assert np.array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(again.astype(jnp.float32)))


@pytest.mark.parametrize("case", base.CASES + BIG)
@pytest.mark.parametrize("dtype,out_dtype,tol", DTYPES)
def test_grouped_outer_gpu(case, dtype, out_dtype, tol):
  M, K, N, sizes = case
  lhs, rhs = base._inputs(M * 3 + K, (M, K), (M, N), dtype=dtype)
  lhs, rhs, gs = _on_gpu(lhs, rhs, jnp.asarray(sizes, jnp.int32))
  out = jax.jit(lambda a, b, s: grouped_outer(a, b, s, preferred_element_type=out_dtype))(lhs, rhs, gs)
  ref = base._ref_outer(base._f64(lhs), base._f64(rhs), sizes)
  err = base._rel(out.astype(jnp.float32), ref)
  assert err < tol, err


SWIGLU_BIG = [  # (M, K, F, sizes): the fused kernel's shapes on Hopper (K % 64, F % 32), F not a multiple of 128
    (2048, 256, 192, [700, 0, 13, 129, 1000, 6]),
    (1024, 512, 64, [128, 256, 512, 128]),
    (512, 128, 288, [511]),
]


@pytest.mark.parametrize("case", base.SWIGLU_CASES + SWIGLU_BIG)
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("keep", [True, False])
def test_grouped_matmul_swiglu_gpu(case, dtype, tol, keep):
  with jax.default_device(gpu_devices()[0]):
    fn, (lhs, rhs, gs), (h, a) = base.check_grouped_matmul_swiglu(case, dtype, keep, tol, seed=1)
    h2, _ = fn(lhs, rhs, gs)
    assert np.array_equal(np.asarray(h.astype(jnp.float32)), np.asarray(h2.astype(jnp.float32)))  # repeatable
    if keep:
      # The preactivation is the bare grouped GEMM's float32 output, bit for bit (the same tiles, the same k order).
      bare = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, preferred_element_type=jnp.float32))(lhs, rhs, gs)
      assert np.array_equal(np.asarray(a), np.asarray(bare))


def test_grouped_matmul_swiglu_fused_on_hopper():
  """The fused path is what runs on a Hopper GPU for bf16 operands of the kernel's shapes (and only there)."""
  from gpu_common import is_hopper  # pylint: disable=g-import-not-at-top
  assert engines.swiglu_fused(True, 256, 192) == is_hopper()
  assert not engines.swiglu_fused(False, 256, 192)
  assert not engines.swiglu_fused(True, 200, 192) and not engines.swiglu_fused(True, 256, 100)
