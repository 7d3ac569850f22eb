"""Expert tensor parallelism (``tensor_axis``): the layer of every impl against a float32 oracle written without the
library's layer code. Shared by test_tensor_parallel.py (4 CPU devices) and tensor_parallel_main.py (8, in a child
process)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe_overlap as jmo
from cases import layer_inputs, rel_err
from layer_checks import Poisoned
from jax_moe_overlap.plan import SKIP, expert_capacity
from jax_moe_overlap.reference import moe_experts_reference

E, D, F, K = 8, 16, 24, 2
IMPLS = ("overlap", "collective", "xla", "reference")


def mesh_of_shape(shape: dict[str, int], explicit: bool = False, devices=None) -> jax.sharding.Mesh:
  """A mesh of ``shape`` over the first devices of ``devices`` (default: jax.devices(), CPU ones in the CPU tests)."""
  n = math.prod(shape.values())
  devs = np.array(list(devices or jax.devices())[:n]).reshape(tuple(shape.values()))
  kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  return jax.sharding.Mesh(devs, tuple(shape), axis_types=(kind,) * len(shape))


def routing_inputs(tokens: int, kind: str, seed: int, d: int = D, f: int = F):
  """x, ids, gates, w1, w2 (cases.layer_inputs) for one routing: "skewed", "empty_experts" (only the first half of
  the experts chosen: every expert of the upper expert ranks empty), or "skipped" (skewed, with about a quarter of
  the slots SKIP and a few tokens skipping every choice)."""
  base = "empty_experts" if kind == "empty_experts" else "skewed"
  x, ids, gates, w1, w2 = layer_inputs(tokens, d, f, E, K, base, seed)
  if kind == "skipped":
    rng = np.random.default_rng(seed + 1)
    ids = np.where(rng.random(ids.shape) < 0.25, SKIP, np.asarray(ids))
    ids[::7] = SKIP
    ids = jnp.asarray(ids.astype(np.int32))
  return x, ids, gates, w1, w2


def oracle(x, ids, gates, w1, w2, groups: int, group_ranks: int, cf):
  """(y, dropped): each of ``groups`` runs of T / groups consecutive tokens is one expert-parallel group of
  ``group_ranks`` devices (the expert axis times the tensor axis) with whole experts, its capacity counting its own
  tokens."""
  t = x.shape[0] // groups
  cap_e = expert_capacity(t // group_ranks, group_ranks, ids.shape[1], E, cf)
  ys, dropped = [], []
  for b in range(groups):
    s = slice(b * t, (b + 1) * t)
    y, d = moe_experts_reference(x[s], ids[s], gates[s], w1, w2, cap_e, group_ranks)
    ys.append(y)
    dropped.append(d)
  return jnp.concatenate(ys), sum(dropped)


def _readout(y):
  # A non-linear read-out, so that every output element gets its own cotangent.
  return jnp.sum(jnp.sin(y.astype(jnp.float32)) * jnp.arange(y.size).reshape(y.shape) / y.size)


@functools.lru_cache(maxsize=None)
def layer_program(mesh, impl: str, batch_axes: tuple, cf, view: bool, config: jmo.CallConfig = jmo.CallConfig()):
  """Jitted (x, ids, gates, w1, w2) -> ((loss, (y, dropped)), grads wrt x, gates, w1, w2) of the layer with
  tensor_axis="tensor" (w1 given as its [E, D, 2, F] view with ``view``) and the custom calls' ``config``; the
  routing is an argument, so one compilation serves every routing of a shape."""
  def loss(x, gates, w1, w2, ids):
    y, dropped = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, capacity_factor=cf, impl=impl,
                                 batch_axes=batch_axes, tensor_axis="tensor", config=config)
    return _readout(y), (y, dropped)

  grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
  return jax.jit(lambda x, ids, gates, w1, w2: grads(x, gates, w1, w2, ids))


@functools.lru_cache(maxsize=None)
def _oracle_program(groups: int, group_ranks: int, cf):
  def loss(x, gates, w1, w2, ids):
    y, dropped = oracle(x, ids, gates, w1, w2, groups, group_ranks, cf)
    return _readout(y), (y, dropped)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def _placed(mesh, batch_axes, x, ids, gates, w1, w2, view: bool):
  """The inputs on the mesh as a caller keeps them: tokens over (*batch, expert, tensor), w1 as its view sharded
  (expert, -, -, tensor) with ``view``, else [E, D, 2F] over the expert axis; w2 over (expert, tensor)."""
  tok = jax.sharding.NamedSharding(mesh, jax.P((*batch_axes, "expert", "tensor")))
  if view:
    w1 = jax.device_put(w1.reshape(E, D, 2, F), jax.sharding.NamedSharding(mesh, jax.P("expert", None, None,
                                                                                       "tensor")))
  else:
    w1 = jax.device_put(w1, jax.sharding.NamedSharding(mesh, jax.P("expert")))
  w2 = jax.device_put(w2, jax.sharding.NamedSharding(mesh, jax.P("expert", "tensor")))
  return jax.device_put(x, tok), jax.device_put(ids, tok), jax.device_put(gates, tok), w1, w2


def check_matches_oracle(shape: dict[str, int], impl: str, kinds=("skewed", "empty_experts", "skipped"), cf=None,
                         batch_axes=(), tokens=64, seed=0, explicit=False, view=True,
                         config: jmo.CallConfig = jmo.CallConfig()) -> list[int]:
  """The layer (mesh ``shape`` with axes "expert", "tensor" and the batch axes) against the oracle for each routing
  of ``kinds``: y, dropped and the gradients wrt x, gates, w1, w2; y sharded as x (each device its own T / devices
  tokens). Returns the dropped counts."""
  mesh = mesh_of_shape(shape, explicit)
  groups = math.prod(shape[a] for a in batch_axes)
  group_ranks = shape["expert"] * shape["tensor"]
  run = layer_program(mesh, impl, tuple(batch_axes), cf, view, config)
  ref = _oracle_program(groups, group_ranks, cf)
  drops = []
  for i, kind in enumerate(kinds):
    x, ids, gates, w1, w2 = routing_inputs(tokens, kind, seed + i)
    args = _placed(mesh, batch_axes, x, ids, gates, w1, w2, view)
    (_, (y, dropped)), grads = run(*args)
    (_, (y_ref, dropped_ref)), grads_ref = ref(x, gates, w1, w2, ids)
    what = f"{shape} {impl} {kind} cf={cf} {config.tensor_reduce}"
    assert float(jnp.max(jnp.abs(y_ref))) > 0.1, what
    assert int(dropped) == int(dropped_ref), (what, int(dropped), int(dropped_ref))
    assert y.sharding.is_equivalent_to(args[0].sharding, 2), (what, y.sharding, args[0].sharding)
    assert {s.data.shape for s in y.addressable_shards} == {(tokens // mesh.size, D)}, what
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5, err_msg=what)
    for name, g, g_ref, a in zip(("x", "gates", "w1", "w2"), grads, grads_ref, args[:1] + args[2:]):
      assert g.shape == a.shape, (what, name, g.shape, a.shape)
      np.testing.assert_allclose(np.asarray(g).reshape(g_ref.shape), g_ref, rtol=1e-4, atol=1e-5,
                                 err_msg=f"{what}: gradient of {name}")
    drops.append(int(dropped))
  return drops


def check_repeatable(shape: dict[str, int], impl: str, calls: int = 5, cf=0.5, batch_axes=(), tokens=64, seed=9,
                     devices=None, config: jmo.CallConfig = jmo.CallConfig()):
  """``calls`` calls of the layer's forward and gradients on the same inputs: every output bitwise equal."""
  mesh = mesh_of_shape(shape, devices=devices)
  run = layer_program(mesh, impl, tuple(batch_axes), cf, True, config)
  args = _placed(mesh, batch_axes, *routing_inputs(tokens, "skipped", seed), True)
  first = [np.asarray(a).tobytes() for a in jax.tree.leaves(run(*args))]
  for i in range(calls - 1):
    again = [np.asarray(a).tobytes() for a in jax.tree.leaves(run(*args))]
    assert again == first, f"{shape} {impl}: call {i + 2} differs from the first"


