"""The expert weights' quantizer (grouped_gemm.quantize_weight_fp8) on its CUDA kernel, both layouts, float32 and
bfloat16 weights: bit for bit the CPU handler (the outputs' memory poisoned first, so that unwritten bytes show), and
against fp8.quantize_weight run by XLA on the same GPU: the scales bit for bit, the values bit for bit but where
XLA:GPU's inexact float32 division explains a byte (_xla_division_differences: the count is printed); the edge blocks
of tests/test_quantize_weight_fp8.py (ties, the top of e4m3's range, zeros, negative zeros, NaN and infinities)
against the CPU handler (a NaN's sign aside: the device's arithmetic returns its canonical NaN, x86 a negative one for
inf / inf), and the float32 subnormal block, which XLA:CPU flushes to zero, against XLA:GPU, which does not; bitwise
repeats; both layouts from one call (quantize_weight_fp8_pair) bit for bit the two calls, NaNs as NaNs; the recipe with
fp8_experts.WEIGHT_QUANTIZER_ON_GPU forced on (the dgrads' weights from the forward's pair call, from the backward's
transposes, or re-quantized by the backward): its calls, its forward and input
gradients bit for bit the recipe on weights the kernel pre-quantized, its weight gradients within float32 rounding of
the recipe with the switch off. On a GPU that is not a Hopper one the call must fail naming the requirement. Skips
where there is no GPU."""

import jax
import jax.numpy as jnp
import jax_moe_overlap as jmo
import ml_dtypes
import numpy as np
import pytest

import test_quantize_weight_fp8 as base  # tests/test_quantize_weight_fp8.py (tests/ is on pytest's pythonpath)
from cases import layer_inputs, rel_err
from gpu_common import gpu_devices, requires_gpu
from test_fp8_layer import grads_fn
from test_gpu_grouped_gemm_fp8 import _hopper, requires_hopper
from test_gpu_quantize_columns_fp8 import _same_bits

from jax_moe_overlap import fp8, fp8_experts
from jax_moe_overlap.grouped_gemm import QUANTIZE_WEIGHT_FP8, quantize_weight_fp8, quantize_weight_fp8_pair

pytestmark = requires_gpu

BIG = [(8, 1024, 2048), (2, 4096, 1536), (4, 768, 1024)]   # the training preset's w1, a Mixtral-like slab, K != N

# e4m3's finite positive values, ascending (bytes 0x00 .. 0x7E).
_E4M3_POS = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _poison(shape):
  """Fills then frees a byte buffer of the values' size with 0x7F (e4m3 NaN, which no finite block gives), so that
  the output's allocation likely reuses it and unwritten bytes show."""
  jax.block_until_ready(jnp.full(shape, 0x7F, jnp.uint8, device=gpu_devices()[0])).delete()


def _run(f, w, device):
  out = jax.jit(f)(jax.device_put(w, device))
  return np.asarray(out.values).view(np.uint8), np.asarray(out.scales)


