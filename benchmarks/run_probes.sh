#!/usr/bin/env bash
# The standalone CUDA probes in one go (one H200: about a minute): each is one .cu file with its own check against a
# host reference, built for sm_90a and run with its defaults; tables to stdout, full outputs in $OUT.
#   push_probe      what limits a consumer CTA's copy (bulk loads / stores alone, issuers, ring depth, chunk size)
#   combine_probe   CombineKernel's gather + weighted sum (the library's loop at several shapes) against the copy
#                   ceiling of the same traffic, XLA's shape of it and a TMA gather
#   decision_probe  the resource manager's device-side choice (consumer_choice.cuh) against the host's on random
#                   tables, and ns per decision
#
#   bash benchmarks/run_probes.sh
set -uo pipefail
OUT=${OUT:-/tmp/jmo-probes-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
pids=()
for p in push combine decision; do
  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -I csrc -I csrc/include \
    -o "/tmp/${p}_probe" "csrc/cuda/${p}_probe.cu" > "$OUT/${p}_build.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
for p in push combine decision; do
  echo "== ${p}_probe"
  [ -x "/tmp/${p}_probe" ] || { tail -20 "$OUT/${p}_build.log"; continue; }
  args=()
  [ "$p" = push ] && args=(--mib 256 --reps 5)
  timeout 120 "/tmp/${p}_probe" "${args[@]}" > "$OUT/${p}_probe.txt" 2>&1
  echo "rc $?"; grep -E "^\||WRONG|rror" "$OUT/${p}_probe.txt" | head -60
done
[ -z "${SKIP_DEEPSEEK:-}" ] && [ -x /tmp/combine_probe ] && {
  echo "== combine_probe, DeepSeek-like (T 4096, k 8, N 7168)"
  timeout 60 /tmp/combine_probe --tokens 4096 --k 8 --n 7168 > "$OUT/combine_probe_deepseek.txt" 2>&1
  grep -E "^\||WRONG|rror" "$OUT/combine_probe_deepseek.txt" | head -40
}
