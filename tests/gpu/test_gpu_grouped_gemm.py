"""The bare grouped GEMMs on the CUDA kernels against float64 numpy: the CPU suite's cases (tests/test_grouped_gemm.py)
plus shapes with many tiles per group, both tile engines (bf16 tensor cores, fp32 SIMT), the transposed-rhs and the
weight-gradient forms; and bitwise-identical repeats; GEMM1 with its SwiGLU (on Hopper the fused epilogue: its
preactivation bitwise equal to the bare grouped GEMM's); and on Hopper the backward's d_out W2^T with the SwiGLU's
gradient in its epilogue (grouped_matmul_swiglu_grad) against the unfused path (grouped_matmul's float32 dh, then
XLA's jax.vjp of swiglu). Skips where there is no GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu_common import gpu_devices, requires_gpu
import test_grouped_gemm as base  # tests/test_grouped_gemm.py (tests/ is on pytest's pythonpath)

from jax_moe_overlap import engines
from jax_moe_overlap import expert_gemms
from jax_moe_overlap.grouped_gemm import grouped_matmul, grouped_matmul_swiglu, grouped_outer

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


@pytest.mark.parametrize("case", base.SWIGLU_CASES + SWIGLU_BIG)
def test_grouped_matmul_swiglu_keeps_a_rounded_once_gpu(case):
  """a kept in bfloat16 (the layer's residual): the float32 preactivation rounded once, h the same bits, by the
  fused kernel's epilogue (Hopper, the big shapes) and elsewhere (the small shapes: the custom call's float32 a,
  rounded by XLA)."""
  with jax.default_device(gpu_devices()[0]):
    base.check_preactivation_rounded_once(case, seed=1)
    M, K, F, sizes = case
    if not engines.swiglu_fused(True, K, F):
      # The custom call itself refuses a bf16 a where the fused epilogue does not run, naming what to ask for.
      lhs, rhs, gs = _on_gpu(jnp.ones((M, K), jnp.bfloat16), jnp.ones((len(sizes), K, 2 * F), jnp.bfloat16),
                             jnp.asarray(sizes, jnp.int32))
      with pytest.raises(jax.errors.JaxRuntimeError, match="ask for the preactivation in float32"):
        jax.block_until_ready(base.raw_swiglu_call_keeping_bf16_a(lhs, rhs, gs))


def test_grouped_matmul_swiglu_fused_on_hopper():
  """The fused path is what runs on a Hopper GPU for bf16 operands of the kernel's shapes (and only there)."""
  from gpu_common import is_hopper  # pylint: disable=g-import-not-at-top
  assert engines.swiglu_fused(True, 256, 192) == is_hopper()
  assert not engines.swiglu_fused(False, 256, 192)
  assert not engines.swiglu_fused(True, 200, 192) and not engines.swiglu_fused(True, 256, 100)


@pytest.mark.parametrize("K", [1024, 1000])  # the fused epilogue on Hopper (K % 64 == 0); the unfused kernel
def test_swiglu_h_within_one_bf16_ulp_of_its_preactivation(K):
  """h against silu(gate) * up in float64 from the kept float32 a, over rows scaled 2^-24..2^24 (gates whose exp
  overflows): within one bf16 ulp wherever 1 + exp(-gate) < 2^126; above it (|silu(gate)| < 2^-126 |gate|) the
  quotient by __fdividef is 0, so |h| stays under 2^-126 |gate * up| there, within h's rounding (activation.cuh)."""
  rng = np.random.default_rng(7)
  M, F, sizes = 2048, 256, [900, 0, 611, 500]
  x = rng.standard_normal((M, K), dtype=np.float32) * np.exp2((np.arange(M) % 49 - 24).astype(np.float32))[:, None]
  w = rng.standard_normal((len(sizes), K, 2 * F), dtype=np.float32) / np.sqrt(K)
  lhs, rhs, gs = _on_gpu(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), jnp.asarray(sizes, jnp.int32))
  h, a = jax.jit(lambda *o: grouped_matmul_swiglu(*o, keep_preactivation=True))(lhs, rhs, gs)
  h = np.asarray(h.astype(jnp.float32)).astype(np.float64)
  g, up = np.asarray(a, np.float64)[:, :F], np.asarray(a, np.float64)[:, F:]
  with np.errstate(over="ignore", invalid="ignore"):
    den = 1.0 + np.exp(-g)
    ref = g / den * up
  # (float32's den can round up to 2^126 where float64's is just below it: the band under 2^126 joins the bound)
  in_range = den < 0.999 * 2.0**126
  assert np.count_nonzero(in_range) > 0.5 * h.size and np.count_nonzero(~in_range) > 0  # both regimes reached
  ulps = np.abs(_bf16_order(h) - _bf16_order(ref))
  assert ulps[in_range].max() <= 1, (int(ulps[in_range].max()), int(np.count_nonzero(ulps[in_range] > 1)))
  assert np.all(np.abs(h[~in_range]) <= 1.01 * 2.0**-126 * np.abs(g * up)[~in_range])
  print(f"\nK={K}: {int(np.count_nonzero(ulps[in_range]))} of {int(in_range.sum())} elements 1 bf16 ulp off; "
        f"{int(np.count_nonzero(h[~in_range] != ref[~in_range]))} of {int((~in_range).sum())} past 2^126 not the "
        "float64 value")


