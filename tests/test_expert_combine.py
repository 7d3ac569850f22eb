"""expert_combine on its own: transpose_rhs (w given as [E_local, N, K] and read transposed in place, as the backward
pass uses it for dx = da @ W1^T) against the plain call on the transposed weights, the FP8 producer
(expert_combine_fp8) against float64 numpy, and the shape errors."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_moe_overlap import _ffi
from jax_moe_overlap import fp8
from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap.call_site import RankInfo
from jax_moe_overlap.config import CallConfig
from jax_moe_overlap.ordering import workspace_call
from jax_moe_overlap.workspace import Workspace, WorkspaceSizes, release_workspaces
from jax_moe_overlap.workspace_calls import expert_combine, expert_combine_fp8
from cases import mesh_of, rel_err, routing

E, TOP_K = 8, 2


@dataclasses.dataclass(frozen=True)
class Case:
  """One call's routing and sizes on a 1-D mesh with axis "expert" (R ranks, `tokens` per rank)."""

  mesh: jax.sharding.Mesh
  tokens: int
  ids: jax.Array       # [tokens * R, top_k]
  cap_e: int
  cap: int
  info: RankInfo
  experts: int = E

  @property
  def top_k(self) -> int:
    return self.ids.shape[1]

  @property
  def R(self) -> int:
    return self.mesh.shape["expert"]


