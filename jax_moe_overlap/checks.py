"""Input rules of the library, each checked in exactly one place.

Every public entry point (``moe_experts``, ``MoE``, ``MoEConfig``, ``Workspace``) calls these instead of its own copy
(``check_layer``: all of ``MoE``'s, for a script that checks its flags before it builds a model),
so a rule and its message change in one place. Each raises a ValueError or TypeError naming the problem before
anything runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_overlap import fp8
from jax_moe_overlap.plan import SKIP

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)
IMPLS = ("overlap", "collective", "xla", "reference")
# None, or the FP8 modes: "fp8" (DeepSeek-V3's recipe, every expert GEMM in FP8), "fp8_bf16_wgrad" (the same with
# the two weight gradients on bfloat16 operands: fp8_experts.bf16_wgrad).
QUANTIZATIONS = (None, "fp8", "fp8_bf16_wgrad")


def check_axis(mesh: jax.sharding.Mesh, axis_name: str) -> int:
  """The mesh is a ``jax.sharding.Mesh`` with an axis ``axis_name``; returns its size R."""
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"jax_moe_overlap: mesh must be a jax.sharding.Mesh (jax.make_mesh makes one), got "
                    f"{type(mesh).__name__}")
  if axis_name not in mesh.axis_names:
    raise ValueError(f"jax_moe_overlap: the mesh has axes {tuple(mesh.axis_names)} but no axis named "
                     f"{axis_name!r} for expert parallelism")
  return int(mesh.shape[axis_name])


def check_experts(num_experts: int, top_k: int, ranks: int, axis_name: str) -> None:
  """1 <= top_k <= num_experts, and the experts split evenly over the R ranks of the axis."""
  if top_k < 1 or top_k > num_experts:
    raise ValueError(f"jax_moe_overlap: top-k must be in [1, num_experts={num_experts}], got {top_k}")
  if num_experts % ranks:
    raise ValueError(f"jax_moe_overlap: {num_experts} experts cannot be split evenly over the {ranks} devices of "
                     f"mesh axis {axis_name!r}")


def check_tokens(tokens: int, ranks: int, axis_name: str) -> None:
  """At least one token on every device of the axis (the custom calls take no empty buffers), split evenly."""
  if tokens < 1:
    raise ValueError(f"jax_moe_overlap: x has no tokens; the layer needs at least one token on each of the {ranks} "
                     f"devices of mesh axis {axis_name!r}")
  if tokens % ranks:
    raise ValueError(f"jax_moe_overlap: {tokens} tokens cannot be split evenly over the {ranks} devices of mesh axis "
                     f"{axis_name!r}")


def check_impl(impl: str) -> None:
  if impl not in IMPLS:
    raise ValueError(f"jax_moe_overlap: impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")


def check_dtype(name: str, dtype) -> None:
  """A compute dtype of the expert layer: float32 or bfloat16."""
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    raise TypeError(f"jax_moe_overlap: {name} has dtype {jnp.dtype(dtype)}; supported: float32, bfloat16")


def check_capacity_factor(capacity_factor, name: str = "capacity_factor") -> None:
  """None (dropless) or a finite real number (whose sign rule is the caller's: ``plan.expert_capacity``, or
  ``MoEConfig``'s "<= 0: dropless")."""
  if capacity_factor is None:
    return
  if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float, np.integer, np.floating)) or (
      not np.isfinite(capacity_factor)):
    raise TypeError(f"jax_moe_overlap: {name} must be None (dropless) or a finite number, got {capacity_factor!r}")


def check_call_config(config) -> None:
  from jax_moe_overlap.config import CallConfig  # pylint: disable=g-import-not-at-top  # config imports this module
  if not isinstance(config, CallConfig):
    raise TypeError(f"jax_moe_overlap: config must be a CallConfig, got {config!r}")


