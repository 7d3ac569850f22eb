"""dispatch_gemm's CPU handler (ffi/cpu/dispatch_gemm.cc) on 4 CPU devices: the call against dispatch +
grouped_matmul (plain, and transpose_rhs) and dispatch + grouped_matmul_swiglu (swiglu, with and without x_recv and
the preactivation) in the kept rows, its padding rows read by no consumer of the layer, its shape errors, the layer
with CallConfig(dispatch_pushers=2) against the two calls (bit for bit, with the bare grouped GEMM calls:
layer_checks.grouped_matmul_gemms) and the reference, repeated calls, and failures inside it with the recovery after
them. tests/test_eight_ranks.py runs the layer comparison on 8 devices."""

import dataclasses
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
from jax_moe_overlap import api as jmo_api
from jax_moe_overlap import expert_block
from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap import workspace_calls
from jax_moe_overlap.call_site import RankInfo, dispatch_pushers
from jax_moe_overlap.config import CallConfig
from jax_moe_overlap.grouped_gemm import grouped_matmul, grouped_matmul_swiglu
from jax_moe_overlap.workspace import Workspace, WorkspaceSizes
from jax_moe_overlap.workspace_backend import DeviceFacts
from jax_moe_overlap.workspace_calls import dispatch, dispatch_gemm
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
# The call on its own: its kept results against dispatch, then the bare grouped GEMM, bit for bit.

# (name, transpose_rhs, swiglu, keep_recv, keep_a): the backward's plain GEMM (d_out W2^T), the plain GEMM as is, and
# GEMM1 with its SwiGLU in a training step (x_recv and a kept) and in inference (neither).
MODES = [("plain", False, False, True, False), ("plain_transposed", True, False, True, False),
         ("swiglu_train", False, True, True, True), ("swiglu_inference", False, True, False, False)]


