"""The regret of the resource manager's choices in the loopback harness: expert_combine's consumer count C,
gather_rs's (GEMM2 + GatherRS) and dispatch_gemm's pusher count P, each against a sweep of pinned counts on the same
data.

regret = (time with the model's choice) / (the best pinned time of the sweep) - 1, per call the slowest rank, the median
over calls (and for a sweep timed in several interleaved passes, Case.sweep_passes, the median over them). Negative
where the model chose a count the sweep does not pin and it was faster. The target (issue 31): mean <= 3%, worst <= 10%.
Each case also checks the host mirror (the C++ model through the extension, on the plan the kernels got) against the
counts the device recorded.
"""

from __future__ import annotations

import dataclasses
import json

from tools.loopback import timing
from tools.loopback.cases import Case, RankData


def _medians(us_by_rank: list[list[float]]) -> float:
  return timing._median_of_max(us_by_rank)  # pylint: disable=protected-access


def _median_per_count(runs) -> dict[int, float]:
  """(count, time of one timed run) pairs -> per count the median over its runs (one per pass of the sweep)."""
  by: dict[int, list[float]] = {}
  for c, t in runs:
    by.setdefault(c, []).append(t)
  return {c: timing.quantile(t, 0.5) for c, t in by.items()}


def _rank_model(case: Case, budget: int):
  """The model each rank's launch evaluates: the case's ModelParams with the rank's SM budget and the call's link."""
  from jax_moe_overlap import _jmo, resource  # pylint: disable=g-import-not-at-top
  ints = ("sms", "ctas_per_sm", "tile_m", "tile_n")
  p = resource.ModelParams(**{f.name: (int if f.name in ints else float)(v)
                              for f, v in zip(dataclasses.fields(resource.ModelParams), case.model)})
  p = dataclasses.replace(p, sms=budget, ctas_per_sm=1)
  q = _jmo.model_with_link(p.native(), float(case.link_gbps))
  return dataclasses.replace(p, link_gbps=q.link_gbps), _jmo


def combine_mirror(case: Case, plans: list[dict], budget: int, producer: str = "wgmma") -> list[int]:
  """expert_combine's C on each rank as its kernel picks it on a budget of `budget` SMs: the C++ model on the rank's
  plan (the host mirror; the e4m3 producer's K as the kernel hands it to the model, Fp8ModelK), in the producer's
  order (`producer`: the run's engine name; Case.producer_expert_major)."""
  from benchmarks import bench_resource  # pylint: disable=g-import-not-at-top
  p, jmo = _rank_model(case, budget)
  K = jmo.model_fp8_k(case.rank_k) if case.fp8 else case.rank_k
  out = []
  for r, plan in enumerate(plans):
    seg_rows = plan["seg_rows"].reshape(case.experts_per_rank, case.ranks).tolist()
    # The kernel times the expert-major producer in its own order where its engine goes so.
    em = case.producer_expert_major(seg_rows, producer)
    out.append(bench_resource.kernel_consumer_ctas(p, seg_rows, r, case.n_dim, K, 4 if case.f32 else 2,
                                                   min(32, budget - 1), expert_major=em))
  return out


def pusher_mirror(case: Case, plans: list[dict], budget: int) -> list[int]:
  """dispatch_gemm's P on each rank as its kernel picks it on a budget of `budget` SMs: the C++ model on the rank's
  plan (the host mirror; GEMM1's K as the kernel hands it, Fp8ModelK)."""
  p, jmo = _rank_model(case, budget)
  K = jmo.model_fp8_k(case.d_model) if case.fp8 else case.d_model
  return [jmo.model_choose_dispatch_pushers_for_plan(p.native(), [int(v) for v in plan["send_start"]], r,
                                                     int(plan["recv_rows"]), case.dispatch_row_bytes, K, case.rank_k,
                                                     jmo.model_max_ctas(budget))
          for r, plan in enumerate(plans)]


def consumer_row(case: Case, result: dict, ranks: list[RankData]) -> dict | None:
  """The C regret of a timed case with a consumer sweep (Case.sweep): its pinned variants against the manager's."""
  variants = case.variants()
  if not case.sweep or (0, False) not in variants or not case.model:
    return None
  runs, starts, chosen = [], [], None  # (C, the median of one pass's timed run: Case.sweep_passes); the manager's C
  for vi, (c, ser) in enumerate(variants):
    if ser or vi >= len(result["timed"]):
      continue
    stats, records, _ = timing._variant_stats(result, vi)  # pylint: disable=protected-access
    if c == 0 and chosen is None:
      chosen = [rec[-1]["consumers"] if rec else 0 for rec in records]
    runs.append((c, stats["median_us"]))
    starts.append((c, stats["producer_start_us"]))
  times = _median_per_count(runs)
  # The first producer tile after the kernel's first CTA started: with the model's C against the pinned counts' (the
  # median over them: a pinned C needs no choice), what the choice costs the producers' start.
  start = _median_per_count(starts)
  pinned_start = timing.quantile([t for c, t in start.items() if c > 0], 0.5)
  pinned = {c: t for c, t in times.items() if c > 0}
  if 0 not in times or not pinned:
    return None
  best = min(pinned, key=lambda c: (pinned[c], c))
  budget = result["budget"]
  what = "C"
  if case.gather_rs:
    fixed, policy = result.get("fixed_consumers", 0), result.get("consumer_policy", "")
    what = "C gather_rs" if policy == "model" else f"C gather_rs ({policy or 'unknown'} policy)"
    mirror = gather_mirror(case, [d.plan for d in ranks], budget, fixed, policy == "model")
  else:
    mirror = combine_mirror(case, [d.plan for d in ranks], budget, result.get("producer", "wgmma"))
  return {"kind": "regret", "what": what, "case": case.name(), "chosen": chosen, "mirror": mirror,
          "mirror_agrees": mirror == chosen, "model_us": times[0], "best": best, "best_us": pinned[best],
          "times_us": {str(c): t for c, t in sorted(pinned.items())}, "regret": times[0] / pinned[best] - 1.0,
          "producer_start_us": {"model": start.get(0, 0.0), "pinned": pinned_start}}


