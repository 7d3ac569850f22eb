"""Inputs for the MoE tests: random tokens and weights, and routings with known shapes of load."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe_overlap as jmo

ROUTINGS = ("balanced", "skewed", "all_to_one", "empty_experts")


def moe_config(**kwargs) -> jmo.MoEConfig:
  """A ``MoEConfig`` that computes in float32 unless kwargs say otherwise (the library's default is bfloat16), so
  that the layer can be held to float32 tolerances against the float32 reference."""
  return jmo.MoEConfig(**{"dtype": jnp.float32, **kwargs})


def mesh_of(n: int, axis: str = "expert") -> jax.sharding.Mesh:
  """A 1-D mesh over the first n CPU devices."""
  devs = np.array(jax.devices("cpu")[:n])
  return jax.sharding.Mesh(devs, (axis,), axis_types=(jax.sharding.AxisType.Auto,))


def routing(kind: str, tokens: int, num_experts: int, k: int, seed: int, ranks: int = 1) -> np.ndarray:
  """[tokens, k] int32 expert ids, distinct within each token (``ranks``: the expert-parallel size, for "one_rank")."""
  rng = np.random.default_rng(seed)
  if kind == "balanced":
    base = rng.permutation(tokens)
    return ((base[:, None] + np.arange(k)[None, :] * max(1, num_experts // k)) % num_experts).astype(np.int32)
  if kind == "skewed":
    p = 1.0 / (np.arange(num_experts) + 1.0) ** 1.5
    p /= p.sum()
    return np.stack([rng.choice(num_experts, k, replace=False, p=p) for _ in range(tokens)]).astype(np.int32)
  if kind == "all_to_one":
    # Every token picks the same k experts: one destination rank receives everything.
    return np.tile(np.arange(k, dtype=np.int32)[::-1], (tokens, 1))
  if kind == "empty_experts":
    # Only the first half of the experts are ever chosen: whole ranks' experts get no tokens.
    half = num_experts // 2
    assert k <= half
    return np.stack([rng.choice(half, k, replace=False) for _ in range(tokens)]).astype(np.int32)
  if kind == "one_rank":
    # Every token picks k random experts among those of the last of `ranks` ranks: that rank receives every row,
    # from every rank (at ranks = 1, any k experts).
    local = num_experts // ranks
    assert k <= local
    return ((ranks - 1) * local + np.stack([rng.permutation(local)[:k] for _ in range(tokens)])).astype(np.int32)
  raise ValueError(kind)


def layer_inputs(tokens: int, d: int, f: int, num_experts: int, k: int, kind: str, seed: int,
                 dtype=jnp.float32, ranks: int = 1):
  """x [T, D], ids [T, k], gates [T, k] (positive, rows sum to 1), w1 [E, D, 2F], w2 [E, F, D]; never zeros. Drawn
  with NumPy: jax.random would compile a program for every new shape, in every test that asks for one."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((tokens, d), np.float32)
  logits = rng.standard_normal((tokens, k), np.float32)
  gates = np.exp(logits - logits.max(axis=-1, keepdims=True))
  gates /= gates.sum(axis=-1, keepdims=True)
  w1 = rng.standard_normal((num_experts, d, 2 * f), np.float32) / np.float32(np.sqrt(d))
  w2 = rng.standard_normal((num_experts, f, d), np.float32) / np.float32(np.sqrt(f))
  ids = routing(kind, tokens, num_experts, k, seed, ranks)
  return (jnp.asarray(x.astype(dtype)), jnp.asarray(ids), jnp.asarray(gates), jnp.asarray(w1.astype(dtype)),
          jnp.asarray(w2.astype(dtype)))


def rel_err(a, b) -> float:
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
