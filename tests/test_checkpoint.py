"""Checkpoint converters: bit-exact round trips through every layout and style, restores into the sharded NNX state
on meshes of both axis types, each published orientation checked by computing the layer in NumPy from the published
tensors as the published code reads them, every tensor given either converted or refused by name, and the published
load-balance losses' scale against this library's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_moe_overlap as jmo
from jax_moe_overlap import checkpoint
from cases import rel_err

SIZES = dict(emb_dim=16, moe_mlp_dim=12, num_experts=8, num_experts_per_tok=2, dtype=jnp.float32,
             weight_dtype=jnp.bfloat16)
# One configuration per published naming, each with every parameter that naming has.
CONFIGS = {
    "deepseek": jmo.MoEConfig(**SIZES, routed_score_func="sigmoid", routed_bias=True, shared_experts=1),
    "qwen2_moe": jmo.MoEConfig(**SIZES, norm_topk_prob=False, shared_experts=1, shared_mlp_dim=20,
                               shared_expert_gate=True),
    "mixtral": jmo.MoEConfig(**SIZES),
}
LAYOUTS = ["maxtext"] + [f"{fmt}-{style}" for fmt in ("per_expert", "transformers") for style in CONFIGS]
AXIS_TYPES = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}


def _mesh(axis_type):
  """The README's mesh, ``jax.make_mesh((4,), ("expert",))``, with the given axis type (Explicit: jax's default)."""
  return jax.make_mesh((4,), ("expert",), axis_types=(AXIS_TYPES[axis_type],))


def _module(seed, cfg=CONFIGS["deepseek"], axis_type="auto"):
  return jmo.MoE(cfg, mesh=_mesh(axis_type), impl="xla", rngs=nnx.Rngs(seed))


def _same_bits(a, b):
  a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
  assert a.dtype == b.dtype and a.shape == b.shape
  np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def _there_and_back(layout, params):
  """params -> the layout -> params, checking a few of the layout's names and shapes on the way."""
  if layout == "maxtext":
    mt = checkpoint.to_maxtext(params)
    assert mt["wi_0"].shape == (8, 16, 12) and mt["gate"]["kernel"].shape == (16, 8)
    return checkpoint.from_maxtext(mt)
  fmt, style = layout.split("-")
  prefix = "model.layers.1.block_sparse_moe." if layout == "per_expert-mixtral" else "model.layers.1.mlp."
  to, back = {"per_expert": (checkpoint.to_per_expert, checkpoint.from_per_expert),
              "transformers": (checkpoint.to_transformers, checkpoint.from_transformers)}[fmt]
  flat = to(params, prefix=prefix, style=style)
  assert flat[f"{prefix}gate.weight"].shape == (8, 16)
  if fmt == "per_expert":
    gate, up, down = checkpoint.STYLES[style].expert_projections
    assert flat[f"{prefix}experts.3.{gate}.weight"].shape == (12, 16)
    assert flat[f"{prefix}experts.3.{up}.weight"].shape == (12, 16)
    assert flat[f"{prefix}experts.3.{down}.weight"].shape == (16, 12)
  else:
    assert flat[f"{prefix}experts.gate_up_proj"].shape == (8, 24, 16)
    assert flat[f"{prefix}experts.down_proj"].shape == (8, 16, 12)
  if style == "qwen2_moe":
    assert flat[f"{prefix}shared_expert.down_proj.weight"].shape == (16, 20)
    assert flat[f"{prefix}shared_expert_gate.weight"].shape == (1, 16)
  flat["model.layers.2.mlp.gate.weight"] = np.zeros((8, 16))  # another layer's tensors are ignored
  return back(flat, prefix=prefix)


# One jitted forward for every case: a configuration and axis type that several layouts share compile it once.
_FORWARD = nnx.jit(lambda m, x: m(x)[0])


# Every layout on Explicit axes in the default pass, and on Auto axes the layouts of the deepseek configuration (every
# parameter; one compiled forward serves them); the qwen2_moe and mixtral layouts on Auto axes (a compiled forward each)
# in the slow pass.
def _round_trip_marks(layout, axis_type):
  slow = axis_type == "auto" and layout not in ("maxtext", "per_expert-deepseek", "transformers-deepseek")
  return pytest.mark.slow if slow else ()


@pytest.mark.parametrize("layout,axis_type", [pytest.param(layout, axis, marks=_round_trip_marks(layout, axis))
                                              for layout in LAYOUTS for axis in sorted(AXIS_TYPES)])
