"""A regret suite's choices under other resource-model constants, computed on the CPU from a GPU run's log: for each
case of the suite, the count (C or P) that the host mirror picks on every rank with the constants of --calibration
(the same C++ model the kernels run, on the plans the suite's cases give, as tools/loopback/regret.py checks it),
and, where every rank picks one count the run pinned, that count's time from the log against the log's best pinned
time: the regret those constants would have had on the same machine, without another GPU run. With the constants the
run used, the picks are the run's own (its "host mirror agrees"), which --check holds it to.

  python3 -m tools.loopback.regret_offline --suite regret-push --log LOG --gpu "NVIDIA H100 80GB HBM3" --sms 132 \\
      [--calibration FILE] [--check]

LOG is the suite's output (its REGRET lines, in case order); --calibration defaults to the file the library loads on
--gpu (tools/loopback/cases.py's use_device_calibration). Covers the suites whose rows are expert_combine's C,
dispatch_gemm's P (regret-combine, regret-push, regret-push-shapes, regret-backward: both) or gather_rs's C
(regret-gather: its cases under the model, bf16; its float32 cases take the workspace's fixed C, not the constants,
and are left out).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

import numpy as np

from tools.loopback import cases as cases_lib
from tools.loopback import regret as regret_lib

SUITES = ("regret-combine", "regret-push", "regret-push-shapes", "regret-backward", "regret-gather")
# what: "C", "P", "C gather_rs" or "C gather_rs (fixed policy)" (regret.py's row kinds).
_REGRET = re.compile(r"REGRET ((?:C|P)(?: gather_rs)?(?: \([^)]*\))?) model (\S+) \(host mirror [^)]*\) ([\d.]+) us \| "
                     r"best pinned [^=]+=(\d+) ([\d.]+) us \| regret \S+% \| pinned us ([\d.: ]+?)(?: \| .*)?$")


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


def _kind(case: cases_lib.Case) -> str:
  """The REGRET line kind of a case's sweep: regret.py's `what`."""
  return "P" if case.dg else "C gather_rs" if case.gather_rs and not case.f32 else \
      "C gather_rs (fixed policy)" if case.gather_rs else "C"


def mirror_choices(case: cases_lib.Case, sms: int) -> list[int]:
  """The count each rank's kernel would pick for `case` (its model, plans of its first data set) on a GPU of `sms`
  SMs split over the case's ranks: regret.py's host mirror, without the run. The plans are make_data's (with a
  tensor axis its shard slots': tools/loopback/tensor.py), from the routing alone."""
  rng = np.random.default_rng(case.seed)
  ids = [cases_lib.route(rng, case, r) for r in range(case.ranks)]
  if case.tensor > 1:
    from tools.loopback import tensor  # pylint: disable=g-import-not-at-top
    ids = [tensor.shard_slots(case, i, np.ones(i.shape, np.float32))[0] for i in ids]
  plans = cases_lib.make_plans(case, ids)
  budget = sms // case.ranks
  if case.gather_rs:  # (the model's picks: no segment of these cases stays local, so the fixed C plays no part)
    return regret_lib.gather_mirror(case, plans, budget, 0, True)
  mirror = regret_lib.pusher_mirror if case.dg else regret_lib.combine_mirror
  return mirror(case, plans, budget)


def estimate(suite: str, rows: list[LoggedRow], sms: int) -> list[dict]:
  """Per case of `suite` (built with the constants cases_lib holds now) beside its logged row: the mirror's picks
  and, where they are one pinned count, the regret that count had in the run. rows: the log's REGRET lines (those
of the suite's kind, C or P, are taken in order)."""
  cases = cases_lib.suite(suite, cases_lib.Case())
  # Each kind's REGRET lines (dispatch_gemm's P, expert_combine's C, gather_rs's C) in its cases' order (a log may
  # hold several kinds).
  kinds = sorted({_kind(c) for c in cases})
  by_kind = {w: [r for r in rows if r.what == w] for w in kinds}
  want = {w: sum(_kind(c) == w for c in cases) for w in kinds}
  if any(len(by_kind[w]) != want[w] for w in kinds):
    raise ValueError(f"{suite} has " + ", ".join(f"{want[w]} {w}" for w in kinds) + " cases but the log has " +
                     ", ".join(f"{len(by_kind[w])}" for w in kinds) + " REGRET lines of them")
  rows = [by_kind[_kind(c)].pop(0) for c in cases]
  out = []
  for case, row in zip(cases, rows):
    if "fixed policy" in row.what:  # (the workspace's fixed C: no constants to judge)
      continue
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
