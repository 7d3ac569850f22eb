"""The sparse float32 oracle (reference.moe_experts_sparse_reference) against the dense one (moe_experts_reference):
the same y, dropped count and gradients wrt x, gates, w1, w2 on small random shapes: balanced, skewed, all to one
expert and half the experts empty, k = 1 and k > 1, dropless and with the capacity rule dropping slots, repeated and
out-of-range ids, several block sizes; and the block layout's bound (a too small ``num_blocks`` poisons y)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import ROUTINGS, layer_inputs, rel_err
from jax_moe_overlap import reference

D, F, E = 12, 20, 8


def _grad(fn):
  """Jitted (x, ids, gates, w1, w2, cap, ct) -> (y, dropped, (dx, dgates, dw1, dw2)) of sum(y * ct) through fn; ids
  and the capacity are traced, so one compilation serves every routing and capacity of a shape."""
  def loss(x, gates, w1, w2, ids, cap, ct):
    y, dropped = fn(x, ids, gates, w1, w2, cap, 1)
    return jnp.sum(y * ct), (y, dropped)

  def run(x, ids, gates, w1, w2, cap, ct):
    (_, (y, dropped)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        x, gates, w1, w2, ids, cap, ct)
    return y, dropped, grads

  return jax.jit(run)


DENSE = _grad(reference.moe_experts_reference)


@functools.lru_cache(maxsize=None)
def _sparse(**blocks):
  return _grad(functools.partial(reference.moe_experts_sparse_reference, **blocks))


def _both(x, ids, gates, w1, w2, cap, **blocks):
  """(y, dropped, (dx, dgates, dw1, dw2)) of the dense and of the sparse oracle, for sum(y * ct)."""
  ct = jax.random.normal(jax.random.PRNGKey(99), x.shape, jnp.float32)
  return [f(x, jnp.asarray(ids), gates, w1, w2, jnp.int32(cap), ct) for f in (DENSE, _sparse(**blocks))]


def _assert_same(dense, sparse):
  (y, dropped, grads), (y_s, dropped_s, grads_s) = dense, sparse
  assert int(dropped) == int(dropped_s)
  assert float(jnp.max(jnp.abs(y))) > 0.1
  for name, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), (y,) + grads, (y_s,) + grads_s):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert rel_err(b, a) <= 1e-5, (name, rel_err(b, a))
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(a))), err_msg=name)


@pytest.mark.parametrize("k", [1, 3])
def test_sparse_equals_dense(k):
  T = 40
  for kind in ROUTINGS:
    x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, k, kind, seed=k * 10 + len(kind))
    for cap in (T, 5):
      dense, sparse = _both(x, ids, gates, w1, w2, cap, block_rows=4)
      if cap < T and kind != "balanced":
        assert int(dense[1]) > 0, f"the capacity must drop slots here ({kind})"
      _assert_same(dense, sparse)


@pytest.mark.parametrize("block_rows,exact", [(1, False), (3, True), (128, False)])
def test_block_sizes(block_rows, exact):
  """One block per row, a size that splits experts unevenly (with the exact number of blocks, blocks_needed), one
  block per expert (with the default worst-case number of blocks)."""
  x, ids, gates, w1, w2 = layer_inputs(33, D, F, E, 2, "skewed", seed=5)
  nb = reference.blocks_needed(ids, E, block_rows) if exact else None
  _assert_same(*_both(x, ids, gates, w1, w2, 33, block_rows=block_rows, num_blocks=nb))


def test_repeated_and_out_of_range_ids():
  """A token may name an expert twice (both slots count, the second may be dropped); an id outside [0, E) is kept
  and computes nothing, in both oracles; the capacity rule agrees slot by slot (kept_mask vs slot_kept)."""
  T, k = 24, 3
  x, _, gates, w1, w2 = layer_inputs(T, D, F, E, k, "balanced", seed=2)
  rng = np.random.default_rng(2)
  ids = rng.integers(0, E // 2, (T, k)).astype(np.int32)   # repeats within tokens, experts E/2.. empty
  ids[::5, 1] = ids[::5, 0]
  ids[3, 2], ids[7, 0] = -1, E
  ids = jnp.asarray(ids)
  kept = jax.jit(lambda ids, cap: (reference.slot_kept(ids, E, cap), reference.kept_mask(ids, E, cap, 1)))
  for cap in (T, 4, 1):
    np.testing.assert_array_equal(*kept(ids, cap))
    _assert_same(*_both(x, ids, gates, w1, w2, cap, block_rows=2))


def test_too_few_blocks_poison_y():
  """A slot that does not fit in num_blocks makes its token's y NaN, never a silent drop; the others stay right."""
  T = 16
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, 2, "all_to_one", seed=1)   # experts 0, 1: 16 rows each
  y_ref, _ = jax.jit(reference.moe_experts_reference, static_argnums=(5, 6))(x, ids, gates, w1, w2, T, 1)
  assert reference.blocks_needed(ids, E, 4) == 8
  sparse = functools.partial(reference.moe_experts_sparse_reference, block_rows=4, num_blocks=7)
  y, _ = jax.jit(sparse, static_argnums=(5, 6))(x, ids, gates, w1, w2, T, 1)
  bad = np.isnan(np.asarray(y)).any(axis=1)
  assert 0 < bad.sum() < T
  np.testing.assert_allclose(np.asarray(y)[~bad], np.asarray(y_ref)[~bad], rtol=1e-5, atol=1e-5)


