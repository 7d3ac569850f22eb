"""NumPy and ml_dtypes twins of jax_moe_overlap/fp8.py's rules and of the FP8 recipe (fp8_experts.py), written from
their docstrings with other means (float64 logarithms for the power-of-two scales, explicit per-group padding for the
128 x 1 tiles, a loop over experts, the SwiGLU derivative by hand), for the tests to hold the JAX code against."""

from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
MAX = np.float32(448.0)
MAX_INV = np.float32(1.0 / 448.0)
FLOOR = np.float32(2.0 ** -126)


def scale(amax, pow2=False):
  """float32 tile scales: max(amax * float32(1 / 448), 2^-126), with pow2 2^ceil(log2(.)) (log2 in float64: exact at powers of
  two, and a float32 that is not one lies more than 1e-7 of an octave above the power below it)."""
  s = np.maximum(np.asarray(amax, np.float32) * MAX_INV, FLOOR).astype(np.float32)
  if pow2:
    with np.errstate(invalid="ignore"):
      p = np.exp2(np.ceil(np.log2(s.astype(np.float64)))).astype(np.float32)
    s = np.where(np.isfinite(s), p, s)
  return s


def quantize(x, s):
  """e4m3 of clip(x / s) (float32 division, ml_dtypes' round to nearest even)."""
  with np.errstate(invalid="ignore"):           # NaN from non-finite input, as fp8.py gives
    return np.clip(np.asarray(x, np.float32) / s, -MAX, MAX).astype(E4M3)


def dequantize(q, s):
  with np.errstate(invalid="ignore"):
    return (q.astype(np.float32) * s).astype(np.float32)


def rows(x, pow2=False):
  """1 x 128: (q [..., C], s [..., C / 128])."""
  t = np.asarray(x, np.float32).reshape(*x.shape[:-1], -1, 128)
  s = scale(np.abs(t).max(-1), pow2)
  return quantize(t, s[..., None]).reshape(x.shape), s


def rows_qdq(x, pow2=False):
  q, s = rows(x, pow2)
  t = q.reshape(*q.shape[:-1], -1, 128)
  return dequantize(t, s[..., None]).reshape(q.shape)


