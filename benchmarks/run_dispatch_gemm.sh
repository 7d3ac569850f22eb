#!/usr/bin/env bash
# dispatch_gemm (the dispatch and GEMM1 in one launch) on one Hopper GPU, in one device call of about 4 minutes:
#   build (tests/gpu/build_gpu.sh) -> loopback --suite dispatch-gemm (R = 1, 2, 4, 8 x 3 routings, a forced
#   timeout; bitwise against Dispatch + GroupedMatmul) -> memcheck on one rank -> --suite dispatch-gemm-time (R = 2
#   loopback ranks, seed-like shape: two calls vs dispatch_gemm with 4 / 8 / 16 pushers) -> the GPU tests named
#   dispatch_gemm (the loopback suite and the layer bitwise equal to two calls).
# On two or more GPUs, the layer itself: EP_IMPLS=ours,serialized,ideal,ours_dg EP_ARGS="--dispatch-pushers 8"
# bash benchmarks/run_multi_gpu.sh.
#
#   bash benchmarks/run_dispatch_gemm.sh       ($OUT: summary.txt, loopback.txt, time.txt, memcheck.txt, pytest.log)
set -uo pipefail
export OUT=${OUT:-/tmp/jmo-dispatch-gemm-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
exec > >(tee "$OUT/summary.txt") 2>&1
S=$(date +%s)
el() { echo "== elapsed $(( $(date +%s) - S )) s: $*"; }
source tests/gpu/build_gpu.sh || exit 1
el build
export CUDA_DEVICE_MAX_CONNECTIONS=32
loopback=(python3 -m tools.loopback.run)
timeout 120 "${loopback[@]}" --suite dispatch-gemm > "$OUT/loopback.txt" 2>&1
echo "loopback rc $?"; grep -E "^(PASS|FAIL)|cases passed|  " "$OUT/loopback.txt" | cut -c1-240 | head -30
el loopback
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$CS" ]; then
  timeout 120 "$CS" --tool memcheck --error-exitcode 99 "${loopback[@]}" --ranks 1 --experts 4 --tokens 48 \
    --d-model 192 --k-dim 128 --dispatch-gemm 1 --iters 2 > "$OUT/memcheck.txt" 2>&1
  echo "memcheck rc $?"; grep -E "SUMMARY|^(PASS|FAIL)" "$OUT/memcheck.txt" | cut -c1-240
fi
el memcheck
timeout 200 "${loopback[@]}" --suite dispatch-gemm-time > "$OUT/time.txt" 2>&1
echo "time rc $?"; grep -E "^(PASS|FAIL)|cases passed" "$OUT/time.txt" | sed 's/.*pushers=\([0-9]*\).*dispatch + GEMM1/pushers=\1: dispatch + GEMM1/' | cut -c1-240
el time
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu -k dispatch_gemm > "$OUT/pytest.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest.log"; grep -E "^FAILED|^E  " "$OUT/pytest.log" | head -10
el pytest
rm -f "$OUT/env.log" "$OUT/build.log" "$OUT/build_tools.log"