def test_round_trip_and_restore(layout, axis_type):
  cfg = CONFIGS["deepseek" if layout == "maxtext" else layout.split("-")[1]]
  src, dst = _module(0, cfg, axis_type), _module(1, cfg, axis_type)
  if cfg.routed_bias:
    bias = src.routing_bias[...]   # on the mesh from creation: the value written goes there too (Explicit axes)
    src.routing_bias[...] = jax.device_put(jax.random.normal(jax.random.PRNGKey(9), (8,)), bias.sharding)
  params = checkpoint.params_of(src)
  assert sorted(params) == sorted(n for n in checkpoint.NAMES if getattr(src, n) is not None)
  back = _there_and_back(layout, params)
  assert sorted(back) == sorted(params)
  for name in params:
    _same_bits(back[name], params[name])
  checkpoint.load_params(dst, back)
  for name, value in checkpoint.params_of(dst).items():
    _same_bits(value, params[name])
  mesh = dst.mesh
  assert dst.w1[...].sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, jax.P("expert")), 3)
  assert dst.router[...].sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, jax.P()), 2)
  x = jax.random.normal(jax.random.PRNGKey(3), (32, 16))
  checkpoint.load_params(src, params)  # placed on the mesh as dst, so that one compiled step serves both
  np.testing.assert_array_equal(np.asarray(_FORWARD(dst, x)), np.asarray(_FORWARD(src, x)))


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
def test_tensor_parallel_module_round_trips(axis_type):
  # A module with a tensor axis keeps w1 as its [E, D, 2, F] view: every converter takes it and gives [E, D, 2F]
  # with the same bits, and load_params puts it back sharded over (expert, -, -, tensor), or into a module without
  # a tensor axis (and that one's checkpoint into the tensor-parallel one).
  types = (AXIS_TYPES[axis_type],) * 2
  mesh = jax.make_mesh((2, 2), ("expert", "tensor"), axis_types=types)
  cfg = CONFIGS["deepseek"]
  src, dst = (jmo.MoE(cfg, mesh=mesh, tensor_axis="tensor", impl="xla", rngs=nnx.Rngs(s)) for s in (0, 1))
  plain = _module(2, cfg, axis_type)
  params = checkpoint.params_of(src)
  assert params["w1"].shape == (8, 16, 2, 12)
  whole_w1 = np.asarray(params["w1"]).reshape(8, 16, 24)
  for layout in ("maxtext", "per_expert-deepseek", "transformers-deepseek"):
    back = _there_and_back(layout, params)
    _same_bits(back["w1"], whole_w1)
    for name in params:
      if name != "w1":
        _same_bits(back[name], params[name])
  checkpoint.load_params(dst, back)
  assert dst.w1[...].sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, jax.P("expert", None, None,
                                                                                      "tensor")), 4)
  assert dst.w2[...].sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, jax.P("expert", "tensor")), 3)
  for name, value in checkpoint.params_of(dst).items():
    _same_bits(value, params[name])
  checkpoint.load_params(plain, params)                     # the view into a module that keeps [E, D, 2F]
  _same_bits(plain.w1[...], whole_w1)
  checkpoint.load_params(dst, checkpoint.params_of(plain))  # and back
  _same_bits(dst.w1[...], params["w1"])


def _published(naming, rng):
  """One layer's random float32 tensors in a published naming, with the projections each expert applies as its
  published code reads them: (tensors, prefix, experts) with experts[e] = (gate [F, D], up [F, D], down [D, F])
  as torch Linear weights."""
  E, D, F = 4, 16, 12
  experts = [tuple(rng.normal(size=s).astype(np.float32) / 4 for s in ((F, D), (F, D), (D, F))) for _ in range(E)]
  router = rng.normal(size=(E, D)).astype(np.float32)
  if naming == "transformers":  # transformers 5.x: gate, up = linear(x, gate_up_proj[e]).chunk(2); linear(h, down_proj[e])
    prefix = "model.layers.0.mlp."
    t = {"experts.gate_up_proj": np.stack([np.concatenate([g, u], 0) for g, u, _ in experts]),
         "experts.down_proj": np.stack([d for _, _, d in experts])}
  elif naming == "mixtral":  # Mixtral: w2(silu(w1(x)) * w3(x))
    prefix = "model.layers.0.block_sparse_moe."
    t = {f"experts.{i}.{n}.weight": w for i, (g, u, d) in enumerate(experts) for n, w in (("w1", g), ("w3", u),
                                                                                          ("w2", d))}
  else:  # DeepSeek-V3, Qwen2/3-MoE: down_proj(silu(gate_proj(x)) * up_proj(x))
    prefix = "model.layers.0.mlp."
    t = {f"experts.{i}.{n}_proj.weight": w for i, (g, u, d) in enumerate(experts)
         for n, w in (("gate", g), ("up", u), ("down", d))}
  t["gate.weight"] = router
  return {prefix + k: v for k, v in t.items()}, prefix, experts


