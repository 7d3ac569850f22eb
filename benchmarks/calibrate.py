"""Measures the resource model's constants (ffi/include/jax_moe_overlap/resource_model.h) on this GPU with the loopback
harness and writes the calibration JSON that jax_moe_overlap loads (jax_moe_overlap/calibration/<gpu name>.json).

The tile time, link_gbps and seg_us come from the serialized mode, which isolates both halves of expert_combine: the
consumer starts only after the producer has flagged every tile, so the device's own %globaltimer spans (first tile
started .. last tile stored; first push .. last push) time each half alone. The rates the model uses beside a running
GEMM (cta_gbps, pusher_gbps, gather_gbps) come from overlapped runs.

  tile time       one rank (R = 1: it owns every SM, and all its rows are its own, so every CTA produces): producer
                  span / waves, waves = ceil(tiles / SMs), for K in --ks; least squares
                  t(K) = tile_us_base + tile_us_per_k * K.
  cta_gbps        two loopback ranks, each routing every row to the other's experts (routing 4), so every row is
                  pushed, overlapped (not serialized) with a K = 2048 producer at C = 4 per rank: one rank's bytes /
                  consumer span / C, the rate a consumer CTA has while the GEMM runs next to it. (The rate alone,
                  serialized at C = 1 and 2, is kept as raw.cta_gbps_alone: it is higher, and the model picked too few
                  consumer CTAs with it.)
  link_gbps       the best bandwidth of both ranks' consumers together over C in 1..32 (the ceiling the consumer
                  reaches on this GPU, loopback: HBM to HBM; a multi-GPU calibration would measure NVLink instead).
  pusher_gbps     two loopback ranks at HBM speed, dispatch_gemm (train mode, 4096 tokens, D 2048, 2F 4096) with 8
                  pushers pinned: the rows each rank sends its peer / its pushers' push span / 8, the median over the
                  ranks (the rate of one pushing CTA beside the GEMM: dispatch_gemm's P, resource_model.h).
  seg_us          the per-segment cost the model adds serially: (span - bytes / rate(C)) / segments per rank at C = 8
                  per rank with many small segments (128 per rank), rate(C) from the big-segment run; clamped at 0.
  gather_gbps     gather_rs (GEMM2 + GatherRS) at R = 4 as 2 x 2 expert x tensor ranks on the regret-gather suite's
                  bf16 shape, at HBM speed, overlapped, with C = 1 and 2 consumer CTAs pinned: per rank the traffic the
                  model counts for its sources (bench_resource.gather_traffic_bytes) / its consumer span / C, the
                  median over the ranks, the lower of the two C (measure_gather).

  python3 -m benchmarks.calibrate --out jax_moe_overlap/calibration/   # writes <dir>/<gpu name>.json
  python3 -m benchmarks.calibrate --only gather [--merge-into FILE]    # gather_gbps alone: prints it and its raw
                                                                       # numbers (and writes them into FILE)

The consumer pushes as the library's defaults (CallConfig.consumer_tuning) unless --plain-copy / --push-* say
otherwise; the harness gets them as flags, and the calibration records them (consumer_tuning).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from benchmarks import bench_resource
from benchmarks import loopback_runner as lb
from jax_moe_overlap import resource as rm
from jax_moe_overlap.config import ConsumerTuning
from tools.loopback import cases as loopback_cases


def fit_line(xs, ys):
  n = len(xs)
  mx, my = sum(xs) / n, sum(ys) / n
  sxx = sum((x - mx) ** 2 for x in xs)
  slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
  return my - slope * mx, slope


def timed(res):
  return [r for r in res["results"] if r["kind"] == "timed"]


# gather_gbps's run: the regret-gather suite's 2 x 2 bf16 case (tools/loopback/cases.py), C pinned small.
GATHER_MESH = loopback_cases.REGRET_GATHER_MESHES[0]
GATHER_CS = (1, 2)


def measure_gather(reps: int, log=None) -> tuple[float, dict]:
  """gather_gbps: one gather_rs consumer CTA's memory traffic per ns beside the GEMM, as the model counts it
  (resource_model.h GatherMakespanFromSources' a_s), and the raw numbers.

  The regret-gather suite's R = 4 as 2 x 2 case in bf16, overlapped, once per C in GATHER_CS pinned, at HBM speed (no
  emulated link: the partials' link is the model's other term, and pacing it here would time the link, not the
  consumer's memory path). With C this small the consumer is the bottleneck, so its span (first CTA in .. last CTA
  out, per rank the median over the timed calls) is its work. Per rank: traffic / span / C; the median over the
  ranks; then the lower of the C values: at C = 1 the GEMM ends long before the consumer, which then runs alone and
  faster, while the rate the model needs is the one beside the GEMM (where a chosen C makes the two end together).
  """
  R_e, TP = GATHER_MESH
  R, tokens, shape = R_e * TP, loopback_cases.REGRET_GATHER_TOKENS[False], loopback_cases.REGRET_GATHER_SHAPE
  args = ["--ranks", R, "--tensor", TP, "--gather-rs", "--tokens", tokens, "--routing", 0, "--datasets", 1,
          "--iters", 2, "--check-tokens", 64, "--time", "--per-call-stats", "--warmup", 2, "--reps", reps,
          "--consumers", GATHER_CS[0], "--sweep-consumers", ",".join(map(str, GATHER_CS))]
  for name, v in shape.items():
    args += ["--" + name.replace("_", "-"), v]
  res = lb.run(args, log=log)
  plans = {x["rank"]: x["seg_rows"] for x in res["results"] if x["kind"] == "plan"}
  E_l = shape["experts"] // R_e
  slots, n = shape["top_k"] * TP, shape["n_dim"]
  traffic = [bench_resource.gather_traffic_bytes([plans[r][e * R:(e + 1) * R] for e in range(E_l)], r, tokens, slots,
                                                 n, 2) for r in range(R)]
  by_c = {}
  for v in timed(res):
    c = v["consumers"]
    if c not in GATHER_CS or v["serialize"]:
      continue
    spans = v["rank_consumer_span_us"]
    ranks = [{"rank": r, "traffic_bytes": traffic[r], "consumer_span_us": spans[r],
              "gbps_per_cta": traffic[r] / spans[r] * 1e-3 / c if spans[r] > 0 else 0.0} for r in range(R)]
    by_c[c] = {"gbps_per_cta": lb.median([x["gbps_per_cta"] for x in ranks]), "median_us": v["median_us"],
               "producer_span_us": v["producer_span_us"], "chosen": v["chosen"], "ranks": ranks}
  missing = [c for c in GATHER_CS if c not in by_c or not by_c[c]["gbps_per_cta"] > 0]
  if missing:
    raise lb.LoopbackError(f"gather_rs timing has no consumer span at C = {missing}:\n{res['stdout'][-3000:]}")
  gbps = min(by_c[c]["gbps_per_cta"] for c in GATHER_CS)
  raw = {"command": res["command"], "mesh": f"{R_e} x {TP}", "tokens": tokens, "slots": slots, **shape,
         "by_c": {str(c): by_c[c] for c in GATHER_CS}, "gather_gbps": gbps}
  return gbps, raw


def print_gather(gbps: float, raw: dict):
  for c, x in raw["by_c"].items():
    per_rank = ", ".join(f"r{y['rank']} {y['traffic_bytes'] / 1e6:.1f} MB / {y['consumer_span_us']:.1f} us"
                         for y in x["ranks"])
    print(f"gather_rs C={c} per rank ({raw['mesh']}, bf16, overlapped, call {x['median_us']:.1f} us, GEMM "
          f"{x['producer_span_us']:.1f} us): {x['gbps_per_cta']:.2f} GB/s of traffic per CTA ({per_rank})", flush=True)
  print(f"gather_gbps {gbps:.2f} (the lower over C = {', '.join(raw['by_c'])})", flush=True)


def merge_gather(path: str, gbps: float, raw: dict) -> None:
  """Writes gather_gbps and its raw numbers into the calibration file `path`, leaving its other constants as they
  are; refuses a file that does not load as a calibration (jax_moe_overlap.resource.load_params)."""
  problems = rm.validate_params(dataclasses.replace(rm.load_params(path), gather_gbps=gbps))
  if problems:
    sys.exit(f"calibration failed: {problems}")
  with open(path) as f:
    doc = json.load(f)
  doc["gather_gbps"] = gbps
  doc.setdefault("raw", {})["gather_run"] = raw
  doc["gather_note"] = (f"gather_gbps: measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by "
                        f"{' '.join(['python3', '-m', 'benchmarks.calibrate'] + sys.argv[1:])} (raw.gather_run)")
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(doc, f, indent=1)
  os.replace(tmp, path)
  print(f"wrote gather_gbps {gbps:.2f} into {path}", flush=True)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default=rm.CALIBRATION_DIR, help="directory (gets <gpu name>.json) or a .json path")
  ap.add_argument("--ks", default="512,1024,2048,4096", help="K values of the tile-time fit")
  ap.add_argument("--tokens", type=int, default=8192, help="tokens of the tile-time and bandwidth runs (top-2)")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--log", default=None, help="append the harness' full output here")
  ap.add_argument("--only", choices=("all", "gather"), default="all",
                  help="gather: measure gather_gbps alone and print it with its raw numbers")
  ap.add_argument("--merge-into", default=None, metavar="FILE",
                  help="with --only gather: write gather_gbps and its raw numbers into this calibration JSON, its "
                       "other constants kept")
  default = ConsumerTuning()
  ap.add_argument("--plain-copy", action="store_true", default=not default.bulk_copy,
                  help="the consumer pushes with 16-byte loads and stores instead of TMA bulk copies")
  ap.add_argument("--push-slots", type=int, default=default.slots, help="ring slots of one issuing thread")
  ap.add_argument("--push-read-lag", type=int, default=default.read_lag,
                  help="bulk stores that may still read their slot")
  ap.add_argument("--push-issuers", type=int, default=default.issuers, help="issuing threads per consumer CTA")
  args = ap.parse_args(argv)
  if args.merge_into and args.only != "gather":
    ap.error("--merge-into goes with --only gather (a full calibration writes --out)")
  tuning = ConsumerTuning(bulk_copy=not args.plain_copy, slots=args.push_slots,
                                     read_lag=args.push_read_lag, issuers=args.push_issuers)
  log = open(args.log, "a") if args.log else None
  t_start = time.time()
  if args.only == "gather":
    gbps, raw = measure_gather(args.reps, log)
    print_gather(gbps, raw)
    print("RESULT " + json.dumps({"kind": "gather_gbps", **raw}))
    if args.merge_into:
      merge_gather(args.merge_into, gbps, raw)
    return args.merge_into
  ks = [int(k) for k in args.ks.split(",")]
  N = 4096
  dev = lb.device_info(ks[0], N)  # the engine these shapes run (wgmma 128 x 256 on Hopper, else mma.sync 64 x 128)
  sms, tile_m, tile_n = dev["sms"], dev["tile_m"], dev["tile_n"]
  print(f"calibrating the {dev.get('producer', '?')} producer ({tile_m} x {tile_n} tiles) on {dev['name']}", flush=True)
  common = ["--top-k", "2", "--d-model", "64", "--iters", "1", "--datasets", "1", "--time", "--serialize",
            "--per-call-stats", "--warmup", "1", "--reps", args.reps, "--check-tokens", "16"] + lb.tuning_args(tuning)
  one_rank = common + ["--ranks", "1", "--routing", "3"]
  R = 2
  pushing = common + ["--ranks", R, "--routing", "4"]  # every row goes to the other rank
  raw = {"device": dev}

  # 1. Tile time vs K: N = 4096, 8 experts, one rank (no push: all SMs produce).
  tile_us = []
  for K in ks:
    res = lb.run(one_rank + ["--tokens", args.tokens, "--experts", 8, "--k-dim", K, "--n-dim", N],
                 log=log)
    v = timed(res)[0]
    rows = args.tokens * 2
    tiles = -(-rows // 8 // tile_m) * 8 * -(-N // tile_n)
    waves = -(-tiles // sms)
    tile_us.append(v["producer_span_us"] / waves)
    print(f"K={K}: producer span {v['producer_span_us']:.1f} us over {waves} waves -> {tile_us[-1]:.3f} us/tile",
          flush=True)
  base, per_k = fit_line(ks, tile_us)
  if base < 0:  # keep the line through the data but non-negative at K = 0
    base, per_k = 0.0, sum(t * k for t, k in zip(tile_us, ks)) / sum(k * k for k in ks)
  raw["tile_us"] = dict(zip(map(str, ks), tile_us))

  # 2. Consumer bandwidth per C with big segments (K = 64: the GEMM is negligible; per rank 8 segments x 2048 rows
  #    x 8 KiB), both ranks pushing at once: bw[c] is what 2 c CTAs move together.
  cs = [1, 2, 4, 8, 16, 32]
  res = lb.run(pushing + ["--tokens", args.tokens, "--experts", 8 * R, "--k-dim", 64, "--n-dim", N, "--consumers", 1,
                          "--sweep-consumers", ",".join(map(str, cs))], log=log)
  bw = {}
  for v in timed(res):
    if v["consumers"] > 0:
      bw[v["consumers"]] = v["pushed_bytes"] / v["consumer_span_us"] * 1e-3
  for c in cs:
    print(f"consumer C={c} per rank x {R} ranks: {bw[c]:.1f} GB/s ({bw[c] / (R * c):.1f} per CTA)", flush=True)
  cta_alone = lb.median([bw[1] / R, bw[2] / (2 * R)])
  link_gbps = max(bw.values())
  raw["consumer_gbps"] = {str(c): bw[c] for c in cs}
  raw["cta_gbps_alone"] = cta_alone

  # 2b. The push rate the model uses: per CTA while the producer runs (overlapped, K = 2048, C = 4 per rank), which is
  #     what a call sees. The consumer alone moves more per CTA (cta_gbps_alone), and a model fed that rate picked
  #     too few consumer CTAs: the oracle sweep of benchmarks.bench_resource gave a mean / worst regret of 5.3% / 25.4%
  #     with it, -0.6% / 2.7% with this one.
  C0 = 4
  overlapped = [a for a in pushing if a != "--serialize"]
  res = lb.run(overlapped + ["--tokens", args.tokens, "--experts", 8 * R, "--k-dim", 2048, "--n-dim", N,
                             "--consumers", C0], log=log)
  v = timed(res)[0]
  cta_gbps = v["pushed_bytes"] / R / v["consumer_span_us"] * 1e-3 / C0
  print(f"consumer C={C0} per rank overlapped with the producer (K=2048): {cta_gbps:.1f} GB/s per CTA "
        f"(alone: {cta_alone:.1f})", flush=True)
  raw["overlap_run"] = v

  # 3. Per-segment cost: per rank 128 segments of 64 rows (512 KiB), C = 8 per rank.
  C1, E1 = 8, 128
  res = lb.run(pushing + ["--tokens", E1 * 64 // 2, "--experts", E1 * R, "--k-dim", 64, "--n-dim", N, "--consumers",
                          C1], log=log)
  v = timed(res)[0]
  rate = min(C1 * cta_alone, link_gbps / R)  # one rank's share (serialized run: the consumer alone)
  seg_us = max(0.0, (v["consumer_span_us"] - v["pushed_bytes"] / R / rate * 1e-3) / E1)
  print(f"per-segment cost at C={C1}: span {v['consumer_span_us']:.1f} us for {E1} segments per rank -> "
        f"{seg_us:.3f} us", flush=True)
  raw["seg_run"] = v

  # 4. dispatch_gemm's pushers beside its GEMM (Hopper: the wgmma engine), 8 per rank.
  P0 = 8
  try:
    res = lb.run(["--ranks", R, "--dispatch-gemm", P0, "--dispatch-gemm-mode", "train", "--experts", 8, "--tokens",
                  4096, "--d-model", 2048, "--k-dim", 4096, "--n-dim", 2048, "--routing", 0, "--datasets", 1, "--iters",
                  2, "--check-tokens", 64, "--time", "--reps", args.reps], log=log)
    push = [r for r in res["results"] if r["kind"] == "dispatch_gemm_push"]
  except lb.LoopbackError as e:  # no dispatch_gemm here (not Hopper): P keeps the fixed rule
    print(f"dispatch_gemm did not run ({str(e).splitlines()[0]}): pusher_gbps 0", flush=True)
    push = []
  pusher_gbps = lb.median([x["gbps_per_pusher"] for x in push[0]["ranks"]]) if push else 0.0
  print(f"dispatch_gemm pushers ({P0} per rank, beside the GEMM): {pusher_gbps:.1f} GB/s per pusher", flush=True)
  raw["pusher_run"] = push[0] if push else None

  # 5. gather_rs's consumer traffic per CTA beside the GEMM.
  try:
    gather_gbps, raw["gather_run"] = measure_gather(args.reps, log)
    print_gather(gather_gbps, raw["gather_run"])
  except lb.LoopbackError as e:  # gather_rs's model then takes 2 cta_gbps
    print(f"gather_rs did not run ({str(e).splitlines()[0]}): gather_gbps 0", flush=True)
    gather_gbps, raw["gather_run"] = 0.0, None

  params = rm.ModelParams(sms=sms, ctas_per_sm=1, tile_m=tile_m, tile_n=tile_n, tile_us_base=base,
                          tile_us_per_k=per_k, cta_gbps=cta_gbps, link_gbps=link_gbps, seg_us=seg_us,
                          pusher_gbps=pusher_gbps, gather_gbps=gather_gbps)
  problems = rm.validate_params(params)
  if problems:
    sys.exit(f"calibration failed: {problems}")
  out = args.out
  if not out.endswith(".json"):
    os.makedirs(out, exist_ok=True)
    out = os.path.join(out, rm.calibration_file_name(dev["name"]))
  doc = dict(params.__dict__, gpu_name=dev["name"], compute_capability=dev["cc"],
             producer=dev.get("producer", "?"),
             consumer="bulk copies (ffi/cuda/transport/bulk_push.cuh)" if tuning.bulk_copy
             else "CopyBand, 16-byte loads and stores (--plain-copy)",
             consumer_tuning=dataclasses.asdict(tuning),
             measured_on="loopback, one GPU (R = 1 tile time, R = 2 pushes)",
             date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             command=" ".join(["python3", "-m", "benchmarks.calibrate"] + sys.argv[1:]),
             note="link_gbps is the consumer's own ceiling on one GPU (HBM to HBM); loopback runs with R ranks "
                  "share it (bench_resource.py passes link_gbps / R)", raw=raw)
  with open(out, "w") as f:
    json.dump(doc, f, indent=1)
  print(f"wrote {out} ({time.time() - t_start:.0f} s): {params}")
  return out


if __name__ == "__main__":
  main()