def _call_setup(mesh, tokens, k, cap_e, cap, dtype, config=FUSED):
  R = mesh.shape["expert"]
  sizes = WorkspaceSizes(row_bytes=D * jnp.dtype(dtype).itemsize, recv_rows=cap, ret_rows=tokens * k,
                         num_segments=E)
  info = RankInfo(Workspace.get(mesh, "expert", sizes), config)

  def plan_of(ids):
    rank = jax.lax.axis_index("expert").astype(jnp.int32)
    counts_all = jax.lax.all_gather(plan_lib.local_counts(ids, E).reshape(R, E // R), "expert")
    return plan_lib.make_plan(ids, counts_all, rank, cap_e)

  def sharded(f, n_in, n_out):
    spec = P("expert")
    return jax.shard_map(f, mesh=mesh, in_specs=(spec,) * n_in, out_specs=(spec,) * n_out, check_vma=False)

  return info, plan_of, sharded


def _call_fns(mesh, tokens, k, cap_e, cap, dtype, mode, send_once=False, config=FUSED, a_dtype=jnp.float32,
              out_dtype=jnp.float32):
  """(fused, two_calls, kept_rows, names): the call (sending each row once per destination rank with send_once) and
  its two-call twin (one row per slot), each returning the results the mode keeps (named by `names`; a kept in
  a_dtype; without the SwiGLU, out in out_dtype), and each rank's kept recv rows; the calls' CallConfig `config`."""
  _, transpose_rhs, swiglu, keep_recv, keep_a = mode
  info, plan_of, sharded = _call_setup(mesh, tokens, k, cap_e, cap, dtype, config)
  slot_rows = jnp.arange(tokens * k, dtype=jnp.int32) // k
  names = tuple(n for n, kept in (("x_recv", keep_recv), ("out", True), ("a", keep_a)) if kept)

  def fused(ids, x, w):
    got = dispatch_gemm(x, slot_rows, w, plan_of(ids), cap, info, transpose_rhs=transpose_rhs, swiglu=swiglu,
                        keep_recv=keep_recv, keep_a=keep_a, a_dtype=a_dtype, out_dtype=out_dtype,
                        send_once=send_once)
    assert [v is not None for v in got] == [keep_recv, True, keep_a]
    return tuple(v for v in got if v is not None)

  def two_calls(ids, x, w):
    plan = plan_of(ids)
    x_recv = dispatch(x, slot_rows, plan, cap, info)
    if swiglu:
      out, a = grouped_matmul_swiglu(x_recv, w, plan.expert_rows, keep_preactivation=keep_a,
                                     preactivation_dtype=a_dtype)
    else:
      out, a = grouped_matmul(x_recv, w, plan.expert_rows, transpose_rhs=transpose_rhs,
                              preferred_element_type=out_dtype), None
    return tuple(v for v, kept in ((x_recv, keep_recv), (out, True), (a, keep_a)) if kept)

  kept_rows = jax.jit(sharded(lambda ids: (plan_of(ids).recv_rows.reshape(1),), 1, 1))
  n = len(names)
  return (layer_checks.Poisoned(sharded(fused, 3, n), mesh), jax.jit(sharded(two_calls, 3, n)),
          lambda ids: np.asarray(kept_rows(ids)[0]), names)


ROUTED = [("all_to_one", None, False), ("skewed", 0.5, True)]
# Each mode once in the default pass, each dtype and each routing twice among them: the rest of the product (each
# case compiles its two programs) in the slow pass.
DEFAULT_CALLS = {("plain", "float32", "all_to_one"), ("plain_transposed", "float32", "skewed"),
                 ("swiglu_train", "bfloat16", "all_to_one"), ("swiglu_inference", "bfloat16", "skewed")}


@pytest.mark.parametrize("kind,cf,skip,dtype,mode", [
    pytest.param(*routed, dtype, mode, id=f"{routed[0]}-{jnp.dtype(dtype).name}-{mode[0]}",
                 marks=() if (mode[0], jnp.dtype(dtype).name, routed[0]) in DEFAULT_CALLS else pytest.mark.slow)
    for routed in ROUTED for dtype in (jnp.float32, jnp.bfloat16) for mode in MODES])
def test_call_equals_dispatch_and_grouped_gemm(kind, cf, skip, dtype, mode, send_once=False, config=FUSED,
                                               a_dtype=jnp.float32, out_dtype=jnp.float32):
  # 160 tokens x 2 choices per rank: 3 send blocks per source; "all_to_one" gives segments of 160 rows (two tiles,
  # each across two blocks), "skewed" at cf 0.5 drops slots, and `skip` leaves every fifth token's second slot -1.
  # The twin: dispatch, then grouped_matmul (out_dtype out) or grouped_matmul_swiglu (h, and a when kept).
  mesh, R, tokens, k, N = mesh_of(4), 4, 160, 2, 40
  transpose_rhs = mode[1]
  ids = routing(kind, tokens * R, E, k, seed=21)
  if skip:
    ids[::5, 1] = plan_lib.SKIP
  cap_e = plan_lib.expert_capacity(tokens, R, k, E, cf)
  cap = plan_lib.recv_capacity(tokens, R, k, E // R, cap_e)
  kx, kw = jax.random.split(jax.random.PRNGKey(3))
  x = jax.random.normal(kx, (tokens * R, D), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (E, N, D) if transpose_rhs else (E, D, N), jnp.float32) / np.sqrt(D)).astype(dtype)
  fused, two_calls, kept_rows, names = _call_fns(mesh, tokens, k, cap_e, cap, dtype, mode, send_once, config,
                                                 a_dtype, out_dtype)
  got = fused(jnp.asarray(ids), x, w)
  want = two_calls(jnp.asarray(ids), x, w)
  assert fused.aliased == fused.buffers == len(names) * R, \
      f"{fused.aliased} of {fused.buffers} outputs computed into the poison"
  kept = kept_rows(jnp.asarray(ids))
  assert kept.sum() > 0
  for name, a, b in zip(names, got, want):
    assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
    assert name != "a" or a.dtype == a_dtype, a.dtype
    assert name != "out" or mode[2] or a.dtype == out_dtype, a.dtype
    a, b = np.asarray(a).reshape(R, cap, -1), np.asarray(b).reshape(R, cap, -1)
    for r in range(R):
      # The kept rows: bitwise the two calls'. The rows past them are unspecified: the call leaves them unwritten (no
      # consumer reads them: test_layer_reads_no_padding_row_of_dispatch_gemm), so they hold whatever XLA's buffer
      # held, where the two calls zero them.
      assert a[r, :kept[r]].tobytes() == b[r, :kept[r]].tobytes(), f"{name} differs from the two calls on rank {r}"
      assert kept[r] == 0 or np.abs(a[r, :kept[r]].astype(np.float32)).max() > 0, (name, r)
  assert src_blocks_nonzero(mesh) == 0, "a call must leave its src_blocks zero"


# bfloat16 (the layer's dtype) in the default pass, float32 in the slow pass.
@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow), jnp.bfloat16])
def test_call_with_row_scale_equals_the_scaled_rows(dtype):
  # row_scale (the layer's backward dispatches gates * dy so: dy's rows, each slot's scaled as it moves, then dh =
  # d_out W2^T, W2 read transposed, in the compute dtype): x_recv and out bit for bit the call's on the [P, D] array of
  # scaled rows (slot p's own row p), with drops, skipped slots, a zero and a negative scale; sending once is refused.
  mesh, R, tokens, k, N = mesh_of(4), 4, 160, 2, 40
  ids = routing("skewed", tokens * R, E, k, seed=22)
  ids[::5, 1] = plan_lib.SKIP
  cap_e = plan_lib.expert_capacity(tokens, R, k, E, 0.5)
  cap = plan_lib.recv_capacity(tokens, R, k, E // R, cap_e)
  info, plan_of, sharded = _call_setup(mesh, tokens, k, cap_e, cap, dtype)
  kx, kw, ks = jax.random.split(jax.random.PRNGKey(5), 3)
  x = jax.random.normal(kx, (tokens * R, D), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (E, N, D), jnp.float32) / np.sqrt(D)).astype(dtype)
  scale = jax.random.uniform(ks, (tokens * R * k,), jnp.float32, 0.01, 1.0).at[2].set(0.0).at[3].set(-0.5)
  rows = (scale[:, None] * jnp.repeat(x, k, axis=0).astype(jnp.float32)).astype(dtype)
  slots = jnp.arange(tokens * k, dtype=jnp.int32)

  def scaled(ids, x, scale, w):
    got = dispatch_gemm(x, slots // k, w, plan_of(ids), cap, info, transpose_rhs=True, out_dtype=dtype,
                        row_scale=scale)
    return got[0], got[1], plan_of(ids).recv_rows.reshape(1)

  def of_rows(ids, rows, w):
    return dispatch_gemm(rows, slots, w, plan_of(ids), cap, info, transpose_rhs=True, out_dtype=dtype)[:2]

  got_recv, got_out, kept = jax.jit(sharded(scaled, 4, 3))(jnp.asarray(ids), x, scale, w)
  want_recv, want_out = jax.jit(sharded(of_rows, 3, 2))(jnp.asarray(ids), rows, w)
  kept = np.asarray(kept)
  assert kept.sum() > 0
  for name, a, b in (("x_recv", got_recv, want_recv), ("out", got_out, want_out)):
    a, b = np.asarray(a).reshape(R, cap, -1), np.asarray(b).reshape(R, cap, -1)
    for r in range(R):
      assert a[r, :kept[r]].tobytes() == b[r, :kept[r]].tobytes(), f"{name} differs on rank {r}"
  with pytest.raises(ValueError, match="row_scale scales float32 or bfloat16 rows, each slot's own .* sent once"):
    jax.jit(sharded(lambda ids, x, scale, w: dispatch_gemm(x, slots // k, w, plan_of(ids), cap, info,
                                                           transpose_rhs=True, row_scale=scale, send_once=True)[1],
                    4, 1))(jnp.asarray(ids), x, scale, w)