def test_memory_is_the_routed_rows():
  """The compiled gradient keeps no per-block copy of x or of the weights: its temporaries stay within a few times
  the [blocks x rows, D] float32 block outputs plus the inputs (a lax.cond in the scan, or activations kept for the
  backward pass, would multiply them)."""
  T, k, e, d, f, B = 512, 2, 4, 32, 64, 16
  x, ids, gates, w1, w2 = layer_inputs(T, d, f, e, k, "skewed", seed=4)
  nb = reference.blocks_needed(ids, e, B)

  def loss(x, gates, w1, w2):
    return jnp.sum(reference.routed_combine(x, ids, gates, w1, w2, block_rows=B, num_blocks=nb))

  mem = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(x, gates, w1, w2).compile().memory_analysis()
  inputs = 4 * (x.size + gates.size + w1.size + w2.size)
  assert mem.temp_size_in_bytes < 4 * (nb * B * d * 4) + 2 * inputs, (mem.temp_size_in_bytes, nb * B * d * 4, inputs)


def test_dense_oracle_keeps_a_non_finite_token_out_of_experts_it_does_not_reach():
  """A token whose slots are all skipped or dropped gets zeros, and a NaN gate on a skipped slot is not read, even
  though the dense oracle runs every token through every expert: its outputs are masked by selection, not
  multiplied by a zero weight (0 * NaN is NaN), as the sparse oracle and the routed impls give."""
  x, ids, gates, w1, w2 = layer_inputs(16, D, F, E, 2, "skewed", 4)
  x = x.at[3, 0].set(jnp.nan).at[6, 1].set(jnp.inf).at[9, 2].set(jnp.nan)
  ids = ids.at[3].set(-1).at[6].set(-1).at[11, 0].set(-1)
  gates = gates.at[11, 0].set(jnp.nan)
  dense = reference.moe_experts_reference(x, ids, gates, w1, w2, 16, 1)[0]
  sparse = reference.moe_experts_sparse_reference(x, ids, gates, w1, w2, 16, 1)[0]
  np.testing.assert_array_equal(dense[3], 0)
  np.testing.assert_array_equal(dense[6], 0)
  assert np.isnan(np.asarray(dense[9])).all()  # the routed NaN token stays NaN, in its own row only
  finite = np.arange(16) != 9
  assert np.isfinite(np.asarray(dense)[finite]).all()
  np.testing.assert_allclose(dense[finite], sparse[finite], rtol=1e-5, atol=1e-6)
  # Every slot dropped (capacity 0 rows per expert would be refused; 1 row keeps only each expert's first slot).
  x1 = x.at[15, 0].set(jnp.nan)
  dense1, dropped = reference.moe_experts_reference(x1, ids.at[15].set(ids[0]), gates, w1, w2, 1, 1)
  assert int(dropped) > 0
  np.testing.assert_array_equal(dense1[15], 0)


def test_dense_oracle_gradients_of_a_skipped_non_finite_token_are_finite():
  """A NaN token that reaches no expert adds nothing to any gradient (the dense oracle ran it through every expert
  and multiplied by zero: NaN in dw1, dw2), and the other gradients are those of the token's finite twin."""
  x, ids, gates, w1, w2 = layer_inputs(16, D, F, E, 2, "skewed", 4)
  ids = ids.at[3].set(-1)

  def grads(x):
    return jax.grad(lambda *a: jnp.sum(reference.moe_experts_reference(*a, 16, 1)[0] ** 2), argnums=(0, 2, 3, 4))(
        x, ids, gates, w1, w2)

  clean, bad = grads(x), grads(x.at[3, 0].set(jnp.nan))
  for a, b in zip(clean, bad):
    np.testing.assert_array_equal(a, b)
