"""``impl="xla"`` and ``impl="collective"``: the expert-parallel MoE layer with its exchange in XLA collectives.

One code path, two choices of the local expert GEMMs (``LOCAL_EXPERTS``):

- ``"xla"``: ``lax.ragged_dot``, no custom call at all. It is the path a JAX user has without this library (route,
  sort, ragged all-to-all, grouped GEMM, ragged all-to-all back, combine), kept first-class: the fallback where the
  custom calls cannot run (TPU) and the honest baseline of the benchmarks. Differentiated by JAX's own rules.
- ``"collective"``: this library's grouped GEMMs (``expert_gemms.expert_mlp``: on GPU ``grouped_matmul_swiglu``, its
  SwiGLU in the GEMM's epilogue where the engine takes it, and ``grouped_matmul``; a ``custom_vjp`` whose backward is
  the same grouped GEMMs). The exchange needs no workspace, so the expert axis may span hosts (NCCL on GPUs):
  ``moe_experts`` chooses it where ``impl="overlap"`` cannot run for that reason (``hosts.py``).

Under quantization="fp8" both run DeepSeek-V3's FP8 recipe (``fp8_experts.py``) with the GEMMs of
``fp8_experts.recipe_gemms(FP8_BACKENDS[impl], quantization)`` (``"xla"``: ragged_dot on the dequantized operands;
``"collective"``: the FP8 grouped GEMM), and the rows cross the exchange in FP8 (``fp8_exchange.py``): quantized
1 x 128 with power-of-two scales on the token's owner, e4m3 values and float32 scales in one packed row of D + D / 32
bytes, read by GEMM1 as they land; in the backward the output gradient likewise, read by GEMM2's dgrad. The combine
and the input gradient cross in the compute dtype. The outputs and gradients are bit for bit those of the compute
dtype's exchange with the rows quantized on arrival (a 1 x 128 tile lies within a row, and the exchange moves rows
unchanged).

Same semantics as ``impl="reference"``: the plan's capacity rule (first come first served in the global slot order),
skipped slots (id -1) moving nothing, the sum over a token's choices in the fixed order j = 0..k-1. The exchange is
differentiated by JAX's own rules (its transpose is the exchange back), but for the FP8 rows (fp8_exchange.py's
``custom_vjp``).

Per rank, inside ``shard_map``:

1. The slot counts are all-gathered and the capacity kept per (source, destination, local expert) group computed as
   in ``plan.make_plan`` (``Route``: where every row goes and comes back). Kept slots go to a compact send buffer in
   the send order (destination rank, expert).
2. The exchange sends each destination its contiguous chunk. It lands on the receiver in (source, expert) order; a
   gather puts it in (expert, source) order, the plan's recv layout, so each local expert's rows are contiguous.
3. GEMM1 (float32 accumulation), SwiGLU, GEMM2 over the local experts (``LOCAL_EXPERTS[impl]``).
4. The inverse gather, the exchange back, and the gate-weighted sum per token.

Expert tensor parallelism (``tensor_axis``): each expert's hidden width is split over the tensor axis, and the
layer is the all-gather / reduce-scatter pattern around the expert-parallel one. The TP devices of a tensor group
all-gather their tokens (``all_gather`` over the tensor axis, in tensor order; under quantization="fp8" the packed
FP8 rows), run steps 1-4 over the expert axis
on the group's tokens with their shards of the experts, which gives each device its shard's partial sum of every
output, in float32, and ``psum_scatter`` over the tensor axis hands each device the sum of its own tokens' rows
(the partials cross in float32; the order of the sum is XLA's reduce-scatter's, fixed for a compiled program). The
gathered tokens are in the group's global order (expert rank, tensor rank, token), so the capacity rule keeps the
slots the other impls keep. JAX differentiates both collectives (each is the other's transpose).

The exchange is ``lax.ragged_all_to_all`` on GPU and TPU. XLA:CPU has no ragged all-to-all: there every destination's
chunk is padded to a static bound and sent with ``lax.all_to_all`` (the same rows land in the same places).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap import tensor_parallel as tp_lib
from jax_moe_overlap.expert_gemms import expert_mlp, swiglu
from jax_moe_overlap.fp8_exchange import fp8_combined_exchange
from jax_moe_overlap.slot_combine import combine_slots
from jax_moe_overlap.fp8_experts import recipe_gemms


def ragged_dot_mlp(x_recv, w1, w2, group_sizes):
  """GEMM1 (float32 accumulation), SwiGLU, GEMM2 of a rank's recv rows with ``lax.ragged_dot``: [cap, D] in x_recv's
  dtype, rows past the last group zero (``expert_mlp``'s contract)."""
  a = jax.lax.ragged_dot(x_recv, w1, group_sizes, preferred_element_type=jnp.float32)
  return jax.lax.ragged_dot(swiglu(a).astype(x_recv.dtype), w2, group_sizes,
                            preferred_element_type=jnp.float32).astype(x_recv.dtype)


# The impls of this module by the function that runs a rank's local experts on its recv rows:
# f(x_recv [cap, D], w1 [E_local, D, 2F], w2 [E_local, F, D], group_sizes [E_local]) -> [cap, D].
LOCAL_EXPERTS = {"xla": ragged_dot_mlp, "collective": expert_mlp}
# Under quantization="fp8" both run the FP8 recipe (fp8_experts.py) on rows exchanged in FP8 (fp8_exchange.py), with
# these GEMMs: impl="xla" ragged_dot on the dequantized operands (the emulation, the baseline), impl="collective"
# this library's FP8 grouped GEMM on the quantized operands (the e4m3 wgmma kernel on Hopper, its emulation on CPU):
# the backend that fp8_experts.recipe_gemms takes, per impl.
FP8_BACKENDS = {"xla": "ragged_dot", "collective": "kernels"}


def moe_experts_xla(x, expert_ids, gates, w1, w2, *, mesh, axis_name: str, expert_cap: int, recv_cap: int,
                    batch_axes: tuple[str, ...] = (), impl: str = "xla", tensor_axis: str | None = None,
                    quantization: str | None = None):
  """The expert layer with tokens sharded over ``(*batch_axes, axis_name, tensor_axis)``, experts over ``axis_name``
  and their hidden width over ``tensor_axis`` (each position on the batch axes an independent expert-parallel
  group), the local experts run by ``LOCAL_EXPERTS[impl]`` (``impl``: "xla" or "collective"; with
  quantization="fp8" the recipe with ``FP8_BACKENDS[impl]``, its rows exchanged in FP8). w1: [E, D, 2F] or its view
  [E, D, 2, F] (with quantization="fp8" also an ``fp8.Fp8Weight``, as w2). expert_cap: rows per expert; recv_cap: a
  rank's recv rows for the T TP tokens of its tensor group. Returns (y [T, D], dropped [])."""
  ragged = _uses_ragged_all_to_all(mesh)
  if quantization is None:
    block = functools.partial(_unquantized_block, LOCAL_EXPERTS[impl])
  else:
    block = functools.partial(fp8_combined_exchange, gemms=recipe_gemms(FP8_BACKENDS[impl], quantization))
  fn = functools.partial(_moe_local, axis_name=axis_name, tensor_axis=tensor_axis, batch_axes=batch_axes,
                         num_experts=w2.shape[0], expert_cap=expert_cap, recv_cap=recv_cap, ragged=ragged,
                         block=block)
  token_spec, w1_spec, w2_spec = tp_lib.operand_specs(axis_name, tensor_axis, batch_axes)
  w1 = tp_lib.w1_view(w1)
  in_specs = (token_spec,) * 3 + (tp_lib.weight_spec(w1, w1_spec), tp_lib.weight_spec(w2, w2_spec))
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=(token_spec, P()),
                       check_vma=False)(x, expert_ids, gates, w1, w2)


