"""What a workspace backend returns, and the steps every backend shares.

A backend (``workspace_cpu``, ``workspace_cuda``) allocates the native workspace of one mesh axis and returns a
``NativeWorkspace``: the handle the custom calls take, the shared-memory name prefix when a group spans processes,
and ``DeviceFacts``, what it learned about the devices for the decisions the host makes (``call_site``). The
``Workspace`` (``workspace.py``) stores that value; nothing else writes onto it.

Shared steps: ``rank_devices`` (the mesh as a [groups, ranks] table of devices) and ``create_shared`` (the set-up of
a workspace whose groups span the processes of one host, through jax.distributed's key-value store).
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
from typing import Callable

import jax
import numpy as np
from jax._src import distributed

from jax_moe_overlap import _jmo
from jax_moe_overlap.hosts import groups_across_hosts, process_hosts
from jax_moe_overlap.resource import Calibration


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
  """What a backend learned about the devices of a workspace's ranks (every rank's device is of one model).

  compute_capability: the GPUs' (major, minor); None off CUDA.
  sm_budget: CTAs one rank may run at once (the smallest over this process's ranks); None where there is no such
    limit (CPU).
  consumer_policy: how expert_combine picks its consumer CTA count C on this workspace, in words (logged once).
  calibration: the resource model's calibration the CUDA kernels use, or None (CPU).
  """

  compute_capability: tuple[int, int] | None
  sm_budget: int | None
  consumer_policy: str
  calibration: Calibration | None


@dataclasses.dataclass(frozen=True)
class NativeWorkspace:
  """What a backend made: the native workspace's handle (this process's part of it where the mesh has devices of
  other processes), the prefix of its shared-memory names when a group spans processes (else None), and the facts
  of its devices."""

  handle: int
  shm_prefix: str | None
  device: DeviceFacts


def rank_devices(mesh: jax.sharding.Mesh, axis_name: str | tuple[str, ...]) -> np.ndarray:
  """[groups, ranks] array of the mesh's devices: rank = position on ``axis_name``, group = linear index over the
  other axes in mesh order (what ``Workspace.group_index`` computes inside shard_map). A tuple of axes (an expert
  axis and a tensor axis) makes one group of their devices, rank = the linear index over them in the tuple's order,
  as ``jax.lax.axis_index`` of the tuple numbers them."""
  axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  where = [list(mesh.axis_names).index(a) for a in axes]
  R = int(np.prod([mesh.devices.shape[i] for i in where]))
  return np.moveaxis(mesh.devices, where, list(range(-len(where), 0))).reshape(-1, R)


# How long creating a workspace that spans processes waits for each peer process's step (creating, then mapping, its
# part). Every process builds the same programs, so peers reach this within the compile-time skew.
SHARED_SETUP_TIMEOUT_S = 60.0
_shared_seq = itertools.count()


def create_shared(devs: np.ndarray, platform: str, create: Callable[[str], int], export: Callable[[int], str],
                  open_peers: Callable[[int, dict[int, str]], None], unlink: Callable[[int], None],
                  names: Callable[[str], list[str]]) -> tuple[int, str]:
  """A workspace whose groups span processes (``devs``: [groups, ranks]), set up in steps the processes take together
  through jax.distributed's key-value store (every process of the mesh creates its workspaces in the same order, so
  the n-th one has the same keys everywhere):

  1. the processes learn each other's hosts (``hosts.process_hosts``): processes of different hosts cannot map each
     other's memory, so a group over several hosts is refused before anything is allocated;
  2. the first process publishes a fresh name prefix; each process creates its part (``create(prefix)`` -> handle)
     and publishes what its peers need to map it (``export(handle)``, a string);
  3. each process maps its peers' parts (``open_peers(handle, {process: export})``), and once all have, each removes
     its names (``unlink(handle)``): nothing is left in /dev/shm after setup, whatever happens to the processes
     later. On a failure every name of the workspace (``names(prefix)``) is removed.

  Returns (handle, name prefix)."""
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError(f"jax_moe_overlap: a {platform} expert axis spanning processes needs "
                       "jax.distributed.initialize() (its key-value store exchanges the workspace's names)")
  here = jax.process_index()
  procs = sorted({d.process_index for d in devs.flat})
  key = f"jmo/ws/{next(_shared_seq)}"
  timeout_ms = int(SHARED_SETUP_TIMEOUT_S * 1000)

  def wait_for(step: str, process: int) -> str:
    try:
      return client.blocking_key_value_get(f"{key}/{step}/{process}", timeout_ms)
    except Exception as e:  # pylint: disable=broad-except
      raise RuntimeError(
          f"jax_moe_overlap: process {here} waited {SHARED_SETUP_TIMEOUT_S:.0f} s for process {process} to {step} "
          f"its part of the shared {platform} workspace {key} (it died, hangs, or runs a different program): {e}"
      ) from e

  across = groups_across_hosts(devs, process_hosts(procs))
  if across:
    raise NotImplementedError(
        "jax_moe_overlap: the mesh's expert axis spans processes of different hosts ("
        f"{', '.join(f'process {p} on {h}' for p, h in across[0])}); a workspace (impl=\"overlap\") needs every "
        "rank of an expert-parallel group on one host (it is memory the processes map). moe_experts and MoE run such "
        "an axis with impl=\"collective\" (XLA collectives and this library's grouped GEMMs), which they choose by "
        "themselves for impl=\"overlap\"; or put the hosts on another mesh axis (batch_axes)")
  if here == procs[0]:
    client.key_value_set(f"{key}/prefix/{here}", f"/jmo-{secrets.token_hex(8)}")
  prefix = wait_for("prefix", procs[0])
  handle = create(prefix)
  try:
    client.key_value_set(f"{key}/create/{here}", export(handle))
    open_peers(handle, {p: wait_for("create", p) for p in procs})
    client.key_value_set(f"{key}/map/{here}", "1")
    for p in procs:
      wait_for("map", p)
    unlink(handle)
  except BaseException:
    _jmo.release_workspace(handle)  # also removes this process's names
    # A peer that died during setup cannot remove its names: remove every name of this workspace.
    for name in names(prefix):
      _jmo.unlink_shm(name)
    raise
  return handle, prefix
