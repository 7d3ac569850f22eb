"""The loopback cases: the suites, and each case's routing, plans (jax_moe_overlap.plan) and data.

A case runs R ranks of the library's kernels on one GPU (tools/loopback/run.py). Its routing plans come from the
library's own ``plan.py`` (``local_counts``, ``make_plan``, ``expert_capacity``, ``recv_capacity``), evaluated by JAX
on the CPU, so the harness exercises exactly the offsets the layer computes. A case with ``tensor`` > 1 runs the
exchange group of expert tensor parallelism (tools/loopback/tensor.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import ml_dtypes
import numpy as np

from jax_moe_overlap import call_site, env
from jax_moe_overlap.config import CallConfig

ROUTINGS = ("balanced", "moderate", "extreme", "round_robin", "next_rank")
AUTO = -1  # Case.dispatch_gemm_pushers: the library's count for the rank's SM budget (DefaultPushers, call_options.h)


@dataclasses.dataclass
class Case:
  """One loopback case (the command-line options of run.py, one field each)."""
  ranks: int = 2                 # the exchange group's ranks (with `tensor`: expert ranks x tensor ranks)
  tokens: int = 128              # per rank
  top_k: int = 2
  experts: int = 8               # total, divisible by the expert ranks
  d_model: int = 128             # dispatch row width
  k_dim: int = 200               # expert_combine K (the whole expert's; a rank's is k_dim / tensor)
  n_dim: int = 136               # expert_combine N
  # Expert tensor parallelism (docs/design.md, "Expert tensor parallelism"; tools/loopback/tensor.py): the ranks are
  # ranks / tensor expert ranks x `tensor` tensor ranks (rank g = r tensor + t), each token's choice is `tensor` shard
  # slots (tensor_parallel.shard_slots), each rank holds its K / tensor shard of its expert rank's experts (of
  # dispatch_gemm's w1, k_dim = 2F: the gate's and the up projection's F / tensor columns), and the references are
  # the whole experts'.
  tensor: int = 1
  iters: int = 20                # iterations of (dispatch, expert_combine)
  # 0 balanced, 1 moderate (Zipf with exponent `zipf`), 2 extreme (token's j-th choice = expert j), 3 exact round
  # robin (slot p -> expert p mod E: equal segments), 4 next rank (rank r's slots round robin over rank r+1's
  # experts: every row is pushed)
  routing: int = 0
  zipf: float = 1.0              # routing 1: expert e has weight 1 / (1 + e)^zipf
  capacity_factor: float = 0.0   # 0: dropless, else plan.expert_capacity's rule
  f32: bool = False              # float32 operands (SIMT producer) instead of bfloat16 (tensor cores)
  transpose_rhs: bool = False    # expert_combine's w stored [E_l, N, K] and read transposed in place
  # expert_combine's producer on e4m3 operands (the FP8 grouped GEMM's loop, Hopper): lhs quantized 1 x 128, w per
  # 128 x 128 block (fp8.quantize_rows, fp8.quantize_weight), the references on their dequantized values; its rows and
  # outputs bfloat16 (float32 with f32). K and N multiples of 128, no tensor axis. With dispatch_gemm its FP8 form too:
  # x quantized 1 x 128 with power-of-two scales and packed (fp8.pack_rows), w1 quantized per block, GEMM1's SwiGLU
  # quantizing h and a (D a multiple of 512, K = 2F with F a multiple of 128); its two-call twin reads the recv rows
  # unpacked on the host (RankData.fp8_operands).
  fp8: bool = False
  delay_rank: int = -1           # this rank is held back delay_us at the start of every call
  delay_us: int = 0
  timeout_at: int = -1           # at this iteration the last rank skips its dispatch: the others time out, the next
                                 # call of every rank reports it, and the calls after it are correct again
  timeout_ms: int = 5000
  short_timeout_ms: int = 200
  stuck_stream_ms: int = 0       # > 0 with timeout_at: rank 0's stream held this long by a host function before the
                                 # call that reports the timeout: every rank's call must give up within
                                 # short_timeout_ms (rank 0 waiting for its stream, the others at the recovery barrier)
  datasets: int = 3
  seed: int = 1
  consumers: int = 2             # consumer CTAs per rank and call (0: the manager's choice)
  serialize: bool = False
  # How the consumer pushes (CallOptions::tuning; the fields of jax_moe_overlap.config.ConsumerTuning), defaults
  # as the library's: $JMO_CONSUMER_COPY, $JMO_PUSH_SLOTS, $JMO_PUSH_READ_LAG, $JMO_PUSH_ISSUERS (env.py), else the
  # shipped values.
  bulk_copy: bool = dataclasses.field(default_factory=env.consumer_bulk_copy)  # False: 16-byte loads and stores
  push_slots: int = dataclasses.field(default_factory=env.push_slots)
  push_read_lag: int = dataclasses.field(default_factory=env.push_read_lag)
  push_issuers: int = dataclasses.field(default_factory=env.push_issuers)
  # The workspace's ModelParams (11 numbers, 10 without gather_gbps, 9 without pusher_gbps either), else the fixed
  # C = SMs / 8 and the fixed pusher rule.
  model: tuple[float, ...] | None = None
  sm_budget: int = 0             # CTAs per rank (0: SMs / ranks)
  device: int = 0
  # Timing (after the checked iterations, on data set 0): per C of `sweep` (or just `consumers` when empty), then the
  # manager and the manager serialized when `sweep` is given, `warmup` then `reps` timed calls of expert_combine.
  time: bool = False
  sweep: tuple[int, ...] = ()
  warmup: int = 3
  reps: int = 20
  # Every timed call started together on every rank (its stream drained, a barrier: the ranks aligned as a layer's
  # combine leaves them) and timed from its start, instead of back to back (where a rank's call starts when its
  # previous one ends, and the ranks drift apart); expert_combine's calls also read their device spans.
  per_call_stats: bool = False
  decision_iters: int = 0        # > 0: also time the device-side choice on rank 0's plan
  # Timing: the overlap table's columns (timing.overlap_row): the GEMM alone (the bare grouped GEMM over the rank's
  # kept rows, on its SMs), and for expert_combine (consumers as given, 0: the manager) its serialized form beside
  # it; dispatch_gemm always times its two calls and the dispatch alone.
  table: bool = False
  check_tokens: int = 0          # > 0: check the expert outputs of about this many tokens per rank only
  # != 0: every dispatch is a dispatch_gemm with this many pushing CTAs (> 0; AUTO: the library's count for the rank's
  # SM budget, DefaultPushers); GEMM1 pre = x_recv @ w1[expert] (w1 [E_l, D, K] bf16). bf16, D and K multiples of 64,
  # a Hopper GPU. Its results by `dispatch_gemm_mode` (DG_MODES): "plain"
  # pre [cap, K] float32 and x_recv (the backward pass's form), "train" the SwiGLU h [cap, K / 2] bf16, pre and x_recv
  # (the training forward), "infer" h alone (the inference forward).
  dispatch_gemm_pushers: int = 0
  dispatch_gemm_mode: str = "plain"
  # "plain": the product rounded once to bf16 (dispatch_gemm's out_dtype, as the layer's backward writes its dh:
  # expert_gemms.dgrad_dtype) instead of float32, in dispatch_gemm and its two calls alike.
  dg_out_bf16: bool = False
  # Every dispatch (and dispatch_gemm, and its two calls) lands slot p's row scaled by its gate (the calls' row_scale:
  # the backward's gates * dy dispatched without a [T k, D] array): the float32 product rounded once to the rows'
  # dtype. Not with fp8, send once or a tensor axis.
  row_scale: bool = False
  # dispatch_gemm timing: also the fused call once per P of this sweep (0: the library's choice), for the regret of
  # the P choice (tools/loopback/regret.py).
  dg_sweep: tuple[int, ...] = ()
  # The sweeps (sweep's pinned C and the manager, dg_sweep's P) timed this many times, interleaved: every count once
  # per pass, in the sweep's order. A count's time is the median over the passes (tools/loopback/regret.py), so the
  # run-to-run spread (the ranks' drift differs from one timed run to the next) weighs on every count alike instead
  # of deciding which of two equal choices looks faster.
  sweep_passes: int = 1
  # > 0: every push to another rank (dispatch and dispatch_gemm rows, expert_combine bands) is paced as over a link
  # of this many GB/s per rank (CallOptions::emulated_link_gbps); 0: at HBM speed, as loopback ranks share one GPU's
  # memory.
  link_gbps: float = 0.0
  # > 0: expert_combine's and gather_rs's wgmma producer goes in raster bands of this many row blocks
  # (CallOptions::producer_band_m); 0: the library's rule.
  producer_band_m: int = 0
  # expert_combine's wgmma producer tile order over its segments and dispatch_gemm's over its m-tiles
  # (CallOptions::producer_order): 1 the segment table's (sources first; dispatch_gemm: the own rows' m-tiles first),
  # 2 expert-major; 0: the library's rule.
  producer_order: int = 0
  # With `tensor` > 1: the shards' partials summed by gather_rs (GEMM2 + GatherRS, docs/design.md "GatherRS") in
  # expert_combine's place (tools/loopback/tensor.py gather_tables); its rows output is checked in the slot output's
  # place, and y also bit for bit against its float32 sums restated on the host (tensor.gather_sums).
  gather_rs: bool = False
  # Send once (docs/design.md, "Send once"): every dispatch (and dispatch_gemm) sends a token's row once per destination
  # rank (plan.slot_primary); AUTO: the library's rule (call_site.send_once), 0: one row per slot, 1: send once.
  send_once: int = AUTO
  # dispatch_gemm's x_recv stored by its GEMM tiles from their A tiles in shared memory (the library's default), or
  # copied by its side units (False) (CallOptions::x_recv_from_tiles, CallConfig.x_recv_from_tiles).
  x_recv_from_tiles: bool = True

  @property
  def dg(self) -> bool:
    """Every dispatch is a dispatch_gemm."""
    return self.dispatch_gemm_pushers != 0

  @property
  def timed_dg_sweep(self) -> list[int]:
    """The pushers of the sweep's timed runs in the runner's order: dg_sweep once per pass (sweep_passes)."""
    return list(self.dg_sweep) * max(1, self.sweep_passes)

  @property
  def sends_once(self) -> bool:
    """Whether the dispatches send each row once per destination rank."""
    if self.send_once == AUTO:
      return call_site.send_once(CallConfig())
    return bool(self.send_once)

  @property
  def expert_ranks(self) -> int:
    return self.ranks // self.tensor

  @property
  def experts_per_rank(self) -> int:
    """Experts of each rank (with `tensor` > 1 its shard experts: one shard of each expert of its expert rank)."""
    return self.experts // self.expert_ranks

  @property
  def slot_top_k(self) -> int:
    """Slots per token that the kernels see (each choice as `tensor` shard slots)."""
    return self.top_k * self.tensor

  @property
  def slots(self) -> int:
    return self.tokens * self.slot_top_k

  @property
  def rank_k(self) -> int:
    """K of each rank's calls: expert_combine's K, dispatch_gemm's GEMM1 N."""
    return self.k_dim // self.tensor

  # The layer's capacities (api.moe_experts, workspace.layer_sizes): its group is the `ranks` ranks, with the whole
  # layer's top_k and experts.
  @property
  def expert_cap(self) -> int:
    from jax_moe_overlap import plan  # pylint: disable=g-import-not-at-top
    return plan.expert_capacity(self.tokens, self.ranks, self.top_k, self.experts,
                                self.capacity_factor if self.capacity_factor > 0 else None)

  @property
  def cap(self) -> int:
    from jax_moe_overlap import plan  # pylint: disable=g-import-not-at-top
    return plan.recv_capacity(self.tokens, self.ranks, self.top_k, self.experts_per_rank, self.expert_cap)

  @property
  def check_stride(self) -> int:
    """Expert outputs are checked on every stride-th token (timing shapes: a full host reference takes minutes)."""
    return max(1, self.tokens // self.check_tokens) if self.check_tokens > 0 else 1

  def variants(self) -> list[tuple[int, bool]]:
    """The timed (consumers, serialize) variants."""
    if not self.time:
      return []
    if self.table and not self.dg:  # the call and its serialized form (the no-overlap baseline)
      return [(self.consumers, False), (self.consumers, True)]
    if not self.sweep:
      return [(self.consumers, self.serialize)]
    v = ([(c, self.serialize) for c in self.sweep] + [(0, self.serialize)]) * max(1, self.sweep_passes)
    if not self.serialize:  # the same kernels without overlap: the baseline
      v.append((0, True))
    return v

  def invalid(self) -> str | None:
    """Why the case cannot run, or None."""
    R, E, k, TP = self.ranks, self.experts, self.top_k, self.tensor
    if TP < 1 or R % TP:
      return f"tensor {TP} must be >= 1 and divide ranks {R}"
    if R < 1 or R > 32 or E % (R // TP):
      return f"ranks {R} must be in 1..32 and their {R // TP} expert ranks divide experts {E}"
    if self.k_dim % TP or (TP > 1 and self.dg and self.k_dim % (2 * TP)):
      return (f"k_dim {self.k_dim} must split into {TP} shards (with dispatch_gemm, k_dim = 2F: F divisible by "
              f"tensor)")
    if not 0 <= self.routing < len(ROUTINGS):
      return f"routing {self.routing} not in 0..{len(ROUTINGS) - 1}"
    if k > E or (self.routing == 4 and k > self.experts_per_rank):
      return f"top_k {k} larger than the experts it chooses from"
    if self.consumers < 0:
      return "consumers must be >= 0 (0: the manager)"
    if self.producer_band_m < 0:
      return "producer_band_m must be >= 0 (0: the library's rule)"
    if self.producer_order not in (0, 1, 2):
      return "producer_order must be 0 (the library's rule), 1 (the segment table's) or 2 (expert-major)"
    from jax_moe_overlap import _jmo, engines  # pylint: disable=g-import-not-at-top
    from jax_moe_overlap.config import ConsumerTuning  # pylint: disable=g-import-not-at-top
    try:
      ConsumerTuning(bulk_copy=self.bulk_copy, slots=self.push_slots, read_lag=self.push_read_lag,
                     issuers=self.push_issuers)
    except ValueError as e:
      return str(e)
    # The engine rules come with the CUDA build (the harness's); a build without it has none to ask, and cannot run
    # the harness either.
    if self.dispatch_gemm_pushers < 0 and self.dispatch_gemm_pushers != AUTO:
      return f"dispatch_gemm_pushers {self.dispatch_gemm_pushers}: a count > 0, AUTO ({AUTO}) or 0"
    if (self.dg and not self.fp8 and _jmo.with_cuda and
        not engines.dispatch_gemm_operands("gpu", not self.f32, self.d_model, self.rank_k, self.swiglu)):
      return "dispatch_gemm's engine does not take the case's operands (engines.dispatch_gemm_operands)"
    if self.dg and self.fp8 and (self.d_model % 512 or (self.swiglu and self.k_dim % 256) or
                                 (_jmo.with_cuda and
                                  not engines.fp8_dispatch_gemm_operands("gpu", self.d_model, self.rank_k))):
      return ("fp8 with dispatch_gemm takes d_model a multiple of 512 (its kernel reads the packed rows by TMA at their "
              "stride) and with the SwiGLU K = 2F, F a multiple of 128 (engines.fp8_dispatch_gemm_operands)")
    if self.dispatch_gemm_mode not in DG_MODES:
      return f"dispatch_gemm_mode {self.dispatch_gemm_mode!r} not in {DG_MODES}"
    if self.dg_out_bf16 and not (self.dg and self.dispatch_gemm_mode == "plain" and not self.fp8 and not self.f32):
      return "dg_out_bf16 is dispatch_gemm's plain product on bf16 rows"
    if self.row_scale and (self.fp8 or self.sends_once or TP > 1):
      return "row_scale takes one row per slot on bf16 or float32 rows, without a tensor axis (the calls' rule)"
    if not self.link_gbps >= 0:
      return f"link_gbps {self.link_gbps} must be >= 0"
    if self.gather_rs and (TP < 2 or self.dg):
      return "gather_rs takes a tensor-parallel case (tensor >= 2) without dispatch_gemm"
    if self.fp8 and (TP > 1 or self.transpose_rhs or self.k_dim % 128 or self.n_dim % 128):
      return ("fp8 takes K and N multiples of 128 (whole scale tiles) without a tensor axis or transpose_rhs (its w "
              "is [E_l, N, K] always)")
    return None

  @property
  def dispatch_row_bytes(self) -> int:
    """Bytes of one dispatched row: D in the call's dtype, or packed e4m3 (D + D / 32) under fp8 with dispatch_gemm."""
    if self.fp8 and self.dg:
      return self.d_model + self.d_model // 32
    return self.d_model * (4 if self.f32 else 2)

  @property
  def swiglu(self) -> bool:
    """dispatch_gemm's GEMM1 ends in the SwiGLU (h [cap, K / 2])."""
    return self.dg and self.dispatch_gemm_mode != "plain"

  @property
  def keeps_recv(self) -> bool:
    """The dispatch (or dispatch_gemm) returns x_recv."""
    return not (self.dg and self.dispatch_gemm_mode == "infer")

  def producer_expert_major(self, seg_rows, producer: str = "wgmma") -> bool:
    """Whether expert_combine's producer tiles a rank's plan (seg_rows [E_local, R]) expert-major, for the consumer
    choice as well (cuda/ops/expert_producer.cuh UseExpertMajor, benchmarks/bench_resource.py producer_expert_major):
    its bf16 and FP8 wgmma engine (`producer`, the run's engine name; Hopper's for the suites' aligned shapes) where
    the rule or producer_order says so; never gather_rs's producer, nor the float32 or mma.sync ones."""
    from benchmarks import bench_resource  # pylint: disable=g-import-not-at-top
    return (not self.f32 and not self.gather_rs
            and bench_resource.producer_expert_major(seg_rows, self.producer_order, self.producer_band_m, producer))

  def name(self) -> str:
    """The case's line in the output (tests/gpu greps it)."""
    consumers = str(self.consumers) if self.consumers > 0 else ("model" if self.model else "fixed")
    s = (f"R={self.ranks}{f' TP={self.tensor}' if self.tensor > 1 else ''} T={self.tokens} k={self.top_k} "
         f"E={self.experts} D={self.d_model} K={self.k_dim} N={self.n_dim} dtype={'f32' if self.f32 else 'bf16'}"
         f"{(' x,w1,lhs,w=e4m3' if self.dg else ' lhs,w=e4m3') if self.fp8 else ''}"
         f"{' w=transposed' if self.transpose_rhs else ''} "
         f"routing={ROUTINGS[min(max(self.routing, 0), len(ROUTINGS) - 1)]}"
         f"{f' zipf={self.zipf:f}' if self.routing == 1 and self.zipf != 1.0 else ''}"
         f"{f' cf={self.capacity_factor:f}' if self.capacity_factor > 0 else ' dropless'} iters={self.iters} "
         f"consumers={consumers}")
    if self.serialize:
      s += " serialized"
    if self.dg:
      pushers = "auto" if self.dispatch_gemm_pushers == AUTO else self.dispatch_gemm_pushers
      s += f" dispatch_gemm pushers={pushers} mode={self.dispatch_gemm_mode}"
      if not self.x_recv_from_tiles:
        s += " x_recv=copied"
      if self.dg_out_bf16:
        s += " out=bf16"
    if self.row_scale:
      s += " row_scale=gates"
    if self.link_gbps > 0:
      s += f" link={self.link_gbps:g}GB/s"
    if self.gather_rs:
      s += " gather_rs"
    if self.producer_band_m > 0:
      s += f" band_m={self.producer_band_m}"
    if self.producer_order > 0:
      s += f" order={self.producer_order}"
    if self.delay_rank >= 0:
      s += f" delay_rank={self.delay_rank} delay_us={self.delay_us}"
    if self.timeout_at >= 0:
      s += f" forced_timeout_at={self.timeout_at}"
    if self.stuck_stream_ms > 0:
      s += f" stream_held_ms={self.stuck_stream_ms}"
    if self.dg and self.send_once == 1:
      s += " send_once"
    if self.dg and self.per_call_stats and self.time:
      s += " aligned"
    return s


# Plausible H200-like constants that make the device-side choice vary over the suites' small shapes: they exercise
# the manager's code path (every CTA must agree on C); they are not a calibration.
SUITE_MODEL = (132, 1, 64, 128, 0.05, 0.0005, 2.0, 300.0, 0.5)

SUITES = ("full", "resource", "dispatch-gemm", "dispatch-gemm-time", "dispatch-gemm-fp8", "dispatch-gemm-time-fp8",
          "dispatch-gemm-shapes", "dispatch-gemm-shapes-fp8", "dispatch-gemm-variants", "combine-time", "combine-fp8",
          "combine-time-fp8", "consumer-rate", "backward-time", "regret", "regret-combine", "regret-gather",
          "regret-push", "regret-push-shapes", "regret-backward", "dgrad-row-scale", "dispatch-gemm-order",
          "dispatch-gemm-order-fp8", "tensor", "tensor-time", "tensor-backward-time", "tensor-time-deepseek", "small",
          "small-mma")
DG_MODES = ("plain", "train", "infer")


def _rank_case(base: Case, R: int, routing: int, iters: int) -> Case:
  """R ranks with two experts each."""
  return dataclasses.replace(base, ranks=R, experts=2 * R, routing=routing, iters=iters)


def _small(base: Case) -> list[Case]:
  # One rank (it pushes to and receives from itself through the same peer-pointer paths): several ranks cannot run
  # under compute-sanitizer, whose tools serialize kernels while ranks sharing a GPU spin-wait on each other's.
  v = []
  for d, kk, n in ((64, 72, 40), (128, 200, 136), (64, 40, 24), (192, 128, 192)):  # the last: wgmma on Hopper
    for f32 in (False, True):
      v.append(dataclasses.replace(base, ranks=1, tokens=48, experts=4, d_model=d, k_dim=kk, n_dim=n, iters=2,
                                   datasets=1, routing=1, f32=f32))
  # w transposed (the backward pass's layout): mma.sync, SIMT and (Hopper) wgmma loads of B along K.
  for d, kk, n, f32 in ((128, 200, 136, False), (128, 200, 136, True), (192, 128, 192, False)):
    v.append(dataclasses.replace(v[0], d_model=d, k_dim=kk, n_dim=n, f32=f32, transpose_rhs=True))
  return v


def _resource(base: Case) -> list[Case]:
  v = []
  for R in (1, 2, 4):  # the resource manager on the device (every CTA computes the same C), then serialized
    for ser in (False, True):
      v.append(dataclasses.replace(base, ranks=R, experts=4 * R, tokens=256, k_dim=256, n_dim=264, routing=1,
                                   consumers=3 if ser else 0, serialize=ser, model=SUITE_MODEL, iters=12))
  # manager + serialized together, 8 ranks; then float32 operands (the SIMT path keeps the fixed C)
  c = dataclasses.replace(base, ranks=8, experts=16, routing=2, consumers=0, serialize=True, model=SUITE_MODEL,
                          iters=10)
  v.append(c)
  v.append(dataclasses.replace(c, f32=True, ranks=2, experts=4))
  return v


def _dispatch_gemm(base: Case) -> list[Case]:
  # The dispatch and GEMM1 in one launch (bf16, D and K multiples of 64: the wgmma engine), each routing in another
  # of the three result modes; K = 320: two column tiles, the second one partial (GEMM1's 256 columns, or the SwiGLU's
  # 128 columns of h).
  v = []
  for R in (1, 2, 4, 8):
    for routing in (0, 1, 2):
      v.append(dataclasses.replace(_rank_case(base, R, routing, 12), d_model=192, k_dim=320,
                                   dispatch_gemm_pushers=1 if R == 1 else 2,
                                   dispatch_gemm_mode=DG_MODES[(routing + R) % 3]))
  v.append(dataclasses.replace(v[3], timeout_at=5))  # a forced timeout and recovery with the per-source waits
  v.append(dataclasses.replace(v[4], link_gbps=20.0))  # pushes paced: GEMM tiles run while rows are in flight
  # One row per slot (the backward's dispatch; the cases above send once at R >= 2): R = 2, every token's two choices
  # on rank 0 (routing 2), and R = 4 over the emulated link.
  v.append(dataclasses.replace(v[5], send_once=0))
  v.append(dataclasses.replace(v[-2], send_once=0))
  # x_recv copied by the side units (x_recv_from_tiles=False) in the modes that keep it: R = 1 training forward; R = 2
  # plain, sending once (its m-tiles of other ranks' rows filled by the expansion units first); R = 4 training forward
  # over the emulated link, one row per slot; R = 8 training forward with every token on rank 0, sending once.
  v += [dataclasses.replace(c, x_recv_from_tiles=False)
        for c in (v[0], v[4], dataclasses.replace(v[6], link_gbps=20.0, send_once=0), v[11])]
  return v


# The emulated NVLink per direction, for an H200 rank: 370 GB/s, what NCCL's maintainers put usable NVLink4 at. Our
# copy-engine copies between two H200s moved 390 (docs/performance.md, Link bandwidth), but the pushers and the
# consumer move rows with SM stores (16-byte stores, TMA bulk stores), not the copy engines, so the lower figure is the
# one they can hope for. A loopback rank has 1 / R of the GPU's SMs, so a link of 370 / R GB/s keeps the ratio of its
# pushes to its GEMM that of R GPUs.
NVLINK_GBPS = 370.0
# The timed suites' repetitions: medians of few back-to-back calls, so that both suites run in minutes.
_TIMED = dict(routing=0, datasets=1, iters=2, check_tokens=64, time=True, table=True, warmup=2, reps=10)


def _dispatch_gemm_time(base: Case) -> list[Case]:
  # A seed-like shape: dispatch + GEMM1 as two calls (Dispatch, then the bare GEMM on the rank's SMs) against
  # dispatch_gemm, after a checked call on every 64th token, with the library's pusher count for the rank's SMs.
  # R = 2 in the three result modes at HBM speed, then over the emulated NVLink: the training forward at R = 2 (and
  # with 8 pushers pinned, the count of a whole H200) and R = 4, the inference forward at R = 8 (2048 tokens per rank:
  # its dropless buffers hold every slot of the group); R = 1 (no remote rows: what the fused kernel costs when there
  # is nothing to hide). K is GEMM1's N = 2F (F = 2048).
  shape = dict(experts=8, tokens=4096, d_model=2048, k_dim=4096, n_dim=2048, dispatch_gemm_pushers=AUTO, **_TIMED)
  v = [dataclasses.replace(base, ranks=2, dispatch_gemm_mode=m, **shape) for m in DG_MODES]
  for R, p, mode, tokens in ((2, AUTO, "train", 4096), (2, 8, "train", 4096), (4, AUTO, "train", 4096),
                             (8, AUTO, "infer", 2048)):
    # (P auto: the resource model's choice from calibrated_model's constants, the library's on this GPU.)
    v.append(dataclasses.replace(base, ranks=R, link_gbps=NVLINK_GBPS / R, model=calibrated_model(R, NVLINK_GBPS / R),
                                 **dict(shape, dispatch_gemm_pushers=p, dispatch_gemm_mode=mode, tokens=tokens)))
  v.append(dataclasses.replace(base, ranks=1, dispatch_gemm_mode="train", **dict(shape, experts=4, tokens=8192)))
  # The linked R = 2 and R = 4 training forwards again sending each row once per destination rank: what it saves in
  # bytes and costs in the receiver's expansion.
  v += [dataclasses.replace(v[i], send_once=1) for i in (3, 5)]
  # The linked R = 2, 4, 8 cases again with every timed call started together on every rank (per_call_stats): what
  # the fused call costs when the ranks start aligned, as a layer's combine leaves them, without the back-to-back
  # calls' drift.
  v += [dataclasses.replace(v[i], per_call_stats=True) for i in (3, 5, 6)]
  return v


def _dispatch_gemm_shapes(base: Case) -> list[Case]:
  # dispatch-gemm-time's training forward at the Mixtral- and DeepSeek-like shapes of COMBINE_SHAPES (below): GEMM1
  # x [rows, D] @ W1 [D, 2F], so a row costs 4 D F flops for its D elements on the link and the ratio is F again (K =
  # 2F, D scaled as there, 1024 for Mixtral-like, 2048 for DeepSeek-like); R = 2 and 4 over the emulated NVLink, P the
  # library's choice from the shipped calibration.
  v = []
  for name in ("mixtral", "deepseek"):
    shape = COMBINE_SHAPES[name]
    for R in (2, 4):
      link = NVLINK_GBPS / R
      v.append(dataclasses.replace(
          base, ranks=R, link_gbps=link, model=calibrated_model(R, link), dispatch_gemm_pushers=AUTO,
          dispatch_gemm_mode="train", experts=shape["experts"], top_k=shape["top_k"], tokens=shape["tokens"],
          d_model=shape["n_dim"], k_dim=2 * shape["k_dim"], n_dim=shape["n_dim"], **_TIMED))
  return v


def _dispatch_gemm_variants(base: Case) -> list[Case]:
  # dispatch-gemm-shapes' Mixtral-like R = 4 case (its largest buffers) checked untimed as it is and with one thing
  # changed each: P pinned low and high, no link, a narrower GEMM1 (N = 4096), inference and plain modes, half the
  # tokens; a 2 s timeout per call. Where the case fails, which change makes it pass tells the harness from the kernel.
  case = dataclasses.replace(_dispatch_gemm_shapes(base)[1], time=False, table=False, timeout_ms=2000)
  assert case.ranks == 4 and case.experts == 8, case.name()
  changes = (dict(), dict(dispatch_gemm_pushers=2), dict(dispatch_gemm_pushers=8), dict(link_gbps=0.0),
             dict(k_dim=4096), dict(dispatch_gemm_mode="infer"), dict(dispatch_gemm_mode="plain"), dict(tokens=1024))
  return [dataclasses.replace(case, **kw) for kw in changes]


# expert_combine's shapes (GEMM2: h [rows, F] @ W2 [F, D], so K = F and N = D; the dispatch's own rows are narrow),
# each with the GEMM-to-return ratio of its model: a row costs 2 F D flops and returns D elements, so the ratio is F,
# which the scaled shapes keep while D (and T, E) shrink to fit R ranks' buffers on one GPU.
COMBINE_SHAPES = {
    "seed": dict(experts=8, top_k=2, tokens=4096, k_dim=2048, n_dim=2048),
    # Mixtral 8x7B: E = 8, top-2, F = 14336 (D = 4096 scaled to 1024).
    "mixtral": dict(experts=8, top_k=2, tokens=2048, k_dim=14336, n_dim=1024),
    # DeepSeek-V3: top-8 of many fine-grained experts, F = 2048 (E = 256 scaled to 64, D = 7168 to 2048).
    "deepseek": dict(experts=64, top_k=8, tokens=1024, k_dim=2048, n_dim=2048),
}


# The calibration file whose constants the suites' cases hand the harness (--model): None for the shipped H200 one,
# else the one use_calibration_file set (run.py: use_device_calibration's, from the runner's device, before it builds
# the cases).
_calibration_file: str | None = None


def use_calibration_file(path: str | None) -> str | None:
  """Has calibrated_model take the calibration in `path` (None: the shipped H200 one); returns the one it took."""
  global _calibration_file  # pylint: disable=global-statement
  before, _calibration_file = _calibration_file, path
  return before


def use_device_calibration(gpu_name: str, sms: int) -> str:
  """Has calibrated_model take the calibration the library loads on GPU `gpu_name` with `sms` SMs
  (resource.calibration_for: the shipped file of its name, or $JMO_CALIBRATION's), the shipped H200 one where that
  gives none; returns the line that says which."""
  from jax_moe_overlap import resource  # pylint: disable=g-import-not-at-top
  cal = resource.calibration_for(gpu_name, sms)
  use_calibration_file(cal.source if cal.params is not None else None)
  if cal.params is not None:
    return f"suite model: {cal.source} (the library's calibration on {gpu_name})"
  return f"suite model: the shipped H200 calibration ({cal.reason})"


def calibrated_model(ranks: int, link_gbps: float) -> tuple[float, ...]:
  """The resource manager's calibration (the shipped H200 one, or use_device_calibration's) as the harness's --model
  for one loopback rank: its link the emulated one, or the rank's share of the GPU's copy ceiling where that is lower
  (bench_resource.py's rule)."""
  from jax_moe_overlap import resource  # pylint: disable=g-import-not-at-top
  p = resource.load_params(_calibration_file or os.path.join(resource.CALIBRATION_DIR, "nvidia_h200.json"))
  link = p.link_gbps / ranks if link_gbps <= 0 else min(link_gbps, p.link_gbps / ranks)
  return tuple(dataclasses.replace(p, link_gbps=link).as_list())


def _combine_time(base: Case, k_factor: int = 1) -> list[Case]:
  # expert_combine (GEMM2 and the return of its bands) against its serialized form (the pushes after the last tile)
  # and GEMM2 alone, over the emulated NVLink at R = 2, 4, 8, for each shape (its K times k_factor: 2 gives the dx
  # combine's K = 2F), with the consumer count the resource manager picks from calibrated_model's constants (the
  # library's choice on this GPU), after a checked call on every 64th token.
  v = []
  for shape in COMBINE_SHAPES.values():
    for R in (2, 4, 8):
      link = NVLINK_GBPS / R
      v.append(dataclasses.replace(base, ranks=R, d_model=256, consumers=0, model=calibrated_model(R, link),
                                   link_gbps=link, **dict(shape, k_dim=k_factor * shape["k_dim"]), **_TIMED))
  return v


def _combine_fp8(base: Case) -> list[Case]:
  # expert_combine with the FP8 producer, checked: R = 1, 2, 4, 8 over balanced, moderate and next-rank routing
  # (every band pushed), capacity drops, pinned and fixed C, float32 outputs, the serialized form, an emulated link,
  # K and N not multiples of the 128 x 256 tile.
  c = dataclasses.replace(base, fp8=True, tokens=256, d_model=128, k_dim=384, n_dim=640, iters=6)
  v = [dataclasses.replace(c, ranks=R, experts=2 * R, routing=rt) for R in (1, 2, 4, 8) for rt in (0, 1)]
  v += [dataclasses.replace(c, ranks=4, experts=8, routing=4),
        dataclasses.replace(c, ranks=4, experts=8, routing=1, capacity_factor=1.0),
        dataclasses.replace(c, ranks=2, experts=4, consumers=0),
        dataclasses.replace(c, ranks=2, experts=4, f32=True),
        dataclasses.replace(c, ranks=2, experts=4, serialize=True),
        dataclasses.replace(c, ranks=4, experts=8, link_gbps=NVLINK_GBPS / 4)]
  return v


def _backward_time(base: Case) -> list[Case]:
  # The backward's two exchanges over the emulated NVLink (issue 31, point 4): the dgrad dispatch fused with its GEMM
  # (dispatch_gemm in plain mode: gates * dy dispatched, dh = dy W2^T in bf16 as the layer writes it, so N = F = 2048
  # on the seed's D = 2048) at R = 2, 4, 8, and the dx combine (expert_combine of da W1^T: K = 2F, N = D) on
  # COMBINE_SHAPES' models at R = 2, 4, 8, each against its serialized form, with the library's P and C from the
  # shipped calibration.
  v = []
  for R in (2, 4, 8):
    link = NVLINK_GBPS / R
    v.append(dataclasses.replace(base, ranks=R, link_gbps=link, model=calibrated_model(R, link), experts=8,
                                 tokens=2048 if R == 8 else 4096, d_model=2048, k_dim=2048, n_dim=2048,
                                 dispatch_gemm_pushers=AUTO, dispatch_gemm_mode="plain", dg_out_bf16=True,
                                 **_TIMED))
  return v + _combine_time(base, k_factor=2)


# The regret sweep's pinned counts (each within a loopback rank's budget at R = 8: 16 SMs, at most 15).
REGRET_C = (1, 2, 3, 4, 6, 8, 12)
REGRET_P = (1, 2, 3, 4, 6, 8, 12)


def _regret(base: Case) -> list[Case]:
  # The resource manager's choices against a sweep of pinned counts on the same data (tools/loopback/regret.py), with
  # the shipped calibration: expert_combine's C (_regret_combine), gather_rs's C (GEMM2 + GatherRS, _regret_gather)
  # and dispatch_gemm's P (_regret_push).
  return _regret_combine(base) + _regret_gather(base) + _regret_push(base)


def _consumer_rate(base: Case) -> list[Case]:
  # expert_combine's consumer alone and beside the running GEMM (timing.consumer_rate_lines): combine-time's shapes at
  # R = 2 over the emulated NVLink with C = 1 and 2 pinned (the consumer the limit), every timed call started together
  # on every rank (their timelines), the serialized form beside.
  link = NVLINK_GBPS / 2
  return [dataclasses.replace(base, ranks=2, d_model=256, consumers=c, link_gbps=link, per_call_stats=True,
                              **shape, **_TIMED)
          for shape in COMBINE_SHAPES.values() for c in (1, 2)]


def _regret_combine(base: Case) -> list[Case]:
  # expert_combine's C on combine-time's shapes over the emulated NVLink at R = 2, 4, 8, the sweep in three
  # interleaved passes.
  v = []
  for shape in COMBINE_SHAPES.values():
    for R in (2, 4, 8):
      link = NVLINK_GBPS / R
      v.append(dataclasses.replace(base, ranks=R, d_model=256, consumers=0, model=calibrated_model(R, link),
                                   link_gbps=link, sweep=REGRET_C, sweep_passes=3, **shape,
                                   **dict(_TIMED, table=False)))
  return v


def _regret_push(base: Case) -> list[Case]:
  # dispatch_gemm's P on dispatch-gemm-time's shape (train mode) over the emulated NVLink at R = 2, 4, 8 and at HBM
  # speed at R = 2, once per pinned P of REGRET_P and once with the library's P, on the same data, every call started
  # together on every rank (the choice's effect without the back-to-back calls' drift), in three passes.
  dg = dict(experts=8, tokens=4096, d_model=2048, k_dim=4096, n_dim=2048, dispatch_gemm_mode="train",
            dispatch_gemm_pushers=AUTO, dg_sweep=REGRET_P + (0,), sweep_passes=3, per_call_stats=True, **_TIMED)
  return [dataclasses.replace(base, ranks=R, link_gbps=link, model=calibrated_model(R, link),
                              **dict(dg, tokens=2048 if R == 8 else 4096))
          for R, link in ((2, NVLINK_GBPS / 2), (4, NVLINK_GBPS / 4), (8, NVLINK_GBPS / 8), (2, 0.0))]


def _dispatch_gemm_order(base: Case) -> list[Case]:
  # dispatch_gemm's GEMM tile order (CallOptions::producer_order; cuda/ops/dispatch_gemm.cu ExpertMajorDg):
  # dispatch-gemm-shapes' cases and dispatch-gemm-time's linked training forwards at R = 2 and 4 and its R = 8
  # inference forward, each with the two phases (1: the own rows' m-tiles first) and then expert-major (2) next to
  # each other, every timed call started together on every rank.
  dg_time = _dispatch_gemm_time(base)
  return [dataclasses.replace(c, per_call_stats=True, producer_order=order)
          for c in _dispatch_gemm_shapes(base) + [dg_time[i] for i in (3, 5, 6)] for order in (1, 2)]


def _regret_push_shapes(base: Case) -> list[Case]:
  # regret-push's sweep on dispatch-gemm-shapes' cases (Mixtral- and DeepSeek-like, R = 2 and 4 over the emulated
  # NVLink): the pusher model's choice where a row is narrow against its GEMM (Mixtral-like: D = 1024, 2F = 28672)
  # and where it is wide with many small segments (DeepSeek-like: 64 experts, top-8, 2F = 4096).
  return _p_swept(_dispatch_gemm_shapes(base))


def _p_swept(cases: list[Case]) -> list[Case]:
  # dispatch_gemm cases with regret-push's sweep of P (and the library's), every call started together, three passes.
  return [dataclasses.replace(c, dg_sweep=REGRET_P + (0,), sweep_passes=3, per_call_stats=True) for c in cases]


# gather_rs's regret cases: (expert ranks, tensor ranks) of R = 4 as 2 x 2 and R = 8 as 4 x 2 and 2 x 4, each in
# bfloat16 (the wgmma engine: the model's C) and float32 (the SIMT engine, which the calibration does not describe: the
# workspace's fixed C, reported apart), with the tokens per rank of each dtype.
REGRET_GATHER_MESHES = ((2, 2), (4, 2), (2, 4))
REGRET_GATHER_TOKENS = {False: 1024, True: 256}  # f32 -> tokens per rank (the SIMT GEMM is slow: fewer)
# Their shape (Case fields; benchmarks/calibrate.py measures gather_gbps on the 2 x 2 bf16 case's).
REGRET_GATHER_SHAPE = dict(experts=8, top_k=2, d_model=256, k_dim=14336, n_dim=4096)


def _regret_backward(base: Case) -> list[Case]:
  # The resource manager's choices for the backward's two exchanges (issue 31, points 4 and 5): backward-time's dgrad
  # dispatch_gemm cases (plain mode, dh in bf16) with regret-push's P sweep, and its dx combine cases (K = 2F) with
  # regret-combine's C sweep, both in three interleaved passes.
  v = _backward_time(base)
  dgrad = [c for c in v if c.dg]
  dx = [c for c in v if not c.dg]
  return _p_swept(dgrad) + [dataclasses.replace(c, sweep=REGRET_C, sweep_passes=3, table=False) for c in dx]


def _regret_gather(base: Case) -> list[Case]:
  # GEMM2 + GatherRS (tools/loopback/tensor.py) on tensor-time's Mixtral-like shape (E = 8, top-2, F = K = 14336 split
  # over the tensor ranks, D = N = 4096), balanced routing, over the emulated NVLink (370 / R GB/s per rank), once
  # per pinned C of REGRET_C and once with the library's C, on the same data; and the device's decision timed on rank
  # 0's plan (a DECISION line: gather_rs's choice alone, ns per decision).
  # bf16 (the model's C) first: the float32 cases' fixed C makes them the slow ones.
  v = []
  for f32 in (False, True):
    for R_e, TP in REGRET_GATHER_MESHES:
      R = R_e * TP
      link = NVLINK_GBPS / R
      v.append(dataclasses.replace(base, ranks=R, tensor=TP, tokens=REGRET_GATHER_TOKENS[f32], **REGRET_GATHER_SHAPE,
                                   f32=f32, gather_rs=True, consumers=0,
                                   model=calibrated_model(R, link), link_gbps=link, sweep=REGRET_C, sweep_passes=3,
                                   decision_iters=1000, **dict(_TIMED, table=False)))
  return v


def _tensor(base: Case) -> list[Case]:
  # Expert tensor parallelism (tools/loopback/tensor.py): R = 4 as 2 x 2, R = 8 as 2 x 4 and 4 x 2 (expert x tensor
  # ranks), two experts per expert rank, balanced and skewed routing, dropless and with drops, y against the whole
  # experts. K = 400 gives each rank K = 200 at TP = 2 (mma.sync; SIMT in float32), K = 512, N = 320 at TP = 4 gives
  # K = 128 (wgmma on Hopper); then w transposed, and dispatch_gemm at 2 x 2 in its three result modes (D = 192,
  # K = 2F = 640: each rank's GEMM1 N = 320, two column tiles, the second partial; its SwiGLU's F / TP = 160).
  def tp(R_e, TP, routing, **kw):
    return dataclasses.replace(base, ranks=R_e * TP, tensor=TP, experts=2 * R_e, routing=routing, iters=12,
                               **{"k_dim": 400, **kw})
  v = [tp(2, 2, 0), tp(2, 2, 1, capacity_factor=1.0), tp(2, 2, 1, f32=True),
       tp(2, 4, 0, k_dim=512, n_dim=320, tokens=192), tp(2, 4, 2, k_dim=512, n_dim=320, tokens=192),
       tp(4, 2, 1), tp(4, 2, 1, capacity_factor=1.0), tp(4, 2, 0, capacity_factor=1.0),
       tp(2, 2, 1, transpose_rhs=True)]
  for routing, mode in ((0, "train"), (1, "plain"), (2, "infer")):
    v.append(tp(2, 2, routing, d_model=192, k_dim=640, dispatch_gemm_pushers=2, dispatch_gemm_mode=mode,
                capacity_factor=1.0 if routing == 1 else 0.0))
  # GEMM2 + GatherRS in expert_combine's place: 2 x 2 in bf16 and (with drops) float32, 2 x 4 on the wgmma engine,
  # 4 x 2 in float32 and in bf16 with extreme routing (most sources have no row on a rank: zero partials), w
  # transposed, over an emulated link, and timed against its serialized form (its outputs bit for bit the checked
  # call's), with the manager's C.
  g = dict(gather_rs=True)
  v += [tp(2, 2, 0, **g), tp(2, 2, 1, capacity_factor=1.0, f32=True, **g),
        tp(2, 4, 0, k_dim=512, n_dim=320, tokens=192, **g), tp(4, 2, 1, f32=True, **g), tp(4, 2, 2, **g),
        tp(2, 2, 1, transpose_rhs=True, **g), tp(2, 2, 1, link_gbps=20.0, **g),
        tp(2, 2, 1, consumers=0, model=SUITE_MODEL, time=True, table=True, warmup=1, reps=3, **g)]
  return v


# GEMM2 + GatherRS at TP = 2 / EP = 2 (R = 4 ranks as 2 x 2) with Mixtral-like shapes: D = N = 4096, F = K = 14336
# split over the tensor ranks (K = 7168 each), E = 8, top-2, 4096, 8192 and 16384 tokens in the group (1024, 2048,
# 4096 per rank), over the emulated NVLink; each shape as the per-slot path (expert_combine, the shards' partials to
# the token owners) and as GatherRS, each timed against its serialized form and GEMM2 alone, with the consumer count
# the resource manager picks from calibrated_model's constants. run.py prints them as one table (timing.tensor_table).
# A --tokens other than Case's default picks that one shape (per rank), so that the suite can run in parts.
# Every timed call (and GEMM alone's) starts together on every rank: back to back, the four ranks' bare GEMMs drifted
# apart and took longer than the overlapped calls at some sizes (docs/performance.md).
# backward=True: the backward's dx = da W1^T in the same two forms (tensor-backward-time): K = 2F (each rank's
# gate and up shards, 14336 of 28672), W1 [E_l, D, 2F / TP] read transposed in place, N = D; the per-slot path
# returns each shard's partial dx rows, GatherRS reduce-scatters them.
# tensor-time-deepseek: the forward at a DeepSeek-like shape (64 experts, top-8, F = K = 2048 split over the tensor
# ranks, N = D = 2048 as dispatch-gemm-shapes' DeepSeek-like D), 4096 and 8192 tokens in the group: top-8 over TP = 2
# is 16 shard slots per token, where call_site.tensor_reduce's byte model picks GatherRS (4 G = 16 <= k TP itemsize =
# 32), the side of its rule the Mixtral-like shape (16 > 8: per-slot) does not measure.
TENSOR_TIME_TOKENS = (1024, 2048, 4096)
TENSOR_TIME_SHAPES = {"mixtral": dict(experts=8, top_k=2, k_dim=14336, n_dim=4096),
                      "deepseek": dict(experts=64, top_k=8, k_dim=2048, n_dim=2048)}


def _tensor_time(base: Case, backward: bool = False, shape: str = "mixtral") -> list[Case]:
  link = NVLINK_GBPS / 4
  v = []
  picked = base.tokens != Case().tokens
  sizes = TENSOR_TIME_TOKENS if shape == "mixtral" else TENSOR_TIME_TOKENS[:2]
  dims = dict(TENSOR_TIME_SHAPES[shape])
  if backward:
    dims["k_dim"] *= 2
  for tokens in (base.tokens,) if picked else sizes:
    for gather in (False, True):
      v.append(dataclasses.replace(base, ranks=4, tensor=2, tokens=tokens, d_model=256, **dims,
                                   transpose_rhs=backward, consumers=0, model=calibrated_model(4, link),
                                   link_gbps=link, gather_rs=gather, per_call_stats=True, **_TIMED))
  return v


def _full(base: Case) -> list[Case]:
  v = [_rank_case(base, R, routing, 30) for R in (2, 4, 8) for routing in (0, 1, 2)]
  # 1000 consecutive iterations (2000 calls per rank) without a reset
  v.append(dataclasses.replace(base, ranks=8, experts=16, routing=1, iters=1000))
  # larger GEMM: many K tiles, several N tiles, multi-band segments
  v.append(dataclasses.replace(base, ranks=2, experts=4, tokens=256, d_model=512, k_dim=1024, n_dim=520, iters=6,
                               datasets=2))
  # K and N multiples of 64: the wgmma producer on Hopper (128-row tiles = 2 bands, segments ending mid-tile,
  # N = 320 = one full and one partial 256-column tile)
  for R in (1, 2, 4, 8):
    v.append(dataclasses.replace(base, ranks=R, experts=2 * R, tokens=192, d_model=320, k_dim=384, n_dim=320,
                                 routing=2 if R == 4 else 1, iters=200 if R == 8 else 20))
  for R in (2, 4):  # float32 operands (SIMT producer)
    v.append(dataclasses.replace(base, ranks=R, experts=2 * R, routing=1, f32=True, iters=10))
  # w transposed, read in place ([E_l, N, K]: the backward pass's dx = da @ W1^T) on each engine: wgmma on Hopper
  # (K, N multiples of 64; mma.sync elsewhere), mma.sync with N = 140 (not a multiple of 8: only w's rows, of K
  # elements, must be 16-byte chunks), SIMT (float32)
  for R, d, kk, n, f32 in ((2, 320, 384, 320, False), (4, 128, 200, 140, False), (2, 128, 200, 136, True)):
    v.append(dataclasses.replace(base, ranks=R, experts=2 * R, tokens=192, d_model=d, k_dim=kk, n_dim=n, f32=f32,
                                 transpose_rhs=True, routing=1, iters=12))
  # capacity overflow: slots dropped by the plan's rule
  v.append(dataclasses.replace(base, ranks=4, experts=8, routing=1, capacity_factor=1.0, iters=10))
  # one rank held back 3 ms at the start of every call
  v.append(dataclasses.replace(base, ranks=4, experts=8, delay_rank=1, delay_us=3000, iters=20))
  for R in (2, 8):  # a forced timeout: reported by the next call, then recovery
    v.append(dataclasses.replace(base, ranks=R, experts=2 * R, timeout_at=5, iters=15))
  # the same with rank 0's stream held past the call's timeout: the recovery gives up within it, then recovers
  v.append(dataclasses.replace(base, ranks=4, experts=8, timeout_at=5, iters=10, stuck_stream_ms=1500))
  # one row per slot (the cases above send once): every token's choices on rank 0's two experts
  v.append(dataclasses.replace(_rank_case(base, 4, 2, 20), send_once=0))
  return v + _resource(base)


def suite(name: str, base: Case, producer_path=None) -> list[Case]:
  """The cases of suite `name`, each a copy of `base` with the suite's fields set.

  producer_path(case) -> the producer engine's name: "small-mma" leaves out the cases that take "wgmma bf16"
  (racecheck instruments every shared-memory access, and a wgmma case's TMA / mbarrier pipeline over ~200 KB of
  shared memory does not finish under it in minutes, while the other cases take seconds; memcheck and synccheck run
  the whole "small" suite).
  """
  if name == "small":
    return _small(base)
  if name == "small-mma":
    if producer_path is None:
      raise ValueError("the small-mma suite needs producer_path (the GPU's engine for each case)")
    return [c for c in _small(base) if producer_path(c) != "wgmma bf16"]
  if name == "resource":
    return _resource(base)
  if name == "dispatch-gemm":  # sending once where the cases do not say (its receiver's expansion is checked here)
    v = _dispatch_gemm(dataclasses.replace(base, send_once=1))
    # The plain product rounded to bf16 (dispatch_gemm's out_dtype, as the layer's backward writes dh): the R = 2 and
    # R = 4 plain cases again.
    assert [v[i].dispatch_gemm_mode for i in (4, 8)] == ["plain", "plain"]
    v += [dataclasses.replace(v[i], dg_out_bf16=True) for i in (4, 8)]
    # The same with every row scaled by its slot's gate (the backward's gates * dy; one row per slot), and the
    # dispatch alone scaled at R = 4 (float32 rows).
    return v + [dataclasses.replace(c, row_scale=True, send_once=0) for c in v[-2:]] + [
        dataclasses.replace(v[8], dispatch_gemm_pushers=0, f32=True, row_scale=True, send_once=0)]
  if name == "dispatch-gemm-time":
    return _dispatch_gemm_time(base)
  if name == "dispatch-gemm-fp8":  # dispatch-gemm's cases on packed e4m3 rows (x_recv by the tiles and copied)
    return [dataclasses.replace(c, fp8=True, d_model=1024, k_dim=768, n_dim=640)
            for c in _dispatch_gemm(dataclasses.replace(base, send_once=1))]
  if name == "dispatch-gemm-time-fp8":  # dispatch-gemm-time on packed e4m3 rows (and the FP8 combine after it)
    v = [dataclasses.replace(c, fp8=True) for c in _dispatch_gemm_time(base)]
    # The training forwards at R = 2 (HBM speed, then the link) and R = 4 with x_recv copied by the side units: what
    # storing it from the FP8 tiles saves, in the same run.
    return v + [dataclasses.replace(v[i], x_recv_from_tiles=False) for i in (1, 3, 5)]
  if name == "dispatch-gemm-shapes":
    return _dispatch_gemm_shapes(base)
  if name == "dispatch-gemm-variants":
    return _dispatch_gemm_variants(base)
  if name == "dispatch-gemm-shapes-fp8":  # the same on packed e4m3 rows, with x_recv copied by the side units beside
    v = [dataclasses.replace(c, fp8=True) for c in _dispatch_gemm_shapes(base)]
    return v + [dataclasses.replace(c, x_recv_from_tiles=False) for c in v]
  if name == "combine-time":
    return _combine_time(base)
  if name == "combine-fp8":
    return _combine_fp8(base)
  if name == "combine-time-fp8":  # combine-time with the FP8 producer (its C the model's, its K counted by Fp8ModelK)
    return [dataclasses.replace(c, fp8=True) for c in _combine_time(base)]
  if name == "consumer-rate":
    return _consumer_rate(base)
  if name == "backward-time":
    return _backward_time(base)
  if name == "dgrad-row-scale":
    # The backward's dgrad dispatch_gemm (backward-time's R = 2, 4, 8) with gates * dy as a dispatched array's rows
    # against the rows scaled by the call (row_scale), each pair run twice in turn, every timed call started together.
    pairs = [(c, dataclasses.replace(c, row_scale=True))
             for c in (dataclasses.replace(c, per_call_stats=True) for c in _backward_time(base)[:3])]
    return [c for pair in pairs for c in pair + pair]
  if name == "regret":
    return _regret(base)
  if name == "regret-combine":  # regret's expert_combine cases alone
    return _regret_combine(base)
  if name == "regret-gather":  # regret's gather_rs cases alone
    return _regret_gather(base)
  if name == "regret-push":  # regret's dispatch_gemm cases alone
    return _regret_push(base)
  if name == "regret-push-shapes":
    return _regret_push_shapes(base)
  if name == "regret-backward":
    return _regret_backward(base)
  if name == "dispatch-gemm-order":
    return _dispatch_gemm_order(base)
  if name == "dispatch-gemm-order-fp8":  # its dispatch-gemm-shapes cases on packed e4m3 rows: FP8 aligned, both orders
    return [dataclasses.replace(c, fp8=True) for c in _dispatch_gemm_order(base)[:2 * len(_dispatch_gemm_shapes(base))]]
  if name == "tensor":
    return _tensor(base)
  if name == "tensor-time":
    return _tensor_time(base)
  if name == "tensor-backward-time":
    return _tensor_time(base, backward=True)
  if name == "tensor-time-deepseek":
    return _tensor_time(base, shape="deepseek")
  if name == "full":  # as dispatch-gemm: sending once where the cases do not say
    return _full(dataclasses.replace(base, send_once=1))
  raise ValueError(f"unknown suite {name!r} (one of {', '.join(SUITES)})")


# ---------------------------------------------------------------------------------------------------------------------
# Routing, plans and data.


def route(rng: np.random.Generator, case: Case, rank: int) -> np.ndarray:
  """[T, k] int32: k distinct global experts per token of `rank` (the layer's routing, before any slot expansion)."""
  T, k, E, R_e, E_l = case.tokens, case.top_k, case.experts, case.expert_ranks, case.experts_per_rank
  P = T * k
  if case.routing == 3:  # exact round robin: every expert gets the same number of slots when E divides T*k
    return (np.arange(P) % E).astype(np.int32).reshape(T, k)
  if case.routing == 4:  # to the next expert rank: round robin over its experts (every row is pushed, R_e > 1)
    return ((rank // case.tensor + 1) % R_e * E_l + np.arange(P) % E_l).astype(np.int32).reshape(T, k)
  if case.routing == 2:  # extreme: every token chooses experts 0..k-1: most experts and ranks get nothing
    return np.tile(np.arange(k, dtype=np.int32), (T, 1))
  # Balanced (uniform) or Zipf weights; k draws without replacement in order, each proportional to the remaining
  # weights: the k largest of log(weight) + Gumbel noise, in decreasing order.
  log_w = np.zeros(E) if case.routing == 0 else -case.zipf * np.log1p(np.arange(E))
  keys = log_w[None, :] + rng.gumbel(size=(T, E))
  return np.argsort(-keys, axis=1, kind="stable")[:, :k].astype(np.int32)


def remote_rows(plan: dict[str, np.ndarray], ranks: int, rank: int) -> int:
  """The rows `rank` received from other ranks (its plan's seg_rows, in (expert, source) order, whose source is not
  `rank`): the rows whose GEMM outputs its consumer pushes back."""
  return int(sum(n for i, n in enumerate(plan["seg_rows"]) if i % ranks != rank))


def make_plans(case: Case, ids: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
  """Every rank's plan from plan.py (JAX on the CPU), as int32 numpy arrays; seg_* flattened in (expert, source)
  order; slot_src_row added (dispatch's source row of each slot: its token). ids: every rank's [T, slot_top_k] slot
  expert ids (with `tensor` > 1 the shard slots of tensor.shard_slots, over experts x tensor shard experts)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap import plan  # pylint: disable=g-import-not-at-top

  R, E, E_l = case.ranks, case.experts * case.tensor, case.experts_per_rank
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    counts = jnp.stack([plan.local_counts(jnp.asarray(i), E).reshape(R, E_l) for i in ids])  # [R_src, R_dst, E_l]
    plans = []
    for r in range(R):
      p = _make_plan_jit(jnp.asarray(ids[r]), counts, jnp.int32(r), case.expert_cap)
      out = {f.name: np.asarray(getattr(p, f.name)) for f in dataclasses.fields(p)}
      out["seg_rows"] = out["seg_rows"].reshape(-1)
      out["seg_ret_off"] = out["seg_ret_off"].reshape(-1)
      out["slot_src_row"] = (np.arange(case.slots) // case.slot_top_k).astype(np.int32)
      out["slot_expert"] = (ids[r].reshape(-1) % E_l).astype(np.int32)  # local expert of each slot (references)
      plans.append(out)
  return plans


_JIT_CACHE: dict[str, Any] = {}


def _make_plan_jit(ids, counts, rank, expert_cap):
  if "make_plan" not in _JIT_CACHE:
    import jax  # pylint: disable=g-import-not-at-top
    from jax_moe_overlap import plan  # pylint: disable=g-import-not-at-top
    _JIT_CACHE["make_plan"] = jax.jit(plan.make_plan, static_argnums=3)
  return _JIT_CACHE["make_plan"](ids, counts, rank, expert_cap)


@dataclasses.dataclass
class Values:
  """A tensor in the call's dtype: the bytes the kernels read, and their float32 values for the references (of the
  rows they check: a few rows convert faster than the whole, at the timing suites' sizes)."""
  data: np.ndarray  # float32, or uint16 holding bfloat16 bits

  def rows(self, index) -> np.ndarray:
    """float32 values of data[index]."""
    d = self.data[index]
    return d if d.dtype == np.float32 else (d.astype(np.uint32) << 16).view(np.float32)

  @property
  def f(self) -> np.ndarray:
    return self.rows(slice(None))


@dataclasses.dataclass
class PackedValues(Values):
  """Packed e4m3 rows (fp8.pack_rows' bytes, uint8 [rows, D + D / 32]): the bytes the dispatch moves; rows() their
  dequantized float32 values (each 1 x 128 tile's e4m3 values times its scale, exact in float32)."""

  def rows(self, index) -> np.ndarray:
    d = np.asarray(self.data[index])
    D = d.shape[-1] * 32 // 33
    q = d[..., :D].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = np.ascontiguousarray(d[..., D:]).view(np.float32)
    return (q.reshape(*q.shape[:-1], D // 128, 128) * s[..., None]).reshape(q.shape)


def random_values(rng: np.random.Generator, shape, scale: float, f32: bool) -> Values:
  """Random values of either sign below `scale` in magnitude: float32 uniform in [-scale, scale); bfloat16 drawn as
  bits, a random sign and mantissa in one of the four binades below scale's (the timing suites' operands run to
  hundreds of millions of values, which a float32 draw and rounding would take minutes to make)."""
  if f32:
    v = rng.random(shape, dtype=np.float32)
    v *= 2
    v -= 1
    v *= np.float32(scale)
    return Values(v)
  u = np.frombuffer(rng.bytes(2 * math.prod(shape)), np.uint16).reshape(shape)
  below = np.frexp(scale)[1] - 1 + 127 - 1  # the biased exponent of the binade below scale's
  exponent = np.uint16(below) - ((u >> np.uint16(7)) & np.uint16(3))
  return Values((u & np.uint16(0x807F)) | (exponent << np.uint16(7)))


@dataclasses.dataclass
class RankData:
  """One rank's inputs of one data set: its plan, and its operands (K: the rank's, Case.rank_k)."""
  plan: dict[str, np.ndarray]
  ids: np.ndarray      # [T, slot_top_k] slot expert ids (the plan's)
  x: Values            # [T, D]
  lhs: Values          # [recv_rows, K]: the rows expert_combine reads (the runner adds cap - recv_rows rows of NaN)
  w: Values            # [E_l, K, N] (the references' layout)
  gates: np.ndarray    # [P] float32
  w1: Values | None    # dispatch_gemm: [E_l, D, K] bf16
  whole: Any = None    # tensor > 1: the layer's routing and whole experts (tensor.Whole), the references' input
  row_gate: np.ndarray | None = None    # gather_rs: [cap] float32, tensor.gather_tables
  token_rows: np.ndarray | None = None  # gather_rs: [R, T, Q] int32
  # fp8: what the kernels read (lhs and w above hold their dequantized float32 values, the references'): lhs e4m3
  # [recv_rows, K] (uint8), its scales [K/128, ld] float32 MN-major (NaN past recv_rows), w e4m3 [E_l, N, K] (uint8)
  # and its block scales [E_l, N/128, K/128]; with dispatch_gemm (x above PackedValues: the packed rows), w1 e4m3
  # [E_l, K, D] and w1_scales [E_l, K/128, D/128] (w1 above: dequantized, [E_l, D, K]), and the rank's recv rows
  # unpacked, x_recv_q e4m3 [recv_rows, D] and x_recv_s [D/128, ld] (NaN past recv_rows): the two calls' GEMM1
  # operands.
  fp8_operands: dict[str, np.ndarray] | None = None

  def inputs(self, case: Case) -> dict[str, Any]:
    """The runner's dict (tools/loopback/module.cc): arrays in the calls' layouts."""
    w = self.w.data
    if case.transpose_rhs:  # the same weights as [E_l, N, K], read transposed in place by the kernels
      w = np.ascontiguousarray(np.swapaxes(w, 1, 2))
    d = {"x": self.x.data, "lhs": self.lhs.data, "w": w, "gates": self.gates,
         "recv_rows": int(self.plan["recv_rows"]), "ret_rows": int(self.plan["ret_rows"])}
    for key in ("slot_src_row", "slot_dest_rank", "slot_dest_row", "slot_ret_row", "seg_rows", "seg_ret_off",
                "expert_rows"):  # (expert_rows: the grouped GEMMs' group sizes)
      d[key] = np.ascontiguousarray(self.plan[key], np.int32)
    if case.gather_rs:
      d["row_gate"], d["token_rows"] = self.row_gate, self.token_rows
    d["slot_primary"] = np.ascontiguousarray(self.plan["slot_primary"] if case.sends_once else np.zeros(0), np.int32)
    if self.w1 is not None:
      d["w1"] = self.w1.data
      d["send_order"] = np.ascontiguousarray(self.plan["send_order"], np.int32)
      d["send_start"] = np.ascontiguousarray(self.plan["send_start"], np.int32)
    if case.fp8:  # (the kernels' bytes of lhs, w and with dispatch_gemm w1, over the references' float32 values)
      d.update(self.fp8_operands)
    return d


def wire_bytes(case: Case, plan: dict[str, np.ndarray], rank: int, row_bytes: int) -> tuple[int, int]:
  """What one rank's dispatch sends over links (to other ranks): (rows, bytes). One row per kept slot routed to
  another rank; with send once only the primaries' rows, plus each such slot's 8-byte recv_from entry."""
  remote = (plan["slot_dest_rank"] != rank) & (plan["slot_dest_row"] >= 0)
  if not case.sends_once:
    rows = int(np.count_nonzero(remote))
    return rows, rows * row_bytes
  rows = int(np.count_nonzero(remote & (plan["slot_primary"] == np.arange(remote.size))))
  return rows, rows * row_bytes + 8 * int(np.count_nonzero(remote))


def quantized_operands(lhs: Values, w: Values, cap: int) -> tuple[Values, Values, dict[str, np.ndarray]]:
  """expert_combine's e4m3 operands from float ones (lhs [recv_rows, K], w [E_l, K, N]), by the library's quantizers
  on the CPU: (lhs and w dequantized, float32 (the references' values), RankData.fp8_operands)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap import fp8  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap.grouped_gemm import fp8_scales_ld  # pylint: disable=g-import-not-at-top
  with jax.default_device(jax.devices("cpu")[0]):
    q, s = fp8.quantize_rows(jnp.asarray(lhs.f))
    weight = fp8.quantize_weight(jnp.asarray(w.f))
    rows = fp8.dequantize_rows(q, s)
    wf = weight.dequantize()
  q, s = np.asarray(q).view(np.uint8), np.asarray(s, np.float32)
  scales = np.full((s.shape[1], fp8_scales_ld(cap)), np.nan, np.float32)  # (NaN: the rows the call must not read)
  scales[:, :s.shape[0]] = s.T
  ops = {"lhs": np.ascontiguousarray(q), "lhs_scales": scales,
         "w": np.ascontiguousarray(np.asarray(weight.values).view(np.uint8)),
         "w_scales": np.ascontiguousarray(np.asarray(weight.scales, np.float32))}
  return Values(np.asarray(rows, np.float32)), Values(np.asarray(wf, np.float32)), ops


def make_data(case: Case) -> list[list[RankData]]:
  """[data set][rank]: routing, plans from plan.py, random operands (deterministic in case.seed)."""
  rng = np.random.default_rng(case.seed)
  if case.tensor > 1:
    from tools.loopback import tensor  # pylint: disable=g-import-not-at-top
    return [tensor.make_data_set(case, rng) for _ in range(case.datasets)]
  R, T, D, K, N, E_l, P = (case.ranks, case.tokens, case.d_model, case.k_dim, case.n_dim, case.experts_per_rank,
                           case.slots)
  sets = []
  for _ in range(case.datasets):
    ids = [route(rng, case, r) for r in range(R)]
    plans = make_plans(case, ids)
    ranks = []
    for r in range(R):
      recv_rows = int(plans[r]["recv_rows"])
      x = random_values(rng, (T, D), 1.0, case.f32)
      lhs = random_values(rng, (recv_rows, K), 1.0, case.f32)  # (the runner pads it to cap rows of NaN)
      w = random_values(rng, (E_l, K, N), 1.0 / math.sqrt(K), case.f32)
      w1 = random_values(rng, (E_l, D, K), 1.0 / math.sqrt(D), case.f32) if case.dg else None
      gates = rng.uniform(0.1, 1.0, P).astype(np.float32)
      fp8_operands = None
      if case.fp8:
        lhs, w, fp8_operands = quantized_operands(lhs, w, case.cap)
        if case.dg:
          x, w1, dg_operands = quantized_dispatch_operands(x, w1)
          fp8_operands.update(dg_operands)
      ranks.append(RankData(plans[r], ids[r], x, lhs, w, gates, w1, fp8_operands=fp8_operands))
    if case.fp8 and case.dg:
      for d in range(R):
        ranks[d].fp8_operands.update(unpacked_recv(case, ranks, d))
    sets.append(ranks)
  return sets


def quantized_dispatch_operands(x: Values, w1: Values) -> tuple[PackedValues, Values, dict[str, np.ndarray]]:
  """dispatch_gemm's FP8 operands from float ones (x [T, D], w1 [E_l, D, K]), by the library's quantizers on the CPU:
  (x quantized 1 x 128 with power-of-two scales and packed, w1 dequantized float32 (the references' values), the
  kernels' w1 and w1_scales)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap import fp8  # pylint: disable=g-import-not-at-top
  with jax.default_device(jax.devices("cpu")[0]):
    packed = fp8.pack_rows(*fp8.quantize_rows(jnp.asarray(x.f), pow2=True))
    weight = fp8.quantize_weight(jnp.asarray(w1.f))
    wf = weight.dequantize()
  ops = {"w1": np.ascontiguousarray(np.asarray(weight.values).view(np.uint8)),
         "w1_scales": np.ascontiguousarray(np.asarray(weight.scales, np.float32))}
  return PackedValues(np.asarray(packed)), Values(np.asarray(wf, np.float32)), ops


def unpacked_recv(case: Case, ranks: list[RankData], d: int) -> dict[str, np.ndarray]:
  """Rank d's recv rows as its dispatch lands them (every source's kept slots at their recv rows), unpacked: the
  two calls' GEMM1 operands x_recv_q e4m3 [recv_rows, D] (uint8) and x_recv_s [D/128, ld] float32 MN-major (NaN past
  recv_rows, as grouped_matmul_fp8's lhs_scales)."""
  from jax_moe_overlap.grouped_gemm import fp8_scales_ld  # pylint: disable=g-import-not-at-top
  D, n = case.d_model, int(ranks[d].plan["recv_rows"])
  recv = np.zeros((n, case.dispatch_row_bytes), np.uint8)
  for src in ranks:
    pl = src.plan
    to_d = (pl["slot_dest_rank"] == d) & (pl["slot_dest_row"] >= 0)
    recv[pl["slot_dest_row"][to_d]] = src.x.data[pl["slot_src_row"][to_d]]
  scales = np.full((D // 128, fp8_scales_ld(case.cap)), np.nan, np.float32)
  scales[:, :n] = np.ascontiguousarray(recv[:, D:]).view(np.float32).T
  return {"x_recv_q": np.ascontiguousarray(recv[:, :D]), "x_recv_s": scales}
