"""One decode step of a multi-layer MoE model: what the CUDA-graph checks (tests/gpu/test_gpu_command_buffers.py) and
the decode benchmark (bench_decode.py) run.

Each of the ``layers`` layers maps x [T, D] to rms_norm(x + moe(x)): a softmax top-k router of its own (float32
logits at HIGHEST precision, so that its ids do not depend on how XLA runs the dot) and SwiGLU experts through
``moe_experts`` (impl "overlap" unless asked otherwise), tokens and experts sharded over the mesh's "expert" axis;
with quantization="fp8" the experts run DeepSeek-V3's FP8 recipe on weights quantized once by ``quantize_params``
(``jmo.quantize_weights``: the step reads only their e4m3 values and float32 block scales). A
step's output is the next step's input, as in a decoding loop, so every step routes its tokens anew: the custom
calls replay with other counts each step. No collective crosses the expert axis outside the layer's own calls, so the
step also runs with the axis over processes sharing one GPU.

Parameters and tokens are drawn under jit with their output shardings from one seed: every process of a
multi-process job gets the same global values and computes its own shards. Import after configuring jax.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_moe_overlap as jmo

AXIS = "expert"

# XLA_FLAGS of a process whose programs run with CUDA graphs ("on": XLA's default command buffer kinds, custom calls
# included, from the first command on) or without ("off": no command buffers at all). XLA reads them when the
# process first uses a backend, so each setting needs a process of its own.
GRAPH_FLAGS = {
    "on": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1",
    "off": "--xla_gpu_enable_command_buffer=",
}


@dataclasses.dataclass(frozen=True)
class DecodeModel:
  """The MoE layers of a decode step (d_model, d_ff: the experts' SwiGLU width; experts: E; top_k: k)."""

  layers: int
  d_model: int
  d_ff: int
  experts: int
  top_k: int

  @classmethod
  def from_args(cls, args) -> "DecodeModel":
    """The model of parsed options (bench_decode.add_model_args')."""
    return cls(layers=args.layers, d_model=args.d_model, d_ff=args.d_ff, experts=args.experts, top_k=args.top_k)


def init_params(model: DecodeModel, mesh, seed: int = 0, dtype=jnp.bfloat16) -> list[dict]:
  """Per layer {"router": [D, E] float32, replicated; "w1": [E, D, 2F], "w2": [E, F, D] in ``dtype``, split over the
  expert axis}, scaled by 1/sqrt(fan-in)."""
  D, F, E = model.d_model, model.d_ff, model.experts
  shardings = {"router": NamedSharding(mesh, P()), "w1": NamedSharding(mesh, P(AXIS)),
               "w2": NamedSharding(mesh, P(AXIS))}

  def draw(key):
    kr, k1, k2 = jax.random.split(key, 3)
    return {"router": jax.random.normal(kr, (D, E), jnp.float32) / np.sqrt(D),
            "w1": (jax.random.normal(k1, (E, D, 2 * F), jnp.float32) / np.sqrt(D)).astype(dtype),
            "w2": (jax.random.normal(k2, (E, F, D), jnp.float32) / np.sqrt(F)).astype(dtype)}

  draw = jax.jit(draw, out_shardings=shardings)
  return [draw(k) for k in jax.random.split(jax.random.key(seed), model.layers)]


def quantize_params(params: list[dict], mesh) -> list[dict]:
  """``init_params``' layers with w1 and w2 replaced by their ``fp8.Fp8Weight``s (``jmo.quantize_weights``, under
  jit: each device quantizes its own experts, the values and scales split over the expert axis like the weights)."""
  by_expert = NamedSharding(mesh, P(AXIS))

  def quantize(p):
    w1, w2 = jmo.quantize_weights(p["w1"], p["w2"])
    return {"router": p["router"], "w1": w1, "w2": w2}

  shardings = {"router": NamedSharding(mesh, P()), "w1": by_expert, "w2": by_expert}
  quantize = jax.jit(quantize, out_shardings=shardings)
  return [quantize(p) for p in params]


def expert_weight_bytes(p: dict) -> int:
  """Bytes of one expert's weights in a layer's parameters: w1 and w2 (bfloat16: 2 bytes a weight; ``Fp8Weight``: 1
  byte a weight plus 4 per 128 x 128 block scale), what the step reads for each expert that receives a row."""
  leaves = jax.tree.leaves((p["w1"], p["w2"]))
  return sum(a.size * a.dtype.itemsize for a in leaves) // p["w2"].shape[0]


def first_tokens(model: DecodeModel, tokens: int, mesh, seed: int = 1, dtype=jnp.bfloat16) -> jax.Array:
  """x [tokens, D] in ``dtype``, tokens split over the expert axis: the first step's input."""
  draw = jax.jit(lambda k: jax.random.normal(k, (tokens, model.d_model), jnp.float32).astype(dtype),
                 out_shardings=NamedSharding(mesh, P(AXIS, None)))  # as the step returns it
  return draw(jax.random.key(seed))


def route(x, router, top_k: int):
  """(expert ids [T, k] int32, gates [T, k] float32): the top-k of float32 logits x @ router, softmax over them."""
  logits = jnp.dot(x.astype(jnp.float32), router, precision=jax.lax.Precision.HIGHEST)
  top, ids = jax.lax.top_k(logits, top_k)
  return ids.astype(jnp.int32), jax.nn.softmax(top, axis=-1)


def moe(x, p: dict, model: DecodeModel, mesh, impl: str = "overlap", config: jmo.CallConfig = jmo.CallConfig(),
        quantization: str | None = None):
  """The experts' output y [T, D] in x's dtype for tokens x, routed by the layer's router."""
  ids, gates = route(x, p["router"], model.top_k)
  y, _ = jmo.moe_experts(x, ids, gates, p["w1"], p["w2"], mesh=mesh, impl=impl, config=config,
                         quantization=quantization)
  return y


def rms_norm(h):
  h = h.astype(jnp.float32)
  return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)


def next_x(x, y):
  """A layer's output from its input x and its experts' output y: rms_norm(x + y) in x's dtype."""
  return rms_norm(x.astype(jnp.float32) + y.astype(jnp.float32)).astype(x.dtype)


def make_step(model: DecodeModel, mesh, impl: str = "overlap", config: jmo.CallConfig = jmo.CallConfig(),
              quantization: str | None = None):
  """jit of step(params, x) -> the next x, in x's dtype: the layers one after another (quantization="fp8": params
  from ``quantize_params``)."""

  def step(params, x):
    for p in params:
      x = next_x(x, moe(x, p, model, mesh, impl, config, quantization))
    return x

  return jax.jit(step)
