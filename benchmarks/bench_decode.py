"""Decode-step latency with and without CUDA graphs (XLA:GPU command buffers, this library's custom calls included),
in bfloat16 and, with ``--quantization fp8``, with the experts' weights pre-quantized.

The step is decode_step.py's: ``--layers`` MoE layers (x <- rms_norm(x + moe(x)), impl "overlap", bfloat16), each
step's output the next one's input, on one GPU. For T = ``--tokens`` tokens per step, after a warm-up:
  ms_chained   median over batches of 20 steps launched back to back (one synchronization per batch), per step:
               the step's device time once the host keeps ahead of it;
  ms_synced    median of single steps, each waited for: what a loop that reads every step back sees.
  host_runs    host runs of the library's CUDA handlers per step (0: every custom call replayed inside a graph).
Each setting runs in a child process of its own (XLA reads its flags when the process starts;
decode_step.GRAPH_FLAGS), both with autotuning off so that their kernels, and so their outputs, are the same: column
same_bits says whether the first step's output of each T is bitwise equal with graphs on and off. speedup = off ms /
on ms (chained). ``--graphs`` picks the settings (default both).

--quantization fp8 times a second step beside the bfloat16 one in each setting: the same layers on the same
parameters, the experts' w1 and w2 quantized once by ``jmo.quantize_weights`` (128 x 128 blocks,
decode_step.quantize_params) and run by DeepSeek-V3's FP8 recipe (``moe_experts(..., quantization="fp8")``), so that
a step reads the e4m3 values and float32 block scales only. Its columns: fp8_ms_chained, fp8_ms_synced,
fp8_host_runs, fp8_same_bits (as above) and fp8_speedup = ms_chained / fp8_ms_chained (bfloat16 over FP8, the same
setting).

Weight-read bound (each step timed, and with no --quantization the bfloat16 one alone): the bytes of expert weights
the step must read at least, divided by the HBM bandwidth ``--hbm-tbps`` (default: the GPU's entry in HBM_TBPS; a
device with none, such as a CPU, gets no bound columns unless the flag gives one):
  experts_<q>     the experts that receive at least one row, summed over the layers, counted from the first step's
                  routing (each layer routed on its input along the checked chain below): with top-k over E experts
                  and T tokens only those experts' weights need reading (T = 1 reads k per layer, large T all E);
                  later steps route other tokens and may touch a few more or fewer
  <q>_read_MB     experts_<q> x the bytes of one expert's w1 and w2 (decode_step.expert_weight_bytes): bfloat16 2
                  bytes per weight; FP8 1 byte per weight plus a float32 scale per 128 x 128 block; the router's and
                  the tokens' bytes are left out
  <q>_bound_ms    <q>_read_MB / the bandwidth; <q>_of_bound = <q>_bound_ms / its ms_chained (1.0: at the bound)

Nothing is timed before it agrees (per setting, per T, per quantization): the first step's layers are run one by
one as calls of their own on the chain's inputs (each layer's input the previous layer's checked output), each
layer's output against its oracle on the same input and routing, and err_<q> is the largest over the layers of
max |got - oracle| / max |oracle|: bfloat16 against the float32 reference (impl="reference" on float32 copies at
HIGHEST precision, err_bf16 <= bench_layer.MAX_ERR), FP8 against the recipe emulated in XLA on the same
pre-quantized weights (impl="xla", quantization="fp8", as bench_fp8_layer checks; err_fp8 <=
bench_fp8_layer.MAX_ERR: the same quantized operands, other float32 summation orders). The step's first output must
also be finite and not all zero (the inputs are random normal draws).

  python3 -m benchmarks.bench_decode --out /tmp/decode.jsonl          # one GPU, T = 1, 8, 32, 64, 128, 256
  python3 -m benchmarks.bench_decode --quantization fp8 --out /tmp/decode_fp8.jsonl
  python3 -m benchmarks.bench_decode --layers 1 --d-model 128 --d-ff 128 --experts 4 --tokens 1,8 \
      --quantization fp8   # a CPU try-out (FP8 tiles 128 channels: D and F multiples of 128)
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

CHILD_LIMIT_S = 170  # per setting and quantization: the default run stays within about six minutes even when a
                     # child hangs
# HBM bandwidth in TB/s by a substring of jax's device_kind, from NVIDIA's datasheets (SXM: the H200's 141 GB of
# HBM3e at 4.8 TB/s, the H100's 80 GB of HBM3 at 3.35 TB/s).
HBM_TBPS = {"H200": 4.8, "H100 80GB HBM3": 3.35}


def hbm_tbps(args, device_kind: str) -> float | None:
  """The bandwidth of the weight-read bound: --hbm-tbps, else the device's HBM_TBPS entry, else None."""
  if args.hbm_tbps is not None:
    return args.hbm_tbps
  return next((v for k, v in HBM_TBPS.items() if k in device_kind), None)


