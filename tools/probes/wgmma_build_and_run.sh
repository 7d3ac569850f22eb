#!/usr/bin/env bash
# Build and run the wgmma probes (Hopper sm_90a).
#   bash tools/probes/wgmma_build_and_run.sh [build_dir=/tmp/wgmma] [mode]
#   grouped GEMM probe (wgmma_probe.cu, WgmmaGroupedGemm):
#     (no 2nd arg) / run  build, SASS sanity line, run all cases (correctness + timing)
#     sanitize            build, then compute-sanitizer --tool memcheck on the small cases only, no timing
#     build               build + SASS sanity line only
#   grouped outer probe (wgmma_outer_probe.cu, WgmmaGroupedOuter, the weight gradient):
#     outer               build, SASS sanity line, run all cases (correctness + timing)
#     outer-sanitize      build, then memcheck on the small cases only, no timing
#     outer-build         build + SASS sanity line only
#     outer-prebuilt      run $dir/wgmma_outer_probe as it is (built elsewhere); all cases
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dir="${1:-/tmp/wgmma}"
mode="${2:-run}"
mkdir -p "$dir"
NVCC="${NVCC:-nvcc}"
case "$mode" in
  outer*) probe=wgmma_outer_probe; kernel_re=GroupedOuterKernel ;;
  *) probe=wgmma_probe; kernel_re=GroupedGemmKernel ;;
esac
if [ "$mode" != outer-prebuilt ]; then
  # The library's gencodes: sm_90a SASS (the wgmma kernels) + sm_80 SASS + compute_80 PTX (guarded __trap() bodies).
  "$NVCC" -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80 \
    -gencode=arch=compute_80,code=compute_80 -O3 -std=c++17 -lineinfo --expt-relaxed-constexpr -Xcompiler=-Wall \
    -I"$repo/ffi" -I"$repo/ffi/include" \
    -Xptxas -v -o "$dir/$probe" "$here/$probe.cu" 2> "$dir/ptxas_$probe.log" || { cat "$dir/ptxas_$probe.log"; exit 1; }
  # One line per sm_90a kernel instantiation: registers / spills.
  if [ "$probe" = wgmma_probe ]; then
    awk '/Compiling entry function/ { k = ""
         if ($0 ~ /GroupedGemmKernel/ && $0 ~ /sm_90a/) { match($0, /GroupedGemmKernelILi[01]ELb[01]/); s = substr($0, RSTART, RLENGTH)
           k = "GroupedGemmKernel<transB=" substr(s, 21, 1) ",f32=" substr(s, 25, 1) "," (($0 ~ /NoTileDone/) ? "plain" : "callback") ">" } }
       k != "" && /spill/ { sp = $0 } k != "" && /registers/ { print "ptxas: " k ":" sp " |" $0; k = "" }' "$dir/ptxas_$probe.log" || true
  else
    awk '/Compiling entry function/ { k = ""
         if ($0 ~ /GroupedOuterKernel/ && $0 ~ /sm_90a/) { match($0, /GroupedOuterKernelILb[01]/); s = substr($0, RSTART, RLENGTH)
           k = "GroupedOuterKernel<f32=" substr(s, 22, 1) ">" } }
       k != "" && /spill/ { sp = $0 } k != "" && /registers/ { print "ptxas: " k ":" sp " |" $0; k = "" }' "$dir/ptxas_$probe.log" || true
  fi
  grep -iE "warning|C7520" "$dir/ptxas_$probe.log" && echo "WARNING: see $dir/ptxas_$probe.log" || true
fi
if command -v cuobjdump > /dev/null; then
  echo "SASS HGMMA count ($probe): $(cuobjdump -sass "$dir/$probe" | grep -c HGMMA || true)"
else
  echo "SASS HGMMA count: (cuobjdump not found)"
fi
case "$mode" in
  build|outer-build) exit 0 ;;
  sanitize|outer-sanitize)
    WGMMA_WATCHDOG_S=300 compute-sanitizer --tool memcheck --error-exitcode 9 \
      "$dir/$probe" --small-only --no-timing ;;
  run|outer|outer-prebuilt) "$dir/$probe" ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
