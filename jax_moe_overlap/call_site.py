"""One call site of the workspace's custom calls: the workspace, the ``CallConfig``, and what is decided once for them.

``RankInfo(workspace, config)`` is built once where a layer (or a benchmark) sets up its calls, before tracing, and is
a static argument of everything after: the call wrappers (``workspace_calls``) read their attributes from it
(``attrs``: the workspace and the call options, the same for every call), and the differentiable blocks
(``expert_block``, ``fp8_overlap``) the fusion decisions. Built here, once:

* ``dispatch_pushers``: whether the dispatch and GEMM1 run as one dispatch_gemm call (> 0) or as two (0), from the
  config and the facts the workspace's backend returned (``dispatch_pushers``). A fused call's pusher count is
  the pinned one, or the library's: the resource model's on the device, per call, where the workspace has a
  calibration with a pusher rate, else the fixed rule (docs/resource_manager.md);
* ``send_once``: whether the forward's dispatch sends a token's row once per destination rank (``send_once``);
* the check of a pinned consumer CTA count against the rank's SM budget, before anything is traced;
* on CUDA, the check that XLA_FLAGS keeps the workspace calls of a CUDA graph in program order
  (``command_buffers.check_scheduling``);
* ``fp8_fused_combine``: whether the FP8 layer's returns are expert_combine calls on e4m3 operands
  (``fp8_fused_combine``), and ``fp8_fused_dispatch``: whether its forward dispatch and GEMM1 are one dispatch_gemm
  call on packed e4m3 rows (``fp8_fused_dispatch``). Fields of the call site's identity: the programs cached per call
  site (``api.eager_program``) are traced again when they change.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_overlap import _jmo
from jax_moe_overlap import command_buffers
from jax_moe_overlap import engines
from jax_moe_overlap.config import CallConfig
from jax_moe_overlap.workspace_backend import DeviceFacts

def dispatch_pushers(config: CallConfig, device: DeviceFacts, ranks: int) -> int:
  """dispatch_gemm's pushing CTAs for a call site, or 0: the dispatch and GEMM1 run as two calls. None with
  ``serialize``; pinned by ``config.dispatch_pushers``; else fused where dispatch_gemm's CUDA kernel runs
  (engines.wgmma_runs_on) and the expert axis has two ranks or more, with ``_jmo.default_dispatch_pushers`` of the
  rank's SM budget as the count it reports (ffi/common/call_options.h's DefaultPushers: 8 on an H200's 132 SMs, the
  same share of a smaller budget: the launch's count without a resource model; with one, the launch lets the model
  choose P on the device, ``RankInfo.attrs``); two calls elsewhere (one rank: no link to hide; CPU: XLA's ragged_dot
  beats the CPU handler's loops)."""
  if config.serialize:
    return 0
  if config.dispatch_pushers > 0:
    return config.dispatch_pushers
  if not engines.wgmma_runs_on(device.compute_capability) or ranks < 2:
    return 0
  return int(_jmo.default_dispatch_pushers(int(device.sm_budget or 0)))


def send_once(config: CallConfig) -> bool:
  """Whether the forward's dispatch sends a token's row once per destination rank (``Plan.slot_primary``): pinned by
  ``config.send_once``, else not. Sending once moves fewer bytes over the links at two ranks or more, but on the
  GPU the receiver's expansion of those rows into the GEMM's rows costs more than the bytes it saves
  (docs/performance.md, "dispatch_gemm: the dispatch overlapped with GEMM1"), so one row per slot is the default
  until that expansion is cheaper; at one rank every row is local and sending once changes nothing."""
  return bool(config.send_once)  # (None: not pinned, one row per slot)


# Whether GPUs run the FP8 layer's returns (GEMM2 and its way back, dx = da W1^T and its way back) as expert_combine
# calls on e4m3 operands (its FP8 producer, the FP8 grouped GEMM's loop in ExpertKernel) instead of the FP8 grouped
# GEMM, a dispatch of its rows back and XLA's sum over a token's slots: on (the kernel passes its GPU tests, and the
# fused call beats the unfused path's GEMM and return in most loopback cases: docs/performance.md, "The FP8 layer's
# overlapped operators"); off gives the unfused path. CPUs take the fused calls (the same bits:
# tests/test_fp8_overlap.py).
FP8_FUSED_COMBINE_ON_GPU = True


def fp8_fused_combine(platform: str) -> bool:
  """Whether impl="overlap" under quantization="fp8" returns its expert rows by ``expert_combine_fp8``
  (``fp8_overlap.fp8_combined_experts``) on a workspace of this platform: on CPUs always, on GPUs where
  FP8_FUSED_COMBINE_ON_GPU."""
  return platform == "cpu" or FP8_FUSED_COMBINE_ON_GPU


# Whether GPUs run the FP8 layer's dispatches with the GEMMs after them (x's with GEMM1, dy's with dh = dy W2^T) as
# dispatch_gemm calls on packed e4m3 rows (its FP8 kernel: the FP8 grouped GEMM's loop reading A's values and scales
# from the rows where they land) where the call site fuses the dispatch (dispatch_pushers). Off on GPUs: the kernel
# passes its GPU tests, but its training forward (which also quantizes a in GEMM1's epilogue) is 4-10% slower than
# the two calls at R = 2 in the loopback (docs/performance.md, "The FP8 layer's overlapped operators"); CPUs take the
# fused calls where dispatch_pushers is pinned (the same bits: tests/test_fp8_overlap.py).
FP8_FUSED_DISPATCH_ON_GPU = False


def fp8_fused_dispatch(platform: str, pushers: int) -> bool:
  """Whether impl="overlap" under quantization="fp8" runs its dispatches with the GEMMs after them (x's with GEMM1,
  dy's with dh = dy W2^T) as ``dispatch_gemm_fp8`` calls on a workspace of this platform with this
  ``dispatch_pushers``: where the call site fuses the dispatch (pushers > 0), on CPUs always, on GPUs where
  FP8_FUSED_DISPATCH_ON_GPU (and, per call, where the kernel takes d_model: ``engines.fp8_dispatch_gemm_operands``)."""
  return pushers > 0 and (platform == "cpu" or FP8_FUSED_DISPATCH_ON_GPU)


# gather_rs's metadata carries a slot's index as a float32 (exact below 2^24): a rank's slots T k TP must be fewer.
GATHER_RS_MAX_SLOTS = 2**24


def tensor_reduce(config: CallConfig, platform: str, ranks: int, tensor: int, top_k: int, itemsize: int,
                  slots: int, quantization: str | None = None) -> str:
  """How an ``impl="overlap"`` layer sums its tensor shards' partial outputs: "gather_rs" (GEMM2 + GatherRS) or
  "per_slot" (expert_combine's per-slot partials to the token owners). The one rule, for a group of G = ranks x
  tensor ranks, top_k choices per token, rows of itemsize bytes and ``slots`` = T k TP slots per rank:

  * no tensor axis (tensor == 1): "per_slot" (nothing to reduce over shards);
  * quantization="fp8": "per_slot" (``fp8_overlap.py`` returns the shards' partials per slot; GatherRS's producer
    takes no e4m3 operands), a pinned "gather_rs" refused;
  * pinned by ``config.tensor_reduce``: that, where it can run (else an error saying why);
  * "auto": "gather_rs" where its kernel runs (the CPU handlers, the CUDA kernels: platforms "cpu" and "gpu") and
    it moves no more bytes than the per-slot return: per token and rank, GatherRS ships G - 1 dense float32
    partials (4 (G - 1) N bytes), the per-slot return k TP (G - 1) / G rows in the layer's dtype under balanced
    routing (k TP (G - 1) / G x itemsize x N), so GatherRS when 4 G <= k TP itemsize; else "per_slot". Measured
    on one side (TP = 2 / EP = 2, top-2, bf16: 16 > 8, per-slot): the per-slot return as fast or faster at every size,
    forward and backward (docs/performance.md); the other side (the loopback's ``tensor-time-deepseek``, top-8) not
    yet. ``CallConfig(tensor_reduce=...)`` overrides it.
  """
  if tensor == 1:
    return "per_slot"
  if quantization is not None:
    if config.tensor_reduce == "gather_rs":
      raise ValueError(f"jax_moe_overlap: CallConfig(tensor_reduce='gather_rs') does not run under "
                       f"quantization={quantization!r}: impl='overlap' returns the shards' FP8 partial outputs per "
                       f"slot (GatherRS's GEMM2 producer takes no e4m3 operands); use 'per_slot' or 'auto'")
    return "per_slot"
  runs = platform in ("cpu", "gpu")
  if config.tensor_reduce == "gather_rs":
    if not runs:
      raise ValueError(f"jax_moe_overlap: CallConfig(tensor_reduce='gather_rs') has no {platform} kernel (the CPU "
                       "handlers and the CUDA kernels run it); use 'per_slot' or 'auto'")
    if slots >= GATHER_RS_MAX_SLOTS:
      raise ValueError(f"jax_moe_overlap: CallConfig(tensor_reduce='gather_rs') takes fewer than 2^24 slots per "
                       f"rank (T k TP, carried as float32), got {slots}")
    return "gather_rs"
  if config.tensor_reduce == "per_slot":
    return "per_slot"
  group = ranks * tensor
  return "gather_rs" if runs and slots < GATHER_RS_MAX_SLOTS and 4 * group <= top_k * tensor * itemsize else "per_slot"


@dataclasses.dataclass(frozen=True)
class RankInfo:
  """Static description of one call site: the workspace (hashable by identity), the ``CallConfig``, and
  ``dispatch_pushers``, ``send_once``, ``fp8_fused_combine`` and ``fp8_fused_dispatch``, decided once from them (the
  functions of those names)."""

  workspace: object  # Workspace
  config: CallConfig
  dispatch_pushers: int = dataclasses.field(init=False, compare=False)
  send_once: bool = dataclasses.field(init=False, compare=False)
  fp8_fused_combine: bool = dataclasses.field(init=False)
  fp8_fused_dispatch: bool = dataclasses.field(init=False)

  def __post_init__(self):
    ws, cfg = self.workspace, self.config
    budget = ws.device.sm_budget
    if cfg.consumer_ctas > 0 and budget is not None and cfg.consumer_ctas > budget - 1:
      raise ValueError(f"jax_moe_overlap: CallConfig.consumer_ctas={cfg.consumer_ctas} leaves no producer CTA: each "
                       f"rank of this workspace has an SM budget of {budget} CTAs, so pin C in [1, {budget - 1}] "
                       "(or 0 for the resource manager's choice)")
    if ws.platform != "cpu":
      command_buffers.check_scheduling()
    object.__setattr__(self, "dispatch_pushers", dispatch_pushers(cfg, ws.device, ws.ranks))
    object.__setattr__(self, "send_once", send_once(cfg))
    object.__setattr__(self, "fp8_fused_combine", fp8_fused_combine(ws.platform))
    object.__setattr__(self, "fp8_fused_dispatch", fp8_fused_dispatch(ws.platform, self.dispatch_pushers))

  def coords(self):
    """Inside shard_map: (group, rank) of this device, the operands every workspace call takes."""
    ws = self.workspace
    return ws.group_index(), jax.lax.axis_index(ws.axis_name).astype(jnp.int32)

  def attrs(self) -> dict:
    """The attributes every workspace call takes: the workspace handle and the call's options, which the handlers of
    both platforms decode by name into one struct (CallAttrs of ffi/common/call_attrs.h; the options are its
    CallOptions, ffi/common/call_options.h). The calls' own attributes (transpose_rhs, swiglu) are their wrappers'."""
    cfg, tuning = self.config, self.config.consumer_tuning
    return dict(workspace=np.int64(self.workspace.handle), timeout_ms=np.int64(cfg.timeout_ms),
                first_call_timeout_ms=np.int64(cfg.first_call_timeout_ms),
                delay_rank=np.int32(cfg.delay_rank), delay_us=np.int64(cfg.delay_us),
                consumer_ctas=np.int32(cfg.consumer_ctas), serialize=np.bool_(cfg.serialize),
                push_bulk_copy=np.bool_(tuning.bulk_copy), push_slots=np.int32(tuning.slots),
                push_read_lag=np.int32(tuning.read_lag), push_issuers=np.int32(tuning.issuers),
                pushers=np.int32(cfg.dispatch_pushers),  # 0: the library's choice, made by the launch
                x_recv_from_tiles=np.bool_(cfg.x_recv_from_tiles))
