"""Checkpoint converters: bit-exact round trips through MaxText's and the per-expert layouts, restores into the
sharded NNX state, and the per-expert orientation checked by computing one expert's output in NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_moe_overlap as jmo
from jax_moe_overlap import checkpoint
from cases import mesh_of, rel_err

CFG = jmo.MoEConfig(emb_dim=16, moe_mlp_dim=12, num_experts=8, num_experts_per_tok=2, routed_score_func="sigmoid",
                    routed_bias=True, shared_experts=1, dtype=jnp.float32, weight_dtype=jnp.bfloat16)
AXIS_TYPES = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}


def _mesh(axis_type):
  """The README's mesh, ``jax.make_mesh((4,), ("expert",))``, with the given axis type (Explicit: jax's default)."""
  return jax.make_mesh((4,), ("expert",), axis_types=(AXIS_TYPES[axis_type],))


def _module(seed, cfg=CFG, axis_type="auto"):
  return jmo.MoE(cfg, mesh=_mesh(axis_type), impl="xla", rngs=nnx.Rngs(seed))


def _same_bits(a, b):
  a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
  assert a.dtype == b.dtype and a.shape == b.shape
  np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
@pytest.mark.parametrize("layout", ["maxtext", "per_expert"])
def test_round_trip_and_restore(layout, axis_type):
  src, dst = _module(0, axis_type=axis_type), _module(1, axis_type=axis_type)
  dst.routing_bias[...] = jnp.ones(8)
  src.routing_bias[...] = jax.random.normal(jax.random.PRNGKey(9), (8,))
  params = checkpoint.params_of(src)
  assert sorted(params) == sorted(checkpoint.NAMES)
  if layout == "maxtext":
    mt = checkpoint.to_maxtext(params)
    assert mt["wi_0"].shape == (8, 16, 12) and mt["gate"]["kernel"].shape == (16, 8)
    back = checkpoint.from_maxtext(mt)
  else:
    flat = checkpoint.to_per_expert(params, prefix="model.layers.1.mlp.")
    assert flat["model.layers.1.mlp.experts.3.gate_proj.weight"].shape == (12, 16)
    assert flat["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (16, 12)
    assert flat["model.layers.1.mlp.gate.weight"].shape == (8, 16)
    flat["model.layers.2.mlp.gate.weight"] = np.zeros((8, 16))  # another layer's tensors are ignored
    back = checkpoint.from_per_expert(flat, prefix="model.layers.1.mlp.")
  for name in params:
    _same_bits(back[name], params[name])
  checkpoint.load_params(dst, back)
  for name, value in checkpoint.params_of(dst).items():
    _same_bits(value, params[name])
  mesh = dst.mesh
  assert dst.w1[...].sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, jax.P("expert")), 3)
  assert dst.router[...].sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, jax.P()), 2)
  x = jax.random.normal(jax.random.PRNGKey(3), (32, 16))
  forward = nnx.jit(lambda m, x: m(x)[0])
  checkpoint.load_params(src, params)  # placed on the mesh as dst, so that one compiled step serves both
  np.testing.assert_array_equal(np.asarray(forward(dst, x)), np.asarray(forward(src, x)))


def test_per_expert_orientation():
  """A layer loaded from per-expert [out, in] tensors computes what those tensors mean in PyTorch's convention."""
  cfg = jmo.MoEConfig(emb_dim=16, moe_mlp_dim=12, num_experts=4, num_experts_per_tok=1, norm_topk_prob=False)
  rng = np.random.default_rng(0)
  t = {"gate.weight": rng.normal(size=(4, 16)).astype(np.float32)}
  for i in range(4):
    t[f"experts.{i}.gate_proj.weight"] = rng.normal(size=(12, 16)).astype(np.float32) / 4
    t[f"experts.{i}.up_proj.weight"] = rng.normal(size=(12, 16)).astype(np.float32) / 4
    t[f"experts.{i}.down_proj.weight"] = rng.normal(size=(16, 12)).astype(np.float32) / 4
  m = jmo.MoE(cfg, mesh=mesh_of(4), impl="reference", rngs=nnx.Rngs(0))
  checkpoint.load_params(m, checkpoint.from_per_expert(t))
  x = rng.normal(size=(8, 16)).astype(np.float32)
  y, _ = m(jnp.asarray(x))
  logits = x @ t["gate.weight"].T
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  want = np.zeros_like(x, np.float64)
  for n in range(8):
    e = int(np.argmax(p[n]))
    g, u = t[f"experts.{e}.gate_proj.weight"] @ x[n], t[f"experts.{e}.up_proj.weight"] @ x[n]
    want[n] = p[n, e] * (t[f"experts.{e}.down_proj.weight"] @ (g / (1 + np.exp(-g)) * u))
  assert rel_err(y, want) < 1e-5


def test_load_rejects_mismatches():
  m = _module(0)
  params = checkpoint.params_of(m)
  with pytest.raises(ValueError, match="the module has"):
    checkpoint.load_params(m, {k: v for k, v in params.items() if k != "shared_w1"})
  with pytest.raises(ValueError, match=r"w2 has shape \(8, 12, 16\)"):
    checkpoint.load_params(m, {**params, "w2": params["w2"][:, :6]})
  with pytest.raises(ValueError, match="numbered 0..E-1"):
    flat = checkpoint.to_per_expert(params)
    del flat["experts.2.gate_proj.weight"]
    checkpoint.from_per_expert(flat)
