"""slot_combine.py: the gate-weighted sum of the slots' rows and its written-out backward, and the FP8 backward's
slots' gradients quantized straight from dy, each against the formula it restates, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe_overlap import fp8, slot_combine
from jax_moe_overlap.xla_path import move_rows


# Each shape once in the default pass, float32 for k = 1 and bfloat16 for the others; the other three in the slow pass.
DEFAULT_COMBINE = {(64, jnp.bfloat16), (33, jnp.float32), (40, jnp.bfloat16)}


@pytest.mark.parametrize("T,k,D,dtype", [
    pytest.param(T, k, D, dtype, marks=() if (T, dtype) in DEFAULT_COMBINE else pytest.mark.slow)
    for dtype in (jnp.bfloat16, jnp.float32) for T, k, D in ((64, 4, 96), (33, 1, 16), (40, 8, 24))])
def test_combine_slots_backward_is_autodiffs_without_padded_slices(dtype, T, k, D):
  # combine_slots' written-out backward gives autodiff's values of its formula bit for bit (signed zeros of the
  # dropped slots included), and its jaxpr pads nothing: autodiff's transpose of the per-choice slices pads each to
  # [T, k, D] float32 and sums them.
  def formula(slot_out, gates, is_kept):
    s = slot_out.astype(jnp.float32).reshape(T, k, -1)
    w = jnp.where(is_kept.reshape(T, k), gates.astype(jnp.float32), 0)
    y = w[:, 0, None] * s[:, 0]
    for j in range(1, k):
      y = y + w[:, j, None] * s[:, j]
    return y

  rng = np.random.default_rng(T + k)
  s = jnp.asarray(rng.standard_normal((T * k, D)), dtype)
  g = jnp.asarray(rng.uniform(0, 1, (T, k)), jnp.float32)
  kept = jnp.asarray(rng.uniform(0, 1, T * k) > 0.25)
  dy = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
  pull = lambda f: jax.jit(lambda s, g: jax.vjp(lambda s, g: f(s, g, kept), s, g)[1](dy))
  want, got = pull(formula)(s, g), pull(slot_combine.combine_slots)(s, g)
  assert not bool(kept.all()) and float(jnp.abs(want[0]).max()) > 0
  for a, b in zip(want, got):
    assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
  assert np.asarray(slot_combine.combine_slots(s, g, kept)).tobytes() == np.asarray(formula(s, g, kept)).tobytes()
  jaxpr = jax.make_jaxpr(lambda s, g: jax.vjp(lambda s, g: slot_combine.combine_slots(s, g, kept), s, g)[1](dy))(s, g)
  assert "pad" not in str(jaxpr)
  if k > 1:  # (the formula's own transpose does pad: the check above can fail)
    assert "pad" in str(jax.make_jaxpr(lambda s, g: jax.vjp(lambda s, g: formula(s, g, kept), s, g)[1](dy))(s, g))



def _slot_of_row(rng, T, k, N):
  """[N] int32: N distinct slots of T k in a random order, the last rows out of range (T k and past it)."""
  slots = rng.permutation(T * k)[:N - 3].astype(np.int32)
  return jnp.asarray(np.concatenate([slots, [T * k, T * k + 5, T * k]]).astype(np.int32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("T,k,D", [(48, 4, 256), (40, 1, 128), (24, 8, 384)])
def test_quantized_slot_gradients_equal_the_written_rows_quantized(dtype, T, k, D):
  # The send buffer's quantized rows from dy and the gates equal quantize_rows of the rows the combine's backward
  # writes, moved into the send buffer, bit for bit: signed zeros (zero gates, dropped slots, k = 1), rows no slot
  # fills, a tile with a NaN, one with an infinity (under a zero gate: NaN), huge and tiny values.
  rng = np.random.default_rng(T * k + D)
  dy = rng.standard_normal((T, D)).astype(np.float32) * np.exp2(rng.integers(-20, 20, (T, 1)))
  dy[1, 5] = np.nan
  dy[2, 130 % D] = np.inf
  dy[3, :] = -0.0
  dy[4, :128] = 3e38
  dy[5, :128] = 1e-42                                       # subnormal float32
  dy = jnp.asarray(dy).astype(dtype).astype(jnp.float32)  # a compute-dtype cotangent, widened
  gates = rng.uniform(0, 1, (T, k)).astype(np.float32)
  gates[2, 0] = 0.0
  gates[6, :] = 0.0
  gates[7, 0] = -0.5
  gates = jnp.asarray(gates)
  is_kept = jnp.asarray(rng.uniform(0, 1, T * k) > 0.2)
  N = T * k - 2
  slot_of_row = _slot_of_row(rng, T, k, N)
  inverse = jnp.full((T * k,), N, jnp.int32).at[jnp.where(slot_of_row < T * k, slot_of_row, T * k)].set(
      jnp.arange(N, dtype=jnp.int32), mode="drop")

  @jax.jit
  def written(dy, gates):
    rows = move_rows(slot_combine.slot_gradients(gates, is_kept, dy, dtype), slot_of_row, inverse)
    return fp8.quantize_rows(rows, pow2=True)

  got = jax.jit(lambda dy, gates: slot_combine.quantized_slot_gradients(dy, gates, is_kept, slot_of_row, dtype))(
      dy, gates)
  want = written(dy, gates)
  # A NaN's sign bit is no value (conversions may drop it): NaNs compare as one pattern, every other bit as it is.
  q_bits = lambda q: np.where(np.asarray(q).view(np.uint8) == 0xFF, 0x7F, np.asarray(q).view(np.uint8))
  s_bits = lambda s: np.where(np.isnan(np.asarray(s)), 0x7FC00000, np.asarray(s).view(np.uint32))
  assert np.count_nonzero(q_bits(want[0])) > N * D // 2 and np.isnan(np.asarray(want[1])).any()
  assert (q_bits(want[0]) == 0x80).any()  # signed zeros are in the comparison
  np.testing.assert_array_equal(q_bits(got[0]), q_bits(want[0]))
  np.testing.assert_array_equal(s_bits(got[1]), s_bits(want[1]))
