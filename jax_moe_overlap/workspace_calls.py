"""The workspace's custom calls, one wrapper each. They run *per rank*, inside ``shard_map`` over the expert-parallel
axis, and take a ``call_site.RankInfo`` (the workspace, the ``CallConfig``, what is decided once for them).

* ``gather_counts(counts, info)``: every rank's routing counts for the plan: ``jax.lax.all_gather``, or where the
  workspace's groups span processes the custom call ``exchange_counts`` through the workspace, whose waits are
  bounded like the others'.
* ``dispatch(src, slot_src_row, plan, ...)``: rows ``src[slot_src_row[p]]`` go to ``plan.slot_dest_rank[p]``'s recv
  rows; returns this rank's recv rows ``[cap, D]`` (rows past ``plan.recv_rows`` are zero). With ``send_once`` a
  token's row crosses to each rank once and the receiver fills its other slots' rows from it. The rows are moved as
  bytes: float32, bfloat16, or packed e4m3 rows (uint8, ``fp8.pack_rows``). ``dispatch_rows``: the same call on any
  routing (the FP8 layer's way back where the call site does not fuse it, ``fp8_overlap.py``).
* ``dispatch_gemm(src, slot_src_row, w, plan, ...)``: the dispatch and the GEMM after it in one call, each GEMM tile
  starting once its rows have arrived. ``dispatch_gemm_fp8``: the same call on packed e4m3 rows with the FP8 grouped
  GEMM (the rows read where they land, values and scales).
* ``expert_combine(lhs, w, gates, plan, ...)``: the overlapped operator. The producer computes
  ``lhs[segment] @ w[expert]`` per (local expert, source rank) segment, remote-critical segments first, flagging each
  finished band; the consumer ships each band back to its source rank; the source combines
  ``y[t] = sum_j gates[t, j] * out[slot(t, j)]`` in the fixed order ``j = 0..k-1``. Returns ``y [T, N]`` and, when
  asked, the per-slot outputs ``[T*k, N]`` (for the gates' gradient). ``expert_combine_fp8``: the same call with the
  FP8 grouped GEMM as its producer (e4m3 lhs and weights with their scales).
* ``gather_rs(lhs, w, row_gate, token_rows, plan, ...)``: GEMM2 + GatherRS. The producer as expert_combine's; the
  consumer sums each source's tokens' gated rows here (the top-k gather-reduce) into a dense float32 partial and
  ships it to the source; each rank sums the group's partials of its tokens in rank order. Returns ``y [T, N]`` and,
  when asked, the GEMM's rows ``[cap, N]`` (for the gates' gradient).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_overlap import _ffi
from jax_moe_overlap import fp8
from jax_moe_overlap.call_site import RankInfo
from jax_moe_overlap.grouped_gemm import check_fp8_operands, check_preactivation_dtype, check_result_dtype
from jax_moe_overlap.grouped_gemm import fp8_row_operands
from jax_moe_overlap.ordering import workspace_call
from jax_moe_overlap.plan import Plan


def _workspace_call(info: RankInfo, target: str, out_types, *args, **attrs):
  """One call on the workspace. On CPU an ordered effect (ordering.py): XLA:CPU would otherwise start two workspace
  calls with no data between them in any order, per rank. On CUDA a plain custom call: XLA:GPU runs the calls on one
  stream in program order.

  Not ``has_side_effect=True`` on CUDA: that gives the call an effect, and any effect in a program turns off JAX's
  C++ dispatch fast path (pjit ``_get_fastpath_data``), so every call of the jitted function would go through Python
  dispatch, whose host time exceeds the fused kernels' device time (docs/design.md, "Effect-free custom calls on
  GPU"). What the flag would add is not needed: every rank runs the same compiled program, so if XLA removes a call
  whose outputs are unused, or merges two identical calls, it does so on every rank alike and the ranks' call
  sequences still match (the protocol needs only that)."""
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
                         counts.astype(jnp.int32), group, rank, **info.attrs())


def _computed_rows(op: str, name: str, a: jax.Array) -> None:
  """A call that computes on its rows (a GEMM's operands) takes float32 or bfloat16 ones: packed e4m3 rows (uint8)
  are taken by ``dispatch`` (moved) and ``dispatch_gemm_fp8`` (read where they land) only, refused here before a
  call is traced (the handlers refuse them too)."""
  if a.dtype == jnp.uint8:
    raise TypeError(f"jax_moe_overlap: {op}: {name} is uint8 (packed e4m3 rows, fp8.pack_rows): {op}'s GEMM takes "
                    f"float32 or bfloat16 rows, or float8_e4m3fn values with their scales apart (grouped_matmul_fp8, "
                    f"expert_combine_fp8); packed rows are taken by dispatch and dispatch_gemm_fp8 only")


def slot_primary(plan: Plan, send_once: bool) -> jax.Array:
  """The dispatch's slot_primary operand: the plan's (a row crosses to each rank once: ``slot_src_row`` must give
  every slot of a token the same source row, as the forward's token rows do) or [0] (one row per slot)."""
  return plan.slot_primary if send_once else jnp.zeros((0,), jnp.int32)


def dispatch(src: jax.Array, slot_src_row: jax.Array, plan: Plan, cap: int, info: RankInfo, *,
             send_once: bool = False, row_scale: jax.Array | None = None) -> jax.Array:
  """[S, D] rows -> [cap, D] recv rows of this rank (grouped by (local expert, source rank)). send_once: a token's
  row crosses to each other rank once (``slot_primary``); the result is the same.

  src: float32 or bfloat16 rows, or uint8 rows of packed e4m3 (``fp8.pack_rows``: D channels as D + D / 32 bytes,
  D a multiple of 128), moved unchanged. row_scale: [P] float32, slot p's row lands as ``(row_scale[p] *
  src[slot_src_row[p]].astype(float32)).astype(src.dtype)`` (float32 or bfloat16 rows, not with send_once): the
  rows of ``row_scale[:, None] * src[slot_src_row]`` without that [P, D] array."""
  return dispatch_rows(src, slot_src_row, plan.slot_dest_rank, plan.slot_dest_row, plan.recv_rows, cap, info,
                       slot_primary(plan, send_once), row_scale)


def dispatch_rows(src: jax.Array, src_row: jax.Array, dest_rank: jax.Array, dest_row: jax.Array, expected: jax.Array,
                  cap: int, info: RankInfo, primary: jax.Array | None = None,
                  row_scale: jax.Array | None = None) -> jax.Array:
  """The dispatch custom call on any routing of rows: row ``src[src_row[p]]`` to row ``dest_row[p]`` of rank
  ``dest_rank[p]`` (-1: not moved), for every p; returns this rank's [cap, C] rows, the first ``expected`` (the rows
  sent to it, [] int32) as they landed and zero past them. The destination rows of a rank must be 0 .. expected - 1,
  each once. ``dispatch`` is it on a plan's slots; the way back of expert rows to their slots' owners is it on
  ``plan.packed_return``'s routing. primary: ``slot_primary`` (send once) or None. row_scale: as ``dispatch``'s."""
  _ffi.register()
  group, rank = info.coords()
  primary = jnp.zeros((0,), jnp.int32) if primary is None else primary
  row_scale = _row_scale_operand("dispatch", src, src_row, primary, row_scale)
  return _workspace_call(info, _ffi.DISPATCH, jax.ShapeDtypeStruct((cap, src.shape[1]), src.dtype),
                         src, src_row.astype(jnp.int32), dest_rank, dest_row, expected, primary, row_scale, group,
                         rank, **info.attrs())


def _row_scale_operand(op: str, src: jax.Array, src_row: jax.Array, primary: jax.Array,
                       row_scale: jax.Array | None) -> jax.Array:
  """The dispatch rows' row_scale operand: [P] float32, or [0] for rows moved unchanged; refused (ValueError) for
  rows other than float32 or bfloat16, rows sent once (``primary`` [P]) and a count other than the slots'."""
  if row_scale is None:
    return jnp.zeros((0,), jnp.float32)
  sends_once = primary.shape[0] > 0
  if src.dtype not in (jnp.float32, jnp.bfloat16) or sends_once:
    raise ValueError(f"jax_moe_overlap: {op}: row_scale scales float32 or bfloat16 rows, each slot's own (not sent "
                     f"once); got {src.dtype} rows{' sent once' if sends_once else ''}")
  if row_scale.shape != src_row.shape:
    raise ValueError(f"jax_moe_overlap: {op}: row_scale {row_scale.shape} must have one scale per slot "
                     f"{src_row.shape}")
  return row_scale.astype(jnp.float32)


def dispatch_gemm(src: jax.Array, slot_src_row: jax.Array, w: jax.Array, plan: Plan, cap: int, info: RankInfo, *,
                  transpose_rhs: bool = False, swiglu: bool = False, keep_recv: bool = True,
                  keep_a: bool = False, a_dtype=jnp.float32, out_dtype=jnp.float32,
                  send_once: bool = False,
                  row_scale: jax.Array | None = None) -> tuple[jax.Array | None, jax.Array, jax.Array | None]:
  """dispatch and GEMM1 in one call, each GEMM tile starting once the 128-row blocks holding its rows are in.

  Args:
    src: [S, D] rows, float32 or bfloat16; slot_src_row, plan, cap, info: as ``dispatch``.
    w: [E_local, D, N] in src's dtype, or [E_local, N, D] read transposed with ``transpose_rhs``.
    swiglu: GEMM1 of the expert MLP (w [E_local, D, 2F], not with ``transpose_rhs``): the call's epilogue applies the
      SwiGLU in float32 to the float32 preactivation.
    keep_recv: also return the recv rows (the backward pass reads them; the inference forward does not).
    keep_a: with ``swiglu``, also return the preactivation (for the backward pass). a_dtype: its dtype, float32 or
      src's (the float32 values rounded once; h is computed from the float32 values either way).
    out_dtype: without ``swiglu``, out's dtype: float32 or src's (the float32 product rounded once, as
      ``grouped_matmul``'s with that ``preferred_element_type``).
    send_once: as ``dispatch``'s (the receiver fills a token's other rows before the GEMM tiles that read them).
    row_scale: as ``dispatch``'s: the recv rows (x_recv, and GEMM1's A) are the scaled rows.
  Returns:
    (x_recv [cap, D] as ``dispatch`` returns it, or None unless keep_recv; out; a or None), where without swiglu
    out = [cap, N] in out_dtype, the recv rows of each (expert, source) segment @ w[expert], and a is None; with swiglu
    out = h [cap, F] in src's dtype = silu(a[:, :F]) * a[:, F:] of a = [cap, 2F] float32, the rows' product with
    w[expert], and a is returned (in a_dtype) when keep_a. In the kept rows (the first ``plan.recv_rows``) the
    results equal ``dispatch`` followed by ``grouped_matmul`` (out_dtype output) or ``grouped_matmul_swiglu`` bit for
    bit; the rows past them are unspecified (left unwritten, where those calls zero them): no consumer of the layer
    reads them (docs/design.md, "Padding rows").
  On CUDA (Hopper, bfloat16) ``info.dispatch_pushers`` CTAs (at least one) push the rows for other ranks, then
  copy x_recv beside the GEMM, then join it; on CPU (float32 or bfloat16) the handler thread pushes, then computes
  with the bare grouped GEMMs' CPU numerics.
  """
  _computed_rows("dispatch_gemm", "src", src)
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
  a_dtype = check_preactivation_dtype("dispatch_gemm", src, a_dtype) if keep_a else jnp.float32
  if swiglu and jnp.dtype(out_dtype) != jnp.float32:
    raise ValueError("jax_moe_overlap: dispatch_gemm: out_dtype is the plain product's; with swiglu out is h in src's "
                     "dtype")
  out_dtype = check_result_dtype("dispatch_gemm", "out_dtype", src, out_dtype)
  D, N = src.shape[1], (w.shape[1] if transpose_rhs else w.shape[2])
  out = jax.ShapeDtypeStruct((cap, N // 2), src.dtype) if swiglu else jax.ShapeDtypeStruct((cap, N), out_dtype)
  out_types = (jax.ShapeDtypeStruct((cap if keep_recv else 0, D), src.dtype), out,
               jax.ShapeDtypeStruct((cap if keep_a else 0, N), a_dtype))
  x_recv, out, a = _dispatch_gemm_call(src, slot_src_row, w, plan, info, out_types, transpose_rhs, swiglu,
                                       send_once, row_scale=row_scale)
  return (x_recv if keep_recv else None), out, (a if keep_a else None)


def _dispatch_gemm_call(src, slot_src_row, w, plan: Plan, info: RankInfo, out_types, transpose_rhs: bool,
                        swiglu: bool, send_once: bool = False, w_scales=None, scale_types=None, row_scale=None):
  """The custom call of ``dispatch_gemm`` with the result types as given (x_recv, out, a; and for the FP8 form
  scale_types, h_scales and a_scales): unchecked here, so that the tests reach the handlers' own shape checks.
  Returns (x_recv, out, a), with scale_types (x_recv, out, a, h_scales, a_scales)."""
  _ffi.register()
  group, rank = info.coords()
  none = jnp.zeros((0,), jnp.float32)  # (the FP8 form's scales, empty for float rows)
  empty = jax.ShapeDtypeStruct((0,), jnp.float32)
  primary = slot_primary(plan, send_once)
  results = _workspace_call(info, _ffi.DISPATCH_GEMM, (*out_types, *(scale_types or (empty, empty))), src,
                            slot_src_row.astype(jnp.int32), plan.slot_dest_rank, plan.slot_dest_row, plan.recv_rows,
                            primary, _row_scale_operand("dispatch_gemm", src, slot_src_row, primary, row_scale),
                            plan.send_order, plan.send_start, plan.seg_rows,
                            plan.seg_ret_off, w, none if w_scales is None else w_scales, group, rank,
                            transpose_rhs=np.bool_(transpose_rhs), swiglu=np.bool_(swiglu), **info.attrs())
  return tuple(results) if scale_types is not None else tuple(results[:3])


def dispatch_gemm_fp8(src: jax.Array, slot_src_row: jax.Array, w: fp8.Fp8Weight, plan: Plan, cap: int,
                      info: RankInfo, *, swiglu: bool = False, keep_recv: bool = True, keep_a: bool = False,
                      send_once: bool = False):
  """``dispatch_gemm`` on packed e4m3 rows: the rows dispatched as they are (``fp8.pack_rows``' bytes) and GEMM1 the
  FP8 grouped GEMM's (DeepSeek-V3's block-scaled e4m3 GEMM), each tile reading its rows' values and scales where they
  landed, no unpacking.

  Args:
    src: [S, D + D/32] uint8, quantized rows packed (``fp8.pack_rows(q, s)``: D e4m3 values, then the D/128 float32
      scales of their 1 x 128 tiles); slot_src_row, plan, cap, info, send_once: as ``dispatch``'s.
    w: an ``fp8.Fp8Weight`` of this rank's experts in its forward layout (values [E_local, N, D] float8_e4m3fn,
      scales [E_local, N/128, D/128]); D and N multiples of 128.
    swiglu: GEMM1 of the expert MLP (N = 2F, F a multiple of 128: the gate's F rows of w, then the up projection's):
      the recipe's SwiGLU forward in the call's epilogue, as ``grouped_matmul_swiglu_fp8``.
    keep_recv: also return the recv rows (packed; the weight gradient reads them). keep_a: with swiglu, also return
      a quantized (what the recipe's backward keeps).
  Returns:
    (x_recv [cap, D + D/32] uint8 or None, out, a or None): without swiglu out = [cap, N] float32, the rows' product
    with w[expert] (``grouped_matmul_fp8`` of the unpacked rows); with swiglu out = (h_q [cap, F] float8_e4m3fn,
    h_s [cap, F/128] float32) and a = (a_q [cap, 2F], a_s [cap, 2F/128]) as ``grouped_matmul_swiglu_fp8`` gives
    them. In the kept rows (the first ``plan.recv_rows``) bit for bit ``dispatch`` + ``fp8.unpack_rows`` + those
    calls (on CUDA to the FP8 GEMM's accumulation, the same kernel loop); the rows past them are unspecified, as
    ``dispatch_gemm``'s. The CPU handler, and on Hopper the CUDA kernel (D a multiple of 512: the rows' stride as
    TMA reads them); elsewhere the call fails naming the requirement.
  """
  name = "dispatch_gemm_fp8"
  if not isinstance(w, fp8.Fp8Weight):
    raise TypeError(f"jax_moe_overlap: {name}: w must be an fp8.Fp8Weight (fp8.quantize_weight: values [E_local, N, "
                    f"D] float8_e4m3fn and their block scales), got {type(w).__name__}")
  values, scales = w.values, w.scales.astype(jnp.float32)
  if src.dtype != jnp.uint8 or src.ndim != 2:
    raise TypeError(f"jax_moe_overlap: {name}: src must be [S, D + D/32] uint8 packed e4m3 rows (fp8.pack_rows), got "
                    f"{src.dtype} {src.shape}")
  if values.dtype != fp8.E4M3 or values.ndim != 3:
    raise TypeError(f"jax_moe_overlap: {name}: w must be an fp8.Fp8Weight (values [E_local, N, D] float8_e4m3fn), "
                    f"got values {values.dtype} {values.shape}")
  _, N, D = values.shape
  if D % fp8.TILE or N % fp8.TILE or (swiglu and N % (2 * fp8.TILE)) or src.shape[1] != D + D // 32:
    raise ValueError(f"jax_moe_overlap: {name}: src {src.shape} and w {values.shape} do not fit src [S, D + D/32], w "
                     f"[E_local, N, D] with D and N multiples of 128 (with swiglu N = 2F, F a multiple of 128)")
  if keep_a and not swiglu:
    raise ValueError(f"jax_moe_overlap: {name}: keep_a keeps the SwiGLU's preactivation (keep_a needs swiglu=True)")
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  e4m3 = lambda *s: jax.ShapeDtypeStruct(s, fp8.E4M3)
  a_rows = cap if keep_a else 0
  x_type = jax.ShapeDtypeStruct((cap if keep_recv else 0, src.shape[1]), jnp.uint8)
  if swiglu:
    out_types, scale_types = (x_type, e4m3(cap, N // 2), e4m3(a_rows, N)), (f32(cap, N // 2 // fp8.TILE),
                                                                            f32(a_rows, N // fp8.TILE))
  else:
    out_types, scale_types = (x_type, f32(cap, N), f32(0, N)), (f32(0), f32(0))
  x_recv, out, a, h_s, a_s = _dispatch_gemm_call(src, slot_src_row, values, plan, info, out_types, True, swiglu,
                                                 send_once, scales, scale_types)
  x_recv = x_recv if keep_recv else None
  if not swiglu:
    return x_recv, out, None
  return x_recv, (out, h_s), ((a, a_s) if keep_a else None)


def expert_combine(lhs: jax.Array, w: jax.Array, gates: jax.Array, plan: Plan, info: RankInfo,
                   want_slots: bool, transpose_rhs: bool = False) -> tuple[jax.Array, jax.Array]:
  """lhs [cap, K], w [E_local, K, N], gates [T, k] float32 -> (y [T, N], slot_out [T*k or 0, N]).

  lhs, w and the outputs share one dtype (float32 or bfloat16); accumulation is float32. With ``transpose_rhs``, w is
  [E_local, N, K] and the producer reads ``w[e].T`` in place (the input gradient ``da @ W1^T`` of the backward pass
  without a transposed copy of W1), as ``grouped_matmul``'s ``transpose_rhs``.
  """
  _computed_rows("expert_combine", "lhs", lhs)
  _ffi.register()
  K, N = (w.shape[2], w.shape[1]) if transpose_rhs else (w.shape[1], w.shape[2])
  if lhs.ndim != 2 or w.ndim != 3 or lhs.shape[1] != K:
    raise ValueError(f"jax_moe_overlap: expert_combine: lhs {lhs.shape} and w {w.shape}"
                     f"{' (transpose_rhs)' if transpose_rhs else ''} do not fit lhs [cap, K], "
                     f"w {'[E_local, N, K]' if transpose_rhs else '[E_local, K, N]'}")
  none = jnp.zeros((0,), jnp.float32)  # (the e4m3 operands' scales)
  return _expert_combine_call(lhs, w, none, none, gates, plan, info, want_slots, transpose_rhs, lhs.dtype, N)


def _expert_combine_call(lhs, w, lhs_scales, w_scales, gates, plan, info, want_slots, transpose_rhs, out_dtype, N):
  group, rank = info.coords()
  T, k = gates.shape
  out_types = (jax.ShapeDtypeStruct((T, N), out_dtype),
               jax.ShapeDtypeStruct((T * k if want_slots else 0, N), out_dtype))
  return _workspace_call(info, _ffi.EXPERT_COMBINE, out_types, lhs, w, lhs_scales, w_scales,
                         gates.astype(jnp.float32), plan.seg_rows, plan.seg_ret_off, plan.slot_ret_row, plan.ret_rows,
                         group, rank, transpose_rhs=np.bool_(transpose_rhs), **info.attrs())


def expert_combine_fp8(lhs_q: jax.Array, lhs_s: jax.Array, w: fp8.Fp8Weight, gates: jax.Array, plan: Plan,
                       info: RankInfo, want_slots: bool, preferred_element_type) -> tuple[jax.Array, jax.Array]:
  """``expert_combine`` with the FP8 producer: the GEMM of the overlapped operator is ``grouped_matmul_fp8``'s
  (DeepSeek-V3's block-scaled e4m3 GEMM, each 128-wide K chunk promoted to float32), its rows rounded to
  ``preferred_element_type``, returned and combined as ``expert_combine``'s in that dtype.

  lhs_q [cap, K] float8_e4m3fn and lhs_s [cap, K/128] float32 (``fp8.quantize_rows``' layout; the call reads them
  MN-major, transposed here as ``grouped_matmul_fp8`` does), w an ``fp8.Fp8Weight`` of this rank's experts (values
  [E_local, N, K], scales [E_local, N/128, K/128]: its forward layout), gates [T, k] float32, preferred_element_type
  float32 or bfloat16 -> (y [T, N], slot_out [T*k or 0, N]) in that dtype. K and N multiples of 128: the operand
  rules of ``grouped_matmul_fp8`` (its groups here the plan's segments). The CPU handler and, on Hopper, the CUDA
  kernels; another GPU fails the call naming the requirement."""
  name = "expert_combine_fp8"
  lhs_s, scales = lhs_s.astype(jnp.float32), w.scales.astype(jnp.float32)
  out_dtype = check_fp8_operands(name, lhs_q, lhs_s, w.values, scales, None, preferred_element_type)
  _, N, scales_mn = fp8_row_operands(name, lhs_q, lhs_s, w.values, scales)
  return _expert_combine_call(lhs_q, w.values, scales_mn, scales, gates, plan, info, want_slots, True, out_dtype, N)


def gather_rs(lhs: jax.Array, w: jax.Array, row_gate: jax.Array, token_rows: jax.Array, plan: Plan, info: RankInfo,
              want_rows: bool, transpose_rhs: bool = False) -> tuple[jax.Array, jax.Array]:
  """lhs [cap, K], w [E_local, K, N] (or [E_local, N, K] with ``transpose_rhs``), row_gate [cap] float32 (the gate of
  each recv row), token_rows [R, T, Q] int32 (the recv row of slot q of source s's token t here, -1: none) ->
  (y [T, N], rows [cap or 0, N]), all in lhs's dtype but row_gate.

  y[t] = sum over the group's ranks g in order 0, 1, ..., R - 1 of g's partial sum_q row_gate[i] * (lhs[i] @
  w[expert of i]) for i = g's token_rows[this rank, t, q], each partial float32, the GEMM's rows rounded to lhs's
  dtype first (as expert_combine's). ``want_rows``: also the GEMM's rows (recv rows outside the segments zero)."""
  _computed_rows("gather_rs", "lhs", lhs)
  _ffi.register()
  group, rank = info.coords()
  K, N = (w.shape[2], w.shape[1]) if transpose_rhs else (w.shape[1], w.shape[2])
  if lhs.ndim != 2 or w.ndim != 3 or lhs.shape[1] != K or token_rows.ndim != 3:
    raise ValueError(f"jax_moe_overlap: gather_rs: lhs {lhs.shape}, w {w.shape} and token_rows {token_rows.shape} do "
                     f"not fit lhs [cap, K], w {'[E_local, N, K]' if transpose_rhs else '[E_local, K, N]'}, "
                     "token_rows [R, T, Q]")
  cap, T = lhs.shape[0], token_rows.shape[1]
  out_types = (jax.ShapeDtypeStruct((T, N), lhs.dtype), jax.ShapeDtypeStruct((cap if want_rows else 0, N), lhs.dtype))
  return _workspace_call(info, _ffi.GATHER_RS, out_types, lhs, w, row_gate.astype(jnp.float32),
                         token_rows.astype(jnp.int32), plan.seg_rows, plan.seg_ret_off, group, rank,
                         transpose_rhs=np.bool_(transpose_rhs), **info.attrs())
