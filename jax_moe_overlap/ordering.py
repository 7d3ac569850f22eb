"""CPU: the workspace calls as one JAX *ordered effect*, so that every rank runs them in the one program order.

Why: ``dispatch`` and ``expert_combine`` are collective on a shared workspace (protocol.h): each call is the next
epoch of every rank, so all ranks of a group must make the same sequence of calls. Inside one program only data
orders two calls, and two workspace calls need not be connected by data (two independent layers; a layer recomputed
by remat next to another layer's backward pass). ``jax.ffi.ffi_call(..., has_side_effect=True)`` only keeps a call
from being removed or merged: XLA:CPU's thunk executor builds its graph from buffer and resource uses alone (custom
calls declare no resource) and runs ready thunks concurrently, so two such calls can start in different orders on
different ranks, or overlap on one rank. Rows of one call then land in another (silently wrong results) or a wait
times out (tests/test_ordering.py checks the chain in the compiled program and the rows each call delivers).

How: on CPU the calls bind ``workspace_call_p``, whose effect ``WorkspaceEffect`` is ordered. JAX threads a token
through every primitive with an ordered effect in program (jaxpr) order: across ``shard_map``, ``custom_vjp``
(forward and backward), loops, conditionals and remat. The lowering makes the token the first operand and first
result of the custom call, and XLA:CPU orders a thunk after the thunk whose token it takes, so the workspace calls
of a program form one chain. Every rank runs the same compiled program, hence the same order. The effect is
*shardable* (each device orders its own calls), the kind of ordered effect JAX allows in multi-device programs.
Nothing else is ordered: the bare grouped GEMMs and XLA's own work stay free to run concurrently.

Between programs: JAX also threads an ordered effect's token from one dispatched program to the next. We do not
keep that link for this effect (``_drop_cross_program_token``): each device runs its programs one after another
anyway (JAX relies on the same total order for its runtime tokens), and the link would carry a failure on: a program
whose workspace call fails (a timeout, an expert id out of range) returns its token in error, and every later program
would fail on that input before running, where the library recovers on the next call instead (tests/test_errors.py).

CUDA does not use this: XLA:GPU launches the calls on one stream in program order, and ``workspace_calls.py`` binds
plain ``ffi_call`` there, with no effect at all (the CUDA handlers take no token): an effect of any kind turns off
JAX's C++ dispatch fast path (workspace_calls._workspace_call says why that matters).

This uses JAX internals (``jax._src``: effects, core, mlir lowering, batching, the runtime token set), checked against
JAX 0.11.2. The public mechanisms do not serve: ``jax.ffi.ffi_call(..., has_side_effect=True)`` gives an *unordered*
effect (see above); ``jax.experimental.io_callback(..., ordered=True)`` orders Python callbacks, not custom calls;
JAX offers no public ordered effect or token for a custom call. ``_wrap_jax_method`` checks the one method each of
``_drop_cross_program_token`` and ``_keep_tokens_in_compiled_calls`` wraps and fails loudly if it moved.

vmap: a workspace call under ``jax.vmap`` runs once per batch element in a ``lax.scan`` (``_batching_rule``), as
``ffi_call``'s ``vmap_method="sequential"`` does for the CUDA calls.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax._src import core
from jax._src import dispatch
from jax._src import effects
from jax._src import shard_map as shard_map_internal
from jax._src.interpreters import batching
from jax._src.interpreters import mlir
from jax._src.interpreters import pxla


class WorkspaceEffect(effects.Effect):
  """Ordered (and shardable) effect of every call on a CPU peer workspace."""

  def __str__(self):
    return "jax_moe_overlap.workspace"

  __repr__ = __str__


workspace_effect = WorkspaceEffect()
for _set in (effects.ordered_effects, effects.shardable_ordered_effects, effects.lowerable_effects,
             effects.control_flow_allowed_effects, effects.custom_derivatives_allowed_effects,
             effects.remat_allowed_effects, effects.partial_eval_kept_effects):
  _set.add_type(WorkspaceEffect)


def _wrap_jax_method(cls, name: str, make):
  """Replaces ``cls.name`` (a JAX internal) by ``make(original)``, once; fails loudly if this JAX lacks it."""
  original = getattr(cls, name, None)
  if original is None or not callable(original):
    raise ImportError(f"jax_moe_overlap: this JAX has no {cls.__name__}.{name}; the CPU workspace ordering "
                      "(jax_moe_overlap/ordering.py) needs updating for it")
  if getattr(original, "_jmo_wrapped", False):
    return
  wrapped = functools.wraps(original)(make(original))
  wrapped._jmo_wrapped = True
  setattr(cls, name, wrapped)


def _drop_cross_program_token(original):
  """JAX stores the token a program returns for each ordered effect and feeds it to the next program; for
  ``WorkspaceEffect`` keep none, so every program starts from a fresh token (see the module docstring)."""

  def set_token_result(self, eff, token):
    if isinstance(eff, WorkspaceEffect):
      return
    original(self, eff, token)

  return set_token_result


def _keep_tokens_in_compiled_calls(original):
  """An ahead-of-time compiled program (``jax.jit(f).lower(...).compile()``) that makes workspace calls must be
  called through JAX's Python path, which adds the ordered effect's token to the arguments: ``jax.jit`` itself keeps
  programs with ordered effects off its C++ fast path (``pjit._get_fastpath_data``), but
  ``MeshExecutable.create_cpp_call`` (the compiled object's call) only checks for unordered effects, so its second
  call would run without the token ("supplied N arguments but compiled program expected N + 1"). For such programs
  make it decline the fast path, as ``jax.jit`` does."""

  def create_cpp_call(self, params):
    if any(isinstance(e, WorkspaceEffect) for e in getattr(self.unsafe_call, "ordered_effects", ())):
      return None
    return original(self, params)

  return create_cpp_call


_wrap_jax_method(dispatch.RuntimeTokenSet, "set_token_result", _drop_cross_program_token)
_wrap_jax_method(pxla.MeshExecutable, "create_cpp_call", _keep_tokens_in_compiled_calls)


workspace_call_p = core.Primitive("jmo_workspace_call")
workspace_call_p.multiple_results = True
dispatch.simple_impl(workspace_call_p)


def _abstract_eval(*avals_in, target_name, result_avals, attributes):
  del avals_in, target_name, attributes
  return tuple(result_avals), {workspace_effect}


workspace_call_p.def_effectful_abstract_eval(_abstract_eval)


def _lowering(ctx: mlir.LoweringRuleContext, *operands, target_name, result_avals, attributes):
  del result_avals
  token = ctx.tokens_in.get(workspace_effect)
  tok = core.abstract_token
  rule = jax.ffi.ffi_lowering(target_name, has_side_effect=True)
  token_out, *outs = rule(ctx.replace(avals_in=(tok, *ctx.avals_in), avals_out=(tok, *ctx.avals_out)),
                          token, *operands, **dict(attributes))
  ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({workspace_effect: token_out})))
  return outs


mlir.register_lowering(workspace_call_p, _lowering, platform="cpu")


def _batching_rule(args, dims, *, target_name, result_avals, attributes):
  """vmap: one call per batch element, in a scan (``ffi_call``'s ``vmap_method="sequential"``). A workspace call is
  one epoch of a collective protocol, so it cannot take a batch dimension the handler does not know; as a sequence
  of calls it stays correct, because every rank runs the same program and so the same number of calls in the same
  order (the token chain runs through the scan)."""
  size, = {a.shape[d] for a, d in zip(args, dims) if d is not None}
  args = [a if d is None else jax.numpy.moveaxis(a, d, 0) for a, d in zip(args, dims)]
  mapped = [d is not None for d in dims]

  def one(_, batched):
    it = iter(batched)
    full = [next(it) if m else a for a, m in zip(args, mapped)]
    return (), tuple(workspace_call_p.bind(*full, target_name=target_name, result_avals=result_avals,
                                           attributes=attributes))

  _, outs = jax.lax.scan(one, (), [a for a, m in zip(args, mapped) if m], length=size)
  return list(outs), [0] * len(outs)


batching.primitive_batchers[workspace_call_p] = _batching_rule


def _eager_shard_map_rule(mesh, *args, **params):
  """A ``shard_map`` run eagerly (outside ``jit``, or under ``jax.disable_jit()``) compiles each operation as its own
  program; XLA:CPU's compiler crashes the process (a segmentation fault) on such a program holding a workspace call.
  Refused with an error naming the fix instead, as JAX refuses what its eager ``shard_map`` cannot run."""
  del mesh, args
  if jax.config.jax_disable_jit:
    fix = ("under jax.disable_jit() moe_experts and MoE compile their forward program by themselves, but a gradient "
           "taken there runs the backward op by op: take it outside jax.disable_jit(), or debug op by op with "
           "impl=\"xla\" (the same results)")
  else:
    fix = "wrap the shard_map that makes it in jax.jit"
  raise ValueError(f"jax_moe_overlap: the workspace call {params['target_name']} (dispatch, expert_combine and the "
                   f"other calls that exchange rows) runs only inside a compiled program: {fix}")


# (jax's table of eager shard_map rules: where a jax has none, an eager shard_map is not intercepted here.)
if hasattr(shard_map_internal, "eager_rules"):
  shard_map_internal.eager_rules[workspace_call_p] = _eager_shard_map_rule


def workspace_call(target_name: str, result_shape_dtypes, *args, **attributes: Any):
  """``jax.ffi.ffi_call(target_name, result_shape_dtypes, has_side_effect=True)(*args, **attributes)`` for a CPU
  workspace call, ordered with every other workspace call of the program (the handler takes a token first and
  returns one first; see the module docstring).

  ``result_shape_dtypes``: one ``jax.ShapeDtypeStruct`` or a tuple of them (then a tuple comes back).
  Attributes: numpy scalars (the custom call's attributes).
  """
  multiple = isinstance(result_shape_dtypes, (tuple, list))
  shapes = tuple(result_shape_dtypes) if multiple else (result_shape_dtypes,)
  result_avals = tuple(core.ShapedArray(s.shape, s.dtype) for s in shapes)
  for k, v in attributes.items():
    if not isinstance(v, np.generic):
      raise TypeError(f"jax_moe_overlap: workspace call attribute {k}={v!r} must be a numpy scalar")
  outs = workspace_call_p.bind(*args, target_name=target_name, result_avals=result_avals,
                               attributes=tuple(sorted(attributes.items())))
  return tuple(outs) if multiple else outs[0]