def add_model_args(ap: argparse.ArgumentParser, tokens: str) -> None:
  """--tokens (default ``tokens``) and the decode model's sizes (decode_step.DecodeModel.from_args reads them)."""
  ap.add_argument("--tokens", default=tokens, help="comma list of tokens per step")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--d-model", type=int, default=2048)
  ap.add_argument("--d-ff", type=int, default=1024)
  ap.add_argument("--experts", type=int, default=32)
  ap.add_argument("--top-k", type=int, default=4)


def parse(argv):
  ap = argparse.ArgumentParser()
  add_model_args(ap, "1,8,32,64,128,256")
  ap.add_argument("--batches", type=int, default=10, help="timed batches of 20 chained steps")
  ap.add_argument("--synced", type=int, default=30, help="timed single steps, each waited for")
  ap.add_argument("--quantization", choices=("fp8",), default=None,
                  help="also time the step with the experts' weights pre-quantized (jmo.quantize_weights)")
  ap.add_argument("--graphs", default="off,on", help="comma list of the settings to run: off, on")
  ap.add_argument("--hbm-tbps", type=float, default=None,
                  help="HBM bandwidth of the weight-read bound, TB/s (default: the GPU's entry in HBM_TBPS)")
  ap.add_argument("--out", default="decode.jsonl")
  ap.add_argument("--child", choices=("on", "off"), default=None, help=argparse.SUPPRESS)
  return ap.parse_args(argv)


def quantizations(args) -> list[str | None]:
  """The steps timed: bfloat16 (None), then args.quantization's."""
  return [None] + ([args.quantization] if args.quantization else [])


