"""Decode-step latency with and without CUDA graphs (XLA:GPU command buffers, this library's custom calls included).

The step is decode_step.py's: ``--layers`` MoE layers (x <- rms_norm(x + moe(x)), impl "overlap", bfloat16), each
step's output the next one's input, on one GPU. For T = ``--tokens`` tokens per step, after a warm-up:
  ms_chained   median over batches of 20 steps launched back to back (one synchronization per batch), per step:
               the step's device time once the host keeps ahead of it;
  ms_synced    median of single steps, each waited for: what a loop that reads every step back sees.
  host_runs    host runs of the library's CUDA handlers per step (0: every custom call replayed inside a graph).
Each setting runs in a child process of its own (XLA reads its flags when the process starts;
decode_step.GRAPH_FLAGS), both with autotuning off so that their kernels, and so their outputs, are the same: column
same_bits says whether the first step's output of each T is bitwise equal with graphs on and off. speedup = off ms /
on ms (chained).

  python3 -m benchmarks.bench_decode --out /tmp/decode.jsonl          # one GPU, T = 1, 8, 32, 64, 128, 256
  python3 -m benchmarks.bench_decode --layers 1 --d-model 64 --d-ff 64 --experts 4 --tokens 1,8   # a CPU try-out
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

CHILD_LIMIT_S = 170  # per setting: the whole benchmark stays within about six minutes even when a child hangs


def parse(argv):
  ap = argparse.ArgumentParser()
  ap.add_argument("--tokens", default="1,8,32,64,128,256", help="comma list of tokens per step")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--d-model", type=int, default=2048)
  ap.add_argument("--d-ff", type=int, default=1024)
  ap.add_argument("--experts", type=int, default=32)
  ap.add_argument("--top-k", type=int, default=4)
  ap.add_argument("--batches", type=int, default=10, help="timed batches of 20 chained steps")
  ap.add_argument("--synced", type=int, default=30, help="timed single steps, each waited for")
  ap.add_argument("--out", default="decode.jsonl")
  ap.add_argument("--child", choices=("on", "off"), default=None, help=argparse.SUPPRESS)
  return ap.parse_args(argv)


def measure(args, setting: str) -> list[dict]:
  """The rows of one setting, in this process (its XLA_FLAGS already set): one per T."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from benchmarks import decode_step as ds  # pylint: disable=g-import-not-at-top
  from jax_moe_overlap.command_buffers import handler_calls  # pylint: disable=g-import-not-at-top

  model = ds.DecodeModel(layers=args.layers, d_model=args.d_model, d_ff=args.d_ff, experts=args.experts,
                         top_k=args.top_k)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (ds.AXIS,))
  params = ds.init_params(model, mesh)
  step = ds.make_step(model, mesh)
  rows = []
  for T in [int(t) for t in args.tokens.split(",")]:
    x0 = ds.first_tokens(model, T, mesh)
    first = np.asarray(jax.block_until_ready(step(params, x0)))
    digest = hashlib.sha256(first.view(f"u{first.dtype.itemsize}").tobytes()).hexdigest()[:16]
    x = x0
    for _ in range(5):
      x = step(params, x)
    jax.block_until_ready(x)
    before, steps = sum(c for c, _ in handler_calls().values()), 0
    chained = []
    for _ in range(args.batches):
      t0 = time.perf_counter()
      for _ in range(20):
        x = step(params, x)
      jax.block_until_ready(x)
      chained.append((time.perf_counter() - t0) / 20)
      steps += 20
    synced = []
    for _ in range(args.synced):
      t0 = time.perf_counter()
      x = jax.block_until_ready(step(params, x))
      synced.append(time.perf_counter() - t0)
      steps += 1
    runs = sum(c for c, _ in handler_calls().values()) - before
    rows.append(dict(T=T, graphs=setting, ms_chained=f"{statistics.median(chained) * 1e3:.3f}",
                     ms_synced=f"{statistics.median(synced) * 1e3:.3f}", host_runs=f"{runs / steps:.2f}",
                     first_step_sha256=digest))
    print(f"  graphs {setting} T={T}: {rows[-1]}", flush=True)
  return rows


def run_child(setting: str, argv: list[str]) -> list[dict] | str:
  """The rows of a child process running ``setting`` (or why there are none)."""
  from benchmarks.decode_step import GRAPH_FLAGS  # pylint: disable=g-import-not-at-top
  env = dict(os.environ, XLA_FLAGS=f"{GRAPH_FLAGS[setting]} --xla_gpu_autotune_level=0")
  cmd = [sys.executable, "-m", "benchmarks.bench_decode", *argv, "--child", setting]
  try:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_LIMIT_S, check=False)
  except subprocess.TimeoutExpired:
    return f"graphs {setting}: the child ran past {CHILD_LIMIT_S} s"
  sys.stdout.write(proc.stdout)
  rows = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
  if proc.returncode != 0 or not rows:
    return f"graphs {setting}: exit status {proc.returncode}: {proc.stderr[-1500:]}"
  return rows


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse(argv)
  if args.child is not None:
    for row in measure(args, args.child):
      print("ROW " + json.dumps(row), flush=True)
    return
  from benchmarks import common  # pylint: disable=g-import-not-at-top  (imports jax: after the children's flags)
  table = common.Table(["T", "graphs", "ms_chained", "ms_synced", "host_runs", "speedup", "same_bits"])
  with common.rows_kept_on_sigterm(table, args.out, "bench_decode"):
    by_setting = {}
    for setting in ("off", "on"):
      got = run_child(setting, argv)
      if isinstance(got, str):
        print(got, flush=True)
        table.add(T="-", graphs=setting, ms_chained=f"error: {got[:200]}")
        continue
      by_setting[setting] = {r["T"]: r for r in got}
    model = dict(layers=args.layers, d_model=args.d_model, d_ff=args.d_ff, experts=args.experts, top_k=args.top_k)
    for T in [int(t) for t in args.tokens.split(",")]:
      off, on = by_setting.get("off", {}).get(T), by_setting.get("on", {}).get(T)
      same = "" if not (off and on) else ("yes" if off["first_step_sha256"] == on["first_step_sha256"] else "NO")
      for r in (off, on):
        if r is None:
          continue
        speedup = f"{float(off['ms_chained']) / float(on['ms_chained']):.2f}" if r is on and off else ""
        table.add(**r, **model, speedup=speedup, same_bits=same)


if __name__ == "__main__":
  main()
