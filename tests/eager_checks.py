"""Eager (un-jitted) forward, jax.vjp and jax.grad of moe_experts, repeated, against the same calls under jit and
against the dense oracle: shared by test_eager.py (4 CPU devices) and eager_meshes_main.py (8, in a child process).

An eager jax.vjp runs the layer as separately dispatched programs (the forward with its residuals, then the
backward), each holding XLA collectives beside the workspace calls, which therefore must not wait on XLA's threads
(ffi/cpu/async_call.h); each call is repeated because a thread pool that runs out does so at random."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_moe_overlap as jmo
from batch_axes_checks import mesh_of_shape
from cases import layer_inputs

E, D, F, K = 8, 32, 32, 2


CALLS = ("forward", "vjp", "grad")


def check_eager_calls(shape: dict[str, int], impl: str, calls=CALLS, repeats: int = 3, tokens: int = 128,
                      seed: int = 0) -> None:
  """Eager `calls` (forward, jax.vjp, jax.grad) of the layer on a mesh of `shape` (the axis "expert" and batch axes),
  tokens sharded over all its axes, each call `repeats` times: every repeat bitwise equal to the first, the first
  equal to the jitted call (bitwise for the forward, to float32 rounding for the gradients: the eager backward is its
  own program) and to the dense oracle."""
  mesh = mesh_of_shape(shape)
  batch_axes = tuple(a for a in shape if a != "expert")
  x, ids, gates, w1, w2 = layer_inputs(tokens, D, F, E, K, "skewed", seed)
  tokens_spec = NamedSharding(mesh, P((*batch_axes, "expert")))
  x, ids, gates = (jax.device_put(a, tokens_spec) for a in (x, ids, gates))
  dy = jax.device_put(jnp.cos(jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape)), tokens_spec)

  def layer(impl):
    return lambda x, g, w1, w2: jmo.moe_experts(x, ids, g, w1, w2, mesh=mesh, impl=impl, batch_axes=batch_axes)

  def vjp_of(fn):
    def run(x, g, w1, w2):
      (y, dropped), pullback = jax.vjp(fn, x, g, w1, w2)
      return y, dropped, pullback((dy, np.zeros((), jax.dtypes.float0)))
    return run

  def grad_of(fn):
    return jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a)[0])), argnums=(0, 1, 2, 3))

  wrap = {"forward": lambda fn: fn, "vjp": vjp_of, "grad": grad_of}
  where = f"{shape} impl={impl}"
  for name in calls:
    call, oracle = wrap[name](layer(impl)), wrap[name](layer("reference"))
    first = jax.block_until_ready(call(x, gates, w1, w2))
    for _ in range(repeats - 1):
      again = jax.block_until_ready(call(x, gates, w1, w2))
      for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b, err_msg=f"{where}: eager {name} repeated")
    jitted = jax.jit(call)(x, gates, w1, w2)
    expected = jax.jit(oracle)(x, gates, w1, w2)
    for a, b, c in zip(jax.tree.leaves(first), jax.tree.leaves(jitted), jax.tree.leaves(expected)):
      if name == "forward":
        np.testing.assert_array_equal(a, b, err_msg=f"{where}: eager {name} against jit")
      else:
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=f"{where}: eager {name} against jit")
      np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-5, err_msg=f"{where}: eager {name} against the oracle")
    if name == "forward":
      y, dropped = first
      assert float(jnp.max(jnp.abs(y))) > 0.1, where
      assert int(dropped) == 0, where  # dropless
      assert {s.data.shape[0] for s in y.addressable_shards} == {tokens // math.prod(shape.values())}, where