def make_case(mesh, N, dtype, tokens=16, seed=0, experts=E, top_k=TOP_K) -> Case:
  """Routing, capacities and the RankInfo of a call on `mesh` whose output rows are N wide."""
  R = mesh.shape["expert"]
  ids = jnp.asarray(routing("skewed", tokens * R, experts, top_k, seed))
  cap_e = plan_lib.expert_capacity(tokens, R, top_k, experts, None)
  cap = plan_lib.recv_capacity(tokens, R, top_k, experts // R, cap_e)
  sizes = WorkspaceSizes(row_bytes=N * jnp.dtype(dtype).itemsize, recv_rows=cap, ret_rows=tokens * top_k,
                         num_segments=experts)
  return Case(mesh, tokens, ids, cap_e, cap, RankInfo(Workspace.get(mesh, "expert", sizes), CallConfig()), experts)


def combine_fn(c: Case, transpose_rhs: bool):
  """jit(shard_map) of plan + one expert_combine with slots: (ids, gates, lhs, w) -> (y, slot_out). One call per
  program: two independent calls in one XLA:CPU program may run in different orders on different devices."""
  R = c.R

  def local(ids, gates, lhs, w):
    rank = jax.lax.axis_index("expert").astype(jnp.int32)
    counts_all = jax.lax.all_gather(plan_lib.local_counts(ids, c.experts).reshape(R, c.experts // R), "expert")
    plan = plan_lib.make_plan(ids, counts_all, rank, c.cap_e)
    return expert_combine(lhs, w, gates, plan, c.info, want_slots=True, transpose_rhs=transpose_rhs)

  spec = P("expert")
  return jax.jit(jax.shard_map(local, mesh=c.mesh, in_specs=(spec,) * 4, out_specs=(spec, spec), check_vma=False))


def operands(c: Case, K, N, dtype, seed):
  """lhs [R * cap, K], w [experts, K, N] (scaled by 1/sqrt(K)), gates [R * tokens, top_k]."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  lhs = jax.random.normal(ks[0], (c.R * c.cap, K), jnp.float32).astype(dtype)
  w = (jax.random.normal(ks[1], (c.experts, K, N), jnp.float32) / np.sqrt(K)).astype(dtype)
  gates = jax.nn.softmax(jax.random.normal(ks[2], (c.tokens * c.R, c.top_k)), axis=-1)
  return lhs, w, gates


def reference(c: Case, gates, lhs, w):
  """y [R * tokens, N] and slot_out [R * tokens * top_k, N] in float64 numpy from the plan: slot p of source rank s
  is the recv row of its destination rank times its expert's w [K, N]."""
  R, T, k, E_l = c.R, c.tokens, c.top_k, c.experts // c.R
  lhs_r = np.asarray(lhs, np.float64).reshape(R, -1, lhs.shape[1])
  w_g = np.asarray(w, np.float64)
  ids = np.asarray(c.ids).reshape(R, T, k)
  counts_all = np.stack([np.asarray(plan_lib.local_counts(jnp.asarray(ids[s]), c.experts)).reshape(R, E_l)
                         for s in range(R)])
  ys, slots = [], []
  for s in range(R):
    plan = plan_lib.make_plan(jnp.asarray(ids[s]), jnp.asarray(counts_all), jnp.int32(s), c.cap_e)
    dest_rank, dest_row = np.asarray(plan.slot_dest_rank), np.asarray(plan.slot_dest_row)
    slot_out = np.zeros((T * k, w.shape[2]))
    for p, g in enumerate(ids[s].reshape(-1)):
      if dest_row[p] >= 0:
        slot_out[p] = lhs_r[dest_rank[p], dest_row[p]] @ w_g[g]
    ys.append(np.einsum("tj,tjn->tn", np.asarray(gates, np.float64)[s * T:(s + 1) * T],
                        slot_out.reshape(T, k, -1)))
    slots.append(slot_out)
  return np.concatenate(ys), np.concatenate(slots)


@pytest.mark.slow  # the default pass stays within 5 minutes on 2 cores; CI's slow pass runs it
@pytest.mark.parametrize("R", [1, 2, 4])
def test_more_than_32_choices_per_token_against_reference(R):
  """top_k = 40 of 64 experts: the combine takes a token's choices 32 at a time on the GPU (combine_gather.cuh);
  y and every slot's row against float64 numpy."""
  K, N = 16, 24
  c = make_case(mesh_of(R), N, jnp.float32, tokens=8, seed=40 + R, experts=64, top_k=40)
  lhs, w, gates = operands(c, K, N, jnp.float32, seed=R)
  y, slot_out = combine_fn(c, False)(c.ids, gates, lhs, w)
  y_ref, slot_ref = reference(c, gates, lhs, w)
  assert y.shape == (c.tokens * R, N) and slot_out.shape == (c.tokens * R * 40, N)
  assert rel_err(y, y_ref) < 1e-5 and rel_err(slot_out, slot_ref) < 1e-5


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow), jnp.bfloat16])
@pytest.mark.parametrize("R", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 4])
def test_transpose_rhs_equals_plain_call_on_transposed_weights(R, dtype):
  K, N = 24, 40  # K != N: a swapped reading would not even have the right shape
  c = make_case(mesh_of(R), N, dtype, seed=R)
  lhs, w, gates = operands(c, K, N, dtype, seed=10 + R)
  w_t = jnp.swapaxes(w, 1, 2)  # [E, N, K]: the layout transpose_rhs reads
  y, slot_out = combine_fn(c, False)(c.ids, gates, lhs, w)
  y_t, slot_out_t = combine_fn(c, True)(c.ids, gates, lhs, w_t)
  assert y_t.shape == y.shape == (c.tokens * R, N) and y_t.dtype == y.dtype == dtype
  assert slot_out_t.shape == slot_out.shape == (c.tokens * R * c.top_k, N)
  # The CPU producer sums in the same order for both layouts: bit for bit.
  np.testing.assert_array_equal(np.asarray(y_t).view(np.uint8), np.asarray(y).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(slot_out_t).view(np.uint8), np.asarray(slot_out).view(np.uint8))
  # And both are the product (float32 accumulation; bf16 outputs rounded once).
  y_ref, slot_ref = reference(c, gates, lhs, w)
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  assert float(np.max(np.abs(y_ref))) > 0.1
  assert rel_err(y_t, y_ref) < tol and rel_err(slot_out_t, slot_ref) < tol


