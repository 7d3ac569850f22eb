"""Expert-parallel MoE expert layer (post-router) on R devices, forward and forward+backward (issue 7, item 3).

A mesh of R devices on axis "expert" (all local devices, or ``--devices N``); tokens and experts are sharded over it.
Every implementation is a function of global arrays ``(x [T_global, D], expert_ids [T_global, k], gates [T_global, k],
w1 [E, D, 2F], w2 [E, F, D]) -> y [T_global, D]`` run under ``jax.jit``:

ours            jax_moe_overlap.moe_experts(impl="overlap"): dispatch + grouped GEMM1 + expert_combine custom calls.
xla_ragged      MaxText's GPU path in shard_map: sort slots by expert, ragged_all_to_all to the owning ranks (one slice
                per destination rank), local permute by local expert, jax.lax.ragged_dot GEMM1 + SwiGLU + GEMM2,
                un-permute, ragged_all_to_all back, unsort, weighted sum over k. XLA:CPU has no ragged_all_to_all:
                on CPU it is skipped (its offsets are still checked, through an all_gather emulation of the
                documented semantics, as ``xla_ragged[emulated]``).
tokamax_ragged  the same with tokamax.ragged_dot(implementation="mosaic") (MaxText's GPU choice), when tokamax imports.
xla_dense_a2a   GShard-style capacity-padded path: scatter slots into [R, E_local, C, D], all_to_all, batched GEMMs
                per local expert, all_to_all back, combine. C = T_local (dropless worst case) unless
                --capacity-factor (a number: ceil(cf T_local k / E); 'fit': the largest (rank, expert) count of these
                inputs, so nothing drops).
ours_dg         (with --dispatch-pushers P > 0) ours with CallConfig(dispatch_pushers=P): the dispatch and GEMM1 in one
                dispatch_gemm call (Hopper, bf16), GEMM1's tiles of each source starting once its rows are in, so the
                dispatch overlaps GEMM1 as the return overlaps GEMM2 (on CPU it runs as ours).
serialized      ours with CallConfig(serialize=True): expert_combine's consumer starts pushing only after the producer
                has finished the whole GEMM (every expert_combine of the pass: GEMM2 forward, dx backward). Same
                kernels, same results, no overlap: the baseline the overlap is measured against.
ideal           max(compute alone, communication alone), both measured in the same run on the same inputs (extra
                rows compute_alone, comm_alone and dispatch_alone, then the ideal and bound rows):
                compute_alone  the expert work of ours with no inter-rank traffic: on every rank, expert_mlp
                               (primitives.py; GEMM1 + SwiGLU + GEMM2 through our grouped GEMMs, for fwd+bwd also the
                               backward GEMMs dh, dW2, dW1, dx as in ours' backward pass) on rows it already holds,
                               with ours' per-rank group sizes (the plan of these routings; the rows are copies of the
                               rank's own tokens, prepared untimed). GEMM2 and dx run as grouped_matmul (the producer's
                               tile engine on every SM), where ours runs them in expert_combine on the SMs the consumer
                               leaves: compute alone is a lower bound for ours' compute. Excluded: the dispatches, the
                               plan's count all_gather and the final combine (they are not expert compute).
                comm_alone     ours (dispatch + expert_combine, the same plan, the same D-wide rows both ways: the same
                               bytes; for fwd+bwd also the backward's dispatch and dx return) with the expert width F
                               shrunk to 64 (the narrowest width the wgmma engine takes), so the GEMMs are <= 64/F of
                               the real ones. Checked against the reference on those shrunk weights. Its consumer
                               CTAs are chosen as for ours (CallConfig.consumer_ctas = 0); a calibrated resource
                               manager may give this GEMM-light call more of them than ours gets: then comm_alone is
                               a lower bound for moving these bytes on our engine. NCCL's ragged_all_to_all moves the
                               same bytes in the xla_ragged row (with its GEMMs).
                dispatch_alone ours' dispatches alone (dispatch_probe): the plan (the count all_gather, make_plan)
                               and the forward dispatch of the token rows, through the same workspace as ours; for
                               fwd+bwd a second dispatch in the same call of [T k, D] rows made untimed, as the
                               backward's dispatch of gates * dy. Half the pass's bytes (its a2a_MB): the dispatch
                               half, which ours runs before GEMM1, where nothing overlaps it. Checked bit-exact: every
                               row a rank receives is the source row the plan sends there.
                The ideal row reports compute_ms, comm_ms, ms = ideal_ms = max of the two, overlap_eff =
                (serialized - ours) / min(compute, comm) (1: the shorter of the two is fully hidden; needs the
                serialized row) and ours/ideal (1: perfect overlap at no cost). max(compute, comm) is not what
                this design can reach: only the return (expert_combine's) overlaps a GEMM, the dispatch runs before
                GEMM1. The bound row is that design's limit, compute_alone + dispatch_alone: ms = bound_ms,
                compute_ms, dispatch_ms and ours/bound (1: the return and the rest are fully hidden).

Nothing is timed before it agrees with the float32 reference on the same inputs: relative error (Frobenius) of y and,
for fwd+bwd, of the gradients wrt x, gates, w1, w2 of sum(y * ct) for a fixed random ct, within --rtol (1e-2 for
bfloat16, 1e-4 for float32). The reference has the semantics of ``moe_experts(impl="reference")`` (the dense oracle:
every token through every expert) at the cost of the routed rows (``sparse_reference_layer``: per-expert blocks of
the slots routed to each expert, GEMMs in float32 at precision HIGHEST, experts sharded like the weights, token
chunks when its buffers would pass 4 GiB per device). When the float32 weight gradients would pass 4 GiB per device
(DeepSeek-like), dw1 and dw2 are compared on a fixed sample of 8 experts only (``weight_sample``, named in the check
text); dx and dgates always whole. The probes of the ideal are checked as far as they can be: comm_alone against the
reference on its shrunk weights; compute_alone (which computes on copies of tokens) by its group sizes, the routing's
rows per (rank, local expert) counted on the host, and finite outputs; dispatch_alone bit-exact against the plan's
placement of the source rows. Per shape and pass it reports ms, the ratio vs ``ours`` (>1: ours is faster), and the
bytes the two all-to-alls move per layer (2 x T_global x k x D x itemsize; twice that for fwd+bwd, whose backward has
the same two transfers; logical payload: the padded path moves more) with the rate that makes of the layer time.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 python3 benchmarks/bench_ep_layer.py --quick   # CPU try-out
  python3 benchmarks/bench_ep_layer.py --shapes 'seed T=8192' --out $OUT/ep_layer.jsonl             # all GPUs
  bash benchmarks/run_multi_gpu.sh     # the one-call device run: build, links, GPU tests, a shape subset, training

The default list is 54 shapes (48 seed-sweep, 3 Mixtral-like, 3 DeepSeek-like), more than one 10-minute device
command holds: select subsets with --shapes (a regex on "name skew") and --impls. --tokens-per-rank N runs the same
list scaled down (a CPU dry run). --check-only runs the checks alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re
import time
import sys
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

# Virtual CPU devices for a CPU try-out: --devices N, else 4 (before jax first uses a backend).
common.virtual_cpu_devices(sys.argv)

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax.sharding import NamedSharding  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax.sharding import PartitionSpec as P  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

import jax_moe_overlap as jmo  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_moe_overlap import reference  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_moe_overlap import plan as plan_lib  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_moe_overlap.primitives import RankInfo, dispatch  # noqa: E402  pylint: disable=wrong-import-position
from jax_moe_overlap.primitives import expert_mlp, swiglu  # noqa: E402  pylint: disable=wrong-import-position
from jax_moe_overlap.workspace import Workspace, WorkspaceSizes  # noqa: E402  pylint: disable=wrong-import-position

AXIS = "expert"


# ----------------------------------------------------------------------------------------------------------------
# Shapes and inputs


@dataclasses.dataclass(frozen=True)
class Shape:
  name: str
  tokens_per_rank: int
  d: int
  f: int
  experts: int
  k: int
  skew: str


def shapes(quick: bool) -> list[Shape]:
  """--quick: one tiny CPU shape. Else the seed-paper sweep (tokens per rank 8192 and 16384, top-2, D 2048,
  GEMM1 N = 2F in {4096, 8192}, E in {8, 16, 32, 64}), Mixtral-like (D 4096, F 14336, E 8, top-2, 8192 tokens per
  rank) and DeepSeek-like (D 7168, F 2048, 256 experts, top-8, 4096 tokens per rank, as in bench_layer.py), each
  under balanced / moderate (Zipf 0.8) / stress (Zipf 2.0) expert popularity (common.topk_routing)."""
  if quick:
    return [Shape("quick", 16, 32, 32, 8, 2, "stress")]
  out = []
  for t in (8192, 16384):                       # tokens per rank
    for n in (4096, 8192):                      # GEMM1 N = 2F
      for e in (8, 16, 32, 64):
        for skew in ("balanced", "moderate", "stress"):
          out.append(Shape(f"seed T={t} N={n} E={e}", t, 2048, n // 2, e, 2, skew))
  for skew in ("balanced", "moderate", "stress"):
    out.append(Shape("mixtral-like", 8192, 4096, 14336, 8, 2, skew))
    out.append(Shape("deepseek-like", 4096, 7168, 2048, 256, 8, skew))
  return out


def make_mesh(n: int | None) -> jax.sharding.Mesh:
  return common.expert_mesh(n, AXIS)


def make_inputs(shape: Shape, R: int, dtype, seed: int, mesh):
  """(x, ids, gates, w1, w2, ct), tokens and experts sharded over the mesh; ct is the fixed cotangent of y."""
  T = shape.tokens_per_rank * R
  E, D, F, k = shape.experts, shape.d, shape.f, shape.k
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  ids = common.topk_routing(T, E, k, shape.skew, seed=seed)
  spec = NamedSharding(mesh, P(AXIS))

  def put(a):
    return jax.device_put(a, spec)

  # Generated under jit with sharded outputs, so no device ever holds a whole global array.
  gen = jax.jit(lambda: (jax.random.normal(ks[0], (T, D), jnp.float32).astype(dtype),
                         jax.nn.softmax(jax.random.normal(ks[1], (T, k)), -1),
                         (jax.random.normal(ks[2], (E, D, 2 * F)) / np.sqrt(D)).astype(dtype),
                         (jax.random.normal(ks[3], (E, F, D)) / np.sqrt(F)).astype(dtype),
                         jax.random.normal(ks[4], (T, D), jnp.float32)),
                out_shardings=(spec,) * 5)
  x, gates, w1, w2, ct = gen()
  return (x, put(jnp.asarray(ids)), gates, w1, w2, ct), ids


def _excl_cumsum(a, axis=-1):
  return jnp.cumsum(a, axis=axis) - a


# ----------------------------------------------------------------------------------------------------------------
# ragged_all_to_all path (MaxText's GPU path)
#
# Operand semantics relied on (JAX docs, jax.lax.ragged_all_to_all,
# https://docs.jax.dev/en/latest/_autosummary/jax.lax.ragged_all_to_all.html, and its docstring in jax 0.11.2):
#  * the four index arrays have length N, a multiple of the axis size R; slice i (N/R per destination) goes to
#    axis index i // (N/R): operand[input_offsets[i] : input_offsets[i] + send_sizes[i]];
#  * output_offsets[i] is the offset of that slice in the *receiver's* buffer (not in ours);
#  * recv_sizes[i] is the size of the slice this rank receives from source i // (N/R), i.e.
#    send_sizes == all_to_all(recv_sizes, tiled=True); the result is ``output`` with the received slices written
#    at all_to_all(output_offsets, tiled=True) and everything else left as ``output`` was.
# MaxText (AI-Hypercomputer/maxtext, src/MaxText/layers/moe.py: permute, get_all_to_all_params, local_permute,
# sparse_matmul) uses one slice per destination rank and then sorts the received rows by local expert; so do we.


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
  """ragged_all_to_all written from its documented semantics with an all_gather (slow; for checking offsets).

  Received slices whose recv_sizes disagree with the sender's send_sizes are filled with NaN, so that a wrong
  size computation fails the correctness check instead of passing silently.
  """
  R = jax.lax.axis_size(axis_name)
  me = jax.lax.axis_index(axis_name)
  N = input_offsets.shape[0]
  spd = N // R
  ops = jax.lax.all_gather(operand, axis_name)                       # [R_src, M_in, ...]
  io, ss, oo = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets))  # [R, N]
  rows = jnp.arange(output.shape[0])
  bshape = (output.shape[0],) + (1,) * (output.ndim - 1)
  result = output
  for s in range(R):
    for j in range(spd):
      i = me * spd + j                                               # the sender's slice index that comes to me
      src_off, size, dst_off = io[s, i], ss[s, i], oo[s, i]
      n = recv_sizes[s * spd + j]
      seg = (rows >= dst_off) & (rows < dst_off + n)
      src = jnp.clip(src_off + rows - dst_off, 0, operand.shape[0] - 1)
      val = jnp.where(n == size, ops[s][src], jnp.nan).astype(output.dtype)
      result = jnp.where(seg.reshape(bshape), val, result)
  return result


def ragged_layer(mesh, ragged_dot, recv_rows: int, a2a=jax.lax.ragged_all_to_all):
  """The ragged_all_to_all path as a function of global arrays; ``recv_rows``: static rows of the receive buffer."""

  def local(x, ids, gates, w1, w2):
    T, k = ids.shape
    E_l = w1.shape[0]
    R = jax.lax.axis_size(AXIS)
    me = jax.lax.axis_index(AXIS)
    E = R * E_l
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)                          # slots sorted by (dest rank, local expert)
    xs = jnp.take(x, order // k, axis=0)                             # [T k, D]
    counts = jnp.zeros((E,), jnp.int32).at[flat].add(1).reshape(R, E_l)       # this rank's [dest, e]
    counts_all = jax.lax.all_gather(counts, AXIS)                    # [src, dest, e]
    per_pair = jnp.sum(counts_all, axis=2)                           # [src, dest] rows
    send_sizes = per_pair[me]                                        # [dest]
    input_offsets = _excl_cumsum(send_sizes)
    recv_sizes = per_pair[:, me]                                     # [src]
    # Where my slice lands on destination d: after the slices of the sources before me (receiver's buffer).
    output_offsets = _excl_cumsum(per_pair, axis=0)[me]              # [dest]
    buf = jnp.zeros((recv_rows, x.shape[1]), x.dtype)
    recv = a2a(xs, buf, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=AXIS)
    # recv: segments (src, e) packed in that order; MaxText's local_permute sorts them by local expert.
    seg_sizes = counts_all[:, me, :].reshape(R * E_l)
    seg_id = jnp.searchsorted(jnp.cumsum(seg_sizes), jnp.arange(recv_rows), side="right")
    e_of_row = jnp.where(seg_id < R * E_l, seg_id % E_l, E_l)       # padding rows sort last
    lorder = jnp.argsort(e_of_row, stable=True)
    group_sizes = jnp.sum(counts_all[:, me, :], axis=0).astype(jnp.int32)     # [E_l]
    rs = jnp.take(recv, lorder, axis=0)
    h = swiglu(ragged_dot(rs, w1, group_sizes).astype(jnp.float32)).astype(x.dtype)
    out = ragged_dot(h, w2, group_sizes).astype(x.dtype)
    out = jnp.zeros_like(out).at[lorder].set(out)                    # back to (src, e) order
    # Return trip: the transposed exchange; every source gets its rows back in its own sorted order.
    back = a2a(out, jnp.zeros((T * k, x.shape[1]), x.dtype), _excl_cumsum(recv_sizes), recv_sizes,
               _excl_cumsum(per_pair, axis=1)[:, me], send_sizes, axis_name=AXIS)
    per_slot = jnp.zeros_like(back).at[order].set(back)
    y = jnp.einsum("tk,tkd->td", gates.astype(jnp.float32), per_slot.reshape(T, k, -1).astype(jnp.float32))
    return y.astype(x.dtype)

  spec = P(AXIS)
  return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec, check_vma=False)


def ragged_recv_rows(ids: np.ndarray, R: int, E: int, mode: str) -> int:
  """Static receive rows per rank: 'worst' = every slot of the group; 'fit' = the most any rank gets here (x128)."""
  T_l = ids.shape[0] // R
  k = ids.shape[1]
  if mode == "worst":
    return T_l * R * k
  owner = ids // (E // R)
  most = max(int(np.sum(owner == d)) for d in range(R))
  return max(128, -(-most // 128) * 128)


# ----------------------------------------------------------------------------------------------------------------
# Capacity-padded all_to_all path (GShard style)


def dense_capacity(ids: np.ndarray, R: int, E: int, capacity_factor) -> int:
  T_l, k = ids.shape[0] // R, ids.shape[1]
  if capacity_factor is None:
    return T_l                       # dropless worst case: every token of a rank picks the expert (k distinct ids)
  if capacity_factor == "fit":
    most = max(int(np.max(np.bincount(ids[r * T_l:(r + 1) * T_l].ravel(), minlength=E))) for r in range(R))
    return max(8, -(-most // 8) * 8)
  return max(1, math.ceil(float(capacity_factor) * T_l * k / E))


def dense_a2a_layer(mesh, capacity: int):
  C = capacity

  def local(x, ids, gates, w1, w2):
    T, k = ids.shape
    E_l, D = w1.shape[0], x.shape[1]
    R = jax.lax.axis_size(AXIS)
    E = R * E_l
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rank_in_sorted = jnp.zeros_like(flat).at[order].set(jnp.arange(T * k, dtype=flat.dtype))
    counts = jnp.zeros((E,), jnp.int32).at[flat].add(1)
    pos = rank_in_sorted - _excl_cumsum(counts)[flat]               # slot's place among this rank's slots of expert
    keep = pos < C
    dest, e = flat // E_l, flat % E_l
    slot_pos = jnp.where(keep, pos, C)                               # C is out of range: dropped by mode="drop"
    buf = jnp.zeros((R, E_l, C, D), x.dtype).at[dest, e, slot_pos].set(jnp.repeat(x, k, axis=0), mode="drop")
    recv = jax.lax.all_to_all(buf, AXIS, 0, 0, tiled=True)           # [src, E_l, C, D]
    lhs = jnp.transpose(recv, (1, 0, 2, 3)).reshape(E_l, R * C, D)
    h = swiglu(jnp.einsum("end,edf->enf", lhs, w1, preferred_element_type=jnp.float32)).astype(x.dtype)
    out = jnp.einsum("enf,efd->end", h, w2).astype(x.dtype)
    out = jnp.transpose(out.reshape(E_l, R, C, D), (1, 0, 2, 3))     # [src, E_l, C, D]
    back = jax.lax.all_to_all(out, AXIS, 0, 0, tiled=True)           # [dest, E_l, C, D] on the source again
    per_slot = jnp.where(keep[:, None], back[dest, e, jnp.minimum(pos, C - 1)], 0)
    y = jnp.einsum("tk,tkd->td", gates.astype(jnp.float32), per_slot.reshape(T, k, D).astype(jnp.float32))
    return y.astype(x.dtype)

  spec = P(AXIS)
  return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec, check_vma=False)


def dense_bytes_per_rank(shape: Shape, R: int, C: int, itemsize: int) -> int:
  """Rough peak of the padded path's per-rank buffers (send, recv, GEMM1 fp32 out, h, out, back)."""
  rows = shape.experts * C                       # R * E_local * C
  return rows * (4 * shape.d * itemsize + 2 * shape.f * 4 + shape.f * itemsize)


