"""A small decoder-only byte-level transformer whose feed-forward blocks are jax_moe_overlap ``MoE`` layers.

Shared by ``train_moe.py`` and ``generate.py``: the model, its config, the mesh, sharded initialization, the text
data and the orbax checkpoint layout. Not part of the library; copy what you need.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe_overlap as jmo
from jax_moe_overlap.checks import check_layer

DATA_FILE = pathlib.Path(__file__).parent / "data" / "licenses.txt"
EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"  # a mesh axis of this name splits each expert's hidden width (jmo.MoE's tensor_axis)
ATTENTION_IMPLS = ("xla", "cudnn")
# Named scopes of the attention core and the MoE layers: the HLO ops under them carry the name in their metadata,
# which is how a step profile (step_profile.py) attributes device time to them.
ATTENTION_SCOPE = "attention"
MOE_SCOPE = "moe"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """The scripts' --help: each flag's help with its default, except a default of None, where the help says what
  leaving the flag out does."""

  def _get_help_string(self, action):
    return (action.help or "") if action.default is None else super()._get_help_string(action)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes of the transformer. Byte-level, so the vocabulary is 256."""

  vocab_size: int = 256
  seq_len: int = 64
  d_model: int = 64
  num_layers: int = 4
  num_heads: int = 4
  d_ff: int = 128                 # hidden width of each expert (and of the dense MLPs when moe_every > 1)
  num_experts: int = 8
  top_k: int = 2
  capacity_factor: float | None = 1.25   # None: dropless
  moe_every: int = 1              # 1: an MoE feed-forward in every layer; 2: in every other layer (others dense)
  impl: str = "overlap"           # "overlap" (custom calls), "collective", "xla" (XLA collectives) or "reference"
  dtype: str = "float32"          # compute dtype; parameters stay float32
  routed_score_func: str = "softmax"   # "softmax" (Mixtral) or "sigmoid" (DeepSeek-V3)
  shared_experts: int = 0         # always-on experts of width d_ff beside the routed ones
  quantization: str | None = None  # None, "fp8" or "fp8_bf16_wgrad" (MoEConfig.quantization)
  attention: str = "xla"          # jax.nn.dot_product_attention's implementation (choose_attention); no parameter
                                  # depends on it, so a checkpoint made with either runs with either

  def moe_config(self) -> jmo.MoEConfig:
    """The MoE blocks' configuration (the auxiliary-loss weights are applied by the training loop)."""
    return jmo.MoEConfig(emb_dim=self.d_model, moe_mlp_dim=self.d_ff, num_experts=self.num_experts,
                         num_experts_per_tok=self.top_k, capacity_factor=self.capacity_factor,
                         routed_score_func=self.routed_score_func, shared_experts=self.shared_experts,
                         dtype=jnp.dtype(self.dtype), quantization=self.quantization)

  def check(self, mesh: jax.sharding.Mesh) -> None:
    """Raises ValueError (the library's TypeError or NotImplementedError for its own rules) naming the rule a size
    breaks, before anything is built: the model's own (heads, MoE layers) and, through the library's checks, its MoE
    layers' on ``mesh`` (``jmo.checks.check_layer``: experts over the expert axis, the hidden width over a tensor
    axis, FP8's sizes and impl)."""
    for name in ("seq_len", "num_heads", "num_layers"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)}: at least 1")
    if self.d_model % self.num_heads:
      raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
    if (self.d_model // self.num_heads) % 2:
      raise ValueError(f"d_model={self.d_model} / num_heads={self.num_heads} = {self.d_model // self.num_heads}: the "
                       f"head width must be even (the rotary position embedding rotates pairs of features)")
    if not 1 <= self.moe_every <= self.num_layers:
      raise ValueError(f"moe_every={self.moe_every} leaves no MoE layer among {self.num_layers} layers")
    check_layer(self.moe_config(), mesh, EXPERT_AXIS, self.impl, batch_axes(mesh), tensor_axis(mesh))

  def flops_per_token(self) -> float:
    """Model FLOPs of one training token: 6 per multiply-add (2 forward, 4 backward) of the matmuls a token runs
    through (attention projections, router, the k routed experts and the shared ones, dense MLPs, the head) and of
    causal attention over the sequence (half of the L x L scores)."""
    return sum(self.flops_per_token_by_part().values())

  def flops_per_token_by_part(self) -> dict[str, float]:
    """``flops_per_token`` split by the parts of the model a step profile times (``step_profile.PARTS``):
    "routed_experts" (the k routed SwiGLU experts of every MoE layer), "moe_other" (routers and shared experts),
    "attention" (QK^T and AV: 2 L D multiply-adds per token and layer, halved for causality) and "rest"
    (attention projections, dense MLPs, the head)."""
    D, F, L = self.d_model, self.d_ff, self.seq_len
    moe_layers = sum(1 for i in range(self.num_layers) if i % self.moe_every == self.moe_every - 1)
    dense_layers = self.num_layers - moe_layers
    return {"routed_experts": 6.0 * moe_layers * self.top_k * 3 * D * F,
            "moe_other": 6.0 * moe_layers * (self.shared_experts * 3 * D * F + D * self.num_experts),
            "attention": 6.0 * self.num_layers * L * D,
            "rest": 6.0 * (self.num_layers * 4 * D * D + dense_layers * 3 * D * F + D * self.vocab_size)}

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict) -> "ModelConfig":
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