def check_token_mask(token_mask, leading_shape: tuple[int, ...]) -> None:
  """None, or a bool mask of the tokens' leading shape (True: the token is routed)."""
  if token_mask is None:
    return
  if tuple(token_mask.shape) != tuple(leading_shape):
    raise ValueError(f"jax_moe_overlap: token_mask must have x's leading shape {tuple(leading_shape)}, got "
                     f"{tuple(token_mask.shape)}")
  if token_mask.dtype != jnp.bool_:
    raise TypeError(f"jax_moe_overlap: token_mask must be bool (False: a padding token), got {token_mask.dtype}")


def check_router_logits(logits, num_experts: int) -> None:
  if logits.ndim != 2 or logits.shape[1] != num_experts or not jnp.issubdtype(logits.dtype, jnp.floating):
    raise ValueError(f"jax_moe_overlap: router logits must be floating [tokens, num_experts={num_experts}], got "
                     f"{logits.dtype}{list(logits.shape)}")


def check_positive_int(what: str, v) -> int:
  """v as an int, where it is a positive int (a NumPy integer, as read from a checkpoint's metadata, included; a
  bool is not)."""
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
    raise ValueError(f"jax_moe_overlap: {what} must be a positive int, got {v!r}")
  return int(v)


def check_outside_shard_map(where: str) -> None:
  """The layer runs its own shard_map over the mesh it is given: called inside a shard_map (some axes Manual in the
  context mesh), its layouts would name a mesh other than the context's, and JAX fails deep in a reshape."""
  context = jax.sharding.get_abstract_mesh()
  manual = [n for n, t in zip(context.axis_names, getattr(context, "axis_types", ()))
            if t == jax.sharding.AxisType.Manual]
  if manual:
    raise ValueError(f"jax_moe_overlap: {where} called inside a shard_map over the axes {manual}: the layer runs "
                     "its own shard_map over the expert axis (and the batch and tensor axes you name), so call it "
                     "outside yours, on the global arrays")


def check_expert_vector(name: str, a, num_experts: int | None) -> None:
  """A per-expert floating vector (the routing bias, an expert load) of num_experts entries (None: any number)."""
  shape, dtype = getattr(a, "shape", None), getattr(a, "dtype", None)
  if (shape is None or len(shape) != 1 or (num_experts is not None and shape[0] != num_experts) or
      not jnp.issubdtype(dtype, jnp.floating)):
    want = "num_experts" if num_experts is None else f"num_experts={num_experts}"
    raise ValueError(f"jax_moe_overlap: {name} must be a floating-point [{want}] vector, got "
                     f"{dtype}{list(shape) if shape is not None else type(a).__name__}")


def check_quantization(quantization) -> None:
  if quantization not in QUANTIZATIONS:
    raise ValueError(f"jax_moe_overlap: quantization must be None (no quantization), 'fp8' or 'fp8_bf16_wgrad', "
                     f"got {quantization!r}")


def check_fp8_weight_dtype(name: str, dtype, quantization) -> None:
  """Under an FP8 quantization the layer quantizes the master weights in their own dtype (no cast to the compute
  dtype first), and takes float32 or bfloat16 ones (``_weight_shape_dtype``)."""
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    raise TypeError(f"jax_moe_overlap: {name} is {jnp.dtype(dtype)}: quantization={quantization!r} quantizes the master "
                    f"weights in it; supported: float32, bfloat16")


def check_fp8_sizes(d_model: int, d_ff: int) -> None:
  """quantization="fp8" tiles D and F by 128 (fp8.py): both multiples of 128."""
  if d_model % fp8.TILE or d_ff % fp8.TILE:
    raise ValueError(f"jax_moe_overlap: quantization='fp8' scales activations per 1 x {fp8.TILE} tile and weights "
                     f"per {fp8.TILE} x {fp8.TILE} block: d_model (emb_dim) and d_ff (moe_mlp_dim) must be multiples "
                     f"of {fp8.TILE}, got d_model={d_model}, d_ff={d_ff}")


