"""A regret suite's choices under other resource-model constants, computed on the CPU from a GPU run's log: for each
case of the suite, the count (C or P) that the host mirror picks on every rank with the constants of --calibration
(the same C++ model the kernels run, on the plans the suite's cases give, as tools/loopback/regret.py checks it),
and, where every rank picks one count the run pinned, that count's time from the log against the log's best pinned
time: the regret those constants would have had on the same machine, without another GPU run. With the constants the
run used, the picks are the run's own (its "host mirror agrees"), which --check holds it to.

  python3 -m tools.loopback.regret_offline --suite regret-push --log LOG --gpu "NVIDIA H100 80GB HBM3" --sms 132 \\
      [--calibration FILE] [--check]

LOG is the suite's output (its REGRET lines, in case order); --calibration defaults to the file the library loads on
--gpu (tools/loopback/cases.py's use_device_calibration). Covers the suites whose rows are expert_combine's C or
dispatch_gemm's P (regret-combine, regret-push, regret-push-shapes, regret-backward: both); not gather_rs's.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

import numpy as np

from tools.loopback import cases as cases_lib
from tools.loopback import regret as regret_lib

SUITES = ("regret-combine", "regret-push", "regret-push-shapes", "regret-backward")
_REGRET = re.compile(r"REGRET (C|P) model (\S+) \(host mirror [^)]*\) ([\d.]+) us \| best pinned \S+=(\d+) ([\d.]+) us "
                     r"\| regret \S+% \| pinned us ([\d.: ]+?)(?: \| .*)?$")  # (regret.line's trailing fields)


@dataclasses.dataclass
class LoggedRow:
  """One REGRET line of a run: what the run's model picked per rank, its time, and every pinned count's time."""
  what: str
  chosen: list[int]
  model_us: float
  best: int
  best_us: float
  pinned_us: dict[int, float]


def read_log(text: str) -> list[LoggedRow]:
  rows = []
  for line in text.splitlines():
    m = _REGRET.match(line.strip())
    if m:
      pinned = {int(c): float(t) for c, t in (kv.split(":") for kv in m.group(6).split())}
      rows.append(LoggedRow(m.group(1), [int(v) for v in m.group(2).split(",")], float(m.group(3)), int(m.group(4)),
                            float(m.group(5)), pinned))
  return rows


def mirror_choices(case: cases_lib.Case, sms: int) -> list[int]:
  """The count each rank's kernel would pick for `case` (its model, plans of its first data set) on a GPU of `sms`
  SMs split over the case's ranks: regret.py's host mirror, without the run."""
  rng = np.random.default_rng(case.seed)
  plans = cases_lib.make_plans(case, [cases_lib.route(rng, case, r) for r in range(case.ranks)])
  mirror = regret_lib.pusher_mirror if case.dg else regret_lib.combine_mirror
  return mirror(case, plans, sms // case.ranks)


def estimate(suite: str, rows: list[LoggedRow], sms: int) -> list[dict]:
  """Per case of `suite` (built with the constants cases_lib holds now) beside its logged row: the mirror's picks
  and, where they are one pinned count, the regret that count had in the run. rows: the log's REGRET lines (those
of the suite's kind, C or P, are taken in order)."""
  cases = cases_lib.suite(suite, cases_lib.Case())
  # dispatch_gemm's cases sweep P, the others C; each kind's REGRET lines in its cases' order (a log may hold both).
  by_kind = {w: [r for r in rows if r.what == w] for w in ("P", "C")}
  want = {w: sum((c.dg) == (w == "P") for c in cases) for w in ("P", "C")}
  if any(want[w] and len(by_kind[w]) != want[w] for w in want):
    raise ValueError(f"{suite} has {want['P']} P and {want['C']} C cases but the log has {len(by_kind['P'])} and "
                     f"{len(by_kind['C'])} REGRET lines")
  rows = [by_kind["P" if c.dg else "C"].pop(0) for c in cases]
  out = []
  for case, row in zip(cases, rows):
    picks = mirror_choices(case, sms)
    one = picks[0] if len(set(picks)) == 1 and picks[0] in row.pinned_us else None
    out.append({"case": case.name(), "ranks": case.ranks, "logged": row, "picks": picks,
                "regret": None if one is None else row.pinned_us[one] / row.best_us - 1.0})
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--suite", choices=SUITES, required=True)
  ap.add_argument("--log", required=True, help="the suite's output on the GPU")
  ap.add_argument("--gpu", required=True, help="the GPU's name, as the run's device reported it")
  ap.add_argument("--sms", type=int, required=True, help="its SM count")
  ap.add_argument("--calibration", default=None, help="constants to judge (default: the library's file for --gpu)")
  ap.add_argument("--check", action="store_true", help="exit 1 unless every pick equals the logged run's")
  args = ap.parse_args(argv)
  with open(args.log, encoding="utf-8") as f:
    rows = read_log(f.read())
  before = cases_lib.use_calibration_file(args.calibration)
  try:
    print(f"suite model: {args.calibration}" if args.calibration else
          cases_lib.use_device_calibration(args.gpu, args.sms))
    est = estimate(args.suite, rows, args.sms)
  finally:
    cases_lib.use_calibration_file(before)
  print("| case | run's picks, us | these constants' picks | that count's us in the run | best pinned, us | regret |")
  print("|---|---|---|---|---|---|")
  for e in est:
    row, picks = e["logged"], e["picks"]
    one_us = row.pinned_us[picks[0]] if e["regret"] is not None else "not one pinned count"
    regret = "" if e["regret"] is None else f"{100 * e['regret']:.1f}%"
    print(f"| {e['case'][:70]} | {','.join(map(str, row.chosen))}, {row.model_us} | {','.join(map(str, picks))} | "
          f"{one_us} | {row.best}, {row.best_us} | {regret} |")
  known = [e["regret"] for e in est if e["regret"] is not None]
  if known:
    print(f"estimated regret: mean {100 * np.mean(known):.1f}%, worst {100 * max(known):.1f}% over {len(known)} of "
          f"{len(est)} cases (computed on the CPU from the run's pinned times, not run with these constants)")
  differ = [e for e in est if e["picks"] != e["logged"].chosen]
  print("picks: the run's in every case" if not differ else "picks other than the run's: " + "; ".join(
      f"{e['case'][:40]}: {e['picks']} (run: {e['logged'].chosen})" for e in differ))
  return 1 if args.check and differ else 0


if __name__ == "__main__":
  sys.exit(main())