def check_same_bits(shape: dict[str, int], configs, cf=0.5, tokens=64, seed=5, devices=None):
  """The layer's forward and gradients on the same inputs under each of ``configs`` (e.g. overlapped and serialized):
  every output bitwise the first config's."""
  mesh = mesh_of_shape(shape, devices=devices)
  args = _placed(mesh, (), *routing_inputs(tokens, "skewed", seed), True)
  outs = [[np.asarray(a).tobytes() for a in jax.tree.leaves(layer_program(mesh, "overlap", (), cf, True, c)(*args))]
          for c in configs]
  for c, out in zip(configs[1:], outs[1:]):
    assert out == outs[0], f"{shape}: {c} differs from {configs[0]}"


def check_bfloat16(shape: dict[str, int], kind="skipped", cf=None, tokens=64, d=D, f=F, seed=13, tol=1e-2,
                   devices=None, config: jmo.CallConfig = jmo.CallConfig()):
  """The overlap layer in bfloat16 (the shards' partial outputs cross in bfloat16, or with GatherRS in float32)
  against the float32 oracle on the same bf16-rounded inputs: y and the gradients within ``tol`` relative error,
  every output computed into a buffer of NaN (``layer_checks.Poisoned``), so that an element the custom calls leave
  unwritten shows. Returns the relative errors."""
  mesh = mesh_of_shape(shape, devices=devices)
  x, ids, gates, w1, w2 = routing_inputs(tokens, kind, seed, d, f)
  x, w1, w2 = (a.astype(jnp.bfloat16) for a in (x, w1, w2))
  target = jnp.asarray(np.random.default_rng(seed).standard_normal(x.shape), jnp.float32)

  def loss(x, gates, w1, w2):
    y, dropped = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, capacity_factor=cf, tensor_axis="tensor",
                                 config=config)
    return jnp.sum(y.astype(jnp.float32) * target), (y, dropped)

  tokens_spec = jax.P(("expert", "tensor"))
  specs = {(tokens, d): tokens_spec, (tokens, K): tokens_spec, (E, d, 2, f): jax.P("expert", None, None, "tensor"),
           (E, f, d): jax.P("expert", "tensor", None)}
  run = Poisoned(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True), mesh,
                 spec_of=lambda s: specs.get(tuple(s.shape), jax.P()))
  (_, (y, dropped)), grads = run(x, gates, w1.reshape(E, d, 2, f), w2)

  def ref_loss(x, gates, w1, w2):
    y, dropped = oracle(x, ids, gates, w1, w2, 1, math.prod(shape.values()), cf)
    return jnp.sum(y * target), (y, dropped)

  f32 = [a.astype(jnp.float32) for a in (x, gates, w1, w2)]
  (_, (y_ref, dropped_ref)), grads_ref = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1, 2, 3),
                                                                    has_aux=True))(*f32)
  assert y.dtype == jnp.bfloat16 and int(dropped) == int(dropped_ref)
  errs = {}
  for name, a, b in zip(("y", "dx", "dgates", "dw1", "dw2"), (y, *grads), (y_ref, *grads_ref)):
    a = np.asarray(a, np.float32).reshape(b.shape)
    assert np.isfinite(a).all(), f"{name} has NaN/inf (poison left: unwritten elements?)"
    errs[name] = rel_err(a, b)
  assert all(v < tol for v in errs.values()), errs
  assert run.aliased == run.buffers, f"only {run.aliased} of {run.buffers} outputs were computed into the poison"
  print(f"{shape} bfloat16 {kind} cf={cf} {config.tensor_reduce} dropped={int(dropped)}: " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
  return errs
