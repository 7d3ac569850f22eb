"""Which hosts the processes of a mesh run on, and whether an expert axis spans hosts.

The ranks of one expert-parallel group can share a peer workspace (``impl="overlap"``) only on one host: a workspace
is memory its processes map (POSIX shared memory, CUDA IPC), which processes of different hosts cannot. So
``moe_experts`` runs an ``"overlap"`` call over an expert axis that spans hosts as ``impl="collective"``
(``axis_spans_hosts``), and a workspace over such an axis is refused before anything is allocated
(``workspace_backend.create_shared``, naming the groups with ``groups_across_hosts``).

A process's host is its ``socket.gethostname()``: processes with different names are on different hosts (so are two
containers of one machine that have names of their own; they do not share /dev/shm either). Each process publishes
its name once per jax.distributed client, through the client's key-value store, the first time it needs the hosts,
and reads its peers' names from there. Every process of a mesh asks at the same point of the same program (where a
layer over an expert axis that spans processes is traced, or its workspace created), so the wait for a peer's name is
short; one that never comes (a dead or diverged peer) fails after ``HOSTS_TIMEOUT_S`` naming that process.
"""

from __future__ import annotations

import socket
import threading

import jax
import numpy as np
from jax._src import distributed

HOSTS_TIMEOUT_S = 60.0
_KEY = "jmo/host"

_lock = threading.Lock()
_learned: dict[int, str] = {}  # process -> host name, as published through _client's key-value store
_client = None


def groups_span_processes(devs: np.ndarray) -> bool:
  """Whether a group of ``devs`` ([groups, ranks]: ``workspace_backend.rank_devices``) has ranks in several
  processes."""
  return any(len({d.process_index for d in row}) > 1 for row in devs)


def process_hosts(processes) -> dict[int, str]:
  """{process: host name} for these processes of the jax.distributed job (this one's own name included)."""
  global _client
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("jax_moe_overlap: a mesh over the devices of several processes needs jax.distributed."
                       "initialize() (the processes learn each other's hosts through its key-value store)")
  here = jax.process_index()
  with _lock:
    if client is not _client:
      _learned.clear()
      name = socket.gethostname()
      client.key_value_set(f"{_KEY}/{here}", name, allow_overwrite=True)
      _learned[here] = name
      _client = client
    for p in processes:
      if p in _learned:
        continue
      try:
        _learned[p] = client.blocking_key_value_get(f"{_KEY}/{p}", int(HOSTS_TIMEOUT_S * 1000))
      except Exception as e:  # pylint: disable=broad-except
        raise RuntimeError(f"jax_moe_overlap: process {here} waited {HOSTS_TIMEOUT_S:.0f} s for process {p} to "
                           f"publish its host name (it died, hangs, or runs a different program): {e}") from e
    return {p: _learned[p] for p in processes}


def groups_across_hosts(devs: np.ndarray, hosts: dict[int, str]) -> list[list[tuple[int, str]]]:
  """The groups of ``devs`` ([groups, ranks]) whose ranks are on several hosts (``hosts``: process -> host name),
  each as its sorted (process, host) pairs; empty when every group is on one host."""
  out = []
  for row in devs:
    pairs = sorted({(int(d.process_index), hosts[int(d.process_index)]) for d in row})
    if len({h for _, h in pairs}) > 1:
      out.append(pairs)
  return out


def axis_spans_hosts(devs: np.ndarray) -> bool:
  """Whether a group of ``devs`` ([groups, ranks]) has ranks on several hosts. The hosts are learned only where a
  group spans processes (no key-value store is asked otherwise, nor in a job of one process)."""
  if not groups_span_processes(devs):
    return False
  return bool(groups_across_hosts(devs, process_hosts(sorted({int(d.process_index) for d in devs.flat}))))
