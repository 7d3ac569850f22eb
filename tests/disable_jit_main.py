"""Run by test_eager.py in a fresh process (XLA:CPU's compiler crashes the process on a workspace call compiled op by
op, so a regression must fail that test alone): impl="overlap" under jax.disable_jit() and the workspace calls in an
eager shard_map.

* moe_experts and MoE (Auto and Explicit meshes) under jax.disable_jit() run their forward program compiled and give
  the reference's result;
* a gradient taken under jax.disable_jit(), whose backward runs op by op, is refused with a ValueError naming the
  fix;
* a workspace call (dispatch) in a shard_map run eagerly, outside jax.jit, is refused with a ValueError naming the fix.
"""

from cpu_flags import set_cpu_flags  # tests/

set_cpu_flags(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_moe_overlap as jmo  # noqa: E402
from cases import layer_inputs  # noqa: E402
from jax_moe_overlap import plan as plan_lib  # noqa: E402
from jax_moe_overlap.call_site import RankInfo  # noqa: E402
from jax_moe_overlap.workspace import Workspace, layer_sizes  # noqa: E402
from jax_moe_overlap.workspace_calls import dispatch  # noqa: E402

T, D, F, E, K = 32, 16, 24, 8, 2


def refused(fn, words):
  try:
    fn()
  except ValueError as e:
    assert words in str(e), str(e)
    return True
  raise AssertionError("not refused")


def main():
  x, ids, gates, w1, w2 = layer_inputs(T, D, F, E, K, "skewed", 1)
  auto = jax.make_mesh((4,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
  explicit = jax.make_mesh((4,), ("expert",), axis_types=(jax.sharding.AxisType.Explicit,))
  y_ref, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=auto, impl="reference")
  with jax.disable_jit():
    y, dropped = jmo.moe_experts(x, ids, gates, w1, w2, mesh=auto)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  assert int(dropped) == 0
  print("moe_experts under disable_jit: match")

  cfg = jmo.MoEConfig(emb_dim=D, moe_mlp_dim=F, num_experts=E, num_experts_per_tok=K, dtype=jnp.float32)
  xs = jax.random.normal(jax.random.PRNGKey(2), (2, 16, D))
  ref = jmo.MoE(cfg, mesh=explicit, impl="reference", rngs=nnx.Rngs(0))
  m = jmo.MoE(cfg, mesh=explicit, rngs=nnx.Rngs(0))
  with jax.disable_jit(), jax.set_mesh(explicit):
    y = m(xs)[0]
  np.testing.assert_allclose(y, nnx.jit(lambda m, x: m(x)[0])(ref, xs), rtol=1e-5, atol=1e-5)
  print("MoE on an Explicit mesh under disable_jit: match")

  def grad_under_disable_jit():
    with jax.disable_jit():
      jax.grad(lambda x: jnp.sum(jmo.moe_experts(x, ids, gates, w1, w2, mesh=auto)[0] ** 2))(x)

  assert refused(grad_under_disable_jit, "take it outside jax.disable_jit()")
  print("grad under disable_jit: refused")

  R = 4
  cap_e = plan_lib.expert_capacity(T // R, R, K, E, None)
  cap = plan_lib.recv_capacity(T // R, R, K, E // R, cap_e)
  info = RankInfo(Workspace.get(auto, "expert", layer_sizes(T // R, R, K, E, D, 4, None)), jmo.CallConfig())

  def local(ids, x):
    counts = plan_lib.local_counts(ids, E).reshape(R, E // R)
    rank = jax.lax.axis_index("expert").astype(jnp.int32)
    plan = plan_lib.make_plan(ids, jax.lax.all_gather(counts, "expert"), rank, cap_e)
    return dispatch(x, jnp.arange(T // R * K, dtype=jnp.int32) // K, plan, cap, info)

  f = jax.shard_map(local, mesh=auto, in_specs=(P("expert"), P("expert")), out_specs=P("expert"), check_vma=False)
  assert jax.jit(f)(ids, x).shape == (R * cap, D)
  assert refused(lambda: f(ids, x), "wrap the shard_map that makes it in jax.jit")
  print("eager shard_map of a workspace call: refused")


if __name__ == "__main__":
  main()
