"""The peer workspace: each rank's symmetric buffers and signal words, owned by one Python object.

A ``Workspace`` belongs to one mesh and one expert-parallel axis. The axis' ``R`` devices form a *group*; the
other mesh axes (if any) enumerate ``G`` independent groups. Under expert tensor parallelism the group is the
devices of the expert axis and the tensor axis together (``axis_name`` a tuple of both: R = their product). The
native side keeps, per group and rank, one block laid out by ``ffi/include/jax_moe_overlap/protocol.h`` (recv rows,
ret rows, stage rows, tile-ready flags and the monotonic counters) plus the per-rank consumer engine, and the custom
calls name the workspace by ``handle``.

Workspaces are cached per (devices, axis): a call gets the smallest cached workspace of its mesh and axis that fits its
sizes, else a new one whose row counts are rounded up to a power of two (``bucket``), so every MoE layer of a model
shares one and a decode loop over batch sizes 1..256 allocates at most log2(256) + 1 times per layer width (once,
when its largest batch comes first or ``reserve`` made room). Sharing is safe because each device runs its workspace
calls one after another in program order, the same order on every rank of a group (on CPU enforced by a token chain,
``ordering.py``; on GPU by the one stream), and every call is one epoch of the protocol.

Processes: a group may span the processes of a ``jax.distributed`` job on one host (an expert axis over processes;
``workspace_backend.create_shared``). On CPU each process holds its own ranks' blocks in POSIX shared memory and maps
its peers' (``workspace_cpu``); on CUDA each process cudaMallocs its own ranks' blocks and opens its peers' through
CUDA IPC handles, and the group memory is a POSIX shared-memory object every process maps and registers with CUDA
(``workspace_cuda``). The protocol, epochs and bounded waits are the same; a timeout names the process of
the awaited peer. The routing counts of such a workspace cross ranks through it as well (``spans_processes``: the
layer calls ``exchange_counts`` instead of ``jax.lax.all_gather``, whose wait across processes on the collective
backend has no timeout, and counts the dropped slots from the exchanged counts instead of a ``psum``), so every wait
of a layer call is a bounded workspace wait: a peer process that dies or hangs (stopped, not dead), inside a call or
between calls, makes the others fail within ``timeout_ms`` with an error naming its rank, its process and the stage
(``counts`` when it was lost between calls), and the workspace recovers on the next call once every rank is back.
An expert axis over processes of different hosts is refused (``moe_experts`` runs it as ``impl="collective"``).

Memory: ``Workspace.bytes_per_rank`` (and ``workspace_bytes`` before anything is allocated) is what one rank holds:
on CPU host memory; on CUDA device memory of that rank's GPU (plus host-mapped control words), allocated with
cudaMalloc *outside* XLA's allocator. XLA preallocates ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (default 0.75) of each
GPU when the backend starts, so the workspace must fit in the rest: lower the fraction (or set
``XLA_PYTHON_CLIENT_PREALLOCATE=false``) when the workspaces of the largest layer shapes do not fit in 25% of the GPU.
``release_workspaces()`` frees every workspace (after waiting for the programs in flight) and they are released when
the process exits.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import threading
import warnings
from typing import Callable

import jax
import numpy as np

from jax_moe_overlap import _ffi
from jax_moe_overlap import _jmo
from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap import workspace_cpu
from jax_moe_overlap import workspace_cuda
from jax_moe_overlap.checks import (check_axis, check_capacity_factor, check_dtype, check_experts, check_positive_int,
                                    check_quantization)


@dataclasses.dataclass(frozen=True)
class WorkspaceSizes:
  """Per-rank capacities. row_bytes: widest row (model dim x bytes per element); recv_rows: rows one rank can
  receive in a call; ret_rows: slots of one rank (T*k); num_segments: E_local * R."""

  row_bytes: int
  recv_rows: int
  ret_rows: int
  num_segments: int

  def fits(self, needed: "WorkspaceSizes") -> bool:
    """Whether a workspace of these sizes can serve calls of ``needed`` (every capacity at least as large)."""
    return (self.row_bytes >= needed.row_bytes and self.recv_rows >= needed.recv_rows and
            self.ret_rows >= needed.ret_rows and self.num_segments >= needed.num_segments)

  def bucket(self) -> "WorkspaceSizes":
    """The sizes a new workspace is allocated with: row counts rounded up to a power of two (at most 2x the rows
    asked for), so that calls with fewer tokens reuse it."""
    return dataclasses.replace(self, recv_rows=_pow2(self.recv_rows), ret_rows=_pow2(self.ret_rows))

  def bytes_per_rank(self) -> int:
    """Bytes of one rank's block (protocol.h's layout: control words, tile-ready flags, recv, ret and stage rows)."""
    return int(_jmo.workspace_bytes_per_rank(self.row_bytes, self.recv_rows, self.ret_rows, self.num_segments))


def group_axes(axis_name: str | tuple[str, ...]) -> str | tuple[str, ...]:
  """The mesh axes of a workspace's groups in one spelling: one axis as its name (a 1-tuple too), several as a tuple
  (the expert axis, then the tensor axis)."""
  if isinstance(axis_name, str):
    return axis_name
  axes = tuple(axis_name)
  return axes[0] if len(axes) == 1 else axes


def _pow2(n: int) -> int:
  return 1 << max(0, math.ceil(math.log2(n))) if n > 0 else 0


def layer_sizes(tokens_per_rank: int, ranks: int, top_k: int, num_experts: int, d_model: int, itemsize: int,
                capacity_factor: float | None, tensor: int = 1, gather_rs: bool = False,
                quantization: str | None = None) -> WorkspaceSizes:
  """The capacities one MoE layer call needs. Every row that crosses ranks is d_model wide (tokens, their gradients,
  expert outputs): the lhs of a GEMM (F or 2F wide) never leaves its rank, so rows are d_model x itemsize bytes.

  ranks: the expert axis' size R; tensor: the tensor axis' size TP (expert tensor parallelism: the group is the
  R TP devices of both axes, each holding the tensor shards of E / R experts, and each slot of a token is TP slots,
  one per shard: ``tensor_parallel.py``). A rank receives a row of an expert's shard for every row the expert
  takes, so its recv rows are those of an expert-parallel rank of the group's R TP ranks; its ret rows are its
  T k TP slots.

  gather_rs: the layer sums the shards' partials with GatherRS (``call_site.tensor_reduce``): its ret rows also hold
  the group's float32 partials of the rank's tokens (G T d_model x 4 bytes), and its recv rows the return of the
  gates' gradient to its T k TP slots (one row per slot).

  quantization="fp8" (``fp8_overlap.py``): the tokens and their gradients cross as packed e4m3 rows
  (``row_bytes("uint8", d_model)``: d_model + d_model / 32 bytes), the expert outputs and the input gradient in the
  compute dtype, each back to its T k slots (by expert_combine's ret rows, or where the layer does not fuse them,
  ``call_site.fp8_fused_combine``, by a dispatch: its recv rows, the slots)."""
  group = ranks * tensor
  cap_e = plan_lib.expert_capacity(tokens_per_rank, group, top_k, num_experts, capacity_factor)
  e_local = num_experts // ranks
  cap = plan_lib.recv_capacity(tokens_per_rank, group, top_k, e_local, cap_e)
  slots = tokens_per_rank * top_k * tensor
  recv, ret = cap, slots
  row = d_model * itemsize
  if gather_rs:
    recv = max(cap, slots)
    ret = max(slots, -(-group * tokens_per_rank * 4 // itemsize))
  if quantization is not None:
    recv = max(cap, slots)
    row = max(row, row_bytes("uint8", d_model))
  return WorkspaceSizes(row_bytes=row, recv_rows=recv, ret_rows=ret, num_segments=e_local * group)


def row_bytes(dtype, channels: int) -> int:
  """Bytes of one row of ``channels`` channels as the workspace holds and ships it (ffi/common/dtype.h's RowBytes):
  dtype float32 or bfloat16 (its elements), or "uint8": packed e4m3 rows (``fp8.pack_rows``: the e4m3 values, then a
  float32 scale per 128 channels)."""
  return int(_jmo.row_bytes(np.dtype(dtype).name, channels))


def workspace_bytes(tokens: int, d_model: int, top_k: int, num_experts: int, *, ranks: int, dtype="float32",
                    capacity_factor: float | None = None, token_shards: int | None = None, tensor: int = 1,
                    gather_rs: bool = False, quantization: str | None = None) -> int:
  """Bytes per rank of the workspace that ``moe_experts`` allocates for a layer call of this shape (after rounding
  up to its bucket), for planning memory before anything runs.

  tokens: T of the call (global); ranks: size of the expert axis; tensor: size of the tensor axis (expert tensor
  parallelism); token_shards: devices the tokens are split over (ranks x tensor x the batch axes' sizes; default
  ranks x tensor); gather_rs: the call sums its tensor shards' partials by GatherRS (``call_site.tensor_reduce``);
  quantization: the layer's (``layer_sizes``).
  """
  for name, v in (("tokens", tokens), ("d_model", d_model), ("ranks", ranks), ("tensor", tensor),
                  ("token_shards", 1 if token_shards is None else token_shards)):
    check_positive_int(f"workspace_bytes' {name}", v)
  check_experts(num_experts, top_k, 1, "")  # top_k in [1, num_experts]; their split over the ranks below
  check_dtype("workspace_bytes' layer", dtype)
  check_capacity_factor(capacity_factor)
  check_quantization(quantization)
  shards = ranks * tensor if token_shards is None else token_shards
  if tokens % shards or num_experts % ranks:
    raise ValueError(f"jax_moe_overlap: {tokens} tokens over {shards} shards and {num_experts} experts over {ranks} "
                     "ranks must split evenly")
  itemsize = np.dtype(dtype).itemsize
  return layer_sizes(tokens // shards, ranks, top_k, num_experts, d_model, itemsize, capacity_factor,
                     tensor, gather_rs, quantization).bucket().bytes_per_rank()


class Workspace:
  """Symmetric peer buffers and flags of one expert-parallel mesh axis.

  Use ``Workspace.get(mesh, axis_name, sizes)``: it returns the cached workspace for these devices and sizes.
  """

  _cache: dict[tuple, list["Workspace"]] = {}
  _lock = threading.Lock()
  _release_hooks: list[Callable[["Workspace"], None]] = []

  def __init__(self, mesh: jax.sharding.Mesh, axis_name: str | tuple[str, ...], sizes: WorkspaceSizes):
    axis_name = group_axes(axis_name)
    axes = (axis_name,) if isinstance(axis_name, str) else axis_name
    ranks = [check_axis(mesh, a) for a in axes]
    _ffi.register()
    self.mesh = mesh
    # One mesh axis, or a tuple of them (the expert and tensor axes of expert tensor parallelism), whose devices
    # form one group: inside shard_map, jax.lax.axis_index and all_gather take it as it is.
    self.axis_name = axis_name
    self.sizes = sizes
    self.ranks = int(np.prod(ranks))
    self.groups = int(mesh.devices.size // self.ranks)
    self.other_axes = tuple(a for a in mesh.axis_names if a not in axes)
    platforms = {d.platform for d in mesh.devices.flat}
    if len(platforms) != 1:
      raise ValueError(f"jax_moe_overlap: a mesh mixing platforms {sorted(platforms)} is not supported")
    self.platform = platforms.pop()
    if self.platform == "cpu":
      native = workspace_cpu.create(mesh, axis_name, sizes)
    elif self.platform == "gpu" and _ffi.with_cuda():
      native = workspace_cuda.create(mesh, axis_name, sizes)
    elif self.platform == "gpu":
      raise NotImplementedError(
          "jax_moe_overlap: this build has no CUDA kernels (nvcc was not found when it was built, or JMO_CUDA=off; "
          "jax_moe_overlap.build_info() says what was built): reinstall with nvcc on PATH and JMO_CUDA=on")
    else:
      raise NotImplementedError(f"jax_moe_overlap: no kernels for platform {self.platform!r} in this build")
    self.handle = native.handle
    # groups spanning processes: the prefix of the shared-memory objects' names (else None)
    self.shm_prefix = native.shm_prefix
    # What the backend learned about the devices (workspace_backend.DeviceFacts): the GPUs' compute capability, a
    # rank's SM budget, how expert_combine picks its consumer CTA count C here (``device.consumer_policy``).
    self.device = native.device
    self._released = False

  @classmethod
  def get(cls, mesh: jax.sharding.Mesh, axis_name: str | tuple[str, ...], sizes: WorkspaceSizes) -> "Workspace":
    """The cached workspace of these devices and axis (or tuple of axes: one group over their devices) that fits
    ``sizes`` (the smallest such), else a new one with ``sizes.bucket()``."""
    key = (tuple(d.id for d in mesh.devices.flat), mesh.axis_names, mesh.devices.shape, group_axes(axis_name))
    with cls._lock:
      fitting = [ws for ws in cls._cache.get(key, ()) if ws.sizes.fits(sizes)]
      if fitting:
        return min(fitting, key=lambda ws: ws.bytes_per_rank)
      ws = cls(mesh, axis_name, sizes.bucket())
      cls._cache.setdefault(key, []).append(ws)
      return ws

  @classmethod
  def reserve(cls, mesh: jax.sharding.Mesh, axis_name: str | tuple[str, ...], sizes: WorkspaceSizes) -> "Workspace":
    """Allocates (or finds) the workspace for the largest calls ahead, so that smaller ones reuse it."""
    return cls.get(mesh, axis_name, sizes)

  @classmethod
  def cached(cls) -> list["Workspace"]:
    """Every live workspace of this process."""
    with cls._lock:
      return [ws for group in cls._cache.values() for ws in group]

  @classmethod
  def on_release(cls, hook: Callable[["Workspace"], None]) -> None:
    """Registers ``hook(ws)``, called when ``ws`` is released (to drop programs compiled against its handle)."""
    cls._release_hooks.append(hook)

  @property
  def bytes_per_rank(self) -> int:
    """Bytes one rank of this workspace holds (on CPU host memory, on CUDA device memory of the rank's GPU)."""
    return self.sizes.bytes_per_rank()

  @property
  def spans_processes(self) -> bool:
    """Whether a group's ranks live in several processes (of one host). The routing counts then cross ranks through
    the workspace (``workspace_calls.gather_counts``), where every wait is bounded."""
    return self.shm_prefix is not None

  @property
  def total_bytes(self) -> int:
    """Bytes of every rank of every group of this workspace together."""
    return self.bytes_per_rank * self.ranks * self.groups

  def group_index(self) -> jax.Array:
    """Inside shard_map: this device's group (its linear index over the mesh axes other than the expert axis)."""
    g = np.int32(0)
    for a in self.other_axes:
      g = g * np.int32(self.mesh.shape[a]) + jax.lax.axis_index(a).astype(np.int32)
    return jax.numpy.asarray(g, np.int32)

  def last_call_stats(self, group: int = 0):
    """Per rank of ``group``: what its last expert_combine did, as recorded by the CUDA kernels (a list of
    ``workspace_cuda.CallStats``: consumer CTAs C, bytes pushed to peers, producer and consumer spans, and the call's
    timeline from BeginKernel to the end of CombineKernel). For
    benchmarks: it synchronizes every device of the group (waits for all their work, XLA's included), so call it
    between calls, after the one of interest. The record describes the last workspace call when that was an
    expert_combine (a dispatch after it clears the spans).

    Returns None on CPU workspaces: the CPU handlers record no spans.
    """
    if self.platform == "cpu":
      return None
    if not 0 <= group < self.groups:
      raise ValueError(f"jax_moe_overlap: group {group} of a workspace with {self.groups} groups")
    return workspace_cuda.last_call_stats(self.handle, group)

  def recorded_failures(self) -> list[str]:
    """The failure recorded in each aborted group of this workspace (one text per such group; [] when none is).

    A call inside a CUDA graph (XLA's command buffers) that fails stops the device, and XLA then raises only CUDA's
    error (an unspecified launch failure or illegal instruction); this says which rank waited for which peer at
    which stage with which counts, or which input was invalid. It reads the group's host memory alone, so it answers
    after such a failure, when every CUDA call of the process fails. [] on CPU workspaces, whose calls report their
    failures themselves.
    """
    if self.platform == "cpu" or self._released:
      return []
    return [t for t in workspace_cuda.failures(self.handle) if t]

  def release(self) -> None:
    """Frees the native buffers, after waiting for the dispatched programs (``jax.effects_barrier``; on CUDA the
    native release also synchronizes the devices). JAX's compilation caches are cleared (``jax.clear_caches``), so
    jitted functions that traced this workspace retrace and allocate a new one at their next call; a program
    compiled ahead of time (``.lower().compile()``) must be compiled again (its call fails naming the released
    handle). A workspace spanning processes is released by every process of it, at about the same time: on
    CUDA each process frees its blocks only once the others have closed their mappings of them (or are gone), and
    waits for that at most 5 s."""
    if self._released:
      return
    try:
      jax.effects_barrier()
    except jax.errors.JaxRuntimeError as e:
      # A failed program's error stays on JAX's runtime tokens and comes back at the next barrier, though the program
      # has ended and its caller got the error: the release goes on, and says what the barrier saw.
      warnings.warn(f"jax_moe_overlap: releasing {self!r} after a program that failed: {str(e).splitlines()[0]}",
                    RuntimeWarning, stacklevel=3)
    with Workspace._lock:
      for group in Workspace._cache.values():
        if self in group:
          group.remove(self)
    for hook in list(Workspace._release_hooks):
      hook(self)
    _jmo.release_workspace(self.handle)
    self._released = True
    # Compiled programs name the workspace they were traced against: one that ran after its release would fail
    # after dispatch, its outputs (an nnx.jit step's updated module state among them) holding the error. JAX's caches
    # are cleared so that every jitted function retraces and takes a live workspace; a program compiled ahead of time
    # (``.lower().compile()``) is the caller's to compile again.
    jax.clear_caches()

  def __repr__(self):
    return (f"Workspace(axis={self.axis_name!r}, ranks={self.ranks}, groups={self.groups}, "
            f"platform={self.platform!r}, sizes={self.sizes}, handle={self.handle})")


def recorded_failures() -> list[str]:
  """The failures recorded in the live workspaces of this process (``Workspace.recorded_failures``), one text per
  aborted group: what to read when a program whose workspace calls ran inside a CUDA graph raised a CUDA error."""
  return [t for ws in Workspace.cached() for t in ws.recorded_failures()]


def release_workspaces() -> int:
  """Frees every workspace of this process (after the programs in flight finish); returns the bytes freed. Later
  calls allocate new workspaces as they need them: JAX's compilation caches are cleared, so jitted functions
  retrace (a program compiled ahead of time must be compiled again; ``Workspace.release``)."""
  freed = 0
  for ws in Workspace.cached():
    freed += ws.total_bytes
    ws.release()
  return freed


@atexit.register
def _release_all():
  try:
    jax.effects_barrier()
  except Exception:  # pylint: disable=broad-except
    pass
  with Workspace._lock:
    workspaces = [ws for group in Workspace._cache.values() for ws in group]
    Workspace._cache.clear()
  for ws in workspaces:
    if not ws._released:  # pylint: disable=protected-access
      _jmo.release_workspace(ws.handle)
      ws._released = True  # pylint: disable=protected-access
