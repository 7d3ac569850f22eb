"""The functional API: one expert-parallel MoE expert layer on global arrays.

``moe_experts(x, expert_ids, gates, w1, w2, mesh=..., axis_name=...)`` runs the layer with tokens and experts
sharded over ``axis_name``: ``impl="overlap"`` through this library's custom calls inside ``shard_map``,
``impl="reference"`` as plain dense JAX (the oracle), ``impl="xla"`` as the expert-parallel path from XLA collectives
and ``lax.ragged_dot`` (``xla_path.py``). All return ``(y, dropped)`` with y sharded as x.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap.checks import check_expert_ids, check_impl, check_inputs
from jax_moe_overlap.primitives import CallConfig, RankInfo, expert_block
from jax_moe_overlap.reference import moe_experts_reference
from jax_moe_overlap.workspace import Workspace, WorkspaceSizes
from jax_moe_overlap.xla_path import moe_experts_xla


def moe_experts(x, expert_ids, gates, w1, w2, *, mesh: jax.sharding.Mesh, axis_name: str = "expert",
                capacity_factor: float | None = None, impl: str = "overlap", config: CallConfig = CallConfig()):
  """Expert-parallel MoE expert layer (after the router).

  Args:
    x: [T, D] tokens (T divisible by the axis size), float32 or bfloat16.
    expert_ids: [T, k] int32 expert choices in [0, E), or -1 for "no selection" (the slot contributes zero, moves
      nothing and is not counted as dropped). gates: [T, k] float weights of the choices.
    w1: [E, D, 2F] (gate and up projections, SwiGLU); w2: [E, F, D]; same dtype as x.
    mesh, axis_name: tokens and experts are sharded over this axis (E divisible by its size).
    capacity_factor: None for dropless; else rows per expert = ceil(cf * T * k / E), overflow dropped.
    impl: "overlap" (custom calls), "reference" (dense pure JAX) or "xla" (expert-parallel pure JAX).
  Returns:
    y [T, D] in x's dtype, dropped: int32 number of (token, choice) slots dropped by the capacity rule.
  """
  check_inputs(x, expert_ids, gates, w1, w2, mesh, axis_name)
  check_impl(impl)
  E = w1.shape[0]
  check_expert_ids(expert_ids, E)
  R = mesh.shape[axis_name]
  T_local = x.shape[0] // R
  k = expert_ids.shape[1]
  cap_e = plan_lib.expert_capacity(T_local, R, k, E, capacity_factor)
  expert_ids = expert_ids.astype(jnp.int32)
  if impl == "reference":
    return _moe_reference(x, expert_ids, gates, w1, w2, mesh, cap_e, R)
  E_l = E // R
  cap = plan_lib.recv_capacity(T_local, R, k, E_l, cap_e)
  if impl == "xla":
    return _moe_xla(x, expert_ids, gates, w1, w2, mesh, axis_name, cap_e, cap)
  # Every row that crosses ranks is d_model wide (tokens, their gradients, expert outputs): the lhs of a GEMM
  # (F or 2F wide) never leaves its rank, so the workspace holds D-wide rows of x's dtype.
  sizes = WorkspaceSizes(row_bytes=x.shape[1] * x.dtype.itemsize, recv_rows=cap, ret_rows=T_local * k,
                         num_segments=E_l * R)
  info = RankInfo(Workspace.get(mesh, axis_name, sizes), config)
  spec = P(axis_name)
  fn = functools.partial(_moe_local, axis_name=axis_name, num_experts=E, cap_e=cap_e, cap=cap, info=info)
  args = [_shard(a, mesh, spec) for a in (x, expert_ids, gates.astype(jnp.float32), w1, w2)]
  y, dropped = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec, P()), check_vma=False)(*args)
  return _like(y, x, mesh), dropped


def _moe_xla(x, expert_ids, gates, w1, w2, mesh, axis_name, cap_e, cap):
  spec = P(axis_name)
  args = [_shard(a, mesh, spec) for a in (x, expert_ids, gates.astype(jnp.float32), w1, w2)]
  y, dropped = moe_experts_xla(*args, mesh=mesh, axis_name=axis_name, expert_cap=cap_e, recv_cap=cap)
  return _like(y, x, mesh), dropped


def _moe_reference(x, expert_ids, gates, w1, w2, mesh, cap_e, R):
  """The dense oracle on whole (replicated) arrays, every device computing all of it: its capacity rule scans all
  tokens in order. Inside ``shard_map`` so that it runs on the mesh's devices whatever x's placement (under ``jit``
  a plain x and mesh-sharded weights could not meet otherwise)."""
  args = [_shard(a, mesh, P()) for a in (x, expert_ids, gates, w1, w2)]
  fn = functools.partial(moe_experts_reference, expert_cap=cap_e, ranks=R)
  y, dropped = jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * 5, out_specs=(P(), P()))(*args)
  return _like(y, x, mesh), dropped


def _like(y, x, mesh):
  """y with exactly x's sharding, so that ``x + y`` works and callers can reshape y as they could x: a committed
  concrete x's own sharding (eager calls); else, on a mesh with Explicit axes, x's sharding type (an uncommitted x
  states no placement: y stays on the mesh, laid out as x's type says)."""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.committed:
    return jax.device_put(y, x.sharding)
  if _explicit(mesh):
    return jax.sharding.reshard(y, jax.sharding.NamedSharding(mesh, jax.typeof(x).sharding.spec))
  return y


def _explicit(mesh) -> bool:
  return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _shard(a, mesh, spec):
  """Places `a` on `spec` over an Explicit mesh, and a concrete array that lives on other devices than the mesh's
  (shard_map reshards by itself over Auto axes, but not across device sets)."""
  if _explicit(mesh):
    return jax.sharding.reshard(a, jax.sharding.NamedSharding(mesh, spec))
  if (isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and
      a.sharding.device_set != set(mesh.devices.flat)):
    return jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))
  return a


def _moe_local(x, expert_ids, gates, w1, w2, *, axis_name, num_experts, cap_e, cap, info):
  R = jax.lax.axis_size(axis_name)
  rank = jax.lax.axis_index(axis_name).astype(jnp.int32)
  counts = plan_lib.local_counts(expert_ids, num_experts).reshape(R, num_experts // R)
  counts_all = jax.lax.all_gather(counts, axis_name)                        # [R_src, R_dst, E_local]
  plan = plan_lib.make_plan(expert_ids, counts_all, rank, cap_e)
  y = expert_block(x, gates, w1, w2, plan, cap, info)
  return y, jax.lax.psum(plan.dropped, axis_name)
