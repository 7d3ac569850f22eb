"""FP8 quantization: the one definition of the formats, tiles, scale rules and rounding of ``quantization="fp8"``
(DeepSeek-V3's recipe, arXiv 2412.19437 section 3.3). The recipe (``fp8_experts.py``), the oracle and the XLA path
quantize with these functions only; kernels and CPU handlers that quantize restate exactly these rules and are tested
against them.

Format: e4m3 values (``float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, no infinities, largest finite 448) with
one float32 scale per tile; a value stands for ``float32(q) * s`` (one float32 product, rounded to nearest even).

Tiles (``TILE`` = 128):
  rows     1 x 128: per row (token), per 128 consecutive channels: activations and activation gradients, the
           operands whose reduction runs along their channels (``quantize_rows``).
  blocks   128 x 128 of a weight [..., K, N]: the weights (``quantize_blocks``). A block of W^T is the transpose of a
           block of W with the same amax, so the transposed copy of a quantized weight is exact.
  columns  128 x 1: per channel, per 128 consecutive rows of one group (an expert's rows), each group starting a new
           tile as if padded with zeros to a multiple of 128: the weight-gradient operands, whose reduction runs
           along the rows (``quantize_columns``).

Scale of a tile whose largest magnitude is amax (float32):
  s = max(amax * r, 2^-126)             r = float32(1 / 448) (0.00223214296), the product rounded to nearest even:
                                        a multiplication, not a division by 448, because compilers (XLA among them)
                                        turn a division by a constant into that multiplication. The floor (the
                                        smallest normal float32) keeps s normal, so an all-zero tile gets s = 2^-126
                                        and all-zero q.
  power-of-two tiles:  s = 2^ceil(log2(s)), exact on s's float32 bits: the exponent field, plus one when any mantissa
                       bit is set. The recipe takes them for the rows dispatched to the experts and the activation
                       gradients dispatched before GEMM2's backward (section 3.3.3), so that their dequantized values
                       are exact in float32 (and in bfloat16: four significant bits) and re-tiling them (1 x 128 to 128 x 1 for
                       the weight gradients) adds no rounding of the scale.
Value: q = e4m3(clip(x / s, -448, 448)): float32 division, then one rounding to e4m3, to nearest, ties to even
(``round_e4m3``). Since |x| <= amax, |x / s| exceeds 448 at most by the roundings of s (a few float32 ulps, which
round to 448 anyway); the clip states the saturation for every input. A NaN in a tile makes its scale NaN and every value of the tile NaN; an infinity makes
the scale infinite and the infinity itself NaN: non-finite input never becomes finite numbers.

``Fp8Weight`` is a quantized expert weight as the layer takes it pre-quantized (``quantize_weights``): values stored
K-major, the layout Hopper's FP8 wgmma reads its B operand in (docs/design.md, "FP8").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0          # the largest finite float8_e4m3fn
E4M3_MAX_INV = np.float32(1.0 / E4M3_MAX)   # r of the scale rule
TILE = 128                # channels of a row tile, rows of a column tile, each side of a weight block
SCALE_FLOOR = 2.0 ** -126  # the smallest normal float32: the least scale of a tile

_EXPONENT_BITS = 0x7F800000
_MANTISSA_BITS = 0x007FFFFF


def _check_tiles(what: str, extent: int) -> None:
  if extent % TILE:
    raise ValueError(f"jax_moe_overlap: FP8 quantization tiles {what} by {TILE}: it must be a multiple of {TILE}, "
                     f"got {extent}")


def round_e4m3(v: jax.Array) -> jax.Array:
  """float32 values -> e4m3: clipped to [-448, 448] (saturation), then rounded to nearest, ties to even."""
  return jnp.clip(v, -E4M3_MAX, E4M3_MAX).astype(E4M3)


def tile_scale(amax: jax.Array, pow2: bool = False) -> jax.Array:
  """Scales of tiles with these float32 amaxes (the module's rule): max(amax * float32(1 / 448), 2^-126), and with
  ``pow2`` the least power of two >= that."""
  s = jnp.maximum(amax.astype(jnp.float32) * E4M3_MAX_INV, jnp.float32(SCALE_FLOOR))
  if not pow2:
    return s
  bits = jax.lax.bitcast_convert_type(s, jnp.uint32)
  up = jnp.where((bits & _MANTISSA_BITS) != 0, jnp.uint32(1 << 23), jnp.uint32(0))
  p = jax.lax.bitcast_convert_type((bits & _EXPONENT_BITS) + up, jnp.float32)
  return jnp.where(jnp.isfinite(s), p, s)   # s <= 2^120 when finite: no carry into the infinities


def tile_amax(t: jax.Array, axis) -> jax.Array:
  """The float32 amax of tiles along ``axis``: max |t|, NaN where the tile holds a NaN (the module's rule).
  XLA:CPU's max reduction can drop a NaN (a 128 x 128 block, or a row tile at channel 0, holding one NaN gets a
  finite jnp.max there), so on CPU the NaN is found by a reduction of its own; XLA:GPU's max keeps it, and the GPU
  program (the FP8 layer's row quantization of x and dy runs here) is the plain reduction."""
  plain = lambda t: jnp.max(jnp.abs(t), axis=axis)
  with_nan = lambda t: jnp.where(jnp.any(jnp.isnan(t), axis=axis), jnp.float32(jnp.nan), plain(t))
  return jax.lax.platform_dependent(t, cpu=with_nan, default=plain)


def _quantize(x, s):
  return round_e4m3(x.astype(jnp.float32) / s)


# The float32 value of each e4m3 byte (0x7F and 0xFF: NaN). Dequantization reads a value's bits from this table
# instead of converting the e4m3 array back to float32: XLA:GPU, whose excess-precision simplification is on by default
# (xla_allow_excess_precision), removes a float32 -> e4m3 -> float32 pair of converts together with its rounding, so a
# plain convert would leave the emulation unquantized on GPUs. A table lookup on the bits cannot be folded that way and
# gives the same values everywhere.
_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _explicit_sharding(a: jax.Array):
  """a's NamedSharding where a lies on a mesh with Explicit axes (jax.make_mesh's default), whose reshapes and
  gathers must be told their output's sharding; else None (Auto axes, a shard_map's local arrays, one device)."""
  sharding = jax.typeof(a).sharding
  if any(t == jax.sharding.AxisType.Explicit for t in getattr(getattr(sharding, "mesh", None), "axis_types", ())):
    return sharding
  return None


def _whole_blocks(mesh, entry, blocks: int):
  """The sharding entry (a mesh axis, a tuple of them, or None) that an axis of ``blocks`` 128-wide blocks keeps,
  split from an axis sharded as ``entry``: kept where every device holds whole blocks, else None (the axis whole)."""
  if entry is None:
    return None
  size = int(np.prod([mesh.shape[n] for n in (entry if isinstance(entry, tuple) else (entry,))]))
  return entry if blocks % size == 0 else None


def e4m3_values(q: jax.Array) -> jax.Array:
  """e4m3 values -> float32, exactly (from their bits; see _E4M3_VALUES), in q's sharding."""
  bits = jax.lax.bitcast_convert_type(q, jnp.uint8)
  sharding = _explicit_sharding(bits)
  if sharding is None:
    return jnp.asarray(_E4M3_VALUES)[bits]
  return jnp.asarray(_E4M3_VALUES).at[bits].get(out_sharding=sharding)


def _dequantize(q, s):
  return e4m3_values(q) * s


def quantize_rows(x: jax.Array, pow2: bool = False) -> tuple[jax.Array, jax.Array]:
  """1 x 128 tiles along the last axis: x [..., C] -> (q [..., C] e4m3, s [..., C / 128] float32)."""
  C = x.shape[-1]
  _check_tiles("the channels of a row", C)
  t = x.astype(jnp.float32).reshape(*x.shape[:-1], C // TILE, TILE)
  s = tile_scale(tile_amax(t, -1), pow2)
  return quantize_rows_by(x, s), s


def quantize_rows_by(x: jax.Array, s: jax.Array) -> jax.Array:
  """x [..., C] -> q [..., C] e4m3 by the scales s [..., C / 128] of its 1 x 128 tiles (found by the scale rule)."""
  t = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // TILE, TILE)
  return _quantize(t, s[..., None]).reshape(x.shape)


def rounded(v: jax.Array, dtype) -> jax.Array:
  """float32 v rounded to ``dtype``'s values (to nearest even, as the conversion rounds), in float32. For bfloat16 a
  reduce_precision, which XLA keeps: a float32 -> bfloat16 -> float32 round trip it may fold away (its
  xla_allow_excess_precision, on by default), handing on values no bfloat16 array holds."""
  v = v.astype(jnp.float32)
  if jnp.dtype(dtype) == jnp.float32:
    return v
  if jnp.dtype(dtype) == jnp.bfloat16:
    return jax.lax.reduce_precision(v, exponent_bits=8, mantissa_bits=7)
  return v.astype(dtype).astype(jnp.float32)


def dequantize_rows(q: jax.Array, s: jax.Array) -> jax.Array:
  """(q [..., C], s [..., C / 128]) -> float32 [..., C]."""
  t = q.reshape(*q.shape[:-1], q.shape[-1] // TILE, TILE)
  return _dequantize(t, s[..., None]).reshape(q.shape)


def pack_rows(q: jax.Array, s: jax.Array) -> jax.Array:
  """The wire format of quantized rows: (q [N, C] e4m3, s [N, C / 128] float32) -> [N, C + C / 32] uint8, each row
  its C e4m3 values' bytes, then its scales' bytes (each float32 as ``bitcast_convert_type`` lays it out, which
  ``unpack_rows`` reads back on a device of the same byte order). Bytes, so that one exchange moves a row's values
  and scales together, through any collective that moves bytes."""
  N, C = q.shape
  s_bytes = jax.lax.bitcast_convert_type(s, jnp.uint8).reshape(N, C // TILE * 4)
  return jnp.concatenate([jax.lax.bitcast_convert_type(q, jnp.uint8), s_bytes], axis=1)


def unpack_rows(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``pack_rows``'s inverse: [N, C + C / 32] uint8 -> (q [N, C] e4m3, s [N, C / 128] float32). An all-zero row
  (one no rank sent) gives zero values and a zero scale: a zero row dequantized."""
  N, W = rows.shape
  C = W * 32 // 33
  s = jax.lax.bitcast_convert_type(rows[:, C:].reshape(N, C // TILE, 4), jnp.float32)
  return jax.lax.bitcast_convert_type(rows[:, :C], E4M3), s


def _blocked(a):
  """a [..., K, N] -> [..., K / 128, 128, N / 128, 128]. On Explicit axes the leading axes keep their sharding, and
  so do K and N (on their blocks' axes) where each device holds whole blocks, as when F is split over a tensor axis
  in 128-multiples; an axis split across a block is made whole first: a block's amax lies on one device."""
  *lead, K, N = a.shape
  shape = (*lead, K // TILE, TILE, N // TILE, TILE)
  sharding = _explicit_sharding(a)
  if sharding is None:
    return a.reshape(shape)
  spec = tuple(sharding.spec) + (None,) * (a.ndim - len(sharding.spec))
  sk, sn = _whole_blocks(sharding.mesh, spec[-2], K // TILE), _whole_blocks(sharding.mesh, spec[-1], N // TILE)
  if (sk, sn) != spec[-2:]:
    a = jax.sharding.reshard(a, sharding.update(spec=jax.sharding.PartitionSpec(*spec[:-2], sk, sn)))
  return jnp.reshape(a, shape, out_sharding=sharding.update(spec=jax.sharding.PartitionSpec(*spec[:-2], sk, None, sn,
                                                                                            None)))


def _unblocked(b, shape):
  """``_blocked``'s inverse: b [..., K / 128, 128, N / 128, 128] -> ``shape`` [..., K, N], in b's sharding."""
  sharding = _explicit_sharding(b)
  if sharding is None:
    return b.reshape(shape)
  spec = tuple(sharding.spec) + (None,) * (b.ndim - len(sharding.spec))
  return jnp.reshape(b, shape, out_sharding=sharding.update(spec=jax.sharding.PartitionSpec(*spec[:-4], spec[-4],
                                                                                            spec[-2])))


def quantize_blocks(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """128 x 128 blocks of the last two axes: w [..., K, N] -> (q [..., K, N] e4m3, s [..., K / 128, N / 128])."""
  _check_tiles("both axes of a weight matrix", w.shape[-2])
  _check_tiles("both axes of a weight matrix", w.shape[-1])
  b = _blocked(w.astype(jnp.float32))
  s = tile_scale(tile_amax(b, (-3, -1)))
  return _unblocked(_quantize(b, s[..., :, None, :, None]), w.shape), s


def dequantize_blocks(q: jax.Array, s: jax.Array) -> jax.Array:
  """(q [..., K, N], s [..., K / 128, N / 128]) -> float32 [..., K, N]."""
  return _unblocked(_dequantize(_blocked(q), s[..., :, None, :, None]), q.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ColumnTiles:
  """Where the 128 x 1 tiles of ``quantize_columns`` lie: ``rows`` rows grouped as ``group_sizes`` [G] int32
  (consecutive groups from row 0, as ``lax.ragged_dot`` takes them). Row r of group g, at position i within it, lies
  in tile base_g + i // 128, where base_g counts the tiles of the groups before g (group g takes ceil(size_g / 128));
  rows past the last group lie in none. ``count``: the static number of tile rows of the scales, ceil(rows / 128) + G,
  enough for any group sizes; tiles past the groups' are empty. The custom call ``grouped_gemm.quantize_columns_fp8``
  takes the group sizes and ``count`` and restates this rule (ffi/common/fp8_columns.h)."""

  group_sizes: jax.Array
  rows: int = dataclasses.field(metadata=dict(static=True))

  @property
  def count(self) -> int:
    return -(-self.rows // TILE) + self.group_sizes.shape[0]

  @property
  def padded_row(self) -> jax.Array:
    """[rows] int32: each row's place when every group starts at a multiple of 128 (128 * its tile + its place in
    the tile; 128 * ``count`` for a row past the last group): the token-contiguous layout of the FP8 weight-gradient
    GEMM's operands (``grouped_gemm.grouped_outer_fp8``)."""
    G, sizes = self.group_sizes.shape[0], self.group_sizes
    ends = jnp.cumsum(sizes)
    tiles = (sizes + (TILE - 1)) // TILE
    base = jnp.cumsum(tiles) - tiles
    r = jnp.arange(self.rows, dtype=jnp.int32)
    g = jnp.searchsorted(ends, r, side="right").astype(jnp.int32)
    gc = jnp.minimum(g, G - 1)
    padded = TILE * base[gc] + (r - (ends[gc] - sizes[gc]))
    return jnp.where(g < G, padded, TILE * self.count).astype(jnp.int32)

  @property
  def row_tile(self) -> jax.Array:
    """[rows] int32: the tile of each row (``count`` for a row past the last group)."""
    return self.padded_row // TILE


def column_tiles(rows: int, group_sizes: jax.Array) -> ColumnTiles:
  """The 128 x 1 tiles of ``rows`` rows grouped as ``group_sizes`` [G] (``ColumnTiles`` states the rule)."""
  return ColumnTiles(group_sizes.astype(jnp.int32), rows)


def quantize_columns(x: jax.Array, tiles: ColumnTiles) -> tuple[jax.Array, jax.Array]:
  """128 x 1 tiles down the rows of each group: x [M, C] -> (q [M, C] e4m3, s [tiles.count, C] float32). Rows past
  the last group quantize to zero."""
  xf = x.astype(jnp.float32)
  amax = jax.ops.segment_max(jnp.abs(xf), tiles.row_tile, num_segments=tiles.count)   # past-the-end rows dropped
  s = tile_scale(jnp.maximum(amax, 0.0))                                               # an empty tile: -inf
  row_s = jnp.take(s, tiles.row_tile, axis=0, mode="fill", fill_value=1.0)
  inside = (tiles.row_tile < tiles.count)[:, None]
  return jnp.where(inside, _quantize(xf, row_s), jnp.zeros((), E4M3)), s


def token_contiguous(q: jax.Array, tiles: ColumnTiles) -> jax.Array:
  """``quantize_columns``' values q [M, C] in the FP8 weight-gradient GEMM's operand layout, [C, 128 * tiles.count]:
  each row at its ``padded_row`` (every group from a multiple of 128), zeros between, transposed so that the tokens
  are contiguous (FP8 wgmma reads both operands K-major). In XLA: a scatter of the rows, then a transpose.
  ``grouped_gemm.quantize_columns_fp8`` quantizes rows into this layout in one custom call."""
  bits = jax.lax.bitcast_convert_type(q, jnp.uint8)
  padded = jnp.zeros((TILE * tiles.count, q.shape[1]), jnp.uint8).at[tiles.padded_row].set(bits, mode="drop")
  return jax.lax.bitcast_convert_type(padded.T, E4M3)


def dequantize_columns(q: jax.Array, s: jax.Array, tiles: ColumnTiles) -> jax.Array:
  """(q [M, C], s [tiles.count, C]) -> float32 [M, C]; zero past the last group."""
  return _dequantize(q, jnp.take(s, tiles.row_tile, axis=0, mode="fill", fill_value=0.0))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
  """An expert weight W [E, K, N] (w1: K = D, N = 2F; w2: K = F, N = D) quantized per 128 x 128 block.

  values: [E, N, K] e4m3, each expert's matrix stored transposed (K-major: the contraction axis contiguous, the only
    layout of an FP8 wgmma's B operand on Hopper). scales: [E, N / 128, K / 128] float32, one per block.
  W[e] ~= (values[e] * scales[e] per block)^T. ``shape`` is W's shape. A pytree: it crosses jit, shard_map and
  device_put like the weight it stands for, sharded over the experts (its leading axis).

  Of w1's view [E, D, 2, F] (``quantize_weights`` of the view; F a multiple of 128): values [E, 2, F, D] and scales
  [E, 2, F / 128, D / 128], the same blocks as w1's (no block straddles the gate and the up halves), which split
  over a tensor axis along F as the view does; ``shape`` is the view's.
  """

  values: jax.Array
  scales: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    if self.values.ndim == 4:
      E, two, F, D = self.values.shape
      return (E, D, two, F)
    E, N, K = self.values.shape
    return (E, K, N)

  def dequantize(self) -> jax.Array:
    """W float32, of ``shape``."""
    w = dequantize_blocks(self.values, self.scales)
    return jnp.transpose(w, (0, 3, 1, 2)) if w.ndim == 4 else jnp.swapaxes(w, -1, -2)


def transpose_weight(w: Fp8Weight) -> Fp8Weight:
  """The ``Fp8Weight`` of W^T [E, N, K] from that of W [E, K, N]: each expert's values and block scales transposed.
  Exact (a 128 x 128 block of W^T is a block of W transposed, with the same amax and so the same scale); the
  dgrad GEMMs' weights (dy W^T), since FP8 wgmma reads its B operand K-major only. A pass over the values (one byte
  per element) and the scales."""
  return Fp8Weight(jnp.swapaxes(w.values, -1, -2), jnp.swapaxes(w.scales, -1, -2))


def quantize_weight(w: jax.Array) -> Fp8Weight:
  """W [E, K, N] (any float dtype) -> ``Fp8Weight``: the blocks of W^T, the same blocks transposed. w1's view
  [E, D, 2, F] -> the view's ``Fp8Weight`` (values [E, 2, F, D]), in the view's sharding."""
  q, s = quantize_blocks(jnp.transpose(w, (0, 2, 3, 1)) if w.ndim == 4 else jnp.swapaxes(w, -1, -2))
  return Fp8Weight(q, s)


def as_fp8_weight(w) -> Fp8Weight:
  """A weight as the recipe reads it: an ``Fp8Weight`` as given, a float array quantized."""
  return w if isinstance(w, Fp8Weight) else quantize_weight(w)


def quantize_weights(w1: jax.Array, w2: jax.Array) -> tuple[Fp8Weight, Fp8Weight]:
  """The expert weights quantized once, for inference: ``moe_experts(x, ids, gates, *quantize_weights(w1, w2),
  quantization="fp8", ...)`` then reads only their FP8 values and scales, and equals the call on w1 and w2 bit for
  bit (that call quantizes them the same way on every call). No gradient flows to pre-quantized weights, so
  differentiating w1 or w2 through this function is refused (ValueError).

  Args:
    w1: [E, D, 2F], or its view [E, D, 2, F] (a module with a ``tensor_axis`` keeps it); w2: [E, F, D]; float32 or
      bfloat16, D and F multiples of 128. Sharded arrays keep their sharding (call under ``jax.jit`` to quantize
      each device's part in place): over the experts, and over a tensor axis along F where w1 is the view and each
      device holds a multiple of 128 of F (the [E, D, 2F] form cannot split F with the gate and up halves alike, so
      pass the view to keep a tensor split).
  Returns:
    (Fp8Weight of w1 [E, D, 2F] or of its view, Fp8Weight of w2).
  """
  from jax_moe_overlap.checks import check_fp8_sizes, check_fp8_weight_dtype, check_weight_shapes  # (it imports fp8)
  for name, w, ranks in (("w1", w1, (3, 4)), ("w2", w2, (3,))):
    if getattr(w, "ndim", None) not in ranks or not jnp.issubdtype(w.dtype, jnp.floating):
      raise TypeError(f"jax_moe_overlap: quantize_weights: {name} must be a float "
                      f"{'[E, D, 2F] (or [E, D, 2, F])' if name == 'w1' else '[E, F, D]'} array, got "
                      f"{getattr(w, 'dtype', type(w))}{list(np.shape(w))}")
    # moe_experts' rules for the master weights it quantizes per call: the Fp8Weights fit such a call and equal
    # its quantization bit for bit.
    check_fp8_weight_dtype(f"quantize_weights: {name}", w.dtype, "fp8")
  check_fp8_sizes(w1.shape[1], check_weight_shapes(tuple(w1.shape), tuple(w2.shape), w1.shape[1])[1])
  return _quantize_for_inference(w1, w2)


@jax.custom_jvp
def inference_only(w: Fp8Weight) -> Fp8Weight:
  """w as it is; differentiating with respect to it is refused (ValueError). A pre-quantized weight gets a zero
  cotangent from the layer (its float32 scales do enter y, so zeros would be a wrong gradient, not "none")."""
  return w


@inference_only.defjvp
def _refuse_fp8_weight_gradients(primals, tangents):
  """JAX calls this rule only where w carries a tangent: inference, and gradients with respect to the layer's other
  arguments, trace as the identity."""
  del primals, tangents
  raise ValueError("jax_moe_overlap: gradients with respect to a pre-quantized Fp8Weight are not computed (the layer "
                   "gives it a zero cotangent): Fp8Weights are for inference. To differentiate other arguments of a "
                   "function that takes one, pass it through jax.lax.stop_gradient; to train, pass the master weights "
                   "with quantization='fp8' (quantized per call, straight-through gradients)")


@jax.custom_jvp
def _quantize_for_inference(w1, w2):
  return quantize_weight(w1), quantize_weight(w2)


@_quantize_for_inference.defjvp
def _refuse_gradients(primals, tangents):
  """Differentiating the master weights through ``quantize_weights`` is refused: ``moe_experts`` gives an
  ``Fp8Weight`` a zero cotangent, so their gradients would be zeros. JAX calls this rule only where w1 or w2 carries
  a tangent, so inference and gradients with respect to the other arguments trace as before."""
  raise ValueError("jax_moe_overlap: quantize_weights is for inference: moe_experts gives pre-quantized weights zero "
                   "cotangents, so the gradient of w1 or w2 through quantize_weights would be zeros. To train, pass "
                   "the master weights with quantization='fp8' (quantized per call, straight-through gradients)")