def blocks(w):
  """128 x 128 of the last two axes: (q [..., K, N], s [..., K / 128, N / 128])."""
  *lead, K, N = w.shape
  b = np.asarray(w, np.float32).reshape(*lead, K // 128, 128, N // 128, 128)
  s = scale(np.abs(b).max(axis=(-3, -1)))
  return quantize(b, s[..., :, None, :, None]).reshape(w.shape), s


def blocks_qdq(w):
  q, s = blocks(w)
  *lead, K, N = w.shape
  b = q.reshape(*lead, K // 128, 128, N // 128, 128)
  return dequantize(b, s[..., :, None, :, None]).reshape(w.shape)


def columns(x, sizes):
  """128 x 1 tiles of each group of rows, the group padded with zero rows to a multiple of 128: (q [M, C], the list
  of each group's scales [tiles_g, C]); rows past the groups quantize to zero."""
  x = np.asarray(x, np.float32)
  q = np.zeros(x.shape, E4M3)
  scales, r0 = [], 0
  for n in sizes:
    n = int(n)
    pad = -(-n // 128) * 128
    g = np.zeros((pad, x.shape[1]), np.float32)
    g[:n] = x[r0:r0 + n]
    s = scale(np.abs(g.reshape(-1, 128, x.shape[1])).max(1))
    q[r0:r0 + n] = quantize(g.reshape(-1, 128, x.shape[1]), s[:, None, :]).reshape(pad, x.shape[1])[:n]
    scales.append(s)
    r0 += n
  return q, scales


def columns_qdq(x, sizes):
  q, scales = columns(x, sizes)
  out, r0 = np.zeros(x.shape, np.float32), 0
  for n, s in zip(sizes, scales):
    n = int(n)
    out[r0:r0 + n] = dequantize(q[r0:r0 + n], np.repeat(s, 128, axis=0)[:n])
    r0 += n
  return out


def _sigmoid(v):
  return 1.0 / (1.0 + np.exp(-v))


def recipe(x, w1, w2, sizes, d_out):
  """The FP8 recipe on rows grouped by expert, GEMMs on the dequantized operands in float64: (out [M, D] float64,
  dx, dw1, dw2) for the output gradient d_out [M, D]. x, d_out as the layer holds them (float32 values)."""
  M, D = x.shape
  E, _, F2 = w1.shape
  F = F2 // 2
  W1, W2 = blocks_qdq(w1).astype(np.float64), blocks_qdq(w2).astype(np.float64)
  xd = rows_qdq(x, pow2=True)
  group = np.repeat(np.arange(E), sizes)
  a = np.zeros((M, F2), np.float32)
  out, dh = np.zeros((M, D)), np.zeros((M, F))
  dy = rows_qdq(d_out, pow2=True)
  for r, e in enumerate(group):
    a[r] = xd[r].astype(np.float64) @ W1[e]
  gate, up = a[:, :F].astype(np.float64), a[:, F:].astype(np.float64)
  h = rows_qdq((gate * _sigmoid(gate) * up).astype(np.float32))
  ac = rows_qdq(a).astype(np.float64)                                     # the kept FP8 SwiGLU input
  gate_c, up_c = ac[:, :F], ac[:, F:]
  h_c = (gate_c * _sigmoid(gate_c) * up_c).astype(np.float32)             # recomputed for the backward
  for r, e in enumerate(group):
    out[r] = h[r].astype(np.float64) @ W2[e]
    dh[r] = dy[r].astype(np.float64) @ W2[e].T
  sig = _sigmoid(gate_c)
  da = np.concatenate([dh * up_c * sig * (1 + gate_c * (1 - sig)), dh * gate_c * sig], axis=1).astype(np.float32)
  daq = rows_qdq(da).astype(np.float64)
  dx = np.zeros((M, D))
  for r, e in enumerate(group):
    dx[r] = daq[r] @ W1[e].T
  hc, dyc = columns_qdq(h_c, sizes).astype(np.float64), columns_qdq(dy, sizes).astype(np.float64)
  xc, dac = columns_qdq(xd, sizes).astype(np.float64), columns_qdq(da, sizes).astype(np.float64)
  dw1, dw2 = np.zeros((E, D, F2)), np.zeros((E, F, D))
  for e in range(E):
    m = group == e
    dw1[e] = xc[:len(group)][m].T @ dac[:len(group)][m]
    dw2[e] = hc[:len(group)][m].T @ dyc[:len(group)][m]
  return out, dx, dw1, dw2


def block_scaled_grouped_gemm(lhs_q, lhs_s, rhs_q, rhs_s, sizes, out_dtype=np.float32):
  """The FP8 grouped GEMM's emulation (grouped_matmul_fp8's CPU handler, ffi/cpu/grouped_gemm.cc) restated: lhs_q [M, K]
  e4m3 with lhs_s [M, K / 128]; rhs_q [G, N, K] e4m3 with rhs_s [G, N / 128, K / 128]. Per 128-wide K chunk the exact
  sum of the products (float64: exact for e4m3 operands), rounded to float32, times the float32 product of the two
  scales and added to a float32 accumulator in one rounding (an FMA: the product and the sum in float64, then rounded
  to float32; that double rounding can differ from a true FMA only on a float32 tie, which random operands never
  hit). Rows past the groups are zero."""
  M, K = lhs_q.shape
  G, N, _ = rhs_q.shape
  a = lhs_q.astype(np.float64).reshape(M, K // 128, 128)
  out = np.zeros((M, N), np.float32)
  off = 0
  for g, n in enumerate(sizes):
    rows = slice(off, off + n)
    b = rhs_q[g].astype(np.float64).reshape(N, K // 128, 128)
    acc = np.zeros((n, N), np.float32)
    for c in range(K // 128):
      part = (a[rows, c] @ b[:, c].T).astype(np.float32)        # exact in float64 in any order, then one rounding
      scale = (lhs_s[rows, c][:, None] * np.repeat(rhs_s[g][:, c], 128)[None]).astype(np.float32)
      acc = (part.astype(np.float64) * scale + acc).astype(np.float32)
    out[rows] = acc
    off += n
  return out.astype(out_dtype)


def outer_fp8(lhs_q, lhs_scales, rhs_q, rhs_scales, sizes, out_dtype=np.float32):
  """The FP8 weight-gradient GEMM's emulation (grouped_outer_fp8's CPU handler) restated on ``columns``' outputs:
  lhs_q [M, K] and rhs_q [M, N] e4m3, each with its list of per-group scales [tiles_g, C]. Per group, rows padded with
  zeros to a multiple of 128; per 128-row chunk the exact sum of the products (float64), rounded to float32, times
  the float32 product of the two channels' scales, added to a float32 accumulator in one rounding (as
  block_scaled_grouped_gemm). [G, K, N]; zero for a group without rows."""
  K, N = lhs_q.shape[1], rhs_q.shape[1]
  out = np.zeros((len(sizes), K, N), np.float32)
  off = 0
  for g, n in enumerate(sizes):
    n = int(n)
    tiles = -(-n // 128)
    a = np.zeros((tiles * 128, K))
    b = np.zeros((tiles * 128, N))
    a[:n] = lhs_q[off:off + n].astype(np.float64)
    b[:n] = rhs_q[off:off + n].astype(np.float64)
    acc = np.zeros((K, N), np.float32)
    for c in range(tiles):
      rows = slice(128 * c, 128 * c + 128)
      part = (a[rows].T @ b[rows]).astype(np.float32)
      scale = (lhs_scales[g][c][:, None] * rhs_scales[g][c][None, :]).astype(np.float32)
      acc = (part.astype(np.float64) * scale + acc).astype(np.float32)
    out[g] = acc
    off += n
  return out.astype(out_dtype)
