"""dispatch_gemm's CPU handler (csrc/cpu/dispatch_gemm.cc) on 4 CPU devices: the call against dispatch +
grouped_matmul, the layer with CallConfig(dispatch_pushers=2) against the two calls (bit for bit, with
jmo_grouped_matmul as GEMM1: layer_checks.grouped_matmul_gemms) and the reference, repeated calls, and failures
inside it with the recovery after them. tests/test_eight_ranks.py runs the layer comparison on 8 devices."""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_overlap as jmo
import layer_checks
from jax_moe_overlap import _jmo
from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap.grouped_gemm import grouped_matmul
from jax_moe_overlap.primitives import CallConfig, RankInfo, dispatch, dispatch_gemm
from jax_moe_overlap.workspace import Workspace, WorkspaceSizes
from cases import layer_inputs, mesh_of, rel_err, routing

E, D, F = 8, 32, 48
FUSED = CallConfig(dispatch_pushers=2)


def src_blocks_nonzero(mesh):
  """Nonzero src_blocks counters over every rank of every CPU workspace of `mesh`'s devices."""
  devices = set(mesh.devices.flat)
  total = 0
  for ws in Workspace.cached():
    if ws.platform == "cpu" and set(ws.mesh.devices.flat) == devices:
      total += sum(int(v != 0) for g in range(ws.groups) for r in range(ws.ranks)
                   for v in _jmo.cpu_src_blocks(ws.handle, g, r))
  return total


# ---------------------------------------------------------------------------------------------------------------
# The call on its own: (recv, a) against dispatch, then grouped_matmul, bit for bit.

