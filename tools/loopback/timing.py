"""Timing statistics of a loopback run: per timed variant, the group's per-call time (the slowest rank of each call),
the device spans of producer and consumer, the consumer counts the kernels used, and the median call's timeline; and
the overlap table's row of a case (GEMM alone, transfer alone, the no-overlap baseline, ours, the hidden share)."""

from __future__ import annotations

import json
import math

import numpy as np

from tools.loopback import cases as cases_lib
from tools.loopback.cases import Case, RankData


def quantile(x: list[float], q: float) -> float:
  if not x:
    return 0.0
  x = sorted(x)
  return x[min(len(x) - 1, math.floor(q * (len(x) - 1) + 0.5))]


def _timeline(records: list[list[dict]], med: int) -> str:
  """Per rank, microseconds from the earliest BeginKernel of call `med` (all ranks share one %globaltimer)."""
  t0 = min((rec[med]["begin_t"] for rec in records if med < len(rec)), default=0)

  def at(t: int) -> str:
    return f"{-1.0 if t == 0 else (t - t0) * 1e-3:.1f}"

  parts = []
  for r, rec in enumerate(records):
    if med >= len(rec):
      continue
    q = rec[med]
    parts.append(f"r{r} C={q['consumers']} begin {at(q['begin_t'])} prod {at(q['prod_t0'])}..{at(q['prod_t1'])} "
                 f"(last CTA start {at(q['prod_t0_last'])}) cons {at(q['cons_t0'])}..{at(q['cons_t1'])} "
                 f"comb {at(q['comb_t0'])}..{at(q['comb_t1'])}")
  return " | ".join(parts)


def _span_us(q: dict, part: str) -> float:
  """A device record's span of `part` ("prod", "cons", "comb") in microseconds; 0 where it did not run."""
  t0, t1 = q[f"{part}_t0"], q[f"{part}_t1"]
  return (t1 - t0) * 1e-3 if t1 > t0 else 0.0


def _start_us(q: dict) -> float:
  """A device record's first producer tile after its ExpertKernel's first CTA started, microseconds (0 where no tile
  ran or the record has no such start): the segment table and, where a CTA must wait for it, the consumer choice."""
  t0, t1 = q.get("entry_t", 2**64 - 1), q["prod_t0"]
  return (t1 - t0) * 1e-3 if t0 < t1 < 2**63 else 0.0


def _median_call(per_call: list[float]) -> int:
  """The index of the call whose time is nearest the median of per_call (not empty)."""
  med = quantile(per_call, 0.5)
  return min(range(len(per_call)), key=lambda i: abs(per_call[i] - med))


def rank_spans_us(records: list[list[dict]], part: str) -> list[float]:
  """Per rank, the median over its recorded calls of its span of `part` (0 where it never ran)."""
  return [quantile([s for s in (_span_us(q, part) for q in rec) if s > 0], 0.5) for rec in records]


def _variant_stats(result: dict, vi: int) -> tuple[dict, list[list[dict]], list[float]]:
  """Timed variant vi: its statistics (per call the slowest rank; producer and consumer spans, the slowest rank's of
  each call), each rank's device records, and the per-call times."""
  ranks = result["timed"][vi]
  calls = len(ranks[0]["call_us"]) if ranks else 0
  per_call = [max(t["call_us"][i] for t in ranks if i < len(t["call_us"])) for i in range(calls)]
  records = [t["device"] for t in ranks]
  prod, cons, comb, start = [], [], [], []
  for i in range(len(records[0]) if records else 0):
    here = [rec[i] for rec in records if i < len(rec)]
    prod.append(max((_span_us(q, "prod") for q in here), default=0.0))
    start.append(max((_start_us(q) for q in here), default=0.0))
    cons.append(max((_span_us(q, "cons") for q in here), default=0.0))
    comb.append(max((_span_us(q, "comb") for q in here), default=0.0))
  stats = {"median_us": quantile(per_call, 0.5), "p10_us": quantile(per_call, 0.1), "p90_us": quantile(per_call, 0.9),
           "mean_us": sum(per_call) / len(per_call) if per_call else 0.0,
           "producer_span_us": quantile(prod, 0.5), "consumer_span_us": quantile(cons, 0.5),
           "combine_span_us": quantile(comb, 0.5), "producer_start_us": quantile(start, 0.5)}
  return stats, records, per_call


