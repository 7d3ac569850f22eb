"""The static configuration types: ``MoEConfig``, the description of one MoE block (with MaxText's names where MaxText
has the option), and ``CallConfig`` (with its ``ConsumerTuning``), the settings of the custom calls.

Examples (the experts' widths scaled down; the routing as published):

  DeepSeek-V3 style: sigmoid scores, a selection-only bias updated from the load, 8 groups of which 4 are searched,
  top-8 renormalised and scaled by 2.5, one shared expert::

    MoEConfig(emb_dim=1024, moe_mlp_dim=512, num_experts=64, num_experts_per_tok=8, routed_score_func="sigmoid",
              routed_bias=True, routed_bias_update_rate=1e-3, n_routing_groups=8, topk_routing_group=4,
              norm_topk_prob=True, routed_scaling_factor=2.5, shared_experts=1, load_balance_loss_weight=0.0)

  Mixtral / Qwen3-MoE style: softmax over all experts, top-k renormalised, no shared expert::

    MoEConfig(emb_dim=1024, moe_mlp_dim=3584, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)

  Qwen2-MoE style (Qwen1.5-MoE-A2.7B's sizes and routing): softmax, top-4 of 60 not renormalised, one shared expert of width
  5632 scaled per token by sigmoid(x @ shared_expert_gate)::

    MoEConfig(emb_dim=2048, moe_mlp_dim=1408, num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
              shared_experts=1, shared_mlp_dim=5632, shared_expert_gate=True)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_moe_overlap import env
from jax_moe_overlap.checks import (check_capacity_factor, check_dtype, check_experts, check_fp8_sizes,
                                    check_fp8_weight_dtype, check_positive_int, check_quantization)

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """One MoE feed-forward block.

  Sizes:
    emb_dim: model width D. moe_mlp_dim: hidden width F of one routed expert (SwiGLU: gate and up are F wide).
    num_experts: E routed experts. num_experts_per_tok: k experts per token.
    shared_experts: number of shared (always-on) experts; their dense SwiGLU path is shared_experts * moe_mlp_dim
      wide (as MaxText and DeepSeek-V3 size it) unless shared_mlp_dim gives the width. 0: none.
    shared_expert_gate: scale the shared path per token by sigmoid(x @ g), with g a learned [D, 1] weight:
      y = routed(x) + sigmoid(x @ g) * shared(x), as Qwen2-MoE and Qwen3-Next do (the weight is their
      ``shared_expert_gate``: ``mlp.shared_expert_gate.weight`` [1, D] in Hugging Face checkpoints,
      ``shared_expert_gate/kernel`` [D, 1] in MaxText's Qwen3-Next block). Needs shared experts.
  Capacity:
    capacity_factor: None or any value <= 0 (MaxText's -1): dropless. Else each expert takes at most
      ceil(cf * tokens * k / E) rows per call; later slots (in global token order) are dropped.
  Router (``routing.route``):
    routed_score_func: "softmax" (Mixtral, Qwen3-MoE) or "sigmoid" (DeepSeek-V3) scores of the router logits.
    routed_bias: a per-expert bias added to the scores for the *selection* only (DeepSeek-V3's auxiliary-loss-free
      balancing); the gates use the unbiased scores. Kept as a non-trainable ``RoutingBias`` variable, updated by
      ``routing.update_routing_bias`` with routed_bias_update_rate from each step's load.
    n_routing_groups, topk_routing_group: group-limited routing: the experts form n_routing_groups equal groups,
      each token searches its topk_routing_group best groups (a group's score: the sum of its two best selection
      scores) and picks its k experts among them. -1: off.
    norm_topk_prob: divide the k selected scores by their sum. routed_scaling_factor: multiplies the gates after.
    load_balance_loss_weight, router_z_loss_weight: weights of the Switch load-balance loss and the ST-MoE z-loss
      in the total auxiliary loss that the drop-in block records (``MoEBlock``; ``total_aux_loss`` sums the layers).
      This library's load-balance loss is 1.0 for a balanced router; Hugging Face's ``load_balancing_loss_func``
      (weighted by ``router_aux_loss_coef``) and MaxText's ``load_balance_loss`` (weighted by MaxText's own
      ``load_balance_loss_weight``) score k = num_experts_per_tok there, and both stand for all L MoE layers at once
      (HF pools every layer's tokens into one loss; MaxText averages the layers' losses). So the same penalty takes
      load_balance_loss_weight = k * coef / L here: exactly for one layer against HF, and against MaxText when each
      call holds one sequence (MaxText takes the statistics per sequence and averages over the batch).
  Dtypes (MaxText's names and defaults):
    dtype: the compute dtype, bfloat16 (default) or float32: the routed and shared experts' inputs and weights are
      cast to it for their matmuls, which accumulate in float32. dtype=jnp.float32 chooses float32 compute on
      purpose (on GPUs float32 GEMMs run on the SIMT engine, bfloat16 ones on the tensor cores).
    weight_dtype: the dtype the parameters are kept in (the master weights), float32 by default; they are cast to
      dtype for each call, so the gradients and the optimizer see weight_dtype. Under quantization float32 or
      bfloat16: the FP8 recipe quantizes the master weights in their own dtype.
    The router always computes in float32, and the output y has the input's dtype.
  Quantization (MaxText's name):
    quantization: None (default): the routed experts compute in ``dtype``. "fp8": their GEMMs follow DeepSeek-V3's
      FP8 recipe (``fp8_experts.py``; docs/design.md, "FP8"): e4m3 operands with float32 scales per 1 x 128 tile of
      the activations and gradients and per 128 x 128 block of the weights, quantized per call from the master
      weights (weight_dtype), float32 accumulation; the rows and the combine keep ``dtype``. emb_dim and
      moe_mlp_dim must be multiples of 128. It runs with impl "overlap" (the default) and
      "collective" (the FP8 grouped GEMM: Hopper GPUs, its emulation on CPU), "xla" and "reference" (the recipe
      emulated in XLA). The shared experts and the router are not quantized. "fp8_bf16_wgrad": the same, but the two
      weight gradients on bfloat16 operands (``fp8_experts.bf16_wgrad``: no 128 x 1 re-quantization of x, da, h and
      dy; the weight gradients' operands lose 2^-9 to rounding, not e4m3's 2^-4; its speed against "fp8":
      docs/performance.md, "Where the FP8 step goes").
  """

  emb_dim: int
  moe_mlp_dim: int
  num_experts: int
  num_experts_per_tok: int
  capacity_factor: float | None = None
  routed_score_func: str = "softmax"
  routed_bias: bool = False
  routed_bias_update_rate: float = 0.0
  n_routing_groups: int = -1
  topk_routing_group: int = -1
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 1.0
  shared_experts: int = 0
  shared_mlp_dim: int | None = None
  shared_expert_gate: bool = False
  load_balance_loss_weight: float = 0.01
  router_z_loss_weight: float = 0.0
  dtype: Any = jnp.bfloat16
  weight_dtype: Any = jnp.float32
  quantization: str | None = None

  def __post_init__(self):
    for name in ("emb_dim", "moe_mlp_dim", "num_experts", "num_experts_per_tok"):
      object.__setattr__(self, name, check_positive_int(f"MoEConfig.{name}", getattr(self, name)))
    check_experts(self.num_experts, self.num_experts_per_tok, 1, "")
    check_capacity_factor(self.capacity_factor, "MoEConfig.capacity_factor")
    if self.routed_score_func not in SCORE_FUNCS:
      raise ValueError(f"jax_moe_overlap: MoEConfig.routed_score_func must be one of {SCORE_FUNCS}, got "
                       f"{self.routed_score_func!r}")
    if (self.n_routing_groups > 0) != (self.topk_routing_group > 0):
      raise ValueError("jax_moe_overlap: group-limited routing needs both n_routing_groups and topk_routing_group "
                       f"(> 0), got {self.n_routing_groups} and {self.topk_routing_group}")
    if self.n_routing_groups > 0:
      G = self.n_routing_groups
      if self.num_experts % G or self.topk_routing_group > G:
        raise ValueError(f"jax_moe_overlap: {self.num_experts} experts do not form {G} equal groups of which "
                         f"topk_routing_group={self.topk_routing_group} are searched")
      if self.num_experts_per_tok > self.topk_routing_group * (self.num_experts // G):
        raise ValueError(f"jax_moe_overlap: num_experts_per_tok={self.num_experts_per_tok} exceeds the "
                         f"{self.topk_routing_group * (self.num_experts // G)} experts of the searched groups")
    if self.shared_experts < 0 or (self.shared_mlp_dim is not None and self.shared_mlp_dim < 1):
      raise ValueError(f"jax_moe_overlap: shared_experts must be >= 0 and shared_mlp_dim positive or None, got "
                       f"{self.shared_experts} and {self.shared_mlp_dim}")
    if self.shared_expert_gate and self.shared_experts == 0:
      raise ValueError("jax_moe_overlap: shared_expert_gate scales the shared experts' output, but shared_experts is 0")
    if self.routed_bias_update_rate and not self.routed_bias:
      raise ValueError("jax_moe_overlap: routed_bias_update_rate is set but routed_bias is False")
    for name in ("routed_bias", "norm_topk_prob", "shared_expert_gate"):
      if not isinstance(getattr(self, name), (bool, np.bool_)):
        raise TypeError(f"jax_moe_overlap: MoEConfig.{name} must be a bool, got {getattr(self, name)!r}")
    # The update moves a bias towards balance with a rate >= 0 (a negative one would steer tokens to the busiest
    # experts); the losses' weights scale a loss the optimizer minimizes; the gates' scale is a positive factor.
    for name, positive in (("routed_bias_update_rate", False), ("load_balance_loss_weight", False),
                           ("router_z_loss_weight", False), ("routed_scaling_factor", True)):
      v = getattr(self, name)
      if (isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v) or
          v < 0 or (positive and v == 0)):
        raise ValueError(f"jax_moe_overlap: MoEConfig.{name} must be a finite number "
                         f"{'> 0' if positive else '>= 0'}, got {v!r}")
    if self.shared_mlp_dim is not None and self.shared_experts == 0:
      raise ValueError(f"jax_moe_overlap: shared_mlp_dim={self.shared_mlp_dim} is the shared experts' width, but "
                       "shared_experts is 0")
    check_dtype("MoEConfig.dtype", self.dtype)
    if not jnp.issubdtype(jnp.dtype(self.weight_dtype), jnp.floating):
      raise TypeError(f"jax_moe_overlap: MoEConfig.weight_dtype is the dtype of the parameters (the master weights), a "
                      f"floating-point dtype such as float32, got {jnp.dtype(self.weight_dtype)}")
    check_quantization(self.quantization)
    if self.quantization is not None:
      check_fp8_sizes(self.emb_dim, self.moe_mlp_dim)
      check_fp8_weight_dtype("MoEConfig.weight_dtype", self.weight_dtype, self.quantization)

  @property
  def dropless(self) -> bool:
    return self.capacity_factor is None or self.capacity_factor <= 0

  @property
  def expert_capacity_factor(self) -> float | None:
    """The capacity factor as ``moe_experts`` takes it (None: dropless)."""
    return None if self.dropless else float(self.capacity_factor)

  @property
  def shared_width(self) -> int:
    """Hidden width of the shared experts' dense SwiGLU path (0: none)."""
    if self.shared_experts == 0:
      return 0
    return self.shared_mlp_dim if self.shared_mlp_dim is not None else self.shared_experts * self.moe_mlp_dim


# CallConfig.tensor_reduce's values.
TENSOR_REDUCES = ("auto", "gather_rs", "per_slot")


MAX_TIMEOUT_MS = 2**40


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
  issuers: issuing threads per consumer CTA, one ring each, 1..8 (a fixed cost per chunk bounds what one thread
    moves, so more threads move more bytes per consumer SM: docs/design.md).
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


@dataclasses.dataclass(frozen=True)
class CallConfig:
  """Static settings of the custom calls.

  timeout_ms: bound on every wait for a peer or flag; a wait that expires raises an error naming rank, peer,
    stage and counts (default $JMO_TIMEOUT_MS, else 10 s).
  first_call_timeout_ms: the bound of the waits of a group's first call on its workspace (and of its first call
    after a recovery from a failure) where it exceeds timeout_ms: in a job of several processes each finishes
    compiling and produces its first batch on its own after the workspace is set up, and the ranks begin their first
    call as far apart as those end; later calls follow one another (protocol.h, CallWaitBoundMs). Default
    $JMO_FIRST_CALL_TIMEOUT_MS, else 60 s; 0: timeout_ms alone. A program compiled later in the job (an evaluation
    step) must begin within timeout_ms of its peers: raise timeout_ms where processes reach it farther apart.
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
    then the bare grouped GEMM). The fused call equals the two calls bit for bit (the layer's results; its own
    results in their kept rows) on the CUDA engine and on the CPU handlers alike. 0 (default): the library's choice
    (``call_site.dispatch_pushers``): fused with the library's pusher count (8 on an H200's 132 SMs, the same share
    of a rank's smaller SM budget) where the expert axis has two ranks or more on Hopper GPUs and the operands take
    the wgmma engine (``engines.dispatch_gemm_operands``: bfloat16, d_model and 2 * d_ff multiples of 64, d_ff of
    32), two calls elsewhere (one rank: nothing to hide; CPU: XLA's ragged_dot is faster there). > 0: fused with this
    many pushing CTAs wherever the operands allow (on CUDA only on Hopper: elsewhere the call fails with an error
    saying so); on CPU any value > 0 selects the fused CPU handler, the protocol's specification, whose GEMMs are the
    bare grouped GEMMs' CPU loops, while the default two calls' are XLA's ragged_dot (results equal to float32
    rounding, not bit for bit). Not with serialize.
  send_once: whether the forward's dispatch sends a token's row once per destination rank rather than once per slot
    (the receiver fills the token's other slots' rows from it: docs/design.md, "Send once"); results are identical
    either way. None (default): the library's choice (``call_site.send_once``): one row per slot (on the GPU the
    receiver's expansion costs more than the link bytes it saves; docs/performance.md). The backward's dispatch of
    ``gates * dy`` always sends one row per slot (each slot's row differs).
  x_recv_from_tiles: how a fused dispatch_gemm call on CUDA writes the received rows it returns where it keeps them
    (x_recv): True (default): stored by the GEMM1 tiles from the rows they hold in shared memory (each row block's
    first column tile: no second read of the rows, no copy on the pushers' SMs; docs/performance.md, "x_recv from
    the GEMM tiles"); False: copied from the workspace's recv rows by the pushing CTAs after their pushes and by the
    GEMM CTAs that run out of tiles. The same bytes either way; no effect on CPU or on two-call dispatches.
  tensor_reduce: how an ``impl="overlap"`` layer with a tensor axis sums the tensor shards' partial outputs
    (docs/design.md, "GatherRS"). "per_slot": expert_combine returns every shard's partial of every slot to the
    token's owner, which sums them (partials in the layer's dtype). "gather_rs": each rank scales its GEMM2 rows by
    their gates and sums each token's rows (the top-k gather-reduce), and one reduce-scatter over the expert x
    tensor group, overlapped with GEMM2, hands every rank its tokens' rows (partials in float32, summed in rank
    order). "auto" (default): the library's choice per call, ``call_site.tensor_reduce``'s rule. Without a tensor
    axis the layer runs "per_slot" whatever this says.
  """

  timeout_ms: int = dataclasses.field(default_factory=env.timeout_ms)
  first_call_timeout_ms: int = dataclasses.field(default_factory=env.first_call_timeout_ms)
  delay_rank: int = -1
  delay_us: int = 0
  consumer_ctas: int = 0
  serialize: bool = False
  dispatch_pushers: int = 0
  send_once: bool | None = None
  x_recv_from_tiles: bool = True
  consumer_tuning: ConsumerTuning = dataclasses.field(default_factory=ConsumerTuning)
  tensor_reduce: str = "auto"

  def __post_init__(self):
    # The custom calls add timeout_ms to a nanosecond clock (int64): 2^40 ms (35 years) stays far from its overflow;
    # 0 would fail every wait at once, and a negative bound wraps.
    if not _int_in(self.timeout_ms, 1, MAX_TIMEOUT_MS):
      raise ValueError(f"jax_moe_overlap: CallConfig.timeout_ms must be an int in [1, {MAX_TIMEOUT_MS}] "
                       f"(milliseconds; its default is $JMO_TIMEOUT_MS, else 10000), got {self.timeout_ms!r}")
    if not _int_in(self.first_call_timeout_ms, 0, MAX_TIMEOUT_MS):
      raise ValueError(f"jax_moe_overlap: CallConfig.first_call_timeout_ms must be an int in [0, {MAX_TIMEOUT_MS}] "
                       f"(milliseconds, 0: timeout_ms alone; its default is $JMO_FIRST_CALL_TIMEOUT_MS, else 60000), "
                       f"got {self.first_call_timeout_ms!r}")
    if not _int_in(self.delay_rank, -1, 2**31 - 1) or not _int_in(self.delay_us, 0, MAX_TIMEOUT_MS):
      raise ValueError(f"jax_moe_overlap: CallConfig.delay_rank must be an int >= -1 (-1: none) and delay_us an int "
                       f"in [0, {MAX_TIMEOUT_MS}], got {self.delay_rank!r} and {self.delay_us!r}")
    if self.tensor_reduce not in TENSOR_REDUCES:
      raise ValueError(f"jax_moe_overlap: CallConfig.tensor_reduce must be one of {TENSOR_REDUCES}, got "
                       f"{self.tensor_reduce!r}")
    if not _int_in(self.consumer_ctas, 0, 2**31 - 1):
      raise ValueError(f"jax_moe_overlap: CallConfig.consumer_ctas must be an int >= 0 (0: the resource manager's "
                       f"choice), got {self.consumer_ctas!r}")
    if not isinstance(self.serialize, (bool, np.bool_)):
      raise ValueError(f"jax_moe_overlap: CallConfig.serialize must be a bool, got {self.serialize!r}")
    if not _int_in(self.dispatch_pushers, 0, 2**31 - 1):
      raise ValueError(f"jax_moe_overlap: CallConfig.dispatch_pushers must be an int >= 0 (0: the library's choice), "
                       f"got {self.dispatch_pushers!r}")
    if self.send_once is not None and not isinstance(self.send_once, (bool, np.bool_)):
      raise ValueError(f"jax_moe_overlap: CallConfig.send_once must be None (the library's choice) or a bool, got "
                       f"{self.send_once!r}")
    if not isinstance(self.x_recv_from_tiles, (bool, np.bool_)):
      raise ValueError(f"jax_moe_overlap: CallConfig.x_recv_from_tiles must be a bool, got "
                       f"{self.x_recv_from_tiles!r}")
    if self.serialize and self.dispatch_pushers > 0:
      raise ValueError(f"jax_moe_overlap: CallConfig(serialize=True) runs the dispatch and GEMM1 as two calls (no "
                       f"overlap anywhere); it excludes dispatch_pushers={self.dispatch_pushers}, which overlaps them")
