"""Bare grouped GEMMs as custom calls (no peers, no workspace): the expert GEMMs that do not feed the return
all-to-all, i.e. GEMM1 of the forward pass and the GEMMs of the backward pass.

XLA's own ``jax.lax.ragged_dot`` runs as dense-masked work on GPU (every group pays for all rows: docs/performance.md
has its TFLOP/s on an H200); these calls run the tile engine of ``expert_combine``'s producer over the routed
rows only. On CPU they run reference loops (the specification the CUDA kernels are tested against).

Groups are consecutive row blocks of ``lhs`` starting at row 0, ``group_sizes[g]`` rows each, as in
``jax.lax.ragged_dot``; group sizes are device data (no host synchronization). Sizes must be >= 0 and sum to at
most the row count: the CPU handler raises otherwise; the CUDA kernels clip (they cannot raise without a sync).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe_overlap import _ffi
from jax_moe_overlap import engines
from jax_moe_overlap import fp8

GROUPED_MATMUL = "jmo_grouped_matmul"
GROUPED_OUTER = "jmo_grouped_outer"
GROUPED_MATMUL_SWIGLU = "jmo_grouped_matmul_swiglu"
GROUPED_MATMUL_SWIGLU_GRAD = "jmo_grouped_matmul_swiglu_grad"
GROUPED_MATMUL_FP8 = "jmo_grouped_matmul_fp8"
GROUPED_MATMUL_SWIGLU_FP8 = "jmo_grouped_matmul_swiglu_fp8"
GROUPED_OUTER_FP8 = "jmo_grouped_outer_fp8"
QUANTIZE_COLUMNS_FP8 = "jmo_quantize_columns_fp8"
QUANTIZE_WEIGHT_FP8 = "jmo_quantize_weight_fp8"
SWIGLU_BACKWARD_FP8 = "jmo_swiglu_backward_fp8"
SWIGLU_FORWARD_FP8 = "jmo_swiglu_forward_fp8"

# quantize_columns_fp8 on row-quantized x: C a multiple of this (ffi/common/fp8_columns.h, kRowsE4m3Channels).
ROWS_E4M3_CHANNELS = 256


def check_result_dtype(name: str, what: str, lhs: jax.Array, dtype):
  """The dtype of a result that a kernel stores from its float32 values: float32, or lhs's (those values rounded
  once), else a TypeError naming the rule (`what`: the argument, in the call `name`)."""
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.dtype(jnp.float32), lhs.dtype):
    raise TypeError(f"jax_moe_overlap: {name}: {what} must be float32 or the operands' dtype {lhs.dtype}, got {dtype}")
  return dtype


def _check_operands(name, lhs, rhs, group_sizes):
  if lhs.dtype not in (jnp.float32, jnp.bfloat16) or rhs.dtype != lhs.dtype:
    raise TypeError(f"jax_moe_overlap: {name}: lhs and rhs must share a dtype, float32 or bfloat16; got "
                    f"{lhs.dtype} and {rhs.dtype}")
  if group_sizes is not None and (group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer)):
    raise TypeError(f"jax_moe_overlap: {name}: group_sizes must be a 1-D integer array, got {group_sizes.dtype}"
                    f"{list(group_sizes.shape)}")


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, transpose_rhs: bool = False,
                   preferred_element_type=None) -> jax.Array:
  """``out[r] = lhs[r] @ rhs[g]`` for the rows ``r`` of group ``g``; rows past the last group are zero.

  Args:
    lhs: [M, K]. rhs: [G, K, N], or [G, N, K] with ``transpose_rhs`` (then ``rhs[g].T`` is used: the input gradient
      ``dy @ W^T`` without materializing ``W^T``). group_sizes: [G] integer rows per group.
    preferred_element_type: float32 or None (the operands' dtype). Accumulation is float32 either way.
  Returns:
    [M, N].
  """
  _check_operands("grouped_matmul", lhs, rhs, group_sizes)
  G = rhs.shape[0]
  K, N = (rhs.shape[2], rhs.shape[1]) if transpose_rhs else (rhs.shape[1], rhs.shape[2])
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != K or group_sizes.shape != (G,):
    raise ValueError(f"jax_moe_overlap: grouped_matmul: lhs {lhs.shape}, rhs {rhs.shape}"
                     f"{' (transposed)' if transpose_rhs else ''} and group_sizes {group_sizes.shape} do not fit "
                     f"lhs [M, K], rhs [G, K, N], group_sizes [G]")
  _ffi.register()
  out_dtype = check_result_dtype("grouped_matmul", "preferred_element_type", lhs, preferred_element_type or lhs.dtype)
  out = jax.ShapeDtypeStruct((lhs.shape[0], N), out_dtype)
  return jax.ffi.ffi_call(GROUPED_MATMUL, out, vmap_method="sequential")(lhs, rhs, group_sizes.astype(jnp.int32),
                                               transpose_rhs=bool(transpose_rhs))


def grouped_outer(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, preferred_element_type=None) -> jax.Array:
  """``out[g] = lhs[rows of g].T @ rhs[rows of g]`` (the weight gradient of a grouped matmul); zero for empty groups.

  Args:
    lhs: [M, K]. rhs: [M, N]. group_sizes: [G] integer rows per group.
  Returns:
    [G, K, N] in float32 or the operands' dtype (``preferred_element_type``).
  """
  _check_operands("grouped_outer", lhs, rhs, group_sizes)
  if lhs.ndim != 2 or rhs.ndim != 2 or rhs.shape[0] != lhs.shape[0]:
    raise ValueError(f"jax_moe_overlap: grouped_outer: lhs {lhs.shape} and rhs {rhs.shape} must be [M, K] and [M, N]")
  _ffi.register()
  out_dtype = check_result_dtype("grouped_outer", "preferred_element_type", lhs, preferred_element_type or lhs.dtype)
  out = jax.ShapeDtypeStruct((group_sizes.shape[0], lhs.shape[1], rhs.shape[1]), out_dtype)
  return jax.ffi.ffi_call(GROUPED_OUTER, out, vmap_method="sequential")(lhs, rhs, group_sizes.astype(jnp.int32))


def check_preactivation_dtype(name: str, lhs: jax.Array, dtype):
  """The kept preactivation's dtype: float32 or lhs's, else a TypeError naming the rule."""
  return check_result_dtype(name, "the preactivation's dtype", lhs, dtype)


def grouped_matmul_swiglu(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, keep_preactivation: bool,
                          preactivation_dtype=jnp.float32) -> tuple[jax.Array, jax.Array | None]:
  """GEMM1 of the expert MLP with its SwiGLU: ``a = lhs[r] @ rhs[g]`` in float32 for the rows ``r`` of group ``g``,
  ``h = silu(a[:, :F]) * a[:, F:]`` in float32, rounded to lhs's dtype; rows past the last group are zero.

  Where the wgmma engine runs and takes the operands (``engines.swiglu_fused``: a Hopper GPU, bfloat16, K a multiple
  of 64, F of 32) one kernel applies the SwiGLU to the GEMM's accumulators, so ``a`` is written only when it is kept (the backward pass needs it); elsewhere on GPU the grouped
  GEMM writes ``a`` and a second kernel reads it. On CPU a reference loop.

  Args:
    lhs: [M, K]. rhs: [G, K, 2F] (the gate's columns, then the up projection's). group_sizes: [G] integer rows per
      group. keep_preactivation: also return ``a``. preactivation_dtype: the returned a's dtype, float32 or lhs's
      (the float32 values rounded once; h is computed from the float32 values either way).
  Returns:
    (h [M, F] in lhs's dtype, a [M, 2F] in preactivation_dtype, or None).
  """
  _check_operands("grouped_matmul_swiglu", lhs, rhs, group_sizes)
  G = rhs.shape[0]
  if (lhs.ndim != 2 or rhs.ndim != 3 or rhs.shape[1] != lhs.shape[1] or rhs.shape[2] % 2 or
      group_sizes.shape != (G,)):
    raise ValueError(f"jax_moe_overlap: grouped_matmul_swiglu: lhs {lhs.shape}, rhs {rhs.shape} and group_sizes "
                     f"{group_sizes.shape} do not fit lhs [M, K], rhs [G, K, 2F], group_sizes [G]")
  a_dtype = check_preactivation_dtype("grouped_matmul_swiglu", lhs, preactivation_dtype)
  _ffi.register()
  M, K, F = lhs.shape[0], lhs.shape[1], rhs.shape[2] // 2
  fused = engines.swiglu_fused(lhs.dtype == jnp.bfloat16, K, F)
  # Where the fused kernel does not run, a is the first kernel's output: it is always written there, in float32 (the
  # CUDA kernels round it to a narrower dtype only in the fused epilogue; XLA rounds it here otherwise: the same bits).
  a_rows = M if keep_preactivation or not fused else 0
  call_a_dtype = a_dtype if keep_preactivation and fused else jnp.float32
  out = (jax.ShapeDtypeStruct((M, F), lhs.dtype), jax.ShapeDtypeStruct((a_rows, 2 * F), call_a_dtype))
  h, a = jax.ffi.ffi_call(GROUPED_MATMUL_SWIGLU, out, vmap_method="sequential")(lhs, rhs,
                                                                               group_sizes.astype(jnp.int32))
  return h, (a.astype(a_dtype) if keep_preactivation else None)


def grouped_matmul_swiglu_grad(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, a: jax.Array, *,
                               transpose_rhs: bool = False) -> jax.Array:
  """The backward GEMM of the expert MLP with the SwiGLU's gradient: ``dh = lhs[r] @ rhs[g]`` in float32 for the rows
  ``r`` of group ``g`` (not returned), then ``da``, the input gradient of ``silu(a[:, :F]) * a[:, F:]`` at ``dh``,
  rounded to lhs's dtype; rows past the last group are zero.

  The expressions are those of ``jax.vjp`` of that SwiGLU in float32, grouped the same way (docs/design.md, "The
  backward pass"). On GPU only where an engine has this epilogue for the operands (``engines.swiglu_grad_fused``: the
  wgmma engine, a Hopper GPU, bfloat16, K and F multiples of 64): one kernel computes dh tile by tile in registers and
  writes da, never dh; elsewhere on GPU the call fails naming the rule (the callers ask first and run
  ``grouped_matmul`` and the gradient apart). On CPU a reference loop.

  Args:
    lhs: [M, K] (the output gradient of GEMM2, d_out). rhs: [G, K, F], or [G, F, K] with ``transpose_rhs`` (W2
      [G, F, K] read transposed: dh = d_out W2^T). group_sizes: [G] integer rows per group. a: [M, 2F] float32 or
      lhs's dtype, GEMM1's preactivation (the gate's F columns, then the up projection's), taken to float32.
  Returns:
    da [M, 2F] in lhs's dtype (d_gate, then d_up).
  """
  _check_operands("grouped_matmul_swiglu_grad", lhs, rhs, group_sizes)
  G = rhs.shape[0]
  if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.shape != (G,):
    raise ValueError(f"jax_moe_overlap: grouped_matmul_swiglu_grad: lhs {lhs.shape}, rhs {rhs.shape} and group_sizes "
                     f"{group_sizes.shape} do not fit lhs [M, K], rhs [G, K, F] (or [G, F, K] transposed), "
                     "group_sizes [G]")
  M = lhs.shape[0]
  K, F = (rhs.shape[2], rhs.shape[1]) if transpose_rhs else (rhs.shape[1], rhs.shape[2])
  if lhs.shape[1] != K:
    raise ValueError(f"jax_moe_overlap: grouped_matmul_swiglu_grad: lhs {lhs.shape} and rhs {rhs.shape}"
                     f"{' (transposed)' if transpose_rhs else ''} do not share the contraction K")
  if a.dtype not in (jnp.dtype(jnp.float32), lhs.dtype) or a.shape != (M, 2 * F):
    raise ValueError(f"jax_moe_overlap: grouped_matmul_swiglu_grad: a must be [{M}, {2 * F}] (lhs's rows, twice "
                     f"rhs's F) in float32 or lhs's dtype {lhs.dtype}, got {a.dtype}{list(a.shape)}")
  _ffi.register()
  out = jax.ShapeDtypeStruct((M, 2 * F), lhs.dtype)
  return jax.ffi.ffi_call(GROUPED_MATMUL_SWIGLU_GRAD, out, vmap_method="sequential")(
      lhs, rhs, group_sizes.astype(jnp.int32), a, transpose_rhs=bool(transpose_rhs))


def fp8_scales_ld(rows: int) -> int:
  """The row stride of ``grouped_matmul_fp8``'s lhs scales in the kernel's layout: rows rounded up to a multiple of 4
  (16-byte rows, which the Hopper kernel loads by TMA)."""
  return -(-rows // 4) * 4


def check_fp8_operands(name, lhs, lhs_scales, rhs, rhs_scales, group_sizes, preferred_element_type):
  """The FP8 calls' dtype rules (group_sizes None: a call whose groups come otherwise, expert_combine_fp8's
  segments); returns the output's dtype."""
  if lhs.dtype != fp8.E4M3 or rhs.dtype != fp8.E4M3 or lhs_scales.dtype != jnp.float32 or rhs_scales.dtype != jnp.float32:
    raise TypeError(f"jax_moe_overlap: {name}: lhs and rhs must be float8_e4m3fn and their scales float32; got "
                    f"{lhs.dtype}, {lhs_scales.dtype}, {rhs.dtype}, {rhs_scales.dtype}")
  if group_sizes is not None and (group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer)):
    raise TypeError(f"jax_moe_overlap: {name}: group_sizes must be a 1-D integer array, got "
                    f"{group_sizes.dtype}{list(group_sizes.shape)}")
  out_dtype = jnp.dtype(preferred_element_type)
  if out_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise TypeError(f"jax_moe_overlap: {name}: preferred_element_type must be float32 or bfloat16, got {out_dtype}")
  return out_dtype