def variant_lines(case: Case, result: dict, identical: list[bool], remote_rows: list[int]) -> list[str]:
  """The TIMED, RESULT and TIMELINE lines of every timed variant (benchmarks/loopback_runner.py parses RESULT; its
  rank_consumer_span_us: per rank the median of its consumer spans, over every call with --per-call-stats, else of
  its last call)."""
  lines = []
  eb = 4 if case.f32 else 2
  pushed_bytes = float(sum(remote_rows) * case.n_dim * eb)
  if case.gather_rs:  # every rank's float32 partials for the other ranks
    pushed_bytes = float(case.ranks * (case.ranks - 1) * case.tokens * case.n_dim * 4)
  for vi, (consumers, serialize) in enumerate(case.variants()):
    if vi >= len(result["timed"]):
      break
    stats, records, per_call = _variant_stats(result, vi)
    chosen = [rec[-1]["consumers"] if rec else 0 for rec in records]
    same = identical[vi] if vi < len(identical) else True
    label = str(consumers) if consumers > 0 else "manager"
    lines.append(f"TIMED C={label}{' serialized' if serialize else ''} "
                 + " ".join(f"{k}={v:.2f}" for k, v in stats.items())
                 + f" chosen={','.join(map(str, chosen))} pushed_MB={pushed_bytes / 1e6:.2f} identical={int(same)}")
    lines.append("RESULT " + json.dumps({"kind": "timed", "consumers": consumers, "serialize": int(serialize), **stats,
                                         "rank_consumer_span_us": rank_spans_us(records, "cons"),
                                         "chosen": chosen, "pushed_bytes": pushed_bytes, "identical": same,
                                         "budget": result["budget"]}))
    if case.per_call_stats and per_call and len(records[0]) == len(per_call):
      lines.append("TIMELINE " + _timeline(records, _median_call(per_call)))
  return lines


def _median_of_max(us: list[list[float]]) -> float:
  """Per call the slowest rank, the median over calls."""
  if not us or not us[0]:
    return 0.0
  return quantile([max(u[i] for u in us if i < len(u)) for i in range(len(us[0]))], 0.5)


# The overlap table (one row per timed case; run.py prints the rows of a run as one markdown table at its end).
TABLE_HEADER = ("| case | link GB/s per rank | GEMM alone us | transfer alone: us, MB, GB/s, % of link | two calls / "
                "serialized us | ours us | ours / GEMM alone | hidden share of the transfer | SMs used by the transfer "
                "|\n|---|---|---|---|---|---|---|---|---|")


def row_blocks(case: Case, plan: dict) -> tuple[int, int]:
  """A rank's 128-row blocks (the wgmma producer's tile rows) as expert_combine's producer on Hopper tiles them, and
  over its experts' rows, as the bare grouped GEMM tiles them. Their ratio is the producer's extra tiles. The
  producer tiles each segment (one source's rows of an expert) apart in the segment table's order, where every
  segment not a multiple of 128 rows ends in a partial block, and each expert's rows as one range where its bf16 and
  FP8 engine goes expert-major (benchmarks/bench_resource.py producer_expert_major; not gather_rs, not float32)."""
  from benchmarks import bench_resource  # pylint: disable=g-import-not-at-top
  seg = np.asarray(plan["seg_rows"], np.int64).reshape(-1, case.ranks)  # (expert, source)
  apart, whole = bench_resource.wgmma_row_blocks(seg)
  return int(np.sum(whole if case.producer_expert_major(seg) else apart)), int(np.sum(whole))


