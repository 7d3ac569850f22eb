"""The FP8 block-scaled grouped GEMM (grouped_matmul_fp8) on Hopper's e4m3 wgmma kernel against its CPU emulation
(the CPU handler's rule restated in NumPy, fp8_numpy.block_scaled_grouped_gemm) and the dequantized float64 product:
random e4m3 operands with per-row and per-block magnitudes spread over 2^16, skewed and empty groups, rows past the
groups holding garbage in lhs and poisoned (NaN) memory under the output; bitwise repeats. Then the layer:
moe_experts(impl="collective", quantization="fp8") on one GPU against impl="xla" (the recipe emulated in XLA),
forward and gradients. On a GPU that is not a Hopper one the call must fail naming the requirement. Skips where there
is no GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_numpy
import test_grouped_gemm_fp8 as base  # tests/test_grouped_gemm_fp8.py (tests/ is on pytest's pythonpath)
from cases import layer_inputs, rel_err
from gpu_common import gpu_devices, requires_gpu

from jax_moe_overlap import engines, fp8_experts, workspace_cuda

pytestmark = requires_gpu

BIG = [  # (M, K, N, sizes)
    (4096, 1024, 2048, [2000, 0, 1, 127, 129, 1500, 0, 300]),   # skew, empty groups, 39 tail rows
    (1001, 512, 384, [1000]),                                   # M not a multiple of 4 (the scales' ld is padded)
    (2048, 2048, 256, [256, 512, 0, 1024, 256]),                # exact tiles, every row in a group
    (300, 7168, 1024, [7, 0, 280, 13]),                         # DeepSeek's D as K (56 chunks), small groups
]
# The kernel keeps about 14 bits of each 128-wide chunk's sum inside the tensor core (the emulation rounds the
# exact sum once): the probe's tolerance, 2e-3 of max |ref|, for float32 output; bfloat16 output adds its rounding.
TOL = {jnp.float32: 2e-3, jnp.bfloat16: 2e-3 + 2.0 ** -8}


def _hopper() -> bool:
  if not gpu_devices():
    return False
  cc = workspace_cuda.device_info(gpu_devices()[0].local_hardware_id).compute_capability
  return engines.fp8_gemm_device_refusal(tuple(cc)) is None


requires_hopper = pytest.mark.skipif("not _hopper()", reason="the FP8 grouped GEMM runs on Hopper only")


def _poison_allocator(shape, dtype):
  """Fills then frees a buffer of the output's size, so that the output's allocation likely reuses NaN memory and
  unwritten rows show."""
  jax.block_until_ready(jnp.full(shape, jnp.nan, dtype, device=gpu_devices()[0])).delete()


@requires_hopper
@pytest.mark.parametrize("case", base.CASES + BIG)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_the_emulation(case, out_dtype):
  lq, ls, rq, rs, sizes = base.operands(case, seed=case[0] + case[1])
  M, N = case[0], case[2]
  _poison_allocator((M, N), out_dtype)
  got = base._call(lq, ls, rq, rs, sizes, out_dtype, device=gpu_devices()[0])
  emu = fp8_numpy.block_scaled_grouped_gemm(lq, ls, rq, rs, sizes)
  exact = base.dequantized_f64(lq, ls, rq, rs, sizes)
  scale = max(float(np.max(np.abs(exact))), 1e-30)
  assert np.max(np.abs(got - emu)) <= TOL[out_dtype] * scale, (case, np.max(np.abs(got - emu)) / scale)
  assert np.max(np.abs(got - exact)) <= TOL[out_dtype] * scale, case
  assert not np.any(got[sum(sizes):]), "rows past the groups must be zero"
  assert np.all(np.isfinite(got))
  again = base._call(lq, ls, rq, rs, sizes, out_dtype, device=gpu_devices()[0])
  np.testing.assert_array_equal(got, again)


def test_other_gpus_refuse_naming_the_requirement():
  if _hopper():
    pytest.skip("a Hopper GPU runs the kernel (test_kernel_matches_the_emulation)")
  lq, ls, rq, rs, sizes = base.operands(base.CASES[0], seed=0)
  with pytest.raises(Exception, match=r"needs Hopper FP8 tensor cores \(compute capability 9.x"):
    base._call(lq, ls, rq, rs, sizes, jnp.float32, device=gpu_devices()[0])


@requires_hopper
@pytest.mark.parametrize("quantization", ["fp8", "fp8_bf16_wgrad"])
@pytest.mark.parametrize("kind", ["skewed", "empty_experts"])
def test_layer_collective_matches_xla(kind, quantization):
  """impl="collective" (the e4m3 kernels: grouped_matmul_fp8 for GEMM1, GEMM2 and the dgrads; for the wgrads
  grouped_outer_fp8, or under "fp8_bf16_wgrad" the bfloat16 grouped_outer) against impl="xla" (the same operands,
  dequantized, ragged_dot) on one GPU: forward and the gradients of x, gates, w1, w2 within 1e-2 (the kernels' chunk
  accumulation); the same bits on a second call."""
  import jax_moe_overlap as jmo  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((1,), ("expert",), devices=gpu_devices()[:1])
  T, D, F, E, k = 1024, 256, 384, 8, 2
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, k, kind, 11, dtype=jnp.bfloat16)
  cot = jnp.asarray(np.random.default_rng(12).standard_normal((T, D)).astype(np.float32))

  def grads(impl):
    def loss(x, gates, w1, w2):
      y, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl=impl, quantization=quantization)
      return jnp.sum(y.astype(jnp.float32) * cot), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))

  f = grads("collective")
  hlo = f.lower(x, gates, w1, w2).as_text()
  fused = fp8_experts.FUSED_GEMM1_SWIGLU_ON_GPU  # GEMM1 with the SwiGLU forward in its epilogue: one call for two
  assert hlo.count("jmo_grouped_matmul_fp8") == 4 - fused and hlo.count("jmo_swiglu_forward_fp8") == 1 - fused
  assert hlo.count("jmo_grouped_matmul_swiglu_fp8") == fused
  assert hlo.count("jmo_quantize_weight_fp8") == 2 * fp8_experts.WEIGHT_QUANTIZER_ON_GPU
  if quantization == "fp8":
    assert hlo.count("jmo_grouped_outer_fp8") == 2
    assert hlo.count("jmo_quantize_columns_fp8") == 2 and hlo.count("jmo_swiglu_backward_fp8") == 1
  else:
    assert hlo.count("@jmo_grouped_outer(") == 2
    assert "jmo_grouped_outer_fp8" not in hlo and "jmo_quantize_columns_fp8" not in hlo
  (_, y), g = f(x, gates, w1, w2)
  (_, y_ref), g_ref = grads("xla")(x, gates, w1, w2)
  assert rel_err(y, y_ref) < 1e-2
  for name, a, b in zip(("dx", "dgates", "dw1", "dw2"), g, g_ref):
    assert float(jnp.max(jnp.abs(b))) > 0, name
    assert rel_err(a, b) < 1e-2, (name, rel_err(a, b))
  (_, y2), g2 = f(x, gates, w1, w2)
  for a, b in zip(jax.tree.leaves((y, g)), jax.tree.leaves((y2, g2))):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


@requires_gpu
def test_emulation_quantizes_on_the_gpu():
  """fp8.py's quantize-then-dequantize under jit on a GPU gives the CPU's values bit for bit: XLA:GPU must not drop the
  float32 -> e4m3 -> float32 round trip (its excess-precision simplification would, for a plain pair of converts)."""
  from jax_moe_overlap import fp8  # pylint: disable=g-import-not-at-top
  x = np.random.default_rng(3).standard_normal((64, 384)).astype(np.float32)
  def f(v):
    return fp8.dequantize_rows(*fp8.quantize_rows(v))
  got = np.asarray(jax.jit(f)(jax.device_put(jnp.asarray(x), gpu_devices()[0])))
  want = np.asarray(jax.jit(f)(jax.device_put(jnp.asarray(x), jax.devices("cpu")[0])))
  assert np.max(np.abs(want - x)) > 1e-3 * np.max(np.abs(x)), "the CPU side must quantize (the test's premise)"
  np.testing.assert_array_equal(got, want)