def _call_fns(mesh, tokens, k, cap_e, cap, dtype, N, transpose_rhs):
  R = mesh.shape["expert"]
  sizes = WorkspaceSizes(row_bytes=D * jnp.dtype(dtype).itemsize, recv_rows=cap, ret_rows=tokens * k,
                         num_segments=E)
  info = RankInfo(Workspace.get(mesh, "expert", sizes), FUSED)

  def plan_of(ids):
    rank = jax.lax.axis_index("expert").astype(jnp.int32)
    counts_all = jax.lax.all_gather(plan_lib.local_counts(ids, E).reshape(R, E // R), "expert")
    return plan_lib.make_plan(ids, counts_all, rank, cap_e)

  def fused(ids, x, w):
    plan = plan_of(ids)
    return dispatch_gemm(x, jnp.arange(tokens * k, dtype=jnp.int32) // k, w, plan, cap, info, transpose_rhs)

  def two_calls(ids, x, w):
    plan = plan_of(ids)
    x_recv = dispatch(x, jnp.arange(tokens * k, dtype=jnp.int32) // k, plan, cap, info)
    return x_recv, grouped_matmul(x_recv, w, plan.expert_rows, transpose_rhs=transpose_rhs,
                                  preferred_element_type=jnp.float32)

  def kept_rows(ids):
    return plan_of(ids).recv_rows.reshape(1)

  spec = P("expert")
  wrap = lambda f, n: jax.shard_map(f, mesh=mesh, in_specs=(spec,) * n, out_specs=(spec, spec), check_vma=False)
  return (layer_checks.Poisoned(wrap(fused, 3), mesh), jax.jit(wrap(two_calls, 3)),
          jax.jit(jax.shard_map(kept_rows, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)))


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind,cf,skip", [("all_to_one", None, False), ("skewed", 0.5, True)])
def test_call_equals_dispatch_and_grouped_matmul(kind, cf, skip, dtype, transpose_rhs):
  # 160 tokens x 2 choices per rank: 3 send blocks per source; "all_to_one" gives segments of 160 rows (two tiles,
  # each across two blocks), "skewed" at cf 0.5 drops slots, and `skip` leaves every fifth token's second slot -1.
  mesh, R, tokens, k, N = mesh_of(4), 4, 160, 2, 40
  ids = routing(kind, tokens * R, E, k, seed=21)
  if skip:
    ids[::5, 1] = plan_lib.SKIP
  cap_e = plan_lib.expert_capacity(tokens, R, k, E, cf)
  cap = plan_lib.recv_capacity(tokens, R, k, E // R, cap_e)
  kx, kw = jax.random.split(jax.random.PRNGKey(3))
  x = jax.random.normal(kx, (tokens * R, D), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (E, N, D) if transpose_rhs else (E, D, N), jnp.float32) / np.sqrt(D)).astype(dtype)
  fused, two_calls, kept_rows = _call_fns(mesh, tokens, k, cap_e, cap, dtype, N, transpose_rhs)
  got = fused(jnp.asarray(ids), x, w)
  want = two_calls(jnp.asarray(ids), x, w)
  assert fused.aliased == fused.buffers, f"{fused.aliased} of {fused.buffers} outputs computed into the poison"
  for name, a, b in zip(("recv", "a"), got, want):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), f"{name} differs from dispatch + grouped_matmul"
  a = np.asarray(got[1]).reshape(R, cap, N)
  kept = np.asarray(kept_rows(jnp.asarray(ids)))
  assert kept.sum() > 0
  for r in range(R):  # rows past the kept ones are zero (written: the output was poisoned)
    assert np.all(a[r, kept[r]:] == 0) and (kept[r] == 0 or np.abs(a[r, :kept[r]]).max() > 0), r
  assert src_blocks_nonzero(mesh) == 0, "a call must leave its src_blocks zero"


# ---------------------------------------------------------------------------------------------------------------
# The layer.

def layer_fn(mesh, cf, config=CallConfig(), impl="overlap"):
  """jit((x, gates, w1, w2, ids) -> ((loss, (y, dropped)), grads wrt x, gates, w1, w2)) with a non-linear read-out;
  the routing is an argument, so one program serves every routing of a shape."""
  def loss(x, gates, w1, w2, ids):
    y, dropped = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, capacity_factor=cf, impl=impl, config=config)
    return jnp.sum(jnp.sin(y.astype(jnp.float32)) * jnp.arange(y.size).reshape(y.shape) / y.size), (y, dropped)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def layer_case(R, kind, skip, dtype, tokens_per_rank=40, k=2, seed=5):
  x, ids, gates, w1, w2 = layer_inputs(tokens_per_rank * R, D, F, E, k, kind, seed, dtype)
  if skip:
    ids = ids.at[::3, 1].set(plan_lib.SKIP)
  return (x, gates, w1, w2, ids)


def check_layer_equals_two_calls(mesh, cases, dtype, cf, tokens_per_rank=80):
  """The fused layer against the two calls with jmo_grouped_matmul as GEMM1 (bit for bit: loss, y, dropped and the
  gradients w.r.t. x, gates, w1, w2), and within rounding of the default two calls (XLA's ragged_dot as GEMM1) and the
  float32 reference, on each (kind, skip) routing; the fused program runs dispatch_gemm twice (forward, backward)
  and dispatch never. 80 tokens x 2 choices per rank: two 128-row send blocks per source, and tiles across both."""
  R = mesh.shape["expert"]
  fused = layer_fn(mesh, cf, FUSED)
  inputs = [layer_case(R, kind, skip, dtype, tokens_per_rank) for kind, skip in cases]
  hlo = fused.lower(*inputs[0]).as_text()
  assert hlo.count("@jmo_dispatch_gemm(") == 2 and "@jmo_dispatch(" not in hlo, "the layer did not fuse"
  got = [fused(*a) for a in inputs]
  with layer_checks.grouped_matmul_gemms():
    two_calls = layer_fn(mesh, cf)
    want = [two_calls(*a) for a in inputs]
  default, reference = layer_fn(mesh, cf), layer_fn(mesh, cf, impl="reference")
  for (kind, skip), a, g, w_ in zip(cases, inputs, got, want):
    same = [x == y for x, y in zip(layer_checks.bits(g), layer_checks.bits(w_))]
    assert all(same), f"{kind} skip={skip}: fused differs from the two calls: {same} (loss, y, dropped, grads)"
    (_, (y, dropped)), grads = g
    (_, (y_d, dropped_d)), grads_d = default(*a)
    (_, (y_ref, dropped_ref)), grads_ref = reference(*(v.astype(jnp.float32) for v in a[:4]), a[4])
    assert int(dropped) == int(dropped_d) == int(dropped_ref)
    assert (int(dropped) > 0) == (cf is not None), "the capacity cases drop, the dropless ones not"
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert rel_err(y, y_d) < tol and rel_err(y, y_ref) < tol, (kind, rel_err(y, y_d), rel_err(y, y_ref))
    for name, v, v_d, v_ref in zip(("x", "gates", "w1", "w2"), grads, grads_d, grads_ref):
      assert rel_err(v, v_d) < tol * 10 and rel_err(v, v_ref) < tol * 10, (kind, name)
  assert src_blocks_nonzero(mesh) == 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_equals_two_calls_dropless(dtype):
  check_layer_equals_two_calls(mesh_of(4), [("balanced", False), ("skewed", False), ("skewed", True),
                                            ("all_to_one", False)], dtype, None)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_equals_two_calls_with_capacity_drops(dtype):
  check_layer_equals_two_calls(mesh_of(4), [("skewed", False), ("skewed", True)], dtype, 0.5)


def test_fifty_calls_bitwise_identical_and_counters_zero():
  # 50 epochs back to back with no reset between them: every call zeroes the src_blocks it used, so the next one's
  # waits count only its own rows.
  mesh = mesh_of(4)
  x, gates, w1, w2, ids = layer_case(4, "skewed", True, jnp.float32, tokens_per_rank=64)
  f = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh, config=FUSED)[0])
  first = np.asarray(f(x, ids, gates, w1, w2))
  y_ref, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl="reference")
  np.testing.assert_allclose(first, y_ref, rtol=1e-5, atol=1e-5)
  outs = [f(x, ids, gates, w1, w2) for _ in range(50)]
  assert sum(int(np.asarray(y).tobytes() != first.tobytes()) for y in outs) == 0
  assert src_blocks_nonzero(mesh) == 0


