"""vmap over the custom calls: each batch element runs as its own call (vmap_method="sequential" and the ordered
workspace primitive's batching rule), with the results of a loop of unbatched calls."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from cases import mesh_of, routing
from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap.call_site import RankInfo
from jax_moe_overlap.config import CallConfig
from jax_moe_overlap.grouped_gemm import grouped_matmul, grouped_outer
from jax_moe_overlap.workspace import Workspace, layer_sizes
from jax_moe_overlap.workspace_calls import dispatch, expert_combine


def test_vmap_of_the_workspace_calls_equals_a_loop():
  # dispatch and expert_combine under vmap inside shard_map: each batch element is one call (one epoch) on every
  # rank, in the same order. (The whole layer under vmap:
  # test_collective.test_vmap_equals_the_reference_per_batch_element.)
  R, T, K, N, E_, B = 4, 16, 16, 8, 8, 3
  mesh = mesh_of(R)
  cap_e = plan_lib.expert_capacity(T, R, 2, E_, None)
  cap = plan_lib.recv_capacity(T, R, 2, E_ // R, cap_e)
  info = RankInfo(Workspace.get(mesh, "expert", layer_sizes(T, R, 2, E_, K, 4, None)), CallConfig(timeout_ms=5000))
  ids_all = jnp.asarray(routing("skewed", R * T, E_, 2, 3))
  gates_all = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(1), (R * T, 2)), axis=-1)
  xs_all = jax.random.normal(jax.random.PRNGKey(2), (B, R * T, K))
  w_all = jax.random.normal(jax.random.PRNGKey(3), (E_, K, N))

  def local(ids, gates, xs, w, batched):
    rank = jax.lax.axis_index("expert").astype(jnp.int32)
    counts = plan_lib.local_counts(ids, E_).reshape(R, E_ // R)
    plan = plan_lib.make_plan(ids, jax.lax.all_gather(counts, "expert"), rank, cap_e)
    slot_src_row = jnp.arange(T * 2, dtype=jnp.int32) // 2

    def one(x):
      recv = dispatch(x, slot_src_row, plan, cap, info)
      return expert_combine(recv[:, :K], w, gates, plan, info, want_slots=False)[0]

    return jax.vmap(one)(xs) if batched else jnp.stack([one(xs[b]) for b in range(B)])

  outs = {}
  for batched in (True, False):
    fn = jax.jit(jax.shard_map(functools.partial(local, batched=batched), mesh=mesh,
                               in_specs=(P("expert"), P("expert"), P(None, "expert"), P("expert")),
                               out_specs=P(None, "expert"), check_vma=False))
    outs[batched] = fn(ids_all, gates_all, xs_all, w_all)
  assert float(jnp.max(jnp.abs(outs[False]))) > 0.1
  np.testing.assert_array_equal(outs[True], outs[False])


def test_vmap_of_the_grouped_gemms_equals_a_loop():
  key = jax.random.split(jax.random.PRNGKey(0), 3)
  lhs = jax.random.normal(key[0], (3, 20, 8))
  rhs = jax.random.normal(key[1], (4, 8, 6))
  sizes = jnp.array([[5, 0, 7, 8], [1, 2, 3, 4], [20, 0, 0, 0]], jnp.int32)
  out = jax.vmap(lambda a, s: grouped_matmul(a, rhs, s))(lhs, sizes)
  outer = jax.vmap(lambda a, s: grouped_outer(a, a, s))(lhs, sizes)
  for b in range(3):
    np.testing.assert_array_equal(out[b], grouped_matmul(lhs[b], rhs, sizes[b]))
    np.testing.assert_array_equal(outer[b], grouped_outer(lhs[b], lhs[b], sizes[b]))
