"""Expert-parallel MoE expert layer (post-router) on R devices, forward and forward+backward.

A mesh of R devices on axis "expert" (all local devices, or ``--devices N``); tokens and experts are sharded over it.
Every implementation is a function of global arrays ``(x [T_global, D], expert_ids [T_global, k], gates [T_global, k],
w1 [E, D, 2F], w2 [E, F, D]) -> y [T_global, D]`` run under ``jax.jit``:

ours            jax_moe_overlap.moe_experts(impl="overlap"): dispatch + grouped GEMM1 + expert_combine custom calls.
xla_ragged      MaxText's GPU path in shard_map: sort slots by expert, ragged_all_to_all to the owning ranks (one slice
                per destination rank), local permute by local expert, jax.lax.ragged_dot GEMM1 + SwiGLU + GEMM2,
                un-permute, ragged_all_to_all back, unsort, weighted sum over k. XLA:CPU has no ragged_all_to_all:
                on CPU it is skipped (its offsets are still checked, through an all_gather emulation of the
                documented semantics, as ``xla_ragged[emulated]``).
xla             jax_moe_overlap.moe_experts(impl="xla") (xla_path.py): the library's own path of this kind, the fallback a
                user of the library has: ragged_all_to_all with a receive buffer of every slot of the group (the
                worst case) and lax.ragged_dot; on CPU a padded all_to_all instead, so it runs (and is checked) there.
                xla_ragged stays this module's own (baselines.ragged_layer): its buffer follows --ragged-buffer and
                its grouped GEMM is swappable for tokamax's.
tokamax_ragged  the same with tokamax.ragged_dot(implementation="mosaic") (MaxText's GPU choice), when tokamax imports.
xla_dense_a2a   GShard-style capacity-padded path: scatter slots into [R, E_local, C, D], all_to_all, batched GEMMs
                per local expert, all_to_all back, combine. C = T_local (dropless worst case) unless
                --capacity-factor (a number: ceil(cf T_local k / E); 'fit': the largest (rank, expert) count of these
                inputs, so nothing drops).
ours_dg         (with --dispatch-pushers P > 0) ours with CallConfig(dispatch_pushers=P): the dispatch and GEMM1 in one
                dispatch_gemm call with P pushing CTAs pinned (ours makes the library's choice: that call with
                the library's pusher count (call_site.dispatch_pushers) on Hopper GPUs at two ranks or more, else
                the dispatch and GEMM1 as two calls; on CPU ours_dg is dispatch_gemm's CPU handler, the protocol's
                specification: checked, its time no GPU measure).
serialized      ours with CallConfig(serialize=True): no overlap anywhere. The dispatch and GEMM1 run as two calls, and
                expert_combine's consumer starts pushing only after the producer has finished the whole GEMM (every
                expert_combine of the pass: GEMM2 forward, dx backward). Same results: the baseline the overlap is
                measured against.
ideal           max(compute alone, communication alone), both measured in the same run on the same inputs (extra
                rows compute_alone, comm_alone and dispatch_alone, then the ideal and bound rows):
                compute_alone  the expert work of ours with no inter-rank traffic: on every rank, ops.expert_mlp
                               (GEMM1 + SwiGLU + GEMM2 through our grouped GEMMs, for fwd+bwd also the backward
                               GEMMs dh, dW2, dW1, dx as in ours' backward pass) on rows it already holds,
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
                dispatch_alone ours' dispatches alone (ideal_probes.dispatch_probe): the plan (the count all_gather,
                               make_plan) and the forward dispatch of the token rows, through the same workspace as
                               ours; for fwd+bwd a second dispatch in the same call of [T k, D] rows made untimed, as
                               the backward's dispatch of gates * dy. Half the pass's bytes (its a2a_MB): the dispatch
                               half, which the two-call path runs before GEMM1, where nothing overlaps it. Checked
                               bit-exact: every row a rank receives is the source row the plan sends there.
                The ideal row reports compute_ms, comm_ms, ms = ideal_ms = max of the two, overlap_eff =
                (serialized - ours) / min(compute, comm) (1: the shorter of the two is fully hidden; needs the
                serialized row), hidden = (compute + comm - ours) / comm (the share of comm_alone's time that ours
                hides behind compute: 1 all of it, 0 none, negative when ours is slower than the two in a row) and
                ours/ideal (1: perfect overlap at no cost). The bound row is the limit of the two-call path, where
                only the return (expert_combine's) overlaps a GEMM and the dispatch runs before GEMM1: compute_alone +
                dispatch_alone (ms = bound_ms, compute_ms, dispatch_ms and ours/bound; 1: the return and the rest
                fully hidden). Where ours fuses the dispatch with GEMM1 (dispatch_gemm), ours/bound < 1 is what the
                dispatch's overlap gains.

Nothing is timed before it agrees with the float32 reference on the same inputs: relative error (Frobenius) of y and,
for fwd+bwd, of the gradients wrt x, gates, w1, w2 of sum(y * ct) for a fixed random ct, within --rtol (1e-2 for
bfloat16, 1e-4 for float32). The reference has the semantics of ``moe_experts(impl="reference")`` (the dense oracle:
every token through every expert) at the cost of the routed rows (``references.sparse_reference_layer``: per-expert
blocks of the slots routed to each expert, GEMMs in float32 at precision HIGHEST, experts sharded like the weights,
token chunks when its buffers would pass 4 GiB per device). When the float32 weight gradients would pass 4 GiB per
device (DeepSeek-like), dw1 and dw2 are compared on a fixed sample of 8 experts only (``references.weight_sample``,
named in the check text); dx and dgates always whole. The probes of the ideal are checked as far as they can be:
comm_alone against the reference on its shrunk weights; compute_alone (which computes on copies of tokens) by its group
sizes, the routing's rows per (rank, local expert) counted on the host, and finite outputs; dispatch_alone bit-exact
against the plan's placement of the source rows. Per shape and pass it reports ms, the ratio vs ``ours`` (>1: ours is
faster), and the bytes the two all-to-alls move per layer (a2a_MB: 2 x T_global x k x D x itemsize; twice that for
fwd+bwd, whose backward has the same two transfers; logical payload: the padded path moves more) with the rate that
makes of the layer time (a2a_GBps). The rows of ours' transfers (ours, serialized, ours_dg, comm_alone, and
dispatch_alone with half of it) also report wire_MB, the bytes that cross ranks: ours' plan of the actual routing
(``ideal_probes.wire_rows``: kept slots whose expert's rank is not the token's rank; a slot on its own rank moves
nothing between GPUs) x D x itemsize, once per transfer: the dispatch and the return forward, for fwd+bwd also the
backward's dispatch of gates * dy and its dx return (4 transfers); the mean over the input sets the timing cycles
through. The plan's count all_gather (R x E int32 per rank) is not counted. wire_GBps = wire_MB / ms.

At the end (and in --out, after the result rows, as rows with table="summary") a summary table, one line per shape x
pass: ours_ms, serialized_ms, xla_ms, compute_ms (compute_alone), comm_ms (comm_alone), comm_wire_MB (its wire bytes)
and comm_GBps (wire bytes / comm_ms), ideal_ms = max(compute, comm), ours/ideal, hidden (as in the ideal row),
ours/serialized and ours/xla (< 1: ours is faster). Nothing is asserted about these numbers.

  python3 -m benchmarks.bench_ep_layer --quick                                   # CPU try-out, 4 devices
  python3 -m benchmarks.bench_ep_layer --shapes 'seed T=8192' --out $OUT/ep_layer.jsonl   # all GPUs
  bash benchmarks/run_multi_gpu.sh     # the one-call device run: build, topology, links, a shape subset, C sweep

The default list is 57 shapes (48 seed-sweep, 3 Mixtral-like, 3 DeepSeek-like, 3 DeepSeek-like E=64), more than
one 10-minute device command holds: select subsets with --shapes (a regex on "name skew") and --impls.
--tokens-per-rank N runs the same list scaled down (a CPU dry run). --check-only runs the checks alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe_overlap as jmo
from benchmarks import baselines
from benchmarks import common
from benchmarks import ideal_probes
from benchmarks import references
from benchmarks.common import AXIS


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
  rank), DeepSeek-like (DeepSeek-V3's per-layer D 7168, F 2048, 256 experts, top-8, 4096 tokens per rank) and
  DeepSeek-like E=64 (the same D, F, top-k and tokens with 64 experts: 32 local experts at EP = 2, as
  bench_layer.py's DeepSeek-like E_l=32; at EP = 2 its weights are 2.8 GB per rank and input set, and the layer,
  the probes and the float32 reference come to about 30 GB per GPU by their array sizes, well inside two 141 GB
  H200s; the 256-expert one has 4x the weights, 11.3 GB per rank and set), each under balanced / moderate (Zipf
  0.8) / stress (Zipf 2.0) expert popularity (common.topk_routing)."""
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
    out.append(Shape("deepseek-like E=64", 4096, 7168, 2048, 64, 8, skew))
  return out


