"""The resource manager's oracle sweep: for each workload, time expert_combine with every feasible consumer
CTA count C pinned (the oracle is the fastest), then with the manager (C chosen on the device from the routed counts
by the calibrated model), and report the model's pick, the oracle's, the regret, the speed-up of the manager over
the best single fixed C across the set, and the decision cost per call.

Workloads: the seed sweep (tokens per rank 8192 / 16384, top-2, K = 2048, N in {4096, 8192}, 8..64 experts,
balanced / moderate (Zipf 0.8) / stress (Zipf 2.0) routing), run by the loopback harness with R ranks sharing one
GPU (each rank gets SMs / R CTAs; the model's SM count is that budget and its link ceiling the calibrated one / R,
since the R ranks share the GPU's memory system). Calls are timed synchronized (--per-call-stats: all ranks finish a
call before any starts the next, start to end on each rank's stream, the slowest rank's time): back to back, one
rank's next call would occupy SMs that another rank's current call still needs, and the times would measure that
contention, not C. Read the per-C times before trusting a regret: an outlier C skews it. Every workload's first call
is checked against a host reference (on a sample of tokens) and every timed variant's outputs bit for bit against
it.

Decision cost: the harness' DecisionBenchKernel loads rank 0's plan and builds its segment table as ExpertKernel does
under the model (with the choice's prepared parts) and runs the prepared choice ExpertKernel runs (the 32 candidates'
FP64 loop and the argmin) thousands of times in one CTA; the time per choice is reported (the table build, the plan's
loads included, apart: ExpertKernel needs it whether or not it chooses C).

  python3 -m benchmarks.bench_resource --calibration $OUT/calibration/nvidia_h200.json --out $OUT/resource.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import time

import numpy as np

from benchmarks import loopback_runner as lb
from jax_moe_overlap import _jmo
from jax_moe_overlap import resource as rm

SKEW_ARGS = {"balanced": ["--routing", 0], "moderate": ["--routing", 1, "--zipf", 0.8],
             "stress": ["--routing", 1, "--zipf", 2.0]}


def workloads(quick: bool):
  """12 workloads: tokens x N x skew, the expert count cycling through 8, 32, 64, 16 (4..64 in the seed sweep)."""
  out = []
  experts = itertools.cycle([8, 32, 64, 16])
  for tokens, n, skew in itertools.product((8192, 16384), (4096, 8192), ("balanced", "moderate", "stress")):
    out.append(dict(tokens=tokens, n=n, k=2048, top_k=2, experts=next(experts), skew=skew))
  # --quick: 4 of them covering both token counts, both N, all three skews and 8..64 experts.
  return [out[i] for i in (0, 5, 7, 10)] if quick else out


# The consumer CTA counts the device kernel considers: C in [1, min(MAX_MODEL_CTAS, budget - 1)], one warp of
# candidates (resource_manager.cuh, kMaxModelCtas).
MAX_MODEL_CTAS = 32


def _table_order(seg_rows, rank: int) -> list[tuple[int, int]]:
  """(expert, source) of the non-empty segments of ``seg_rows [E_local, R]`` in the segment table's order
  (protocol.h SegmentBefore: remote first, the most loaded destination first, then by source and expert; own
  segments last)."""
  E_l = len(seg_rows)
  R = len(seg_rows[0]) if E_l else 0
  to_rank = [sum(int(seg_rows[e][s]) for e in range(E_l)) for s in range(R)]
  keys = sorted(((s == rank, -to_rank[s], s, e) for e in range(E_l) for s in range(R)))
  return [(e, s) for _, _, s, e in keys if int(seg_rows[e][s]) > 0]


def device_segment_sources(seg_rows, rank: int) -> list[tuple[int, int]]:
  """The kernel's segment table of one rank's call: (rows, source) of the non-empty segments of
  ``seg_rows [E_local, R]`` in the producer's order (_table_order)."""
  return [(int(seg_rows[e][s]), s) for e, s in _table_order(seg_rows, rank)]


# The wgmma producer's rows per tile and its raster band's row blocks (wgmma_gemm::kBM, wgmma_gemm::kBandM).
WGMMA_BM, WGMMA_BAND_M = 128, 8


def wgmma_row_blocks(seg_rows) -> tuple[np.ndarray, np.ndarray]:
  """The wgmma producer's 128-row blocks of ``seg_rows [E_local, R]``: per segment, each tiled apart, and per expert,
  its rows tiled as one range (as the bare grouped GEMM tiles them)."""
  seg = np.maximum(np.asarray(seg_rows, np.int64), 0)
  return (seg + WGMMA_BM - 1) // WGMMA_BM, (seg.sum(axis=1) + WGMMA_BM - 1) // WGMMA_BM