def _uses_ragged_all_to_all(mesh) -> bool:
  return {d.platform for d in mesh.devices.flat} != {"cpu"}


def _unquantized_experts(local_experts, x, w1, w2, route):
  """Steps 2-4 up to the combine: this rank's tokens x [T, D] -> their rows back from the experts [T TP k, D], the
  rows crossing in x's dtype."""
  recv = route.dispatch(route.send_buffer(route.slot_rows(x)))
  return route.combine_rows(local_experts(recv, w1, w2, route.expert_rows))


def _unquantized_block(local_experts, x, gates, is_kept, w1, w2, route):
  """The slots' rows through the local experts on ``route`` and back, summed per token with their gates (the
  route's tokens' gates [T, k], is_kept [T k]): y [T, D] float32."""
  return combine_slots(route.from_send_buffer(_unquantized_experts(local_experts, x, w1, w2, route)), gates, is_kept)


def _moe_local(x, expert_ids, gates, w1, w2, *, axis_name, tensor_axis, batch_axes, num_experts, expert_cap,
               recv_cap, ragged, block):
  w1 = tp_lib.gate_up_shards(w1)
  route, is_kept, dropped = _route(_group_tokens(expert_ids, tensor_axis), axis_name=axis_name,
                                   tensor_axis=tensor_axis, num_experts=num_experts, expert_cap=expert_cap,
                                   recv_cap=recv_cap, ragged=ragged)
  y = block(x, _group_tokens(gates, tensor_axis), is_kept, w1, w2, route)
  if tensor_axis is not None:
    y = jax.lax.psum_scatter(y, tensor_axis, scatter_dimension=0, tiled=True)
  # Every device of a tensor group holds its group's dropped slots: the sum runs over the groups of the expert axis.
  return y.astype(x.dtype), jax.lax.psum(dropped, (*batch_axes, axis_name))