# ----------------------------------------------------------------------------------------------------------------
# Devices and mesh.


def make_mesh(num_devices: int | None = None, axis_type: str = "auto", shape: str | None = None) -> jax.sharding.Mesh:
  """A mesh over the devices of the default backend (all GPUs when present, else the CPU devices): this process's,
  or in a jax.distributed job every process's (``num_devices`` then must be None).

  ``shape``: None for a 1-D mesh whose one axis, ``"expert"``, spans every device; else ``"data=2,expert=2"``, axes
  in that order whose sizes multiply to the device count, one of them ``"expert"``. Experts are sharded over the
  expert axis, and their hidden width over an axis named ``"tensor"`` if there is one (expert tensor parallelism);
  tokens (the batch) over every axis (``batch_axes``: the others, each position on them an independent
  expert-parallel group); every other parameter is replicated (data parallel). ``axis_type``: "auto" (XLA
  propagates shardings) or "explicit" (shardings are part of the array types); the model runs on either.
  """
  if num_devices is not None and num_devices < 1:     # None means every device; 0 is not a count of devices
    raise ValueError(f"--devices {num_devices}: at least 1")
  devices = jax.devices()
  if num_devices and jax.process_count() > 1:
    raise ValueError(f"--devices {num_devices}: a job of {jax.process_count()} processes uses every process's "
                     f"devices (choose each process's with --local-device-ids)")
  if num_devices:
    if num_devices > len(devices):
      raise ValueError(f"asked for {num_devices} devices, but only {len(devices)} {devices[0].platform} devices "
                       f"are present")
    devices = devices[:num_devices]
  names, sizes = parse_mesh_shape(shape, len(devices))
  types = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
  return jax.make_mesh(sizes, names, axis_types=(types[axis_type],) * len(names), devices=devices)