def _bf16_order(v):
  """v rounded to bfloat16, its bits as integers in the values' order (a difference counts ulps, across zero too)."""
  u = np.asarray(jnp.asarray(v, jnp.bfloat16)).view(np.uint16).astype(np.int64)
  return np.where(u & 0x8000, -(u & 0x7FFF), u)


SWIGLU_GRAD_BIG = [  # (M, K, F, sizes): the fused kernel's shapes (K % 64, F % 64), F not a multiple of 256
    (2048, 256, 192, [700, 0, 13, 129, 1000, 6]),  # multi-tile groups, partial tiles, an empty group, 200 tail rows
    (1024, 512, 320, [128, 256, 512, 128]),         # exact row tiles; a 64-column last column tile
    (512, 128, 64, [0, 511, 0]),                     # one group has every row but the tail one
    (1200, 2048, 768, [1000, 50, 50, 0]),           # the training preset's K = D = 2048, skewed
]


def _bf16_ulps(got, want):
  """Per element: |got - want| in bfloat16 ulps of max(|got|, |want|) (0 where both are 0)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = np.maximum(np.abs(got), np.abs(want))
  ulp = np.where(scale > 0, 2.0 ** (np.floor(np.log2(np.where(scale > 0, scale, 1.0))) - 7), 1.0)
  return np.abs(got - want) / ulp


@pytest.mark.parametrize("case", SWIGLU_GRAD_BIG)
@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("a_dtype", [jnp.float32, jnp.bfloat16], ids=["a_f32", "a_bf16"])
def test_grouped_matmul_swiglu_grad_gpu(case, transpose, a_dtype):
  """The fused epilogue (Hopper): against float64 numpy, into a NaN-poisoned output (tests/test_grouped_gemm.py's
  check), repeatable bit for bit, and against the unfused path the layer runs elsewhere (grouped_matmul's float32 dh,
  then jax.vjp of swiglu by XLA, rounded to bf16): within one bf16 ulp element by element (the dh tiles are the bare
  GEMM's, bit for bit; the two compute the same float32 expressions in the same order, so they differ only where
  XLA's exp or FMA contraction rounds otherwise than expf and the epilogue's one-rounding-per-operation). Prints how
  many elements are bitwise equal."""
  M, K, F, _ = case
  if not engines.swiglu_grad_fused(True, K, F, transpose):
    pytest.skip("no engine of this GPU has the SwiGLU-gradient epilogue (the wgmma engine: Hopper)")
  with jax.default_device(gpu_devices()[0]):
    fn, (d_out, w, gs, a), da = base.check_grouped_matmul_swiglu_grad(case, transpose, jnp.bfloat16, 1e-2, seed=2,
                                                                      a_dtype=a_dtype)
    again = fn(d_out, w, gs, a)
    assert np.array_equal(np.asarray(da.astype(jnp.float32)), np.asarray(again.astype(jnp.float32)))
    unfused = jax.jit(lambda x, w, s, a: expert_gemms.swiglu_grad(
        a, grouped_matmul(x, w, s, transpose_rhs=transpose, preferred_element_type=jnp.float32), jnp.bfloat16))(
            d_out, w, gs, a)
  got, want = np.asarray(da.astype(jnp.float32)), np.asarray(unfused.astype(jnp.float32))
  ulps = _bf16_ulps(got, want)
  same = int(np.sum(got.view(np.uint32) == want.view(np.uint32)))
  print(f"swiglu_grad M={M} K={K} F={F} transpose={transpose}: {same} of {got.size} elements bitwise equal to the "
        f"unfused path, max {ulps.max():.2f} bf16 ulps apart")
  assert ulps.max() <= 1.0, ulps.max()


def test_swiglu_grad_fused_on_hopper_only():
  """The fused backward GEMM runs on a Hopper GPU for bf16 operands of the kernel's shapes, and only there."""
  from gpu_common import is_hopper  # pylint: disable=g-import-not-at-top
  assert engines.swiglu_grad_fused(True, 2048, 768, True) == is_hopper()
  assert not engines.swiglu_grad_fused(False, 2048, 768, True)
  assert not engines.swiglu_grad_fused(True, 200, 768, True) and not engines.swiglu_grad_fused(True, 2048, 96, True)