def fp8_one_rank_block(x, expert_ids, gates, w1, w2, *, axis_name, num_experts, expert_cap, recv_cap,
                       quantization: str = "fp8"):
  """impl="collective"'s FP8 expert block on a one-rank expert axis with no tensor axis (inside shard_map): x [T, D],
  expert_ids and gates [T, k], w1 [E, D, 2F] (gate | up), w2 [E, F, D] -> y [T, D] in x's dtype. impl="overlap"
  takes it there: no row crosses a link, and XLA's gathers move the rows within the device (``_exchange_local``)
  faster than the workspace's dispatch call copies them (docs/performance.md, "Where the FP8 step goes")."""
  route, is_kept, _ = _route(expert_ids, axis_name=axis_name, tensor_axis=None, num_experts=num_experts,
                             expert_cap=expert_cap, recv_cap=recv_cap, ragged=False)
  block = functools.partial(fp8_combined_exchange, gemms=recipe_gemms("kernels", quantization))
  return block(x, gates, is_kept, w1, w2, route).astype(x.dtype)


def _group_tokens(a, tensor_axis):
  """A rank's token rows -> its tensor group's, in tensor order (with no tensor axis: its own)."""
  return a if tensor_axis is None else jax.lax.all_gather(a, tensor_axis, axis=0, tiled=True)


@jax.custom_vjp
def move_rows(rows, index, inverse):
  """rows [N, C] -> [len(index), C]: out[i] = rows[index[i]], zero where index[i] is out of range. ``index`` takes
  each row at most once, and ``inverse`` [N] is its inverse (inverse[j] = i where index[i] = j, out of range for a
  row no output takes). The gradient is then the gather through ``inverse``, where JAX's transpose of a gather is a
  scatter-add of rows, which XLA:GPU runs many times slower than a gather and with atomics. Every row move of the
  route is such a one-to-one map. (A custom_vjp: forward-mode differentiation does not pass through it.)"""
  return jnp.take(rows, index, axis=0, mode="fill", fill_value=0)


def _move_rows_forward(rows, index, inverse):
  return move_rows(rows, index, inverse), (index, inverse)


def _move_rows_backward(residuals, d_out):
  index, inverse = residuals
  return move_rows(d_out, inverse, index), None, None


