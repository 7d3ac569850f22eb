"""The training example with one of the library's module switches off and on, side by side in one run: each setting
in a child process of its own (the switch set before the first step is traced), the rounds interleaved (off, on,
then on, off, ...) so that drift between runs falls on both sides. Per run the example's tokens/s (the median of its
timed steps) and its last step's train loss; then per setting the median tokens/s, on / off, and whether the two
settings' loss curves are the same bits (a switch that swaps a kernel for another of the same rule must keep them).

  python3 -m benchmarks.train_switch_ab --switch jax_moe_overlap.fp8_experts.ROW_QUANTIZED_COLUMNS_ON_GPU \\
      -- --preset gpu --quantization fp8 --steps 12 --skip-check --no-progress

The arguments after -- are examples/train_moe.py's. The switch is MODULE.NAME; --values gives the two settings
(default "False,True", each read by ast.literal_eval).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys

import numpy as np

from benchmarks import EXAMPLES, set_switch, switch_values

RESULT = "train_switch_ab result: "   # the line a child prints its outcome on


def run_child(switch: str, value, train_args: list[str]) -> None:
  """Sets MODULE.NAME = value, then runs train_moe.main(train_args) in this process and prints its outcome."""
  set_switch(switch, value, "train_switch_ab")
  sys.path.insert(0, EXAMPLES)
  import train_moe  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  out = train_moe.main(train_args)
  print(RESULT + json.dumps({"step_times": out["step_times"], "losses": [float(v) for v in out["losses"]]}),
        flush=True)


def child_result(stdout: str) -> dict:
  lines = [l for l in stdout.splitlines() if l.startswith(RESULT)]
  if not lines:
    raise RuntimeError("train_switch_ab: a child printed no result; its output ends:\n" + stdout[-3000:])
  return json.loads(lines[-1][len(RESULT):])


def compare_losses(runs: list[dict]) -> tuple[bool, bool, str]:
  """(every run's loss curve the same bits, each setting's runs the same bits among themselves, the sentence saying
  which). Where a setting's own runs differ the step is not deterministic on this machine, and a difference between
  the settings says nothing about the switch. On GPUs cuDNN attention's backward (within a process) and XLA's
  autotuning (between processes) are not: benchmarks/step_repeat.py names the parameters they reach; with
  `--attention xla` and XLA_FLAGS=--xla_gpu_autotune_level=0 the example repeats bit for bit, with far slower steps,
  so such a run compares the curves and another times the settings."""
  same = all(r["losses"] == runs[0]["losses"] for r in runs)
  repeatable = all(r["losses"] == next(q for q in runs if q["value"] == r["value"])["losses"] for r in runs)
  if same:
    return same, repeatable, "the same bits in every run"
  if repeatable:
    return same, repeatable, "the same bits within each setting, DIFFERENT between the settings"
  return same, repeatable, ("DIFFER between runs of one setting: the step is not deterministic here, so the settings' "
                            "curves cannot be compared (on GPUs: --attention xla and "
                            "XLA_FLAGS=--xla_gpu_autotune_level=0 repeat bit for bit)")


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  own, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--switch", required=True, help="MODULE.NAME of the switch")
  ap.add_argument("--values", default="False,True", help="the two settings, comma-separated literals")
  ap.add_argument("--rounds", type=int, default=2, help="runs of each setting")
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(own)
  if args.child is not None:
    run_child(args.switch, ast.literal_eval(args.child), train_args)
    return None
  values = args.values.split(",")
  if len(values) != 2:
    raise SystemExit(f"--values {args.values!r}: two settings, comma-separated")
  switch_values(args.values)                                # a malformed literal is refused before any run
  order = [values[i] for r in range(args.rounds) for i in ((0, 1) if r % 2 == 0 else (1, 0))]
  runs = []
  for value in order:
    cmd = [sys.executable, "-m", "benchmarks.train_switch_ab", "--switch", args.switch, "--child", value, "--",
           *train_args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
      raise RuntimeError(f"train_switch_ab: {' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}"
                         f"\n{done.stderr[-3000:]}")
    res = child_result(done.stdout)
    times = res["step_times"]
    runs.append({"value": value, "median_step_s": float(np.median(times)) if times else float("nan"),
                 "last_loss": res["losses"][-1] if res["losses"] else float("nan"), "losses": res["losses"]})
    r = runs[-1]
    print(f"{args.switch} = {value}: median step {r['median_step_s'] * 1e3:.2f} ms, last train loss "
          f"{r['last_loss']:.6f}", flush=True)
  med = {v: float(np.median([r["median_step_s"] for r in runs if r["value"] == v])) for v in values}
  same, repeatable, verdict = compare_losses(runs)
  print(f"| {args.switch} | median step ms | speed / {values[0]} |")
  print("|---|---|---|")
  for v in values:
    print(f"| {v} | {med[v] * 1e3:.2f} | {med[values[0]] / med[v]:.3f} |")
  print(f"loss curves {verdict}", flush=True)
  return {"runs": runs, "median_step_s": med, "same_losses": same, "repeatable": repeatable}


if __name__ == "__main__":
  main()