# ----------------------------------------------------------------------------------------------------------------
# ours, serialized, and the probes of the ideal (compute alone, communication alone)

COMM_PROBE_F = 64     # expert width of the communication probe: K and N % 64 == 0 keep the wgmma engine


def ours_layer(mesh, config: jmo.CallConfig = jmo.CallConfig()):
  """moe_experts(impl="overlap") as a function of global arrays -> y; ``config`` e.g. CallConfig(serialize=True)."""
  return lambda *a: jmo.moe_experts(*a, mesh=mesh, impl="overlap", config=config)[0]


@functools.partial(jax.jit, static_argnums=(1,))
def _shrink_experts(ws, f: int):
  """(w1 [E, D, 2F], w2 [E, F, D]) -> ([E, D, 2f], [E, f, D]): the first f columns of w1's gate and up halves."""
  w1, w2 = ws
  F = w2.shape[1]
  return jnp.concatenate([w1[..., :f], w1[..., F:F + f]], axis=-1), w2[:, :f]


def comm_probe_args(args, f: int = COMM_PROBE_F):
  """The layer's inputs (x, ids, gates, w1, w2, ct) with the expert width F shrunk to min(f, F): ours on them moves
  the same rows (the routing, x and D are unchanged) with next to no GEMM work."""
  x, ids, gates, w1, w2, ct = args
  w1s, w2s = _shrink_experts((w1, w2), min(f, w2.shape[1]))
  return x, ids, gates, w1s, w2s, ct