# The default pass sends once with the plain transposed GEMM here, and with the SwiGLU's training form in
# test_call_with_x_recv_copied_equals_the_two_calls; the other two cases in the slow pass.
@pytest.mark.parametrize("kind,cf,skip,dtype,mode", [
    pytest.param(*ROUTED[0], jnp.bfloat16, MODES[2], id="all_to_one-bfloat16-swiglu_train", marks=pytest.mark.slow),
    pytest.param(*ROUTED[1], jnp.float32, MODES[1], id="skewed-float32-plain_transposed"),
    pytest.param(*ROUTED[1], jnp.bfloat16, MODES[3], id="skewed-bfloat16-swiglu_inference", marks=pytest.mark.slow)])
def test_call_sending_once_equals_the_two_calls(kind, cf, skip, dtype, mode):
  # Send once (each token's row crosses to a rank once; the receiver fills its other rows before the GEMM tiles that
  # read them) against the two calls sending one row per slot: bit for bit, and src_blocks left zero.
  test_call_equals_dispatch_and_grouped_gemm(kind, cf, skip, dtype, mode, send_once=True)


def test_call_keeping_a_in_bfloat16_equals_the_two_calls():
  # The preactivation kept in the compute dtype (the layer's residual, expert_gemms.kept_preactivation_dtype): the
  # handler rounds each tile's float32 product once, as grouped_matmul_swiglu does, so the two calls' bits again.
  test_call_equals_dispatch_and_grouped_gemm(*ROUTED[1], jnp.bfloat16, MODES[2], a_dtype=jnp.bfloat16)


# plain_transposed (the backward's dh = d_out W2^T) in the default pass, plain in the slow pass.
@pytest.mark.parametrize("mode", [pytest.param(MODES[0], marks=pytest.mark.slow), MODES[1]], ids=lambda m: m[0])
def test_call_with_a_bf16_product_equals_the_two_calls(mode):
  # The plain product in the compute dtype (the layer's backward asks its dh so: expert_gemms.dgrad_dtype): the
  # handler rounds each row's float32 sums once, as grouped_matmul with a bfloat16 output does, so the two calls'
  # bits again, also sending once.
  test_call_equals_dispatch_and_grouped_gemm(*ROUTED[1], jnp.bfloat16, mode, out_dtype=jnp.bfloat16)
  test_call_equals_dispatch_and_grouped_gemm(*ROUTED[0], jnp.bfloat16, mode, send_once=True, out_dtype=jnp.bfloat16)


def test_call_with_x_recv_copied_equals_the_two_calls():
  # CallConfig(x_recv_from_tiles=False) (on CUDA the side units copy x_recv; the default, True, has the GEMM tiles
  # store it) travels as a call attribute on every platform; the CPU handler decodes it with the other options and
  # ignores it: the kept results are still the two calls' bit for bit. Then the config's type rule.
  test_call_equals_dispatch_and_grouped_gemm(*ROUTED[1], jnp.bfloat16, MODES[2], send_once=True,
                                             config=CallConfig(dispatch_pushers=2, x_recv_from_tiles=False))
  with pytest.raises(ValueError, match="x_recv_from_tiles must be a bool"):
    CallConfig(x_recv_from_tiles=1)


