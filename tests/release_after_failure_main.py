"""Run by test_eager.py in a fresh process (a failed program's error stays on JAX's runtime tokens of the process):
a layer program compiled ahead of time whose workspace was released fails when called again (it names a handle that
is no longer live), and the next ``release_workspaces`` then still frees the new workspace, warning about that failure instead of
raising it a second time; a later layer call works and matches the first."""

import warnings

from cpu_flags import set_cpu_flags  # tests/

set_cpu_flags(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_moe_overlap as jmo  # noqa: E402

T, D, F, E, K = 32, 64, 128, 8, 2


def main():
  ks = jax.random.split(jax.random.PRNGKey(0), 5)
  x = jax.random.normal(ks[0], (T, D))
  ids = jnp.argsort(jax.random.uniform(ks[1], (T, E)), axis=1)[:, :K].astype(jnp.int32)
  gates = jax.nn.softmax(jax.random.normal(ks[2], (T, K)), -1)
  w1 = jax.random.normal(ks[3], (E, D, 2 * F)) / 8
  w2 = jax.random.normal(ks[4], (E, F, D)) / 8
  mesh = jax.make_mesh((4,), ("expert",))
  f = jax.jit(lambda x: jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh)[0])
  y0 = np.asarray(f(x))
  ahead = f.lower(x).compile()
  jmo.release_workspaces()
  y1, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh)  # eager: a new workspace
  try:
    jax.block_until_ready(ahead(x))  # compiled against the released one
    raise AssertionError("a program of a released workspace ran")
  except jax.errors.JaxRuntimeError as e:
    assert "not live" in str(e), e
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    freed = jmo.release_workspaces()
  assert freed > 0 and not jmo.Workspace.cached(), freed
  assert any("after a program that failed" in str(w.message) for w in seen), [str(w.message) for w in seen]
  y2, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh)
  np.testing.assert_array_equal(np.asarray(y1), y0)
  np.testing.assert_array_equal(np.asarray(y2), y0)
  print("released after a failure")


if __name__ == "__main__":
  main()