def compute_probe(mesh, shape: Shape, want_grads: bool):
  """(prepare, fn) of the compute-alone probe on global arrays.

  prepare(x, ids) -> (x_recv [R cap, D], group_sizes [R E_local] int32), sharded over the mesh: per rank, ``cap``
  (ours' static recv rows) copies of its own tokens and the rows per local expert of ours' plan for these routings.
  fn(x_recv, group_sizes, w1, w2) -> expert_mlp's [R cap, D] output, or for fwd+bwd its gradients wrt x_recv, w1,
  w2 for the cotangent x_recv (any [cap, D] data does).
  """
  R = mesh.shape[AXIS]
  E, k, T_l = shape.experts, shape.k, shape.tokens_per_rank
  cap_e = plan_lib.expert_capacity(T_l, R, k, E, None)
  cap = plan_lib.recv_capacity(T_l, R, k, E // R, cap_e)
  spec = P(AXIS)

  def local_prepare(x, ids):
    counts = plan_lib.local_counts(ids, E).reshape(R, E // R)
    counts_all = jax.lax.all_gather(counts, AXIS)                    # [src, dest, e], as ours
    plan = plan_lib.make_plan(ids, counts_all, jax.lax.axis_index(AXIS).astype(jnp.int32), cap_e)
    return jnp.tile(x, (-(-cap // x.shape[0]), 1))[:cap], plan.expert_rows

  def local_mlp(x_recv, group_sizes, w1, w2):
    return expert_mlp(x_recv, w1, w2, group_sizes)

  mlp = jax.shard_map(local_mlp, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec, check_vma=False)

  def grads(x_recv, group_sizes, w1, w2):
    _, vjp = jax.vjp(lambda a, b, c: mlp(a, group_sizes, b, c), x_recv, w1, w2)
    return vjp(x_recv)

  prepare = jax.jit(jax.shard_map(local_prepare, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec),
                                  check_vma=False))
  return prepare, jax.jit(grads if want_grads else mlp)


def dispatch_probe(mesh, shape: Shape, want_grads: bool):
  """(prepare, fn) of the dispatch-alone probe on global arrays: ours' dispatches and nothing else.

  prepare(x, ids) -> fn's arguments: (x, ids), for fwd+bwd (x, ids, d_slot [T k, D]) with d_slot random rows in x's
  dtype (made untimed, sharded like the slots: rank r's [T_local k, D] are its own slots').
  fn(x, ids[, d_slot]) -> x_recv [R cap, D] (for fwd+bwd also d_recv [R cap, D]): per rank, ours' plan (the count
  all_gather and make_plan of api._moe_local) and ours' forward dispatch of the token rows (slot_src_row = slot // k),
  with cap_e, cap and the RankInfo built as moe_experts builds them (the same WorkspaceSizes: the same workspace). For
  fwd+bwd a second dispatch of d_slot with slot_src_row = slot emulates the backward's dispatch of d_slot [T k, D]
  (_expert_block_bwd): one call moves the same D-wide rows as ours' two dispatches of a fwd+bwd pass.
  """
  R = mesh.shape[AXIS]
  E, k, T_l = shape.experts, shape.k, shape.tokens_per_rank
  cap_e = plan_lib.expert_capacity(T_l, R, k, E, None)
  cap = plan_lib.recv_capacity(T_l, R, k, E // R, cap_e)
  spec = P(AXIS)

  def local(x, ids, *d_slot, info):
    counts = plan_lib.local_counts(ids, E).reshape(R, E // R)
    counts_all = jax.lax.all_gather(counts, AXIS)                    # [src, dest, e], as ours
    plan = plan_lib.make_plan(ids, counts_all, jax.lax.axis_index(AXIS).astype(jnp.int32), cap_e)
    T = ids.shape[0]
    x_recv = dispatch(x, jnp.arange(T * k, dtype=jnp.int32) // k, plan, cap, info)
    if not d_slot:
      return x_recv
    return x_recv, dispatch(d_slot[0], jnp.arange(T * k, dtype=jnp.int32), plan, cap, info)

  def fn(x, ids, *d_slot):
    sizes = WorkspaceSizes(row_bytes=x.shape[1] * x.dtype.itemsize, recv_rows=cap, ret_rows=T_l * k,
                           num_segments=E)
    info = RankInfo(Workspace.get(mesh, AXIS, sizes), jmo.CallConfig())
    local_fn = jax.shard_map(functools.partial(local, info=info), mesh=mesh, in_specs=(spec,) * (2 + len(d_slot)),
                             out_specs=(spec, spec) if d_slot else spec, check_vma=False)
    return local_fn(x, ids.astype(jnp.int32), *d_slot)

  def prepare(x, ids):
    if not want_grads:
      return x, ids
    make = jax.jit(lambda: jax.random.normal(jax.random.PRNGKey(7), (x.shape[0] * k, x.shape[1])).astype(x.dtype),
                   out_shardings=NamedSharding(mesh, spec))
    return x, ids, make()

  return prepare, jax.jit(fn)


def dispatch_probe_verdict(fn, sets, ids_np, mesh, shape: Shape) -> Verdict:
  """The dispatch probe's check: fn on the first set, every row each rank received against the source row the plan
  sends there (bit-exact; the placement from make_plan per source rank, slot_dest_rank / slot_dest_row, as
  tests/test_expert_combine.py's reference), for fwd+bwd also d_recv's rows against d_slot's. Rows past what a rank
  received are not checked. call_s 0, as compute_probe_verdict."""
  R = mesh.shape[AXIS]
  E, k, T_l = shape.experts, shape.k, shape.tokens_per_rank
  try:
    outs = fn(*sets[0])
  except Exception as e:  # pylint: disable=broad-except
    return Verdict(False, f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
  outs = outs if isinstance(outs, tuple) else (outs,)
  cap_e = plan_lib.expert_capacity(T_l, R, k, E, None)
  ids = ids_np[0].reshape(R, T_l, k)
  counts_all = jnp.asarray(np.stack([np.bincount(ids[s].ravel(), minlength=E).reshape(R, E // R)
                                     for s in range(R)]))
  placements = []                                                     # (dest rank, dest row, src row) per source
  for s in range(R):
    plan = plan_lib.make_plan(jnp.asarray(ids[s], jnp.int32), counts_all, jnp.int32(s), cap_e)
    rank, row = np.asarray(plan.slot_dest_rank), np.asarray(plan.slot_dest_row)
    kept = row >= 0
    placements.append((rank[kept], row[kept], np.flatnonzero(kept)))
  srcs = (sets[0][0], *sets[0][2:])                                   # x (row = slot // k), d_slot (row = slot)
  for name, src, out, per in zip(("x_recv", "d_recv"), srcs, outs, (k, 1)):
    got = np.asarray(out).reshape(R, -1, out.shape[-1])
    rows = T_l * k // per
    for s, (rank, row, slot) in enumerate(placements):
      want = np.asarray(src[s * rows:(s + 1) * rows])[slot // per]
      bad = np.flatnonzero(np.any(got[rank, row].view(np.uint8) != want.view(np.uint8), axis=-1))
      if bad.size:
        p = slot[bad[0]]
        return Verdict(False, f"{name}: {bad.size} rows from rank {s} differ from the rows the plan sends (first: "
                              f"slot {p} at rank {rank[bad[0]]} row {row[bad[0]]})")
  n = sum(len(p[0]) for p in placements)
  return Verdict(True, f"{n} rows per dispatch where the plan sends them, bit-exact")


def recv_rows_per_expert(ids: np.ndarray, R: int, E: int) -> np.ndarray:
  """[R, E_local] rows each rank receives per local expert (dropless), counted on the host: the probe's check."""
  return np.bincount(ids.ravel(), minlength=E).reshape(R, E // R)


# ----------------------------------------------------------------------------------------------------------------
# Correctness


@jax.jit
def _rel_err(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  err = jnp.sqrt(jnp.sum((a - b) ** 2)) / jnp.maximum(jnp.sqrt(jnp.sum(b * b)), 1e-30)
  return jnp.where(jnp.all(jnp.isfinite(a)), err, jnp.inf)


def rel_err(a, b) -> float:
  """Frobenius relative error of a vs b (inf if a has a NaN/inf), computed on the device (gradients are GBs)."""
  return float(_rel_err(jnp.asarray(a), jnp.asarray(b)))


def fwd_fn(f):
  return jax.jit(lambda x, ids, g, w1, w2, ct: f(x, ids, g, w1, w2))


def grad_fn(f):
  def loss(x, ids, g, w1, w2, ct):
    return jnp.sum(f(x, ids, g, w1, w2).astype(jnp.float32) * ct)
  return jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4)))


REF_BLOCK_ROWS = 128      # rows per GEMM of the sparse reference (reference.routed_combine)
REF_SAMPLE_EXPERTS = 8    # experts whose weight gradients are compared when all of them would not fit


def sparse_reference_layer(mesh, num_experts: int, expert_cap: int, num_blocks: int,
                           block_rows: int = REF_BLOCK_ROWS):
  """The float32 reference layer, sparse and expert-parallel, as a function of global arrays.

  f(x [T, D], ids [T, k] int32, gates [T, k] float32, w1 [E_w, D, 2F], w2 [E_w, F, D], experts [E_w] int32) ->
  y [T, D] float32, everything sharded over the mesh; ``experts`` names the global expert of each weight row (all E
  in order, or a sample, ``weight_sample``). Each rank all-gathers the tokens, applies the oracle's capacity rule to
  the global ids (reference.slot_kept, equal to kept_mask) and runs reference.routed_combine on the slots of its own
  weight rows (GEMMs in float32, precision HIGHEST, ``num_blocks`` static blocks of ``block_rows`` rows: at least
  the most any rank fills, ``reference_blocks``); psum_scatter adds the ranks' partial sums (each over its slots in
  the order j = 0..k-1) and hands every rank its tokens. The semantics of moe_experts(impl="reference"), at the cost
  of the routed rows (T k, not T E per GEMM), with no float32 copy of the weights unless they are differentiated.
  """

  def local(x, ids, gates, w1, w2, experts):
    xg, idg, gg = (jax.lax.all_gather(a, AXIS, tiled=True) for a in (x, ids, gates))
    kept = reference.slot_kept(idg, num_experts, expert_cap)
    row = jnp.full((num_experts,), -1, jnp.int32).at[experts].set(jnp.arange(experts.shape[0], dtype=jnp.int32))
    local_ids = jnp.where(kept, jnp.take(row, idg, mode="fill", fill_value=-1), -1)
    y = reference.routed_combine(xg, local_ids, jnp.where(kept, gg, 0), w1, w2, block_rows=block_rows,
                                 num_blocks=num_blocks)
    return jax.lax.psum_scatter(y, AXIS, scatter_dimension=0, tiled=True)

  spec = P(AXIS)
  return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec, check_vma=False)


def reference_blocks(ids: np.ndarray, experts: np.ndarray, R: int, num_experts: int,
                     block_rows: int = REF_BLOCK_ROWS) -> int:
  """The static blocks of ``sparse_reference_layer`` for host ids [T, k]: the most any rank fills with the slots of
  its weight rows (``experts`` split evenly over R ranks), rounded up to a multiple of max(8, 2^(bits - 5)) (at most
  1/16 more: the input sets of a shape, whose routings differ a little, then mostly share one compilation)."""
  row = np.full(num_experts, -1)
  row[experts] = np.arange(len(experts))
  local, per = row[ids], len(experts) // R
  most = max(reference.blocks_needed(np.where(local >= 0, local - r * per, -1), per, block_rows) for r in range(R))
  step = max(8, 1 << max(0, most.bit_length() - 5))
  return max(step, -(-most // step) * step)


def weight_sample(R: int, num_experts: int) -> np.ndarray:
  """The fixed experts whose weight gradients are compared at big shapes (they depend on E and R only, never on the
  inputs): ceil(REF_SAMPLE_EXPERTS / R) local experts of every rank, evenly spread over its E / R (the first and the
  last included)."""
  per = num_experts // R
  local = np.unique(np.linspace(0, per - 1, min(per, -(-REF_SAMPLE_EXPERTS // R))).round().astype(np.int64))
  return (np.arange(R)[:, None] * per + local[None, :]).ravel()


@functools.lru_cache(maxsize=None)
def _take_experts(mesh, local: tuple):
  """[E, ...] sharded over the mesh -> the rows ``local`` of every rank's shard, [R len(local), ...], float32."""
  fn = lambda w: w[np.asarray(local)].astype(jnp.float32)  # noqa: E731
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False))


def take_experts(mesh, w, experts: np.ndarray):
  """w [E, ...] -> w[experts] in float32 for an ``experts`` of ``weight_sample`` (gathered on each rank, no
  communication: a full float32 copy of the weights or of their gradients can be tens of GB)."""
  R, E = mesh.shape[AXIS], w.shape[0]
  return _take_experts(mesh, tuple(int(e) for e in experts[:len(experts) // R] % (E // R)))(w)


class Reference(NamedTuple):
  """The reference outputs of one input set: (y,) or (dx, dgates, dw1, dw2), float32; ``experts``: None when dw1
  and dw2 cover every expert, else the sampled experts (``weight_sample``) they are of."""

  outputs: tuple
  experts: np.ndarray | None = None


@functools.lru_cache(maxsize=None)
def _reference_fns(mesh, num_experts: int, expert_cap: int, num_blocks: int):
  """(y, grads wrt (x, gates), grads wrt (x, gates, w1, w2), grads wrt (w1, w2)) of the sparse reference, jitted
  (cached per static shape: the two input sets of a shape share their compilations)."""
  f = sparse_reference_layer(mesh, num_experts, expert_cap, num_blocks)

  def loss(x, ids, g, w1, w2, experts, ct):
    return jnp.sum(f(x, ids, g, w1, w2, experts) * ct)

  return (jax.jit(f),) + tuple(jax.jit(jax.grad(loss, argnums=a)) for a in ((0, 2), (0, 2, 3, 4), (3, 4)))


def reference_results(mesh, args, want_grads: bool, max_bytes: float = 2 ** 32,
                      max_wgrad_bytes: float = 2 ** 32) -> Reference:
  """y and the gradients of sum(y * ct) from the sparse float32 reference (``sparse_reference_layer``): the
  semantics of moe_experts(impl="reference"), dropless, at the cost of the routed rows.

  Token chunks keep a rank's [blocks x rows, D] float32 block outputs (and their cotangents) and its gathered
  tokens near ``max_bytes`` (dropless: chunks agree). The weights are read as given (cast to float32 one expert at
  a time); only for dw1 and dw2 are float32 copies made. When the float32 weight gradients of a rank (E / R * 3 D F
  * 4 bytes; the reference holds up to 3x that: copies, gradients, their sum over chunks) exceed
  ``max_wgrad_bytes`` (DeepSeek-like: 22.5 GB at R = 2), dw1 and dw2 are those of the ``weight_sample`` experts
  only (dx and dgates stay whole; the sampled rows are a second, weights-only gradient pass).
  """
  x, ids, gates, w1, w2, ct = args
  R = mesh.shape[AXIS]
  T, D = x.shape
  E, F, k = w2.shape[0], w2.shape[1], ids.shape[1]
  ids_np = np.asarray(ids)
  cap = plan_lib.expert_capacity(T // R, R, k, E, None)
  everyone = np.arange(E)
  sample = weight_sample(R, E) if want_grads and E // R * 3 * D * F * 4 > max_wgrad_bytes else None

  def blocks(n, experts):                   # static blocks of n token chunks
    return max(reference_blocks(c, experts, R, E) for c in np.split(ids_np, n))

  n = 1
  while T % (2 * n) == 0 and (T // (2 * n)) % R == 0 and max_bytes < (2 if want_grads else 1) * (
      blocks(n, everyone) * REF_BLOCK_ROWS * D * 4 + T // n * D * 8):
    n *= 2
  Tc = T // n
  fwd, grad_xg, grad_all, _ = _reference_fns(mesh, E, cap, blocks(n, everyone))
  put = lambda a: jax.device_put(jnp.asarray(a, jnp.int32), NamedSharding(mesh, P(AXIS)))  # noqa: E731
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  experts = put(everyone)
  if sample is None and want_grads:
    w1, w2 = f32(w1), f32(w2)               # differentiated: float32 copies (they fit, see max_wgrad_bytes)
  if sample is not None:
    grad_ws = _reference_fns(mesh, E, cap, blocks(n, sample))[3]
    w1s, w2s, experts_s = take_experts(mesh, w1, sample), take_experts(mesh, w2, sample), put(sample)
  ys, dxs, dgs, dw1, dw2 = [], [], [], 0.0, 0.0
  for c in range(n):                          # everything stays on the devices
    sl = slice(c * Tc, (c + 1) * Tc)
    a = (f32(x[sl]), ids[sl], f32(gates[sl]))
    if not want_grads:
      ys.append(fwd(*a, w1, w2, experts))
      continue
    if sample is None:
      gx, gg, g1, g2 = grad_all(*a, w1, w2, experts, ct[sl])
    else:
      gx, gg = grad_xg(*a, w1, w2, experts, ct[sl])
      g1, g2 = grad_ws(*a, w1s, w2s, experts_s, ct[sl])
    dxs.append(gx)
    dgs.append(gg)
    dw1 = dw1 + g1
    dw2 = dw2 + g2
  if want_grads:
    return Reference((jnp.concatenate(dxs), jnp.concatenate(dgs), dw1, dw2), sample)
  return Reference((jnp.concatenate(ys),))


class Verdict(NamedTuple):
  """A check's outcome: ok, its text, and the seconds of the call checked (what --max-call-s compares)."""

  ok: bool
  text: str
  call_s: float = 0.0


def check(fn, args, ref: Reference, rtol: float, mesh=None) -> Verdict:
  """Runs fn once on args, compares every output with the reference's (dw1 and dw2 on ``ref.experts`` only when
  the reference sampled them: the check text then names the experts)."""
  t0 = time.perf_counter()
  try:
    got = jax.block_until_ready(fn(*args))
  except Exception as e:  # pylint: disable=broad-except
    return Verdict(False, f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
  call_s = time.perf_counter() - t0
  got = got if isinstance(got, tuple) else (got,)
  note = ""
  if ref.experts is not None:
    got = got[:2] + tuple(take_experts(mesh, g, ref.experts) for g in got[2:])
    note = (f" (dw1, dw2 on experts {','.join(map(str, ref.experts))} of {args[3].shape[0]}: sampled, all would "
            f"not fit)")
  errs = [rel_err(g, w) for g, w in zip(got, ref.outputs)]
  worst = max(errs)
  return Verdict(worst <= rtol, "rel err " + "/".join(f"{e:.1e}" for e in errs) + note, call_s)


def verdicts(mesh, fns: dict, arg_sets, want_grads: bool, rtol: float) -> dict:
  """{name: Verdict} of every fn on every input set (their routings differ) against the reference, one set's
  reference at a time; a failure sticks. call_s is that of the last set's call (compiled by then: the first set's
  call compiles fn)."""
  out = {n: Verdict(True, "") for n in fns}
  for a in arg_sets:
    ref = reference_results(mesh, a, want_grads)
    for n, fn in fns.items():
      if out[n].ok:
        out[n] = check(fn, a, ref, rtol, mesh)
    del ref
  return out


def compute_probe_verdict(fn, sets, ids_np, R: int, E: int) -> Verdict:
  """The compute probe's check: its group sizes are the routings' recv rows per (rank, local expert), and fn runs on
  the first set with finite outputs (there is no reference for copies of tokens). call_s 0: that one call compiles
  fn, and the probe is our GEMMs alone, never the slow one of a sweep."""
  for (_, gs, *_), ids in zip(sets, ids_np):
    if not np.array_equal(np.asarray(gs).reshape(R, E // R), recv_rows_per_expert(ids, R, E)):
      return Verdict(False, "its group sizes differ from the rows the routing sends each (rank, local expert)")
  try:
    outs = jax.tree.leaves(fn(*sets[0]))
  except Exception as e:  # pylint: disable=broad-except
    return Verdict(False, f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
  if not all(bool(jnp.all(jnp.isfinite(o))) for o in outs):
    return Verdict(False, "non-finite output")
  return Verdict(True, "group sizes = the routings' recv rows")


def compile_error(fn, args) -> str | None:
  """None if fn compiles for args, else the first line of the error (how ragged_all_to_all is found missing)."""
  try:
    fn.lower(*args).compile()
    return None
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


# ----------------------------------------------------------------------------------------------------------------
# Driver


def implementations(mesh, ids_np, shape: Shape, args, capacity_factor, ragged_buffer: str, itemsize: int,
                    max_dense_gib: float, dispatch_pushers: int = 0):
  """{name: (fn on global arrays, None) or (None, reason it is skipped)}; check-only entries end in '[emulated]'."""
  R = mesh.shape[AXIS]
  impls = {"ours": (ours_layer(mesh), None), "serialized": (ours_layer(mesh, jmo.CallConfig(serialize=True)), None)}
  if dispatch_pushers > 0:
    impls["ours_dg"] = (ours_layer(mesh, jmo.CallConfig(dispatch_pushers=dispatch_pushers)), None)
  rows = max(ragged_recv_rows(i, R, shape.experts, ragged_buffer) for i in ids_np)
  grouped = {"xla_ragged": jax.lax.ragged_dot}
  tokamax_fn, why = common.tokamax_ragged_dot()
  if tokamax_fn:
    grouped["tokamax_ragged"] = tokamax_fn
  else:
    impls["tokamax_ragged"] = (None, why)
  for name, rd in grouped.items():
    f = ragged_layer(mesh, rd, rows)
    err = compile_error(fwd_fn(f), args)
    if err and "ragged-all-to-all" in err.replace("_", "-"):
      impls[name] = (None, f"skipped: this backend ({jax.default_backend()}) cannot compile ragged_all_to_all "
                           f"({err})")
    else:
      impls[name] = (f, None)   # any other compile error surfaces in the correctness check, with its text
  if impls["xla_ragged"][0] is None:
    # Where the real collective cannot run, still check this path's offsets and sizes (check only, never timed).
    impls["xla_ragged[emulated]"] = (ragged_layer(mesh, jax.lax.ragged_dot, rows, a2a=emulated_ragged_all_to_all),
                                     None)
  C = max(dense_capacity(i, R, shape.experts, capacity_factor) for i in ids_np)
  gib = dense_bytes_per_rank(shape, R, C, itemsize) / 2 ** 30
  if gib > max_dense_gib:
    impls["xla_dense_a2a"] = (None, f"skipped: capacity C={C} needs ~{gib:.0f} GiB per rank (> --max-dense-gib "
                                    f"{max_dense_gib}); try --capacity-factor fit")
  else:
    impls["xla_dense_a2a"] = (dense_a2a_layer(mesh, C), None)
  T_l = shape.tokens_per_rank
  drops = sum(int(np.maximum(np.bincount(i[r * T_l:(r + 1) * T_l].ravel(), minlength=shape.experts) - C, 0).sum())
              for i in ids_np[:1] for r in range(R))
  return impls, dict(ragged_recv_rows=rows, dense_capacity=C, dense_dropped_slots=drops)


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="one tiny CPU-sized shape")
  ap.add_argument("--tokens-per-rank", type=int, default=None,
                  help="override every shape's tokens per rank (a scaled-down dry run of the sweep)")
  ap.add_argument("--devices", type=int, default=None, help="mesh size R (default: all local devices)")
  ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                  help="auto: bfloat16 on GPU, float32 on CPU")
  ap.add_argument("--shapes", default=None, help="regex on 'name skew' to select shapes")
  ap.add_argument("--impls", default=None, help="comma list of implementations to run (ours is always run)")
  ap.add_argument("--passes", default="fwd,fwd+bwd")
  ap.add_argument("--capacity-factor", default=None, help="xla_dense_a2a capacity: a number, or 'fit'")
  ap.add_argument("--ragged-buffer", choices=("fit", "worst"), default="fit",
                  help="receive rows of the ragged paths: the most any rank gets for these inputs (x128), or "
                       "every slot of the group")
  ap.add_argument("--max-dense-gib", type=float, default=48.0)
  ap.add_argument("--dispatch-pushers", type=int, default=0,
                  help="> 0: also run ours_dg, ours with CallConfig(dispatch_pushers=this) (dispatch + GEMM1 fused)")
  ap.add_argument("--rtol", type=float, default=None, help="default 1e-2 (bfloat16) / 1e-4 (float32)")
  ap.add_argument("--check-only", action="store_true", help="correctness checks, no timing")
  ap.add_argument("--max-call-s", type=float, default=None,
                  help="do not time an implementation whose checked call took longer than this (seconds): keeps a "
                       "time-limited sweep going past a pathologically slow one (reported as skipped, with the time)")
  ap.add_argument("--out", default="ep_layer.jsonl")
  a = ap.parse_args(argv)
  known = {"ours", "xla_ragged", "tokamax_ragged", "xla_dense_a2a", "serialized", "ideal", "ours_dg"}
  if a.impls and set(a.impls.split(",")) - known:
    ap.error(f"--impls: unknown {sorted(set(a.impls.split(',')) - known)}; known: {sorted(known)}")
  if set(a.passes.split(",")) - {"fwd", "fwd+bwd"}:
    ap.error("--passes: a comma list of fwd, fwd+bwd")
  if a.capacity_factor not in (None, "fit"):
    a.capacity_factor = float(a.capacity_factor)
  return a


COLUMNS = ["shape", "skew", "pass", "impl", "ms", "vs_ours", "a2a_MB", "a2a_GBps", "compute_ms", "comm_ms",
           "dispatch_ms", "overlap_eff", "ours/ideal", "ours/bound", "check"]


@dataclasses.dataclass
class Pass:
  """One pass ("fwd" or "fwd+bwd") of one shape: its rows go to ``table``; ``ms`` keeps what was timed, by impl."""

  table: common.Table
  shape: Shape
  name: str
  a2a_bytes: int          # logical payload of the pass's all-to-alls
  rtol: float
  timing: bool
  max_call_s: float | None = None   # an impl whose checked call took longer is not timed
  ms: dict = dataclasses.field(default_factory=dict)

  def add(self, impl: str, **cells):
    """Adds the row of ``impl``: the shape's cells, a2a_MB, then ``cells``; every other column empty."""
    row = dict.fromkeys(COLUMNS, "")
    row.update(shape=self.shape.name, skew=self.shape.skew, impl=impl, a2a_MB=f"{self.a2a_bytes / 1e6:.4g}")
    row["pass"] = self.name
    row.update(cells)
    self.table.add(**row)

  def measure(self, impl: str, fn, arg_sets, verdict: Verdict, moves_bytes: bool = True,
              a2a_bytes: int | None = None) -> float | None:
    """Times fn over arg_sets unless its check failed (then: excluded) or its checked call was slower than
    max_call_s (then: skipped); adds its row; returns the ms, or None if untimed. ``a2a_bytes``: what fn moves,
    when not the pass's a2a_bytes (the dispatch probe: one of the two transfers)."""
    ok, text, call_s = verdict
    moved = self.a2a_bytes if a2a_bytes is None else a2a_bytes
    a2a = dict(a2a_MB=f"{moved / 1e6:.4g}" if moves_bytes else "")
    if not ok:
      print(f"  {impl}: EXCLUDED from timing, disagrees with the reference ({text}; rtol {self.rtol})")
      self.add(impl, ms="excluded", check=f"FAIL {text}", **a2a)
      return None
    if impl.endswith("[emulated]") or not self.timing:
      self.add(impl, ms="check only", check=f"ok {text}", **a2a)
      return None
    if self.max_call_s and call_s > self.max_call_s:
      text = f"ok {text}; not timed: one call took {call_s:.1f} s (> --max-call-s {self.max_call_s:g})"
      print(f"  {impl}: {text}")
      self.add(impl, ms="skipped", check=text, **a2a)
      return None
    try:
      ms = common.time_fn(fn, arg_sets) * 1e3
    except Exception as e:  # pylint: disable=broad-except  (e.g. out of memory: keep the rest of the sweep)
      text = f"error while timing: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
      print(f"  {impl}: {text}")
      self.add(impl, ms="error", check=text, **a2a)
      return None
    self.ms[impl] = ms
    base = self.ms.get("ours")
    self.add(impl, ms=f"{ms:.3f}", vs_ours=f"{ms / base:.2f}" if base else "", check=f"ok {text}",
             a2a_GBps=f"{moved / ms / 1e6:.4g}" if moves_bytes else "", **a2a)
    return ms


def measure_ideal(p: Pass, mesh, arg_sets, ids_np):
  """The compute_alone, comm_alone, dispatch_alone, ideal and bound rows of pass p (the module docstring says what
  each measures)."""
  want_grads = p.name == "fwd+bwd"
  R = mesh.shape[AXIS]
  prepare, fn = compute_probe(mesh, p.shape, want_grads)
  sets = [prepare(x, ids) + (w1, w2) for x, ids, _, w1, w2, _ in arg_sets]
  compute = p.measure("compute_alone", fn, sets, compute_probe_verdict(fn, sets, ids_np, R, p.shape.experts),
                      moves_bytes=False)
  del sets
  comm_sets = [comm_probe_args(a) for a in arg_sets]
  comm_fn = (grad_fn if want_grads else fwd_fn)(ours_layer(mesh))
  verdict = verdicts(mesh, {"comm": comm_fn}, comm_sets, want_grads, p.rtol)["comm"]
  comm = p.measure("comm_alone", comm_fn, comm_sets,
                   verdict._replace(text=f"{verdict.text} (F={comm_sets[0][4].shape[1]})"))
  del comm_sets
  prepare, fn = dispatch_probe(mesh, p.shape, want_grads)
  sets = [prepare(x, ids) for x, ids, *_ in arg_sets]
  disp = p.measure("dispatch_alone", fn, sets, dispatch_probe_verdict(fn, sets, ids_np, mesh, p.shape),
                   a2a_bytes=p.a2a_bytes // 2)             # the dispatches: half the pass's logical payload
  del sets
  ours, serialized = p.ms.get("ours"), p.ms.get("serialized")
  if compute is None or comm is None:
    p.add("ideal", a2a_MB="", ms="check only" if not p.timing else "not measured",
          check="max(compute_alone, comm_alone): needs both timed")
  else:
    ideal = max(compute, comm)
    p.add("ideal", a2a_MB="", ms=f"{ideal:.3f}", vs_ours=f"{ideal / ours:.2f}" if ours else "",
          compute_ms=f"{compute:.3f}", comm_ms=f"{comm:.3f}",
          overlap_eff=f"{(serialized - ours) / min(compute, comm):.2f}" if ours and serialized else "",
          check=f"max(compute_alone, comm_alone): {'communication' if comm >= compute else 'compute'}-bound",
          **{"ours/ideal": f"{ours / ideal:.2f}" if ours else ""})
  why = "compute_alone + dispatch_alone: the dispatch runs before GEMM1, only the return overlaps"
  if compute is None or disp is None:
    p.add("bound", a2a_MB="", ms="check only" if not p.timing else "not measured", check=f"{why}; needs both timed")
    return
  bound = compute + disp
  p.add("bound", a2a_MB="", ms=f"{bound:.3f}", vs_ours=f"{bound / ours:.2f}" if ours else "",
        compute_ms=f"{compute:.3f}", dispatch_ms=f"{disp:.3f}", check=why,
        **{"ours/bound": f"{ours / bound:.2f}" if ours else ""})


def run(args, *, timing: bool = True, table: common.Table | None = None):
  """Checks (and unless ``timing`` is False, times) every selected shape; returns the Table (``table``, when given:
  its rows so far survive an interruption)."""
  mesh = make_mesh(args.devices)
  R = mesh.shape[AXIS]
  dtype = {"auto": jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16,
           "bfloat16": jnp.bfloat16, "float32": jnp.float32}[args.dtype]
  rtol = args.rtol if args.rtol is not None else (1e-2 if dtype == jnp.bfloat16 else 1e-4)
  itemsize = jnp.dtype(dtype).itemsize
  wanted = set(args.impls.split(",")) | {"ours"} if args.impls else None
  print(f"mesh: {R} x {jax.devices()[0].device_kind} on axis {AXIS!r}; dtype {jnp.dtype(dtype).name}; rtol {rtol}")
  table = table if table is not None else common.Table(COLUMNS)
  for shape in shapes(args.quick):
    if args.tokens_per_rank:
      shape = dataclasses.replace(shape, tokens_per_rank=args.tokens_per_rank)
    if args.shapes and not re.search(args.shapes, f"{shape.name} {shape.skew}"):
      continue
    if shape.experts % R:
      print(f"{shape.name} {shape.skew}: skipped, {shape.experts} experts do not split over {R} ranks")
      continue
    T = shape.tokens_per_rank * R
    sets = [make_inputs(shape, R, dtype, seed, mesh) for seed in range(2)]
    arg_sets, ids_np = [s[0] for s in sets], [s[1] for s in sets]
    impls, sizes = implementations(mesh, ids_np, shape, arg_sets[0], args.capacity_factor, args.ragged_buffer,
                                   itemsize, args.max_dense_gib, args.dispatch_pushers)
    fwd_bytes = 2 * T * shape.k * shape.d * itemsize        # dispatch + return all-to-all, logical payload
    print(f"\n{shape} R={R} T_global={T}: {sizes} (started at {time.strftime('%H:%M:%S')})")
    for pname in args.passes.split(","):
      want_grads = pname == "fwd+bwd"
      # The backward pass has the same two transfers.
      p = Pass(table, shape, pname, fwd_bytes * (2 if want_grads else 1), rtol, timing, args.max_call_s)
      selected = {n: v for n, v in impls.items() if not wanted or n.split("[")[0] in wanted}
      fns = {n: (fwd_fn(f) if not want_grads else grad_fn(f)) for n, (f, _) in selected.items() if f is not None}
      verdict = verdicts(mesh, fns, arg_sets, want_grads, rtol)
      for iname, (f, reason) in selected.items():
        if f is None:
          print(f"  {iname}: {reason}")
          p.add(iname, ms="skipped", check=reason[:120])
        else:
          p.measure(iname, fns[iname], arg_sets, verdict[iname])
      if not wanted or "ideal" in wanted:
        measure_ideal(p, mesh, arg_sets, ids_np)
  return table


def main(argv=None):
  """Runs the sweep; on SIGTERM (``timeout``'s signal in a time-limited device run) it stops and still writes --out
  and prints the table of the rows done so far."""
  args = parse_args(argv)
  with common.rows_kept_on_sigterm(common.Table(COLUMNS), args.out, "bench_ep_layer") as table:
    run(args, timing=not args.check_only, table=table)


if __name__ == "__main__":
  main()
