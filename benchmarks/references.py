"""The float32 references every benchmark checks its implementations against before timing them, and the checks.

One device:
  reference_rows           a grouped GEMM's rows (jax.lax.ragged_dot on float32 copies, precision HIGHEST).
  static_ragged_dot        the same for host group sizes, as one padded batched dot (near each group's own cost).
  layer_reference(ids, E)  the expert layer (baselines.xla_layer on float32 copies, ``static_ragged_dot``).
Expert parallel (mesh axis ``common.AXIS``):
  combine_reference        GEMM2 + weighted combine of every rank's plan (bench_ep_combine).
  reference_results        the expert layer and its gradients: jax_moe_overlap.reference's routed GEMMs, sharded
                           like the weights, in token chunks (bench_ep_layer).
Checks: ``max_rel_err`` (max |got - ref| / max |ref|), ``rel_err`` (Frobenius), and for bench_ep_layer ``Verdict``,
``check``, ``verdicts``.
The FP8 layer against float64 (tests/test_fp8_layer.py, benchmarks/fp8_error.py): ``float64_layer`` (the unquantized
layer and its gradients in float64), ``grads_fn`` (a layer's output and gradients through moe_experts), and
``FP8_ERROR_BOUND`` / ``FP8_ERROR_FLOOR`` (the relative error the FP8 layer is held within).
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe_overlap as jmo
from benchmarks import baselines
from benchmarks.common import AXIS, of_rank, rank_map
from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap import reference

# ----------------------------------------------------------------------------------------------------------------
# Comparisons


@jax.jit
def _max_rel_err(got, ref):
  got, ref = got.astype(jnp.float32), ref.astype(jnp.float32)
  return jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref))


def max_rel_err(got, ref) -> float:
  """max |got - ref| / max |ref| of two arrays of one shape, in float32 where they are (on the devices: outputs are
  GBs); NaN if got has a NaN."""
  return float(_max_rel_err(got, ref))


@jax.jit
def _rel_err(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  err = jnp.sqrt(jnp.sum((a - b) ** 2)) / jnp.maximum(jnp.sqrt(jnp.sum(b * b)), 1e-30)
  return jnp.where(jnp.all(jnp.isfinite(a)), err, jnp.inf)


def rel_err(a, b) -> float:
  """Frobenius relative error of a vs b (inf if a has a NaN/inf), computed on the device (gradients are GBs)."""
  return float(_rel_err(jnp.asarray(a), jnp.asarray(b)))



# ----------------------------------------------------------------------------------------------------------------
# The FP8 layer against the unquantized float64 layer

# e4m3 keeps 3 mantissa bits: one rounding errs by at most u = 2^-4 relatively (half a step), by about u / 2.5 in
# the root mean square over random values. y passes four quantized operands (x, W1, h, W2), each gradient five or
# six (the output gradient, a weight, the kept SwiGLU input, da or h, and the re-tiled wgrad operands): their
# random errors add in quadrature to 0.05-0.08 of the norm. The bound, 2u = 0.125, leaves room for the routing's
# spread of values and is far below what a wrong scale or a missing dequantization gives (errors of order 1); the
# floor 2^-10 shows that the operands are quantized at all (float32 rounding alone is below 1e-6).
FP8_ERROR_BOUND = 2.0 ** -3
FP8_ERROR_FLOOR = 2.0 ** -10


def grads_fn(mesh, ids, cotangent, impl, quantization="fp8", cf=None, argnums=(0, 1, 2, 3),
             config: jmo.CallConfig = jmo.CallConfig()):
  """jit of (y, the gradients with respect to argnums of (x, gates, w1, w2)) of sum(y * cotangent) through
  moe_experts."""
  def loss(x, gates, w1, w2):
    y, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, impl=impl, capacity_factor=cf,
                           quantization=quantization, config=config)
    return jnp.sum(y.astype(jnp.float32) * cotangent), y
  return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))


def float64_layer(x, ids, gates, w1, w2, cotangent, cap_e):
  """The unquantized layer in float64 (the dense reference's formula) and its gradients."""
  with jax.enable_x64(True):
    args = [jnp.asarray(np.asarray(a, np.float64)) for a in (x, gates, w1, w2)]

    def loss(x, g, w1, w2):
      y, _ = reference.moe_experts_reference(x, jnp.asarray(ids), g, w1, w2, cap_e, 1)
      return jnp.sum(y * jnp.asarray(np.asarray(cotangent, np.float64))), y
    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*args)
    return [np.asarray(a) for a in (y, *grads)]


# ----------------------------------------------------------------------------------------------------------------
# One device


def reference_rows(h, w2, group_sizes):
  """The float32 reference of a grouped GEMM2: jax.lax.ragged_dot of h [M, F] and w2 [G, F, N] upcast, at HIGHEST
  precision -> [M, N] float32 (rows past the groups zero)."""
  return jax.lax.ragged_dot(h.astype(jnp.float32), w2.astype(jnp.float32), group_sizes,
                            precision=jax.lax.Precision.HIGHEST)

