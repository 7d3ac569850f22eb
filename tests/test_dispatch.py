"""dispatch on its own on CPU devices: every rank's recv rows against a NumPy model of the plan, written into poisoned
buffers, at R = 1 (a group of one rank stores its rows straight into the output, protocol.h) and R = 4 (through the
workspace's recv rows, one row per slot and sent once per destination rank), with capacity drops and skipped slots;
at R = 1 the invalid expert id the call reports, and at R = 4 a slot_primary that breaks the send-once rule; rows
scaled per slot as they move (row_scale) bitwise the rows of the scaled [P, D] array, and its refusals."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import layer_checks
from cases import mesh_of, routing
from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap.call_site import RankInfo
from jax_moe_overlap.config import CallConfig
from jax_moe_overlap.workspace import Workspace, WorkspaceSizes
from jax_moe_overlap.workspace_calls import dispatch

E, D, K = 8, 24, 2


def _dispatch_program(mesh, tokens, cap_e, cap, dtype, poisoned=True, send_once=False, primary_of=None,
                      scaled=False, slot_rows=False):
  """ids, x[, scale] -> (recv rows [R * cap, D], slot_dest_rank, slot_dest_row, recv_rows [R]) of one dispatch per
  rank. primary_of(plan, rank): the slot_primary operand in place of the plan's (send_once). scaled: the program
  takes a third operand, the slots' row_scale [tokens * K] per rank. slot_rows: x holds a row per slot (slot p's row
  p) instead of a row per token."""
  R = mesh.shape["expert"]
  sizes = WorkspaceSizes(row_bytes=D * jnp.dtype(dtype).itemsize, recv_rows=cap, ret_rows=tokens * K,
                         num_segments=E)
  info = RankInfo(Workspace.get(mesh, "expert", sizes), CallConfig(timeout_ms=5000))

  def local(ids, x, scale=None):
    rank = jax.lax.axis_index("expert").astype(jnp.int32)
    counts_all = jax.lax.all_gather(plan_lib.local_counts(ids, E).reshape(R, E // R), "expert")
    plan = plan_lib.make_plan(ids, counts_all, rank, cap_e)
    if primary_of is not None:
      plan = dataclasses.replace(plan, slot_primary=primary_of(plan, rank))
    src_row = jnp.arange(tokens * K, dtype=jnp.int32) // (1 if slot_rows else K)
    recv = dispatch(x, src_row, plan, cap, info, send_once=send_once, row_scale=scale)
    return recv, plan.slot_dest_rank, plan.slot_dest_row, plan.recv_rows.reshape(1)

  spec = P("expert")
  fn = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * (3 if scaled else 2), out_specs=(spec,) * 4,
                     check_vma=False)
  return layer_checks.Poisoned(fn, mesh) if poisoned else jax.jit(fn)


def _dropping_routing(R, tokens, seed):
  """(mesh, ids [tokens * R, K], cap_e, cap): skewed routing at capacity factor 0.75, which drops slots (so each
  rank's recv rows end before cap), with every seventh token's second slot skipped (-1)."""
  ids = routing("skewed", tokens * R, E, K, seed=seed)
  ids[::7, 1] = plan_lib.SKIP
  cap_e = plan_lib.expert_capacity(tokens, R, K, E, 0.75)
  return mesh_of(R), ids, cap_e, plan_lib.recv_capacity(tokens, R, K, E // R, cap_e)


# Each R, dtype and send_once setting in the default pass; (1, bfloat16) and (4, bfloat16, sending once) in the slow
# pass.
@pytest.mark.parametrize("R,dtype,send_once", [pytest.param(1, jnp.bfloat16, False, marks=pytest.mark.slow),
                                               (1, jnp.float32, False), (4, jnp.bfloat16, False),
                                               pytest.param(4, jnp.bfloat16, True, marks=pytest.mark.slow),
                                               (4, jnp.float32, True)])
def test_recv_rows_match_the_plan(R, dtype, send_once):
  tokens = 48
  mesh, ids, cap_e, cap = _dropping_routing(R, tokens, seed=5)
  x = jnp.asarray(np.random.default_rng(6).standard_normal((tokens * R, D)).astype(np.float32)).astype(dtype)
  f = _dispatch_program(mesh, tokens, cap_e, cap, dtype, send_once=send_once)
  recv, dest_rank, dest_row, recv_rows = (np.asarray(a) for a in f(jnp.asarray(ids), x))
  assert f.aliased == f.buffers, f"{f.aliased} of {f.buffers} outputs computed into the poison"
  xs = np.asarray(x.astype(jnp.float32)).reshape(R, tokens, D)
  want = np.zeros((R, cap, D), np.float32)
  for s in range(R):
    for p in range(tokens * K):
      d, row = dest_rank[s * tokens * K + p], dest_row[s * tokens * K + p]
      if row >= 0:
        want[d, row] = xs[s, p // K]
  assert 0 < recv_rows.min() < cap, (recv_rows, cap)          # rows on every rank, padding rows on one at least
  assert np.array_equal(np.asarray(jnp.asarray(recv).astype(jnp.float32)).reshape(R, cap, D), want)


def test_invalid_expert_id_fails_the_call_at_one_rank():
  # The rows of a one-rank group skip the recv rows; the slot check before them stays.
  tokens = 32
  mesh = mesh_of(1)
  cap_e = plan_lib.expert_capacity(tokens, 1, K, E, None)
  cap = plan_lib.recv_capacity(tokens, 1, K, E, cap_e)
  ids = routing("skewed", tokens, E, K, seed=7)
  x = jnp.ones((tokens, D), jnp.float32)
  f = _dispatch_program(mesh, tokens, cap_e, cap, jnp.float32, poisoned=False)
  jax.block_until_ready(f(jnp.asarray(ids), x))
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"token 3 \(slot 7\) names expert id 9, which is neither -1"):
    jax.block_until_ready(f(jnp.asarray(ids).at[3, 1].set(9), x))
  recv, *_ = f(jnp.asarray(ids), x)                        # the next call works
  assert np.asarray(recv).shape == (cap, D)


def test_bad_slot_primary_fails_the_call():
  # Send once at R = 4: a remote slot whose primary is another token's slot is refused before any row moves (the row
  # it would take is not its token's), naming the slot; the next call works.
  R, tokens = 4, 32
  mesh = mesh_of(R)
  cap_e = plan_lib.expert_capacity(tokens, R, K, E, None)
  cap = plan_lib.recv_capacity(tokens, R, K, E // R, cap_e)
  ids = np.zeros((tokens * R, K), np.int32)
  ids[:, 0], ids[:, 1] = 2, 3                      # both choices on rank 1: every token of ranks 0, 2, 3 sends once
  x = jnp.asarray(np.random.default_rng(3).standard_normal((tokens * R, D)).astype(np.float32))

  def wrong(plan, rank):  # rank 0's slot 3 (token 1, choice 1) names slot 0 (token 0's): same rank, another row
    bad = plan.slot_primary.at[3].set(0)
    return jnp.where(rank == 0, bad, plan.slot_primary)

  good = _dispatch_program(mesh, tokens, cap_e, cap, jnp.float32, poisoned=False, send_once=True)
  f = _dispatch_program(mesh, tokens, cap_e, cap, jnp.float32, poisoned=False, send_once=True, primary_of=wrong)
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"send once: slot 3 names slot 0 of 64 as its primary"):
    jax.block_until_ready(f(jnp.asarray(ids), x))
  recv, *_ = good(jnp.asarray(ids), x)             # the next call works, and its rows are the tokens'
  recv = np.asarray(recv).reshape(R, cap, D)
  xs = np.asarray(x).reshape(R, tokens, D)
  # rank 1's recv: segment (expert 2, source s) for s = 0..3, then (expert 3, s): each source's tokens in order
  assert np.array_equal(recv[1, :2 * tokens * R], np.concatenate([xs.reshape(-1, D)] * 2))


# (1, float32) and (4, bfloat16) in the default pass, the other two in the slow pass.
@pytest.mark.parametrize("R,dtype", [pytest.param(1, jnp.bfloat16, marks=pytest.mark.slow), (1, jnp.float32),
                                     (4, jnp.bfloat16), pytest.param(4, jnp.float32, marks=pytest.mark.slow)])
def test_scaled_rows_are_the_scaled_arrays_rows(R, dtype):
  # row_scale: slot p's row lands as (scale[p] * x[p // K].astype(f32)).astype(dtype), bitwise the dispatch of that
  # [P, D] array (the layer's backward dispatches gates * dy so), with drops, skipped slots, a zero and a negative
  # scale, and rows written into poisoned buffers.
  tokens = 48
  mesh, ids, cap_e, cap = _dropping_routing(R, tokens, seed=8)
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.standard_normal((tokens * R, D)).astype(np.float32)).astype(dtype)
  scale = rng.uniform(0.01, 1.0, tokens * R * K).astype(np.float32)
  scale[5], scale[6] = 0.0, -0.75
  scaled = _dispatch_program(mesh, tokens, cap_e, cap, dtype, scaled=True)
  recv, *_ = scaled(jnp.asarray(ids), x, jnp.asarray(scale))
  assert scaled.aliased == scaled.buffers, f"{scaled.aliased} of {scaled.buffers} outputs computed into the poison"
  # The same slots' rows as a [P, D] array per rank, dispatched unscaled (slot p's own row p).
  rows = (jnp.asarray(scale)[:, None] * jnp.repeat(x, K, axis=0).astype(jnp.float32)).astype(dtype)
  want, *_ = _dispatch_program(mesh, tokens, cap_e, cap, dtype, poisoned=False, slot_rows=True)(jnp.asarray(ids), rows)
  got, want = (np.asarray(a).view(np.uint16 if dtype == jnp.bfloat16 else np.uint32) for a in (recv, want))
  assert np.array_equal(got, want)
  assert np.count_nonzero(np.asarray(jnp.asarray(recv).astype(jnp.float32))) > 0


def test_row_scale_is_refused_where_it_cannot_apply():
  # Sent once (slots share a row), packed e4m3 rows (moved as bytes) and a scale count other than the slots'.
  R, tokens = 4, 16
  mesh = mesh_of(R)
  cap_e = plan_lib.expert_capacity(tokens, R, K, E, None)
  cap = plan_lib.recv_capacity(tokens, R, K, E // R, cap_e)
  ids = jnp.asarray(routing("skewed", tokens * R, E, K, seed=2))
  x = jnp.ones((tokens * R, D), jnp.float32)
  once = _dispatch_program(mesh, tokens, cap_e, cap, jnp.float32, poisoned=False, send_once=True, scaled=True)
  with pytest.raises(ValueError, match="row_scale scales float32 or bfloat16 rows, each slot's own .* sent once"):
    once(ids, x, jnp.ones((tokens * R * K,), jnp.float32))
  f = _dispatch_program(mesh, tokens, cap_e, cap, jnp.float32, poisoned=False, scaled=True)
  with pytest.raises(ValueError, match=r"row_scale \(7,\) must have one scale per slot \(32,\)"):
    f(ids, x, jnp.ones((7 * R,), jnp.float32))
  packed = _dispatch_program(mesh, tokens, cap_e, cap, jnp.uint8, poisoned=False, scaled=True)
  with pytest.raises(ValueError, match="got uint8 rows"):
    packed(ids, jnp.ones((tokens * R, 160), jnp.uint8), jnp.ones((tokens * R * K,), jnp.float32))
