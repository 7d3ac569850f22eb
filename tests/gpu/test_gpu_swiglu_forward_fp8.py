"""The FP8 recipe's SwiGLU forward (grouped_gemm.swiglu_forward_fp8) on its CUDA kernel, against the CPU handler and
against the jnp composition run by XLA on the same GPU, the outputs' memory poisoned first (unwritten bytes show):

- a quantized (no exp in it): bit for bit the CPU handler everywhere; zero rows: zero bytes, scales 2^-126, in h too;
- h on inputs whose exp is exact on both sides (gates 0 and +-200: exp 1, 0 and inf), where the kernel's float32 math
  is the handler's op for op: every byte and scale bit for bit;
- h on random inputs, where CUDA's expf (within 2 ulp) and the C library's may part in the last bit of the logistic
  (and so in a few ulps of h, no cancellation on the way): each scale within 2^-20 relative, each value byte equal or
  one e4m3 step apart, at most 1 in 10^3; the same bound against XLA:GPU for h and for a (a's scales bit for bit:
  the same product), whose exp is its own and whose float32 division is div.full, not IEEE (openxla/xla#37181; see
  tests/gpu/test_gpu_quantize_columns_fp8.py). The counts print (-s) so the bound can be tightened on evidence;
- non-finite inputs as the handler gives them (NaN sign bits aside); bitwise repeats; on a GPU that is not a Hopper
  one the call fails naming the requirement. Skips where there is no GPU."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import test_swiglu_forward_fp8 as base  # tests/test_swiglu_forward_fp8.py (tests/ is on pytest's pythonpath)
from gpu_common import gpu_devices, requires_gpu
from test_gpu_grouped_gemm_fp8 import _hopper, _poison_allocator, requires_hopper

from jax_moe_overlap import fp8, fp8_experts
from jax_moe_overlap.grouped_gemm import swiglu_forward_fp8

pytestmark = requires_gpu

BIG = [  # (M, F, zero rows at the end)
    (4096, 1024, 39),
    (3001, 512, 1),      # M not a multiple of the kernel's 32 rows per CTA
    (20480, 1024, 480),
    (8191, 2048, 3),     # 16 channel blocks
]
SCALE_RTOL = 2.0 ** -20
BYTE_FRACTION = 1e-3
NAMES = ("h q", "h s", "a q", "a s")


def _leaves(out):
  return [np.asarray(v) for v in jax.tree.leaves(out)]


def _run(a, device, f=swiglu_forward_fp8):
  return _leaves(jax.jit(f)(jax.device_put(a, device)))


def _kernel(a):
  M, C = a.shape
  for shape in ((M, C // 8), (M, C // 256), (M, C // 4), (M, C // 128)):
    _poison_allocator(shape, jnp.float32)   # NaN bytes where the kernel would leave any unwritten
  return _run(a, gpu_devices()[0])


def _cpu(a):
  return _run(a, jax.devices("cpu")[0])


def _assert_close(got, want, what, a_scales_exact=True):
  """Scales within SCALE_RTOL (a's bit for bit); value bytes equal or one e4m3 step apart (same sign), at most
  BYTE_FRACTION of them. Returns the counts for the printout."""
  counts = []
  for name, g, w in zip(NAMES, got, want):
    if g.dtype.itemsize == 1:
      counts.append(f"{name} {base.assert_e4m3_close(g, w, f'{what}: {name}', BYTE_FRACTION)}/{g.size}")
    else:
      if name == "a s" and a_scales_exact:
        np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32), err_msg=f"{what} {name}")
      rel = np.abs(g.astype(np.float64) / w.astype(np.float64) - 1)
      assert rel.max() <= SCALE_RTOL, (what, name, float(rel.max()))
      counts.append(f"{name} {int(np.count_nonzero(g != w))}/{g.size} (max rel {rel.max():.1e})")
  return counts


def _assert_zero_rows(out, live):
  for q, s in (out[:2], out[2:]):
    assert not q.view(np.uint8)[live:].any(), "zero rows give zero bytes"
    np.testing.assert_array_equal(s[live:], np.float32(fp8.SCALE_FLOOR))


@requires_hopper
@pytest.mark.parametrize("case", base.CASES + BIG)
def test_kernel_against_the_cpu_handler_and_xla(case, capsys):
  M, F, zero = case
  a = base.inputs(case, seed=M + F)
  got = _kernel(a)
  cpu = _cpu(a)
  _assert_zero_rows(got, M - zero)
  for name, g, c in zip(NAMES[2:], got[2:], cpu[2:]):
    np.testing.assert_array_equal(g.view(np.uint8), c.view(np.uint8), err_msg=f"{name}: no exp, the same rules")
  vs_cpu = _assert_close(got, cpu, "vs the CPU handler")
  xla = _run(a, gpu_devices()[0], f=fp8_experts.swiglu_forward_composed)
  vs_xla = _assert_close(got, xla, "vs XLA:GPU")
  with capsys.disabled():
    print(f"\nswiglu_forward_fp8 M={M} F={F}: vs CPU handler " + ", ".join(vs_cpu) + "; vs XLA:GPU " + ", ".join(vs_xla))
  assert np.count_nonzero(got[0].view(np.uint8)[:M - zero]) > 0.9 * (M - zero) * F
  again = _kernel(a)
  for name, x, y in zip(NAMES, got, again):
    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=name)


@requires_hopper
@pytest.mark.parametrize("case", [base.CASES[0], BIG[0], BIG[1]])
def test_kernel_equals_the_cpu_handler_where_exp_is_exact(case):
  """Gates 0 and about +-200 only (exp(-gate) = 1, 0 or inf on every platform, so the logistic is 0.5, 1 or 0
  exactly), ups random: every byte and scale bit for bit."""
  M, F, zero = case
  rng = np.random.default_rng(4)
  a = rng.standard_normal((M, 2 * F)) * np.exp2(rng.integers(-3, 4, (M, 1)))
  a[:, :F] = rng.choice([0.0, 200.0, -200.0], (M, F))   # a is read as given: no dequantization before the SwiGLU
  a[M - zero:] = 0
  a = jnp.asarray(a, jnp.float32)
  got, cpu = _kernel(a), _cpu(a)
  for name, g, c in zip(NAMES, got, cpu):
    np.testing.assert_array_equal(g.view(np.uint8), c.view(np.uint8), err_msg=name)
  assert np.count_nonzero(got[0].view(np.uint8)[:M - zero]) > 0.3 * (M - zero) * F


@requires_hopper
def test_non_finite_values_as_the_cpu_handler():
  """Infinities and NaNs in a: the same scales and values as the handler's (NaN where fp8.py says), compared as
  numbers (a NaN's sign and payload are the platform's)."""
  M, F = 64, 256
  a = np.asarray(base.inputs((M, F, 0), seed=2)).copy()
  a[0, 3], a[1, F + 7], a[2, 200], a[5, 2 * F - 1] = np.inf, np.nan, -np.inf, np.nan
  a = jnp.asarray(a, jnp.float32)
  got, cpu = _kernel(a), _cpu(a)
  for name, g, c in zip(NAMES, got, cpu):
    if g.dtype.itemsize == 1:
      g, c = g.view(ml_dtypes.float8_e4m3fn).astype(np.float32), c.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(g, c, err_msg=name)   # NaN equals NaN here
  assert np.isnan(got[3][1, 2]) and np.isinf(got[3][0, 0]) and np.isnan(got[1][1, 0])


def test_other_gpus_refuse_naming_the_requirement():
  if _hopper():
    pytest.skip("a Hopper GPU runs the kernel (test_kernel_against_the_cpu_handler_and_xla)")
  a = base.inputs(base.CASES[0], seed=0)
  with pytest.raises(Exception, match=r"needs Hopper FP8 tensor cores \(compute capability 9.x"):
    _run(a, gpu_devices()[0])
