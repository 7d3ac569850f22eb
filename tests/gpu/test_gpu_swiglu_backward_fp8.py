"""The FP8 recipe's SwiGLU backward (grouped_gemm.swiglu_backward_fp8) on its CUDA kernel, against the CPU handler and
against the jnp composition run by XLA on the same GPU, the outputs' memory poisoned first (unwritten bytes show):

- exactly, everywhere the exact rules decide: the rows of da past the groups (zero bytes, scales 2^-126), the places
  of the token-contiguous layouts no row takes (zero bytes), the empty tiles' scales (2^-126); and every byte and
  scale bit for bit on inputs whose exp is exact on both sides (gates 0 and +-200: exp 1, 0 and inf), where the
  kernel's float32 math is the handler's op for op;
- on random inputs, where CUDA's expf (within 2 ulp) and the C library's may part in the last bit of the logistic:
  each scale within 2^-16 relative, each value byte equal or one e4m3 step apart, at most 1 in 10^3; the same bound
  against XLA:GPU, whose exp is its own and whose float32 division is div.full, not IEEE (openxla/xla#37181; see
  tests/gpu/test_gpu_quantize_columns_fp8.py). The counts print (-s) so the bound can be tightened on evidence;
- bitwise repeats (the recipe's gradients on the GPU: tests/gpu/test_gpu_quantize_columns_fp8.py); on a GPU that is not a Hopper one the call fails naming the
  requirement. Skips where there is no GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_swiglu_backward_fp8 as base  # tests/test_swiglu_backward_fp8.py (tests/ is on pytest's pythonpath)
from gpu_common import gpu_devices, requires_gpu
from test_gpu_grouped_gemm_fp8 import _hopper, _poison_allocator, requires_hopper

from jax_moe_overlap import fp8, fp8_experts
from jax_moe_overlap.grouped_gemm import swiglu_backward_fp8

pytestmark = requires_gpu

BIG = [  # (M, F, sizes)
    (4096, 1024, [2000, 0, 1, 127, 129, 1500, 0, 300]),   # skew, empty groups, 39 rows past the groups
    (3000, 512, [2999]),                                  # one group, one row past
    (20480, 1024, list(np.random.default_rng(1).multinomial(20000, np.ones(16) / 16))),   # 16 groups, 480 past
]
SCALE_RTOL = 2.0 ** -16
BYTE_FRACTION = 1e-3


def _leaves(out):
  return [np.asarray(v) for v in jax.tree.leaves(out)]


def _run(aq, a_s, dh, tiles, device, f=swiglu_backward_fp8):
  put = lambda v: jax.device_put(v, device)
  return _leaves(jax.jit(f)(put(aq), put(a_s), put(dh), jax.tree.map(put, tiles)))


def _kernel(aq, a_s, dh, tiles):
  M, C = aq.shape
  F, n = C // 2, tiles.count
  for shape in ((M, C // 4), (M, C // 128), (C, 128 * n // 4), (n, C), (F, 128 * n // 4), (n, F)):
    _poison_allocator(shape, jnp.float32)   # NaN bytes where the kernel would leave any unwritten
  return _run(aq, a_s, dh, tiles, gpu_devices()[0])


def _xla_on_gpu(aq, a_s, dh, tiles, rows):
  """The jnp composition (fp8_experts.swiglu_backward_composed) on the GPU, in the call's layouts; a and dh zeroed
  past the groups as the layer has them."""
  def composed(aq, a_s, dh):
    keep = (jnp.arange(aq.shape[0]) < rows)[:, None]
    aq = jax.lax.bitcast_convert_type(jnp.where(keep, jax.lax.bitcast_convert_type(aq, jnp.uint8), 0), fp8.E4M3)
    a_s, dh = jnp.where(keep, a_s, np.float32(fp8.SCALE_FLOOR)), jnp.where(keep, dh, 0.0)
    h_c, da_r, da_c = fp8_experts.swiglu_backward_composed(fp8.quantize_columns)(aq, a_s, dh, tiles)
    return da_r, (fp8.token_contiguous(da_c[0], tiles), da_c[1]), (fp8.token_contiguous(h_c[0], tiles), h_c[1])

  return _run(aq, a_s, dh, tiles, gpu_devices()[0], f=lambda aq, a_s, dh, tiles: composed(aq, a_s, dh))


NAMES = ("da rows q", "da rows s", "da cols q", "da cols s", "h cols q", "h cols s")


def _assert_exact_parts(out, sizes):
  """What no exp decides: the rows past the groups, the places no row takes, the empty tiles' scales."""
  dq, ds, dq_t, ds_t, hq_t, hs_t = out
  rows = sum(sizes)
  assert not dq.view(np.uint8)[rows:].any(), "da's rows past the groups must be zero"
  np.testing.assert_array_equal(ds[rows:], np.float32(fp8.SCALE_FLOOR))
  taken = np.zeros(dq_t.shape[1], bool)
  start = 0
  for n in sizes:
    taken[start:start + n] = True
    start += 128 * -(-n // 128)
  for q_t in (dq_t, hq_t):
    assert not q_t.view(np.uint8)[:, ~taken].any(), "the places no row takes must be zero"
  for s in (ds_t, hs_t):
    np.testing.assert_array_equal(s[start // 128:], np.float32(fp8.SCALE_FLOOR))
  assert all(np.all(np.isfinite(s)) for s in (ds, ds_t, hs_t))


def _assert_close(got, want, what):
  """Scales within SCALE_RTOL; value bytes equal or one e4m3 step apart (same sign), at most BYTE_FRACTION of them.
  Returns (differing scales, differing bytes) for the printout."""
  counts = []
  for name, g, w in zip(NAMES, got, want):
    if g.dtype.itemsize == 1:
      counts.append(f"{name} {base.assert_e4m3_close(g, w, f'{what}: {name}', BYTE_FRACTION)}/{g.size}")
    else:
      rel = np.abs(g.astype(np.float64) / w.astype(np.float64) - 1)
      assert rel.max() <= SCALE_RTOL, (what, name, float(rel.max()))
      counts.append(f"{name} {int(np.count_nonzero(g != w))}/{g.size} (max rel {rel.max():.1e})")
  return counts


@requires_hopper
@pytest.mark.parametrize("case", base.CASES + BIG)
def test_kernel_against_the_cpu_handler_and_xla(case, capsys):
  M, F, sizes = case
  aq, a_s, dh = base.inputs(case, seed=M + F)
  tiles = fp8.column_tiles(M, jnp.asarray(sizes, jnp.int32))
  got = _kernel(aq, a_s, dh, tiles)
  _assert_exact_parts(got, sizes)
  cpu = _run(aq, a_s, dh, tiles, jax.devices("cpu")[0])
  xla = _xla_on_gpu(aq, a_s, dh, tiles, sum(sizes))
  vs_cpu = _assert_close(got, cpu, "vs the CPU handler")
  vs_xla = _assert_close(got, xla, "vs XLA:GPU")
  with capsys.disabled():
    print(f"\nswiglu_backward_fp8 M={M} F={F}: vs CPU handler " + ", ".join(vs_cpu) + "; vs XLA:GPU " + ", ".join(vs_xla))
  if sum(sizes):
    assert np.count_nonzero(got[4].view(np.uint8)) > 0.9 * sum(sizes) * F
  again = _kernel(aq, a_s, dh, tiles)
  for name, a, b in zip(NAMES, got, again):
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)


@requires_hopper
@pytest.mark.parametrize("case", [base.CASES[0], BIG[0]])
@pytest.mark.parametrize("dh_dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_equals_the_cpu_handler_where_exp_is_exact(case, dh_dtype):
  """Gates 0 and about +-200 only (exp(-gate) = 1, 0 or inf on every platform, so the logistic is 0.5, 1 or 0
  exactly), ups and dh random (float32, or bfloat16: the kernel's 8-byte loads of dh): every byte and scale bit for
  bit."""
  M, F, sizes = case
  rng = np.random.default_rng(4)
  a = rng.standard_normal((M, 2 * F)) * np.exp2(rng.integers(-3, 4, (M, 1)))
  a[:, :F] = rng.choice([0.0, 200.0, -200.0], (M, F))
  aq, a_s = fp8.quantize_rows(jnp.asarray(a, jnp.float32))
  dh = jnp.asarray(rng.standard_normal((M, F)) * np.exp2(rng.integers(-6, 7, (1, F))), dh_dtype)
  gates = np.abs(np.asarray(fp8.dequantize_rows(aq, a_s))[:, :F])
  assert np.all((gates == 0) | (gates > 150)), "each gate dequantizes to 0 or to its tile's +-amax (about 200)"
  tiles = fp8.column_tiles(M, jnp.asarray(sizes, jnp.int32))
  got = _kernel(aq, a_s, dh, tiles)
  cpu = _run(aq, a_s, dh, tiles, jax.devices("cpu")[0])
  for name, g, c in zip(NAMES, got, cpu):
    np.testing.assert_array_equal(g.view(np.uint8), c.view(np.uint8), err_msg=name)
  assert np.count_nonzero(got[0].view(np.uint8)[:sum(sizes)]) > 0.5 * sum(sizes) * 2 * F


def test_other_gpus_refuse_naming_the_requirement():
  if _hopper():
    pytest.skip("a Hopper GPU runs the kernel (test_kernel_against_the_cpu_handler_and_xla)")
  case = base.CASES[0]
  aq, a_s, dh = base.inputs(case, seed=0)
  tiles = fp8.column_tiles(case[0], jnp.asarray(case[2], jnp.int32))
  with pytest.raises(Exception, match=r"needs Hopper FP8 tensor cores \(compute capability 9.x"):
    _run(aq, a_s, dh, tiles, gpu_devices()[0])
