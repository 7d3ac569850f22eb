"""The workspace's custom calls and the differentiable expert block built from them.

All functions here run *per rank*, inside ``shard_map`` over the expert-parallel axis.

* ``gather_counts(counts, info)``: every rank's routing counts for the plan: ``jax.lax.all_gather``, or where the
  workspace's groups span processes the custom call ``exchange_counts`` through the workspace, whose waits are
  bounded like the others'.
* ``dispatch(src, slot_src_row, plan, ...)``: rows ``src[slot_src_row[p]]`` go to ``plan.slot_dest_rank[p]``'s recv
  rows; returns this rank's recv rows ``[cap, D]`` (rows past ``plan.recv_rows`` are zero).
* ``expert_combine(lhs, w, gates, plan, ...)``: the overlapped operator. The producer computes
  ``lhs[segment] @ w[expert]`` per (local expert, source rank) segment, remote-critical segments first, flagging each
  finished band; the consumer ships each band back to its source rank; the source combines
  ``y[t] = sum_j gates[t, j] * out[slot(t, j)]`` in the fixed order ``j = 0..k-1``. Returns ``y [T, N]`` and, when
  asked, the per-slot outputs ``[T*k, N]`` (for the gates' gradient).
* ``expert_block``: dispatch -> grouped GEMM1 + SwiGLU -> expert_combine, with a ``custom_vjp`` whose backward pass
  uses the same two custom calls: ``gates*dy`` is dispatched like tokens, and ``dx`` is ``expert_combine`` of the
  GEMM1 input gradient with ``W1^T`` (``transpose_rhs``: W1 read transposed in place, no copy) and unit gates.
* ``expert_mlp``: the same GEMMs on rows a rank already holds, no custom call that talks to a peer (the
  benchmarks' compute-alone measurement).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_overlap import _ffi
from jax_moe_overlap import engines
from jax_moe_overlap import env
from jax_moe_overlap.grouped_gemm import grouped_matmul, grouped_matmul_swiglu, grouped_outer
from jax_moe_overlap.ordering import workspace_call
from jax_moe_overlap.plan import Plan


def _int_in(value, lo: int, hi: int) -> bool:
  return not isinstance(value, bool) and isinstance(value, (int, np.integer)) and lo <= value <= hi


@dataclasses.dataclass(frozen=True)
class ConsumerTuning:
  """How expert_combine's CUDA consumer CTAs push their bands (ignored on CPU). Defaults: $JMO_CONSUMER_COPY,
  $JMO_PUSH_SLOTS, $JMO_PUSH_READ_LAG, $JMO_PUSH_ISSUERS (env.py), else the values the shipped calibration was
  measured with.

  bulk_copy: TMA bulk copies on Hopper (True), or ordinary 16-byte loads and stores (False).
  slots: shared-memory ring slots of one issuing thread, 2..24 (the launch's shared memory may give fewer).
  read_lag: bulk stores that may still be reading their slot, 1..16 (kept below the slots).
  issuers: issuing threads per consumer CTA, one ring each, 1..8 (one thread moves ~12 GB/s on the H200).
  """

  bulk_copy: bool = dataclasses.field(default_factory=env.consumer_bulk_copy)
  slots: int = dataclasses.field(default_factory=env.push_slots)
  read_lag: int = dataclasses.field(default_factory=env.push_read_lag)
  issuers: int = dataclasses.field(default_factory=env.push_issuers)

  def __post_init__(self):
    if not isinstance(self.bulk_copy, (bool, np.bool_)):
      raise ValueError(f"jax_moe_overlap: ConsumerTuning.bulk_copy must be a bool, got {self.bulk_copy!r}")
    for name, lo, hi in (("slots", 2, 24), ("read_lag", 1, 16), ("issuers", 1, 8)):
      if not _int_in(getattr(self, name), lo, hi):
        raise ValueError(f"jax_moe_overlap: ConsumerTuning.{name} must be an int in [{lo}, {hi}], got "
                         f"{getattr(self, name)!r}")

  def attrs(self) -> dict:
    return dict(push_bulk_copy=np.bool_(self.bulk_copy), push_slots=np.int32(self.slots),
                push_read_lag=np.int32(self.read_lag), push_issuers=np.int32(self.issuers))


@dataclasses.dataclass(frozen=True)
class CallConfig:
  """Static settings of the custom calls.

  timeout_ms: bound on every wait for a peer or flag; a wait that expires raises an error naming rank, peer,
    stage and counts (default $JMO_TIMEOUT_MS, else 10 s).
  delay_rank, delay_us: testing aid that holds one rank back at the start of every call (-1: none).
  consumer_ctas: CTAs of expert_combine's consumer (the communication engine) on CUDA. 0 (default): the resource
    manager chooses per call on the device from the routed counts (or a fixed count when the GPU has no
    calibration: ``Workspace.device.consumer_policy`` says which); > 0: pinned, at most the rank's SM budget - 1.
  serialize: no overlap anywhere (the baseline of the benchmarks; results are identical): the dispatch and GEMM1 run
    as two calls, and expert_combine's consumer starts only after the producer has finished every tile.
  consumer_tuning: how the CUDA consumer pushes (ConsumerTuning).
  dispatch_pushers: whether the dispatch and the GEMM after it run as one dispatch_gemm call, each GEMM1 tile
    starting once its rows have arrived (in the forward GEMM1 with its SwiGLU in the call's epilogue, in the backward
    the dispatch of gates * dy with its d_out W2^T), and with how many pushing CTAs; else as two calls (the dispatch,
    then the bare grouped GEMM). The fused call equals the two calls bit for bit on the CUDA engine and on the CPU
    handlers alike. 0 (default): the library's choice (``dispatch_pushers_for``): fused with AUTO_PUSHERS pushing
    CTAs where the expert axis has two ranks or more on Hopper GPUs and the operands take the wgmma engine (bfloat16,
    d_model and 2 * d_ff multiples of 64, d_ff of 32), two calls elsewhere (one rank: nothing to hide; CPU: XLA's
    ragged_dot is faster there). > 0: fused with this many pushing CTAs wherever the operands allow (on CUDA only on
    Hopper: elsewhere the call fails with an error saying so); on CPU any value > 0 selects the fused CPU handler, the
    protocol's specification, whose GEMMs are the bare grouped GEMMs' CPU loops, while the default two calls' are
    XLA's ragged_dot (results equal to float32 rounding, not bit for bit). Not with serialize.
  """

  timeout_ms: int = dataclasses.field(default_factory=env.timeout_ms)
  delay_rank: int = -1
  delay_us: int = 0
  consumer_ctas: int = 0
  serialize: bool = False
  dispatch_pushers: int = 0
  consumer_tuning: ConsumerTuning = dataclasses.field(default_factory=ConsumerTuning)

  def __post_init__(self):
    if isinstance(self.consumer_ctas, bool) or not isinstance(self.consumer_ctas, (int, np.integer)) or \
        self.consumer_ctas < 0 or self.consumer_ctas > 2**31 - 1:
      raise ValueError(f"jax_moe_overlap: CallConfig.consumer_ctas must be an int >= 0 (0: the resource manager's "
                       f"choice), got {self.consumer_ctas!r}")
    if not isinstance(self.serialize, (bool, np.bool_)):
      raise ValueError(f"jax_moe_overlap: CallConfig.serialize must be a bool, got {self.serialize!r}")
    if isinstance(self.dispatch_pushers, bool) or not isinstance(self.dispatch_pushers, (int, np.integer)) or \
        self.dispatch_pushers < 0 or self.dispatch_pushers > 2**31 - 1:
      raise ValueError(f"jax_moe_overlap: CallConfig.dispatch_pushers must be an int >= 0 (0: the library's choice), "
                       f"got {self.dispatch_pushers!r}")
    if self.serialize and self.dispatch_pushers > 0:
      raise ValueError(f"jax_moe_overlap: CallConfig(serialize=True) runs the dispatch and GEMM1 as two calls (no "
                       f"overlap anywhere); it excludes dispatch_pushers={self.dispatch_pushers}, which overlaps them")

  def attrs(self, workspace) -> dict:
    return dict(workspace=np.int64(workspace.handle), timeout_ms=np.int64(self.timeout_ms),
                delay_rank=np.int32(self.delay_rank), delay_us=np.int64(self.delay_us))

  def combine_attrs(self, workspace) -> dict:
    """expert_combine's attributes: those of every call plus the consumer options (checked against the workspace's
    SM budget here, before anything runs)."""
    budget = workspace.device.sm_budget
    if self.consumer_ctas > 0 and budget is not None and self.consumer_ctas > budget - 1:
      raise ValueError(f"jax_moe_overlap: CallConfig.consumer_ctas={self.consumer_ctas} leaves no producer CTA: each "
                       f"rank of this workspace has an SM budget of {budget} CTAs, so pin C in [1, {budget - 1}] "
                       "(or 0 for the resource manager's choice)")
    return dict(self.attrs(workspace), consumer_ctas=np.int32(self.consumer_ctas),
                serialize=np.int32(1 if self.serialize else 0), **self.consumer_tuning.attrs())


@dataclasses.dataclass(frozen=True)
class RankInfo:
  """Static description of one call site: the workspace and this device's coordinates."""

  workspace: object  # Workspace (hashable by identity)
  config: CallConfig

  def coords(self):
    ws = self.workspace
    return ws.group_index(), jax.lax.axis_index(ws.axis_name).astype(jnp.int32)


