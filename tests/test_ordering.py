"""Every rank runs its workspace calls in the one program order (jax_moe_overlap/ordering.py), even where no data
orders them. XLA:CPU runs ready thunks concurrently: without the token chain, independent dispatches of one program
can deliver rows of one call into another on some ranks (silently wrong results), intermittently, so the runtime
test repeats the program many times and the compile-time test checks the chain itself."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_overlap as jmo
from cases import layer_inputs, mesh_of
from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap import workspace_calls
from jax_moe_overlap.call_site import RankInfo
from jax_moe_overlap.config import CallConfig
from jax_moe_overlap.workspace import Workspace, WorkspaceSizes
from jax_moe_overlap.workspace_backend import DeviceFacts
from jax_moe_overlap.workspace_calls import dispatch

WORKSPACE_TARGETS = ("jmo_dispatch", "jmo_expert_combine")


def workspace_chain(hlo: str) -> list[str]:
  """The workspace custom calls of a compiled entry computation, following the token from the entry's token
  parameter; fails if a call takes its token from anywhere but the previous call (or the parameter, for the first)."""
  calls = {}      # call name -> name of its first operand
  token_of = {}   # get-tuple-element name -> call whose token (tuple index 0) it reads
  params = set()
  for line in hlo.splitlines():
    if m := re.match(r"\s*%(\S+) = token\[\] parameter\(", line):
      params.add(m.group(1))
    elif m := re.match(r"\s*%(\S+) = token\[\] get-tuple-element\(%(\S+)\), index=0", line):
      token_of[m.group(1)] = m.group(2)
    elif (m := re.match(r"\s*%(\S+) = .* custom-call\(%([^,)]+)", line)) and any(
        f'custom_call_target="{t}"' in line for t in WORKSPACE_TARGETS):
      calls[m.group(1)] = m.group(2)
  chain, prev = [], None
  pending = dict(calls)
  while pending:
    nxt = [c for c, op in pending.items() if (op in params if prev is None else token_of.get(op) == prev)]
    assert len(nxt) == 1, f"after {prev!r}: calls taking its token: {nxt}; not yet chained: {pending}"
    prev = nxt[0]
    chain.append(prev)
    del pending[prev]
  return chain


def test_two_independent_layers_and_their_backward_passes_form_one_chain():
  mesh = mesh_of(4)
  a = layer_inputs(64, 16, 24, 8, 2, "skewed", 21)
  b = layer_inputs(64, 16, 24, 8, 2, "balanced", 22)

  def loss(xa, xb):   # no data between the layers
    ya = jmo.moe_experts(xa, *a[1:], mesh=mesh)[0]
    yb = jmo.moe_experts(xb, *b[1:], mesh=mesh)[0]
    return jnp.sum(ya ** 2) + jnp.sum(yb ** 2)

  hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(a[0], b[0]).compile().as_text()
  chain = workspace_chain(hlo)
  # Forward: dispatch and expert_combine per layer; backward: the same again.
  assert len(chain) == 8, chain


@pytest.mark.slow  # 600 repetitions: the reordering it guards against is intermittent
def test_independent_dispatches_deliver_their_own_rows():
  # Eight dispatches of one program with no data between them (they share only the plan). Rank r sends rows valued
  # 100 * site + r, so a row from another site shows which call a peer ran where this rank ran this one.
  R, T, D, E, sites, reps = 4, 64, 32, 8, 8, 600
  mesh = mesh_of(R)
  cap_e = plan_lib.expert_capacity(T, R, 1, E, None)
  cap = plan_lib.recv_capacity(T, R, 1, E // R, cap_e)
  ws = Workspace.get(mesh, "expert", WorkspaceSizes(row_bytes=D * 4, recv_rows=cap, ret_rows=T, num_segments=E))
  info = RankInfo(ws, CallConfig(timeout_ms=5000))

  def local(ids, xs):
    rank = jax.lax.axis_index("expert").astype(jnp.int32)
    counts = plan_lib.local_counts(ids, E).reshape(R, E // R)
    plan = plan_lib.make_plan(ids, jax.lax.all_gather(counts, "expert"), rank, cap_e)
    outs = [dispatch(xs[i], jnp.arange(T, dtype=jnp.int32), plan, cap, info)[None] for i in range(sites)]
    return jnp.concatenate(outs), plan.recv_rows[None]

  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("expert"), P(None, "expert")),
                             out_specs=(P(None, "expert"), P("expert")), check_vma=False))
  ids = jnp.asarray((np.arange(R * T) % E).reshape(R * T, 1).astype(np.int32))   # every call moves the same rows
  src_rank = np.repeat(np.arange(R), T).astype(np.float32)[:, None]
  xs = jnp.stack([jnp.asarray(100.0 * i + src_rank + np.zeros((R * T, D), np.float32)) for i in range(sites)])
  assert len(workspace_chain(fn.lower(ids, xs).compile().as_text())) == sites
  for rep in range(reps):
    out, rows = fn(ids, xs)
    out = np.asarray(out).reshape(sites, R, cap, D)
    rows = np.asarray(rows)
    for r in range(R):
      for i in range(sites):
        got = out[i, r, :rows[r], 0]
        assert rows[r] > 0 and np.all(got // 100 == i), (
            f"run {rep}: rank {r}'s dispatch #{i} received rows of dispatches {sorted(set((got // 100).astype(int).tolist()))}")


def test_a_failed_call_does_not_fail_the_next_program():
  # The token chain stops at the end of each program: a program whose workspace call failed must not hand its
  # (failed) token to the next one.
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(32, 16, 24, 8, 2, "skewed", 1)
  f = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh, config=jmo.CallConfig(timeout_ms=5000))[0])
  g = jax.jit(lambda *a: 2 * jmo.moe_experts(*a, mesh=mesh)[0])
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"names expert id 99, which is neither -1"):
    jax.block_until_ready(f(x, ids.at[3, 1].set(99), gates, w1, w2))
  y_ref, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl="reference")
  np.testing.assert_allclose(g(x, ids, gates, w1, w2), 2 * y_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(f(x, ids, gates, w1, w2), y_ref, rtol=1e-5, atol=1e-5)


def test_an_ahead_of_time_compiled_program_runs_more_than_once():
  # jit(f).lower(...).compile() gives an object whose later calls take JAX's C++ path: it must still pass the
  # ordered effect's token (ordering._keep_tokens_in_compiled_calls), forward and backward.
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(32, 16, 24, 8, 2, "skewed", 2)
  y_ref, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl="reference")
  fwd = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh)[0]).lower(x, ids, gates, w1, w2).compile()
  first = fwd(x, ids, gates, w1, w2)
  np.testing.assert_allclose(first, y_ref, rtol=1e-5, atol=1e-5)
  for _ in range(2):
    np.testing.assert_array_equal(fwd(x, ids, gates, w1, w2), first)
  loss = lambda x, w1: jnp.sum(jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh)[0] ** 2)
  grad = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w1).compile()
  g0 = grad(x, w1)
  for a, b in zip(grad(x, w1), g0):
    np.testing.assert_array_equal(a, b)


def test_cuda_workspace_calls_carry_no_effect():
  """On CUDA the workspace calls must stay effect-free: any effect (``has_side_effect=True`` included) turns off
  jit's C++ dispatch fast path (workspace_calls._workspace_call says why that matters).
  Traced only (no lowering, no GPU): a stand-in workspace that says it is a CUDA one."""

  class CudaLikeWorkspace:
    platform = "cuda"
    handle = 1
    ranks = 2
    device = DeviceFacts(compute_capability=(9, 0), sm_budget=132, consumer_policy="test", calibration=None)

  info = RankInfo(CudaLikeWorkspace(), CallConfig())
  jaxpr = jax.make_jaxpr(lambda x: workspace_calls._workspace_call(
      info, "jmo_dispatch", jax.ShapeDtypeStruct(x.shape, x.dtype), x, **info.attrs()))(
          jnp.ones((4, 8), jnp.float32))
  assert not jaxpr.effects, jaxpr.effects
  assert any(e.primitive.name == "ffi_call" for e in jaxpr.eqns)