def _kernel(w, transposed):
  E, K, N = w.shape
  _poison((E, K, N))
  jax.block_until_ready(jnp.full((E, K // 128, N // 128), jnp.nan, jnp.float32, device=gpu_devices()[0])).delete()
  return _run(lambda w: quantize_weight_fp8(w, transposed=transposed), w, gpu_devices()[0])


def _cpu(w, transposed):
  return _run(lambda w: quantize_weight_fp8(w, transposed=transposed), w, jax.devices("cpu")[0])


def _xla_gpu(w, transposed):
  return _run(lambda w: fp8_experts.xla_quantize_weight(w, transposed), w, gpu_devices()[0])


def _xla_division_differences(q, gq, w, s, transposed):
  """The bytes where the kernel's q differs from XLA:GPU's gq, each of which must be explained by XLA:GPU's float32
  division (div.full.f32, within 2 ulp, not correctly rounded: openxla/xla#37181) where the kernel divides as IEEE
  does: x / s within a few float32 ulps of a midpoint between two e4m3 values, and the bytes one e4m3 step apart with
  the same sign. Returns the count of differing bytes."""
  diff = np.argwhere(q != gq)
  w32 = np.asarray(jnp.asarray(w, jnp.float32)).astype(np.float64)
  x_all = np.swapaxes(w32, -1, -2) if transposed else w32
  for e, r, c in diff:
    y = abs(x_all[e, r, c] / np.float64(s[e, r // 128, c // 128]))
    k = np.searchsorted(_E4M3_POS, y)
    assert 0 < k < _E4M3_POS.size, f"[{e}, {r}, {c}]: x / s = {y} is not between two e4m3 values"
    mid = (_E4M3_POS[k - 1] + _E4M3_POS[k]) / 2
    a, b = int(q[e, r, c]), int(gq[e, r, c])
    assert abs(y - mid) <= 4 * 2.0**-24 * y and (a ^ b) & 0x80 == 0 and abs((a & 0x7F) - (b & 0x7F)) == 1, (
        f"[{e}, {r}, {c}]: kernel byte {a:#04x}, XLA:GPU {b:#04x}, x / s = {y!r}, nearest midpoint {mid!r}")
  return len(diff)


def _same(a, b, nan_free=False):
  """Equal bytes (values) or words (scales); with nan_free, NaNs compared as NaNs (sign and payload aside)."""
  _same_bits(a, b, nan_free)


@requires_hopper
@pytest.mark.parametrize("shape", base.SHAPES + BIG)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("transposed", [True, False], ids=["transposed", "w_layout"])
def test_kernel_equals_the_cpu_handler_and_the_xla_path(shape, dtype, transposed, capsys):
  w = base.weights(shape, dtype, seed=sum(shape))
  q, s = _kernel(w, transposed)
  cq, cs = _cpu(w, transposed)
  _same(q, cq)
  _same(s, cs)
  gq, gs = _xla_gpu(w, transposed)
  _same(s, gs)
  differing = _xla_division_differences(q, gq, w, s, transposed)
  with capsys.disabled():
    print(f"\nquantize_weight_fp8 {shape} {jnp.dtype(dtype).name} {'transposed' if transposed else 'w layout'}: "
          f"{differing} of {q.size} bytes differ from XLA:GPU's (its division)")
  assert differing <= 1e-3 * q.size
  q2, s2 = _kernel(w, transposed)
  _same(q, q2)
  _same(s, s2)


@requires_hopper
@pytest.mark.parametrize("transposed", [True, False], ids=["transposed", "w_layout"])
def test_kernel_edge_blocks(transposed, capsys):
  """base.edge_weights: every block but the subnormal one (11) bit for bit the CPU handler, NaNs as NaNs; block 11
  (subnormals only: scale 2^-126, quotients x * 2^126, exact) bit for bit the NumPy twin, which keeps subnormals as
  the kernel does (XLA:CPU, and with it the CPU handler, flushes them: the CPU test holds the handler to that); how
  many of its bytes XLA:GPU's quantizer gives otherwise prints (its division's handling of subnormals)."""
  w = jnp.asarray(base.edge_weights())
  q, s = _kernel(w, transposed)
  cq, cs = _cpu(w, transposed)
  gq, gs = _xla_gpu(w, transposed)
  in_w_layout = (lambda a: a) if not transposed else (lambda a: np.swapaxes(a, 1, 2))

  def by_block(a):
    if a.shape[-1] == 3:
      return a.reshape(12)
    return a.reshape(2, 2, 128, 3, 128).transpose(0, 1, 3, 2, 4).reshape(12, 128, 128)

  qb, cqb, gqb = (by_block(in_w_layout(a)) for a in (q, cq, gq))
  sb, csb, gsb = (by_block(in_w_layout(a)) for a in (s, cs, gs))
  _same(qb[:11], cqb[:11], nan_free=True)
  _same(sb[:11], csb[:11], nan_free=True)
  tq, ts = base.twin(np.asarray(w), transposed)
  _same(qb[11], by_block(in_w_layout(tq))[11])
  _same(sb[11:], by_block(in_w_layout(ts))[11:])
  assert np.count_nonzero(qb[11]) > 0.5 * qb[11].size      # the subnormals do quantize (x * 2^126) on GPUs
  with capsys.disabled():
    print(f"\nsubnormal block: {np.count_nonzero(qb[11] != gqb[11])} of {qb[11].size} bytes differ from XLA:GPU's; "
          f"scale {'equal' if sb[11] == gsb[11] else 'differs'}")
  q2, s2 = _kernel(w, transposed)
  _same(q, q2)
  _same(s, s2, nan_free=True)


def scale_range_weights(dtype, seed=5):
  """w [1, 128, 128 * B] of B blocks, each one block's amax A (at a random place) among values that test the
  quotient x / s of every range ops/e4m3.cuh distinguishes, s = float32(A * float32(1 / 448)) the block's scale:
  e4m3's midpoints times s and the float32 values up to 2 ulps either side, random values in [-A, A], random
  bfloat16 values (8-bit significands: exact midpoints come often), tiny values (2^-149 .. 2^-60) and signed zeros.
  Returns (w as float32 NumPy, the blocks' scales).
  The A's: scales at and just below the fast path's smallest (2^-62), random ones above it (2^-61 .. 2^110, random
  significands), powers of two, 1.75 * 2^k (s a power of two), and below: in (2^-126, 2^-62) and at the floor
  (2^-126, tiles of subnormals). With dtype bfloat16 every value (A among them) is rounded to bfloat16 first."""
  rng = np.random.default_rng(seed)
  inv448 = np.float32(1 / 448)
  amaxes = [np.float32(448 * 2.0 ** -62), np.nextafter(np.float32(448 * 2.0 ** -62), np.float32(0)),
            np.float32(447.99997 * 2.0 ** -62)]
  amaxes += list((rng.uniform(1, 2, 40) * np.exp2(rng.integers(-52, 118, 40))).astype(np.float32))
  amaxes += [np.float32(2.0 ** k) for k in (-50, -3, 0, 7, 60)] + [np.float32(1.75 * 2.0 ** k) for k in (-40, 0, 9)]
  amaxes += list((rng.uniform(1, 2, 8) * np.exp2(rng.integers(-116, -54, 8))).astype(np.float32))
  amaxes += [np.float32(448 * 2.0 ** -126), np.float32(2.0 ** -120), np.float32(3 * 2.0 ** -140)]
  if dtype == jnp.bfloat16:
    amaxes = [np.float32(ml_dtypes.bfloat16(a)) for a in amaxes]
  mids = (_E4M3_POS[:-1] + _E4M3_POS[1:]) / 2
  blocks = []
  for a in amaxes:
    s = np.float32(a * inv448)
    at_mids = (np.concatenate([mids, -mids]) * np.float64(max(s, np.float32(2.0 ** -126)))).astype(np.float32)
    near = np.concatenate([np.nextafter(at_mids, np.float32(np.inf) * np.sign(at_mids))] * 2 + [at_mids] * 2 +
                          [np.nextafter(at_mids, np.float32(0))] * 2)
    near = np.concatenate([near, np.nextafter(near[: len(at_mids)], np.float32(np.inf) * np.sign(at_mids))])
    uniform = rng.uniform(-a, a, 4096).astype(np.float32)
    bf = rng.uniform(-a, a, 4096).astype(ml_dtypes.bfloat16).astype(np.float32)
    tiny = (rng.choice([-1, 1], 2048) * np.exp2(rng.uniform(-149, -60, 2048))).astype(np.float32)
    zeros = np.array([0.0, -0.0] * 64, np.float32)
    b = np.resize(rng.permutation(np.concatenate([near, uniform, bf, tiny, zeros])), 128 * 128)
    if dtype == jnp.bfloat16:
      b = b.astype(ml_dtypes.bfloat16).astype(np.float32)
    b = np.where(np.abs(b) <= a, b, b * np.float32(0.25)).astype(np.float32)
    b = np.where(np.abs(b) <= a, b, np.float32(0))
    b[rng.integers(0, b.size)] = a
    blocks.append(b.reshape(128, 128))
  w = np.concatenate(blocks, axis=1)[None]
  floor = np.float32(fp8.SCALE_FLOOR)
  return w, np.array([max(np.float32(a * inv448), floor) for a in amaxes], np.float32)


@requires_hopper
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("transposed", [True, False], ids=["transposed", "w_layout"])
def test_kernel_quotients_at_every_range_of_scales(dtype, transposed):
  """scale_range_weights: the kernel's bytes and scales bit for bit the NumPy twin's (IEEE division of float32
  values, subnormals kept, e4m3 by ml_dtypes), block by block: the quotient ops/e4m3.cuh's fast path computes
  without a division, and the exact path of the tiles it does not serve."""
  w, scales = scale_range_weights(dtype)
  q, s = _kernel(jnp.asarray(w, dtype), transposed)
  tq, ts = base.twin(w, transposed)
  np.testing.assert_array_equal(np.ravel(ts).view(np.uint32), scales.view(np.uint32))
  _same(s, ts)
  for blk in range(len(scales)):
    cut = (slice(None), slice(128 * blk, 128 * blk + 128)) if transposed else (slice(None), slice(None),
                                                                                 slice(128 * blk, 128 * blk + 128))
    got, want = q[cut], tq[cut]
    assert np.array_equal(got, want), (
        f"block {blk} (scale {scales[blk]!r}): {np.count_nonzero(got != want)} of {got.size} bytes differ from the "
        f"twin's, first at {np.argwhere(got != want)[0].tolist()}")


@requires_hopper
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pair_kernel_equals_its_two_calls(dtype):
  """quantize_weight_fp8_pair's kernel (both layouts from one read): each form bit for bit the single-layout
  kernel's (the outputs' memory poisoned first), on random weights of many scales (the training preset's w1 among
  them) and on the edge blocks (NaNs as NaNs); repeats bitwise."""
  for w in [base.weights(shape, dtype, seed=sum(shape)) for shape in base.SHAPES + BIG[:2]] + [
      jnp.asarray(base.edge_weights(), dtype)]:
    E, K, N = w.shape
    singles = [_kernel(w, transposed) for transposed in (True, False)]
    for _ in range(2):
      _poison((2, E, K, N))
      pair = jax.jit(quantize_weight_fp8_pair)(jax.device_put(w, gpu_devices()[0]))
      for (q, s), got in zip(singles, pair):
        _same(np.asarray(got.values).view(np.uint8), q, nan_free=True)
        _same(np.asarray(got.scales), s, nan_free=True)


def _recipe(w1, w2):
  """y and the gradients (dx, dgates, and dw1, dw2 for master weights: pre-quantized Fp8Weights get none, the layer
  refuses a gradient with respect to them) of the FP8 recipe, and the lowered program's text."""
  mesh = jax.make_mesh((1,), ("expert",), devices=gpu_devices()[:1])
  x, ids, gates, _, _ = layer_inputs(512, 256, 512, 8, 2, "skewed", 21, dtype=jnp.bfloat16)
  cot = jnp.asarray(np.random.default_rng(22).standard_normal((512, 256)).astype(np.float32))
  prequantized = isinstance(w1, jmo.Fp8Weight)
  f = grads_fn(mesh, ids, cot, "collective", argnums=(0, 1) if prequantized else (0, 1, 2, 3))
  (_, y), g = f(x, gates, w1, w2)
  return [np.asarray(a) for a in (y, *g)], f.lower(x, gates, w1, w2).as_text()


@requires_hopper
@pytest.mark.parametrize("requantizes,pair,calls", [(True, True, 4), (False, True, 2), (False, False, 2)],
                         ids=["backward_requantizes", "forward_pair", "forward_only"])
def test_recipe_with_the_weight_quantizer_on_the_gpu(monkeypatch, capsys, requantizes, pair, calls):
  """fp8_experts.WEIGHT_QUANTIZER_ON_GPU forced on: the recipe quantizes the master weights by the kernel in the
  forward and, with BACKWARD_REQUANTIZES_WEIGHTS, again untransposed for the dgrads (4 calls, no quantized weight
  kept; else 2: with FORWARD_QUANTIZES_DGRAD_WEIGHTS both layouts from one read each, the dgrads' copies kept, or the
  dgrads transposing the kept forward copies); y, dx and dgates equal the
  recipe on the weights the kernel pre-quantized bit for bit (the same FP8 operands; dgrads from their transposed
  copies); the weight gradients stay within float32 rounding of the switch-off recipe's (XLA:GPU's quantizer, whose
  division parts from the kernel's at a few bytes)."""
  _, _, _, w1, w2 = layer_inputs(512, 256, 512, 8, 2, "skewed", 21, dtype=jnp.bfloat16)
  w1, w2 = (jax.device_put(w, gpu_devices()[0]) for w in (w1, w2))
  with jax.default_device(gpu_devices()[0]):
    monkeypatch.setattr(fp8_experts, "WEIGHT_QUANTIZER_ON_GPU", True)
    monkeypatch.setattr(fp8_experts, "BACKWARD_REQUANTIZES_WEIGHTS", requantizes)
    monkeypatch.setattr(fp8_experts, "FORWARD_QUANTIZES_DGRAD_WEIGHTS", pair)
    monkeypatch.setattr(fp8_experts, "WEIGHT_PAIR_KERNEL_ON_GPU", True)
    jax.clear_caches()  # no program traced with the flag off (same functions, same shapes) may be reused
    on, text = _recipe(w1, w2)
    assert text.count(QUANTIZE_WEIGHT_FP8) == calls
    assert text.count("both = true") == (2 if pair and not requantizes else 0)
    pre, _ = _recipe(jax.jit(quantize_weight_fp8)(w1), jax.jit(quantize_weight_fp8)(w2))
    for name, a, b in zip(("y", "dx", "dgates"), on[:3], pre[:3]):
      np.testing.assert_array_equal(a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32),
                                    b.view(np.uint16 if b.dtype.itemsize == 2 else np.uint32), err_msg=name)
    monkeypatch.setattr(fp8_experts, "WEIGHT_QUANTIZER_ON_GPU", False)
    jax.clear_caches()
    off, text = _recipe(w1, w2)
    assert QUANTIZE_WEIGHT_FP8 not in text
  errs = {n: rel_err(a, b) for n, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), on, off)}
  with capsys.disabled():
    print("\nrecipe, weight quantizer on vs off: " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))
  assert all(e < 1e-3 for e in errs.values()), errs


def test_other_gpus_refuse_naming_the_requirement():
  if _hopper():
    pytest.skip("a Hopper GPU runs the kernel (test_kernel_equals_the_cpu_handler_and_the_xla_path)")
  with pytest.raises(Exception, match=r"needs Hopper FP8 tensor cores \(compute capability 9.x"):
    _run(quantize_weight_fp8, jnp.ones((1, 128, 128), jnp.float32), gpu_devices()[0])
