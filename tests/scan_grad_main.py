"""Run by test_scan.py in a fresh process (a crash of XLA's compiler there fails that test, not pytest's process):
the gradient of a stack of expert layers under ``lax.scan``, each layer routed by its own router from the carry,
against ``impl="reference"``. Usage: scan_grad_main.py IMPL [gpu] (gpu: an expert axis over every visible GPU, a
number dividing 8, instead of 4 virtual CPU devices)."""

import sys

from cpu_flags import set_cpu_flags  # tests/

if sys.argv[2:] != ["gpu"]:
  set_cpu_flags(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_moe_overlap as jmo  # noqa: E402

L, T, D, F, E, K = 2, 16, 32, 64, 8, 2


def loss(impl, mesh):
  def layer(h, params):
    router, w1, w2 = params
    gates, ids = jax.lax.top_k(jax.nn.softmax(h @ router), K)
    y, _ = jmo.moe_experts(h, ids.astype(jnp.int32), gates, w1, w2, mesh=mesh, impl=impl)
    return jnp.tanh(h + y), None

  return lambda x, router, w1, w2: jnp.sum(jnp.cos(jax.lax.scan(layer, x, (router, w1, w2))[0]))


def main():
  impl = sys.argv[1]
  mesh = jax.make_mesh((jax.device_count(),), ("expert",))
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  args = (jax.random.normal(ks[0], (T, D)), jax.random.normal(ks[1], (L, D, E)),
          jax.random.normal(ks[2], (L, E, D, 2 * F)) / np.sqrt(D), jax.random.normal(ks[3], (L, E, F, D)) / np.sqrt(F))
  with jax.set_mesh(mesh):
    got = jax.jit(jax.grad(loss(impl, mesh), argnums=(0, 1, 2, 3)))(*args)
    want = jax.jit(jax.grad(loss("reference", mesh), argnums=(0, 1, 2, 3)))(*args)
  for name, a, b in zip(("x", "router", "w1", "w2"), got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5, err_msg=name)
  print(f"{impl}: match")


if __name__ == "__main__":
  main()