move_rows.defvjp(_move_rows_forward, _move_rows_backward)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Route:
  """Where this rank's rows go and come back (steps 1, 2 and 4), as int32 arrays of the plan; every row moved
  unchanged, whatever its dtype and width.

  send_row: [T k] a slot's row in the compact send buffer, T k for a slot not kept (T: the tensor group's tokens).
  send_slot: [T k] the inverse: the slot at each send-buffer row, T k past the kept slots.
  send_offsets, send_sizes, at_dest: [R] this rank's chunk to each destination: where it starts in the send buffer,
    its rows, where it lands on the destination; recv_offsets, recv_sizes, at_source: [R] the chunk from each
    source, likewise, for the way back.
  es_from_se, se_from_es: [recv_cap] ``_layout_maps``. expert_rows: [E_local] the recv rows of each local expert.
  """

  send_row: jax.Array
  send_slot: jax.Array
  send_offsets: jax.Array
  send_sizes: jax.Array
  at_dest: jax.Array
  recv_offsets: jax.Array
  recv_sizes: jax.Array
  at_source: jax.Array
  es_from_se: jax.Array
  se_from_es: jax.Array
  expert_rows: jax.Array
  axis_name: str = dataclasses.field(metadata=dict(static=True))
  tensor_axis: str | None = dataclasses.field(metadata=dict(static=True))
  ragged: bool = dataclasses.field(metadata=dict(static=True))
  k: int = dataclasses.field(metadata=dict(static=True))

  @property
  def stays_local(self) -> bool:
    """Whether no row leaves the device: a one-rank expert axis and no tensor axis (inside ``shard_map``)."""
    return self.tensor_axis is None and jax.lax.axis_size(self.axis_name) == 1

  @property
  def moves_words(self) -> bool:
    """True: XLA's gathers and collectives move rows of any element type, so rows of bytes may move as 4-byte
    words (``fp8_exchange.moved``)."""
    return True

  def fuses_dispatch_gemm(self, d_model, n) -> bool:  # pylint: disable=unused-argument
    """False: XLA's collectives move the rows and the GEMM runs after them (``fp8_exchange.experts_gemm1``,
    ``experts_dy``)."""
    return False

  def _exchange(self, *args):
    if jax.lax.axis_size(self.axis_name) == 1:
      return _exchange_local(*args)
    return (_exchange_ragged if self.ragged else _exchange_padded)(*args, axis_name=self.axis_name)

  def _regroup(self, rows, index, inverse):
    """Rows between (source, expert) and (expert, source) order by ``index`` (``_layout_maps``; ``inverse`` the
    other map), zero past the received rows. With one rank there is one source and the two orders are the same: no
    gather (the exchange already left the rows past the received ones zero, and the way back reads none of them)."""
    if jax.lax.axis_size(self.axis_name) == 1:
      return rows
    return move_rows(rows, index, inverse)

  def slot_rows(self, x):
    """This rank's token rows [T / TP, C] -> the tensor group's slot rows [T k, C] (row t k + j: token t's row)."""
    return token_slots(_group_tokens(x, self.tensor_axis), self.k)

  def dispatch_tokens(self, x):
    """This rank's token rows [T / TP, C] -> this rank's recv rows [recv_cap, C]: each kept slot's token row at
    its expert (``dispatch`` of the slots' send buffer)."""
    return self.dispatch(self.send_buffer(self.slot_rows(x)))

  def send_buffer(self, slots):
    """Slot rows [T k, C] -> the send buffer [T k, C]: each kept slot's row at its ``send_row``, zero past them."""
    return move_rows(slots, self.send_slot, self.send_row)

  def from_send_buffer(self, send):
    """``send_buffer``'s inverse on the kept slots: [T k, C] -> slot rows [T k, C], zero for a slot not kept."""
    return move_rows(send, self.send_row, self.send_slot)

  def dispatch(self, send):
    """The send buffer [T k, C] -> this rank's recv rows [recv_cap, C], grouped by local expert (zero past them):
    exchanged, received in (source, expert) order, gathered into (expert, source) order."""
    recv_se = self._exchange(send, self.es_from_se.shape[0], self.send_offsets, self.send_sizes, self.at_dest,
                             self.recv_sizes)
    return self._regroup(recv_se, self.es_from_se, self.se_from_es)

  def combine_rows(self, out):
    """Recv rows [recv_cap, C] -> the send buffer's rows [T k, C] (each kept slot's at its ``send_row``, zero past
    them): the inverse gather and the exchange back. It moves each row back where ``dispatch`` took it from, so
    as a linear map it is ``dispatch``'s transpose."""
    out_se = self._regroup(out, self.se_from_es, self.es_from_se)
    return self._exchange(out_se, self.send_row.shape[0], self.recv_offsets, self.recv_sizes, self.at_source,
                          self.send_sizes)