def test_call_shape_errors_name_the_problem():
  mesh, R, tokens, k, N = mesh_of(4), 4, 8, 2, 8
  ids = routing("balanced", tokens * R, E, k, seed=2)
  cap_e = plan_lib.expert_capacity(tokens, R, k, E, None)
  cap = plan_lib.recv_capacity(tokens, R, k, E // R, cap_e)
  info, plan_of, sharded = _call_setup(mesh, tokens, k, cap_e, cap, jnp.float32)
  x = jnp.ones((tokens * R, D), jnp.float32)
  slot_rows = jnp.arange(tokens * k, dtype=jnp.int32) // k
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)

  def raw(out_types, transpose_rhs, swiglu):
    """The custom call with these result types, past the Python wrapper's checks: the handler's own."""
    def f(ids, x, w):
      return tuple(workspace_calls._dispatch_gemm_call(x, slot_rows, w, plan_of(ids), info, out_types, transpose_rhs,
                                                  swiglu))  # pylint: disable=protected-access
    return jax.jit(sharded(f, 3, 3))

  w = jnp.ones((E, D, N), jnp.float32)
  with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(
      "dispatch_gemm: expected src [S, D], w [E_local, D, N], x_recv [cap or 0, D], out [cap, N / 2] and a "
      f"[cap or 0, N] (swiglu); got src [{tokens}, {D}], w [{E // R}, {D}, {N}], x_recv [{cap}, {D}], out "
      f"[{cap}, {N // 2}], a [{cap}, {N + 2}]")):
    jax.block_until_ready(raw((shape(cap, D), shape(cap, N // 2), shape(cap, N + 2)), False, True)(
        jnp.asarray(ids), x, w))
  with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape("out [cap, N] and a [0, N]; got")):
    jax.block_until_ready(raw((shape(cap, D), shape(cap, N), shape(cap, N)), False, False)(jnp.asarray(ids), x, w))
  with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(
      "dispatch_gemm: without swiglu, out must be float32 or src's dtype, and a float32")):
    jax.block_until_ready(raw((shape(cap, D), jax.ShapeDtypeStruct((cap, N), jnp.bfloat16), shape(0, N)), False,
                              False)(jnp.asarray(ids), x, w))
  with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(
      "dispatch_gemm: swiglu is GEMM1's epilogue (w [E_local, D, 2F]), not for transpose_rhs")):
    jax.block_until_ready(raw((shape(cap, D), shape(cap, D // 2), shape(0, D)), True, True)(
        jnp.asarray(ids), x, jnp.ones((E, D, D), jnp.float32)))
  # The wrapper refuses the same before tracing a call.
  plan = object()  # never reached
  with pytest.raises(ValueError, match="swiglu is GEMM1's epilogue .* does not take transpose_rhs"):
    dispatch_gemm(x, slot_rows, jnp.ones((E, N, D)), plan, cap, info, transpose_rhs=True, swiglu=True)
  with pytest.raises(ValueError, match="keep_a needs swiglu=True"):
    dispatch_gemm(x, slot_rows, w, plan, cap, info, keep_a=True)
  with pytest.raises(TypeError, match=r"dispatch_gemm: out_dtype must be float32 or the operands' dtype float32, got "
                                      r"bfloat16"):
    dispatch_gemm(x, slot_rows, w, plan, cap, info, out_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="out_dtype is the plain product's; with swiglu out is h in src's dtype"):
    dispatch_gemm(x, slot_rows, w, plan, cap, info, swiglu=True, out_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match=r"an even number of columns.*got w \(8, 32, 7\)"):
    dispatch_gemm(x, slot_rows, w[:, :, :7], plan, cap, info, swiglu=True)
  with pytest.raises(ValueError, match=r"do not fit src \[S, D\], w \[E_local, N, D\] \(transpose_rhs\)"):
    dispatch_gemm(x, slot_rows, w, plan, cap, info, transpose_rhs=True)
  # A shape error is found before the call opens an epoch: the group goes on.
  f = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh, config=FUSED)[0])
  x_l, ids_l, gates, w1, w2 = layer_inputs(tokens * R, D, F, E, k, "balanced", 2)
  y_ref, _ = jmo.moe_experts(x_l, ids_l, gates, w1, w2, mesh=mesh, impl="reference")
  np.testing.assert_allclose(f(x_l, ids_l, gates, w1, w2), y_ref, rtol=1e-5, atol=1e-5)


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
  """The fused layer against the two calls with the bare grouped GEMM calls (layer_checks.grouped_matmul_gemms:
  jmo_grouped_matmul_swiglu as GEMM1, jmo_grouped_matmul for the backward's d_out W2^T; bit for bit: loss, y, dropped
  and the gradients w.r.t. x, gates, w1, w2), and within rounding of the default two calls (XLA's ragged_dot and
  SwiGLU as GEMM1) and the float32 reference, on each (kind, skip) routing; the fused program runs dispatch_gemm
  twice (forward with the SwiGLU epilogue, backward plain with transpose_rhs) and dispatch never. 80 tokens x 2
  choices per rank: two 128-row send blocks per source, and tiles across both."""
  R = mesh.shape["expert"]
  fused = layer_fn(mesh, cf, FUSED)
  inputs = [layer_case(R, kind, skip, dtype, tokens_per_rank) for kind, skip in cases]
  hlo = fused.lower(*inputs[0]).as_text()
  assert hlo.count("@jmo_dispatch_gemm(") == 2 and "@jmo_dispatch(" not in hlo, "the layer did not fuse"
  calls = [line for line in hlo.splitlines() if "@jmo_dispatch_gemm(" in line]
  assert sorted(re.search(r"swiglu = (\w+), .*transpose_rhs = (\w+)", c).groups() for c in calls) == \
      [("false", "true"), ("true", "false")], "GEMM1 with its SwiGLU in the forward, d_out W2^T in the backward"
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