def combine_fp8_fn(c: Case, out_dtype):
  """combine_fn's program with the FP8 producer (expert_combine_fp8): (ids, gates, lhs_q, lhs_s, w_values, w_scales)
  -> (y, slot_out) in out_dtype."""
  R = c.R

  def local(ids, gates, lhs_q, lhs_s, w_values, w_scales):
    rank = jax.lax.axis_index("expert").astype(jnp.int32)
    counts_all = jax.lax.all_gather(plan_lib.local_counts(ids, c.experts).reshape(R, c.experts // R), "expert")
    plan = plan_lib.make_plan(ids, counts_all, rank, c.cap_e)
    return expert_combine_fp8(lhs_q, lhs_s, fp8.Fp8Weight(w_values, w_scales), gates, plan, c.info, True, out_dtype)

  spec = P("expert")
  return jax.jit(jax.shard_map(local, mesh=c.mesh, in_specs=(spec,) * 6, out_specs=(spec, spec), check_vma=False))


def check_fp8_producer(mesh, out_dtype, K, N, tokens, seed, tol=None):
  """expert_combine_fp8 on e4m3 operands quantized from random ones (lhs 1 x 128, w 128 x 128 blocks): y and every
  slot's row against float64 numpy of the dequantized operands (tolerance `tol`, else the CPU emulation's: float32
  output 1e-5, bfloat16 1e-2), bitwise-identical repeats. Returns the relative errors (for the GPU test's print)."""
  c = make_case(mesh, N, out_dtype, tokens=tokens, seed=seed)
  lhs, w, gates = operands(c, K, N, jnp.float32, seed=seed + 1)
  lhs_q, lhs_s = fp8.quantize_rows(lhs)
  weight = fp8.quantize_weight(w)
  fn = combine_fp8_fn(c, out_dtype)
  y, slot_out = fn(c.ids, gates, lhs_q, lhs_s, weight.values, weight.scales)
  assert y.dtype == slot_out.dtype == out_dtype
  y_ref, slot_ref = reference(c, gates, fp8.dequantize_rows(lhs_q, lhs_s), weight.dequantize())
  tol = tol or (1e-5 if out_dtype == jnp.float32 else 1e-2)
  errs = {"y": rel_err(y, y_ref), "slot_out": rel_err(slot_out, slot_ref)}
  assert float(np.max(np.abs(y_ref))) > 0.1 and all(v < tol for v in errs.values()), errs
  again, _ = fn(c.ids, gates, lhs_q, lhs_s, weight.values, weight.scales)
  np.testing.assert_array_equal(np.asarray(again).view(np.uint8), np.asarray(y).view(np.uint8))
  return errs


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_producer_against_reference(out_dtype):
  """The FP8 producer (expert_combine_fp8) at R = 4 over skewed routing: y and the slots' rows are the product of the
  dequantized operands."""
  check_fp8_producer(mesh_of(4), out_dtype, K=256, N=128, tokens=16, seed=3)


def test_transpose_rhs_python_shape_error():
  c = make_case(mesh_of(2), 40, jnp.float32)
  lhs, w, gates = operands(c, 24, 40, jnp.float32, seed=0)
  # w [E, K, N] passed as if it were [E, N, K]: its last dimension (N = 40) is not lhs's K = 24.
  with pytest.raises(ValueError, match=r"expert_combine: lhs \(\d+, 24\) and w \(4, 24, 40\) \(transpose_rhs\) do "
                                       r"not fit lhs \[cap, K\], w \[E_local, N, K\]"):
    combine_fn(c, True)(c.ids, gates, lhs, w)
  with pytest.raises(ValueError, match=r"w \[E_local, K, N\]"):
    combine_fn(c, False)(c.ids, gates, lhs, jnp.swapaxes(w, 1, 2))


def _raw_call(lhs, w, n_out, transpose_rhs, info, attrs=None, seg_ranks=1, scales=None, out_dtype=None):
  """The custom call with no Python-side checks: (y [T, n_out], slot_out [0, n_out]) on device 0 (one rank), with the
  attributes of `info` updated by `attrs` (None: the attribute left out), seg_rows [E_local, seg_ranks], the
  operands lhs_scales and w_scales `scales` (None: both empty) and the outputs in out_dtype (None: lhs's)."""
  _ffi.register()
  attrs = {k: v for k, v in dict(info.attrs(), **(attrs or {})).items() if v is not None}
  T, k = 4, 2
  out_dtype = lhs.dtype if out_dtype is None else out_dtype
  out_types = (jax.ShapeDtypeStruct((T, n_out), out_dtype), jax.ShapeDtypeStruct((0, n_out), out_dtype))
  E_l = w.shape[0]
  zeros = lambda *s: jnp.zeros(s, jnp.int32)
  # The CPU handler takes the workspace ordering token first (ordering.py), so the raw call goes through
  # workspace_call rather than a bare ffi_call.
  none = jnp.zeros((0,), jnp.float32)
  lhs_scales, w_scales = (none, none) if scales is None else scales
  return workspace_call(_ffi.EXPERT_COMBINE, out_types, lhs, w, lhs_scales, w_scales, jnp.ones((T, k), jnp.float32),
                        zeros(E_l, seg_ranks),
                        zeros(E_l, seg_ranks), jnp.full((T * k,), -1, jnp.int32), zeros(), zeros(), zeros(),
                        transpose_rhs=np.bool_(transpose_rhs), **attrs)


def test_handler_names_the_shape_problem():
  mesh = mesh_of(1)
  sizes = WorkspaceSizes(row_bytes=64 * 4, recv_rows=16, ret_rows=8, num_segments=2)
  info = RankInfo(Workspace.get(mesh, "expert", sizes), CallConfig())
  lhs = jnp.ones((16, 24), jnp.float32)
  w_t = jnp.ones((2, 40, 24), jnp.float32)  # [E_local, N, K]
  run = lambda *a: jax.block_until_ready(jax.jit(functools.partial(_raw_call, info=info), static_argnums=(2, 3))(*a))
  y, _ = run(lhs, w_t, 40, True)  # fits: no routed rows, so y is zero
  np.testing.assert_array_equal(y, np.zeros((4, 40), np.float32))
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r"expert_combine: w \[E_local, K, N\] does not fit lhs \[cap, K\]: lhs \[16, 24\], "
                           r"w \[2, 40, 24\] \(K 24 vs 40\)"):
    run(lhs, w_t, 24, False)
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r"expert_combine: w \[E_local, N, K\] \(transpose_rhs\) does not fit lhs \[cap, K\]: "
                           r"lhs \[16, 24\], w \[2, 24, 40\] \(K 24 vs 40\)"):
    run(lhs, jnp.ones((2, 24, 40), jnp.float32), 40, True)
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r"inconsistent shapes: y \[4, 24\] must be \[T, N\] = \[4, 40\]"):
    run(lhs, w_t, 24, True)
  # The failed calls opened no epoch: the next good call runs.
  y, _ = run(lhs, w_t, 40, True)
  np.testing.assert_array_equal(y, np.zeros((4, 40), np.float32))