def gather_mirror(case: Case, plans: list[dict], budget: int, fixed: int, model: bool) -> list[int]:
  """gather_rs's C on each rank as its kernel picks it on a budget of `budget` SMs: with `model` (the calls' engine
  the calibrated one: the runner's consumer_policy "model") the C++ model on the rank's plan (the host mirror), else
  the workspace's `fixed` C (float32: the SIMT engine, which the calibration does not describe)."""
  if not model:
    return [fixed] * len(plans)
  from benchmarks import bench_resource  # pylint: disable=g-import-not-at-top
  p, _ = _rank_model(case, budget)
  E_l, R, eb = case.experts_per_rank, case.ranks, 4 if case.f32 else 2
  return [bench_resource.kernel_gather_consumer_ctas(p, plan["seg_rows"].reshape(E_l, R).tolist(), r, case.tokens,
                                                     case.slot_top_k, case.n_dim, case.rank_k, eb,
                                                     min(32, budget - 1), fixed)
          for r, plan in enumerate(plans)]


def pusher_row(case: Case, result: dict, ranks: list[RankData]) -> dict | None:
  """The P regret of a dispatch_gemm case with a pusher sweep (Case.dg_sweep, 0 = the model's choice), timed
  Case.sweep_passes times interleaved: each P's time is the median over the passes of its timed run's."""
  sweep = case.timed_dg_sweep
  us, used = result.get("dg_sweep_us", []), result.get("dg_sweep_pushers", [])
  if not sweep or 0 not in sweep or len(us) != len(sweep) or not case.model:
    return None
  times = _median_per_count((p, _medians(u)) for p, u in zip(sweep, us))
  pinned = {p: t for p, t in times.items() if p > 0}
  if not pinned:
    return None
  best = min(pinned, key=lambda q: (pinned[q], q))
  chosen = used[sweep.index(0)]
  mirror = pusher_mirror(case, [d.plan for d in ranks], result["budget"])
  return {"kind": "regret", "what": "P", "case": case.name(), "chosen": chosen, "mirror": mirror,
          "mirror_agrees": mirror == chosen, "model_us": times[0], "best": best, "best_us": pinned[best],
          "times_us": {str(q): t for q, t in sorted(pinned.items())}, "regret": times[0] / pinned[best] - 1.0}


def line(row: dict) -> str:
  times = " ".join(f"{c}:{t:.1f}" for c, t in row["times_us"].items())
  return (f"REGRET {row['what']} model {','.join(map(str, row['chosen']))} (host mirror "
          f"{'agrees' if row['mirror_agrees'] else 'DIFFERS: ' + ','.join(map(str, row['mirror']))}) "
          f"{row['model_us']:.1f} us | best pinned {row['what']}={row['best']} {row['best_us']:.1f} us | regret "
          f"{100 * row['regret']:.1f}% | pinned us {times}"
          + (f" | first tile after kernel start: model {row['producer_start_us']['model']:.2f} us, pinned "
             f"{row['producer_start_us']['pinned']:.2f} us" if "producer_start_us" in row else ""))


def summary(rows: list[dict]) -> list[str]:
  """Per kind (expert_combine's C, gather_rs's C by policy, dispatch_gemm's P, in the order they first appear): the
  mean and worst regret against the target (mean <= 3%, worst <= 10%), and whether every host mirror agreed with the
  device."""
  out = []
  for what in dict.fromkeys(x["what"] for x in rows):
    r = [x["regret"] for x in rows if x["what"] == what]
    if not r:
      continue
    mean, worst = sum(r) / len(r), max(r)
    ok = mean <= 0.03 and worst <= 0.10
    agree = all(x["mirror_agrees"] for x in rows if x["what"] == what)
    out.append(f"regret {what}: mean {100 * mean:.1f}%, worst {100 * worst:.1f}% over {len(r)} cases "
               f"({'within' if ok else 'OUTSIDE'} the target: mean <= 3%, worst <= 10%); host mirror "
               f"{'agrees on every rank' if agree else 'DIFFERS somewhere'}")
    out.append("RESULT " + json.dumps({"kind": "regret_summary", "what": what, "cases": len(r), "mean": mean,
                                       "worst": worst, "within_target": ok, "mirror_agrees": agree}))
  return out