def checked_first_step(model, mesh, params, x0, quantization) -> tuple[float, list[int]]:
  """(the largest error over the layers, the experts each layer routes rows to) of the first step, its layers run
  one by one on the chain's inputs, each against its oracle on the same input and routing (the module's text)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  import jax_moe_overlap as jmo  # pylint: disable=g-import-not-at-top
  from benchmarks import decode_step as ds  # pylint: disable=g-import-not-at-top
  from benchmarks import references  # pylint: disable=g-import-not-at-top

  route = jax.jit(ds.route, static_argnums=2)
  next_x = jax.jit(ds.next_x)
  f32 = jnp.float32
  errs, touched, x = [], [], x0
  for p in params:
    ids, gates = route(x, p["router"], model.top_k)
    y, _ = jmo.moe_experts(x, ids, gates, p["w1"], p["w2"], mesh=mesh, quantization=quantization)
    if quantization is None:
      with jax.default_matmul_precision("highest"):
        oracle, _ = jmo.moe_experts(x.astype(f32), ids, gates, p["w1"].astype(f32), p["w2"].astype(f32), mesh=mesh,
                                    impl="reference")
    else:
      oracle, _ = jmo.moe_experts(x, ids, gates, p["w1"], p["w2"], mesh=mesh, impl="xla", quantization=quantization)
    errs.append(references.max_rel_err(y, oracle))
    touched.append(int(np.unique(np.asarray(ids)).size))
    x = next_x(x, y)
  return max(errs), touched


def max_err(quantization) -> float:
  from benchmarks import bench_fp8_layer, bench_layer  # pylint: disable=g-import-not-at-top
  return bench_layer.MAX_ERR if quantization is None else bench_fp8_layer.MAX_ERR


def timed(args, step, params, x0) -> dict:
  """ms_chained, ms_synced, host_runs and first_step_sha256 of ``step`` from x0 (the module's text), or the
  ms_chained column saying why it was not timed."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from jax_moe_overlap.command_buffers import handler_calls  # pylint: disable=g-import-not-at-top

  first = np.asarray(jax.block_until_ready(step(params, x0)))
  as_f32 = first.astype(np.float32)
  if not (np.all(np.isfinite(as_f32)) and np.any(as_f32 != 0)):
    return dict(ms_chained="first step not finite or all zero, not timed")
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
  return dict(ms_chained=f"{statistics.median(chained) * 1e3:.3f}", ms_synced=f"{statistics.median(synced) * 1e3:.3f}",
              host_runs=f"{runs / steps:.2f}", first_step_sha256=digest)


def measure(args, setting: str) -> list[dict]:
  """The rows of one setting, in this process (its XLA_FLAGS already set): one per T, the bfloat16 step's columns
  unprefixed, the quantized step's prefixed with its name."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from benchmarks import decode_step as ds  # pylint: disable=g-import-not-at-top

  model = ds.DecodeModel.from_args(args)
  tbps = hbm_tbps(args, jax.devices()[0].device_kind)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (ds.AXIS,))
  params = {None: ds.init_params(model, mesh)}
  for q in quantizations(args)[1:]:
    params[q] = ds.quantize_params(params[None], mesh)
  steps = {q: ds.make_step(model, mesh, quantization=q) for q in quantizations(args)}
  rows = []
  for T in [int(t) for t in args.tokens.split(",")]:
    x0 = ds.first_tokens(model, T, mesh)
    row = dict(T=T, graphs=setting, hbm_tbps=tbps if tbps is not None else "")
    for q in quantizations(args):
      name, prefix = q or "bf16", "" if q is None else f"{q}_"
      err, touched = checked_first_step(model, mesh, params[q], x0, q)
      read = sum(t * ds.expert_weight_bytes(p) for t, p in zip(touched, params[q]))
      row.update({f"err_{name}": f"{err:.1e}", f"experts_{name}": sum(touched), f"{name}_read_MB": f"{read / 1e6:.2f}"})
      bound_ms = None if tbps is None else read / (tbps * 1e12) * 1e3
      if bound_ms is not None:
        row[f"{name}_bound_ms"] = f"{bound_ms:.4g}"
      got = (timed(args, steps[q], params[q], x0) if err <= max_err(q)  # (not for NaN)
             else dict(ms_chained=f"wrong result (err_{name} > {max_err(q)}), not timed"))
      row.update({prefix + k: v for k, v in got.items()})
      try:
        row[f"{name}_of_bound"] = f"{bound_ms / float(got['ms_chained']):.2f}"
      except (TypeError, ValueError):  # (no bound, or not timed)
        pass
    rows.append(row)
    print(f"  graphs {setting} T={T}: {row}", flush=True)
  return rows


def run_child(setting: str, argv: list[str], limit_s: float) -> list[dict] | str:
  """The rows of a child process running ``setting`` (or why there are none)."""
  from benchmarks.decode_step import GRAPH_FLAGS  # pylint: disable=g-import-not-at-top
  env = dict(os.environ, XLA_FLAGS=f"{GRAPH_FLAGS[setting]} --xla_gpu_autotune_level=0")
  cmd = [sys.executable, "-m", "benchmarks.bench_decode", *argv, "--child", setting]
  try:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit_s, check=False)
  except subprocess.TimeoutExpired:
    return f"graphs {setting}: the child ran past {limit_s} s"
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
  columns = ["T", "graphs", "ms_chained", "ms_synced", "host_runs", "speedup", "same_bits"]
  for q in quantizations(args)[1:]:
    columns += [f"{q}_ms_chained", f"{q}_ms_synced", f"{q}_host_runs", f"{q}_speedup", f"{q}_same_bits"]
  for q in quantizations(args):
    name = q or "bf16"
    columns += [f"experts_{name}", f"{name}_bound_ms", f"{name}_of_bound", f"err_{name}"]
  table = common.Table(columns)
  settings = [s for s in ("off", "on") if s in args.graphs.split(",")]
  with common.rows_kept_on_sigterm(table, args.out, "bench_decode"):
    by_setting = {}
    for setting in settings:
      got = run_child(setting, argv, CHILD_LIMIT_S * len(quantizations(args)))
      if isinstance(got, str):
        print(got, flush=True)
        table.add(T="-", graphs=setting, ms_chained=f"error: {got[:200]}")
        continue
      by_setting[setting] = {r["T"]: r for r in got}
    model = dict(layers=args.layers, d_model=args.d_model, d_ff=args.d_ff, experts=args.experts, top_k=args.top_k)
    for T in [int(t) for t in args.tokens.split(",")]:
      off, on = by_setting.get("off", {}).get(T), by_setting.get("on", {}).get(T)
      for r in (off, on):
        if r is None:
          continue
        extra = {}
        for q in quantizations(args):
          prefix = "" if q is None else f"{q}_"
          sha = prefix + "first_step_sha256"
          extra[prefix + "same_bits"] = ("" if not (off and on and sha in off and sha in on)
                                         else "yes" if off[sha] == on[sha] else "NO")
        extra["speedup"] = _ratio(off, on, "ms_chained", "ms_chained") if r is on else ""
        for q in quantizations(args)[1:]:
          extra[f"{q}_speedup"] = _ratio(r, r, "ms_chained", f"{q}_ms_chained")
        table.add(**r, **model, **extra)


def _ratio(a: dict | None, b: dict | None, key_a: str, key_b: str) -> str:
  """a[key_a] / b[key_b] to two decimals, or "" where either is missing or not a time."""
  try:
    return f"{float(a[key_a]) / float(b[key_b]):.2f}"
  except (TypeError, KeyError, ValueError, ZeroDivisionError):
    return ""


if __name__ == "__main__":
  main()
