"""The fused operator at EP=1 (one GPU): expert_combine (grouped GEMM2 + per-band flags + consumer push + weighted
combine) against the same kernels serialized, against our bare grouped GEMM with an XLA combine, and against the XLA
path (ragged_dot + gather + weighted sum) and the tokamax path (tokamax.ragged_dot + the same combine).

Input: h [cap, F] rows in recv order (sorted by expert; at EP=1 every segment is local), w2 [E, F, D], top-k routing
of T tokens with a skew; the plan is built once, outside the timing. Every implementation's y is compared with a
float32 reference before it is timed (column err: max |y - ref| / max |ref|).

  ours          expert_combine, consumer count chosen by the resource manager
  serialized    expert_combine with CallConfig(serialize=True): the consumer starts after the last tile
  bare+combine  grouped_matmul (our GEMM engine, no flags) + XLA gather / weighted sum
  bare gemm     grouped_matmul alone: the signalling overhead is ours / (bare gemm) - 1 minus the combine's share
  xla           jax.lax.ragged_dot + XLA gather / weighted sum
  tokamax       tokamax.ragged_dot(mosaic) + XLA gather / weighted sum (when installed)
  ours fp8      expert_combine_fp8: the FP8 grouped GEMM as expert_combine's producer, on h quantized 1 x 128 and
                w2 per 128 x 128 block outside the timing (the layer's GEMM1 epilogue writes h so; w2 pre-quantized)
  bare fp8+combine  grouped_matmul_fp8 on the same operands + XLA gather / weighted sum (the unfused FP8 way)
  bare fp8 gemm grouped_matmul_fp8 alone
The FP8 rows (where F and D are multiples of 128) are checked against the float32 reference of their dequantized
operands (vs_bare_gemm: against the bf16 bare GEMM; the FP8 rows' own ratio is ours fp8 / bare fp8 gemm).

  python3 -m benchmarks.bench_fused --quick --out /tmp/fused.jsonl
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from benchmarks import baselines
from benchmarks import common
from benchmarks import device_trace
from benchmarks import references
from jax_moe_overlap import fp8
from jax_moe_overlap import plan as plan_lib
from jax_moe_overlap.grouped_gemm import grouped_matmul_fp8
from jax_moe_overlap.ops import CallConfig, RankInfo, Workspace, WorkspaceSizes, expert_combine, grouped_matmul
from jax_moe_overlap.workspace_calls import expert_combine_fp8


def shapes(quick: bool):
  """(name, T, F, D, E, k): GEMM2 of the seed sweep (K = F = 2048), Mixtral-like and DeepSeek-like (E_l = 32)."""
  return common.gemm2_shapes(quick)


def main():
  ap = common.shape_parser("fused.jsonl", skews="balanced,stress")
  ap.add_argument("--impls", default="", help="comma-separated implementations to run (default: all); e.g. "
                  "'ours,serialized,bare+combine,bare gemm,tokamax' leaves out XLA's dense-masked ragged_dot, which "
                  "takes most of a big-shape run")
  ap.add_argument("--profile", type=int, default=0, metavar="N",
                  help="no timing: run each implementation N times after its check (for ncu: every kernel of a call)")
  ap.add_argument("--trace", type=int, default=0, metavar="N",
                  help="after timing, trace N calls of each implementation (device_trace.py): kernel times, the "
                       "GPU's idle gaps between them and the longest host events")
  args = ap.parse_args()
  mesh = jax.make_mesh((1,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
  smap = lambda f, n_in, n_out=P(): jax.shard_map(f, mesh=mesh, in_specs=(P(),) * n_in, out_specs=n_out,
                                                  check_vma=False)
  ragged = {"xla": jax.lax.ragged_dot}
  tokamax_fn, why = baselines.tokamax_ragged_dot()
  if tokamax_fn:
    ragged["tokamax"] = tokamax_fn
  else:
    print(why)
  table = common.Table(["shape", "skew", "impl", "ms", "tflops", "vs_xla", "vs_bare_gemm", "err"])
  for name, T, F, D, E, k in shapes(args.quick):
    if not common.shape_selected(args, name):
      continue
    for skew in args.skews.split(","):
      ids = jnp.asarray(common.topk_routing(T, E, k, skew))
      cap_e = plan_lib.expert_capacity(T, 1, k, E, None)
      cap = plan_lib.recv_capacity(T, 1, k, E, cap_e)
      plan = jax.jit(smap(lambda i: plan_lib.make_plan(
          i, plan_lib.local_counts(i, E).reshape(1, 1, E), jnp.int32(0), cap_e), 1))(ids)
      sizes = WorkspaceSizes(row_bytes=D * 2, recv_rows=cap, ret_rows=T * k, num_segments=E)
      ws = Workspace.get(mesh, "expert", sizes)
      arg_sets = [common.gemm2_operands(T + E + s, cap, T, F, D, E, k) + (plan,) for s in range(2)]
      slot_row = plan.slot_dest_row  # at EP=1 a slot's recv row is its expert output's row

      def fused(cfg):
        info = RankInfo(ws, cfg)
        return smap(lambda h, w2, g, pl: expert_combine(h, w2, g, pl, info, want_slots=False)[0], 4)

      impls = {"ours": fused(CallConfig())}
      if "serialize" in {f.name for f in dataclasses.fields(CallConfig)}:
        impls["serialized"] = fused(CallConfig(serialize=True))
      impls["bare+combine"] = baselines.gemm2_combine(grouped_matmul, slot_row)
      impls["bare gemm"] = lambda h, w2, g, pl: grouped_matmul(h, w2, pl.expert_rows)
      for rname, rd in ragged.items():
        impls[rname] = baselines.gemm2_combine(rd, slot_row)
      # The FP8 rows take (hq, hs, w2 values, w2 scales, gates, plan), quantized once outside the timing.
      fp8_sets = ([(*fp8.quantize_rows(h), *_fp8_weight(w2), g, pl) for h, w2, g, pl in arg_sets]
                  if F % fp8.TILE == 0 and D % fp8.TILE == 0 else [])
      info = RankInfo(ws, CallConfig())
      fp8_impls = {
          "ours fp8": smap(lambda hq, hs, wv, wsc, g, pl: expert_combine_fp8(
              hq, hs, fp8.Fp8Weight(wv, wsc), g, pl, info, False, jnp.bfloat16)[0], 6),
          "bare fp8+combine": lambda hq, hs, wv, wsc, g, pl: baselines.weighted_combine(
              grouped_matmul_fp8(hq, hs, wv, wsc, pl.expert_rows, preferred_element_type=jnp.bfloat16), slot_row,
              g),
          "bare fp8 gemm": lambda hq, hs, wv, wsc, g, pl: grouped_matmul_fp8(
              hq, hs, wv, wsc, pl.expert_rows, preferred_element_type=jnp.bfloat16),
      }
      if F % fp8.TILE or D % fp8.TILE:  # (FP8 takes whole 128-channel tiles and 128 x 128 blocks)
        fp8_impls = {}
      impls.update(fp8_impls)
      if args.impls:
        impls = {n: f for n, f in impls.items() if n in args.impls.split(",")}
      h, w2, g, pl = arg_sets[0]
      ref = baselines.gemm2_combine(references.reference_rows, slot_row)(h, w2, g, pl)
      ref8 = None
      if fp8_impls:
        hq, hs, wv, wsc = fp8_sets[0][:4]
        ref8 = baselines.gemm2_combine(references.reference_rows, slot_row)(
            fp8.dequantize_rows(hq, hs), fp8.Fp8Weight(wv, wsc).dequantize(), g, pl)
      flops = 2.0 * T * k * F * D
      timed, errs, notes = {}, {}, {}
      for iname, fn in impls.items():
        fn = jax.jit(fn)
        sets, want = (fp8_sets, ref8) if iname in fp8_impls else (arg_sets, ref)
        try:
          # (a bare GEMM alone has no y to check: its output is checked in its +combine row)
          if iname not in ("bare gemm", "bare fp8 gemm"):
            errs[iname] = references.max_rel_err(fn(*sets[0]), want)
            if not errs[iname] < 2e-2:
              notes[iname] = "wrong result, not timed"
              continue
          if args.profile:
            for _ in range(args.profile):
              jax.block_until_ready(fn(*sets[0]))
            continue
          timed[iname] = common.time_fn(fn, sets) * 1e3
          if args.trace:
            print(f"== {name} {skew} {iname}: " +
                  device_trace.format_summary(device_trace.trace_calls(fn, sets[0], calls=args.trace)), flush=True)
        except Exception as ex:  # pylint: disable=broad-except
          notes[iname] = f"error: {type(ex).__name__}: {str(ex)[:100]}"
      for iname in impls:
        err = f"{errs[iname]:.1e}" if iname in errs else ""
        if iname not in timed:
          table.add(shape=name, skew=skew, impl=iname, ms=notes.get(iname, ""), err=err)
          continue
        ms = timed[iname]
        table.add(shape=name, skew=skew, impl=iname, ms=f"{ms:.3f}", tflops=f"{flops / ms / 1e9:.0f}",
                  vs_xla=f"{timed['xla'] / ms:.2f}" if "xla" in timed else "",
                  vs_bare_gemm=f"{ms / timed['bare gemm']:.3f}" if "bare gemm" in timed else "", err=err)
  table.finish(args.out)


def _fp8_weight(w2):
  """w2 [E, F, D] -> (values [E, D, F], scales [E, D/128, F/128]): GEMM2's FP8 weight (fp8.quantize_weight)."""
  q = fp8.quantize_weight(w2)
  return q.values, q.scales


if __name__ == "__main__":
  main()
