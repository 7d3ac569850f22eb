"""The functional API: one expert-parallel MoE expert layer on global arrays.

``moe_experts(x, expert_ids, gates, w1, w2, mesh=..., axis_name=...)`` runs the layer with tokens and experts
sharded over ``axis_name`` (with ``tensor_axis``, each expert's hidden width split over that axis too):
``impl="overlap"`` through this library's custom calls inside ``shard_map``,
``impl="collective"`` as XLA collectives for the exchange and this library's grouped GEMMs for the experts,
``impl="xla"`` as XLA collectives and ``lax.ragged_dot`` (both ``xla_path.py``), ``impl="reference"`` as plain dense
JAX (the oracle). All return ``(y, dropped)`` with y sharded as x. An ``"overlap"`` call over an expert axis that
spans hosts, where no workspace can serve it, runs as ``"collective"`` (``chosen_impl``).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_moe_overlap import fp8
from jax_moe_overlap import hosts
from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap import tensor_parallel as tp_lib
from jax_moe_overlap.call_site import RankInfo, tensor_reduce
from jax_moe_overlap.checks import (batch_size, check_batch_axes, check_call_config, check_capacity_factor,
                                    check_expert_ids, check_fp8_impl, check_fp8_tensor_split, check_impl,
                                    check_inputs, check_outside_shard_map, check_tensor_axis, check_tensor_split)
from jax_moe_overlap.config import CallConfig
from jax_moe_overlap.expert_block import expert_block
from jax_moe_overlap.fp8_overlap import fp8_expert_block, workspace_route
from jax_moe_overlap.gather_rs_block import gather_rs_block
from jax_moe_overlap.reference import moe_experts_fp8_reference, moe_experts_reference
from jax_moe_overlap.workspace import Workspace, layer_sizes
from jax_moe_overlap.workspace_backend import rank_devices
from jax_moe_overlap.workspace_calls import gather_counts
from jax_moe_overlap.xla_path import fp8_one_rank_block, moe_experts_xla

log = logging.getLogger("jax_moe_overlap")


def moe_experts(x, expert_ids, gates, w1, w2, *, mesh: jax.sharding.Mesh, axis_name: str = "expert",
                capacity_factor: float | None = None, impl: str = "overlap", config: CallConfig = CallConfig(),
                batch_axes: tuple[str, ...] = (), tensor_axis: str | None = None, quantization: str | None = None):
  """Expert-parallel MoE expert layer (after the router).

  Args:
    x: [T, D] tokens (T divisible by the number of token shards), float32 or bfloat16.
    expert_ids: [T, k] int32 expert choices in [0, E), or -1 for "no selection" (the slot contributes zero, moves
      nothing and is not counted as dropped). A token's choices are meant to be distinct experts: every capacity,
      dropless included, is at most the group's tokens per expert (each token once), so an expert named in several
      slots of many tokens can overflow, and the slots past the bound are dropped (and counted). gates: [T, k] float
      weights of the choices.
    w1: [E, D, 2F] (gate and up projections, SwiGLU) or its view [E, D, 2, F] ([..., 0, :] the gate, [..., 1, :]
      the up projection: the layout that splits over ``tensor_axis``); w2: [E, F, D]; same dtype as x (with
      quantization="fp8": float32 or bfloat16 master weights whatever x's dtype, or pre-quantized ``fp8.Fp8Weight``s
      from ``quantize_weights``).
    mesh, axis_name: tokens and experts are sharded over this axis (E divisible by its size).
    capacity_factor: None for dropless; else rows per expert = ceil(cf * T_group * k / E), overflow dropped, where
      T_group = T / (product of the batch axes' sizes) are the tokens of one expert-parallel group (its expert and
      tensor axes' devices).
    impl: "overlap" (custom calls; over an expert axis that spans hosts it runs as "collective"), "collective" (XLA
      collectives for the exchange, this library's grouped GEMMs for the experts: any expert axis, hosts included),
      "xla" (expert-parallel pure JAX: XLA collectives and ragged_dot) or "reference" (dense pure JAX, the oracle).
    batch_axes: other mesh axes the tokens are also sharded over (data, FSDP): tokens are laid out as
      ``P((*batch_axes, axis_name))``, each device holds T / (B * R) of them, and every position on the batch axes
      is an independent expert-parallel group over the same experts (weights replicated over the batch axes, their
      gradients summed). Empty (the default): tokens are sharded over ``axis_name`` only, and replicated over the
      other mesh axes.
    tensor_axis: expert tensor parallelism: another mesh axis (not a batch axis) each expert's hidden width F is
      split over (F divisible by its size TP): device t of it holds columns t F / TP ... (t + 1) F / TP - 1 of the
      gate and of the up projection (w1's view [E, D, 2, F] sharded ``P(axis_name, None, None, tensor_axis)``) and
      those rows of w2 (``P(axis_name, tensor_axis, None)``). Tokens are sharded over ``(*batch_axes, axis_name,
      tensor_axis)``: every device holds distinct tokens, and the expert and tensor axes' devices form one
      expert-parallel group. Each member of an expert's tensor group computes its shard for every row the expert
      takes; a token's output sums the shards' partial outputs in tensor order (every impl: the same capacity rule,
      the same results). None (the default): no tensor parallelism.
    quantization: None, or "fp8": the experts' GEMMs follow DeepSeek-V3's FP8 recipe (``fp8_experts.py``), forward
      and backward; D and F multiples of 128 (with a tensor axis F / TP too: each shard's 128 x 128 weight blocks
      and 1 x 128 tiles are the whole expert's); impl "overlap" (x dispatched in FP8 by the workspace's dispatch,
      the FP8 grouped GEMMs, the combine in x's dtype; GEMM2 overlapped with the way back by expert_combine on e4m3
      operands where ``call_site.fp8_fused_combine``: ``fp8_overlap.py``) and "collective" (the FP8 grouped GEMM:
      Hopper GPUs, its emulation on CPU; the two give the same bits, but with a tensor axis, where "overlap" returns
      the shards' partials per slot in x's dtype), "xla" or "reference" (the recipe emulated in XLA).
      "fp8_bf16_wgrad": the same with the two weight gradients on bfloat16 operands (``fp8_experts.bf16_wgrad``).
      The weights' gradients are those of the quantized weights (straight-through), in the weights' dtype;
      pre-quantized weights get none.
  Returns:
    y [T, D] in x's dtype and sharding, dropped: int32 number of (token, choice) slots dropped by the capacity rule.

  Outside ``jit`` each call runs one compiled program, cached per static configuration (mesh, axes, capacities,
  config, workspace) by ``eager_program`` and per shapes, dtypes and shardings by ``jax.jit``.
  """
  check_outside_shard_map("moe_experts")
  check_inputs(x, expert_ids, gates, w1, w2, mesh, axis_name, quantization)
  check_impl(impl)
  check_capacity_factor(capacity_factor)
  check_call_config(config)
  TP = check_tensor_axis(mesh, axis_name, tensor_axis)
  batch_axes = check_batch_axes(mesh, axis_name, batch_axes, x.shape[0], tensor_axis)
  check_tensor_split(w2.shape[1], TP, tensor_axis)
  if quantization is not None:
    check_fp8_tensor_split(w2.shape[1], TP, tensor_axis)
  E = w1.shape[0]
  check_expert_ids(expert_ids, E)
  w1, w2 = (fp8.inference_only(w) if isinstance(w, fp8.Fp8Weight) else w for w in (w1, w2))
  R = mesh.shape[axis_name]
  B = batch_size(mesh, batch_axes)
  T_local = x.shape[0] // (R * TP * B)
  k = expert_ids.shape[1]
  cap_e = plan_lib.expert_capacity(T_local, R * TP, k, E, capacity_factor)
  args = [_onto_mesh(a, mesh) for a in (x, expert_ids, gates, w1, w2)]
  axes = (axis_name, tensor_axis, batch_axes)
  impl = chosen_impl(impl, mesh, exchange_axes(axis_name, tensor_axis))
  if quantization is not None:
    check_fp8_impl(impl, mesh)
  if impl == "reference":
    y, dropped = eager_program(_reference_layer, mesh, axes, cap_e, B, quantization)(*args)
  elif impl in ("xla", "collective"):
    cap = plan_lib.recv_capacity(T_local * TP, R, k, E // R, cap_e)
    y, dropped = eager_program(_xla_layer, mesh, axes, cap_e, cap, impl, quantization)(*args)
  else:
    platform = next(iter(mesh.devices.flat)).platform
    reduce = tensor_reduce(config, platform, R, TP, k, x.dtype.itemsize, T_local * k * TP, quantization)
    sizes = layer_sizes(T_local, R, k, E, x.shape[1], x.dtype.itemsize, capacity_factor, TP,
                        gather_rs=reduce == "gather_rs", quantization=quantization)
    cap = plan_lib.recv_capacity(T_local, R * TP, k, E // R, cap_e)
    info = RankInfo(Workspace.get(mesh, exchange_axes(axis_name, tensor_axis), sizes), config)
    # The custom calls run only in a compiled program (ordering.py): under jax.disable_jit() the layer's program is
    # still compiled; the rest of the caller's code runs op by op.
    with jax.disable_jit(False):
      y, dropped = eager_program(_overlap_layer, mesh, axes, E, cap_e, cap, info, reduce, quantization)(*args)
  return like_committed(y, x), dropped


def exchange_axes(axis_name: str, tensor_axis: str | None) -> str | tuple[str, str]:
  """The mesh axes whose devices exchange rows in one group: the expert axis, or with expert tensor parallelism the
  expert and tensor axes together (``tensor_parallel.py``)."""
  return axis_name if tensor_axis is None else (axis_name, tensor_axis)


def chosen_impl(impl: str, mesh: jax.sharding.Mesh, axis_name: str | tuple[str, ...]) -> str:
  """The impl a call asking for ``impl`` runs: ``"collective"`` for ``"overlap"`` where the expert axis (with a
  tensor axis: the group of both) spans hosts (a workspace is memory its processes map: ``hosts.py``), else
  ``impl``."""
  if impl == "overlap" and _axis_spans_hosts(mesh, axis_name):
    return "collective"
  return impl


@functools.cache
def _axis_spans_hosts(mesh: jax.sharding.Mesh, axis_name: str | tuple[str, ...]) -> bool:
  spans = hosts.axis_spans_hosts(rank_devices(mesh, axis_name))
  if spans:
    log.info("jax_moe_overlap: the expert axis %r spans hosts: impl=\"overlap\" runs as impl=\"collective\" (XLA "
             "collectives and this library's grouped GEMMs)", axis_name)
  return spans


# One jitted program per static configuration, so that eager calls compile once: outside jit, shard_map would run
# its body op by op (hundreds of small compilations per call). Under an outer jit/grad/vmap the jitted program is
# traced inline like any nested jit. Entries hold their workspace (through RankInfo): ``Workspace.release`` of that
# workspace drops them (``_forget_programs``).
_programs: dict[tuple, object] = {}


def eager_program(layer, *static):
  """``jax.jit(functools.partial(layer, *static))``, one per (layer, static) and reused by every later call."""
  key = (layer, *static)
  fn = _programs.get(key)
  if fn is None:
    fn = jax.jit(functools.partial(layer, *static))
    _programs[key] = fn
  return fn


def _forget_programs(workspace) -> None:
  for key in [k for k in _programs if any(isinstance(s, RankInfo) and s.workspace is workspace for s in k)]:
    del _programs[key]


Workspace.on_release(_forget_programs)


def _ids_int32(expert_ids):
  """Expert ids as the int32 every path computes with. Ids of a wider or unsigned dtype (int64 under x64, uint32,
  uint64) are first saturated to int32's range, so that an id outside [-1, E) stays outside it: a plain cast wraps
  (2**32 + 3 to expert 3, uint32 2**32 - 1 to -1, a skipped slot), and under ``jit``, where ``check_expert_ids``
  cannot see the values, only the invalid-id rule (the custom calls' error, or no output in the impls that route in
  XLA) keeps such an id from being computed as another expert."""
  ids = jnp.asarray(expert_ids)
  lo, hi = int(jnp.iinfo(jnp.int32).min), int(jnp.iinfo(jnp.int32).max)
  info = jnp.iinfo(ids.dtype)
  if info.max > hi:
    ids = jnp.where(ids > hi, jnp.asarray(hi, ids.dtype), ids)
  if info.min < lo:
    ids = jnp.where(ids < lo, jnp.asarray(lo, ids.dtype), ids)
  return ids.astype(jnp.int32)


def _reference_layer(mesh, axes, cap_e, B, quantization, x, expert_ids, gates, w1, w2):
  """The dense oracle on whole (replicated) arrays, every device computing all of it (its capacity rule scans all
  tokens of a group in order; B > 1: B independent groups of T / B tokens), whole experts whatever the tensor axis.
  Inside ``shard_map`` so that it runs on the mesh's devices whatever x's placement (under ``jit`` a plain x and
  mesh-sharded weights could not meet otherwise)."""
  args = [_shard(a, mesh, P()) for a in (x, _ids_int32(expert_ids), gates, w1, w2)]
  layer = (moe_experts_reference if quantization is None
           else functools.partial(moe_experts_fp8_reference, quantization=quantization))

  def groups(x, ids, g, w1, w2):
    w1 = tp_lib.gate_up_shards(w1)                                      # the [E, D, 2, F] view: [E, D, 2F]
    x_, ids_, g_ = (a.reshape(B, a.shape[0] // B, *a.shape[1:]) for a in (x, ids, g))
    y, dropped = jax.vmap(lambda x, i, g: layer(x, i, g, w1, w2, cap_e, 1))(x_, ids_, g_)
    return y.reshape(x.shape), jnp.sum(dropped).astype(jnp.int32)

  y, dropped = jax.shard_map(groups, mesh=mesh, in_specs=(P(),) * 5, out_specs=(P(), P()))(*args)
  return _like(y, x, mesh, axes), dropped


def _expert_parallel_inputs(mesh, axes, x, expert_ids, gates, w1, w2):
  """The layer's inputs as the expert-parallel paths take them (``axes``: (axis_name, tensor_axis, batch_axes)):
  tokens (int32 ids, float32 gates) over ``(*batch_axes, axis_name, tensor_axis)``, experts over ``axis_name`` and
  their hidden width over ``tensor_axis``, w1 as its [E, D, 2, F] view (``tensor_parallel.operand_specs``; an
  ``Fp8Weight``'s values and scales by ``tensor_parallel.weight_spec``). Returns (args, in_specs, token_spec)."""
  axis_name, tensor_axis, batch_axes = axes
  token_spec, w1_spec, w2_spec = tp_lib.operand_specs(axis_name, tensor_axis, batch_axes)
  w1 = _w1_view(w1, mesh, axis_name)
  specs = (token_spec, token_spec, token_spec, tp_lib.weight_spec(w1, w1_spec), tp_lib.weight_spec(w2, w2_spec))
  args = [_shard(a, mesh, s) for a, s in zip((x, _ids_int32(expert_ids), gates.astype(jnp.float32), w1, w2),
                                             specs)]
  return args, specs, token_spec


def _xla_layer(mesh, axes, cap_e, cap, impl, quantization, x, expert_ids, gates, w1, w2):
  args, _, _ = _expert_parallel_inputs(mesh, axes, x, expert_ids, gates, w1, w2)
  axis_name, tensor_axis, batch_axes = axes
  y, dropped = moe_experts_xla(*args, mesh=mesh, axis_name=axis_name, expert_cap=cap_e, recv_cap=cap,
                               batch_axes=batch_axes, impl=impl, tensor_axis=tensor_axis, quantization=quantization)
  return _like(y, x, mesh, axes), dropped


def _overlap_layer(mesh, axes, num_experts, cap_e, cap, info, reduce, quantization, x, expert_ids, gates, w1, w2):
  args, in_specs, token_spec = _expert_parallel_inputs(mesh, axes, x, expert_ids, gates, w1, w2)
  axis_name, tensor_axis, batch_axes = axes
  fn = functools.partial(_moe_local, axis_name=axis_name, tensor_axis=tensor_axis, batch_axes=batch_axes,
                         num_experts=num_experts, cap_e=cap_e, cap=cap, info=info, reduce=reduce,
                         quantization=quantization)
  y, dropped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=(token_spec, P()), check_vma=False)(*args)
  return _like(y, x, mesh, axes), dropped


def _like(y, x, mesh, axes):
  """Inside the layer's program, y's layout, the same for every impl: on a mesh with Explicit axes, as x's sharding
  type says (so that ``x + y`` works and callers can reshape y as they could x); on Auto axes, where a traced x
  carries no sharding, the layer's token layout (``tensor_parallel.operand_specs``), which is x's when x is laid out
  as the layer takes its tokens (an eager call's committed x gets its own back: ``like_committed``)."""
  if explicit_mesh(mesh):
    return jax.sharding.reshard(y, jax.sharding.NamedSharding(mesh, jax.typeof(x).sharding.spec))
  token_spec = tp_lib.operand_specs(*axes)[0]
  return jax.lax.with_sharding_constraint(y, jax.sharding.NamedSharding(mesh, token_spec))


def like_committed(y, x):
  """After the layer's program: a committed concrete x (an eager call) gets y back with exactly its sharding. A traced
  y (an eager ``jax.grad`` of the weights with x held constant) has no concrete sharding to compare: left as the
  program laid it out (``_like``)."""
  if (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and not isinstance(y, jax.core.Tracer) and
      x.committed and y.sharding != x.sharding):
    return jax.device_put(y, x.sharding)
  return y


def explicit_mesh(mesh) -> bool:
  """Whether ``mesh`` has Explicit axes (jax.make_mesh's default): reshapes on it must be told their output sharding."""
  return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def explicit_spec(mesh, spec: P) -> P:
  """spec naming only the mesh's Explicit axes. A sharding in the types (``reshard``, a reshape's ``out_sharding``)
  may name no other: on a mesh mixing Explicit and Auto axes the Auto ones are left to XLA (shard_map lays the
  operands out over them)."""
  explicit = {n for n, t in zip(mesh.axis_names, getattr(mesh, "axis_types", ()))
              if t == jax.sharding.AxisType.Explicit}

  def keep(entry):
    if entry is None or entry is P.UNCONSTRAINED:
      return entry
    kept = tuple(n for n in (entry if isinstance(entry, tuple) else (entry,)) if n in explicit)
    return kept[0] if len(kept) == 1 else (kept or None)

  return P(*(keep(e) for e in spec))


def _onto_mesh(tree, mesh):
  """Each concrete array of `tree` on other devices than the mesh's, replicated onto the mesh (inside the program
  shard_map reshards over Auto axes, but not across device sets)."""
  def onto(a):
    if (isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and
        a.sharding.device_set != set(mesh.devices.flat)):
      return jax.device_put(a, jax.sharding.NamedSharding(mesh, P()))
    return a

  return jax.tree.map(onto, tree)


def _w1_view(w1, mesh, axis_name):
  """w1 as its [E, D, 2, F] view (``tensor_parallel.w1_view``; an ``Fp8Weight``'s arrays alike). On an Explicit mesh
  a reshape must be told its output sharding: a [E, D, 2F] w1 is laid out over the expert axis first (its 2F axis
  cannot be split over a tensor axis with the gate and up halves split alike; the view can, without moving data)."""
  if not explicit_mesh(mesh):
    return tp_lib.w1_view(w1)
  experts = jax.sharding.NamedSharding(mesh, explicit_spec(mesh, P(axis_name)))

  def reshape(a, shape):
    return jnp.reshape(jax.sharding.reshard(a, experts), shape, out_sharding=experts)

  return tp_lib.w1_view(w1, reshape)


def _shard(tree, mesh, spec):
  """Places each array of `tree` on `spec` (one PartitionSpec for all, or a tree of them shaped as `tree`) over an
  Explicit mesh (shard_map reshards by itself over Auto axes)."""
  if not explicit_mesh(mesh):
    return tree
  specs = jax.tree.map(lambda _: spec, tree) if isinstance(spec, P) else spec
  return jax.tree.map(lambda a, s: jax.sharding.reshard(a, jax.sharding.NamedSharding(mesh, explicit_spec(mesh, s))),
                      tree, specs)


def _moe_local(x, expert_ids, gates, w1, w2, *, axis_name, tensor_axis, batch_axes, num_experts, cap_e, cap, info,
               reduce, quantization=None):
  """One rank of the exchange group (``info.workspace.axis_name``: the expert axis, or the expert and tensor axes):
  its tokens' slots (with a tensor axis, each choice as TP shard slots: ``tensor_parallel``) through the plan and the
  expert block, whose shards' partials ``reduce`` sums ("per_slot": ``expert_block``; "gather_rs":
  ``gather_rs_block``; ``call_site.tensor_reduce`` chose). quantization="fp8": ``fp8_overlap.fp8_expert_block``
  (the shards' partials per slot), on a one-rank group ``xla_path.fp8_one_rank_block`` (impl="collective"'s)."""
  R = jax.lax.axis_size(axis_name)
  TP = jax.lax.axis_size(tensor_axis) if tensor_axis is not None else 1
  slot_ids, slot_gates = tp_lib.shard_slots(expert_ids, gates, num_experts, R, TP)
  counts_all, rank, plan = plan_lib.plan_over_axis(slot_ids, num_experts * TP, info.workspace.axis_name, cap_e,
                                                   gather=functools.partial(gather_counts, info=info))
  plan = tp_lib.name_expert_ids(plan, expert_ids, TP)
  if quantization is not None and R * TP == 1:
    y = fp8_one_rank_block(x, slot_ids, slot_gates, tp_lib.gate_up_shards(w1), w2, axis_name=axis_name,
                           num_experts=num_experts, expert_cap=cap_e, recv_cap=cap, quantization=quantization)
  elif quantization is not None:
    route = workspace_route(slot_ids, counts_all, rank, cap_e, plan, cap, info)
    y = fp8_expert_block(x, slot_gates, tp_lib.gate_up_shards(w1), w2, route, quantization)
  else:
    block = gather_rs_block if reduce == "gather_rs" else expert_block
    y = block(x, slot_gates, tp_lib.gate_up_shards(w1), w2, plan, cap, info)
  if info.workspace.spans_processes:
    # The group's dropped slots from the counts every rank holds (the routed slots less those the capacity keeps),
    # equal to the psum of the ranks' plan.dropped: no collective crosses the processes of the expert axis.
    dropped = jnp.sum(counts_all) - jnp.sum(plan_lib.kept_counts(counts_all, cap_e))
    dropped = jax.lax.psum(dropped, batch_axes) if batch_axes else dropped
  else:
    tensor = (tensor_axis,) if tensor_axis is not None else ()
    dropped = jax.lax.psum(plan.dropped, (*batch_axes, axis_name, *tensor))
  # Every shard of an expert drops the expert's slots: the plans count each dropped slot TP times.
  return y, dropped // TP if TP > 1 else dropped