def overlap_row(case: Case, result: dict, ranks: list[RankData]) -> dict | None:
  """The overlap table's row of a timed case with ``table`` (None without the timings it needs). Per call the
  slowest rank, the median over calls; bytes and SMs the largest rank's.

  dispatch_gemm: GEMM alone = the bare GEMM1 over the kept rows; transfer alone = the dispatch call alone (its
  copies of the rank's own rows included), bytes = what it pushes to other ranks (cases.wire_bytes: with send once
  the primaries' rows and every remote slot's 8-byte entry); two calls = the dispatch, then
  the bare GEMM1 over all recv rows; ours = dispatch_gemm; SMs = its pushing CTAs.
  expert_combine: GEMM alone = the bare GEMM2 over the kept rows; transfer alone = the consumer's span in the
  serialized call (from its first push after the last tile to its last), bytes = the rows of remote segments;
  serialized = expert_combine with its pushes after the last tile; ours = expert_combine (its combine's span,
  which no GEMM hides, beside: combine_us); SMs = the consumer CTAs the calls used; row_blocks = row_blocks' pair
  of the rank with the most segment blocks.
  gather_rs: the same with its consumer's reduce-scatter in the pushes' place: bytes = the float32 partials a rank
  stores into the other ranks' slices, (R - 1) T N x 4; combine_us = the span of its slice sum.
  hidden share = 1 - (ours - GEMM alone) / transfer alone: 1 when ours costs the GEMM alone, 0 when GEMM + transfer.
  """
  eb = 4 if case.f32 else 2
  gemm = _median_of_max(result.get("gemm_us", []))
  if case.dg:
    two, fused, alone = result["dg_us"]
    transfer, baseline, ours = _median_of_max(alone), _median_of_max(two), _median_of_max(fused)
    wire = [cases_lib.wire_bytes(case, d.plan, r, case.dispatch_row_bytes) for r, d in enumerate(ranks)]
    used = [q.get("pushers", 0) for q in result.get("dg_device", [])]  # P of each rank's last fused call
    moved, sms = max(b for _, b in wire), max(used, default=0) or result.get("pushers", 0)
    extra = {"send_once": case.sends_once, "rows_sent": max(n for n, _ in wire),
             "x_recv_from_tiles": case.x_recv_from_tiles}
    op = (f"dispatch_gemm {case.dispatch_gemm_mode}{'' if case.x_recv_from_tiles else ' x_recv=copied'}"
          f"{' row_scale' if case.row_scale else ''}")
  else:
    variants = case.variants()
    if (case.consumers, False) not in variants or (case.consumers, True) not in variants:
      return None
    ours_stats, records, _ = _variant_stats(result, variants.index((case.consumers, False)))
    ser_stats, _, _ = _variant_stats(result, variants.index((case.consumers, True)))
    transfer, baseline, ours = ser_stats["consumer_span_us"], ser_stats["median_us"], ours_stats["median_us"]
    remote = [cases_lib.remote_rows(d.plan, case.ranks, r) for r, d in enumerate(ranks)]
    moved = max(remote) * case.n_dim * eb
    if case.gather_rs:
      moved = (case.ranks - 1) * case.tokens * case.n_dim * 4
    sms = max((q["consumers"] for rec in records for q in rec), default=0)
    extra = {"combine_us": ours_stats["combine_span_us"],
             "row_blocks": max((row_blocks(case, d.plan) for d in ranks), default=(0, 0))}
    op = "gather_rs" if case.gather_rs else "expert_combine"
  if not (gemm > 0 and transfer > 0 and ours > 0):
    return None
  gbps = moved / transfer * 1e-3
  return {"kind": "overlap", "case": f"{op} R={case.ranks}{f' TP={case.tensor}' if case.tensor > 1 else ''} "
                                     f"T={case.tokens} k={case.top_k} E={case.experts} "
                                     f"D={case.d_model} K={case.k_dim} N={case.n_dim}"
                                     f"{f' band_m={case.producer_band_m}' if case.producer_band_m else ''}"
                                     f"{f' order={case.producer_order}' if case.producer_order else ''}",
          "op": op, "group_tokens": case.tokens * case.ranks,
          "link_gbps": case.link_gbps, "gemm_us": gemm, "transfer_us": transfer, "transfer_bytes": moved,
          "transfer_gbps": gbps, "link_share": gbps / case.link_gbps if case.link_gbps > 0 else None,
          "baseline_us": baseline, "ours_us": ours, "ours_over_gemm": ours / gemm,
          "hidden": 1.0 - (ours - gemm) / transfer, "sms": sms, **extra}