# Each dtype once in the default pass, dropless and with drops; the other pairs in the slow pass.
@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow), jnp.bfloat16])
def test_layer_equals_two_calls_dropless(dtype):
  check_layer_equals_two_calls(mesh_of(4), [("balanced", False), ("skewed", False), ("skewed", True),
                                            ("all_to_one", False)], dtype, None)


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_equals_two_calls_with_capacity_drops(dtype):
  check_layer_equals_two_calls(mesh_of(4), [("skewed", False), ("skewed", True)], dtype, 0.5)


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
def test_layer_reads_no_padding_row_of_dispatch_gemm(monkeypatch):
  """No consumer reads the rows of dispatch_gemm's results past the rank's kept rows (the padding of the dropless
  recv buffer), which the call therefore leaves unwritten: with those rows NaN in every result of both calls of a
  training step (x_recv, h and a of the forward; d_out and dh of the backward), the loss, y and every gradient are
  bitwise those of the calls as they are. The consumers on CPU: expert_combine's handler (segment rows only), XLA's
  SwiGLU backward (row by row: the NaN stays in da's padding rows) and ragged_dot's outer products (rows outside
  every group selected away, not multiplied by zero). A control run that poisons one kept row too must differ, so
  the poison does reach the consumers."""
  mesh = mesh_of(4)
  x, gates, w1, w2, ids = layer_case(4, "skewed", False, jnp.bfloat16, tokens_per_rank=80)
  R, T, k = 4, x.shape[0] // 4, ids.shape[1]
  cap = plan_lib.recv_capacity(T, R, k, E // R, plan_lib.expert_capacity(T, R, k, E, None))
  kept = np.bincount(np.asarray(ids).reshape(-1) // (E // R), minlength=R)
  assert kept.max() < cap, (kept, cap)  # every rank has padding rows
  as_is, padded, control, poisoned_results = layer_checks.padding_poisoned_runs(
      monkeypatch, expert_block, "dispatch_gemm", lambda: layer_fn(mesh, None, FUSED)(x, gates, w1, w2, ids))
  # Traced last: the forward rule (x_recv, h, a) and the backward rule (d_out, dh).
  assert poisoned_results[-2:] == [3, 2], poisoned_results
  names = ("loss", "y", "dropped", "dx", "dgates", "dw1", "dw2")
  same = dict(zip(names, (a == b for a, b in zip(layer_checks.bits(padded), layer_checks.bits(as_is)))))
  assert all(same.values()), f"a consumer read a padding row: {same}"
  assert layer_checks.bits(control) != layer_checks.bits(as_is), "the poison did not reach the consumers"


def test_inference_forward_has_no_xla_swiglu():
  # The forward alone: one dispatch_gemm with the SwiGLU in its epilogue, keeping neither x_recv nor a ([0, D] and
  # [0, 2F] results), and no SwiGLU of XLA's after it (no silu, logistic or exponential anywhere in the program).
  mesh = mesh_of(4)
  x, gates, w1, w2, ids = layer_case(4, "skewed", False, jnp.float32)
  hlo = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh, config=FUSED)[0]).lower(x, ids, gates, w1, w2).as_text()
  calls = [line for line in hlo.splitlines() if "@jmo_dispatch_gemm(" in line]
  assert len(calls) == 1 and "@jmo_dispatch(" not in hlo, calls
  assert "swiglu = true" in calls[0] and "transpose_rhs = false" in calls[0], calls[0]
  results = re.search(r"-> \(!stablehlo.token, (.*)\)$", calls[0]).group(1)
  # (then the FP8 form's h_scales and a_scales, empty for float rows)
  assert re.fullmatch(rf"tensor<0x{D}xf32>, tensor<\d+x{F}xf32>, tensor<0x{2 * F}xf32>, tensor<0xf32>, tensor<0xf32>",
                      results), results
  for op in ("silu", "logistic", "exponential"):
    assert op not in hlo, f"XLA's {op} in the fused forward"


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
  fused, held = run(FUSED), run(CallConfig(timeout_ms=timeout_ms, first_call_timeout_ms=0,
                                           delay_rank=late, delay_us=2_000_000, dispatch_pushers=2))
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