def parse_mesh_shape(shape: str | None, num_devices: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
  """``"data=2,expert=2"`` -> (("data", "expert"), (2, 2)); None -> (("expert",), (num_devices,))."""
  if not shape:
    return (EXPERT_AXIS,), (num_devices,)
  expected = f"mesh {shape!r}: expected axis=size pairs separated by commas, e.g. data=2,expert=2"
  try:
    pairs = [(name.strip(), int(size)) for name, size in (item.split("=") for item in shape.split(","))]
  except ValueError:
    raise ValueError(expected) from None
  if not all(name for name, _ in pairs):
    raise ValueError(expected)
  names, sizes = tuple(n for n, _ in pairs), tuple(s for _, s in pairs)
  # One message per rule, so that a typo or a slip in one axis is named, not the rules listed.
  if EXPERT_AXIS not in names:
    raise ValueError(f"mesh {shape!r} has no axis named {EXPERT_AXIS!r} (the experts are sharded over it; an axis "
                     f"named {TENSOR_AXIS!r} splits their hidden width, every other axis shards the batch)")
  twice = sorted({n for n in names if names.count(n) > 1})
  if twice:
    raise ValueError(f"mesh {shape!r} names axis {', '.join(map(repr, twice))} more than once")
  small = [f"{n}={s}" for n, s in pairs if s < 1]
  if small:
    raise ValueError(f"mesh {shape!r}: {', '.join(small)}: every axis needs a size of at least 1")
  if int(np.prod(sizes)) != num_devices:
    raise ValueError(f"mesh {shape!r} has {int(np.prod(sizes))} devices, but {num_devices} are in use")
  return names, sizes


def batch_axes(mesh) -> tuple[str, ...]:
  """The mesh axes other than the expert and tensor axes: the tokens are sharded over them too (``jmo.MoE``'s
  batch_axes)."""
  return tuple(a for a in mesh.axis_names if a not in (EXPERT_AXIS, TENSOR_AXIS))


def tensor_axis(mesh) -> str | None:
  """The tensor axis of expert tensor parallelism (``jmo.MoE``'s tensor_axis), if the mesh has one."""
  return TENSOR_AXIS if TENSOR_AXIS in mesh.axis_names else None


def put_global(a: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """A host array every process holds whole, as a global array with ``sharding`` (each process places its shards:
  one process or many)."""
  return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])


def batch_sharding(mesh) -> NamedSharding:
  """Sequences sharded over every mesh axis, the batch axes first, the tensor axis last (``moe_experts``' token
  layout)."""
  axes = (*batch_axes(mesh), EXPERT_AXIS, *([TENSOR_AXIS] if tensor_axis(mesh) else []))
  return NamedSharding(mesh, P(axes if len(axes) > 1 else EXPERT_AXIS, None))


