"""Parameter converters between ``MoE`` and the layouts other code keeps MoE layers in.

Four layouts of one layer's parameters (D = emb_dim, E experts of hidden width F, shared width S):

* This library (``MoE``): ``router [D, E]``, ``routing_bias [E]``, ``w1 [E, D, 2F]`` (gate | up on the last
  axis; a module with a ``tensor_axis`` keeps its view ``[E, D, 2, F]``, the same elements in the same order),
  ``w2 [E, F, D]``, ``shared_w1 [D, 2S]`` (gate | up), ``shared_w2 [S, D]``, ``shared_expert_gate [D, 1]``. The
  ``to_*`` converters take w1 in either shape, the ``from_*`` ones give ``[E, D, 2F]``, and ``load_params`` puts
  either into the module's own.
* MaxText (``to_maxtext`` / ``from_maxtext``): ``RoutedMoE``'s parameters and its shared experts' ``MlpBlock``, as
  nested dicts: ``gate/kernel [D, E]``, ``gate/bias [E]``, ``wi_0 [E, D, F]`` (gate), ``wi_1 [E, D, F]`` (up),
  ``wo [E, F, D]``; ``shared_experts/{wi_0,wi_1}/kernel [D, S]``, ``shared_experts/wo/kernel [S, D]``;
  ``shared_expert_gate/kernel [D, 1]`` (the name of Qwen3-Next's block).
* Published checkpoints, one tensor per expert (``to_per_expert`` / ``from_per_expert``): the Hugging Face
  safetensors files, torch ``Linear`` weights [out, in], flat names under a prefix such as
  ``model.layers.3.mlp.``:

  - router: ``gate.weight [E, D]``; ``gate.e_score_correction_bias [E]`` (DeepSeek-V3's routing bias);
  - experts: ``experts.{i}.gate_proj.weight [F, D]``, ``experts.{i}.up_proj.weight [F, D]``,
    ``experts.{i}.down_proj.weight [D, F]`` (DeepSeek-V3, Qwen2-MoE, Qwen3-MoE), or Mixtral's
    ``experts.{i}.w1.weight`` (gate), ``w3`` (up), ``w2`` (down), whose prefix is ``model.layers.3.block_sparse_moe.``;
  - shared experts: ``shared_experts.{gate,up,down}_proj.weight`` (DeepSeek-V3) or
    ``shared_expert.{gate,up,down}_proj.weight`` (Qwen2-MoE), ``[S, D]``, ``[S, D]``, ``[D, S]``;
    ``shared_expert_gate.weight [1, D]`` (Qwen2-MoE).
* transformers 5.x in memory (``to_transformers`` / ``from_transformers``): what a live model's ``state_dict()``
  holds, the experts stacked: ``experts.gate_up_proj [E, 2F, D]`` (the gate's F rows, then the up's),
  ``experts.down_proj [E, D, F]``; the router and shared experts as published. transformers renames Mixtral's
  ``block_sparse_moe.gate`` to ``mlp.gate`` on loading, so its prefix there is ``model.layers.3.mlp.``.

``STYLES`` names the published naming a ``to_*`` converter writes: "deepseek" (DeepSeek-V3; Qwen3-MoE, which has no
shared expert), "qwen2_moe" (the singular shared expert and its gate) or "mixtral" (w1 / w3 / w2, no shared
expert). The ``from_*`` converters recognise every style, and convert every tensor named under the prefix or raise a
ValueError naming the ones they cannot place: nothing given is dropped silently.

The parameters are the same under every ``MoEConfig.quantization``: an FP8 module keeps its master weights (it
quantizes them per call) and no FP8 or calibration state, so parameters restore into a module of any quantization.
Pre-quantized ``Fp8Weight``s (``quantize_weights``, for ``moe_experts``) are no layout's tensors: refused by name.

Conversions only slice, concatenate and transpose: a round trip gives the same bits. ``load_params`` writes a dict
of this library's layout into a module, each array placed with the sharding the module's variable already has (so
a restore lands sharded over the expert axis without a replicated copy on one device).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_moe_overlap.api import explicit_mesh, explicit_spec
from jax_moe_overlap.checks import check_master_weight
from jax_moe_overlap.layer import MoE, expert_specs

NAMES = ("router", "routing_bias", "w1", "w2", "shared_w1", "shared_w2", "shared_expert_gate")


def _check_master_weights(params: dict, where: str) -> None:
  for name, value in params.items():
    check_master_weight(where, name, value)


def params_of(module: MoE) -> dict:
  """The module's parameters in this library's layout: {name: array} (only those the module has)."""
  return {n: getattr(module, n)[...] for n in NAMES if getattr(module, n, None) is not None}


def load_params(module: MoE, params: dict) -> None:
  """Writes ``params`` (this library's layout; arrays of any kind) into ``module`` in the dtype of the variable it
  replaces, placed on the module's mesh: with the variable's own sharding when it already has one there, else the
  experts' weights sharded over the expert axis and the rest replicated. Every variable of the module must be given,
  with its exact shape. Host (NumPy) arrays go from the host straight to their shards: no device holds a whole copy.

  Each variable's array is replaced whole, never updated in place: an in-place update (``var[...] = value``) is a
  scatter, which on a mesh with Explicit axes must be told its output sharding and fails when the new value's
  sharding differs from the old one's."""
  _check_master_weights(params, "load_params")
  have = {n for n in NAMES if getattr(module, n, None) is not None}
  if set(params) != have:
    raise ValueError(f"jax_moe_overlap: load_params: the module has {sorted(have)}, got {sorted(params)}")
  for name, value in params.items():
    var = getattr(module, name)
    old = var[...]
    if name == "w1" and _w1_views(tuple(value.shape), tuple(old.shape)):
      value = _reshaped(value, old.shape)  # [E, D, 2F] <-> its view [E, D, 2, F]: the same elements, same order
    if tuple(value.shape) != tuple(old.shape):
      raise ValueError(f"jax_moe_overlap: load_params: {name} has shape {tuple(old.shape)}, got "
                       f"{tuple(value.shape)}")
    value = value.astype(old.dtype) if isinstance(value, jax.Array) else np.asarray(value).astype(old.dtype)
    var.set_value(jax.device_put(value, _target_sharding(module, name, old)))


def _target_sharding(module: MoE, name: str, old: jax.Array):
  sharding = getattr(old, "sharding", None)
  if isinstance(sharding, NamedSharding) and set(sharding.mesh.devices.flat) == set(module.mesh.devices.flat):
    return sharding
  w1_spec, w2_spec = expert_specs(module.expert_axis, module.tensor_axis)
  spec = {"w1": w1_spec, "w2": w2_spec}.get(name, P())
  return NamedSharding(module.mesh, spec)


def _w1_views(a: tuple, b: tuple) -> bool:
  """Whether shapes a and b are w1 [E, D, 2F] and its view [E, D, 2, F], in either order."""
  three, four = (a, b) if len(a) == 3 else (b, a)
  return len(three) == 3 and len(four) == 4 and four == (*three[:2], 2, three[2] // 2) and three[2] % 2 == 0


def _w1(w):
  """w1 as [E, D, 2F] (from either of the module's layouts)."""
  return _reshaped(w, (w.shape[0], w.shape[1], math.prod(w.shape[2:])))


def _reshaped(a, shape):
  """``a`` in ``shape``, the same elements in the same order. A jax array on a mesh with Explicit axes, where a
  reshape must be told its output sharding, is laid out over the Explicit mesh axes of its first axis alone first
  (as the experts' weights are without a tensor axis)."""
  if tuple(a.shape) == tuple(shape):
    return a
  sharding = getattr(a, "sharding", None)
  if isinstance(a, jax.Array) and isinstance(sharding, NamedSharding) and explicit_mesh(sharding.mesh):
    first = NamedSharding(sharding.mesh, explicit_spec(sharding.mesh, P(*tuple(sharding.spec)[:1])))
    return jnp.reshape(jax.sharding.reshard(a, first), shape, out_sharding=first)
  return a.reshape(shape)


def _split(w):
  half = w.shape[-1] // 2
  return w[..., :half], w[..., half:]


def _cat(a, b):
  xp = jnp if isinstance(a, jax.Array) else np
  return xp.concatenate([a, b], axis=-1)


def _some(names, limit: int = 8) -> str:
  names = list(names)
  return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


class _Given:
  """The tensors given under one prefix (names relative to it). Each rule takes the ones it converts; ``finish``
  raises naming whatever no rule took, so that a converter never drops a tensor silently."""

  def __init__(self, tensors: dict, prefix: str, where: str):
    self.prefix, self.where = prefix, where
    self.t = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    self.taken: set[str] = set()
    if not self.t:  # name the tensors under the longest dotted part of the prefix that has some
      near = prefix
      while near and not any(k.startswith(near) for k in tensors):
        near = near[:near.rstrip(".").rfind(".") + 1]
      raise ValueError(f"{self.where}: no tensor is named under the prefix {prefix!r}; the names under {near!r}: "
                       f"{_some(sorted(k for k in tensors if k.startswith(near)))}")

  def error(self, message: str) -> ValueError:
    return ValueError(f"{self.where}: {message} (prefix {self.prefix!r})")

  def has(self, name: str) -> bool:
    return name in self.t

  def take(self, name: str, shape: tuple) -> np.ndarray:
    """The tensor ``name`` as a NumPy array of ``shape`` (None in it: any size)."""
    if name not in self.t:
      raise self.error(f"{name} is missing; the names given: {_some(sorted(self.t))}")
    a = np.asarray(self.t[name])
    if a.ndim != len(shape) or any(want is not None and n != want for n, want in zip(a.shape, shape)):
      want = "[" + ", ".join("?" if n is None else str(n) for n in shape) + "]"
      raise self.error(f"{name} has shape {list(a.shape)}, expected {want}")
    self.taken.add(name)
    return a

  def finish(self, out: dict) -> dict:
    rest = sorted(set(self.t) - self.taken)
    if rest:
      raise self.error(f"no rule converts {_some(rest)}: the converters take one MoE layer's unquantised weights, "
                       "named as checkpoint.py lists, and nothing else under the prefix")
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


@dataclasses.dataclass(frozen=True)
class Style:
  """A published naming of one MoE layer (see the module docstring)."""

  expert_projections: tuple[str, str, str]  # the per-expert names of the gate, up and down projections
  shared_expert: str | None                 # the shared experts' module name; None: the models have none
  shared_expert_gate: bool                  # whether the models gate the shared expert


STYLES = {
    "deepseek": Style(("gate_proj", "up_proj", "down_proj"), "shared_experts", False),
    "qwen2_moe": Style(("gate_proj", "up_proj", "down_proj"), "shared_expert", True),
    "mixtral": Style(("w1", "w3", "w2"), None, False),
}
_SHARED_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def to_maxtext(params: dict) -> dict:
  """This library's layout -> MaxText's nested dict."""
  _check_master_weights(params, "to_maxtext")
  gate, up = _split(_w1(params["w1"]))
  out = {"gate": {"kernel": params["router"]}, "wi_0": gate, "wi_1": up, "wo": params["w2"]}
  if "routing_bias" in params:
    out["gate"]["bias"] = params["routing_bias"]
  if "shared_w1" in params:
    sg, su = _split(params["shared_w1"])
    out["shared_experts"] = {"wi_0": {"kernel": sg}, "wi_1": {"kernel": su}, "wo": {"kernel": params["shared_w2"]}}
  if "shared_expert_gate" in params:
    out["shared_expert_gate"] = {"kernel": params["shared_expert_gate"]}
  return out


def from_maxtext(tree: dict) -> dict:
  """MaxText's nested dict -> this library's layout (arrays of the tree's kind). Every leaf must be one of the
  layout's; any other raises a ValueError naming it."""
  flat = {"/".join(str(getattr(k, "key", k)) for k in path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
  known = {"gate/kernel", "gate/bias", "wi_0", "wi_1", "wo", "shared_experts/wi_0/kernel",
           "shared_experts/wi_1/kernel", "shared_experts/wo/kernel", "shared_expert_gate/kernel"}
  if set(flat) - known:
    raise ValueError(f"jax_moe_overlap: from_maxtext: no rule converts {_some(sorted(set(flat) - known))}")
  out = {"router": tree["gate"]["kernel"], "w1": _cat(tree["wi_0"], tree["wi_1"]), "w2": tree["wo"]}
  if "bias" in tree["gate"]:
    out["routing_bias"] = tree["gate"]["bias"]
  if "shared_experts" in tree:
    s = tree["shared_experts"]
    out["shared_w1"] = _cat(s["wi_0"]["kernel"], s["wi_1"]["kernel"])
    out["shared_w2"] = s["wo"]["kernel"]
  if "shared_expert_gate" in tree:
    out["shared_expert_gate"] = tree["shared_expert_gate"]["kernel"]
  return out


def _style(style: str) -> Style:
  if style not in STYLES:
    raise ValueError(f"jax_moe_overlap: unknown checkpoint style {style!r}; one of {sorted(STYLES)}")
  return STYLES[style]


def _router_and_shared_to(p: dict, prefix: str, style: str) -> dict:
  """The router, routing bias, shared experts and shared expert gate of ``p`` (NumPy) in the published names."""
  st = _style(style)
  out = {f"{prefix}gate.weight": p["router"].T}
  if "routing_bias" in p:
    out[f"{prefix}gate.e_score_correction_bias"] = p["routing_bias"]
  if "shared_w1" in p:
    if st.shared_expert is None:
      raise ValueError(f"jax_moe_overlap: style {style!r} has no shared experts; these parameters have them")
    sg, su = _split(p["shared_w1"])
    for proj, w in zip(_SHARED_PROJECTIONS, (sg, su, p["shared_w2"])):
      out[f"{prefix}{st.shared_expert}.{proj}.weight"] = w.T
  if "shared_expert_gate" in p:
    if not st.shared_expert_gate:
      raise ValueError(f"jax_moe_overlap: style {style!r} has no shared expert gate; these parameters have one "
                       "(Qwen2-MoE's naming, style='qwen2_moe', has)")
    out[f"{prefix}shared_expert_gate.weight"] = p["shared_expert_gate"].T
  return out


def _router_and_shared_from(g: _Given) -> tuple[dict, int, int]:
  """Takes the router, routing bias, shared experts and shared expert gate from ``g``. Returns (this library's
  tensors, E, D)."""
  router = g.take("gate.weight", (None, None))
  E, D = router.shape
  out = {"router": router.T}
  if g.has("gate.e_score_correction_bias"):
    out["routing_bias"] = g.take("gate.e_score_correction_bias", (E,))
  modules = sorted({k.split(".")[0] for k in g.t if k.startswith(("shared_experts.", "shared_expert."))})
  if len(modules) > 1:
    raise g.error("both DeepSeek-V3's shared_experts.* and Qwen2-MoE's shared_expert.* are given")
  if modules:
    gate, up, down = (f"{modules[0]}.{proj}.weight" for proj in _SHARED_PROJECTIONS)
    sg = g.take(gate, (None, D))
    su, sd = g.take(up, sg.shape), g.take(down, (D, sg.shape[0]))
    out["shared_w1"], out["shared_w2"] = np.concatenate([sg.T, su.T], -1), sd.T
  if g.has("shared_expert_gate.weight"):
    if not modules:
      raise g.error("shared_expert_gate.weight is given without a shared expert")
    out["shared_expert_gate"] = g.take("shared_expert_gate.weight", (1, D)).T
  return out, E, D


def to_per_expert(params: dict, prefix: str = "", style: str = "deepseek") -> dict:
  """This library's layout -> flat {name: NumPy array} of the published checkpoints, one tensor per expert, in the
  naming of ``style`` (a key of ``STYLES``; [out, in] weights)."""
  _check_master_weights(params, "to_per_expert")
  p = {k: np.asarray(v) for k, v in params.items()}
  out = _router_and_shared_to(p, prefix, style)
  names = _style(style).expert_projections
  gate, up = _split(_w1(p["w1"]))
  for i in range(p["w1"].shape[0]):
    for proj, w in zip(names, (gate[i], up[i], p["w2"][i])):
      out[f"{prefix}experts.{i}.{proj}.weight"] = w.T
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


_PER_EXPERT = re.compile(r"experts\.(\d+)\.(\w+)\.weight")


def from_per_expert(tensors: dict, prefix: str = "") -> dict:
  """Flat published per-expert tensors (any style; names outside ``prefix`` are ignored) -> this library's layout
  (NumPy). Every tensor under the prefix is converted, or a ValueError names it."""
  g = _Given(tensors, prefix, "jax_moe_overlap: from_per_expert")
  out, E, D = _router_and_shared_from(g)
  found: dict[str, set[int]] = {}
  for k in g.t:
    if m := _PER_EXPERT.fullmatch(k):
      found.setdefault(m.group(2), set()).add(int(m.group(1)))
  styles = {s.expert_projections for s in STYLES.values() if set(s.expert_projections) & set(found)}
  if len(styles) != 1:
    hint = " (experts.gate_up_proj is transformers' in-memory layout: from_transformers takes it)" \
        if g.has("experts.gate_up_proj") else ""
    raise g.error(f"expected per-expert weights experts.{{i}}.{{gate_proj,up_proj,down_proj}}.weight or Mixtral's "
                  f"experts.{{i}}.{{w1,w3,w2}}.weight; found {sorted(found) or 'none'}{hint}")
  names = styles.pop()
  ids = {proj: sorted(found.get(proj, ())) for proj in names}
  if any(ids[proj] != list(range(E)) for proj in names):
    raise g.error(f"expert weights must be numbered 0..{E - 1} for each projection (the router has {E} experts); "
                  "found " + "; ".join(f"{proj}: [{_some(map(str, ids[proj]))}]" for proj in names))
  gate = g.take(f"experts.0.{names[0]}.weight", (None, D))
  F = gate.shape[0]
  w = [[g.take(f"experts.{i}.{proj}.weight", (D, F) if proj == names[2] else (F, D)).T for proj in names]
       for i in range(E)]
  out["w1"] = np.stack([np.concatenate([gi, ui], -1) for gi, ui, _ in w])
  out["w2"] = np.stack([di for _, _, di in w])
  return g.finish(out)


def to_transformers(params: dict, prefix: str = "", style: str = "deepseek") -> dict:
  """This library's layout -> flat {name: NumPy array} as transformers 5.x holds the layer in memory (the experts
  stacked in ``experts.gate_up_proj`` and ``experts.down_proj``; the router and shared experts in the naming of
  ``style``)."""
  _check_master_weights(params, "to_transformers")
  p = {k: np.asarray(v) for k, v in params.items()}
  out = _router_and_shared_to(p, prefix, style)
  out[f"{prefix}experts.gate_up_proj"] = _w1(p["w1"]).transpose(0, 2, 1)
  out[f"{prefix}experts.down_proj"] = p["w2"].transpose(0, 2, 1)
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def from_transformers(tensors: dict, prefix: str = "") -> dict:
  """transformers 5.x in-memory tensors of one layer (a live model's ``state_dict()``, as NumPy arrays; names
  outside ``prefix`` are ignored) -> this library's layout (NumPy). Every tensor under the prefix is converted, or a
  ValueError names it."""
  g = _Given(tensors, prefix, "jax_moe_overlap: from_transformers")
  out, E, D = _router_and_shared_from(g)
  if not g.has("experts.gate_up_proj"):
    hint = (" (experts.{i}.* are the published per-expert names: from_per_expert takes them)"
            if any(_PER_EXPERT.fullmatch(k) for k in g.t) else "")
    raise g.error(f"experts.gate_up_proj is missing{hint}")
  gate_up = g.take("experts.gate_up_proj", (E, None, D))
  if gate_up.shape[1] % 2:
    raise g.error(f"experts.gate_up_proj has shape {list(gate_up.shape)}: its gate and up halves need an even "
                  "axis 1")
  out["w1"] = gate_up.transpose(0, 2, 1)
  out["w2"] = g.take("experts.down_proj", (E, D, gate_up.shape[1] // 2)).transpose(0, 2, 1)
  return g.finish(out)