def grouped_matmul_fp8(lhs: jax.Array, lhs_scales: jax.Array, rhs: jax.Array, rhs_scales: jax.Array,
                       group_sizes: jax.Array, *, preferred_element_type=jnp.float32) -> jax.Array:
  """DeepSeek-V3's block-scaled FP8 grouped GEMM (arXiv 2412.19437 section 3.3) on quantized operands (``fp8.py``):
  ``out[r] = dequantize_rows(lhs, lhs_scales)[r] @ W[g]`` for the rows ``r`` of group ``g``, with ``W[g]`` the
  weight block-dequantized from ``rhs[g].T`` (an ``fp8.Fp8Weight``'s values and scales), each 128-wide K chunk's sum
  scaled and added into a float32 accumulator; rows past the last group are zero.

  On Hopper (compute capability 9.x) the e4m3 wgmma kernel (ffi/cuda/gemm/sm90/wgmma_grouped_fp8.cuh); on another
  GPU the call fails naming that requirement (``engines.fp8_gemm_runs_on`` says beforehand). On CPU a reference
  loop, the emulation of the kernel (ffi/cpu/grouped_gemm.cc: each chunk's sum exact, rounded once to float32, then
  the kernel's promotion), slow: for tests.

  The lhs scales come in the layout ``fp8.quantize_rows`` gives them, [M, K / 128]; the kernel reads them MN-major,
  [K / 128, ld] (one chunk's scales of consecutive rows contiguous, ld = M rounded up to a multiple of 4): the
  transpose (and padding) runs here, in XLA, a pass over M * K / 128 floats (1/32 of lhs's bytes).

  Args:
    lhs: [M, K] float8_e4m3fn. lhs_scales: [M, K / 128] float32. rhs: [G, N, K] float8_e4m3fn (K-major).
    rhs_scales: [G, N / 128, K / 128] float32. group_sizes: [G] integer rows per group (>= 0, sum <= M).
    preferred_element_type: float32 (default) or bfloat16, the output's dtype. K and N multiples of 128.
  Returns:
    [M, N].
  """
  out_dtype = check_fp8_operands("grouped_matmul_fp8", lhs, lhs_scales, rhs, rhs_scales, group_sizes,
                                  preferred_element_type)
  M, N, scales_mn = fp8_row_operands("grouped_matmul_fp8", lhs, lhs_scales, rhs, rhs_scales, group_sizes)
  out = jax.ShapeDtypeStruct((M, N), out_dtype)
  return jax.ffi.ffi_call(GROUPED_MATMUL_FP8, out, vmap_method="sequential")(
      lhs, scales_mn, rhs, rhs_scales, group_sizes.astype(jnp.int32))


