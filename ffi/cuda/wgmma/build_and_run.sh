#!/usr/bin/env bash
# Build and run the wgmma grouped-GEMM probe (Hopper sm_90a).
#   bash ffi/cuda/wgmma/build_and_run.sh [build_dir=/tmp/wgmma] [sanitize|build]
#     (no 2nd arg)  build, SASS sanity line, run all cases (correctness + timing)
#     sanitize      build, then compute-sanitizer --tool memcheck on the small cases only, no timing
#     build         build + SASS sanity line only
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dir="${1:-/tmp/wgmma}"
mode="${2:-run}"
mkdir -p "$dir"
NVCC="${NVCC:-nvcc}"
# The library's gencodes: sm_90a SASS (the wgmma kernels) + sm_80 SASS + compute_80 PTX (guarded __trap() bodies).
"$NVCC" -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80 \
  -gencode=arch=compute_80,code=compute_80 -O3 -std=c++17 -lineinfo --expt-relaxed-constexpr -Xcompiler=-Wall \
  -Xptxas -v -o "$dir/wgmma_probe" "$here/wgmma_probe.cu" 2> "$dir/ptxas.log" || { cat "$dir/ptxas.log"; exit 1; }
# One line per sm_90a GEMM instantiation: GroupedGemmKernel<kTransB, kOutF32, Done> registers / spills.
awk '/Compiling entry function/ { k = ""
       if ($0 ~ /GroupedGemmKernel/ && $0 ~ /sm_90a/) { match($0, /GroupedGemmKernelILi[01]ELb[01]/); s = substr($0, RSTART, RLENGTH)
         k = "GroupedGemmKernel<transB=" substr(s, 21, 1) ",f32=" substr(s, 25, 1) "," (($0 ~ /NoTileDone/) ? "plain" : "callback") ">" } }
     k != "" && /spill/ { sp = $0 } k != "" && /registers/ { print "ptxas: " k ":" sp " |" $0; k = "" }' "$dir/ptxas.log" || true
grep -iE "warning" "$dir/ptxas.log" && echo "WARNING: see $dir/ptxas.log" || true
if command -v cuobjdump > /dev/null; then
  echo "SASS HGMMA count: $(cuobjdump -sass "$dir/wgmma_probe" | grep -c HGMMA || true)"
else
  echo "SASS HGMMA count: (cuobjdump not found)"
fi
case "$mode" in
  build) exit 0 ;;
  sanitize)
    WGMMA_WATCHDOG_S=300 compute-sanitizer --tool memcheck --error-exitcode 9 \
      "$dir/wgmma_probe" --small-only --no-timing ;;
  run) "$dir/wgmma_probe" ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
