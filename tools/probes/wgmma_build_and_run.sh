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
#   FP8 grouped outer probe (wgmma_outer_fp8_probe.cu, WgmmaGroupedOuterFp8: the FP8 weight gradient, 128 x 1 scales on
#   both operands), timed beside the bf16 grouped outer GEMM:
#     outer-fp8           build, SASS sanity line, run all cases (correctness + timing)
#     outer-fp8-sanitize  build, then memcheck on the small cases only, no timing
#     outer-fp8-build     build + SASS sanity line only
#   FP8 grouped GEMM probe (wgmma_fp8_probe.cu, WgmmaGroupedGemmFp8: e4m3, DeepSeek-V3's block scales), timed beside
#   the bf16 grouped GEMM and cuBLASLt's FP8 GEMM when cublasLt.h and libcublasLt are found (the CUDA toolkit, or the
#   nvidia-cublas wheels of python3; CUBLASLT_HOME=<dir with include/ and lib/> points elsewhere):
#     fp8                 build, SASS sanity line, run all cases (correctness + timing; about half a minute)
#     fp8-sanitize        build, then memcheck on the small cases only, no timing
#     fp8-build           build + SASS sanity line only
#   gathered-A probe (wgmma_gather_probe.cu: the grouped GEMM with A gathered row by row from scattered rows, by
#   cp.async or by one-row TMA boxes, timed against the TMA A of WgmmaGroupedGemm on the same data; PROBE_ARGS=--rows-only
#   runs the TMA A and the one-row TMA variants alone):
#     gather              build, SASS sanity line, run all cases (correctness + bitwise against TMA A + timing)
#     gather-sanitize     build, then memcheck on the small cases only, no timing
#     gather-build        build + SASS sanity line only
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dir="${1:-/tmp/wgmma}"
mode="${2:-run}"
mkdir -p "$dir"
NVCC="${NVCC:-nvcc}"
case "$mode" in
  outer-fp8*) probe=wgmma_outer_fp8_probe ;;
  outer*) probe=wgmma_outer_probe ;;
  fp8*) probe=wgmma_fp8_probe ;;
  gather*) probe=wgmma_gather_probe ;;
  *) probe=wgmma_probe ;;
