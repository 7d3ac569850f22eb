"""Edge shapes drawn at random (fixed seed): tiny token counts, one expert per rank, k = E, odd widths, capacity of a
single row. Forward and gradients of impl="overlap" must equal impl="reference" on every one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe_overlap as jmo
from cases import mesh_of


def _configs(n=10, seed=1234):
  rng = np.random.default_rng(seed)
  out = [dict(R=4, T=1, E=4, k=4, D=3, F=5, cf=None),     # one token per rank, every expert chosen
         dict(R=4, T=2, E=4, k=1, D=7, F=1, cf=0.01),     # capacity of one row per expert
         dict(R=1, T=5, E=1, k=1, D=9, F=2, cf=None)]     # a single expert
  while len(out) < n:
    R = int(rng.choice([1, 2, 4]))
    E = R * int(rng.integers(1, 5))
    out.append(dict(R=R, T=int(rng.integers(1, 40)), E=E, k=int(rng.integers(1, E + 1)),
                    D=int(rng.integers(1, 33)), F=int(rng.integers(1, 33)),
                    cf=[None, 0.5, 1.0, 2.0][int(rng.integers(0, 4))]))
  return out


HAND_PICKED = 3  # the first configs; the random draws after them run in the slow pass (each compiles its programs)


@pytest.mark.parametrize("cfg", [pytest.param(c, marks=() if i < HAND_PICKED else pytest.mark.slow)
                                 for i, c in enumerate(_configs())],
                         ids=lambda c: "R{R}-T{T}-E{E}-k{k}-D{D}-F{F}-cf{cf}".format(**c))
def test_edge_shapes_match_reference(cfg):
  R, T, E, k, D, F, cf = (cfg[n] for n in ("R", "T", "E", "k", "D", "F", "cf"))
  mesh = mesh_of(R)
  rng = np.random.default_rng(T * 131 + E * 7 + k)
  tokens = T * R
  ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(tokens)]).astype(np.int32))
  ks = jax.random.split(jax.random.PRNGKey(T + D), 4)
  x = jax.random.normal(ks[0], (tokens, D))
  gates = jax.nn.softmax(jax.random.normal(ks[1], (tokens, k)), axis=-1)
  w1 = jax.random.normal(ks[2], (E, D, 2 * F)) / np.sqrt(D)
  w2 = jax.random.normal(ks[3], (E, F, D)) / np.sqrt(F)

  def run(impl):
    def loss(x, g, w1, w2):
      y, dropped = jmo.moe_experts(x, ids, g, w1, w2, mesh=mesh, capacity_factor=cf, impl=impl)
      return jnp.sum(jnp.cos(y) * (1 + jnp.arange(y.size).reshape(y.shape) % 3)), (y, dropped)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, gates, w1, w2)

  (_, (y, dropped)), grads = run("overlap")
  (_, (y_ref, dropped_ref)), grads_ref = run("reference")
  assert int(dropped) == int(dropped_ref)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for g, g_ref in zip(grads, grads_ref):
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5)
