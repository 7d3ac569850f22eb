"""The FP8 expert MLP (``quantization="fp8"``): DeepSeek-V3's recipe (arXiv 2412.19437, section 3.3) on the rows one
rank's experts hold, GEMM1 + SwiGLU + GEMM2 forward and the recipe's backward, as a ``custom_vjp``.

Every operand of every GEMM is quantized by ``fp8.py``'s rules, and ``Gemms`` takes the quantized operands (e4m3
values and their float32 scales) and chooses how the GEMMs run:

  ``DENSE``    the oracle: the operands dequantized to float32, every expert's product at precision HIGHEST, each
               row taking its own expert's (an emulation of FP8 tensor-core GEMMs that accumulate in float32: the
               Hopper kernels' promotion every 128 of K keeps their sums this close to it; docs/design.md, "FP8")
  ``RAGGED``   the same dequantized float32 operands through XLA's ``ragged_dot``: ``impl="xla"``, the honest
               baseline (no custom call)
  ``KERNELS``  this library's custom calls on the quantized operands themselves (on Hopper the e4m3 wgmma kernels;
               on CPU their emulations); ``impl="collective"``: the four row GEMMs (GEMM1, GEMM2 and the two dgrads)
               by ``grouped_gemm.grouped_matmul_fp8``, the two wgrads (dW1 = x^T da, dW2 = h^T dy) by
               ``grouped_gemm.grouped_outer_fp8_packed`` on operands that ``grouped_gemm.quantize_columns_fp8``
               quantizes 128 x 1 straight into the token-contiguous layout (each expert's rows padded to a multiple
               of 128), since FP8 wgmma takes both operands K-major only; the SwiGLU forward (h and its
               quantization, and a's) by ``grouped_gemm.swiglu_forward_fp8``, one pass over a (on CPUs, and on
               GPUs with ``FUSED_GEMM1_SWIGLU_ON_GPU``, GEMM1 and the SwiGLU forward by one call,
               ``grouped_gemm.grouped_matmul_swiglu_fp8``, whose epilogue writes both: no float32 a); the SwiGLU
               backward (h recomputed, da, and their three quantizations) by ``grouped_gemm.swiglu_backward_fp8``,
               one pass over a and dh. x and dy, which the backward holds row-quantized, go to the column quantizer
               as e4m3 values and scales (no float32 copy; on GPUs while ``ROW_QUANTIZED_COLUMNS_ON_GPU``, the
               default, and where D is a multiple of 256, the call's item).
               The dgrads read the transposed copies of the quantized weights, for the same reason: the master
               weights are quantized per call in both layouts at once by ``grouped_gemm.quantize_weight_fp8_pair``
               (one read of each weight, the forward's copy and the dgrads'; on GPUs only with
               ``WEIGHT_QUANTIZER_ON_GPU``), while ``FORWARD_QUANTIZES_DGRAD_WEIGHTS``; else the forward's copies
               by ``grouped_gemm.quantize_weight_fp8`` and the backward's transposes of them
               (``fp8.transpose_weight``: exact); with ``BACKWARD_REQUANTIZES_WEIGHTS`` the dgrads' weights are
               made from the master weights by its untransposed form, so that the forward keeps no quantized copy.

Under quantization="fp8_bf16_wgrad" each backend's ``bf16_wgrad`` form computes the two wgrads on bfloat16 operands
instead (no 128 x 1 quantization); ``recipe_gemms(backend, quantization)`` gives the Gemms of either mode.

With a = x W1 [rows, 2F], h = SwiGLU(a), out = h W2:

  forward   x      1 x 128, power-of-two scales (the rows dispatched to the experts, section 3.3.3)
            W1, W2 128 x 128 blocks (quantized per call from the master weights, or given as ``fp8.Fp8Weight``)
            a      GEMM1, float32 output; SwiGLU in float32
            h      1 x 128 (GEMM2's input), with a's 1 x 128 copy below, in one pass (``Gemms.swiglu_forward``)
            out    GEMM2, rounded to x's dtype (the combine stays in that dtype)
  kept      x as quantized (e4m3 + scales), a quantized 1 x 128 (the recipe caches the SwiGLU input in FP8 and
            recomputes h), the quantized weights (the dgrads' copies where the forward made both layouts; the master
            weights themselves where ``Gemms.requantizes_weights``: the backward quantizes them again): per row
            D + 2F bytes of e4m3 and (D + 2F) / 32 bytes of scales
  backward  dy     1 x 128, power-of-two scales (the gradient dispatched before GEMM2's backward, section 3.3.3)
            dh = dy W2^T (dgrad, W2's blocks transposed: exact, or quantized again in W2's own layout: the same bits),
                   written in ``expert_gemms.dgrad_dtype`` of the compute dtype (the float32 sums rounded once, as
                   the unquantized layer's dh)
            dW2 = h^T dy, both operands re-quantized 128 x 1 per expert (h recomputed from the kept a)
            da = SwiGLU'(a) dh in float32, quantized 1 x 128 for dx = da W1^T (dgrad)
            dW1 = x^T da, both operands re-quantized 128 x 1 per expert
  The weight gradients are straight-through: the gradient of the quantized weight, returned for the master weight
  (in its dtype); pre-quantized weights get none (zero cotangents).

Rows are grouped by expert as ``lax.ragged_dot`` takes them (``group_sizes``); rows past the last group are zero in
the input and the output, and take no part in any tile.

Two entries: ``fp8_expert_mlp`` (the ``custom_vjp`` on rows in the compute dtype, which quantizes x and dy itself:
the oracle's, ``reference.py``), and ``recipe_forward`` / ``recipe_backward``, which take x and dy already quantized
(1 x 128, power-of-two scales): ``fp8_exchange.py`` quantizes them on the token's owner and exchanges them in FP8,
for ``impl="xla"`` (``RAGGED``) and ``impl="collective"`` (``KERNELS``); and their parts before GEMM2 and before
dx = da W1^T, ``recipe_gemm1`` / ``recipe_dgrad_operands`` (``fp8_overlap.fp8_combined_experts``, whose
expert_combine calls run those GEMMs).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_overlap import fp8
from jax_moe_overlap import expert_gemms
from jax_moe_overlap.expert_gemms import ragged_matmul_f32, ragged_outer_f32, swiglu
from jax_moe_overlap.grouped_gemm import ROWS_E4M3_CHANNELS, grouped_matmul_fp8, grouped_outer_fp8_packed
from jax_moe_overlap.grouped_gemm import grouped_matmul_swiglu_fp8
from jax_moe_overlap.grouped_gemm import quantize_columns_fp8, quantize_weight_fp8, quantize_weight_fp8_pair
from jax_moe_overlap.grouped_gemm import swiglu_backward_fp8, swiglu_forward_fp8


def xla_quantize_weight(w, transposed=True):
  """``Gemms.quantize_weight`` as XLA ops: ``fp8.quantize_weight(w)``, or its ``fp8.transpose_weight``."""
  wq = fp8.quantize_weight(w)
  return wq if transposed else fp8.transpose_weight(wq)


def _never() -> bool:
  return False


@dataclasses.dataclass(frozen=True)
class Gemms:
  """The grouped GEMMs of the recipe, on quantized operands.

  rows(lhs_q [M, K] e4m3, lhs_s [M, K / 128], w: fp8.Fp8Weight of W [G, K, N], group_sizes [G], out_dtype) -> [M, N]
    in out_dtype: dequantize_rows(lhs_q, lhs_s)[r] @ W[g] for the rows r of group g, zero past them; accumulated in
    float32, then rounded to out_dtype.
  columns(v [M, C] float, tiles: fp8.ColumnTiles) -> the weight gradients' operand in the form ``outer`` takes: in
    the recipe v quantized per 128 x 1 tile (``fp8.quantize_columns``' values and scales), in row layout (q [M, C],
    s [tiles.count, C]) for the XLA backends, in the kernel's token-contiguous one
    (``grouped_gemm.quantize_columns_fp8``) for ``KERNELS``; under ``bf16_wgrad`` v in bfloat16.
  outer(lhs = columns(a, tiles), rhs = columns(b, tiles), tiles, group_sizes [G], out_dtype) -> [G, K, N] in
    out_dtype: a[rows of g]^T @ b[rows of g] on the operands as ``columns`` gave them (the recipe: dequantized per
    128 x 1 tile), accumulated in float32, then rounded to out_dtype (the master weight's: the kernels write the
    gradient in it, no float32 copy to convert).
  swiglu_forward(a [M, 2F] float32) -> (h_rows, a_rows): fp8.quantize_rows(swiglu(a)) (GEMM2's operand) and
    fp8.quantize_rows(a) (what the backward keeps). ``swiglu_forward_composed`` is the jnp composition (``DENSE``,
    ``RAGGED``: the definition); ``KERNELS`` runs ``grouped_gemm.swiglu_forward_fp8``, one custom call for both.
  swiglu_backward(aq [M, 2F] e4m3, a_s [M, 2F / 128], dh [M, F] float32 or bfloat16, tiles) -> (h_cols, da_rows,
    da_cols): with a = dequantize_rows(aq, a_s), h = swiglu(a) and da its input gradient at dh in float32, h_cols =
    columns(h), da_rows = fp8.quantize_rows(da) and da_cols = columns(da). ``swiglu_backward_composed(columns)`` is
    the jnp composition (``DENSE``, ``RAGGED``: the definition); ``KERNELS`` runs
    ``grouped_gemm.swiglu_backward_fp8``, one custom call for all three (on GPUs a bfloat16 dh widened first where
    ``BF16_DH_KERNEL_ON_GPU`` is off).
  row_columns(q [M, C] e4m3, s [M, C / 128], tiles) -> columns(fp8.dequantize_rows(q, s), tiles): the wgrads' x and
    dy, which the recipe holds row-quantized. None (``DENSE``, ``RAGGED``): that composition; ``KERNELS`` gives the
    pair to ``grouped_gemm.quantize_columns_fp8``, which dequantizes as it reads (CPUs; GPUs while
    ``ROW_QUANTIZED_COLUMNS_ON_GPU``, the default), bit for bit the same.
  quantize_weight(w [E, K, N] float, transposed) -> fp8.Fp8Weight: with transposed ``fp8.quantize_weight(w)`` (the
    forward's weights), else ``fp8.transpose_weight(fp8.quantize_weight(w))`` (the dgrads'). ``xla_quantize_weight``
    (``DENSE``, ``RAGGED``): those compositions; ``KERNELS`` runs ``grouped_gemm.quantize_weight_fp8`` (CPUs; GPUs
    once ``WEIGHT_QUANTIZER_ON_GPU``), one pass over w.
  quantize_weight_pair(w [E, K, N] float) -> (quantize_weight(w), quantize_weight(w, transposed=False)) from one
    read of w, or None (``DENSE``, ``RAGGED``: no such form; the backward transposes the forward's copy).
    ``KERNELS`` runs ``grouped_gemm.quantize_weight_fp8_pair`` (CPUs; GPUs once ``WEIGHT_QUANTIZER_ON_GPU`` and
    ``WEIGHT_PAIR_KERNEL_ON_GPU``, else the single-layout call and XLA's transpose of it); the forward takes it while
    ``FORWARD_QUANTIZES_DGRAD_WEIGHTS``.
  requantizes_weights() -> bool, read when traced: whether the backward makes the dgrads' weights from the master
    weights by ``quantize_weight(w, transposed=False)`` (the forward then keeps the master weights, which the caller
    holds anyway, instead of their quantized copies), rather than transposing the quantized copies the forward kept.
  rows_swiglu(lhs_q, lhs_s, w: fp8.Fp8Weight of W1 [G, K, 2F], group_sizes, keep_a) -> swiglu_forward(rows(lhs_q,
    lhs_s, w, group_sizes)), a_rows None without keep_a: GEMM1 and the SwiGLU forward. None (``DENSE``,
    ``RAGGED``): that composition (``gemm1_swiglu`` runs it: the definition); ``KERNELS`` runs
    ``grouped_gemm.grouped_matmul_swiglu_fp8``, one custom call whose epilogue quantizes h and a from the
    accumulators, bit for bit the composition's two calls (CPUs; GPUs once ``FUSED_GEMM1_SWIGLU_ON_GPU``).
  """

  name: str
  rows: Callable
  columns: Callable
  outer: Callable
  swiglu_forward: Callable
  swiglu_backward: Callable
  row_columns: Callable | None = None
  quantize_weight: Callable = xla_quantize_weight
  requantizes_weights: Callable[[], bool] = _never
  rows_swiglu: Callable | None = None
  quantize_weight_pair: Callable | None = None

  def gemm1_swiglu(self, lhs_q, lhs_s, w, group_sizes, keep_a=True):
    """``rows_swiglu``, or its composition where None: (h_rows, a_rows), a_rows None without keep_a (nothing
    differentiates the forward: the kernel then writes no a; h_rows the same bits)."""
    if self.rows_swiglu is None:
      h_rows, a_rows = self.swiglu_forward(self.rows(lhs_q, lhs_s, w, group_sizes))
      return h_rows, (a_rows if keep_a else None)
    return self.rows_swiglu(lhs_q, lhs_s, w, group_sizes, keep_a)

  def columns_of_rows(self, q, s, tiles):
    """``row_columns``, or its composition where None."""
    if self.row_columns is None:
      return self.columns(fp8.dequantize_rows(q, s), tiles)
    return self.row_columns(q, s, tiles)


def swiglu_forward_composed(a):
  """``Gemms.swiglu_forward`` as XLA ops: swiglu in float32, then the two quantizations, each a pass of its own."""
  return fp8.quantize_rows(swiglu(a)), fp8.quantize_rows(a)


def exact_float32(v):
  """v in float32, a bfloat16 v's values exactly (``fp8.rounded``): a float32 -> bfloat16 -> float32 round trip
  folded away by XLA would hand the composition the unrounded float32 values that the kernels never see."""
  return fp8.rounded(v, v.dtype)


def swiglu_backward_composed(columns: Callable) -> Callable:
  """``Gemms.swiglu_backward`` as XLA ops: a dequantized, h recomputed, da by ``jax.vjp`` of ``swiglu`` in float32,
  then the three quantizations, each a pass of its own (``columns`` lays the column tiles out)."""
  def swiglu_backward(aq, a_s, dh, tiles):
    h, swiglu_vjp = jax.vjp(swiglu, fp8.dequantize_rows(aq, a_s))
    (da,) = swiglu_vjp(exact_float32(dh))
    return columns(h, tiles), fp8.quantize_rows(da), columns(da, tiles)

  return swiglu_backward


def _on_dequantized(name: str, rows_f32: Callable, outer_f32: Callable) -> Gemms:
  """A backend of float32 GEMMs on the dequantized operands."""
  def rows(lhs_q, lhs_s, w, group_sizes, out_dtype=jnp.float32):
    return rows_f32(fp8.dequantize_rows(lhs_q, lhs_s), w.dequantize(), group_sizes).astype(out_dtype)

  def outer(lhs, rhs, tiles, group_sizes, out_dtype=jnp.float32):
    return outer_f32(fp8.dequantize_columns(*lhs, tiles), fp8.dequantize_columns(*rhs, tiles),
                     group_sizes).astype(out_dtype)

  return Gemms(name, rows, fp8.quantize_columns, outer, swiglu_forward_composed,
               swiglu_backward_composed(fp8.quantize_columns))


def _row_groups(rows: int, group_sizes):
  """[rows] int32 group of each row (G for a row past the last group)."""
  return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right").astype(jnp.int32)


def _dense_rows(lhs, w, group_sizes):
  every = jnp.einsum("mk,gkn->gmn", lhs, w, precision=jax.lax.Precision.HIGHEST)
  own = jax.nn.one_hot(_row_groups(lhs.shape[0], group_sizes), w.shape[0], dtype=jnp.bool_)    # [M, G]
  return jnp.sum(jnp.where(own.T[:, :, None], every, 0.0), axis=0)                              # exact selection


def _dense_outer(lhs, rhs, group_sizes):
  # Each group's rows selected on both sides, not multiplied by a 0/1 mask: 0 * NaN is NaN, so a non-finite row of one
  # group would reach every group's sum.
  own = jax.nn.one_hot(_row_groups(lhs.shape[0], group_sizes), group_sizes.shape[0], dtype=jnp.bool_).T[:, :, None]
  lhs, rhs = (jnp.where(own, a[None], 0.0) for a in (lhs, rhs))                                 # [G, M, K], [G, M, N]
  return jnp.einsum("gmk,gmn->gkn", lhs, rhs, precision=jax.lax.Precision.HIGHEST)


def _kernel_rows(lhs_q, lhs_s, w, group_sizes, out_dtype=jnp.float32):
  return grouped_matmul_fp8(lhs_q, lhs_s, w.values, w.scales, group_sizes, preferred_element_type=out_dtype)


def _kernel_columns(v, tiles):
  return quantize_columns_fp8(v, tiles)


def _kernel_outer(lhs, rhs, tiles, group_sizes, out_dtype=jnp.float32):
  return grouped_outer_fp8_packed(lhs, rhs, group_sizes, preferred_element_type=out_dtype)


def _switched_call(call, xla, on_gpu: bool):
  """call() on CPUs, and on GPUs where its switch is on (on_gpu, read when traced), else xla(): GPUs keep XLA's ops
  for the same step while the custom call's kernel is not the faster one there (or has not passed its GPU test)."""
  return jax.lax.platform_dependent(cpu=call, default=call if on_gpu else xla)


def _kernel_swiglu_forward(a):
  return swiglu_forward_fp8(a)


# Whether GPUs give the SwiGLU backward's kernel a bfloat16 dh as it is (its DhT = bfloat16 instance) rather than
# widened to float32 first by XLA (exact_float32: the same values, also where a fused dispatch's float32 dh was rounded
# just before; the float32 instance: one more pass over dh, and a float32 [rows, F] temporary). CPUs always do. On:
# the instance passes its GPU test (tests/gpu/test_gpu_swiglu_backward_fp8.py), and the FP8 layer is faster with it
# and needs 0.25 GiB less at the training preset (docs/performance.md, "The dgrads' weights and dh on a GPU").
BF16_DH_KERNEL_ON_GPU = True


def _kernel_swiglu_backward(aq, a_s, dh, tiles):
  def call(d):
    da_rows, da_cols, h_cols = swiglu_backward_fp8(aq, a_s, d, tiles)
    return h_cols, da_rows, da_cols

  if dh.dtype == jnp.float32:
    return call(dh)
  return _switched_call(lambda: call(dh), lambda: call(exact_float32(dh)), BF16_DH_KERNEL_ON_GPU)


# Whether GPUs give the wgrads' row-quantized x and dy to the column quantizer as they are (its CUDA kernel on e4m3
# rows: QuantizeColumnsLean<RowsE4m3>, which passes tests/gpu/test_gpu_quantize_columns_fp8.py) instead of
# dequantizing them in XLA and quantizing the float32 rows: the same bits, one byte read per value instead of four
# and no dequantization pass (docs/performance.md, "Where the FP8 step goes"). CPUs always take it.
ROW_QUANTIZED_COLUMNS_ON_GPU = True


def _kernel_row_columns(q, s, tiles):
  def from_rows():
    return quantize_columns_fp8((q, s), tiles)

  def dequantized():
    return quantize_columns_fp8(fp8.dequantize_rows(q, s), tiles)

  if q.shape[1] % ROWS_E4M3_CHANNELS:  # the call takes row-quantized rows of whole 256-channel items only
    return dequantized()
  return _switched_call(from_rows, dequantized, ROW_QUANTIZED_COLUMNS_ON_GPU)


# Whether GPUs quantize the expert weights by the custom call (grouped_gemm.quantize_weight_fp8: one pass over each
# weight, ffi/cuda/ops/quantize_weight.cu) instead of XLA's transposes, amax reductions and quantizations of
# fp8.quantize_weight: the rule's bits, from which XLA:GPU's inexact division parts in a few bytes
# (tests/gpu/test_gpu_quantize_weight_fp8.py); the forward a quarter faster at Mixtral-like and DeepSeek-like sizes, the forward + backward level
# (docs/performance.md, "FP8 layer at EP = 1"). CPUs always take the call.
WEIGHT_QUANTIZER_ON_GPU = True

# Whether the backward makes the dgrads' weights from the master weights (quantize_weight untransposed: the forward
# then keeps no quantized copy of them) instead of transposing the quantized copies the forward kept (exact: the same
# bits). A trade of memory (3 E D F bytes of e4m3 per layer kept) for a second pass over each master weight; off while
# that pass costs more than the transposes (docs/performance.md, "FP8 layer at EP = 1").
BACKWARD_REQUANTIZES_WEIGHTS = False


def _kernel_quantize_weight(w, transposed=True):
  return _switched_call(lambda: quantize_weight_fp8(w, transposed=transposed),
                        lambda: xla_quantize_weight(w, transposed), WEIGHT_QUANTIZER_ON_GPU)


def _kernel_requantizes_weights():
  return BACKWARD_REQUANTIZES_WEIGHTS


# Whether the forward quantizes each master weight in both layouts (Gemms.quantize_weight_pair: the forward's
# Fp8Weight of W and the dgrads' of W^T) and keeps the dgrads' copy, instead of keeping the forward's and transposing
# it in the backward (fp8.transpose_weight: each e4m3 byte read back and written again): the same bits and the same
# kept bytes (one e4m3 copy of each weight); on GPUs, as WEIGHT_PAIR_KERNEL_ON_GPU is off, the transposes move to
# the forward, as fast or a little faster (docs/performance.md, "The dgrads' weights and dh on a GPU").
FORWARD_QUANTIZES_DGRAD_WEIGHTS = True


# Whether GPUs run the pair form's kernel (QuantizeWeightKernel's both-layouts instances: the second layout from the
# same read of w) rather than the single-layout call and XLA's transpose of its output (the same bits). CPUs always
# do. Off: the instances pass their GPU test (tests/gpu/test_gpu_quantize_weight_fp8.py) but take 17-19% longer than
# the call and the transpose (docs/performance.md, "The dgrads' weights and dh on a GPU").
WEIGHT_PAIR_KERNEL_ON_GPU = False


def _kernel_quantize_weight_pair(w):
  def transposed_copy():
    wq = _kernel_quantize_weight(w)
    return wq, fp8.transpose_weight(wq)

  return _switched_call(lambda: quantize_weight_fp8_pair(w), transposed_copy,
                        WEIGHT_QUANTIZER_ON_GPU and WEIGHT_PAIR_KERNEL_ON_GPU)


# Whether GPUs run GEMM1 with the SwiGLU forward in its epilogue (grouped_matmul_swiglu_fp8's kernel,
# gemm/sm90/wgmma_swiglu_fp8.cuh: no float32 a in memory) instead of the two calls: the same bits
# (tests/gpu/test_gpu_grouped_matmul_swiglu_fp8.py), 5% faster (benchmarks/bench_gemm1_swiglu_fp8.py); CPUs take the
# fused call.
FUSED_GEMM1_SWIGLU_ON_GPU = True


def _kernel_rows_swiglu(lhs_q, lhs_s, w, group_sizes, keep_a=True):
  def fused():
    return grouped_matmul_swiglu_fp8(lhs_q, lhs_s, w.values, w.scales, group_sizes, keep_a)

  def composed():
    h_rows, a_rows = _kernel_swiglu_forward(_kernel_rows(lhs_q, lhs_s, w, group_sizes))
    return h_rows, (a_rows if keep_a else None)

  return _switched_call(fused, composed, FUSED_GEMM1_SWIGLU_ON_GPU)


DENSE = _on_dequantized("dense", _dense_rows, _dense_outer)
RAGGED = _on_dequantized("ragged_dot", ragged_matmul_f32, ragged_outer_f32)
KERNELS = Gemms("kernels", _kernel_rows, _kernel_columns, _kernel_outer, _kernel_swiglu_forward,
                _kernel_swiglu_backward, _kernel_row_columns, _kernel_quantize_weight, _kernel_requantizes_weights,
                _kernel_rows_swiglu, _kernel_quantize_weight_pair)


def _bf16_columns(v, tiles):
  del tiles
  return v.astype(jnp.bfloat16)


def _bf16_row_columns(q, s, tiles):
  """x and dy in bfloat16, exactly: their scales are powers of two and an e4m3 value has 4 significant bits."""
  del tiles
  return fp8.dequantize_rows(q, s).astype(jnp.bfloat16)


def bf16_wgrad(gemms: Gemms, outer: Callable) -> Gemms:
  """``gemms`` with the two weight gradients on bfloat16 operands (quantization="fp8_bf16_wgrad"): dW2 = h^T dy and
  dW1 = x^T da by ``outer`` (bfloat16 [M, K] and [M, N], group_sizes, out_dtype -> [G, K, N] in out_dtype, summed in
  float32), x and dy the
  dequantized rows (exact), h and da rounded from float32. The forward and the two dgrads stay the recipe's FP8 GEMMs;
  no operand is re-quantized 128 x 1 (docs/design.md, "FP8")."""
  return dataclasses.replace(gemms, name=f"{gemms.name}, bf16 wgrad", columns=_bf16_columns,
                             outer=lambda lhs, rhs, tiles, group_sizes, out_dtype=jnp.float32: outer(
                                 lhs, rhs, group_sizes, out_dtype),
                             swiglu_backward=swiglu_backward_composed(_bf16_columns), row_columns=_bf16_row_columns)


def _dense_outer_bf16(lhs, rhs, group_sizes, out_dtype):
  return _dense_outer(lhs.astype(jnp.float32), rhs.astype(jnp.float32), group_sizes).astype(out_dtype)


def _ragged_outer_bf16(lhs, rhs, group_sizes, out_dtype):
  return ragged_outer_f32(lhs, rhs, group_sizes).astype(out_dtype)


# The recipe's GEMMs per backend and quantization (checks.QUANTIZATIONS' FP8 modes): "dense" is the oracle
# (impl="reference"), "ragged_dot" impl="xla", "kernels" impl="collective" and "overlap".
_GEMMS = {
    ("dense", "fp8"): DENSE,
    ("ragged_dot", "fp8"): RAGGED,
    ("kernels", "fp8"): KERNELS,
    ("dense", "fp8_bf16_wgrad"): bf16_wgrad(DENSE, _dense_outer_bf16),
    ("ragged_dot", "fp8_bf16_wgrad"): bf16_wgrad(RAGGED, _ragged_outer_bf16),
    ("kernels", "fp8_bf16_wgrad"): bf16_wgrad(KERNELS, expert_gemms.outer),
}


def recipe_gemms(backend: str, quantization: str) -> Gemms:
  """The ``Gemms`` of ``backend`` ("dense", "ragged_dot", "kernels") under ``quantization`` ("fp8",
  "fp8_bf16_wgrad")."""
  return _GEMMS[backend, quantization]


def _weight_cotangent_template(w):
  """What the backward needs to return w's cotangent: None for a pre-quantized weight (zero cotangents of the
  Fp8Weight the residuals hold), else an empty array of the master weight's dtype."""
  return None if isinstance(w, fp8.Fp8Weight) else jnp.zeros((0,), w.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DgradWeight:
  """What the forward keeps of a weight when it made the dgrads' copy itself (``FORWARD_QUANTIZES_DGRAD_WEIGHTS``):
  ``weight``, the ``Fp8Weight`` of W^T, which the dgrads read as it is."""

  weight: fp8.Fp8Weight


def _weight_of(w, gemms, keep=True):
  """A weight as the forward reads it and what the backward keeps of it for the dgrads: an ``Fp8Weight`` as given
  (kept too: the backward transposes it); a master weight quantized by the backend, then kept: the master weight
  itself where the backend re-quantizes it in the backward (an array the caller holds anyway: no memory of the
  forward's); the dgrads' copy (a ``DgradWeight``) where the forward made both layouts from one read (keep, a pair
  form and ``FORWARD_QUANTIZES_DGRAD_WEIGHTS``); else the forward's ``Fp8Weight``. Without keep (nothing
  differentiates the forward) the forward's form alone, and None kept."""
  if isinstance(w, fp8.Fp8Weight):
    return w, w
  if not keep:
    return gemms.quantize_weight(w), None
  if gemms.requantizes_weights():
    return gemms.quantize_weight(w), w
  if gemms.quantize_weight_pair is not None and FORWARD_QUANTIZES_DGRAD_WEIGHTS:
    wq, wt = gemms.quantize_weight_pair(w)
    return wq, DgradWeight(wt)
  wq = gemms.quantize_weight(w)
  return wq, wq


def _dgrad_weight(kept, gemms):
  """The dgrads' weight (the ``Fp8Weight`` of W^T) from what the forward kept: the dgrads' copy as it is, a kept
  ``Fp8Weight`` transposed (exact), a master weight quantized in its own layout (the same bits all three)."""
  if isinstance(kept, DgradWeight):
    return kept.weight
  if isinstance(kept, fp8.Fp8Weight):
    return fp8.transpose_weight(kept)
  return gemms.quantize_weight(kept, transposed=False)


def recipe_weights(w1, w2, gemms, keep=True):
  """The weights as the forward reads them (``Fp8Weight`` of W1 and W2: as given, or quantized by the backend) and
  what the backward keeps of them for the dgrads (``_weight_of``): ((w1q, w2q), (w1 kept, w2 kept))."""
  (w1q, k1), (w2q, k2) = _weight_of(w1, gemms, keep), _weight_of(w2, gemms, keep)
  return (w1q, w2q), (k1, k2)


def recipe_kept(x_rows, a_rows, w1, w2, kept_weights, group_sizes):
  """What the backward keeps of a forward: x_rows (x quantized: (values, scales), or its packed rows [M, D + D/32]
  as a fused dispatch left them, ``fp8.pack_rows``' format), a_rows (a quantized), the weights as
  ``recipe_weights`` kept them, group_sizes, and the weights' cotangent templates (of w1 and w2, the forward's
  arguments)."""
  return (x_rows, a_rows, *kept_weights, group_sizes, _weight_cotangent_template(w1), _weight_cotangent_template(w2))


def recipe_gemm1(xq, xs, w1, w2, group_sizes, gemms, keep=True):
  """The forward up to GEMM2's operands, from x quantized (1 x 128, power-of-two scales): (h quantized (1 x 128: its
  values and scales), w2 as GEMM2 reads it (an ``Fp8Weight``), what the backward keeps; without keep (nothing
  differentiates the forward) a and the dgrads' weights are left out of it)."""
  (w1q, w2q), kept_weights = recipe_weights(w1, w2, gemms, keep)
  h_rows, a_rows = gemms.gemm1_swiglu(xq, xs, w1q, group_sizes, keep)
  return h_rows, w2q, recipe_kept((xq, xs), a_rows, w1, w2, kept_weights, group_sizes)


def recipe_forward(xq, xs, w1, w2, group_sizes, gemms, out_dtype, keep=True):
  """The forward from x quantized (1 x 128, power-of-two scales): (out [M, D] in out_dtype, what the backward
  keeps; keep as ``recipe_gemm1``'s)."""
  h_rows, w2q, kept = recipe_gemm1(xq, xs, w1, w2, group_sizes, gemms, keep)
  return gemms.rows(*h_rows, w2q, group_sizes, out_dtype), kept


def _quantized_rows(rows):
  """Quantized rows as (values, scales), from that pair or from their packed form (``fp8.pack_rows``)."""
  return rows if isinstance(rows, tuple) else fp8.unpack_rows(rows)


def recipe_dgrad_weight(kept, gemms):
  """W2^T as dh = dy W2^T reads it (an ``Fp8Weight``), from what the forward kept."""
  return _dgrad_weight(kept[3], gemms)


def recipe_ffn_columns(kept) -> int:
  """F, h's columns (dh = dy W2^T's), from what the forward kept (a quantized: [rows, 2F])."""
  return kept[1][0].shape[1] // 2


def recipe_dgrad_operands(gemms, kept, dy_rows, compute_dtype, dh=None):
  """The backward up to the input gradient's GEMM, from the output gradient quantized (1 x 128, power-of-two
  scales: (values, scales), or packed rows as a fused dispatch left them) and dh = dy W2^T (float32) where the caller
  computed it (a fused dispatch), else computed here: (da quantized 1 x 128 (its values and scales), W1^T as that
  GEMM reads it (an ``Fp8Weight``), w1's cotangent, w2's cotangent). dx = da W1^T. dh goes to the SwiGLU's
  backward in ``expert_gemms.dgrad_dtype(compute_dtype)`` (the layer's compute dtype: x's), a caller's float32 dh
  rounded to it as the GEMM here rounds its sums: the same bits either way."""
  (x_rows, (aq, a_s), w1_kept, w2_kept, group_sizes, w1_like, w2_like) = kept
  xq, xs = _quantized_rows(x_rows)
  dyq, dys = _quantized_rows(dy_rows)
  tiles = fp8.column_tiles(dyq.shape[0], group_sizes)

  # Each weight gradient in its master weight's dtype (a pre-quantized weight's cotangent is zeros: float32 there).
  w1_dtype, w2_dtype = (jnp.float32 if like is None else like.dtype for like in (w1_like, w2_like))
  dh_dtype = expert_gemms.dgrad_dtype(compute_dtype)
  if dh is None:
    dh = gemms.rows(dyq, dys, recipe_dgrad_weight(kept, gemms), group_sizes, dh_dtype)
  h_cols, da_rows, da_cols = gemms.swiglu_backward(aq, a_s, dh.astype(dh_dtype), tiles)
  dw2 = gemms.outer(h_cols, gemms.columns_of_rows(dyq, dys, tiles), tiles, group_sizes, w2_dtype)
  dw1 = gemms.outer(gemms.columns_of_rows(xq, xs, tiles), da_cols, tiles, group_sizes, w1_dtype)

  def weight_ct(dw, like, w_kept):
    return jax.tree.map(jnp.zeros_like, w_kept) if like is None else dw

  return (da_rows, _dgrad_weight(w1_kept, gemms), weight_ct(dw1, w1_like, w1_kept),
          weight_ct(dw2, w2_like, w2_kept))


def recipe_backward(gemms, kept, dy_rows, dx_dtype, dh=None):
  """The backward from the output gradient quantized (1 x 128, power-of-two scales; dy_rows and dh as
  ``recipe_dgrad_operands`` takes them): (dx [M, D] in dx_dtype, the layer's compute dtype; w1's cotangent, w2's
  cotangent)."""
  da_rows, w1_t, dw1, dw2 = recipe_dgrad_operands(gemms, kept, dy_rows, dx_dtype, dh)
  return gemms.rows(*da_rows, w1_t, kept[4], dx_dtype), dw1, dw2


def _forward(x, w1, w2, group_sizes, gemms, keep=True):
  return recipe_forward(*fp8.quantize_rows(x, pow2=True), w1, w2, group_sizes, gemms, x.dtype, keep)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def fp8_expert_mlp(x, w1, w2, group_sizes, gemms: Gemms):
  """The FP8 expert MLP on rows grouped by expert.

  Args:
    x: [M, D] float32 or bfloat16, rows grouped by expert (zero past the last group). w1: [E, D, 2F] and w2:
      [E, F, D], float arrays (master weights, quantized on each call) or ``fp8.Fp8Weight``. group_sizes: [E] int32
      rows per expert (their sum <= M). gemms: ``DENSE``, ``RAGGED`` or ``KERNELS``. D and F multiples of 128.
  Returns:
    [M, D] in x's dtype.
  """
  return _forward(x, w1, w2, group_sizes, gemms, keep=False)[0]


def _fp8_expert_mlp_fwd(x, w1, w2, group_sizes, gemms):
  return _forward(x, w1, w2, group_sizes, gemms)


def _fp8_expert_mlp_bwd(gemms, kept, d_out):
  dx, dw1, dw2 = recipe_backward(gemms, kept, fp8.quantize_rows(d_out, pow2=True), d_out.dtype)
  group_sizes = kept[4]
  return dx, dw1, dw2, np.zeros(group_sizes.shape, jax.dtypes.float0)


fp8_expert_mlp.defvjp(_fp8_expert_mlp_fwd, _fp8_expert_mlp_bwd)