def _route(expert_ids, *, axis_name, tensor_axis, num_experts, expert_cap, recv_cap, ragged):
  """Step 1 on the tensor group's routing [T, k]: (``Route``, is_kept [T k], this rank's dropped slots [])."""
  T, k = expert_ids.shape
  # An id outside [0, E) other than SKIP: no custom call runs here to report it (the plan would count it as expert
  # 0's), so it is a skipped slot, as impl="reference" gives it no output.
  expert_ids = jnp.where((expert_ids >= 0) & (expert_ids < num_experts), expert_ids, plan_lib.SKIP)
  counts_all, rank, plan = plan_lib.plan_over_axis(expert_ids, num_experts, axis_name, expert_cap)  # [s, d, e]
  kept = plan_lib.kept_counts(counts_all, expert_cap)                      # [s, d, e]
  cs = plan_lib.exclusive_cumsum

  is_kept = plan.slot_ret_row >= 0
  send_row, send_slot = plan_lib.packed_rows(expert_ids, counts_all, rank, expert_cap, plan)

  kept_sd = jnp.sum(kept, axis=2)                                           # [s, d] rows from s to d
  send_sizes = kept_sd[rank]
  recv_sizes = kept_sd[:, rank]
  es_from_se, se_from_es = _layout_maps(kept[:, rank, :], recv_cap)
  route = Route(send_row=send_row, send_slot=send_slot, send_offsets=cs(send_sizes), send_sizes=send_sizes,
                at_dest=cs(kept_sd, axis=0)[rank],        # where this rank's chunk starts on each destination
                recv_offsets=cs(recv_sizes), recv_sizes=recv_sizes,
                at_source=cs(kept_sd, axis=1)[:, rank],   # where each source's chunk starts in its send order
                es_from_se=es_from_se, se_from_es=se_from_es, expert_rows=plan.expert_rows, axis_name=axis_name,
                tensor_axis=tensor_axis, ragged=ragged, k=k)
  return route, is_kept, plan.dropped


def token_slots(rows, k: int):
  """Token rows [T, C] -> slot rows [T k, C], row t k + j token t's. A broadcast, so its transpose is the sum over a
  token's k slots in slot order (no scatter-add)."""
  return jnp.broadcast_to(rows[:, None], (rows.shape[0], k) + rows.shape[1:]).reshape((-1,) + rows.shape[1:])




def _layout_maps(kept_se: jax.Array, rows: int):
  """kept_se [R_src, E_local]: rows of each (source, expert) segment on this rank -> (es_from_se, se_from_es), two
  [rows] int32 maps: the (source, expert)-order row of each (expert, source)-order row and the inverse; ``rows``
  (out of range: a zero row) past the received rows."""
  R, E_l = kept_se.shape
  sizes_se = kept_se.reshape(R * E_l)
  sizes_es = kept_se.T.reshape(E_l * R)
  start_se = plan_lib.exclusive_cumsum(sizes_se).reshape(R, E_l)
  start_es = plan_lib.exclusive_cumsum(sizes_es).reshape(E_l, R)
  i = jnp.arange(rows, dtype=jnp.int32)
  total = jnp.sum(sizes_se)

  def lookup(sizes, start_from, start_to, transpose):
    seg = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), i, side="right"), sizes.shape[0] - 1)
    a, b = seg // start_from.shape[1], seg % start_from.shape[1]
    within = i - start_from[a, b]
    dst = (start_to[b, a] if transpose else start_to[a, b]) + within
    return jnp.where(i < total, dst, rows).astype(jnp.int32)

  es_from_se = lookup(sizes_es, start_es, start_se, transpose=True)
  se_from_es = lookup(sizes_se, start_se, start_es, transpose=True)
  return es_from_se, se_from_es


