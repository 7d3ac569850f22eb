"""CUDA peer workspaces: the backend of ``Workspace`` on platform "gpu", and device queries through cuda-python.

The buffers themselves are allocated in C++ (``_jmo.create_cuda_workspace``: one ``cudaMalloc``'d block per rank on
that rank's device, the peer pointer table, the group's abort word, error records and count board in host-mapped
memory; peer access is checked with ``cudaDeviceCanAccessPeer`` for every pair and enabled there). Python only maps
the mesh to (group, rank) -> CUDA device ordinal and asks the devices what it needs to size the kernels, through
``cuda.bindings`` (the ``cuda-python`` package of the ``gpu`` extra, imported on the first query, so that CPU-only
installs never need it), never through hard-coded numbers.

Processes: the expert axis may span the processes of one host (``jax.distributed``: one process per GPU, several
GPUs per process, or several processes on one GPU). Each process then allocates its own ranks' blocks and exports
them as CUDA IPC handles, published through the distributed runtime's key-value store; each opens its peers' blocks
(``cudaIpcOpenMemHandle``) into its peer table, and the group memory is a POSIX shared-memory object created by the
process of rank 0 and registered with CUDA in every process (``workspace_backend.create_shared`` runs the steps).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging

import jax

from jax_moe_overlap import _jmo
from jax_moe_overlap import env
from jax_moe_overlap import resource
from jax_moe_overlap.hosts import groups_span_processes
from jax_moe_overlap.workspace_backend import DeviceFacts, NativeWorkspace, create_shared, rank_devices

log = logging.getLogger("jax_moe_overlap")


def _runtime():
  try:
    from cuda.bindings import runtime  # pylint: disable=g-import-not-at-top
  except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError("jax_moe_overlap: GPU workspaces query the devices through cuda-python; install it with "
                      "`pip install 'jax-moe-overlap[gpu]'` (or `pip install cuda-python`)") from e
  return runtime


def _check(result, what):
  err, *values = result
  runtime = _runtime()
  if err != runtime.cudaError_t.cudaSuccess:
    raise RuntimeError(f"jax_moe_overlap: {what} failed: {err}")
  return values[0] if len(values) == 1 else tuple(values)


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
  """What the kernels' launch configuration needs to know about one CUDA device."""

  ordinal: int
  name: str
  sm_count: int
  compute_capability: tuple[int, int]
  shared_memory_per_sm: int


@functools.cache
def device_info(ordinal: int) -> DeviceInfo:
  """SM count, compute capability and shared memory of CUDA device ``ordinal`` (cached)."""
  rt = _runtime()
  attr = rt.cudaDeviceAttr
  get = lambda a: int(_check(rt.cudaDeviceGetAttribute(a, ordinal), f"cudaDeviceGetAttribute({a.name})"))
  props = _check(rt.cudaGetDeviceProperties(ordinal), "cudaGetDeviceProperties")
  name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
  return DeviceInfo(ordinal=ordinal, name=name.rstrip("\x00"),
                    sm_count=get(attr.cudaDevAttrMultiProcessorCount),
                    compute_capability=(get(attr.cudaDevAttrComputeCapabilityMajor),
                                        get(attr.cudaDevAttrComputeCapabilityMinor)),
                    shared_memory_per_sm=get(attr.cudaDevAttrMaxSharedMemoryPerMultiprocessor))


def check_peer_access(ordinals) -> None:
  """Raises a RuntimeError naming the first pair of distinct devices without peer access."""
  rt = _runtime()
  distinct = sorted(set(int(o) for o in ordinals))
  for a in distinct:
    for b in distinct:
      if a != b and not _check(rt.cudaDeviceCanAccessPeer(a, b), "cudaDeviceCanAccessPeer"):
        raise RuntimeError(f"jax_moe_overlap: CUDA device {a} cannot access the memory of device {b} "
                           "(cudaDeviceCanAccessPeer = 0); the expert-parallel axis needs peer access (NVLink or "
                           "PCIe P2P) between all of its GPUs")


def default_consumer_ctas(info: DeviceInfo) -> int:
  """The fixed C (communication CTAs of expert_combine) used when no calibration applies: about an eighth of the
  SMs (the seed paper's default was 14 of 108), at least one. ``$JMO_CONSUMER_CTAS`` overrides it (env.py)."""
  fixed = env.fixed_consumer_ctas()
  return fixed if fixed is not None else resource.fallback_consumer_ctas(info.sm_count)


def calibration(info: DeviceInfo) -> resource.Calibration:
  """The resource-model calibration of this device (jax_moe_overlap/calibration/<gpu name>.json), or why none.

  A calibration describes one producer engine by its tile shape (mma.sync 64 x 128 or, on Hopper, wgmma 128 x 256);
  the workspace checks the shape (CheckModelParams) and calls on the other engine keep the fixed C."""
  return resource.calibration_for(info.name, info.sm_count)


