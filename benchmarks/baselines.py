"""The competitor paths the benchmarks time ours against: plain JAX (and tokamax) implementations of the same
computations, each a function of the arrays ours takes.

One device (EP = 1):
  xla_layer(ragged_dot)    the expert layer as MaxText runs it on GPU: sort slots by expert, grouped GEMM1, SwiGLU,
                           grouped GEMM2, unsort, weighted sum over k; the grouped GEMM is a parameter
                           (jax.lax.ragged_dot, tokamax_ragged_dot(), or a float32 reference's, references.py).
  gemm2_combine(ragged_dot, slot_row)  GEMM2 of rows already in recv order + ``weighted_combine``: the XLA
                           counterpart of expert_combine at EP = 1.
  tokamax_ragged_dot()     tokamax's mosaic grouped GEMM, when tokamax imports.

Expert parallel (a mesh axis ``common.AXIS``, tokens and experts sharded over it):
  ragged_layer             MaxText's GPU path in shard_map: ragged_all_to_all to the owning ranks, local permute,
                           grouped GEMMs, the transposed exchange back, unsort, weighted sum.
  emulated_ragged_all_to_all  ragged_all_to_all from its documented semantics (an all_gather): checks
                           ragged_layer's offsets where the collective does not compile (XLA:CPU).
  dense_a2a_layer          GShard-style capacity-padded all_to_all with batched per-expert GEMMs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from benchmarks.common import AXIS
from jax_moe_overlap.ops import swiglu


def tokamax_ragged_dot():
  """(fn, None) with fn(lhs, rhs, group_sizes) = tokamax.ragged_dot(..., implementation="mosaic") (the best grouped
  GEMM a JAX user has on Hopper, MaxText's GPU choice), or (None, why) when tokamax does not import."""
  try:
    import tokamax  # pylint: disable=g-import-not-at-top
  except Exception as e:  # pylint: disable=broad-except
    return None, f"tokamax unavailable: {type(e).__name__}: {e}"
  return (lambda a, b, g: tokamax.ragged_dot(a, b, g, implementation="mosaic")), None


# ----------------------------------------------------------------------------------------------------------------
# One device


def xla_layer(ragged_dot):
  """The sort -> grouped GEMMs -> unsort path, with a pluggable grouped GEMM: f(x [T, D], ids [T, k], gates [T, k],
  w1 [E, D, 2F], w2 [E, F, D]) -> y [T, D] in x's dtype."""

  def layer(x, ids, gates, w1, w2):
    T, k = ids.shape
    E = w1.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = jnp.take(x, order // k, axis=0)
    gs = jnp.bincount(flat, length=E).astype(jnp.int32)
    h = swiglu(ragged_dot(xs, w1, gs).astype(jnp.float32)).astype(x.dtype)
    out = ragged_dot(h, w2, gs)
    per_slot = jnp.zeros_like(out).at[order].set(out)
    return jnp.einsum("tk,tkd->td", gates.astype(jnp.float32),
                      per_slot.reshape(T, k, -1).astype(jnp.float32)).astype(x.dtype)
  return layer


def weighted_combine(out_rows, slot_row, gates):
  """y[t] = sum_j gates[t, j] * out_rows[slot_row[t*k + j]] in float32, in out_rows' dtype (every slot kept: the
  benchmarks' plans are dropless). out_rows [M, N], slot_row [T*k] int32, gates [T, k] float32 -> y [T, N]."""
  T, k = gates.shape
  per_slot = jnp.take(out_rows, slot_row, axis=0).astype(jnp.float32).reshape(T, k, -1)
  return jnp.einsum("tk,tkd->td", gates, per_slot).astype(out_rows.dtype)


def gemm2_combine(ragged_dot, slot_row):
  """f(h [M, F], w2 [E, F, D], gates [T, k], plan) -> y [T, D]: ``ragged_dot`` on the plan's expert rows, then
  ``weighted_combine`` of slot t*k + j's row ``slot_row[t*k + j]``."""
  return lambda h, w2, g, pl: weighted_combine(ragged_dot(h, w2, pl.expert_rows), slot_row, g)


# ----------------------------------------------------------------------------------------------------------------
# Expert parallel: the ragged_all_to_all path (MaxText's GPU path)
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


def _excl_cumsum(a, axis=-1):
  """Exclusive prefix sum along ``axis``."""
  return jnp.cumsum(a, axis=axis) - a


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
  """ragged_all_to_all written from its documented semantics with an all_gather (slow; for checking offsets).

  Received slices whose recv_sizes disagree with the sender's send_sizes are filled with NaN (integer rows: all bits
  set, which packed e4m3 rows read as NaN values and NaN scales), so that a wrong size computation fails the
  correctness check instead of passing silently.
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
  poison = (jnp.array(jnp.nan, output.dtype) if jnp.issubdtype(output.dtype, jnp.inexact)
            else jnp.array(jnp.iinfo(output.dtype).max if jnp.issubdtype(output.dtype, jnp.unsignedinteger) else -1,
                           output.dtype))
  for s in range(R):
    for j in range(spd):
      i = me * spd + j                                               # the sender's slice index that comes to me
      src_off, size, dst_off = io[s, i], ss[s, i], oo[s, i]
      n = recv_sizes[s * spd + j]
      seg = (rows >= dst_off) & (rows < dst_off + n)
      src = jnp.clip(src_off + rows - dst_off, 0, operand.shape[0] - 1)
      val = jnp.where(n == size, ops[s][src].astype(output.dtype), poison)
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
# Expert parallel: the capacity-padded all_to_all path (GShard style)


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


def dense_bytes_per_rank(shape, R: int, C: int, itemsize: int) -> int:
  """Rough peak of the padded path's per-rank buffers (send, recv, GEMM1 fp32 out, h, out, back) for a shape with
  fields experts, d and f."""
  rows = shape.experts * C                       # R * E_local * C
  return rows * (4 * shape.d * itemsize + 2 * shape.f * 4 + shape.f * itemsize)