def producer_expert_major(seg_rows, producer_order: int = 0, band_m: int = 0, producer: str = "wgmma") -> bool:
  """Whether expert_combine's producer goes expert-major on a rank with ``seg_rows [E_local, R]``
  (cuda/ops/expert_producer.cuh UseExpertMajor): only its wgmma engine does (``producer``, the engine's name as the
  loopback runner reports it: bf16 and FP8 on Hopper; never gather_rs's producer, which the caller leaves out);
  there ``producer_order`` 2 pins it, 1 the segment table's order; 0, the rule: the table's order counts at least
  twice the weight passes, a pass per raster band of ``band_m`` row blocks (0: the library's 8) summed over the
  segments against the same over the experts' rows."""
  if not producer.startswith("wgmma"):
    return False
  if producer_order:
    return producer_order == 2
  band = band_m or WGMMA_BAND_M
  apart, whole = wgmma_row_blocks(seg_rows)
  return int(np.sum((apart + band - 1) // band)) >= 2 * int(np.sum((whole + band - 1) // band))


def device_segments_expert_major(seg_rows, rank: int) -> tuple[list[tuple[int, int]], list[int]]:
  """device_segments in the expert-major producer's order (the table's segments by expert, stably) and each one's
  ModelSegment::tile_rows: an expert's first segment carries the expert's rows, the others none (its rows are tiled
  as one range, every segment ready once they are)."""
  segs, tile_rows, seen = [], [], set()
  for e, s in sorted(_table_order(seg_rows, rank), key=lambda es: es[0]):
    segs.append((int(seg_rows[e][s]), int(s != rank)))
    tile_rows.append(0 if e in seen else sum(max(int(n), 0) for n in seg_rows[e]))
    seen.add(e)
  return segs, tile_rows


def device_segments(seg_rows, rank: int) -> list[tuple[int, int]]:
  """The kernel's view of one rank's expert_combine, as the model takes it: (rows, remote) of the non-empty segments
  in the producer's order (device_segment_sources). Only remote segments are pushed: the CUDA producer stores the
  rank's own segments in place."""
  return [(rows, int(s != rank)) for rows, s in device_segment_sources(seg_rows, rank)]


def kernel_consumer_ctas(p: rm.ModelParams, seg_rows, rank: int, n: int, k: int, elem_bytes: int, max_ctas: int,
                         pinned: int = 0, expert_major: bool = False) -> int:
  """The consumer CTA count the CUDA kernel uses for one rank's call (resource_manager.cuh ConsumersOfCall): 0 when
  nothing is pushed (no remote segment: every CTA produces), else ``pinned`` if given, else the model's choice
  (``_jmo.model_choose_consumer_ctas``, the device's model run on the host), with ``expert_major`` in the
  expert-major producer's order (ExpertMajorTermPrep's terms: device_segments_expert_major)."""
  segs, tile_rows = device_segments_expert_major(seg_rows, rank) if expert_major else (
      device_segments(seg_rows, rank), [])
  if not any(remote for _, remote in segs):
    return 0
  return pinned if pinned > 0 else _jmo.model_choose_consumer_ctas(p.native(), segs, n, k, elem_bytes, max_ctas,
                                                                   tile_rows)


def kernel_gather_consumer_ctas(p: rm.ModelParams, seg_rows, rank: int, tokens: int, slots: int, n: int, k: int,
                                elem_bytes: int, max_ctas: int, fixed: int, pinned: int = 0) -> int:
  """The consumer CTA count the CUDA kernel uses for one rank's gather_rs call under the model (resource_manager.cuh
  GatherConsumersOfCall): ``pinned`` if given; else ``fixed`` (the workspace's fixed C) when no segment is another
  rank's; else the model's choice (``_jmo.model_choose_gather_consumer_ctas``, the device's model run on the host)
  from the segments in producer order, the tokens per rank and the slots per token (k TP)."""
  if pinned > 0:
    return pinned
  segs = device_segment_sources(seg_rows, rank)
  if not any(s != rank for _, s in segs):
    return fixed
  R = len(seg_rows[0])
  return _jmo.model_choose_gather_consumer_ctas(p.native(), segs, rank, R, tokens, slots, n, k, elem_bytes, max_ctas)


def gather_traffic_bytes(seg_rows, rank: int, tokens: int, slots: int, n: int, elem_bytes: int) -> int:
  """The memory traffic of one rank's gather_rs call as the model counts it (``_jmo.model_gather_traffic_bytes``: per
  source its partial stored, its token_rows and its rows here with their gates read), from ``seg_rows [E_local, R]``:
  what benchmarks/calibrate.py divides by the consumer's span for gather_gbps."""
  R = len(seg_rows[0])
  return _jmo.model_gather_traffic_bytes(device_segment_sources(seg_rows, rank), rank, R, tokens, slots, n, elem_bytes)


def model_for_ranks(p: rm.ModelParams, ranks: int) -> rm.ModelParams:
  """What the device sees per rank in loopback: the link shared by the R ranks of the GPU."""
  return dataclasses.replace(p, link_gbps=p.link_gbps / ranks)


def summarize(rows):
  """Regret of the manager vs the oracle per workload, and the manager vs the best fixed C across the set."""
  cs = sorted(set.intersection(*[set(r["times_us"]) for r in rows]))
  total = {c: sum(r["times_us"][c] for r in rows) for c in cs}
  best_fixed = min(cs, key=lambda c: (total[c], c))
  manager_total = sum(r["manager_us"] for r in rows)
  regrets = [r["regret"] for r in rows]
  geo = math.exp(sum(math.log(r["times_us"][best_fixed] / r["manager_us"]) for r in rows) / len(rows))
  return dict(kind="summary", workloads=len(rows), mean_regret=sum(regrets) / len(regrets), worst_regret=max(regrets),
              best_fixed_c=best_fixed, speedup_vs_best_fixed_total=total[best_fixed] / manager_total,
              speedup_vs_best_fixed_geomean=geo, mirror_agrees=all(r["mirror_agrees"] for r in rows))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--calibration", default=None, help="calibration JSON (default: the shipped one for this GPU)")
  ap.add_argument("--ranks", type=int, default=4, help="loopback ranks sharing the GPU")
  ap.add_argument("--ctas", default="all", help="C values of the oracle: 'all' = 1..min(32, budget - 1), or a list")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--quick", action="store_true", help="4 workloads instead of 12")
  ap.add_argument("--only", type=int, default=None, help="run workload #i only")
  ap.add_argument("--decision-iters", type=int, default=2000)
  ap.add_argument("--out", default=None, help="JSON lines")
  ap.add_argument("--log", default=None)
  args = ap.parse_args(argv)
  log = open(args.log, "a") if args.log else None
  dev = lb.device_info()
  cal_path = args.calibration or os.path.join(rm.CALIBRATION_DIR, rm.calibration_file_name(dev["name"]))
  params = rm.load_params(cal_path)
  if params.sms != dev["sms"]:
    sys.exit(f"{cal_path} was measured on {params.sms} SMs, this GPU has {dev['sms']}")
  R = args.ranks
  budget = dev["sms"] // R
  per_rank = model_for_ranks(params, R)
  cs = list(range(1, MAX_MODEL_CTAS + 1)) if args.ctas == "all" else [int(c) for c in args.ctas.split(",")]
  cs = [c for c in cs if 1 <= c <= min(MAX_MODEL_CTAS, budget - 1)]
  header = dict(kind="header", command=" ".join(["python3"] + sys.argv), device=dev, calibration=cal_path,
                params=dataclasses.asdict(params), ranks=R, budget=budget, ctas=cs,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
  out_rows, out_rows_failed = [], []
  # JSON lines are written as the workloads finish, so a run stopped by a time limit keeps the rows it measured.
  out_f = open(args.out, "w") if args.out else None

  def emit(r):
    if out_f:
      out_f.write(json.dumps(r) + "\n")
      out_f.flush()

  emit(header)
  wls = workloads(args.quick)
  if args.only is not None:
    wls = [wls[args.only]]
  print(f"{len(wls)} workloads x {len(cs)} pinned C + the manager, R = {R} ranks x {budget} CTAs, {args.reps} reps")
  print("| # | tokens/rank | N | E | skew | oracle C | oracle ms | manager C (per rank) | manager ms | regret | "
        "serialized ms | C=SMs/8 ms | mirror |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  t_all = time.time()
  decision = []
  for i, w in enumerate(wls):
    t0 = time.time()
    base = ["--ranks", R, "--tokens", w["tokens"], "--top-k", w["top_k"], "--experts", w["experts"], "--d-model", 64,
            "--k-dim", w["k"], "--n-dim", w["n"], "--iters", 1, "--datasets", 1, "--check-tokens", 16,
            "--model", lb.params_arg(per_rank), "--time", "--per-call-stats", "--warmup", args.warmup, "--reps", args.reps,
            "--timeout-ms", 60000] + SKEW_ARGS[w["skew"]]
    try:
      res = lb.run(base + ["--consumers", 0, "--sweep-consumers", ",".join(map(str, cs)),
                           "--decision-cost", args.decision_iters], timeout=900, log=log)
    except lb.LoopbackError as e:  # a failed check: no numbers from this workload
      print(f"| {i} | {w} | FAILED: {str(e)[-600:]}", flush=True)
      out_rows_failed.append(dict(kind="failed", index=i, **w, error=str(e)[-4000:]))
      emit(out_rows_failed[-1])
      continue
    timed = [r for r in res["results"] if r["kind"] == "timed"]
    plans = sorted((r for r in res["results"] if r["kind"] == "plan"), key=lambda r: r["rank"])
    times = {r["consumers"]: r["median_us"] for r in timed if r["consumers"] > 0}
    manager = [r for r in timed if r["consumers"] == 0 and not r["serialize"]][0]
    ser_us = [r for r in timed if r["consumers"] == 0 and r["serialize"]][0]["median_us"]
    fixed_c = min(max(1, dev["sms"] // 8), budget - 1)
    fixed_us = times.get(fixed_c)
    oracle = min(times, key=lambda c: (times[c], c))
    # The model run on the host on the same segment tables (the "mirror") must pick what the device picked.
    p_rank = dataclasses.replace(per_rank, sms=budget, ctas_per_sm=1)
    # (in the expert-major producer's order where its engine goes so, as the kernel: UseExpertMajor)
    grids = [_grid(pl["seg_rows"], R) for pl in plans]
    mirror = [kernel_consumer_ctas(p_rank, g, pl["rank"], w["n"], w["k"], 2, min(MAX_MODEL_CTAS, budget - 1),
                                   expert_major=producer_expert_major(g, producer=pl.get("producer", "")))
              for g, pl in zip(grids, plans)]
    mirror_ok = mirror == manager["chosen"]
    wl_decision = [r for r in res["results"] if r["kind"] == "decision"]
    decision += wl_decision
    row = dict(kind="workload", index=i, **w, ranks=R, budget=budget, times_us={c: times[c] for c in sorted(times)},
               oracle_c=oracle, oracle_us=times[oracle], manager_chosen=manager["chosen"], manager_us=manager["median_us"],
               regret=manager["median_us"] / times[oracle] - 1.0, serialized_us=ser_us, fixed_c=fixed_c,
               fixed_us=fixed_us, mirror_chosen=mirror, mirror_agrees=mirror_ok, seconds=time.time() - t0,
               decision_ns=[d["decision_ns"] for d in wl_decision], table_ns=[d["table_ns"] for d in wl_decision],
               model_us={c: _jmo.model_makespan_us(p_rank.native(), device_segments(_grid(plans[0]["seg_rows"], R), 0),
                                                   w["n"], w["k"], 2, c) for c in cs})
    out_rows.append(row)
    emit(row)
    print(f"| {i} | {w['tokens']} | {w['n']} | {w['experts']} | {w['skew']} | {oracle} | {times[oracle] / 1e3:.3f} | "
          f"{','.join(map(str, manager['chosen']))} | {manager['median_us'] / 1e3:.3f} | {100 * row['regret']:.1f}% | "
          f"{ser_us / 1e3:.3f} | {(fixed_us or float('nan')) / 1e3:.3f} | {'ok' if mirror_ok else 'DIFFERS'} |",
          flush=True)
  summary = summarize(out_rows) if out_rows else {}
  if decision:
    summary.update(decision_ns_median=lb.median([d["decision_ns"] for d in decision]),
                   decision_ns_max=max(d["decision_ns"] for d in decision),
                   table_build_ns_median=lb.median([d["table_ns"] for d in decision]))
  summary["seconds"] = time.time() - t_all
  summary["failed_workloads"] = len(out_rows_failed)
  print(f"\nmean regret {100 * summary.get('mean_regret', float('nan')):.2f}%, worst "
        f"{100 * summary.get('worst_regret', float('nan')):.2f}% | best fixed C across the set: "
        f"{summary.get('best_fixed_c')} -> manager speed-up {summary.get('speedup_vs_best_fixed_total', float('nan')):.3f}x "
        f"(total time), {summary.get('speedup_vs_best_fixed_geomean', float('nan')):.3f}x (geomean) | decision "
        f"{summary.get('decision_ns_median', float('nan')):.0f} ns per call (max "
        f"{summary.get('decision_ns_max', float('nan')):.0f}; table build "
        f"{summary.get('table_build_ns_median', float('nan')):.0f} ns, needed anyway) | host model agrees: "
        f"{summary.get('mirror_agrees')} | {summary['seconds']:.0f} s")
  emit(summary)
  if out_f:
    out_f.close()
  return out_rows, summary


def _grid(flat, R):
  """seg_rows [E_local * R] (flat, expert-major) -> [E_local][R]."""
  return [flat[e * R:(e + 1) * R] for e in range(len(flat) // R)]


if __name__ == "__main__":
  main()