def selected_shapes(args) -> list[Shape]:
  """The shapes --shapes selects (a regex on "name skew"), with --tokens-per-rank applied; SystemExit naming the
  regex when it selects none (a mistyped regex would otherwise run nothing and look like a finished run)."""
  out = [dataclasses.replace(s, tokens_per_rank=args.tokens_per_rank or s.tokens_per_rank)
         for s in shapes(args.quick) if not args.shapes or re.search(args.shapes, f"{s.name} {s.skew}")]
  if not out:
    raise SystemExit(f"--shapes {args.shapes!r} selects none of these shapes: "
                     + "; ".join(f"{s.name} {s.skew}" for s in shapes(args.quick)))
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



def ours_layer(mesh, config: jmo.CallConfig = jmo.CallConfig()):
  """moe_experts(impl="overlap") as a function of global arrays -> y; ``config`` e.g. CallConfig(serialize=True)."""
  return lambda *a: jmo.moe_experts(*a, mesh=mesh, impl="overlap", config=config)[0]


def fwd_fn(f):
  """jit of f on (x, ids, gates, w1, w2, ct): y (ct unused)."""
  return jax.jit(lambda x, ids, g, w1, w2, ct: f(x, ids, g, w1, w2))


def grad_fn(f):
  """jit of the gradients of sum(f(x, ids, gates, w1, w2) * ct) wrt x, gates, w1, w2."""
  def loss(x, ids, g, w1, w2, ct):
    return jnp.sum(f(x, ids, g, w1, w2).astype(jnp.float32) * ct)
  return jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4)))


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
  impls = {"ours": (ours_layer(mesh), None), "serialized": (ours_layer(mesh, jmo.CallConfig(serialize=True)), None),
           "xla": (lambda *a: jmo.moe_experts(*a, mesh=mesh, impl="xla")[0], None)}
  if dispatch_pushers > 0:
    impls["ours_dg"] = (ours_layer(mesh, jmo.CallConfig(dispatch_pushers=dispatch_pushers)), None)
  rows = max(baselines.ragged_recv_rows(i, R, shape.experts, ragged_buffer) for i in ids_np)
  grouped = {"xla_ragged": jax.lax.ragged_dot}
  tokamax_fn, why = baselines.tokamax_ragged_dot()
  if tokamax_fn:
    grouped["tokamax_ragged"] = tokamax_fn
  else:
    impls["tokamax_ragged"] = (None, why)
  for name, rd in grouped.items():
    f = baselines.ragged_layer(mesh, rd, rows)
    err = compile_error(fwd_fn(f), args)
    if err and "ragged-all-to-all" in err.replace("_", "-"):
      impls[name] = (None, f"skipped: this backend ({jax.default_backend()}) cannot compile ragged_all_to_all "
                           f"({err})")
    else:
      impls[name] = (f, None)   # any other compile error surfaces in the correctness check, with its text
  if impls["xla_ragged"][0] is None:
    # Where the real collective cannot run, still check this path's offsets and sizes (check only, never timed).
    emulated = baselines.ragged_layer(mesh, jax.lax.ragged_dot, rows, a2a=baselines.emulated_ragged_all_to_all)
    impls["xla_ragged[emulated]"] = (emulated, None)
  C = max(baselines.dense_capacity(i, R, shape.experts, capacity_factor) for i in ids_np)
  gib = baselines.dense_bytes_per_rank(shape, R, C, itemsize) / 2 ** 30
  if gib > max_dense_gib:
    impls["xla_dense_a2a"] = (None, f"skipped: capacity C={C} needs ~{gib:.0f} GiB per rank (> --max-dense-gib "
                                    f"{max_dense_gib}); try --capacity-factor fit")
  else:
    impls["xla_dense_a2a"] = (baselines.dense_a2a_layer(mesh, C), None)
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
  ap.add_argument("--list-shapes", action="store_true",
                  help="print the selected shapes (name skew: tokens per rank, D, F, E, top-k) and exit")
  ap.add_argument("--max-call-s", type=float, default=None,
                  help="do not time an implementation whose checked call took longer than this (seconds): keeps a "
                       "time-limited sweep going past a pathologically slow one (reported as skipped, with the time)")
  ap.add_argument("--out", default="ep_layer.jsonl")
  a = ap.parse_args(argv)
  known = {"ours", "xla", "xla_ragged", "tokamax_ragged", "xla_dense_a2a", "serialized", "ideal", "ours_dg"}
  if a.impls and set(a.impls.split(",")) - known:
    ap.error(f"--impls: unknown {sorted(set(a.impls.split(',')) - known)}; known: {sorted(known)}")
  if set(a.passes.split(",")) - {"fwd", "fwd+bwd"}:
    ap.error("--passes: a comma list of fwd, fwd+bwd")
  if a.capacity_factor not in (None, "fit"):
    a.capacity_factor = float(a.capacity_factor)
  return a