def _workspace_call(info: RankInfo, target: str, out_types, *args, **attrs):
  """One call on the workspace. On CPU an ordered effect (ordering.py): XLA:CPU would otherwise start two workspace
  calls with no data between them in any order, per rank. On CUDA a plain custom call: XLA:GPU runs the calls on one
  stream in program order.

  Not ``has_side_effect=True`` on CUDA: that gives the call an effect, and any effect in a program turns off JAX's
  C++ dispatch fast path (pjit ``_get_fastpath_data``), so every call of the jitted function went through Python
  dispatch: 0.8 ms of host time per call in bench_fused (jax.profiler trace, H200), more than the kernels' 0.5 ms,
  which made the fused operator host-bound. What the flag would add is not needed: every rank runs the same compiled
  program, so if XLA removes a call whose outputs are unused, or merges two identical calls, it does so on every rank
  alike and the ranks' call sequences still match (the protocol needs only that)."""
  if info.workspace.platform == "cpu":
    return workspace_call(target, out_types, *args, **attrs)
  # vmap: one call per batch element (ordering._batching_rule says why that is the only correct way).
  return jax.ffi.ffi_call(target, out_types, vmap_method="sequential")(*args, **attrs)


def gather_counts(counts: jax.Array, info: RankInfo) -> jax.Array:
  """[R_dst, E_local] routing counts of this rank -> [R_src, R_dst, E_local] every rank's, for ``plan_over_axis``.

  When the workspace's groups span processes, through the workspace (``exchange_counts``): across processes
  ``jax.lax.all_gather`` runs on the collective backend (gloo on CPU, NCCL on CUDA), whose wait has no bound, so a
  peer process that hangs between calls would block its peers there for good (and NCCL refuses two processes on
  one GPU). Elsewhere (one process) ``jax.lax.all_gather``.
  """
  if info.workspace.spans_processes:
    return exchange_counts(counts, info)
  return jax.lax.all_gather(counts, info.workspace.axis_name)