def create(mesh: jax.sharding.Mesh, axis_name: str, sizes) -> NativeWorkspace:
  """Allocates the CUDA workspace of ``mesh``'s axis ``axis_name`` with ``sizes`` (a ``WorkspaceSizes``): this
  process's part when the mesh has devices of other processes."""
  devs = rank_devices(mesh, axis_name)
  groups, ranks = devs.shape
  here = jax.process_index()
  mine = [d.process_index == here for d in devs.flat]
  # Ranks of other processes have no device here (-1); the C++ side reaches their blocks through IPC.
  ordinals = [int(d.local_hardware_id) if m else -1 for d, m in zip(devs.flat, mine)]
  for g in range(groups):
    check_peer_access([o for o, m in zip(ordinals[g * ranks:(g + 1) * ranks], mine[g * ranks:(g + 1) * ranks]) if m])
  local = [o for o, m in zip(ordinals, mine) if m]
  info = device_info(local[0])
  if len({device_info(o).name for o in set(local)}) != 1:
    raise NotImplementedError("jax_moe_overlap: a CUDA workspace over GPUs of different models is not supported")
  cal = calibration(info)
  fixed = default_consumer_ctas(info)
  # What decides C, once per workspace (the per-call pick happens on the device and is not logged).
  policy = cal.reason if cal.params is not None else f"{cal.reason} (fixed C used: {fixed})"
  (log.info if cal.params is not None else log.warning)("jax_moe_overlap: %s", policy)
  model = cal.params.native() if cal.params is not None else None

  def create_part(process=None, prefix=""):
    return int(_jmo.create_cuda_workspace(ranks, groups, ordinals, sizes.row_bytes, sizes.recv_rows, sizes.ret_rows,
                                          sizes.num_segments, fixed, 0, model, process, here, prefix))

  shm_prefix = None
  if all(mine):
    handle = create_part()
  else:
    process = [int(d.process_index) for d in devs.flat]
    # Other processes' devices on the mesh: this process creates its part with the process table, and the
    # processes meet to open each other's blocks. Only a group that itself spans processes makes the workspace
    # spans_processes (groups each inside one process, a data axis across processes, keep the collectives).
    handle, prefix = create_shared(
        devs, "CUDA", create=lambda prefix: create_part(process, prefix), export=_export_blocks,
        open_peers=lambda h, exports: _open_peers(h, exports, groups * ranks), unlink=_jmo.unlink_cuda_workspace_names,
        names=lambda prefix: [f"{prefix}-g{g}" for g in range(groups)])
    if groups_span_processes(devs):
      shm_prefix = prefix
  device = DeviceFacts(compute_capability=tuple(info.compute_capability), consumer_policy=policy, calibration=cal,
                       sm_budget=int(_jmo.cuda_workspace_info(handle)["min_sm_budget"]))
  return NativeWorkspace(handle, shm_prefix, device)


def _export_blocks(handle: int) -> str:
  """This process's blocks of a shared workspace as the key-value store carries them: JSON of
  {g * ranks + r: [IPC handle hex, PCI bus id]} for its own ranks."""
  return json.dumps({i: [h.hex(), bus] for i, (h, bus) in enumerate(_jmo.export_cuda_workspace_blocks(handle))
                     if h})


def _open_peers(handle: int, exports: dict[int, str], blocks_total: int) -> None:
  """Opens every other process's blocks (``exports``: each process's ``_export_blocks``)."""
  blocks: dict[int, tuple[bytes, str]] = {}
  for text in exports.values():
    blocks.update({int(i): (bytes.fromhex(h), bus) for i, (h, bus) in json.loads(text).items()})
  _jmo.open_cuda_workspace_peers(handle, [blocks.get(i, (b"", "")) for i in range(blocks_total)])


# ----------------------------------------------------------------------------------------------------------------
# What the last expert_combine did on each rank (the kernels' own record, for benchmarks)

_NO_START = 2**64 - 1  # a span's start as every call's BeginKernel resets it (0 after a group's recovery)


