"""CPU peer workspaces: the backend of ``Workspace`` on platform "cpu".

The ranks of a group are host threads of one process, whose blocks live in one allocation
(``_jmo.create_cpu_workspace``), or of several processes of one host: then each process holds its own ranks' blocks
in POSIX shared memory and maps its peers' (``_create_shared``, the steps of ``workspace_backend.create_shared``).
"""

from __future__ import annotations

import jax
import numpy as np

from jax_moe_overlap import _jmo
from jax_moe_overlap.hosts import groups_span_processes
from jax_moe_overlap.workspace_backend import DeviceFacts, NativeWorkspace, create_shared, rank_devices

DEVICE = DeviceFacts(compute_capability=None, sm_budget=None, calibration=None,
                     consumer_policy="CPU: one consumer thread per rank (consumer_ctas is checked but has no effect)")


def create(mesh: jax.sharding.Mesh, axis_name: str, sizes) -> NativeWorkspace:
  """Allocates the CPU workspace of ``mesh``'s axis ``axis_name`` with ``sizes`` (a ``WorkspaceSizes``)."""
  devs = rank_devices(mesh, axis_name)
  groups, ranks = devs.shape
  if groups_span_processes(devs):
    handle, prefix = _create_shared(devs, sizes)
    return NativeWorkspace(handle, prefix, DEVICE)
  handle = int(_jmo.create_cpu_workspace(ranks, groups, sizes.row_bytes, sizes.recv_rows, sizes.ret_rows,
                                         sizes.num_segments))
  return NativeWorkspace(handle, None, DEVICE)


def _create_shared(devs: np.ndarray, sizes) -> tuple[int, str]:
  """A CPU workspace whose groups span processes: each process creates a POSIX shared-memory object per rank it owns
  (``<prefix>-g<g>-r<r>``; the group memory follows rank 0's block) and maps its peers' objects."""
  groups, ranks = devs.shape
  here = jax.process_index()
  return create_shared(
      devs, "CPU",
      create=lambda prefix: int(_jmo.create_cpu_shared_workspace(
          ranks, groups, sizes.row_bytes, sizes.recv_rows, sizes.ret_rows, sizes.num_segments,
          [int(d.process_index) for d in devs.flat], here, prefix)),
      export=lambda handle: "1",
      open_peers=lambda handle, _: _jmo.map_cpu_workspace_peers(handle),
      unlink=_jmo.unlink_cpu_workspace_names,
      names=lambda prefix: [f"{prefix}-g{g}-r{r}" for g in range(groups) for r in range(ranks)])