@pytest.mark.parametrize("naming", ["per_expert", "mixtral", "transformers"])
def test_published_orientation(naming):
  """A layer loaded from published tensors computes what those tensors mean in the published (PyTorch) code."""
  rng = np.random.default_rng(0)
  tensors, prefix, experts = _published(naming, rng)
  cfg = jmo.MoEConfig(emb_dim=16, moe_mlp_dim=12, num_experts=4, num_experts_per_tok=1, norm_topk_prob=False,
                      dtype=jnp.float32, weight_dtype=jnp.float32)
  m = jmo.MoE(cfg, mesh=_mesh("explicit"), impl="reference", rngs=nnx.Rngs(0))
  convert = checkpoint.from_transformers if naming == "transformers" else checkpoint.from_per_expert
  checkpoint.load_params(m, convert(tensors, prefix=prefix))
  x = rng.normal(size=(8, 16)).astype(np.float32)
  y, _ = m(jnp.asarray(x))
  logits = x @ tensors[prefix + "gate.weight"].T
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  want = np.zeros_like(x, np.float64)
  for n in range(8):
    e = int(np.argmax(p[n]))
    gate, up, down = experts[e]
    g, u = gate @ x[n], up @ x[n]
    want[n] = p[n, e] * (down @ (g / (1 + np.exp(-g)) * u))
  assert rel_err(y, want) < 1e-5


def test_load_rejects_mismatches():
  m = _module(0)
  params = checkpoint.params_of(m)
  with pytest.raises(ValueError, match="the module has"):
    checkpoint.load_params(m, {k: v for k, v in params.items() if k != "shared_w1"})
  with pytest.raises(ValueError, match=r"w2 has shape \(8, 12, 16\)"):
    checkpoint.load_params(m, {**params, "w2": params["w2"][:, :6]})


@pytest.mark.parametrize("axis_type", ["explicit", pytest.param("auto", marks=pytest.mark.slow)])  # ~10 s each
def test_fp8_module_round_trips(axis_type):
  """A quantization="fp8" block (master weights in bfloat16) through the published per-expert layout into a fresh
  one: its whole NNX state the same bits (the parameters and the routing bias, which a training call has moved: no
  other state), and the same output bits. The same parameters restore into an unquantized block (the module
  docstring's rule)."""
  cfg = dataclasses.replace(CONFIGS["deepseek"], emb_dim=128, moe_mlp_dim=128, routed_bias_update_rate=1e-3,
                            dtype=jnp.bfloat16, quantization="fp8")
  mesh = _mesh(axis_type)
  x = jax.device_put(jax.random.normal(jax.random.PRNGKey(3), (4, 16, 128)).astype(jnp.bfloat16),
                     jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("expert")))
  forward = nnx.jit(lambda m, x: m(x))
  a, b = (jmo.MoEBlock(cfg, mesh=mesh, impl="xla", rngs=nnx.Rngs(seed)) for seed in (0, 1))
  forward(a, x)                                   # training mode: the routing bias moves from zero
  a.deterministic = b.deterministic = True
  assert np.any(np.asarray(a.routing_bias[...]))
  flat = checkpoint.to_per_expert(checkpoint.params_of(a), prefix="model.layers.0.mlp.")
  checkpoint.load_params(b, checkpoint.from_per_expert(flat, prefix="model.layers.0.mlp."))
  state_a, state_b = (nnx.to_flat_state(nnx.state(m)) for m in (a, b))
  assert [path for path, _ in state_a] == [path for path, _ in state_b]
  assert {type(v).__name__ for _, v in state_a} == {"Param", "RoutingBias"}
  for (_, va), (_, vb) in zip(state_a, state_b):
    _same_bits(np.asarray(va[...]), np.asarray(vb[...]))
  y = forward(a, x)
  assert float(jnp.max(jnp.abs(y.astype(jnp.float32)))) > 0
  _same_bits(np.asarray(y), np.asarray(forward(b, x)))
  plain = jmo.MoEBlock(dataclasses.replace(cfg, quantization=None), mesh=mesh, impl="xla", rngs=nnx.Rngs(2))
  checkpoint.load_params(plain, checkpoint.params_of(a))
  for name, value in checkpoint.params_of(plain).items():
    _same_bits(np.asarray(value), np.asarray(checkpoint.params_of(a)[name]))