def static_ragged_dot(group_sizes: np.ndarray):
  """fn(lhs [M, K], rhs [G, K, N], group_sizes) -> [M, N]: jax.lax.ragged_dot's result for the host ``group_sizes``
  [G] baked in as static row ranges (the group_sizes argument is ignored), at HIGHEST precision.

  A float32 reference near each group's own cost. jax.lax.ragged_dot runs every row against every group
  (dense-masked), G times the work: minutes at DeepSeek-like sizes in float32. One dot per group has G different
  shapes, each autotuned by XLA: minutes of compiling at G = 32 forward+backward. So the groups are gathered
  (static indices) into one [G, max group, K] batch, zero rows padding the short ones, and multiplied as one batched
  dot; the rows are gathered back. Rows past the groups' sum come out zero, as in ragged_dot. Gathers and one dot
  differentiate as ragged_dot does."""
  sizes = np.asarray(group_sizes).astype(np.int64)
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  width = max(int(sizes.max(initial=0)), 1)
  j = np.arange(width)

  def fn(lhs, rhs, group_sizes_unused=None):
    del group_sizes_unused
    m = lhs.shape[0]
    # Row (g, j) of the batch is lhs row starts[g] + j, or the appended zero row m past the group's end.
    take = np.where(j[None, :] < sizes[:, None], starts[:, None] + j[None, :], m)
    lhs0 = jnp.concatenate([lhs, jnp.zeros((1, lhs.shape[1]), lhs.dtype)])
    prod = jnp.einsum("gmk,gkn->gmn", lhs0[take], rhs, precision=jax.lax.Precision.HIGHEST)
    # Output row r is batch row (g, r - starts[g]) of its group g, or the appended zero row past the groups' sum.
    rows = np.arange(m)
    g = np.minimum(np.searchsorted(np.cumsum(sizes), rows, side="right"), len(sizes) - 1)
    back = np.where(rows < sizes.sum(), g * width + rows - starts[g], len(sizes) * width)
    flat = jnp.concatenate([prod.reshape(-1, prod.shape[2]), jnp.zeros((1, prod.shape[2]), prod.dtype)])
    return flat[back]
  return fn


def layer_reference(ids: np.ndarray, E: int):
  """The float32 reference of the expert layer for one routing ``ids`` [T, k] (host values): baselines.xla_layer on
  float32 copies of every input, with the grouped GEMMs on this routing's static group rows at HIGHEST precision
  (``static_ragged_dot``). The returned function takes the layer's arguments and checks that concrete ``ids`` are
  the routing it was built for."""
  layer = baselines.xla_layer(static_ragged_dot(np.bincount(ids.reshape(-1), minlength=E)))

  def ref(x, ids_arg, gates, w1, w2):
    if not isinstance(ids_arg, jax.core.Tracer):
      assert np.array_equal(np.asarray(ids_arg), ids), "layer_reference: called with another routing"
    f32 = jnp.float32
    with jax.default_matmul_precision("highest"):  # the gate-weighted sum too
      return layer(x.astype(f32), ids_arg, gates.astype(f32), w1.astype(f32), w2.astype(f32))
  return ref


# ----------------------------------------------------------------------------------------------------------------
# Expert parallel


def combine_reference(mesh, cap: int, h, w2, gates, plans):
  """(rows [R cap, D], y [R T, D]) in float32: each rank's GEMM2 rows, then every token's weighted sum of its slots'
  rows wherever they were computed (all ranks' rows all-gathered). ``plans``: every rank's plan, stacked."""

  def local(h, w2, gates, plans):
    pl = of_rank(plans)
    rows = reference_rows(h, w2, pl.expert_rows)
    every = jax.lax.all_gather(rows, AXIS, tiled=True)                  # [R cap, D]
    return rows, baselines.weighted_combine(every, pl.slot_dest_rank * cap + pl.slot_dest_row, gates)

  return rank_map(mesh, local)(h, w2, gates, plans)


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
  # Everything stays on the devices, and each program finishes before the next is dispatched, so that no two of these
  # programs' collectives are in flight at once (on XLA:CPU they can wait in each other's rendezvous, as
  # tests/multiprocess_main.py's calls can).
  for c in range(n):
    sl = slice(c * Tc, (c + 1) * Tc)
    a = (f32(x[sl]), ids[sl], f32(gates[sl]))
    if not want_grads:
      ys.append(jax.block_until_ready(fwd(*a, w1, w2, experts)))
      continue
    if sample is None:
      gx, gg, g1, g2 = jax.block_until_ready(grad_all(*a, w1, w2, experts, ct[sl]))
    else:
      gx, gg = jax.block_until_ready(grad_xg(*a, w1, w2, experts, ct[sl]))
      g1, g2 = jax.block_until_ready(grad_ws(*a, w1s, w2s, experts_s, ct[sl]))
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