def test_options_and_capacity_are_checked_once_for_every_call():
  """The call's attributes are read by name into one struct (every one, nothing else) and its options checked before
  the call opens an epoch; a call larger than the workspace fails its epoch and the next call recovers."""
  release_workspaces()  # its own workspace: a larger one cached by an earlier test would fit the call below
  mesh = mesh_of(1)
  sizes = WorkspaceSizes(row_bytes=64 * 4, recv_rows=16, ret_rows=8, num_segments=2)
  info = RankInfo(Workspace.get(mesh, "expert", sizes), CallConfig(timeout_ms=5000))
  lhs, w = jnp.ones((16, 24), jnp.float32), jnp.ones((2, 24, 40), jnp.float32)

  def run(attrs=None, n_out=40, lhs=lhs, w=w):
    f = functools.partial(_raw_call, info=info, attrs=attrs)
    return jax.block_until_ready(jax.jit(f, static_argnums=(2, 3))(lhs, w, n_out, False))

  with pytest.raises(jax.errors.JaxRuntimeError, match=r"the call's attributes lack \(or mistype\) pushers"):
    run(dict(pushers=None))
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"the call's attributes lack \(or mistype\) consumer_ctas"):
    run(dict(consumer_ctas=np.int64(0)))
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r"the call's attributes hold pushers_typo, which it does not take"):
    run(dict(pushers_typo=np.int32(1)))
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r"expert_combine: pushers must be 0 \(the library's choice\) or a positive count of "
                           r"dispatch_gemm's pushing CTAs \(no effect on CPU\), got -1"):
    run(dict(pushers=np.int32(-1)))
  # 80 float32 columns: 320 B rows in a workspace of 256 B rows.
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r"expert_combine: the call needs rows of 320 B x 16 recv rows and 8 ret rows \(slots\) but "
                           r"the workspace holds rows of 256 B x 16 recv rows and 8 ret rows"):
    run(n_out=80, w=jnp.ones((2, 24, 80), jnp.float32))
  # seg_rows against the workspace's ranks: after the epoch opened too (the group aborts and recovers).
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r"expert_combine: seg_rows must be \[E_local, R\] with R = workspace ranks"):
    jax.block_until_ready(jax.jit(functools.partial(_raw_call, info=info, seg_ranks=2), static_argnums=(2, 3))(
        lhs, w, 40, False))
  y, _ = run()
  np.testing.assert_array_equal(y, np.zeros((4, 40), np.float32))