# ---------------------------------------------------------------------------------------------------------------
# Where the library fuses by itself (CallConfig.dispatch_pushers = 0).

def test_dispatch_pushers_rule():
  def at(config=CallConfig(), ranks=2, **device):
    base = dict(compute_capability=(9, 0), sm_budget=132, consumer_policy="test", calibration=None)
    return dispatch_pushers(config, DeviceFacts(**{**base, **device}), ranks)

  # The one rule (call_options.h's DefaultPushers): 8 on an H200's 132 SMs, the same share of a smaller budget
  # (a rank holding part of a GPU, as the loopback harness's), rounded, at least one, and a GEMM CTA left.
  assert [_jmo.default_dispatch_pushers(b) for b in (132, 114, 66, 44, 33, 16, 8, 2)] == [8, 7, 4, 3, 2, 1, 1, 1]
  assert all(1 <= _jmo.default_dispatch_pushers(b) <= b - 1 for b in range(2, 1000))
  if _jmo.with_cuda:
    assert at() == 8                                    # Hopper, two ranks: fused, with the rule's pushers
    assert at(sm_budget=66) == 4 and at(sm_budget=33) == 2 and at(sm_budget=16) == 1
  else:
    assert at() == 0                                    # a build without CUDA has no wgmma engine to fuse on
  assert at(ranks=1) == 0                               # nothing to hide: two calls
  assert at(compute_capability=(8, 0)) == 0             # no wgmma engine
  assert at(compute_capability=None, sm_budget=None) == 0  # CPU: XLA's ragged_dot is faster there
  assert at(CallConfig(dispatch_pushers=3), ranks=1) == 3
  assert at(CallConfig(dispatch_pushers=3), compute_capability=None, sm_budget=None) == 3
  assert at(CallConfig(serialize=True)) == 0            # the baseline: no overlap anywhere
  # The call site takes the decision once, from its workspace's facts: a CPU workspace runs two calls by default.
  ws = Workspace.get(mesh_of(2), "expert", WorkspaceSizes(row_bytes=64, recv_rows=16, ret_rows=16, num_segments=4))
  assert RankInfo(ws, CallConfig()).dispatch_pushers == 0
  assert RankInfo(ws, CallConfig(dispatch_pushers=5)).dispatch_pushers == 5
  with pytest.raises(ValueError, match=r"serialize=True\) runs the dispatch and GEMM1 as two calls"):
    CallConfig(serialize=True, dispatch_pushers=2)


def test_default_layer_on_cpu_runs_two_calls():
  mesh = mesh_of(4)
  x, gates, w1, w2, ids = layer_case(4, "skewed", False, jnp.float32, tokens_per_rank=16)
  hlo = layer_fn(mesh, None).lower(x, gates, w1, w2, ids).as_text()
  assert "@jmo_dispatch_gemm(" not in hlo and hlo.count("@jmo_dispatch(") == 2, "CPU defaults to the two calls"


def test_layer_sends_once_where_pinned():
  # CallConfig(send_once=True): the forward's dispatch gets the plan's slot_primary [P], the backward's [0] (its rows,
  # gates * dy, differ per slot); the default (one row per slot, call_site.send_once) gives [0] to both, and the
  # layer's results are the same bit for bit (loss, y, dropped and every gradient).
  mesh = mesh_of(4)
  args = layer_case(4, "all_to_one", True, jnp.float32, tokens_per_rank=16)

  def dispatch_lines(config):
    hlo = layer_fn(mesh, None, config).lower(*args).as_text()
    return [line for line in hlo.splitlines() if "@jmo_dispatch(" in line]

  once, per_slot = dispatch_lines(CallConfig(send_once=True)), dispatch_lines(CallConfig())
  assert len(once) == len(per_slot) == 2
  assert sorted("tensor<0xi32>" in line for line in once) == [False, True], once
  assert all("tensor<0xi32>" in line for line in per_slot), per_slot
  got = layer_fn(mesh, None, CallConfig(send_once=True))(*args)
  want = layer_fn(mesh, None, CallConfig())(*args)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  ws = Workspace.get(mesh_of(1), "expert", WorkspaceSizes(row_bytes=64, recv_rows=16, ret_rows=16, num_segments=8))
  assert not RankInfo(ws, CallConfig()).send_once and RankInfo(ws, CallConfig(send_once=True)).send_once
  with pytest.raises(ValueError, match="send_once must be None"):
    CallConfig(send_once=1)


# ---------------------------------------------------------------------------------------------------------------
# The FP8 form: packed e4m3 rows dispatched and multiplied where they land, against dispatch + fp8.unpack_rows +
# the FP8 grouped GEMMs, bit for bit in the kept rows.

