"""Consumer bandwidth: bytes/s of expert_combine's segment pushes for C consumer CTAs and segment
sizes 64 KiB .. 4 MiB, against a device-to-device copy ceiling (cudaMemcpyAsync D2D in the same binary), on one GPU.

How the consumer is isolated: two loopback ranks (R = 2, half the SMs each), each routing every row round robin to
the other rank's experts (routing 4: a rank's own rows would be stored in place by the producer and never pushed),
bf16, N = 4096 (8 KiB rows), K = 64 (a negligible GEMM), every segment exactly the asked size, and the *serialized*
mode: the consumer starts only after the producer has flagged every tile, so nothing competes with it. Its time is
the device's own span (%globaltimer: first consumer CTA starting to push .. last push done, arrival counters
included; the longer of the two ranks), median over --reps synchronized calls; bytes are both ranks' rows, so a
column "C" is 2 C CTAs pushing together. The ceiling is one cudaMemcpyAsync of the same total bytes (what a copy
engine / copy kernel reaches for one big contiguous block), and, for scale, of one segment.

  python3 -m benchmarks.bench_consumer --out $OUT/consumer.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks import loopback_runner as lb

KIB = 1024


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--ctas", default="2,4,8,12,16,24,32")
  ap.add_argument("--segment-kib", default="64,256,1024,4096")
  ap.add_argument("--total-mib", type=int, default=128, help="bytes pushed per call (fewer if 256 segments cap it)")
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--out", default=None, help="JSON lines")
  ap.add_argument("--log", default=None)
  args = ap.parse_args(argv)
  log = open(args.log, "a") if args.log else None
  ctas = [int(c) for c in args.ctas.split(",")]
  N, row_bytes, top_k = 4096, 4096 * 2, 2
  rows_out = []
  header = dict(kind="header", command=" ".join(["python3"] + sys.argv),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), device=lb.device_info())
  for seg_kib in [int(s) for s in args.segment_kib.split(",")]:
    seg_rows = seg_kib * KIB // row_bytes
    experts = max(top_k, min(128, args.total_mib * KIB * KIB // (seg_kib * KIB)))  # per rank; 2 x 128 <= 256 segments
    tokens = seg_rows * experts // top_k
    total = seg_rows * experts * row_bytes * 2
    res = lb.run(["--ranks", 2, "--top-k", top_k, "--routing", 4, "--experts", 2 * experts, "--tokens", tokens,
                  "--d-model", 64, "--k-dim", 64, "--n-dim", N, "--iters", 1, "--datasets", 1, "--time", "--serialize",
                  "--per-call-stats", "--warmup", 2, "--reps", args.reps, "--check-tokens", 64, "--consumers", ctas[0],
                  "--sweep-consumers", ",".join(map(str, ctas))], log=log)
    copies = lb.run(["--copy-ceiling", f"{total},{seg_kib * KIB}", "--reps", max(20, args.reps)], log=log)["results"]
    ceil_total = copies[0]["gbps"]
    ceil_seg = copies[1]["gbps"]
    for v in res["results"]:
      if v["kind"] != "timed" or v["consumers"] <= 0:
        continue
      gbps = v["pushed_bytes"] / v["consumer_span_us"] * 1e-3
      rows_out.append(dict(kind="consumer", segment_kib=seg_kib, segments=experts, total_bytes=total,
                           consumers=v["consumers"], ctas=2 * v["consumers"], span_us=v["consumer_span_us"], gbps=gbps,
                           copy_ceiling_gbps=ceil_total, copy_segment_gbps=ceil_seg,
                           fraction_of_ceiling=gbps / ceil_total))
  # Table: one row per segment size, one column per C.
  sizes = sorted({r["segment_kib"] for r in rows_out})
  print(f"\nconsumer GB/s (fraction of the D2D copy ceiling of the same bytes), serialized, R = 2 pushing to each "
        f"other, bf16 N = {N}; C per rank, 2 C CTAs in all")
  print("| segment | segments per rank | copy ceiling GB/s | " + " | ".join(f"C={c} ({2 * c} CTAs)" for c in ctas) + " |")
  print("|---|---|---|" + "---|" * len(ctas))
  for s in sizes:
    rs = {r["consumers"]: r for r in rows_out if r["segment_kib"] == s}
    any_r = next(iter(rs.values()))
    cells = [f"{rs[c]['gbps']:.0f} ({rs[c]['fraction_of_ceiling']:.2f})" if c in rs else "-" for c in ctas]
    print(f"| {s} KiB | {any_r['segments']} | {any_r['copy_ceiling_gbps']:.0f} | " + " | ".join(cells) + " |")
  if args.out:
    with open(args.out, "w") as f:
      for r in [header] + rows_out:
        f.write(json.dumps(r) + "\n")
  return rows_out


if __name__ == "__main__":
  main()