esac
# cuBLASLt for the FP8 probe's comparison: a folder with include/cublasLt.h and lib*/libcublasLt.so*.
cublas=()
if [ "$probe" = wgmma_fp8_probe ] && [ "$mode" != fp8-sanitize ]; then
  homes=("${CUBLASLT_HOME:-}" "$(dirname "$(command -v "$NVCC")")/..")
  while IFS= read -r d; do homes+=("$d"); done < <(python3 -c '
import glob, os, site, sys
for r in sorted(set(sys.path + site.getsitepackages())):
    for d in glob.glob(os.path.join(r, "nvidia", "*")):
        print(d)' 2>/dev/null || true)
  for d in "${homes[@]}"; do
    [ -n "$d" ] && [ -f "$d/include/cublasLt.h" ] || continue
    lib=$(ls "$d"/lib*/libcublasLt.so* 2>/dev/null | head -1 || true)
    if [ -n "$lib" ]; then
      cublas=(-DPROBE_CUBLASLT=1 -I"$d/include" "$lib" -Xlinker "-rpath=$(dirname "$lib")")
      echo "cuBLASLt: $lib"
      break
    fi
  done
  [ ${#cublas[@]} -gt 0 ] || echo "cuBLASLt: not found (the FP8 probe times without it)"
fi
if [ "$mode" != outer-prebuilt ]; then
  # The library's gencodes: sm_90a SASS (the wgmma kernels) + sm_80 SASS + compute_80 PTX (guarded __trap() bodies).
  build() {
    "$NVCC" -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80 \
      -gencode=arch=compute_80,code=compute_80 -O3 -std=c++17 -lineinfo --expt-relaxed-constexpr -Xcompiler=-Wall \
      -I"$repo/ffi" -I"$repo/ffi/include" \
      -Xptxas -v -o "$dir/$probe" "$here/$probe.cu" "$@" 2> "$dir/ptxas_$probe.log"
  }
  if ! build "${cublas[@]}"; then
    if [ ${#cublas[@]} -gt 0 ]; then
      grep -m5 -i error "$dir/ptxas_$probe.log" || true
      echo "cuBLASLt: the build with it failed (above); building without it"
      build || { cat "$dir/ptxas_$probe.log"; exit 1; }
    else
      cat "$dir/ptxas_$probe.log"
      exit 1
    fi
  fi
  # One line per sm_90a kernel instantiation: registers / spills.
  if [ "$probe" = wgmma_fp8_probe ]; then
    awk '/Compiling entry function/ { k = ""
         if ($0 ~ /sm_90a/ && $0 ~ /GroupedGemmFp8Kernel/) k = "GroupedGemmFp8Kernel<f32=" (($0 ~ /KernelILb1/) ? 1 : 0) ">"
         else if ($0 ~ /sm_90a/ && $0 ~ /GroupedGemmKernel/) { match($0, /GroupedGemmKernelILi[01]ELb[01]/); s = substr($0, RSTART, RLENGTH)
           k = "GroupedGemmKernel<transB=" substr(s, 21, 1) ",f32=" substr(s, 25, 1) "> (bf16, timed beside)" } }
       k != "" && /spill/ { sp = $0 } k != "" && /registers/ { print "ptxas: " k ":" sp " |" $0; k = "" }' "$dir/ptxas_$probe.log" || true
  elif [ "$probe" = wgmma_outer_fp8_probe ]; then
    awk '/Compiling entry function/ { k = ""
         if ($0 ~ /sm_90a/ && $0 ~ /GroupedOuterFp8Kernel/) k = "GroupedOuterFp8Kernel<f32=" (($0 ~ /KernelILb1/) ? 1 : 0) ">"
         else if ($0 ~ /sm_90a/ && $0 ~ /GroupedOuterKernel/) k = "GroupedOuterKernel<f32=" (($0 ~ /KernelILb1/) ? 1 : 0) "> (bf16, timed beside)" }
       k != "" && /spill/ { sp = $0 } k != "" && /registers/ { print "ptxas: " k ":" sp " |" $0; k = "" }' "$dir/ptxas_$probe.log" || true
  elif [ "$probe" = wgmma_gather_probe ]; then
    awk '/Compiling entry function/ { k = ""
         if ($0 ~ /sm_90a/ && $0 ~ /GatherGemmKernel/) { match($0, /GatherGemmKernelILi[234]ELb[01]/); s = substr($0, RSTART, RLENGTH)
           k = "GatherGemmKernel<warps=" (4 - substr(s, 20, 1)) "-3,fence=" substr(s, 24, 1) ">" }
         else if ($0 ~ /sm_90a/ && $0 ~ /RowTmaGemmKernel/) { match($0, /RowTmaGemmKernelILi[24]/); s = substr($0, RSTART, RLENGTH)
           k = "RowTmaGemmKernel<warps=" (4 - substr(s, 20, 1)) "-3>" }
         else if ($0 ~ /sm_90a/ && $0 ~ /GroupedGemmKernelILi1ELb0/) k = "GroupedGemmKernel<transB=1,f32=0> (TMA A)" }
       k != "" && /spill/ { sp = $0 } k != "" && /registers/ { print "ptxas: " k ":" sp " |" $0; k = "" }' "$dir/ptxas_$probe.log" || true
  elif [ "$probe" = wgmma_probe ]; then
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
  echo "SASS HGMMA count ($probe): $(cuobjdump -sass "$dir/$probe" | grep -c HGMMA || true)," \
    "QGMMA (e4m3) count: $(cuobjdump -sass "$dir/$probe" | grep -c QGMMA || true)"
  if [ "$probe" = wgmma_gather_probe ]; then
    echo "SASS gathered A: LDGSTS count $(cuobjdump -sass "$dir/$probe" | grep -c LDGSTS || true)," \
      "cp.async noinc arrives (ARRIVES.LDGSTSBAR.64.ARVCNT) $(cuobjdump -sass "$dir/$probe" | grep -c 'LDGSTSBAR.64.ARVCNT' || true)"
  fi
else
  echo "SASS HGMMA count: (cuobjdump not found)"
fi
case "$mode" in
  build|outer-build|fp8-build|outer-fp8-build|gather-build) exit 0 ;;
  sanitize|outer-sanitize|fp8-sanitize|outer-fp8-sanitize|gather-sanitize)
    WGMMA_WATCHDOG_S=300 compute-sanitizer --tool memcheck --error-exitcode 9 \
      "$dir/$probe" --small-only --no-timing ;;
  run|outer|outer-prebuilt|fp8|outer-fp8|gather) "$dir/$probe" ${PROBE_ARGS:-} ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