D8 = 256  # a multiple of 128 (the CUDA kernel's 512 is its own rule: the CPU handler takes whole 1 x 128 tiles)
ROW8 = D8 + D8 // 32


# The SwiGLU's training and inference forms in the default pass; the plain product (the FP8 layer's backward runs it
# in test_fp8_overlap's fused-dispatch cases) in the slow pass.
@pytest.mark.parametrize("kind,cf,skip,swiglu,keep,send_once", [
    pytest.param(*ROUTED[0], True, True, False, id="all_to_one-swiglu_train"),
    pytest.param(*ROUTED[1], True, False, True, id="skewed-swiglu_inference-send_once"),
    pytest.param(*ROUTED[1], False, True, False, id="skewed-plain", marks=pytest.mark.slow)])
def test_fp8_call_equals_dispatch_unpack_and_fp8_gemm(kind, cf, skip, swiglu, keep, send_once):
  check_fp8_call(mesh_of(4), 160, D8, 256, kind, cf, skip, swiglu, keep, send_once)


def check_fp8_call(mesh, tokens, d_model, N, kind, cf, skip, swiglu, keep, send_once, seed=23,
                   x_recv_from_tiles=True):
  """dispatch_gemm_fp8 (packed rows of d_model channels, w [E, N, d_model], `tokens` per rank routed by `kind` at
  capacity factor cf, every fifth token's second slot skipped with `skip`) against dispatch + fp8.unpack_rows +
  grouped_matmul_swiglu_fp8 (swiglu) or grouped_matmul_fp8: every result bit for bit in the kept rows, computed
  into the poison, nonzero, src_blocks left zero. On CPU the handlers; on a Hopper GPU the kernels (the same loop and
  promotion over the same rows: the same bits), x_recv stored by the GEMM tiles (values and scale tails) or with
  x_recv_from_tiles=False copied by the side units."""
  from jax_moe_overlap import fp8
  from jax_moe_overlap.grouped_gemm import grouped_matmul_fp8, grouped_matmul_swiglu_fp8
  R, k = mesh.shape["expert"], 2
  row = d_model + d_model // 32
  ids = routing(kind, tokens * R, E, k, seed=seed)
  if skip:
    ids[::5, 1] = plan_lib.SKIP
  cap_e = plan_lib.expert_capacity(tokens, R, k, E, cf)
  cap = plan_lib.recv_capacity(tokens, R, k, E // R, cap_e)
  sizes = WorkspaceSizes(row_bytes=row, recv_rows=cap, ret_rows=tokens * k, num_segments=E)
  info = RankInfo(Workspace.get(mesh, "expert", sizes),
                  dataclasses.replace(FUSED, x_recv_from_tiles=x_recv_from_tiles))
  _, plan_of, sharded = _call_setup(mesh, tokens, k, cap_e, cap, jnp.float32)
  kx, kw = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(kx, (tokens * R, d_model), jnp.float32)
  w = fp8.quantize_weight(jax.random.normal(kw, (E, d_model, N), jnp.float32) / np.sqrt(d_model))
  packed = fp8.pack_rows(*fp8.quantize_rows(x, pow2=True))
  slot_rows = jnp.arange(tokens * k, dtype=jnp.int32) // k
  keep_a = keep and swiglu

  def flat(x_recv, out, a):
    parts = [x_recv] if keep else []
    parts += list(out) if swiglu else [out]
    return tuple(parts + (list(a) if keep_a else []))

  def fused(ids, rows, values, scales):
    got = workspace_calls.dispatch_gemm_fp8(rows, slot_rows, fp8.Fp8Weight(values, scales), plan_of(ids), cap, info,
                                            swiglu=swiglu, keep_recv=keep, keep_a=keep_a, send_once=send_once)
    assert [v is not None for v in got] == [keep, True, keep_a]
    return flat(*got)

  def two_calls(ids, rows, values, scales):
    plan = plan_of(ids)
    x_recv = dispatch(rows, slot_rows, plan, cap, info)
    xq, xs = fp8.unpack_rows(x_recv)
    if swiglu:
      h, a = grouped_matmul_swiglu_fp8(xq, xs, values, scales, plan.expert_rows)
      return flat(x_recv, h, a)
    return flat(x_recv, grouped_matmul_fp8(xq, xs, values, scales, plan.expert_rows), None)

  n = len(flat(0, (0, 0) if swiglu else 0, (0, 0)))
  fused_fn = layer_checks.Poisoned(sharded(fused, 4, n), mesh)
  args = (jnp.asarray(ids), packed, w.values, w.scales)
  got, want = fused_fn(*args), jax.jit(sharded(two_calls, 4, n))(*args)
  assert fused_fn.aliased == fused_fn.buffers == n * R, f"{fused_fn.aliased} of {fused_fn.buffers} into the poison"
  kept = np.asarray(jax.jit(sharded(lambda ids: (plan_of(ids).recv_rows.reshape(1),), 1, 1))(jnp.asarray(ids))[0])
  assert kept.sum() > 0
  same = []
  for i, (a, b) in enumerate(zip(got, want)):
    assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype, a.shape, b.shape)
    a, b = np.asarray(a).reshape(R, cap, -1), np.asarray(b).reshape(R, cap, -1)
    same.append(all(a[r, :kept[r]].tobytes() == b[r, :kept[r]].tobytes() for r in range(R)))
    assert all(kept[r] == 0 or np.abs(a[r, :kept[r]].astype(np.float32)).max() > 0 for r in range(R)), i
  print(f"R={R} swiglu={swiglu} keep={keep} send_once={send_once} x_recv_from_tiles={x_recv_from_tiles}: results "
        f"bitwise the two calls' {same}")
  assert all(same), same
  assert src_blocks_nonzero(mesh) == 0, "a call must leave its src_blocks zero"