def fp8_row_operands(name, lhs, lhs_scales, rhs, rhs_scales, group_sizes=None):
  """The shape rules of the FP8 row GEMMs' operands (group_sizes None: as check_fp8_operands); returns (M, N,
  lhs_scales in the kernels' MN-major layout)."""
  if lhs.ndim != 2 or rhs.ndim != 3:
    raise ValueError(f"jax_moe_overlap: {name}: lhs {lhs.shape} and rhs {rhs.shape} must be [M, K] and [G, N, K]")
  (M, K), (G, N) = lhs.shape, rhs.shape[:2]
  if K % fp8.TILE or N % fp8.TILE or K == 0 or N == 0:
    raise ValueError(f"jax_moe_overlap: {name}: K and N must be positive multiples of 128 (whole 1 x 128 and "
                     f"128 x 128 scale tiles), got K={K}, N={N}")
  t = fp8.TILE
  if (rhs.shape[2] != K or lhs_scales.shape != (M, K // t) or rhs_scales.shape != (G, N // t, K // t) or
      (group_sizes is not None and group_sizes.shape != (G,))):
    groups = (f" and group_sizes {group_sizes.shape}", ", group_sizes [G]") if group_sizes is not None else ("", "")
    raise ValueError(f"jax_moe_overlap: {name}: lhs {lhs.shape}, lhs_scales {lhs_scales.shape}, rhs {rhs.shape}, "
                     f"rhs_scales {rhs_scales.shape}{groups[0]} do not fit lhs [M, K], lhs_scales [M, K/128], "
                     f"rhs [G, N, K], rhs_scales [G, N/128, K/128]{groups[1]}")
  _ffi.register()
  return M, N, jnp.pad(lhs_scales.T, ((0, 0), (0, fp8_scales_ld(M) - M)))


def grouped_matmul_swiglu_fp8(lhs: jax.Array, lhs_scales: jax.Array, rhs: jax.Array, rhs_scales: jax.Array,
                              group_sizes: jax.Array, keep_a: bool = True):
  """GEMM1 of the FP8 recipe with its SwiGLU forward in one custom call: bit for bit
  ``swiglu_forward_fp8(grouped_matmul_fp8(lhs, lhs_scales, rhs, rhs_scales, group_sizes))`` (float32 a = [M, 2F],
  rhs's first F rows the gate's, the others the up projection's), without a in memory.

  On Hopper the e4m3 wgmma kernel of ``grouped_matmul_fp8`` (the same mainloop and promotion: the same float32
  accumulators) with the SwiGLU and both 1 x 128 quantizations in its epilogue, by ``swiglu_forward_fp8``'s device
  steps (ffi/cuda/gemm/sm90/wgmma_swiglu_fp8.cuh); elsewhere on GPUs the call fails naming that requirement. On CPU
  the two calls' loops, one after the other (ffi/cpu/fp8_gemm_rows.h). Rows past the groups come out as the two
  calls give them: zero values, scales 2^-126.

  Args:
    lhs: [M, K] float8_e4m3fn. lhs_scales: [M, K / 128] float32. rhs: [G, 2F, K] float8_e4m3fn (K-major).
    rhs_scales: [G, 2F / 128, K / 128] float32. group_sizes: [G] integer rows per group (>= 0, sum <= M). K and F
      positive multiples of 128. keep_a: whether a is returned (what the recipe's backward keeps); False where
      nothing differentiates the call (inference): the epilogue then quantizes h alone and writes no a.
  Returns:
    (h_rows, a_rows): h_rows = (q [M, F] float8_e4m3fn, s [M, F / 128] float32); a_rows = (q [M, 2F], s [M, 2F / 128]),
    as ``swiglu_forward_fp8`` returns them, or None without keep_a (h_rows the same bits either way).
  """
  name = "grouped_matmul_swiglu_fp8"
  check_fp8_operands(name, lhs, lhs_scales, rhs, rhs_scales, group_sizes, jnp.float32)
  M, C, scales_mn = fp8_row_operands(name, lhs, lhs_scales, rhs, rhs_scales, group_sizes)
  F = _swiglu_width(name, "rhs", C)
  a_rows = M if keep_a else 0  # (a not kept: empty results, which the call leaves unwritten)
  out = (jax.ShapeDtypeStruct((M, F), fp8.E4M3), jax.ShapeDtypeStruct((M, F // fp8.TILE), jnp.float32),
         jax.ShapeDtypeStruct((a_rows, C), fp8.E4M3), jax.ShapeDtypeStruct((a_rows, C // fp8.TILE), jnp.float32))
  hq, hs, aq, a_s = jax.ffi.ffi_call(GROUPED_MATMUL_SWIGLU_FP8, out, vmap_method="sequential")(
      lhs, scales_mn, rhs, rhs_scales, group_sizes.astype(jnp.int32))
  return (hq, hs), ((aq, a_s) if keep_a else None)


def quantize_columns_fp8(x, tiles: fp8.ColumnTiles) -> tuple[jax.Array, jax.Array]:
  """``fp8.quantize_columns`` in the layout of ``grouped_outer_fp8_packed``'s operands, in one custom call: x [M, C]
  -> (q_t [C, 128 * tiles.count] float8_e4m3fn, s [tiles.count, C] float32). ``q_t[c, 128 t + i]`` is channel c of
  the i-th row of tile t quantized (each group's rows from a multiple of 128), zero at the places no row takes; ``s``
  is ``quantize_columns``' scales. Bitwise ``quantize_columns`` followed by the scatter to the padded rows and the
  transpose that ``grouped_outer_fp8`` runs in XLA.

  x may also come row-quantized, as the pair (xq [M, C] float8_e4m3fn, xs [M, C / 128] float32) of
  ``fp8.quantize_rows``: the call dequantizes each value as it reads it (value times its scale, one float32 product:
  ``fp8.dequantize_rows``' rule), bit for bit ``quantize_columns_fp8(fp8.dequantize_rows(xq, xs), tiles)`` without
  the float32 copy in memory (a quarter of the bytes read). C must then be a multiple of 256, on every platform (the
  CUDA kernel's item: 32 lanes of 8 e4m3 values).

  One kernel reads x once and writes both outputs (ffi/cuda/ops/quantize_columns.cu), so XLA cannot re-lay its
  output out (it folded the transpose of an XLA gather into the gather and wrote its rows out of order:
  docs/design.md, "The e4m3 weight gradient"). On CUDA it runs where the FP8 GEMMs do (Hopper; elsewhere it fails
  naming the requirement); on CPU a loop with the same rules (ffi/common/fp8_columns.h).

  Args:
    x: [M, C] float32 or bfloat16, C a positive multiple of 128; or (xq, xs) as above, C a positive multiple of 256.
      tiles: ``fp8.column_tiles(M, group_sizes)``; the sizes must be >= 0 and sum to at most M (the CPU handler
      raises otherwise; the kernel clips).
  Returns:
    (q_t, s).
  """
  name = "jax_moe_overlap: quantize_columns_fp8"
  if isinstance(x, (tuple, list)):
    if len(x) != 2:
      raise TypeError(f"{name}: row-quantized x is the pair (xq, xs), got {len(x)} arrays")
    xq, xs = x
    if (getattr(xq, "ndim", None) != 2 or xq.dtype != fp8.E4M3 or getattr(xs, "ndim", None) != 2
        or xs.dtype != jnp.float32):
      raise TypeError(f"{name}: row-quantized x must be (xq [M, C] float8_e4m3fn, xs [M, C / 128] float32), got "
                      f"{getattr(xq, 'dtype', type(xq))}{list(getattr(xq, 'shape', ()))} and "
                      f"{getattr(xs, 'dtype', type(xs))}{list(getattr(xs, 'shape', ()))}")
    M, C = xq.shape
    if C % ROWS_E4M3_CHANNELS or C == 0:
      raise ValueError(f"{name}: C must be a positive multiple of {ROWS_E4M3_CHANNELS} when x is row-quantized "
                       f"(the CUDA kernel's item: 32 lanes of 8 e4m3 values), got C={C}")
    if xs.shape != (M, C // fp8.TILE):
      raise ValueError(f"{name}: xs must be [M, C / 128] = {[M, C // fp8.TILE]} for xq {list(xq.shape)}, got "
                       f"{list(xs.shape)}")
    operands = (xq, xs)
  else:
    if getattr(x, "ndim", None) != 2 or x.dtype not in (jnp.float32, jnp.bfloat16):
      raise TypeError(f"{name}: x must be a float32 or bfloat16 [M, C] array or the pair (xq, xs) of row-quantized "
                      f"rows, got {getattr(x, 'dtype', type(x))}{list(getattr(x, 'shape', ()))}")
    M, C = x.shape
    if C % fp8.TILE or C == 0:
      raise ValueError(f"{name}: C must be a positive multiple of 128, got C={C}")
    operands = (x, jnp.zeros((M, 0), jnp.float32))  # x_scales: unread for float rows
  if tiles.rows != M or tiles.group_sizes.ndim != 1:
    raise ValueError(f"{name}: tiles were made for {tiles.rows} rows, x has {M}")
  _ffi.register()
  out = (jax.ShapeDtypeStruct((C, fp8.TILE * tiles.count), fp8.E4M3),
         jax.ShapeDtypeStruct((tiles.count, C), jnp.float32))
  return jax.ffi.ffi_call(QUANTIZE_COLUMNS_FP8, out, vmap_method="sequential")(
      *operands, tiles.group_sizes.astype(jnp.int32))


def quantize_weight_fp8(w: jax.Array, *, transposed: bool = True) -> fp8.Fp8Weight:
  """``fp8.quantize_weight`` in one custom call: an expert weight w [E, K, N] quantized per 128 x 128 block, read
  once. ``transposed`` (the default): the ``Fp8Weight`` of W, values [E, N, K] (the blocks of W^T, K-major as FP8
  wgmma reads its B operand) and scales [E, N / 128, K / 128], as ``fp8.quantize_weight(w)``. Not transposed: the
  ``Fp8Weight`` of W^T, values [E, K, N] in w's own layout and scales [E, K / 128, N / 128], as
  ``fp8.transpose_weight(fp8.quantize_weight(w))``: the dgrads' weights, made from the master weight instead of
  transposing a kept quantized copy. The two forms are each other's transpose bit for bit.

  The rule is ``fp8.py``'s (``tile_scale`` without pow2, each value x / s divided as IEEE does and rounded to
  e4m3, nearest even, saturating at 448; ffi/common/fp8_columns.h restates it for both handlers): a NaN in a block
  makes its scale and its values NaN, an infinity makes its scale infinite, itself NaN and the block's finite
  values zero. XLA's ``fp8.quantize_weight`` gives the same bytes but where it departs from that rule
  (docs/design.md, "The weight quantizer"): its division (x * (1 / s) on CPUs, div.full on GPUs: one e4m3 step
  where x / s lies near a midpoint, a few bytes in 10^5), XLA:CPU's maximum over a block, which drops a NaN, and
  XLA:CPU's flushed subnormals (which the CPU handler, run under XLA:CPU's flags, shares). On CUDA (Hopper, like
  the FP8 GEMMs its output feeds; elsewhere it fails naming the requirement) one CTA per block
  (ffi/cuda/ops/quantize_weight.cu); on CPU a loop by the same rules (ffi/cpu/quantize_weight.cc).

  Args:
    w: [E, K, N] float32 or bfloat16, K and N positive multiples of 128.
    transposed: the layout of the values, as above.
  Returns:
    fp8.Fp8Weight.
  """
  return _quantize_weight_call("quantize_weight_fp8", w, transposed, both=False)[0]


def quantize_weight_fp8_pair(w: jax.Array) -> tuple[fp8.Fp8Weight, fp8.Fp8Weight]:
  """Both forms of ``quantize_weight_fp8`` from one read of w [E, K, N] (float32 or bfloat16, K and N positive
  multiples of 128), in one custom call: (the ``Fp8Weight`` of W, as ``quantize_weight_fp8(w)``: the forward's
  weight; the ``Fp8Weight`` of W^T, as ``quantize_weight_fp8(w, transposed=False)``: the dgrads'), each the other's
  transpose bit for bit. Where a layer needs both, this writes the second form for the price of its bytes instead
  of a transpose that reads the first one back (docs/design.md, "FP8")."""
  return _quantize_weight_call("quantize_weight_fp8_pair", w, True, both=True)


def _quantize_weight_call(op: str, w: jax.Array, transposed: bool, both: bool) -> tuple[fp8.Fp8Weight, ...]:
  """jmo_quantize_weight_fp8 on w: (the form ``transposed`` names,) and with both (the other form,)."""
  name = f"jax_moe_overlap: {op}"
  if getattr(w, "ndim", None) != 3 or w.dtype not in (jnp.float32, jnp.bfloat16):
    raise TypeError(f"{name}: w must be a float32 or bfloat16 [E, K, N] array, got "
                    f"{getattr(w, 'dtype', type(w))}{list(getattr(w, 'shape', ()))}")
  E, K, N = w.shape
  fp8._check_tiles("both axes of a weight matrix", K)
  fp8._check_tiles("both axes of a weight matrix", N)
  if K == 0 or N == 0:
    raise ValueError(f"{name}: K and N must be positive multiples of {fp8.TILE}, got K={K}, N={N}")

  def form(rows, cols):
    return (jax.ShapeDtypeStruct((E, rows, cols), fp8.E4M3),
            jax.ShapeDtypeStruct((E, rows // fp8.TILE, cols // fp8.TILE), jnp.float32))

  rows, cols = (N, K) if transposed else (K, N)
  # The second pair of results is the other form with both, else empty.
  other = form(cols, rows) if both else (jax.ShapeDtypeStruct((0,), fp8.E4M3), jax.ShapeDtypeStruct((0,), jnp.float32))
  _ffi.register()
  q, s, q2, s2 = jax.ffi.ffi_call(QUANTIZE_WEIGHT_FP8, form(rows, cols) + other, vmap_method="sequential")(
      w, transposed=bool(transposed), both=bool(both))
  return (fp8.Fp8Weight(q, s), fp8.Fp8Weight(q2, s2)) if both else (fp8.Fp8Weight(q, s),)


def _swiglu_width(name: str, operand: str, C: int) -> int:
  """F of an operand [M, 2F] of the SwiGLU calls (its C channels: the gate's F, then the up projection's), refused
  unless a positive multiple of 128 (whole 1 x 128 tiles in each half)."""
  if C % (2 * fp8.TILE) or C == 0:
    raise ValueError(f"jax_moe_overlap: {name}: F (half of {operand}'s {C} channels) must be a positive multiple of "
                     "128")
  return C // 2


def swiglu_forward_fp8(a: jax.Array):
  """The FP8 recipe's SwiGLU forward in one custom call, from GEMM1's float32 output to what follows it: with a's gate
  (its F first columns) and up projection (the F others), as ``expert_gemms.swiglu`` splits them, and h =
  silu(gate) * up in float32 (the expression XLA runs for ``expert_gemms.swiglu``, ffi/common/swiglu.h):

    h_rows = ``fp8.quantize_rows(h)``: 1 x 128, GEMM2's operand
    a_rows = ``fp8.quantize_rows(a)``: 1 x 128, what the backward keeps (it recomputes h from it)

  in one pass over a, row by row (no group sizes: rows past the groups are whatever a holds there, zero rows in the
  layer, which quantize to zero values and scales 2^-126, as ``quantize_rows`` gives them). On CUDA (Hopper, like the
  FP8 GEMM its output feeds; elsewhere it fails naming the requirement) a warp quantizes one row tile of h and two of
  a per row, the amaxes by shuffles (ffi/cuda/ops/swiglu_forward_fp8.cu); on CPU a loop by the same rules
  (ffi/cpu/swiglu_forward_fp8.cc). Both divide by the scale as IEEE does, so a_rows is bit for bit
  ``fp8.quantize_rows``' rule everywhere and h_rows wherever the host's and the device's expf agree (and no float32
  intermediate is subnormal: ffi/common/swiglu.h). XLA's ``quantize_rows`` multiplies by the scale's reciprocal
  instead on CPU (div.full on GPUs), one float32 ulp off now and then: one e4m3 step at most.

  Args:
    a: [M, 2F] float32, F a positive multiple of 128.
  Returns:
    (h_rows, a_rows): h_rows = (q [M, F] float8_e4m3fn, s [M, F / 128] float32); a_rows = (q [M, 2F], s [M, 2F / 128]).
  """
  name = "swiglu_forward_fp8"
  if getattr(a, "ndim", None) != 2 or a.dtype != jnp.float32:
    raise TypeError(f"jax_moe_overlap: {name}: a must be a float32 [M, 2F] array, got "
                    f"{getattr(a, 'dtype', type(a))}{list(getattr(a, 'shape', ()))}")
  M, C = a.shape
  F = _swiglu_width(name, "a", C)
  _ffi.register()
  out = (jax.ShapeDtypeStruct((M, F), fp8.E4M3), jax.ShapeDtypeStruct((M, F // fp8.TILE), jnp.float32),
         jax.ShapeDtypeStruct((M, C), fp8.E4M3), jax.ShapeDtypeStruct((M, C // fp8.TILE), jnp.float32))
  hq, hs, aq, a_s = jax.ffi.ffi_call(SWIGLU_FORWARD_FP8, out, vmap_method="sequential")(a)
  return (hq, hs), (aq, a_s)


def swiglu_backward_fp8(aq: jax.Array, a_s: jax.Array, dh: jax.Array, tiles: fp8.ColumnTiles):
  """The FP8 recipe's SwiGLU backward in one custom call, from the kept preactivation to the three quantized operands
  the backward's GEMMs read: with a = ``fp8.dequantize_rows(aq, a_s)`` (the gate's F columns, then the up
  projection's, as ``expert_gemms.swiglu`` splits them), h = swiglu(a) and da = (d_gate | d_up) its input gradient at
  dh (the expressions of ``jax.vjp`` of ``swiglu`` in float32, ffi/common/swiglu.h):

    da_rows = ``fp8.quantize_rows(da)``: 1 x 128, for dx = da W1^T (a row past the groups: zero values, scales
              2^-126, as ``quantize_rows`` of a zero row)
    da_cols = ``quantize_columns_fp8(da, tiles)``: 128 x 1 per group, token-contiguous, for dW1 = x^T da
    h_cols  = ``quantize_columns_fp8(h, tiles)``, for dW2 = h^T dy

  in one pass over aq, a_s and dh: on CUDA (Hopper, like the FP8 GEMMs its outputs feed; elsewhere it fails naming
  the requirement) a CTA owns 128 rows of one tile x 128 channels of h, and so whole 1 x 128 row tiles of da and
  whole 128 x 1 column tiles of da and h (ffi/cuda/ops/swiglu_backward_fp8.cu); on CPU loops by the same rules
  (ffi/cpu/swiglu_backward_fp8.cc). Both divide by the scale as IEEE does; the CPU handler and the kernel agree bit
  for bit wherever the host's and the device's expf agree and no float32 intermediate is subnormal (XLA:CPU's threads
  flush those, as XLA:CPU's own code does; the GPU keeps them, as XLA:GPU does): ffi/common/swiglu.h.

  Args:
    aq: [M, 2F] float8_e4m3fn, a_s: [M, 2F / 128] float32 (``fp8.quantize_rows(a)``), dh: [M, F] float32 or
      bfloat16 (the dgrad in the compute dtype: each value exactly its float32; zero past the groups). tiles:
      ``fp8.column_tiles(M, group_sizes)``; sizes >= 0 summing to at most M (the CPU handler raises otherwise; the
      kernel clips). F a positive multiple of 128.
  Returns:
    (da_rows, da_cols, h_cols): da_rows = (q [M, 2F] e4m3, s [M, 2F / 128] float32); da_cols = (q_t [2F, 128 *
    tiles.count] e4m3, s [tiles.count, 2F] float32); h_cols = (q_t [F, 128 * tiles.count], s [tiles.count, F]).
  """
  name = "swiglu_backward_fp8"
  if (aq.ndim != 2 or aq.dtype != fp8.E4M3 or a_s.dtype != jnp.float32
      or dh.dtype not in (jnp.float32, jnp.bfloat16)):
    raise TypeError(f"jax_moe_overlap: {name}: aq must be a float8_e4m3fn [M, 2F] array, a_s float32 and dh float32 "
                    f"or bfloat16; got aq {aq.dtype}{list(aq.shape)}, a_s {a_s.dtype}, dh {dh.dtype}")
  M, C = aq.shape
  F = _swiglu_width(name, "aq", C)
  if dh.shape != (M, F) or a_s.shape != (M, C // fp8.TILE):
    raise ValueError(f"jax_moe_overlap: {name}: aq {aq.shape}, a_s {a_s.shape} and dh {dh.shape} do not fit aq "
                     f"[M, 2F], a_s [M, 2F / 128], dh [M, F]")
  if tiles.rows != M or tiles.group_sizes.ndim != 1:
    raise ValueError(f"jax_moe_overlap: {name}: tiles were made for {tiles.rows} rows, aq has {M}")
  _ffi.register()
  Mp, n = fp8.TILE * tiles.count, tiles.count
  out = (jax.ShapeDtypeStruct((M, C), fp8.E4M3), jax.ShapeDtypeStruct((M, C // fp8.TILE), jnp.float32),
         jax.ShapeDtypeStruct((C, Mp), fp8.E4M3), jax.ShapeDtypeStruct((n, C), jnp.float32),
         jax.ShapeDtypeStruct((F, Mp), fp8.E4M3), jax.ShapeDtypeStruct((n, F), jnp.float32))
  dq, ds, dq_t, ds_t, hq_t, hs_t = jax.ffi.ffi_call(SWIGLU_BACKWARD_FP8, out, vmap_method="sequential")(
      aq, a_s, dh, tiles.group_sizes.astype(jnp.int32))
  return (dq, ds), (dq_t, ds_t), (hq_t, hs_t)


def grouped_outer_fp8_packed(lhs: tuple[jax.Array, jax.Array], rhs: tuple[jax.Array, jax.Array],
                             group_sizes: jax.Array, *, preferred_element_type=jnp.float32) -> jax.Array:
  """The FP8 weight gradient of DeepSeek-V3's recipe on token-contiguous operands: ``out[g] = lhs[rows of g]^T @
  rhs[rows of g]`` with both operands dequantized per 128 x 1 tile, each 128-row chunk's sum scaled per element and
  added into a float32 accumulator (the kernel's promotion); zero for a group without rows.

  The operands come as the kernel reads them (FP8 wgmma reads both operands K-major only, the reduction axis being
  the tokens): each the output of ``quantize_columns_fp8`` with the tiles of ``group_sizes``, values [C, Mp] with
  each group's rows from a multiple of 128 and zeros between, scales [Mp / 128, C]. On Hopper (compute capability
  9.x) the e4m3 wgmma kernel (ffi/cuda/gemm/sm90/wgmma_outer_fp8.cuh); on another GPU the call fails naming that
  requirement. On CPU a reference loop, the emulation of the kernel (ffi/cpu/grouped_gemm.cc: each chunk's sum exact,
  rounded once to float32, then the kernel's promotion), slow: for tests.

  Args:
    lhs: (q_t [K, Mp] float8_e4m3fn, s [Mp / 128, K] float32), rhs: (q_t [N, Mp], s [Mp / 128, N]). group_sizes: [G]
      integer rows per group (>= 0), those the operands were quantized with. preferred_element_type: float32
      (default) or bfloat16. K, N and Mp multiples of 128.
  Returns:
    [G, K, N].
  """
  (lq, ls), (rq, rs) = lhs, rhs
  out_dtype = check_fp8_operands("grouped_outer_fp8", lq, ls, rq, rs, group_sizes, preferred_element_type)
  t = fp8.TILE
  if lq.ndim != 2 or rq.ndim != 2 or lq.shape[1] != rq.shape[1] or lq.shape[1] % t or lq.shape[1] == 0:
    raise ValueError(f"jax_moe_overlap: grouped_outer_fp8: lhs {lq.shape} and rhs {rq.shape} must be [K, Mp] and "
                     f"[N, Mp] (token-contiguous), Mp a positive multiple of 128")
  (K, Mp), N, G = lq.shape, rq.shape[0], group_sizes.shape[0]
  if K % t or N % t or K == 0 or N == 0:
    raise ValueError(f"jax_moe_overlap: grouped_outer_fp8: K and N must be positive multiples of 128, got K={K}, "
                     f"N={N}")
  if ls.shape != (Mp // t, K) or rs.shape != (Mp // t, N):
    raise ValueError(f"jax_moe_overlap: grouped_outer_fp8: the scales {ls.shape} and {rs.shape} must be "
                     f"[Mp / 128, K] and [Mp / 128, N] with Mp = {Mp}")
  _ffi.register()
  out = jax.ShapeDtypeStruct((G, K, N), out_dtype)
  return jax.ffi.ffi_call(GROUPED_OUTER_FP8, out, vmap_method="sequential")(
      lq, ls, rq, rs, group_sizes.astype(jnp.int32))


def grouped_outer_fp8(lhs: tuple[jax.Array, jax.Array], rhs: tuple[jax.Array, jax.Array], tiles: fp8.ColumnTiles,
                      group_sizes: jax.Array, *, preferred_element_type=jnp.float32) -> jax.Array:
  """``grouped_outer_fp8_packed`` on operands in row layout, as ``fp8.quantize_columns`` gives them: each one's e4m3
  values made token-contiguous here, in XLA (``fp8.token_contiguous``: scattered to their padded rows and transposed,
  a pass over its bytes). The recipe's backward does not take this path: it quantizes its wgrad operands
  into that layout directly (``quantize_columns_fp8``, one custom call), which XLA's scatters here are many times
  slower than (docs/performance.md, "Where the FP8 step goes").

  Args:
    lhs: (q [M, K] float8_e4m3fn, s [tiles.count, K] float32), rhs: (q [M, N], s [tiles.count, N]): the outputs of
      ``fp8.quantize_columns`` with ``tiles``. group_sizes: [G] integer rows per group (>= 0, sum <= M), those
      ``tiles`` was made from. preferred_element_type: float32 (default) or bfloat16. K and N multiples of 128.
  Returns:
    [G, K, N].
  """
  (lq, ls), (rq, rs) = lhs, rhs
  check_fp8_operands("grouped_outer_fp8", lq, ls, rq, rs, group_sizes, preferred_element_type)
  if lq.ndim != 2 or rq.ndim != 2 or lq.shape[0] != rq.shape[0]:
    raise ValueError(f"jax_moe_overlap: grouped_outer_fp8: lhs {lq.shape} and rhs {rq.shape} must be [M, K] and "
                     f"[M, N]")
  (M, K), N = lq.shape, rq.shape[1]
  if ls.shape != (tiles.count, K) or rs.shape != (tiles.count, N) or tiles.rows != M:
    raise ValueError(f"jax_moe_overlap: grouped_outer_fp8: the scales {ls.shape} and {rs.shape} must be "
                     f"[tiles.count, K] and [tiles.count, N] with tiles.count = {tiles.count} for {M} rows")
  return grouped_outer_fp8_packed((fp8.token_contiguous(lq, tiles), ls), (fp8.token_contiguous(rq, tiles), rs),
                                  group_sizes, preferred_element_type=preferred_element_type)