@dataclasses.dataclass(frozen=True)
class CallStats:
  """One rank's record of its last expert_combine, read from the device (``Workspace.last_call_stats``).

  consumers: the consumer CTA count C the call used (pinned, the fixed fallback, or the resource model's pick).
  pushed_bytes: bytes its consumer pushed to the other ranks (rows of remote segments x N x element bytes).
  producer_start_us / producer_end_us: the first producer tile started / the last one finished; consumer_start_us /
    consumer_end_us: the first consumer CTA started pushing (after the serialized mode's wait) / the last push
    finished. Microseconds (float) after ``origin_ns``; None where that side did nothing in the call (no rows to
    compute, nothing remote to push), or where the last call on the workspace was not an expert_combine.
  begin_us: BeginKernel started (the call's first kernel; before a testing delay).
  last_producer_start_us: the last producer CTA with work started; far after producer_start_us means the kernel's
    CTAs were not all resident at once (something else held SMs).
  combine_start_us / combine_end_us: CombineKernel's first CTA started / its last CTA finished (the call's end).
  kernel_start_us: the expert kernel's first CTA started (its segment table, the choice of C and the producers'
    first tile follow; producer_start_us - kernel_start_us is what the producers waited for).
  origin_ns: the earliest of the rank's recorded times, a %globaltimer value in ns (0 if none). Every GPU has its own
    timer: compare origins of different ranks only where the clocks are known to agree. Its resolution is about
    1 us on some GPUs.
  """

  rank: int
  consumers: int
  pushed_bytes: int
  origin_ns: int
  producer_start_us: float | None
  producer_end_us: float | None
  consumer_start_us: float | None
  consumer_end_us: float | None
  begin_us: float | None = None
  last_producer_start_us: float | None = None
  combine_start_us: float | None = None
  combine_end_us: float | None = None
  kernel_start_us: float | None = None

  @property
  def producer_us(self) -> float | None:
    """The producer's span: first tile start to last tile finish."""
    return _span(self.producer_start_us, self.producer_end_us)

  @property
  def consumer_us(self) -> float | None:
    """The consumer's span: first push start to last push finish."""
    return _span(self.consumer_start_us, self.consumer_end_us)

  @property
  def busy_us(self) -> float | None:
    """From the first start to the last finish of either side (the expert kernel's recorded work)."""
    ends = [t for t in (self.producer_end_us, self.consumer_end_us) if t is not None]
    starts = [t for t in (self.producer_start_us, self.consumer_start_us) if t is not None]
    return max(ends) - min(starts) if ends else None

  @property
  def overlap_us(self) -> float | None:
    """producer_us + consumer_us - busy_us: how long both sides ran at once (negative: the gap between them)."""
    if self.producer_us is None or self.consumer_us is None:
      return None
    return self.producer_us + self.consumer_us - self.busy_us

  @property
  def call_us(self) -> float | None:
    """The whole call on the device: BeginKernel's start to CombineKernel's end."""
    return _span(self.begin_us, self.combine_end_us)

  @property
  def producer_start_spread_us(self) -> float | None:
    """How long after the first producer CTA the last one started (about 0 when every CTA is resident at once)."""
    return _span(self.producer_start_us, self.last_producer_start_us)

  @property
  def push_gbps(self) -> float | None:
    """pushed_bytes / consumer_us in GB/s: the rate the consumer moved the rank's remote rows at."""
    return self.pushed_bytes / self.consumer_us / 1e3 if self.consumer_us else None


def _span(start, end):
  return end - start if start is not None and end is not None else None


def call_stats(rank: int, record: dict) -> CallStats:
  """A CallStats from one rank's raw record (``_jmo.cuda_last_combine_records``: consumers, pushed_bytes and the
  %globaltimer ns of producer_start_ns, producer_end_ns, consumer_start_ns, consumer_end_ns, and where the library
  records them begin_ns, last_producer_start_ns, combine_start_ns, combine_end_ns, expert_kernel_start_ns)."""
  pairs = {side: (record[f"{side}_start_ns"], record[f"{side}_end_ns"]) for side in ("producer", "consumer")}
  pairs["combine"] = (record.get("combine_start_ns", _NO_START), record.get("combine_end_ns", 0))
  # Recorded: a start set by its first event (not the reset value) and an end after it.
  done = {side: 0 < t0 < _NO_START and t1 >= t0 for side, (t0, t1) in pairs.items()}
  begin = record.get("begin_ns", 0)
  begin = begin if 0 < begin < _NO_START else None
  entry = record.get("expert_kernel_start_ns", _NO_START)
  entry = entry if 0 < entry < _NO_START else None
  last_start = record.get("last_producer_start_ns", 0)
  last_start = last_start if done["producer"] and last_start >= pairs["producer"][0] else None
  origin = min([pairs[side][0] for side in pairs if done[side]] + [t for t in (begin, entry) if t is not None],
               default=0)
  rel = lambda side, i: (pairs[side][i] - origin) / 1e3 if done[side] else None
  at = lambda t: None if t is None else (t - origin) / 1e3
  return CallStats(rank=rank, consumers=int(record["consumers"]), pushed_bytes=int(record["pushed_bytes"]),
                   origin_ns=int(origin), producer_start_us=rel("producer", 0), producer_end_us=rel("producer", 1),
                   consumer_start_us=rel("consumer", 0), consumer_end_us=rel("consumer", 1), begin_us=at(begin),
                   last_producer_start_us=at(last_start), combine_start_us=rel("combine", 0),
                   combine_end_us=rel("combine", 1), kernel_start_us=at(entry))


def last_call_stats(handle: int, group: int = 0) -> list[CallStats]:
  """Per rank of ``group``, what its last expert_combine recorded. Synchronizes every device of the group first."""
  return [call_stats(r, rec) for r, rec in enumerate(_jmo.cuda_last_combine_records(int(handle), int(group)))]


def failures(handle: int, timeout_ms: int = 0) -> list[str]:
  """Per group of the workspace, the text of its recorded failure ("" where the group is not aborted), read from the
  group's host memory alone (``Workspace.recorded_failures``)."""
  return [str(t) for t in _jmo.cuda_workspace_failures(int(handle), int(timeout_ms))]