def test_pre_quantized_weights_are_refused_by_name():
  """The module and the converters hold master weights (float arrays); a pre-quantized Fp8Weight given for one is
  refused with a TypeError naming it, not a failed conversion inside NumPy."""
  m = _module(0, dataclasses.replace(CONFIGS["mixtral"], emb_dim=128, moe_mlp_dim=128, quantization="fp8"))
  params = checkpoint.params_of(m)
  q1, _ = jmo.quantize_weights(params["w1"], params["w2"])
  rule = r"{}: w1 is a pre-quantized Fp8Weight; MoE's parameters are the master weights, float arrays"
  with pytest.raises(TypeError, match=rule.format("load_params")):
    checkpoint.load_params(m, {**params, "w1": q1})
  for convert in (checkpoint.to_maxtext, checkpoint.to_per_expert, checkpoint.to_transformers):
    with pytest.raises(TypeError, match=rule.format(convert.__name__)):
      convert({**params, "w1": q1})


def _qwen2_flat(prefix="mlp."):
  m = _module(0, CONFIGS["qwen2_moe"])
  return checkpoint.to_per_expert(checkpoint.params_of(m), prefix=prefix, style="qwen2_moe")


def test_converters_take_every_tensor_or_name_it():
  flat = _qwen2_flat()
  back = checkpoint.from_per_expert(flat, prefix="mlp.")
  assert {"shared_w1", "shared_w2", "shared_expert_gate"} <= set(back)  # Qwen2-MoE's singular shared expert
  for extra in ("mlp.experts.0.gate_proj.weight_scale_inv", "mlp.input_layernorm.weight", "mlp.experts.8.w9.weight"):
    with pytest.raises(ValueError, match="no rule converts " + extra[len("mlp."):].replace(".", r"\.")):
      checkpoint.from_per_expert({**flat, extra: np.ones((2,), np.float32)}, prefix="mlp.")
  hf = checkpoint.to_transformers(checkpoint.params_of(_module(0, CONFIGS["qwen2_moe"])), "mlp.", "qwen2_moe")
  with pytest.raises(ValueError, match=r"no rule converts experts\.bias"):
    checkpoint.from_transformers({**hf, "mlp.experts.bias": np.ones((2,), np.float32)}, prefix="mlp.")
  mt = checkpoint.to_maxtext(checkpoint.params_of(_module(0)))
  with pytest.raises(ValueError, match="no rule converts shared_experts/wi_0/bias"):
    checkpoint.from_maxtext({**mt, "shared_experts": {**mt["shared_experts"], "wi_0": {
        "kernel": mt["shared_experts"]["wi_0"]["kernel"], "bias": np.ones((2,))}}})


