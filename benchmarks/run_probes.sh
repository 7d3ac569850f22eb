#!/usr/bin/env bash
# The standalone CUDA probes in one go (one H200: about a minute): each is one .cu file (tools/probes/) with its own
# check against a reference, built sm_90a by tools/CMakeLists.txt (target `probes`) into build/tools and run with its
# defaults; tables to stdout, full outputs in $OUT.
#   push_probe      what limits a consumer CTA's copy (bulk loads / stores alone, issuers, ring depth, chunk size)
#   row_push_probe  the dispatch's row pushes: GB/s per pushing CTA against bytes in flight, 16-byte warp stores
#                   against TMA bulk copies
#   push_beside_gemm_probe  the same pushes on C SMs while the library's grouped GEMM runs on the others: GB/s per
#                   pushing CTA beside the GEMM against alone, and the GEMM's time with the pushes beside it
#   combine_probe   CombineKernel's gather + weighted sum (the library's loop at several shapes) against the copy
#                   ceiling of the same traffic, XLA's shape of it and a TMA gather
#   decision_probe  the resource manager's device-side choice (resource_manager.cuh) against the host's on random
#                   tables, and ns per decision
# The wgmma probes (wgmma_probe, wgmma_outer_probe, wgmma_fp8_probe) build with the same target;
# tools/probes/wgmma_build_and_run.sh runs them (with ptxas statistics and a memcheck mode).
#
#   bash benchmarks/run_probes.sh
set -uo pipefail
OUT=${OUT:-/tmp/jmo-probes-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
if ! bash tools/build_tools.sh probes > "$OUT/probes_build.log" 2>&1; then
  tail -40 "$OUT/probes_build.log"
  exit 1
fi
for p in push row_push push_beside_gemm combine decision; do
  echo "== ${p}_probe"
  args=()
  [ "$p" = push ] && args=(--mib 256 --reps 5)
  [ "$p" = row_push ] && args=(--mib 64 --reps 5)
  timeout 120 "build/tools/${p}_probe" "${args[@]}" > "$OUT/${p}_probe.txt" 2>&1
  echo "rc $?"; grep -E "^\||WRONG|rror" "$OUT/${p}_probe.txt" | head -200
done
[ -z "${SKIP_DEEPSEEK:-}" ] && {
  echo "== combine_probe, DeepSeek-like (T 4096, k 8, N 7168)"
  timeout 60 build/tools/combine_probe --tokens 4096 --k 8 --n 7168 > "$OUT/combine_probe_deepseek.txt" 2>&1
  grep -E "^\||WRONG|rror" "$OUT/combine_probe_deepseek.txt" | head -40
}