def exchange_counts(counts: jax.Array, info: RankInfo) -> jax.Array:
  """[R_dst, E_local] int32 -> [R_src, R_dst, E_local] int32: every rank's counts through the workspace's count board
  (protocol.h), one epoch of the workspace like the other calls, every wait bounded by ``timeout_ms``."""
  ws = info.workspace
  _ffi.register()
  group, rank = info.coords()
  return _workspace_call(info, _ffi.EXCHANGE_COUNTS, jax.ShapeDtypeStruct((ws.ranks, *counts.shape), jnp.int32),
                         counts.astype(jnp.int32), group, rank, **info.config.attrs(ws))


def dispatch(src: jax.Array, slot_src_row: jax.Array, plan: Plan, cap: int, info: RankInfo) -> jax.Array:
  """[S, D] rows -> [cap, D] recv rows of this rank (grouped by (local expert, source rank))."""
  _ffi.register()
  group, rank = info.coords()
  return _workspace_call(info, _ffi.DISPATCH, jax.ShapeDtypeStruct((cap, src.shape[1]), src.dtype),
                         src, slot_src_row.astype(jnp.int32), plan.slot_dest_rank, plan.slot_dest_row, plan.recv_rows,
                         group, rank, **info.config.attrs(info.workspace))


def dispatch_gemm(src: jax.Array, slot_src_row: jax.Array, w: jax.Array, plan: Plan, cap: int, info: RankInfo, *,
                  transpose_rhs: bool = False, swiglu: bool = False, keep_recv: bool = True,
                  keep_a: bool = False) -> tuple[jax.Array | None, jax.Array, jax.Array | None]:
  """dispatch and GEMM1 in one call, each GEMM tile starting once the 128-row blocks holding its rows are in.

  Args:
    src: [S, D] rows, float32 or bfloat16; slot_src_row, plan, cap, info: as ``dispatch``.
    w: [E_local, D, N] in src's dtype, or [E_local, N, D] read transposed with ``transpose_rhs``.
    swiglu: GEMM1 of the expert MLP (w [E_local, D, 2F], not with ``transpose_rhs``): the call's epilogue applies the
      SwiGLU in float32 to the float32 preactivation.
    keep_recv: also return the recv rows (the backward pass reads them; the inference forward does not).
    keep_a: with ``swiglu``, also return the preactivation (for the backward pass).
  Returns:
    (x_recv [cap, D] as ``dispatch`` returns it, or None unless keep_recv; out; a or None), where without swiglu
    out = [cap, N] float32, the recv rows of each (expert, source) segment @ w[expert], and a is None; with swiglu
    out = h [cap, F] in src's dtype = silu(a[:, :F]) * a[:, F:] of a = [cap, 2F] float32, the rows' product with
    w[expert], and a is returned when keep_a. Rows past the kept ones are zero in every result. The results equal
    ``dispatch`` followed by ``grouped_matmul`` (float32 output) or ``grouped_matmul_swiglu`` bit for bit.
  On CUDA (Hopper, bfloat16) ``dispatch_pushers_for(info)`` CTAs (at least one) push the rows for other ranks, then
  copy x_recv and zero the padding rows beside the GEMM, then join it; on CPU (float32 or bfloat16) the handler
  thread pushes, then computes with the bare grouped GEMMs' CPU numerics.
  """
  if src.ndim != 2 or w.ndim != 3 or w.shape[2 if transpose_rhs else 1] != src.shape[1]:
    raise ValueError(f"jax_moe_overlap: dispatch_gemm: src {src.shape} and w {w.shape} do not fit src [S, D], w "
                     f"{'[E_local, N, D] (transpose_rhs)' if transpose_rhs else '[E_local, D, N]'}")
  if swiglu and transpose_rhs:
    raise ValueError("jax_moe_overlap: dispatch_gemm: swiglu is GEMM1's epilogue (w [E_local, D, 2F]); it does not "
                     "take transpose_rhs")
  if swiglu and w.shape[2] % 2:
    raise ValueError(f"jax_moe_overlap: dispatch_gemm: with swiglu w must be [E_local, D, 2F] (an even number of "
                     f"columns: the gate's F, then the up projection's F), got w {w.shape}")
  if keep_a and not swiglu:
    raise ValueError("jax_moe_overlap: dispatch_gemm: keep_a keeps the SwiGLU's preactivation; without swiglu the "
                     "GEMM's output is `out` itself (keep_a needs swiglu=True)")
  D, N = src.shape[1], (w.shape[1] if transpose_rhs else w.shape[2])
  out = jax.ShapeDtypeStruct((cap, N // 2), src.dtype) if swiglu else jax.ShapeDtypeStruct((cap, N), jnp.float32)
  out_types = (jax.ShapeDtypeStruct((cap if keep_recv else 0, D), src.dtype), out,
               jax.ShapeDtypeStruct((cap if keep_a else 0, N), jnp.float32))
  x_recv, out, a = _dispatch_gemm_call(src, slot_src_row, w, plan, info, out_types, transpose_rhs, swiglu)
  return (x_recv if keep_recv else None), out, (a if keep_a else None)


def _dispatch_gemm_call(src, slot_src_row, w, plan: Plan, info: RankInfo, out_types, transpose_rhs: bool,
                        swiglu: bool):
  """The custom call of ``dispatch_gemm`` with the result types as given (x_recv, out, a): unchecked here, so that
  the tests reach the handlers' own shape checks."""
  _ffi.register()
  group, rank = info.coords()
  return _workspace_call(info, _ffi.DISPATCH_GEMM, out_types, src, slot_src_row.astype(jnp.int32),
                         plan.slot_dest_rank, plan.slot_dest_row, plan.recv_rows, plan.send_order, plan.send_start,
                         plan.seg_rows, plan.seg_ret_off, w, group, rank,
                         pushers=np.int32(max(1, dispatch_pushers_for(info))), transpose_rhs=np.bool_(transpose_rhs),
                         swiglu=np.bool_(swiglu), **info.config.attrs(info.workspace))


# Pushing CTAs of dispatch_gemm where the library chooses (CallConfig.dispatch_pushers = 0), at most one in 8 of the
# rank's SMs. Measured in loopback on one H200 (two ranks of 66 SMs, the seed shape, an emulated NVLink): 8 pushers
# 1.06-1.07x the two calls, 16 pushers 1.05x, so the fewer SMs off the GEMM (docs/performance.md, dispatch_gemm).
AUTO_PUSHERS = 8


def dispatch_pushers_for(info: RankInfo) -> int:
  """dispatch_gemm's pushing CTAs at this call site, or 0: the dispatch and GEMM1 run as two calls (CallConfig's
  rule: pinned, or the library's choice on Hopper GPUs with two ranks or more, none with serialize)."""
  cfg, ws = info.config, info.workspace
  if cfg.serialize:
    return 0
  if cfg.dispatch_pushers > 0:
    return cfg.dispatch_pushers
  if not engines.wgmma_runs_on(ws.device.compute_capability) or ws.ranks < 2:
    return 0
  return max(1, min(AUTO_PUSHERS, (ws.device.sm_budget or 0) // 8))


def _fuses_dispatch(x, w, info: RankInfo, swiglu: bool, transpose_rhs: bool) -> bool:
  """Whether a dispatch of rows x and the GEMM with w after it run as one dispatch_gemm: chosen
  (dispatch_pushers_for) and taken by the engine (``engines.dispatch_gemm_operands``)."""
  if dispatch_pushers_for(info) <= 0:
    return False
  K, N = (w.shape[2], w.shape[1]) if transpose_rhs else (w.shape[1], w.shape[2])
  bf16 = x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16
  return engines.dispatch_gemm_operands(info.workspace.platform, bf16, K, N, swiglu)


def expert_combine(lhs: jax.Array, w: jax.Array, gates: jax.Array, plan: Plan, info: RankInfo,
                   want_slots: bool, transpose_rhs: bool = False) -> tuple[jax.Array, jax.Array]:
  """lhs [cap, K], w [E_local, K, N], gates [T, k] float32 -> (y [T, N], slot_out [T*k or 0, N]).

  lhs, w and the outputs share one dtype (float32 or bfloat16); accumulation is float32. With ``transpose_rhs``, w is
  [E_local, N, K] and the producer reads ``w[e].T`` in place (the input gradient ``da @ W1^T`` of the backward pass
  without a transposed copy of W1), as ``grouped_matmul``'s ``transpose_rhs``.
  """
  _ffi.register()
  group, rank = info.coords()
  T, k = gates.shape
  K, N = (w.shape[2], w.shape[1]) if transpose_rhs else (w.shape[1], w.shape[2])
  if lhs.ndim != 2 or w.ndim != 3 or lhs.shape[1] != K:
    raise ValueError(f"jax_moe_overlap: expert_combine: lhs {lhs.shape} and w {w.shape}"
                     f"{' (transpose_rhs)' if transpose_rhs else ''} do not fit lhs [cap, K], "
                     f"w {'[E_local, N, K]' if transpose_rhs else '[E_local, K, N]'}")
  out_types = (jax.ShapeDtypeStruct((T, N), lhs.dtype),
               jax.ShapeDtypeStruct((T * k if want_slots else 0, N), lhs.dtype))
  return _workspace_call(info, _ffi.EXPERT_COMBINE, out_types, lhs, w, gates.astype(jnp.float32), plan.seg_rows,
                         plan.seg_ret_off, plan.slot_ret_row, plan.ret_rows, group, rank,
                         transpose_rhs=np.bool_(transpose_rhs), **info.config.combine_attrs(info.workspace))


def swiglu(a: jax.Array) -> jax.Array:
  """[rows, 2F] -> [rows, F]: silu(a[:, :F]) * a[:, F:]."""
  gate, up = jnp.split(a, 2, axis=-1)
  return jax.nn.silu(gate) * up


def _matmul(lhs, rhs, group_sizes, transpose_rhs=False, out_dtype=jnp.float32):
  """Grouped matmul of the expert GEMMs outside expert_combine: our custom call on GPU; XLA's ragged_dot on CPU.

  Why not the custom call on CPU too (it exists, tests/test_grouped_gemm.py checks it): its CPU handler is a
  reference loop, and XLA:CPU's ragged_dot is faster: the CPU training example (examples/train_moe.py --steps 100)
  took about twice as long with the custom calls, same losses. (The order of the workspace calls does not depend on
  this: ordering.py chains them on CPU.)
  """
  def xla():
    rhs_ = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    return jax.lax.ragged_dot(lhs, rhs_, group_sizes, preferred_element_type=jnp.float32).astype(out_dtype)

  def ours():
    return grouped_matmul(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, preferred_element_type=out_dtype)

  return jax.lax.platform_dependent(cpu=xla, default=ours)


def _outer(lhs, rhs, group_sizes, out_dtype):
  """[rows, K], [rows, N] grouped by consecutive row blocks -> [G, K, N] per-group lhs^T @ rhs (as _matmul: ours on
  GPU, XLA's ragged_dot_general on CPU)."""
  def xla():
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims,
                                      preferred_element_type=jnp.float32).astype(out_dtype)

  def ours():
    return grouped_outer(lhs, rhs, group_sizes, preferred_element_type=out_dtype)

  return jax.lax.platform_dependent(cpu=xla, default=ours)


def _gemm1_swiglu(x_recv, w1, group_sizes, keep_a: bool):
  """GEMM1 and its SwiGLU in float32: (h [cap, F] in x_recv's dtype, a [cap, 2F] float32 GEMM1's output, or None
  unless keep_a). On GPU one custom call, which on Hopper applies the SwiGLU in the GEMM's epilogue (no pass over a,
  and a is written only when kept); on CPU XLA's ragged_dot, then the SwiGLU."""
  def xla():
    a = _matmul(x_recv, w1, group_sizes)
    return (swiglu(a).astype(x_recv.dtype), a) if keep_a else swiglu(a).astype(x_recv.dtype)

  def ours():
    h, a = grouped_matmul_swiglu(x_recv, w1, group_sizes, keep_preactivation=keep_a)
    return (h, a) if keep_a else h

  out = jax.lax.platform_dependent(cpu=xla, default=ours)
  return out if keep_a else (out, None)


def _dispatch_and_gemm1(x, gates, w1, plan, cap, info, keep_a: bool):
  """Tokens to their experts' ranks, then GEMM1 and its SwiGLU: (x_recv [cap, D] or None, h [cap, F] in x's dtype,
  a [cap, 2F] float32 or None). keep_a: keep what the backward pass reads, x_recv and a (the forward alone needs
  neither, so without it the fused call writes neither)."""
  T, k = gates.shape
  slot_src_row = jnp.arange(T * k, dtype=jnp.int32) // k
  if _fuses_dispatch(x, w1, info, swiglu=True, transpose_rhs=False):
    return dispatch_gemm(x, slot_src_row, w1, plan, cap, info, swiglu=True, keep_recv=keep_a, keep_a=keep_a)
  x_recv = dispatch(x, slot_src_row, plan, cap, info)
  return ((x_recv if keep_a else None), *_gemm1_swiglu(x_recv, w1, plan.expert_rows, keep_a))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def expert_block(x, gates, w1, w2, plan: Plan, cap: int, info: RankInfo):
  """Per-rank expert block. x [T, D], gates [T, k] f32, w1 [E_local, D, 2F], w2 [E_local, F, D] -> y [T, D]."""
  _, h, _ = _dispatch_and_gemm1(x, gates, w1, plan, cap, info, keep_a=False)
  y, _ = expert_combine(h, w2, gates, plan, info, want_slots=False)  # no per-slot rows without a backward pass
  return y


def _expert_block_fwd(x, gates, w1, w2, plan, cap, info):
  x_recv, h, a = _dispatch_and_gemm1(x, gates, w1, plan, cap, info, keep_a=True)
  y, slot_out = expert_combine(h, w2, gates, plan, info, want_slots=True)
  return y, (x_recv, a, slot_out, gates, w1, w2, plan)


def _expert_grads(x_recv, a, d_out, w1, w2, group_sizes, dh=None):
  """The local backward GEMMs of GEMM1 + SwiGLU + GEMM2 on a rank's recv rows, all but the input gradient.

  x_recv [cap, D], a [cap, 2F] float32 (GEMM1's output), d_out [cap, D] (GEMM2's output gradient), w1 [E_local, D,
  2F], w2 [E_local, F, D], group_sizes [E_local] -> (da [cap, 2F] in x_recv's dtype, dw1, dw2 in the weights' dtypes).
  dh [cap, F] float32 = d_out W2^T when the caller has it (dispatch_gemm), else computed here.
  """
  h, swiglu_vjp = jax.vjp(swiglu, a)                                       # float32
  if dh is None:
    dh = _matmul(d_out, w2, group_sizes, transpose_rhs=True)
  dw2 = _outer(h.astype(w2.dtype), d_out, group_sizes, w2.dtype)
  (da,) = swiglu_vjp(dh)
  da = da.astype(x_recv.dtype)
  dw1 = _outer(x_recv, da, group_sizes, w1.dtype)
  return da, dw1, dw2


def _expert_block_bwd(cap, info, res, dy):
  x_recv, a, slot_out, gates, w1, w2, plan = res
  T, k = gates.shape
  dy_slot = jnp.repeat(dy, k, axis=0)                                     # [P, D], slot p = t*k + j
  d_gates = jnp.sum(dy_slot.astype(jnp.float32) * slot_out.astype(jnp.float32), axis=-1).reshape(T, k)
  d_slot = (gates.reshape(T * k, 1).astype(jnp.float32) * dy_slot.astype(jnp.float32)).astype(dy.dtype)
  slot_rows = jnp.arange(T * k, dtype=jnp.int32)
  if _fuses_dispatch(d_slot, w2, info, swiglu=False, transpose_rhs=True):
    # The dispatch of gates * dy with dh = d_out W2^T (float32), as the forward's dispatch with GEMM1; d_out is kept
    # for the weight gradient dW2.
    d_out, dh, _ = dispatch_gemm(d_slot, slot_rows, w2, plan, cap, info, transpose_rhs=True)
  else:
    d_out = dispatch(d_slot, slot_rows, plan, cap, info)                                # [cap, D] at the experts
    dh = None
  da, dw1, dw2 = _expert_grads(x_recv, a, d_out, w1, w2, plan.expert_rows, dh)
  # dx = da @ W1^T per expert: W1 [E_local, D, 2F] is read transposed in place (no [E_local, 2F, D] copy).
  dx, _ = expert_combine(da, w1, jnp.ones_like(gates, jnp.float32), plan, info, want_slots=False, transpose_rhs=True)
  plan_ct = jax.tree.map(lambda v: np.zeros(v.shape, jax.dtypes.float0), plan)
  return dx, d_gates.astype(gates.dtype), dw1, dw2, plan_ct


expert_block.defvjp(_expert_block_fwd, _expert_block_bwd)


@jax.custom_vjp
def expert_mlp(x_recv, w1, w2, group_sizes):
  """One rank's expert work on rows it already holds, with no communication: expert_block minus its custom calls.

  GEMM1 + SwiGLU + GEMM2 through the grouped GEMMs of expert_block (GEMM2 as ``grouped_matmul``, the tile engine of
  expert_combine's producer, on every SM), and under ``jax.grad`` expert_block's backward GEMMs, the input gradient
  ``da @ W1^T`` as ``grouped_matmul``. The benchmarks' "compute alone" (benchmarks/ideal_probes.py).

  Args:
    x_recv: [cap, D] rows grouped by local expert (float32 or bfloat16). w1: [E_local, D, 2F]; w2: [E_local, F, D].
    group_sizes: [E_local] int32 rows per local expert (their sum <= cap).
  Returns:
    [cap, D] in x_recv's dtype; rows past the last group are zero.
  """
  h, _ = _gemm1_swiglu(x_recv, w1, group_sizes, keep_a=False)
  return _matmul(h, w2, group_sizes, out_dtype=x_recv.dtype)


def _expert_mlp_fwd(x_recv, w1, w2, group_sizes):
  h, a = _gemm1_swiglu(x_recv, w1, group_sizes, keep_a=True)
  out = _matmul(h, w2, group_sizes, out_dtype=x_recv.dtype)
  return out, (x_recv, a, w1, w2, group_sizes)


def _expert_mlp_bwd(res, d_out):
  x_recv, a, w1, w2, group_sizes = res
  da, dw1, dw2 = _expert_grads(x_recv, a, d_out, w1, w2, group_sizes)
  dx = _matmul(da, w1, group_sizes, transpose_rhs=True, out_dtype=x_recv.dtype)
  return dx, dw1, dw2, np.zeros(group_sizes.shape, jax.dtypes.float0)


expert_mlp.defvjp(_expert_mlp_fwd, _expert_mlp_bwd)