def consumer_rate_lines(case: Case, result: dict, ranks: list[RankData]) -> list[str]:
  """expert_combine timed with its serialized form and per_call_stats: per rank, its consumer CTAs' rate alone (the
  serialized call's consumer span, after the last tile) and beside the running GEMM (the overlapped call: the bytes
  not accounted for by the alone rate over the consumer's time after the producer's last tile, over the consumer's
  time before it), GB/s per consumer CTA, each from the call nearest its variant's median. The beside rate is an
  estimate, meaningful where the consumer is the limit (its span outlasts the producer's). [] for other cases."""
  if case.dg or case.gather_rs or not (case.time and case.table and case.per_call_stats):
    return []
  variants = case.variants()
  at = {}
  for key in ((case.consumers, False), (case.consumers, True)):
    if key not in variants:
      return []
    _, records, per_call = _variant_stats(result, variants.index(key))
    if not per_call or not records or any(len(rec) != len(per_call) for rec in records):
      return []
    med = _median_call(per_call)
    at[key[1]] = [rec[med] for rec in records]
  eb = 4 if case.f32 else 2
  lines = []
  for r, d in enumerate(ranks):
    moved = cases_lib.remote_rows(d.plan, case.ranks, r) * case.n_dim * eb
    ser, ours = at[True][r], at[False][r]
    alone_us, ctas = _span_us(ser, "cons"), max(1, ser["consumers"])
    if moved <= 0 or alone_us <= 0 or ours["cons_t1"] <= ours["cons_t0"]:
      continue
    after_us = max(0.0, (ours["cons_t1"] - ours["prod_t1"]) * 1e-3)
    beside_us = (min(ours["cons_t1"], ours["prod_t1"]) - ours["cons_t0"]) * 1e-3
    left = max(0.0, moved - moved / alone_us * after_us)  # bytes the alone rate does not account for after the GEMM
    beside = left / beside_us * 1e-3 / ctas if beside_us > 0 else 0.0
    lines.append(f"CONSUMER r{r} C={ctas} {moved / 1e6:.2f} MB: alone {moved / alone_us * 1e-3 / ctas:.1f} GB/s per "
                 f"CTA ({alone_us:.1f} us) | beside the GEMM {beside:.1f} GB/s per CTA (estimated: {beside_us:.1f} us "
                 f"before the last tile, {after_us:.1f} us after it)")
  return lines


def overlap_cells(row: dict) -> str:
  """One markdown table row (TABLE_HEADER's columns)."""
  link = f"{row['link_gbps']:g}" if row["link_gbps"] > 0 else "none (HBM)"
  share = f", {100 * row['link_share']:.0f}%" if row["link_share"] is not None else ""
  return (f"| {row['case']} | {link} | {row['gemm_us']:.1f} | {row['transfer_us']:.1f}, "
          f"{row['transfer_bytes'] / 1e6:.1f}, {row['transfer_gbps']:.0f}{share} | {row['baseline_us']:.1f} | "
          f"{row['ours_us']:.1f} | {row['ours_over_gemm']:.3f} | {100 * row['hidden']:.0f}% | {row['sms']} |")


TENSOR_HEADER = ("| tokens (group) | GEMM2 alone us | per-slot (expert_combine) us | GEMM2 + GatherRS serialized us | "
                 "GEMM2 + GatherRS overlapped us | GatherRS overlapped / per-slot | GatherRS hidden share |\n"
                 "|---|---|---|---|---|---|---|")


def tensor_table(rows: list[dict]) -> list[str]:
  """The tensor-time suite's table (cases.TENSOR_TIME_TOKENS): per group token count, GEMM2 alone (GatherRS case's),
  the per-slot path, GatherRS serialized and overlapped (per call the slowest rank, medians after warm-up). Empty
  when no shape has both rows."""
  by = {}
  for row in rows:
    by.setdefault(row["group_tokens"], {})[row["op"]] = row
  lines = []
  for tokens in sorted(by):
    pair = by[tokens]
    if "gather_rs" not in pair or "expert_combine" not in pair:
      continue
    g, p = pair["gather_rs"], pair["expert_combine"]
    lines.append(f"| {tokens} | {g['gemm_us']:.1f} | {p['ours_us']:.1f} | {g['baseline_us']:.1f} | "
                 f"{g['ours_us']:.1f} | {g['ours_us'] / p['ours_us']:.3f} | {100 * g['hidden']:.0f}% |")
  return [TENSOR_HEADER, *lines] if lines else []


def plan_lines(case: Case, ranks: list[RankData], budget: int, producer: str) -> list[str]:
  """One RESULT line per rank: its segment rows on data set 0 and the producer engine's name (for the benchmarks'
  host-side model)."""
  return ["RESULT " + json.dumps({"kind": "plan", "rank": r, "ranks": case.ranks, "budget": budget,
                                  "producer": producer, "seg_rows": [int(n) for n in d.plan["seg_rows"]]})
          for r, d in enumerate(ranks)]