def _exchange_local(operand, out_rows, input_offsets, send_sizes, output_offsets, recv_sizes):
  """The exchange of a one-rank expert axis: the rank's one chunk moved within the rank by a gather, the same rows
  in the same places as ``ragged_all_to_all``'s result. No collective: XLA:GPU's ragged_all_to_all moves a chunk to
  the device itself no faster than to a peer, far below HBM speed (docs/performance.md, "impl='collective' and
  'xla' at EP = 1")."""
  del recv_sizes   # one rank: what it receives is what it sends
  o = jnp.arange(out_rows, dtype=jnp.int32) - output_offsets[0]
  src = jnp.where((o >= 0) & (o < send_sizes[0]), input_offsets[0] + o, operand.shape[0])
  i = jnp.arange(operand.shape[0], dtype=jnp.int32) - input_offsets[0]
  dst = jnp.where((i >= 0) & (i < send_sizes[0]), output_offsets[0] + i, out_rows)
  return move_rows(operand, src, dst)


def _exchange_ragged(operand, out_rows, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
  output = jnp.zeros((out_rows,) + operand.shape[1:], operand.dtype)
  sizes = _batched_with(jax.lax.stop_gradient(operand), input_offsets, send_sizes, output_offsets, recv_sizes)
  return jax.lax.ragged_all_to_all(operand, output, *sizes, axis_name=axis_name)


@jax.custom_batching.custom_vmap
def _batched_with(operand, *sizes):
  """``sizes`` unchanged. Under vmap they carry a batch dimension whenever ``operand`` or any of them does: JAX's
  batching rule of ``ragged_all_to_all`` takes offsets and sizes that are all batched or none (vmap over the tokens
  with the routing held fixed batches the rows and not the counts). ``operand`` only tells the batching; it is read
  through ``stop_gradient``, so that differentiation never enters this function (it has no reverse-mode rule)."""
  del operand
  return sizes


@_batched_with.def_vmap
def _batched_with_rule(axis_size, in_batched, operand, *sizes):
  del operand
  if not any(in_batched):
    return sizes, (False,) * len(sizes)
  out = tuple(a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(sizes, in_batched[1:]))
  return out, (True,) * len(sizes)


def _exchange_padded(operand, out_rows, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
  """``ragged_all_to_all``'s result through ``lax.all_to_all``: every chunk padded to the most rows it can hold, the
  rows into and out of the padded blocks moved by ``move_rows`` (one-to-one maps both ways)."""
  R = input_offsets.shape[0]
  bound = min(operand.shape[0], out_rows)
  i = jnp.arange(bound, dtype=jnp.int32)
  src = jnp.where(i[None, :] < send_sizes[:, None], input_offsets[:, None] + i[None, :], operand.shape[0])
  blocks = move_rows(operand, src.reshape(-1), _padded_place(operand.shape[0], input_offsets, send_sizes, bound))
  got = jax.lax.all_to_all(blocks.reshape((R, bound) + operand.shape[1:]), axis_name, 0, 0, tiled=True)
  where = jax.lax.all_to_all(output_offsets.reshape(R, 1), axis_name, 0, 0, tiled=True).reshape(R)
  dst = jnp.where(i[None, :] < recv_sizes[:, None], where[:, None] + i[None, :], out_rows)
  return move_rows(got.reshape((R * bound,) + operand.shape[1:]), _padded_place(out_rows, where, recv_sizes, bound),
                   dst.reshape(-1))


def _padded_place(rows, starts, sizes, bound):
  """[rows] int32: row j's place r * bound + (j - starts[r]) among R padded chunks of ``bound`` rows, for the
  chunk r holding it (rows starts[r] .. starts[r] + sizes[r] - 1; the chunks disjoint), R * bound for a row in
  none."""
  j = jnp.arange(rows, dtype=jnp.int32)[:, None]
  inside = (j >= starts[None, :]) & (j < (starts + sizes)[None, :])            # [rows, R]
  r = jnp.argmax(inside, axis=1).astype(jnp.int32)
  place = r * bound + j[:, 0] - starts[r]
  return jnp.where(jnp.any(inside, axis=1), place, starts.shape[0] * bound).astype(jnp.int32)
