"""GEMM1 of the FP8 recipe with its SwiGLU forward in one kernel (grouped_gemm.grouped_matmul_swiglu_fp8,
gemm/sm90/wgmma_swiglu_fp8.cuh) against the two CUDA calls it replaces, swiglu_forward_fp8(grouped_matmul_fp8(...)),
on the same GPU, the fused call's outputs' memory poisoned first (unwritten bytes show):

- bit for bit: the kernel runs grouped_matmul_fp8's mainloop and promotion (the same float32 accumulators) and
  swiglu_forward_fp8's device steps (the same expf, amax, scale and rounding), so every byte of h_q, h_s, a_q and a_s
  is the two calls' (the differing bytes of each output print on failure); skewed and empty groups, group ends inside
  128-row tiles, rows past the groups (zero bytes, scales 2^-126), F a multiple of 128 but not of 256, values that
  saturate and non-finite accumulators; bitwise repeats; without a (keep_a=False) the same h;
- the layer (moe_experts quantization="fp8", impl="collective") with fp8_experts.FUSED_GEMM1_SWIGLU_ON_GPU on gives
  the bits it gives with the switch off (the two calls), output and gradients;
- on a GPU that is not a Hopper one the call fails naming the requirement. Skips where there is no GPU.

  pytest -q tests/gpu/test_gpu_grouped_matmul_swiglu_fp8.py"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_grouped_matmul_swiglu_fp8 as base  # tests/test_grouped_matmul_swiglu_fp8.py (tests/ is on pythonpath)
from gpu_common import gpu_devices, requires_gpu
from test_gpu_grouped_gemm_fp8 import _hopper, _poison_allocator, requires_hopper

from jax_moe_overlap import fp8_experts
from jax_moe_overlap.grouped_gemm import grouped_matmul_fp8, grouped_matmul_swiglu_fp8, swiglu_forward_fp8

pytestmark = requires_gpu

BIG = [  # (M, K, F, group sizes)
    (4096, 1024, 1024, [1000, 0, 2500, 500, 17]),     # 79 rows past the groups
    (3001, 512, 384, [1, 2999]),                      # F = 3 x 128; one row past the groups
    (8192, 2048, 2048, [3000, 129, 0, 127, 4000, 900, 36, 0]),
]
NAMES = ("h q", "h s", "a q", "a s")


def _on_gpu(f, args):
  return [np.asarray(v) for v in jax.tree.leaves(jax.jit(f)(*[jax.device_put(jnp.asarray(a), gpu_devices()[0])
                                                             for a in args]))]


def _fused(args):
  M, F = args[0].shape[0], args[2].shape[1] // 2
  for shape in ((M, F // 4), (M, F // 128), (M, 2 * F // 4), (M, 2 * F // 128)):
    _poison_allocator(shape, jnp.float32)   # NaN bytes where the kernel would leave any unwritten
  return _on_gpu(grouped_matmul_swiglu_fp8, args)


def _two_calls(args):
  return _on_gpu(lambda *a: swiglu_forward_fp8(grouped_matmul_fp8(*a)), args)


def _assert_bitwise(got, want, what):
  differ = {n: int(np.count_nonzero(base.bits(g) != base.bits(w))) for n, g, w in zip(NAMES, got, want)}
  assert not any(differ.values()), f"{what}: differing elements per output {differ} (of " + ", ".join(
      f"{n} {g.size}" for n, g in zip(NAMES, got)) + ")"


@requires_hopper
@pytest.mark.parametrize("case", base.CASES + BIG)
def test_kernel_equals_the_two_calls(case):
  M, K, F, sizes = case
  args = base.operands(case, seed=M + F)
  got = _fused(args)
  _assert_bitwise(got, _two_calls(args), f"M={M} K={K} F={F}")
  live = int(sum(sizes))
  assert np.count_nonzero(base.bits(got[0])[:live]) >= 0.5 * live * F
  assert not base.bits(got[0])[live:].any() and not base.bits(got[2])[live:].any()
  again = _fused(args)
  _assert_bitwise(again, got, "a repeat")


@requires_hopper
@pytest.mark.parametrize("case", [base.CASES[1], BIG[0]])
def test_kernel_without_a_writes_the_same_h(case):
  # keep_a=False (inference): the epilogue quantizes h alone; h's bytes and scales those of the call that keeps a,
  # every row computed into the poison.
  M, K, F, sizes = case
  args = base.operands(case, seed=M + F)
  for shape in ((M, F // 4), (M, F // 128)):
    _poison_allocator(shape, jnp.float32)
  got = _on_gpu(lambda *a: grouped_matmul_swiglu_fp8(*a, keep_a=False)[0], args)
  assert len(got) == 2
  _assert_bitwise(got, _fused(args)[:2], f"without a: M={M} K={K} F={F}")


@requires_hopper
def test_saturation_and_non_finite_accumulators():
  M, K, F, sizes = 24, 256, 128, [10, 14]
  lq, ls, rq, rs, sizes = base.operands((M, K, F, sizes), seed=3)
  ls[0] = 3e38
  ls[1, 1] = np.inf
  lq[2:6] = np.asarray(0.0, lq.dtype)
  lq[2:6, 5] = np.asarray(448.0, lq.dtype)
  ls[2:6] = 2.0 ** 10
  args = (lq, ls, rq, rs, sizes)
  got = _fused(args)
  # NaNs compared by bits too: both sides are the device's canonical NaN, written by the same steps.
  _assert_bitwise(got, _two_calls(args), "saturation and non-finite values")


@requires_hopper
@pytest.mark.parametrize("kind", ["skewed", "empty_experts"])
def test_layer_with_the_switch_on_or_off_gives_the_same_bits(kind, monkeypatch):
  import jax_moe_overlap as jmo  # pylint: disable=g-import-not-at-top
  from cases import layer_inputs  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((1,), ("expert",), devices=gpu_devices()[:1])
  T, D, F, E, k = 1024, 256, 384, 8, 2
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, k, kind, 11, dtype=jnp.bfloat16)
  cot = jnp.asarray(np.random.default_rng(12).standard_normal((T, D)).astype(np.float32))

  def grads():
    def loss(x, gates, w1, w2):
      y, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl="collective", quantization="fp8")
      return jnp.sum(y.astype(jnp.float32) * cot), y
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    return f.lower(x, gates, w1, w2).as_text(), f(x, gates, w1, w2)

  monkeypatch.setattr(fp8_experts, "FUSED_GEMM1_SWIGLU_ON_GPU", False)
  jax.clear_caches()  # the layer's traces read the switch when traced
  off_hlo, off = grads()
  assert "jmo_grouped_matmul_swiglu_fp8" not in off_hlo
  monkeypatch.setattr(fp8_experts, "FUSED_GEMM1_SWIGLU_ON_GPU", True)
  jax.clear_caches()  # the layer's traces read the switch when traced
  on_hlo, on = grads()
  monkeypatch.undo()
  jax.clear_caches()
  assert on_hlo.count("jmo_grouped_matmul_swiglu_fp8") == 1 and "jmo_swiglu_forward_fp8" not in on_hlo
  for u, v in zip(jax.tree.leaves(on), jax.tree.leaves(off)):
    np.testing.assert_array_equal(base.bits(np.asarray(u.astype(jnp.float32))),
                                  base.bits(np.asarray(v.astype(jnp.float32))))


def test_other_gpus_refuse_naming_the_requirement():
  if _hopper():
    pytest.skip("a Hopper GPU runs the kernel (test_kernel_equals_the_two_calls)")
  with pytest.raises(Exception, match=r"needs Hopper FP8 tensor cores \(compute capability 9.x"):
    _on_gpu(grouped_matmul_swiglu_fp8, base.operands(base.CASES[0], seed=0))
