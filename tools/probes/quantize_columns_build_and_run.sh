#!/usr/bin/env bash
# Build and run the FP8 column quantizer probe (quantize_columns_probe.cu, Hopper sm_90a): the library's kernel beside
# the schedules and input forms of ops/quantize_columns.cuh, each checked bitwise against the baseline, then timed.
#   bash tools/probes/quantize_columns_build_and_run.sh [build_dir=/tmp/qcols] [mode=run|build]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dir="${1:-/tmp/qcols}"
mode="${2:-run}"
mkdir -p "$dir"
NVCC="${NVCC:-nvcc}"
probe=quantize_columns_probe
if ! "$NVCC" -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -lineinfo --expt-relaxed-constexpr \
    -I"$repo/ffi" -I"$repo/ffi/include" -Xptxas -v -o "$dir/$probe" "$here/$probe.cu" 2> "$dir/ptxas_$probe.log"; then
  cat "$dir/ptxas_$probe.log"
  exit 1
fi
# One line per quantizer kernel: registers / spills.
awk '/Compiling entry function/ { k = ""
     if ($0 ~ /QuantizeColumns/) { match($0, /QuantizeColumns[A-Za-z]+I[^E]*E/); k = substr($0, RSTART, RLENGTH) } }
   k != "" && /spill/ { sp = $0 } k != "" && /registers/ { sub(/.*: +/, "", sp); r = $0; sub(/.*: +/, "", r)
     print "ptxas: " k ": " sp " | " r; k = "" }' "$dir/ptxas_$probe.log" || true
[ "$mode" = build ] && exit 0
"$dir/$probe"
