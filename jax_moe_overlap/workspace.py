"""The peer workspace: each rank's symmetric buffers and signal words, owned by one Python object.

A ``Workspace`` belongs to one mesh and one expert-parallel axis. The axis' ``R`` devices form a *group*; the
other mesh axes (if any) enumerate ``G`` independent groups. The native side keeps, per group and rank, one block
laid out by ``csrc/include/jax_moe_overlap/protocol.h`` (recv rows, ret rows, stage rows, tile-ready flags and the
monotonic counters) plus the per-rank consumer engine, and the custom calls name the workspace by ``handle``.

Workspaces are cached per (devices, axis, sizes): every MoE layer of the same sizes shares one. This is safe because
each device runs its workspace calls one after another in program order, the same order on every rank of a group
(on CPU enforced by a token chain, ``ordering.py``; on GPU by the one stream), and every call is one epoch of the
protocol. They are released when the process exits.
"""

from __future__ import annotations

import atexit
import dataclasses
import threading

import jax
import numpy as np

from jax_moe_overlap import _ffi
from jax_moe_overlap import _jmo
from jax_moe_overlap.checks import check_axis


@dataclasses.dataclass(frozen=True)
class WorkspaceSizes:
  """Per-rank capacities. row_bytes: widest row (model dim x bytes per element); recv_rows: rows one rank can
  receive in a call; ret_rows: slots of one rank (T*k); num_segments: E_local * R."""

  row_bytes: int
  recv_rows: int
  ret_rows: int
  num_segments: int


class Workspace:
  """Symmetric peer buffers and flags of one expert-parallel mesh axis.

  Use ``Workspace.get(mesh, axis_name, sizes)``: it returns the cached workspace for these devices and sizes.
  """

  _cache: dict[tuple, "Workspace"] = {}
  _lock = threading.Lock()

  def __init__(self, mesh: jax.sharding.Mesh, axis_name: str, sizes: WorkspaceSizes):
    check_axis(mesh, axis_name)
    _ffi.register()
    self.mesh = mesh
    self.axis_name = axis_name
    self.sizes = sizes
    self.ranks = int(mesh.shape[axis_name])
    self.groups = int(mesh.devices.size // self.ranks)
    self.other_axes = tuple(a for a in mesh.axis_names if a != axis_name)
    platforms = {d.platform for d in mesh.devices.flat}
    if len(platforms) != 1:
      raise ValueError(f"jax_moe_overlap: a mesh mixing platforms {sorted(platforms)} is not supported")
    self.platform = platforms.pop()
    # How expert_combine picks its consumer CTA count C on this workspace (CUDA: the resource model or a fixed
    # count, set by cuda_workspace.create); sm_budget: CTAs of one rank (None: no such limit, as on CPU).
    self.consumer_policy = "CPU: one consumer thread per rank (consumer_ctas is checked but has no effect)"
    self.calibration = None
    self.sm_budget = None
    if self.platform == "cpu":
      self.handle = int(_jmo.create_cpu_workspace(self.ranks, self.groups, sizes.row_bytes, sizes.recv_rows,
                                                  sizes.ret_rows, sizes.num_segments))
    elif self.platform == "gpu" and _ffi.with_cuda():
      from jax_moe_overlap import cuda_workspace  # pylint: disable=g-import-not-at-top
      self.handle = cuda_workspace.create(self, mesh, axis_name, sizes)
    else:
      raise NotImplementedError(
          f"jax_moe_overlap: no kernels for platform {self.platform!r} in this build "
          f"(CUDA compiled in: {_ffi.with_cuda()})")
    self._released = False

  @classmethod
  def get(cls, mesh: jax.sharding.Mesh, axis_name: str, sizes: WorkspaceSizes) -> "Workspace":
    key = (tuple(d.id for d in mesh.devices.flat), mesh.axis_names, mesh.devices.shape, axis_name, sizes)
    with cls._lock:
      ws = cls._cache.get(key)
      if ws is None:
        ws = cls(mesh, axis_name, sizes)
        cls._cache[key] = ws
      return ws

  def group_index(self) -> jax.Array:
    """Inside shard_map: this device's group (its linear index over the mesh axes other than the expert axis)."""
    g = np.int32(0)
    for a in self.other_axes:
      g = g * np.int32(self.mesh.shape[a]) + jax.lax.axis_index(a).astype(np.int32)
    return jax.numpy.asarray(g, np.int32)

  def last_call_stats(self, group: int = 0):
    """Per rank of ``group``: what its last expert_combine did, as recorded by the CUDA kernels (a list of
    ``cuda_workspace.CallStats``: consumer CTAs C, bytes pushed to peers, producer and consumer spans, and the call's
    timeline from BeginKernel to the end of CombineKernel). For
    benchmarks: it synchronizes every device of the group (waits for all their work, XLA's included), so call it
    between calls, after the one of interest. The record describes the last workspace call when that was an
    expert_combine (a dispatch after it clears the spans).

    Returns None on CPU workspaces: the CPU handlers record no spans.
    """
    if self.platform == "cpu":
      return None
    from jax_moe_overlap import cuda_workspace  # pylint: disable=g-import-not-at-top
    if not 0 <= group < self.groups:
      raise ValueError(f"jax_moe_overlap: group {group} of a workspace with {self.groups} groups")
    return cuda_workspace.last_call_stats(self.handle, group)

  def release(self) -> None:
    """Frees the native buffers. Call only when no computation using this workspace is in flight."""
    if not self._released:
      _jmo.release_workspace(self.handle)
      self._released = True

  def __repr__(self):
    return (f"Workspace(axis={self.axis_name!r}, ranks={self.ranks}, groups={self.groups}, "
            f"platform={self.platform!r}, sizes={self.sizes}, handle={self.handle})")


@atexit.register
def _release_all():
  try:
    jax.effects_barrier()
  except Exception:  # pylint: disable=broad-except
    pass
  with Workspace._lock:
    for ws in Workspace._cache.values():
      ws.release()
    Workspace._cache.clear()