def test_fp8_call_refuses_what_it_cannot_take():
  """The FP8 form's rules, by the handler (past the wrapper) and the wrapper, each error naming the rule; then a
  well-formed call runs (no refused call left an epoch open)."""
  from jax_moe_overlap import fp8
  mesh, R, tokens, k, N = mesh_of(4), 4, 8, 2, 256
  ids = routing("balanced", tokens * R, E, k, seed=2)
  cap_e = plan_lib.expert_capacity(tokens, R, k, E, None)
  cap = plan_lib.recv_capacity(tokens, R, k, E // R, cap_e)
  sizes = WorkspaceSizes(row_bytes=ROW8, recv_rows=cap, ret_rows=tokens * k, num_segments=E)
  info = RankInfo(Workspace.get(mesh, "expert", sizes), FUSED)
  _, plan_of, sharded = _call_setup(mesh, tokens, k, cap_e, cap, jnp.float32)
  slot_rows = jnp.arange(tokens * k, dtype=jnp.int32) // k
  rows = jnp.ones((tokens * R, ROW8), jnp.uint8)
  w = fp8.quantize_weight(jnp.ones((E, D8, N), jnp.float32))
  t = lambda dtype, *s: jax.ShapeDtypeStruct(s, dtype)
  u8, f32, e4m3 = jnp.uint8, jnp.float32, fp8.E4M3

  def raw(out_types, scale_types, transpose_rhs=True, swiglu=True, scales=None):
    def f(ids, x, values, w_scales):
      return workspace_calls._dispatch_gemm_call(  # pylint: disable=protected-access
          x, slot_rows, values, plan_of(ids), info, out_types, transpose_rhs, swiglu, False, w_scales, scale_types)
    return jax.block_until_ready(jax.jit(sharded(f, 4, 5))(jnp.asarray(ids), rows, w.values,
                                                            w.scales if scales is None else scales))

  good = ((t(u8, cap, ROW8), t(e4m3, cap, N // 2), t(e4m3, cap, N)), (t(f32, cap, 1), t(f32, cap, 2)))
  with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(
      "dispatch_gemm (e4m3 w): e4m3 w must be [E_local, N, D] (K-major: transpose_rhs)")):
    raw(*good, transpose_rhs=False)
  with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(
      "dispatch_gemm (e4m3 w): w_scales must be [E_local, N/128, D/128] = [2, 2, 2], got [2, 2, 1]")):
    raw(*good, scales=w.scales[:, :, :1])
  with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(
      "with swiglu, out = h_q float8_e4m3fn [cap, F], a = a_q float8_e4m3fn [cap or 0, 2F], h_scales f32 [cap, F/128], "
      "a_scales f32 [a's rows, 2F/128] (F = N/2 = 128); got out")):
    raw((good[0][0], t(jnp.bfloat16, cap, N // 2), good[0][2]), good[1])
  with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(
      f"src and x_recv rows must be D + D/32 = {ROW8} bytes")):
    raw((t(u8, cap, D8), *good[0][1:]), good[1])
  with pytest.raises(TypeError, match=r"dispatch_gemm_fp8: src must be \[S, D \+ D/32\] uint8"):
    workspace_calls.dispatch_gemm_fp8(rows.astype(jnp.float32), slot_rows, w, object(), cap, info)
  with pytest.raises(ValueError, match=r"dispatch_gemm_fp8: src \(32, 260\) and w"):
    workspace_calls.dispatch_gemm_fp8(rows[:, :260], slot_rows, w, object(), cap, info)
  with pytest.raises(ValueError, match="keep_a needs swiglu=True"):
    workspace_calls.dispatch_gemm_fp8(rows, slot_rows, w, object(), cap, info, keep_a=True)
  with pytest.raises(TypeError, match=r"dispatch_gemm_fp8: w must be an fp8.Fp8Weight .*got ArrayImpl"):
    workspace_calls.dispatch_gemm_fp8(rows, slot_rows, w.values, object(), cap, info)
  x_recv, h, a, h_s, a_s = raw(*good)
  assert x_recv.shape == (R * cap, ROW8) and h.dtype == e4m3 and h_s.shape == (R * cap, 1)