def test_bad_expert_id_is_named_and_the_next_call_works():
  mesh = mesh_of(4)
  x, gates, w1, w2, ids = layer_case(4, "skewed", False, jnp.float32, tokens_per_rank=8)
  f = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh, config=CallConfig(timeout_ms=5000, dispatch_pushers=2)))
  good = np.asarray(f(x, ids, gates, w1, w2)[0])
  # Global token 9 is rank 1's token 1; its choice 1 is that rank's slot 3.
  with pytest.raises(jax.errors.JaxRuntimeError) as err:
    jax.block_until_ready(f(x, ids.at[9, 1].set(11), gates, w1, w2))
  assert re.search(r"rank 1 \(group 0\) found an invalid input in epoch \d+: its token 1 \(slot 3\) names expert id "
                   r"11", str(err.value)), str(err.value)
  np.testing.assert_array_equal(np.asarray(f(x, ids, gates, w1, w2)[0]), good)
  assert src_blocks_nonzero(mesh) == 0


def test_timeout_at_src_block_names_the_late_source_and_recovery_clears_the_counters():
  mesh = mesh_of(4)
  timeout_ms, late = 300, 1
  x, gates, w1, w2, ids = layer_case(4, "balanced", False, jnp.float32, tokens_per_rank=16)
  # Every rank keeps rows from the late rank, so each of the others times out waiting for its blocks.
  late_ids = np.asarray(ids)[late * 16:(late + 1) * 16]
  assert set(np.unique(late_ids // (E // 4))) == {0, 1, 2, 3}
  run = lambda config: jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh, config=config)[0])
  fused, held = run(FUSED), run(CallConfig(timeout_ms=timeout_ms, delay_rank=late, delay_us=2_000_000,
                                           dispatch_pushers=2))
  good = np.asarray(fused(x, ids, gates, w1, w2))
  held.lower(x, ids, gates, w1, w2).compile()
  t0 = time.monotonic()
  with pytest.raises(jax.errors.JaxRuntimeError) as err:
    jax.block_until_ready(held(x, ids, gates, w1, w2))
  msg = str(err.value)
  assert "DEADLINE_EXCEEDED" in msg and f"timed out after {timeout_ms} ms" in msg, msg
  assert "at stage src_block" in msg and f"waiting for peer {late}: observed 0, expected " in msg, msg
  assert time.monotonic() - t0 < 10, "the others must fail at their timeout"
  # The failed call left counters behind (its pushes landed, no rank reached its zeroing); the next workspace call,
  # a plain dispatch that never touches src_blocks, meets the group at the recovery barrier, which clears them.
  assert src_blocks_nonzero(mesh) > 0
  y = jax.block_until_ready(jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh)[0])(x, ids, gates, w1, w2))
  assert src_blocks_nonzero(mesh) == 0
  np.testing.assert_allclose(y, good, rtol=1e-5, atol=1e-5)
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(fused(x, ids, gates, w1, w2)), good)


@pytest.mark.slow  # two more meshes, each compiling the fused and the two-call programs again
@pytest.mark.parametrize("R", [1, 2])
def test_layer_equals_two_calls_dispatch_on_1_and_2_ranks(R):
  # R = 1: no pushes, the rank's own rows only; R = 2: one peer per round.
  check_layer_equals_two_calls(mesh_of(R), [("skewed", True), ("all_to_one", False)], jnp.bfloat16, None)
