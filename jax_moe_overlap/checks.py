"""Input rules of the library, each checked in exactly one place.

Every public entry point (``moe_experts``, ``MoE``, ``MoEConfig``, ``Workspace``) calls these instead of its own copy,
so a rule and its message change in one place. Each raises a ValueError or TypeError naming the problem before
anything runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_overlap.plan import SKIP

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)
IMPLS = ("overlap", "collective", "xla", "reference")


def check_axis(mesh: jax.sharding.Mesh, axis_name: str) -> int:
  """The mesh has an axis ``axis_name``; returns its size R."""
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


def check_inputs(x, expert_ids, gates, w1, w2, mesh, axis_name) -> None:
  """The arguments of ``moe_experts``: shapes, dtypes and their fit to the mesh axis."""
  R = check_axis(mesh, axis_name)
  if x.ndim != 2:
    raise ValueError(f"jax_moe_overlap: x must be [tokens, d_model], got shape {x.shape}")
  T, D = x.shape
  if w1.ndim not in (3, 4) or w2.ndim != 3 or (w1.ndim == 4 and w1.shape[2] != 2):
    raise ValueError(f"jax_moe_overlap: w1 must be [E, D, 2F] (or its view [E, D, 2, F]) and w2 [E, F, D], got "
                     f"{w1.shape} and {w2.shape}")
  E = w1.shape[0]
  width = w1.shape[2] * (w1.shape[3] if w1.ndim == 4 else 1)
  if w1.shape[1] != D or width % 2 or w2.shape != (E, width // 2, D):
    raise ValueError(f"jax_moe_overlap: weight shapes w1 {w1.shape}, w2 {w2.shape} do not fit d_model={D} "
                     f"(expected w1 [E, {D}, 2F] or [E, {D}, 2, F], w2 [E, F, {D}])")
  if expert_ids.ndim != 2 or expert_ids.shape[0] != T or gates.shape != expert_ids.shape:
    raise ValueError(f"jax_moe_overlap: expert_ids {expert_ids.shape} and gates {gates.shape} must both be "
                     f"[tokens={T}, k]")
  if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
    raise TypeError(f"jax_moe_overlap: expert_ids must be integers, got {expert_ids.dtype}")
  for name, a in (("x", x), ("w1", w1), ("w2", w2)):
    check_dtype(name, a.dtype)
  if not (x.dtype == w1.dtype == w2.dtype):
    raise TypeError(f"jax_moe_overlap: x, w1, w2 must share a dtype, got {x.dtype}, {w1.dtype}, {w2.dtype}")
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


def batch_size(mesh, batch_axes) -> int:
  """Devices along the batch axes: the number of independent expert-parallel groups the tokens split into."""
  return int(np.prod([mesh.shape[a] for a in batch_axes], dtype=np.int64))