COLUMNS = ["shape", "skew", "pass", "impl", "ms", "vs_ours", "a2a_MB", "a2a_GBps", "wire_MB", "wire_GBps",
           "compute_ms", "comm_ms", "dispatch_ms", "overlap_eff", "hidden", "ours/ideal", "ours/bound", "check"]
# Implementations that run ours' transfers on ours' plan: their rows quote the pass's wire bytes.
OUR_TRANSFERS = ("ours", "serialized", "ours_dg")


@dataclasses.dataclass
class Pass:
  """One pass ("fwd" or "fwd+bwd") of one shape: its rows go to ``table``; ``ms`` keeps what was timed, by impl."""

  table: common.Table
  shape: Shape
  name: str
  a2a_bytes: int          # logical payload of the pass's all-to-alls
  wire_bytes: float       # what ours' transfers of the pass move between ranks (mean over the input sets)
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

  def measure(self, impl: str, fn, arg_sets, verdict: references.Verdict, moves_bytes: bool = True,
              a2a_bytes: int | None = None, wire_bytes: float | None = None) -> float | None:
    """Times fn over arg_sets unless its check failed (then: excluded) or its checked call was slower than
    max_call_s (then: skipped); adds its row; returns the ms, or None if untimed. ``a2a_bytes``: what fn moves,
    when not the pass's a2a_bytes (the dispatch probe: one of the two transfers). ``wire_bytes``: what fn moves
    between ranks on ours' plan (None: not counted for fn)."""
    ok, text, call_s = verdict
    moved = self.a2a_bytes if a2a_bytes is None else a2a_bytes
    a2a = dict(a2a_MB=f"{moved / 1e6:.4g}" if moves_bytes else "")
    if wire_bytes is not None:
      a2a.update(wire_MB=f"{wire_bytes / 1e6:.4g}", wire_bytes=wire_bytes)
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
             a2a_GBps=f"{moved / ms / 1e6:.4g}" if moves_bytes else "",
             wire_GBps=f"{wire_bytes / ms / 1e6:.4g}" if wire_bytes is not None else "", **a2a)
    return ms