def decision_lines(result: dict) -> list[str]:
  t, d, c = result["table_ns"], result["decision_ns"], result["decision_choice"]
  return [f"DECISION table_build_ns={t:.1f} decision_ns={d:.1f} choice={c}",
          "RESULT " + json.dumps({"kind": "decision", "table_ns": t, "decision_ns": d, "choice": c})]


def dispatch_gemm_summary(result: dict) -> str:
  """dispatch + GEMM1 per call, two calls against one launch, and the two calls' dispatch alone: per call the slowest
  rank, the median over calls."""
  two, fused, alone = result["dg_us"]
  if not two or not two[0] or not fused or not fused[0]:
    return ""
  a, b = _median_of_max(two), _median_of_max(fused)
  d = f", of which the dispatch alone {_median_of_max(alone):.1f} us" if alone and alone[0] else ""
  return (f" | dispatch + GEMM1 per call: two calls {a:.1f} us{d}, dispatch_gemm {b:.1f} us ({a / b:.3f}x)"
          f"{dispatch_gemm_timeline(result)}")


def dispatch_gemm_push_rates(case: Case, result: dict, ranks: list[RankData]) -> dict | None:
  """Per rank, what its pushers moved in its last timed dispatch_gemm: P, the bytes of its rows for other ranks, the
  push span (first push to the last pusher's end of pushing) and GB/s per pusher (benchmarks/calibrate.py's
  pusher_gbps)."""
  out = []
  for r, q in enumerate(result.get("dg_device", [])):
    _, sent = cases_lib.wire_bytes(case, ranks[r].plan, r, case.dispatch_row_bytes)  # what crossed (send once)
    t0, t1, p = q["cons_t0"], q["push_t1"], q.get("pushers", 0)
    if not (p > 0 and sent > 0 and t0 and t1 > t0 and t0 != 2**64 - 1):
      continue
    us = (t1 - t0) * 1e-3
    out.append({"rank": r, "pushers": p, "bytes": sent, "push_us": us, "gbps_per_pusher": sent / us * 1e-3 / p})
  return {"kind": "dispatch_gemm_push", "link_gbps": case.link_gbps, "ranks": out} if out else None


def dispatch_gemm_timeline(result: dict) -> str:
  """Where the last timed dispatch_gemm of each rank spent its time, in microseconds from the earliest rank's
  BeginKernel (one clock for all ranks, so one rank's pushes line up with another's GEMM): the rank's BeginKernel, its
  pushers from their first push to the end of the push and of their side work, the GEMM from the first CTA entering
  the tile loop to the last leaving it and when its first tile not made of the rank's own rows alone (phase B) was
  claimed, the mean time a GEMM CTA's look-ahead warp (which claims a tile while the previous one loads) waited
  for its tiles' rows, in phase A (own rows) and in phase B, and the mean time its TMA thread stalled for the
  look-ahead (the part of those waits, and of the claims, that the loads did not cover) on the CTA's first tile + on
  the others."""
  records = result.get("dg_device", [])
  starts = [q["begin_t"] for q in records if q["begin_t"]]
  if not starts:
    return ""
  t0 = min(starts)

  def at(t: int) -> str:
    return f"{(t - t0) * 1e-3:.1f}" if t and t != 2**64 - 1 else "-"

  parts = []
  for r, q in enumerate(records):
    if not q["begin_t"]:
      continue
    gemm_ctas = q.get("ctas", 0) - q.get("pushers", 0)
    wait = ""
    if gemm_ctas > 0 and "gemm_wait_own_ns" in q:
      stall = (f" stall {q['gemm_stall_first_ns'] * 1e-3 / gemm_ctas:.1f} + {q['gemm_stall_ns'] * 1e-3 / gemm_ctas:.1f}"
               if "gemm_stall_first_ns" in q else "")
      wait = (f" wait A {q['gemm_wait_own_ns'] * 1e-3 / gemm_ctas:.1f} B {q['gemm_wait_ns'] * 1e-3 / gemm_ctas:.1f}"
              f"{stall}/CTA, B from {at(q['phase_b_t0'])}")
    parts.append(f"r{r} P={q.get('pushers', '?')} begin {at(q['begin_t'])} push {at(q['cons_t0'])}..{at(q['push_t1'])} "
                 f"side ..{at(q['cons_t1'])} gemm {at(q['prod_t0'])}..{at(q['prod_t1'])}{wait}")
  return f" | timeline (us): {'; '.join(parts)}" if parts else ""