def test_converter_errors_say_what_they_found():
  flat = _qwen2_flat()
  no_expert_2 = {k: v for k, v in flat.items() if k != "mlp.experts.2.gate_proj.weight"}
  with pytest.raises(ValueError, match=r"numbered 0\.\.7 .*gate_proj: \[0, 1, 3, 4, 5, 6, 7\]; up_proj: \[0, 1, 2, "):
    checkpoint.from_per_expert(no_expert_2, prefix="mlp.")
  mixtral = {k.replace("mlp.", "model.layers.0.block_sparse_moe."): v
             for k, v in checkpoint.to_per_expert(checkpoint.params_of(_module(0, CONFIGS["mixtral"])), "mlp.",
                                                  "mixtral").items()}
  mixtral["model.embed_tokens.weight"] = np.ones((4, 16), np.float32)
  with pytest.raises(ValueError, match=r"no tensor is named under the prefix 'model\.layers\.0\.mlp\.'; the names "
                                       r"under 'model\.layers\.0\.': model\.layers\.0\.block_sparse_moe\."):
    checkpoint.from_per_expert(mixtral, prefix="model.layers.0.mlp.")
  with pytest.raises(ValueError, match=r"Mixtral's experts.*found \['down_proj', 'gate_proj', 'up_proj', 'w1'\]"):
    checkpoint.from_per_expert({**flat, "mlp.experts.0.w1.weight": np.ones((12, 16))}, prefix="mlp.")
  with pytest.raises(ValueError, match="both DeepSeek-V3's shared_experts"):
    checkpoint.from_per_expert({**flat, "mlp.shared_experts.up_proj.weight": np.ones((20, 16))}, prefix="mlp.")
  no_shared = {k: v for k, v in flat.items() if not k.startswith("mlp.shared_expert.")}
  with pytest.raises(ValueError, match="shared_expert_gate.weight is given without a shared expert"):
    checkpoint.from_per_expert(no_shared, prefix="mlp.")
  with pytest.raises(ValueError, match=r"experts\.5\.down_proj\.weight has shape \[12, 16\], expected \[16, 12\]"):
    checkpoint.from_per_expert({**flat, "mlp.experts.5.down_proj.weight": flat["mlp.experts.5.down_proj.weight"].T},
                               prefix="mlp.")
  with pytest.raises(ValueError, match=r"shared_expert_gate\.weight has shape \[16, 1\], expected \[1, 16\]"):
    checkpoint.from_per_expert({**flat, "mlp.shared_expert_gate.weight": np.ones((16, 1))}, prefix="mlp.")
  hf = checkpoint.to_transformers(checkpoint.params_of(_module(0, CONFIGS["qwen2_moe"])), "mlp.", "qwen2_moe")
  with pytest.raises(ValueError, match="from_transformers takes it"):
    checkpoint.from_per_expert(hf, prefix="mlp.")
  with pytest.raises(ValueError, match="from_per_expert takes them"):
    checkpoint.from_transformers(flat, prefix="mlp.")
  with pytest.raises(ValueError, match=r"down_proj has shape \[8, 12, 16\], expected \[8, 16, 12\]"):
    checkpoint.from_transformers({**hf, "mlp.experts.down_proj": hf["mlp.experts.down_proj"].transpose(0, 2, 1)},
                                 prefix="mlp.")
  params = checkpoint.params_of(_module(0, CONFIGS["qwen2_moe"]))
  with pytest.raises(ValueError, match="style 'mixtral' has no shared experts"):
    checkpoint.to_per_expert(params, style="mixtral")
  with pytest.raises(ValueError, match="style 'deepseek' has no shared expert gate"):
    checkpoint.to_transformers(params, style="deepseek")
  with pytest.raises(ValueError, match="unknown checkpoint style 'qwen3'"):
    checkpoint.to_per_expert(params, style="qwen3")


def test_load_balance_loss_scale_of_hf_and_maxtext():
  """The published load-balance losses, written from their sources, are k times this library's on one layer's
  tokens: Hugging Face's ``load_balancing_loss_func`` (Mixtral, Qwen2/3-MoE) and MaxText's
  ``RoutedMoE.load_balance_loss`` (before its weight) both score k for a balanced router, this library 1."""
  E, k, T = 8, 3, 64
  logits = (np.random.default_rng(1).normal(size=(T, E)) + np.linspace(-1, 1, E)).astype(np.float32)  # skewed
  cfg = jmo.MoEConfig(emb_dim=16, moe_mlp_dim=12, num_experts=E, num_experts_per_tok=k)
  ours = float(jmo.route(jnp.asarray(logits), cfg).load_balance_loss)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  top = np.argsort(-p, axis=-1)[:, :k]
  mask = np.eye(E)[top]                                                   # [T, k, E]
  # transformers: tokens_per_expert = mean(expert_mask, 0) [k, E]; sum(tokens_per_expert * mean(p, 0)) * E
  hf = float(np.sum(mask.mean(0) * p.mean(0)[None, :]) * E)
  # MaxText: per sequence ([B, S] tokens), density = mean_S(sum_k mask); mean(density * mean_S(p)) * E^2
  density, density_prob = mask.sum(1)[None].mean(1), p[None].mean(1)     # one sequence: B = 1
  maxtext = float(np.mean(density * density_prob) * E ** 2)
  assert ours > 1.05  # an unbalanced router, so that the scale is not read off a constant
  np.testing.assert_allclose([hf, maxtext], [k * ours, k * ours], rtol=1e-5)
