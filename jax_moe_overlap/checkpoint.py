"""Parameter converters between ``MoE`` and the layouts other code saves MoE layers in.

Three layouts of one layer's parameters (D = emb_dim, E experts of hidden width F, shared width S):

* This library (``MoE``): ``router [D, E]``, ``routing_bias [E]``, ``w1 [E, D, 2F]`` (gate | up on the last
  axis), ``w2 [E, F, D]``, ``shared_w1 [D, 2S]`` (gate | up), ``shared_w2 [S, D]``.
* MaxText's ``RoutedMoE`` (and its shared experts' ``MlpBlock``), as nested dicts: ``gate/kernel [D, E]``,
  ``gate/bias [E]``, ``wi_0 [E, D, F]`` (gate), ``wi_1 [E, D, F]`` (up), ``wo [E, F, D]``;
  ``shared_experts/{wi_0,wi_1}/kernel [D, S]``, ``shared_experts/wo/kernel [S, D]``.
* Published per-expert checkpoints (DeepSeek-V3, Qwen3-MoE in Hugging Face naming; torch ``Linear`` weights are
  [out, in]), flat names under a prefix such as ``model.layers.3.mlp.``: ``gate.weight [E, D]``,
  ``gate.e_score_correction_bias [E]``, ``experts.{i}.gate_proj.weight [F, D]``, ``experts.{i}.up_proj.weight
  [F, D]``, ``experts.{i}.down_proj.weight [D, F]``, ``shared_experts.{gate,up,down}_proj.weight``.

Conversions only slice, concatenate and transpose: a round trip gives the same bits. ``load_params`` writes a dict
of this library's layout into a module, each array placed with the sharding the module's variable already has (so
a restore lands sharded over the expert axis without a replicated copy on one device).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_moe_overlap.layer import MoE

NAMES = ("router", "routing_bias", "w1", "w2", "shared_w1", "shared_w2")


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
  have = {n for n in NAMES if getattr(module, n, None) is not None}
  if set(params) != have:
    raise ValueError(f"jax_moe_overlap: load_params: the module has {sorted(have)}, got {sorted(params)}")
  for name, value in params.items():
    var = getattr(module, name)
    old = var[...]
    if tuple(value.shape) != tuple(old.shape):
      raise ValueError(f"jax_moe_overlap: load_params: {name} has shape {tuple(old.shape)}, got "
                       f"{tuple(value.shape)}")
    value = value.astype(old.dtype) if isinstance(value, jax.Array) else np.asarray(value).astype(old.dtype)
    var.set_value(jax.device_put(value, _target_sharding(module, name, old)))


def _target_sharding(module: MoE, name: str, old: jax.Array):
  sharding = getattr(old, "sharding", None)
  if isinstance(sharding, NamedSharding) and set(sharding.mesh.devices.flat) == set(module.mesh.devices.flat):
    return sharding
  spec = P(module.expert_axis) if name in ("w1", "w2") else P()
  return NamedSharding(module.mesh, spec)


def _split(w):
  half = w.shape[-1] // 2
  return w[..., :half], w[..., half:]


def _cat(a, b):
  xp = jnp if isinstance(a, jax.Array) else np
  return xp.concatenate([a, b], axis=-1)


def to_maxtext(params: dict) -> dict:
  """This library's layout -> MaxText's nested dict."""
  gate, up = _split(params["w1"])
  out = {"gate": {"kernel": params["router"]}, "wi_0": gate, "wi_1": up, "wo": params["w2"]}
  if "routing_bias" in params:
    out["gate"]["bias"] = params["routing_bias"]
  if "shared_w1" in params:
    sg, su = _split(params["shared_w1"])
    out["shared_experts"] = {"wi_0": {"kernel": sg}, "wi_1": {"kernel": su}, "wo": {"kernel": params["shared_w2"]}}
  return out


def from_maxtext(tree: dict) -> dict:
  """MaxText's nested dict -> this library's layout."""
  out = {"router": tree["gate"]["kernel"], "w1": _cat(tree["wi_0"], tree["wi_1"]), "w2": tree["wo"]}
  if "bias" in tree["gate"]:
    out["routing_bias"] = tree["gate"]["bias"]
  if "shared_experts" in tree:
    s = tree["shared_experts"]
    out["shared_w1"] = _cat(s["wi_0"]["kernel"], s["wi_1"]["kernel"])
    out["shared_w2"] = s["wo"]["kernel"]
  return out


def to_per_expert(params: dict, prefix: str = "") -> dict:
  """This library's layout -> flat {name: numpy array} in the published per-expert naming ([out, in] weights)."""
  p = {k: np.asarray(v) for k, v in params.items()}
  out = {f"{prefix}gate.weight": p["router"].T}
  if "routing_bias" in p:
    out[f"{prefix}gate.e_score_correction_bias"] = p["routing_bias"]
  gate, up = _split(p["w1"])
  for i in range(p["w1"].shape[0]):
    out[f"{prefix}experts.{i}.gate_proj.weight"] = gate[i].T
    out[f"{prefix}experts.{i}.up_proj.weight"] = up[i].T
    out[f"{prefix}experts.{i}.down_proj.weight"] = p["w2"][i].T
  if "shared_w1" in p:
    sg, su = _split(p["shared_w1"])
    out[f"{prefix}shared_experts.gate_proj.weight"] = sg.T
    out[f"{prefix}shared_experts.up_proj.weight"] = su.T
    out[f"{prefix}shared_experts.down_proj.weight"] = p["shared_w2"].T
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def from_per_expert(tensors: dict, prefix: str = "") -> dict:
  """Flat per-expert tensors (names under ``prefix``; other names are ignored) -> this library's layout (numpy)."""
  t = {k[len(prefix):]: np.asarray(v) for k, v in tensors.items() if k.startswith(prefix)}
  ids = sorted({int(m.group(1)) for k in t if (m := re.fullmatch(r"experts\.(\d+)\.gate_proj\.weight", k))})
  if not ids or ids != list(range(len(ids))):
    raise ValueError(f"jax_moe_overlap: from_per_expert: expert weights under {prefix!r} must be numbered 0..E-1, "
                     f"found {ids[:8]}{'...' if len(ids) > 8 else ''}")
  w1 = np.stack([np.concatenate([t[f"experts.{i}.gate_proj.weight"].T, t[f"experts.{i}.up_proj.weight"].T], -1)
                 for i in ids])
  w2 = np.stack([t[f"experts.{i}.down_proj.weight"].T for i in ids])
  out = {"router": np.ascontiguousarray(t["gate.weight"].T), "w1": w1, "w2": w2}
  if "gate.e_score_correction_bias" in t:
    out["routing_bias"] = t["gate.e_score_correction_bias"]
  if "shared_experts.gate_proj.weight" in t:
    out["shared_w1"] = np.ascontiguousarray(np.concatenate([t["shared_experts.gate_proj.weight"].T,
                                                            t["shared_experts.up_proj.weight"].T], -1))
    out["shared_w2"] = np.ascontiguousarray(t["shared_experts.down_proj.weight"].T)
  return out
