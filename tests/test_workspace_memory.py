"""Workspace memory: its size before and after allocation, reuse by smaller calls, release on demand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_moe_overlap as jmo
from cases import layer_inputs, mesh_of
from jax_moe_overlap.workspace import Workspace, WorkspaceSizes, layer_sizes, release_workspaces, workspace_bytes

E, D, F = 8, 16, 24


def _workspaces(mesh):
  ids = {d.id for d in mesh.devices.flat}
  return [ws for ws in Workspace.cached() if {d.id for d in ws.mesh.devices.flat} == ids]


def test_sizes_are_known_before_allocation_and_match_the_workspace():
  release_workspaces()
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(64, D, F, E, 2, "skewed", 1)
  planned = workspace_bytes(64, D, 2, E, ranks=4, dtype=jnp.float32)
  jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh)
  (ws,) = _workspaces(mesh)
  assert ws.bytes_per_rank == planned > 4 * D * 16   # recv + ret + stage rows at least
  assert ws.total_bytes == planned * 4
  assert ws.sizes.fits(layer_sizes(16, 4, 2, E, D, 4, None))
  # Planning a bfloat16 layer or one with a capacity factor gives less.
  assert workspace_bytes(64, D, 2, E, ranks=4, dtype=jnp.bfloat16) < planned
  assert workspace_bytes(64, D, 2, E, ranks=4, capacity_factor=0.5) < planned
  with pytest.raises(ValueError, match="split evenly"):
    workspace_bytes(63, D, 2, E, ranks=4)
  for kwargs, match in ((dict(tokens=-4), "tokens must be a positive int"), (dict(ranks=0), "ranks must be a positive"),
                        (dict(top_k=E + 1), "top-k must be in"), (dict(dtype="float16"), "supported: float32"),
                        (dict(quantization="int8"), "quantization must be")):
    with pytest.raises((ValueError, TypeError), match=match):
      workspace_bytes(**{**dict(tokens=64, d_model=D, top_k=2, num_experts=E, ranks=4), **kwargs})


DECODE_BATCHES = (4, 12, 36, 100, 256)   # a decode loop's batch sizes, about 3x apart (each one compiles)


@pytest.mark.slow  # five batch sizes, each compiled
def test_a_decode_loop_allocates_once_per_layer_width():
  release_workspaces()
  mesh = mesh_of(4)
  x, ids, gates, w1, w2 = layer_inputs(256, D, F, E, 2, "balanced", 2)
  Workspace.reserve(mesh, "expert", layer_sizes(256 // 4, 4, 2, E, D, 4, None))
  for tokens in DECODE_BATCHES:
    y, _ = jmo.moe_experts(x[:tokens], ids[:tokens], gates[:tokens], w1, w2, mesh=mesh)
    if tokens in (4, 100, 256):
      y_ref, _ = jmo.moe_experts(x[:tokens], ids[:tokens], gates[:tokens], w1, w2, mesh=mesh, impl="reference")
      np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  assert len(_workspaces(mesh)) == 1
  # Without the reservation, growing batches allocate one workspace per power-of-two bucket of rows.
  release_workspaces()
  for tokens in DECODE_BATCHES:
    jmo.moe_experts(x[:tokens], ids[:tokens], gates[:tokens], w1, w2, mesh=mesh)
  assert 1 < len(_workspaces(mesh)) <= 7


def test_buckets_round_rows_up_to_a_power_of_two():
  s = WorkspaceSizes(row_bytes=64, recv_rows=33, ret_rows=20, num_segments=8).bucket()
  assert (s.recv_rows, s.ret_rows, s.row_bytes, s.num_segments) == (64, 32, 64, 8)
  assert WorkspaceSizes(64, 0, 1, 8).bucket().recv_rows == 0


def test_release_frees_everything_and_later_calls_allocate_again():
  mesh = mesh_of(2)
  x, ids, gates, w1, w2 = layer_inputs(32, D, F, E, 2, "skewed", 3)
  f = jax.jit(lambda *a: jmo.moe_experts(*a, mesh=mesh)[0])
  y = f(x, ids, gates, w1, w2)
  ahead = f.lower(x, ids, gates, w1, w2).compile()
  y_eager, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh)
  assert release_workspaces() > 0
  assert Workspace.cached() == []
  # The eager cache dropped its program: the next eager call allocates a new workspace and gives the same numbers.
  y_again, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh)
  np.testing.assert_array_equal(y_again, y_eager)
  np.testing.assert_array_equal(y, y_eager)
  assert len(_workspaces(mesh)) == 1
  # The release cleared JAX's caches: the jitted function retraces against the new workspace.
  np.testing.assert_array_equal(f(x, ids, gates, w1, w2), y_eager)
  assert len(_workspaces(mesh)) == 1
  # A program compiled ahead of time keeps the released handle: its call fails naming the fix.
  with pytest.raises(jax.errors.JaxRuntimeError, match="is not live.*must be compiled again"):
    jax.block_until_ready(ahead(x, ids, gates, w1, w2))
  try:
    jax.effects_barrier()  # the failed program's error stays on the runtime token until a barrier takes it
  except jax.errors.JaxRuntimeError:
    pass


def test_release_keeps_a_module_stepped_by_a_compiled_nnx_jit():
  """An nnx.jit step compiled before release_workspaces() runs after it against a new workspace: the module's
  parameters it writes back stay readable and the step's output is unchanged."""
  mesh = mesh_of(2)
  cfg = jmo.MoEConfig(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=2)
  moe = jmo.MoE(cfg, mesh=mesh, rngs=nnx.Rngs(0))
  step = nnx.jit(lambda m, x: m(x)[0])
  x = jax.random.normal(jax.random.key(1), (2, 8, D))
  y = step(moe, x)
  release_workspaces()
  np.testing.assert_array_equal(step(moe, x), y)
  assert np.isfinite(np.asarray(moe.w1[...])).all() and np.isfinite(np.asarray(moe.router[...])).all()