def measure_ideal(p: Pass, mesh, arg_sets, ids_np):
  """The compute_alone, comm_alone, dispatch_alone, ideal and bound rows of pass p (the module docstring says what
  each measures)."""
  want_grads = p.name == "fwd+bwd"
  R = mesh.shape[AXIS]
  prepare, fn = ideal_probes.compute_probe(mesh, p.shape, want_grads)
  sets = [prepare(x, ids) + (w1, w2) for x, ids, _, w1, w2, _ in arg_sets]
  compute = p.measure("compute_alone", fn, sets,
                      ideal_probes.compute_probe_verdict(fn, sets, ids_np, R, p.shape.experts), moves_bytes=False)
  del sets
  comm_sets = [ideal_probes.comm_probe_args(a) for a in arg_sets]
  comm_fn = (grad_fn if want_grads else fwd_fn)(ours_layer(mesh))
  verdict = references.verdicts(mesh, {"comm": comm_fn}, comm_sets, want_grads, p.rtol)["comm"]
  comm = p.measure("comm_alone", comm_fn, comm_sets,
                   verdict._replace(text=f"{verdict.text} (F={comm_sets[0][4].shape[1]})"), wire_bytes=p.wire_bytes)
  del comm_sets
  prepare, fn = ideal_probes.dispatch_probe(mesh, p.shape, want_grads)
  sets = [prepare(x, ids) for x, ids, *_ in arg_sets]
  disp = p.measure("dispatch_alone", fn, sets, ideal_probes.dispatch_probe_verdict(fn, sets, ids_np, mesh, p.shape),
                   a2a_bytes=p.a2a_bytes // 2, wire_bytes=p.wire_bytes / 2)   # the dispatches: half the pass's bytes
  del sets
  # Ratios come from the times as printed (ms to 1 us), so a reader recomputing them from the table gets the same.
  ours, serialized, compute, comm, disp = (None if v is None else float(f"{v:.3f}")
                                           for v in (p.ms.get("ours"), p.ms.get("serialized"), compute, comm, disp))
  if compute is None or comm is None:
    p.add("ideal", a2a_MB="", ms="check only" if not p.timing else "not measured",
          check="max(compute_alone, comm_alone): needs both timed")
  else:
    ideal = max(compute, comm)
    p.add("ideal", a2a_MB="", ms=f"{ideal:.3f}", vs_ours=f"{ideal / ours:.2f}" if ours else "",
          compute_ms=f"{compute:.3f}", comm_ms=f"{comm:.3f}",
          overlap_eff=f"{(serialized - ours) / min(compute, comm):.2f}" if ours and serialized else "",
          hidden=f"{(compute + comm - ours) / comm:.2f}" if ours else "",
          check=f"max(compute_alone, comm_alone): {'communication' if comm >= compute else 'compute'}-bound",
          **{"ours/ideal": f"{ours / ideal:.2f}" if ours else ""})
  why = "compute_alone + dispatch_alone: the two-call path's limit (the dispatch before GEMM1, only the return overlaps)"
  if compute is None or disp is None:
    p.add("bound", a2a_MB="", ms="check only" if not p.timing else "not measured", check=f"{why}; needs both timed")
    return
  bound = compute + disp
  p.add("bound", a2a_MB="", ms=f"{bound:.3f}", vs_ours=f"{bound / ours:.2f}" if ours else "",
        compute_ms=f"{compute:.3f}", dispatch_ms=f"{disp:.3f}", check=why,
        **{"ours/bound": f"{ours / bound:.2f}" if ours else ""})


SUMMARY_COLUMNS = ["shape", "skew", "pass", "ours_ms", "serialized_ms", "xla_ms", "compute_ms", "comm_ms",
                   "comm_wire_MB", "comm_GBps", "ideal_ms", "ours/ideal", "hidden", "ours/serialized", "ours/xla"]


def summary(rows: list[dict]) -> common.Table:
  """One row per shape x pass of ``rows`` (a run's result rows), columns SUMMARY_COLUMNS (the module docstring says
  what each is): the ms of ours, serialized, xla, compute_alone and comm_alone, comm_alone's wire_GBps, the ideal
  row's ms, ours/ideal and hidden (computed there from the printed times), the wire bytes of the pass and the
  ratios of ours' ms to serialized's and xla's. A time that was not measured shows its row's ms text (check only,
  skipped, excluded, ...) or "-" where the row is absent; ratios with it stay empty. The JSON rows carry
  table="summary" and wire_bytes, the exact count."""
  groups: dict[tuple, dict] = {}
  for r in rows:
    groups.setdefault((r["shape"], r["skew"], r["pass"]), {})[r["impl"]] = r
  out = common.Table(SUMMARY_COLUMNS)
  for (shape, skew, pname), by in groups.items():
    ms = {}
    for impl in ("ours", "serialized", "xla", "compute_alone", "comm_alone"):
      try:
        ms[impl] = float(by[impl]["ms"])
      except (KeyError, ValueError):
        ms[impl] = None

    def cell(impl):
      return by.get(impl, {}).get("ms", "-")

    def ratio(a, b):
      return f"{a / b:.2f}" if a is not None and b else ""

    ideal = by.get("ideal", {})
    wire = next((r["wire_bytes"] for r in by.values() if "wire_bytes" in r), None)
    out.rows.append({
        "table": "summary", "shape": shape, "skew": skew, "pass": pname, "ours_ms": cell("ours"),
        "serialized_ms": cell("serialized"), "xla_ms": cell("xla"), "compute_ms": cell("compute_alone"),
        "comm_ms": cell("comm_alone"), "comm_wire_MB": f"{wire / 1e6:.4g}" if wire is not None else "",
        "comm_GBps": by.get("comm_alone", {}).get("wire_GBps", ""), "ideal_ms": ideal.get("ms", "-"),
        "ours/ideal": ideal.get("ours/ideal", ""), "hidden": ideal.get("hidden", ""),
        "ours/serialized": ratio(ms["ours"], ms["serialized"]), "ours/xla": ratio(ms["ours"], ms["xla"]),
        "wire_bytes": wire})
  return out


class LayerTable(common.Table):
  """The result rows, with ``summary``'s table printed after them and its rows written after theirs."""

  def render(self) -> str:
    return (f"{super().render()}\n\nSummary (ms; comm_wire_MB: bytes crossing ranks per call; hidden = (compute + "
            f"comm - ours) / comm):\n{summary(self.rows).render()}")

  def save(self, path: str, meta: dict):
    super().save(path, meta)
    with open(path, "a") as f:
      for r in summary(self.rows).rows:
        f.write(json.dumps(r) + "\n")


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
  table = table if table is not None else LayerTable(COLUMNS)
  for shape in selected_shapes(args):
    if shape.experts % R:
      print(f"{shape.name} {shape.skew}: skipped, {shape.experts} experts do not split over {R} ranks")
      continue
    T = shape.tokens_per_rank * R
    sets = [make_inputs(shape, R, dtype, seed, mesh) for seed in range(2)]
    arg_sets, ids_np = [s[0] for s in sets], [s[1] for s in sets]
    impls, sizes = implementations(mesh, ids_np, shape, arg_sets[0], args.capacity_factor, args.ragged_buffer,
                                   itemsize, args.max_dense_gib, args.dispatch_pushers)
    fwd_bytes = 2 * T * shape.k * shape.d * itemsize        # dispatch + return all-to-all, logical payload
    # Ours' forward moves each cross-rank row twice (dispatch, return); the timing cycles through the input sets.
    wire_fwd = 2 * shape.d * itemsize * float(np.mean([ideal_probes.wire_rows(i, R, shape) for i in ids_np]))
    print(f"\n{shape} R={R} T_global={T}: {sizes} (started at {time.strftime('%H:%M:%S')})")
    for pname in args.passes.split(","):
      want_grads = pname == "fwd+bwd"
      # The backward pass has the same two transfers.
      scale = 2 if want_grads else 1
      p = Pass(table, shape, pname, fwd_bytes * scale, wire_fwd * scale, rtol, timing, args.max_call_s)
      selected = {n: v for n, v in impls.items() if not wanted or n.split("[")[0] in wanted}
      fns = {n: (fwd_fn(f) if not want_grads else grad_fn(f)) for n, (f, _) in selected.items() if f is not None}
      verdict = references.verdicts(mesh, fns, arg_sets, want_grads, rtol)
      for iname, (f, reason) in selected.items():
        if f is None:
          print(f"  {iname}: {reason}")
          p.add(iname, ms="skipped", check=reason[:120])
        else:
          p.measure(iname, fns[iname], arg_sets, verdict[iname],
                    wire_bytes=p.wire_bytes if iname in OUR_TRANSFERS else None)
      if not wanted or "ideal" in wanted:
        measure_ideal(p, mesh, arg_sets, ids_np)
  return table


def main(argv=None):
  """Runs the sweep; on SIGTERM (``timeout``'s signal in a time-limited device run) it stops and still writes --out
  and prints the table of the rows done so far."""
  common.virtual_cpu_devices(sys.argv if argv is None else argv)  # a CPU try-out: --devices N, else 4
  args = parse_args(argv)
  if args.list_shapes:
    for s in selected_shapes(args):
      print(f"{s.name} {s.skew}: T/rank {s.tokens_per_rank}, D {s.d}, F {s.f}, E {s.experts}, top-{s.k}")
    return
  with common.rows_kept_on_sigterm(LayerTable(COLUMNS), args.out, "bench_ep_layer") as table:
    run(args, timing=not args.check_only, table=table)


if __name__ == "__main__":
  main()