def check_fp8_tensor_split(d_ff: int, tensor: int, tensor_axis: str | None) -> None:
  """quantization="fp8" with expert tensor parallelism: each device's F / TP hidden units are whole 128-wide tiles
  of h and a, and whole 128 x 128 blocks of w1's gate and up halves and of w2, so that every shard quantizes exactly
  the whole expert's tiles and blocks."""
  if tensor > 1 and (d_ff // tensor) % fp8.TILE:
    raise ValueError(f"jax_moe_overlap: quantization='fp8' with tensor_axis {tensor_axis!r} needs each device's share "
                     f"of the experts' hidden width to be whole {fp8.TILE} x {fp8.TILE} weight blocks and 1 x "
                     f"{fp8.TILE} tiles: d_ff (moe_mlp_dim) / {tensor} must be a multiple of {fp8.TILE}, got "
                     f"d_ff={d_ff}, {d_ff} / {tensor} = {d_ff // tensor}")


def check_fp8_impl(impl: str, mesh: jax.sharding.Mesh) -> None:
  """quantization="fp8" runs with every impl: "xla" and "reference" emulate the recipe on any device; "collective"
  and "overlap" run the FP8 grouped GEMM, on GPUs only where it runs (Hopper), on CPU its emulation."""
  if impl in ("xla", "reference"):
    return
  gpus = [d for d in mesh.devices.flat
          if d.platform == "gpu" and getattr(d, "compute_capability", None) is not None]
  from jax_moe_overlap import engines   # (engines imports the CUDA workspace module: only where it is asked)
  for d in gpus:
    why = engines.fp8_gemm_device_refusal(_compute_capability(d))
    if why is not None:
      raise ValueError(f"jax_moe_overlap: quantization='fp8' with impl={impl!r} runs the FP8 grouped GEMM: "
                       f"{why}; {d} ({d.device_kind}) has compute capability {d.compute_capability}. impl='xla' "
                       f"emulates the recipe on any device")


def _compute_capability(device) -> tuple[int, int]:
  """(major, minor) of a GPU device's compute capability (JAX gives it as the string "9.0")."""
  return tuple(int(v) for v in str(device.compute_capability).split(".")[:2])


def _weight_shape_dtype(name: str, w, quantization):
  """(shape, dtype) of a weight argument: a float array, or under quantization="fp8" also an ``fp8.Fp8Weight`` (its
  logical [E, K, N] shape, dtype None)."""
  if isinstance(w, fp8.Fp8Weight):
    if quantization is None:
      raise TypeError(f"jax_moe_overlap: {name} is a pre-quantized Fp8Weight, which only the FP8 quantizations take")
    # [E, N, K], or of w1's view [E, 2, F, D]; any other form gets scales no shape matches.
    v = tuple(w.values.shape)
    scales = ((*v[:-2], v[-2] // fp8.TILE, v[-1] // fp8.TILE)
              if len(v) == 3 or (len(v) == 4 and name == "w1" and v[1] == 2) else None)
    if w.values.dtype != fp8.E4M3 or w.scales.dtype != jnp.float32 or tuple(w.scales.shape) != scales:
      raise TypeError(f"jax_moe_overlap: {name}: an Fp8Weight holds float8_e4m3fn values [E, N, K] and float32 "
                      f"scales [E, N / {fp8.TILE}, K / {fp8.TILE}] (w1's also [E, 2, F, D] and [E, 2, F / "
                      f"{fp8.TILE}, D / {fp8.TILE}]: fp8.quantize_weights makes them), got "
                      f"{w.values.dtype}{list(w.values.shape)} and {w.scales.dtype}{list(w.scales.shape)}")
    return w.shape, None
  if not hasattr(w, "shape") or not hasattr(w, "dtype"):
    # (an orbax restore without a target gives an Fp8Weight back as a dict of its arrays)
    raise TypeError(f"jax_moe_overlap: {name} must be an array{' or an Fp8Weight' if quantization else ''}, got "
                    f"{type(w).__name__}")
  if quantization is None:
    check_dtype(name, w.dtype)
  else:
    check_fp8_weight_dtype(name, w.dtype, quantization)
  return tuple(w.shape), w.dtype


def check_weight_shapes(s1: tuple[int, ...], s2: tuple[int, ...], d_model: int) -> tuple[int, int]:
  """w1 [E, D, 2F] (or its view [E, D, 2, F]) and w2 [E, F, D] of shapes s1 and s2, D = d_model: returns (E, F)."""
  if len(s1) not in (3, 4) or len(s2) != 3 or (len(s1) == 4 and s1[2] != 2):
    raise ValueError(f"jax_moe_overlap: w1 must be [E, D, 2F] (or its view [E, D, 2, F]) and w2 [E, F, D], got "
                     f"{s1} and {s2}")
  E = s1[0]
  width = s1[2] * (s1[3] if len(s1) == 4 else 1)
  if s1[1] != d_model or width % 2 or s2 != (E, width // 2, d_model):
    raise ValueError(f"jax_moe_overlap: weight shapes w1 {s1}, w2 {s2} do not fit d_model={d_model} "
                     f"(expected w1 [E, {d_model}, 2F] or [E, {d_model}, 2, F], w2 [E, F, {d_model}])")
  return E, width // 2


def check_master_weight(where: str, name: str, value) -> None:
  """A module's parameter is a float array: a pre-quantized ``fp8.Fp8Weight`` (``quantize_weights``' output, which
  ``moe_experts`` takes for inference) is neither a module's parameter nor any checkpoint layout's tensor."""
  if isinstance(value, fp8.Fp8Weight):
    raise TypeError(f"jax_moe_overlap: {where}: {name} is a pre-quantized Fp8Weight; MoE's parameters are the "
                    "master weights, float arrays (quantization='fp8' quantizes them per call; quantize_weights "
                    "gives the Fp8Weights that moe_experts takes)")


def check_inputs(x, expert_ids, gates, w1, w2, mesh, axis_name, quantization=None) -> None:
  """The arguments of ``moe_experts``: shapes, dtypes and their fit to the mesh axis. Without quantization x, w1 and
  w2 share a dtype; with quantization="fp8" each weight is float32, bfloat16 or an ``fp8.Fp8Weight``, whatever x's
  dtype, and D and F are multiples of 128."""
  R = check_axis(mesh, axis_name)
  check_quantization(quantization)
  if x.ndim != 2:
    raise ValueError(f"jax_moe_overlap: x must be [tokens, d_model], got shape {x.shape}")
  T, D = x.shape
  check_dtype("x", x.dtype)
  (s1, dt1), (s2, dt2) = _weight_shape_dtype("w1", w1, quantization), _weight_shape_dtype("w2", w2, quantization)
  E, F = check_weight_shapes(s1, s2, D)
  if expert_ids.ndim != 2 or expert_ids.shape[0] != T or gates.shape != expert_ids.shape:
    raise ValueError(f"jax_moe_overlap: expert_ids {expert_ids.shape} and gates {gates.shape} must both be "
                     f"[tokens={T}, k]")
  if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
    raise TypeError(f"jax_moe_overlap: expert_ids must be integers, got {expert_ids.dtype}")
  if not jnp.issubdtype(gates.dtype, jnp.floating):
    raise TypeError(f"jax_moe_overlap: gates must be real floating point, got {gates.dtype}")
  if quantization is None and not (x.dtype == dt1 == dt2):
    raise TypeError(f"jax_moe_overlap: x, w1, w2 must share a dtype, got {x.dtype}, {dt1}, {dt2}")
  if quantization is not None:
    check_fp8_sizes(D, F)
  check_experts(E, expert_ids.shape[1], R, axis_name)
  check_tokens(T, R, axis_name)


def check_expert_ids(expert_ids, num_experts: int) -> None:
  """Concrete expert ids must lie in [0, E) or be ``SKIP`` (-1); traced ones are checked by the custom calls at run
  time (the other impls give an invalid id no output, as for a skipped slot)."""
  try:
    ids = np.asarray(expert_ids)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return
  if ids.size == 0:
    return
  bad = (ids != SKIP) & ((ids < 0) | (ids >= num_experts))
  if bad.any():
    lo, hi = int(ids.min()), int(ids.max())
    raise ValueError(f"jax_moe_overlap: expert ids must lie in [0, {num_experts}), got values in [{lo}, {hi}] "
                     f"({SKIP} marks a skipped slot; other values are errors)")


def check_batch_axes(mesh, axis_name, batch_axes, tokens, tensor_axis: str | None = None) -> tuple[str, ...]:
  """The batch axes as a tuple of distinct mesh axes other than ``axis_name`` and ``tensor_axis``, T divisible by
  all token shards (the devices of the batch axes, the expert axis and the tensor axis)."""
  batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
  for a in batch_axes:
    if a not in mesh.axis_names or a in (axis_name, tensor_axis) or batch_axes.count(a) > 1:
      other = f" and the tensor axis {tensor_axis!r}" if tensor_axis is not None else ""
      raise ValueError(f"jax_moe_overlap: batch_axes {batch_axes} must be distinct axes of the mesh "
                       f"{tuple(mesh.axis_names)} other than the expert axis {axis_name!r}{other}")
  token_axes = (*batch_axes, axis_name) + ((tensor_axis,) if tensor_axis is not None else ())
  shards = batch_size(mesh, token_axes)
  if tokens % shards:
    raise ValueError(f"jax_moe_overlap: {tokens} tokens cannot be split evenly over the {shards} devices of mesh "
                     f"axes {token_axes}")
  return batch_axes


def check_tensor_axis(mesh, axis_name: str, tensor_axis: str | None) -> int:
  """The tensor axis of expert tensor parallelism (each expert's hidden width F split over it): None (no tensor
  parallelism, size 1) or a mesh axis other than the expert axis. Returns its size."""
  if tensor_axis is None:
    return 1
  if not isinstance(tensor_axis, str) or tensor_axis not in mesh.axis_names:
    raise ValueError(f"jax_moe_overlap: tensor_axis {tensor_axis!r} is not an axis of the mesh "
                     f"{tuple(mesh.axis_names)}")
  if tensor_axis == axis_name:
    raise ValueError(f"jax_moe_overlap: tensor_axis {tensor_axis!r} is the expert axis; the experts' hidden width is "
                     "split over another mesh axis than the one the experts are split over")
  return int(mesh.shape[tensor_axis])


def check_tensor_split(hidden: int, tensor: int, tensor_axis: str | None) -> None:
  """The experts' hidden width F splits evenly over the tensor axis (each device takes F / size columns of the gate
  and of the up projection, and as many rows of w2)."""
  if hidden % tensor:
    raise ValueError(f"jax_moe_overlap: the experts' hidden width F={hidden} cannot be split evenly over the {tensor} "
                     f"devices of tensor axis {tensor_axis!r} (each takes F / {tensor} columns of w1's gate and of its "
                     f"up projection, and as many rows of w2)")


def check_layer(config, mesh, expert_axis: str, impl: str, batch_axes=(), tensor_axis: str | None = None
                ) -> tuple[str, ...]:
  """A layer of ``config`` (an ``MoEConfig``) on ``mesh``: every rule ``MoE`` checks when it is built (the expert
  axis and its split of the experts, the impl, the tensor axis and its split of the hidden width, FP8's split and
  impl, the batch axes), for callers that check their flags before they build a model. Returns the batch axes as a
  tuple. The tokens' count is checked per call (0 tokens split over any devices)."""
  R = check_axis(mesh, expert_axis)
  check_experts(config.num_experts, config.num_experts_per_tok, R, expert_axis)
  check_impl(impl)
  TP = check_tensor_axis(mesh, expert_axis, tensor_axis)
  check_tensor_split(config.moe_mlp_dim, TP, tensor_axis)
  if config.quantization is not None:
    check_fp8_tensor_split(config.moe_mlp_dim, TP, tensor_axis)
    check_fp8_impl(impl, mesh)
  return check_batch_axes(mesh, expert_axis, batch_axes, 0, tensor_axis)


def batch_size(mesh, batch_axes) -> int:
  """Devices along the batch axes: the number of independent expert-parallel groups the tokens split into."""
  return int(np.prod([mesh.shape[a] for a in batch_axes], dtype=np.int64))