# ----------------------------------------------------------------------------------------------------------------
# The model.


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
  """Rotary position embedding on x [B, T, N, H] (H even)."""
  half = x.shape[-1] // 2
  freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
  angle = positions[:, None].astype(jnp.float32) * freq[None, :]             # [T, H/2]
  sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class CausalSelfAttention(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    if cfg.attention not in ATTENTION_IMPLS:
      raise ValueError(f"attention={cfg.attention!r}: one of {ATTENTION_IMPLS}")
    self.num_heads = cfg.num_heads
    self.implementation = cfg.attention
    dtype = jnp.dtype(cfg.dtype)
    self.qkv = nnx.Linear(cfg.d_model, 3 * cfg.d_model, use_bias=False, dtype=dtype, rngs=rngs)
    self.out = nnx.Linear(cfg.d_model, cfg.d_model, use_bias=False, dtype=dtype, rngs=rngs,
                          kernel_init=nnx.initializers.normal(0.02 / np.sqrt(2 * cfg.num_layers)))

  def __call__(self, x: jax.Array) -> jax.Array:
    B, T, D = x.shape
    q, k, v = jnp.split(self.qkv(x).reshape(B, T, 3 * self.num_heads, D // self.num_heads), 3, axis=2)
    pos = jnp.arange(T)
    q, k = rope(q, pos), rope(k, pos)
    with jax.named_scope(ATTENTION_SCOPE):
      y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.implementation)
    return self.out(y.reshape(B, T, D))


class SwiGLU(nnx.Module):
  """Dense feed-forward block (used in the layers without an MoE when moe_every > 1)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.up = nnx.Linear(cfg.d_model, 2 * cfg.d_ff, use_bias=False, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(cfg.d_ff, cfg.d_model, use_bias=False, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    g, u = jnp.split(self.up(x), 2, axis=-1)
    return self.down(jax.nn.silu(g) * u)


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, mesh, use_moe: bool, *, rngs: nnx.Rngs):
    self.use_moe = use_moe
    self.attn_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
    self.attn = CausalSelfAttention(cfg, rngs=rngs)
    self.ffn_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
    if use_moe:
      self.ffn = jmo.MoE(cfg.moe_config(), mesh=mesh, expert_axis=EXPERT_AXIS, impl=cfg.impl,
                         batch_axes=batch_axes(mesh), tensor_axis=tensor_axis(mesh), rngs=rngs)
    else:
      self.ffn = SwiGLU(cfg, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.attn_norm(x))
    h = self.ffn_norm(x)
    if self.use_moe:
      with jax.named_scope(MOE_SCOPE):
        y, aux = self.ffn(h)       # aux: load_balance_loss, router_z_loss, dropped_fraction
    else:
      y, aux = self.ffn(h), None
    return x + y, aux


class Transformer(nnx.Module):
  """Decoder-only LM: tokens [B, T] int -> (logits [B, T, 256] float32, aux) where aux averages the router
  statistics (``load_balance_loss``, ``router_z_loss``, ``dropped_fraction``) over the MoE layers."""

  def __init__(self, cfg: ModelConfig, mesh: jax.sharding.Mesh, *, rngs: nnx.Rngs):
    cfg.check(mesh)
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
    self.blocks = nnx.List([Block(cfg, mesh, use_moe=(i % cfg.moe_every == cfg.moe_every - 1), rngs=rngs)
                            for i in range(cfg.num_layers)])
    self.final_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
    self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False,
                           kernel_init=nnx.initializers.normal(0.02), rngs=rngs)

  def __call__(self, tokens: jax.Array):
    # A one-hot matmul instead of a gather: with 256 byte values it is cheap, and it needs no sharding annotation
    # for batch-sharded token ids on an Explicit mesh.
    x = (jax.nn.one_hot(tokens, self.cfg.vocab_size, dtype=jnp.float32) @ self.embed.embedding[...])
    x = x.astype(jnp.dtype(self.cfg.dtype))
    auxes = []
    for block in self.blocks:
      x, aux = block(x)
      if aux is not None:
        auxes.append(aux)
    x = self.final_norm(x)
    logits = self.head(x.astype(jnp.float32))
    aux = jax.tree.map(lambda *a: sum(a) / len(a), *auxes)
    return logits, aux


def choose_attention(cfg: ModelConfig, mesh: jax.sharding.Mesh, batch_size: int,
                     request: str = "auto") -> tuple[str, str]:
  """(implementation, reason): how ``jax.nn.dot_product_attention`` runs in this model, chosen once per run.

  "cudnn" (cuDNN's fused flash attention: the [B, N, L, L] scores are never in memory) where it applies: a GPU
  backend, a bfloat16 or float16 compute dtype, and shapes and shardings cuDNN takes, which is checked by compiling
  the attention's forward and backward at the run's shapes (``batch_size`` sequences sharded like a batch) on the
  mesh; "xla" (XLA's attention, which materializes the scores) elsewhere and on CPU. ``request`` "xla" or "cudnn"
  asks for one; a "cudnn" that does not apply raises ValueError with the reason.
  """
  if request == "xla":
    return "xla", "asked for"
  if request not in ("auto", "cudnn"):
    raise ValueError(f"attention {request!r}: auto, xla or cudnn")
  platform = jax.default_backend()
  if platform != "gpu":
    why = f"cuDNN attention needs a GPU, the backend is {platform}"
  elif jnp.dtype(cfg.dtype) not in (jnp.bfloat16, jnp.float16):
    why = f"cuDNN's flash attention takes bfloat16 or float16, the compute dtype is {cfg.dtype}"
  else:
    why = _cudnn_attention_refusal(cfg, mesh, batch_size)
  if why is None:
    return "cudnn", "cuDNN flash attention: a GPU, a 16-bit compute dtype and shapes cuDNN takes"
  if request == "cudnn":
    raise ValueError(f"--attention cudnn does not apply: {why}")
  return "xla", why


def _cudnn_attention_refusal(cfg: ModelConfig, mesh: jax.sharding.Mesh, batch_size: int) -> str | None:
  """None when the model's attention compiles with implementation="cudnn" (forward and backward, at the run's
  shapes and batch sharding), else why not."""
  shape = (batch_size, cfg.seq_len, cfg.num_heads, cfg.d_model // cfg.num_heads)
  qkv = jax.ShapeDtypeStruct(shape, jnp.dtype(cfg.dtype), sharding=batch_sharding(mesh))

  def loss(q, k, v):
    y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return jnp.sum(y.astype(jnp.float32))

  try:
    with jax.set_mesh(mesh):
      jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(qkv, qkv, qkv).compile()
  except Exception as e:  # pylint: disable=broad-exception-caught  # cuDNN's refusals come as several types
    return f"cuDNN refused the attention: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}"
  return None


def create_model(cfg: ModelConfig, mesh: jax.sharding.Mesh, seed: int) -> Transformer:
  """Initializes the model, placed on the mesh: experts sharded over the expert axis (the MoE parameters'
  ``sharding_names``), everything else replicated."""
  graphdef, _ = abstract_model(cfg, mesh)
  # impl and capacity factor do not change the parameters: one compiled initializer serves every variant.
  init = _initializer(dataclasses.replace(cfg, impl="reference", capacity_factor=None), mesh, seed)
  return nnx.merge(graphdef, init())


@functools.lru_cache(maxsize=None)
def abstract_model(cfg: ModelConfig, mesh: jax.sharding.Mesh):
  """(graphdef, state of jax.ShapeDtypeStructs with their shardings): the model without computing anything."""
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, mesh, rngs=nnx.Rngs(0))))
  specs = nnx.get_partition_spec(abstract)
  abstract = jax.tree.map(lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec)),
                          abstract, specs)
  return graphdef, abstract


@functools.lru_cache(maxsize=None)
def _initializer(cfg: ModelConfig, mesh: jax.sharding.Mesh, seed: int):
  """The jit-compiled init of the state; cached, so that building the same model again compiles nothing."""
  _, abstract = abstract_model(cfg, mesh)
  shardings = jax.tree.map(lambda a: a.sharding, abstract)
  return jax.jit(lambda: nnx.state(Transformer(cfg, mesh, rngs=nnx.Rngs(seed))), out_shardings=shardings)


# ----------------------------------------------------------------------------------------------------------------
# Data: byte-level text with a held-out split.


def load_text(path: str | os.PathLike | None = None, block: int = 2048, eval_every: int = 10):
  """Returns (train, eval) uint8 arrays of bytes. The text is cut into blocks of ``block`` bytes; every
  ``eval_every``-th block is held out for evaluation, the rest (in order) is the training text. ValueError when the
  text is too short to hold out any byte: more than ``(eval_every - 1) * block`` bytes are needed."""
  data = np.frombuffer(pathlib.Path(path or DATA_FILE).read_bytes(), dtype=np.uint8)
  least = (eval_every - 1) * block + 1
  if len(data) < least:
    raise ValueError(f"the text has {len(data)} bytes; it needs at least {least}: every {eval_every}th block of "
                     f"{block} bytes is held out for evaluation, the first from byte {least - 1}")
  blocks = [data[i:i + block] for i in range(0, len(data), block)]
  train = np.concatenate([b for i, b in enumerate(blocks) if i % eval_every != eval_every - 1])
  held = np.concatenate([b for i, b in enumerate(blocks) if i % eval_every == eval_every - 1])
  return train, held


def train_batch(train: np.ndarray, step: int, seed: int, batch_size: int, seq_len: int) -> np.ndarray:
  """The batch of training step ``step`` (0-based): ``batch_size`` random windows of seq_len + 1 bytes. A pure
  function of (seed, step), so a resumed run sees exactly the data an uninterrupted one would."""
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(train) - seq_len - 1, size=batch_size)
  return np.stack([train[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def eval_batches(held: np.ndarray, batch_size: int, seq_len: int, max_batches: int,
                 multiple_of: int = 1) -> list[np.ndarray]:
  """Consecutive, non-overlapping windows of seq_len + 1 bytes of the held-out text, grouped into at most
  ``max_batches`` full batches of ``batch_size`` windows. A held-out text too short for one such batch gives one
  smaller batch instead: as many of its windows as divide by ``multiple_of`` (the devices the batch is sharded
  over), so every held-out byte that fits is scored, none twice. ValueError when not even
  ``multiple_of`` windows fit."""
  n = (len(held) - 1) // seq_len
  if n < max(multiple_of, 1):
    raise ValueError(f"the held-out text ({len(held)} bytes) holds {n} windows of {seq_len + 1} bytes; evaluating "
                     f"on {multiple_of} devices needs at least {multiple_of}")
  windows = np.stack([held[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int32)
  if n < batch_size:
    return [windows[:n - n % multiple_of]]
  nb = min(max_batches, n // batch_size)
  return [windows[i * batch_size:(i + 1) * batch_size] for i in range(nb)]


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints (orbax): items "model" (parameters), "opt" (optimizer state incl. its step count) and "meta" (JSON:
# model config, training arguments, loss history).


def checkpoint_manager(ckpt_dir: str, max_to_keep: int | None = 3, create: bool = True):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp.CheckpointManager(os.path.abspath(ckpt_dir),
                               options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create),
                               item_names=("model", "opt", "meta"))


def abstract_like(state):
  """ShapeDtypeStructs (with shardings) of a concrete state: the restore target."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)


def check_checkpoint_mesh(meta: dict, mesh: jax.sharding.Mesh, ckpt_dir: str) -> None:
  """ValueError unless ``mesh`` keeps the experts in the layout the checkpoint (its ``meta``) stored them in: a run
  on a mesh with a tensor axis keeps each w1 as its [E, D, 2, F] view (``jmo.MoE``'s tensor_axis), a run without one
  as [E, D, 2F], and a restore reads the arrays in the shapes this run's model has."""
  trained = meta.get("args", {}).get("mesh")
  had = bool(trained) and TENSOR_AXIS in [item.split("=")[0].strip() for item in trained.split(",")]
  if had == (tensor_axis(mesh) is not None):
    return
  where = f"--mesh {trained}" if trained else "the default mesh"
  if had:
    raise ValueError(f"{ckpt_dir} was trained on {where}, with a {TENSOR_AXIS!r} axis, so its w1 are stored as "
                     f"[E, D, 2, F]: restore it on a mesh with a {TENSOR_AXIS!r} axis (--mesh ...,{TENSOR_AXIS}=N)")
  raise ValueError(f"{ckpt_dir} was trained on {where}, without a {TENSOR_AXIS!r} axis, so its w1 are stored as "
                   f"[E, D, 2F]: restore it on a mesh without a {TENSOR_AXIS!r} axis")


def read_meta(ckpt_dir: str, step: int | None = None) -> tuple[int, dict]:
  """(step, meta) of the latest (or given) checkpoint in ckpt_dir."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  if not os.path.isdir(ckpt_dir):
    raise FileNotFoundError(f"no checkpoint directory {ckpt_dir}")
  mngr = checkpoint_manager(ckpt_dir, create=False)
  step = mngr.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint in {ckpt_dir}")
  meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  mngr.close()
  return step, meta
