#!/usr/bin/env bash
# dispatch_gemm (the dispatch and GEMM1 in one launch) on one Hopper GPU, in one device call of about 6 minutes:
#   build (tests/gpu/build_gpu.sh) -> loopback --suite dispatch-gemm (R = 1, 2, 4, 8 x 3 routings in its three result
#   modes, a forced timeout, an emulated link; bitwise against Dispatch + GroupedMatmul / GroupedMatmulSwiGlu) ->
#   memcheck on one rank (training and inference modes) -> --suite dispatch-gemm-time (seed-like shape: two calls vs
#   dispatch_gemm at HBM speed and over an emulated NVLink, with its timeline) -> the GPU tests named dispatch_gemm or
#   swiglu (the loopback suite, the layer bitwise equal to two calls) -> the loopback full suite (the dispatch and
#   expert_combine it shares code with).
# On two or more GPUs, the layer itself: EP_IMPLS=ours,serialized,ideal,ours_dg EP_ARGS="--dispatch-pushers 8"
# bash benchmarks/run_multi_gpu.sh.
#
#   bash benchmarks/run_dispatch_gemm.sh       ($OUT: summary.txt, loopback.txt, time.txt, memcheck.txt, pytest.log,
#                                               full.txt)
# DG_ONLY_TIME=1 keeps the build, dispatch-gemm-time and the pytest step (about 5 minutes); DG_REGRET=1 adds
# --suite regret-push (the pusher model's regret, aligned calls in three passes: about 4 minutes more; regret.txt).
set -uo pipefail
export OUT=${OUT:-/tmp/jmo-dispatch-gemm-out}
cd "$(dirname "$0")/.."
source benchmarks/device_call.sh || exit 1  # $OUT/summary.txt, `el`, the build
loopback=(python3 -m tools.loopback.run)
DG_ONLY_TIME=${DG_ONLY_TIME:-0} DG_REGRET=${DG_REGRET:-0}
if [ "$DG_ONLY_TIME" = 0 ]; then
  timeout 120 "${loopback[@]}" --suite dispatch-gemm > "$OUT/loopback.txt" 2>&1
  echo "loopback rc $?"; grep -E "^(PASS|FAIL)|cases passed|  " "$OUT/loopback.txt" | cut -c1-240 | head -30
  el loopback
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ -n "$CS" ]; then
    for mode in train infer plain; do
      timeout 120 "$CS" --tool memcheck --error-exitcode 99 "${loopback[@]}" --ranks 1 --experts 4 --tokens 48 \
        --d-model 192 --k-dim 320 --dispatch-gemm 1 --dispatch-gemm-mode $mode --iters 2 >> "$OUT/memcheck.txt" 2>&1
      echo "memcheck $mode rc $?"
    done
    grep -E "SUMMARY|^(PASS|FAIL)" "$OUT/memcheck.txt" | cut -c1-240
  fi
  el memcheck
fi
timeout 240 "${loopback[@]}" --suite dispatch-gemm-time > "$OUT/time.txt" 2>&1
echo "time rc $?"
grep -E "^(PASS|FAIL)|cases passed" "$OUT/time.txt" \
  | sed -E 's/^(PASS|FAIL) (R=[0-9]+) .*pushers=([0-9]+) mode=([a-z]+)( link=[0-9.]+GB\/s)?.*dispatch \+ GEMM1 per call:/\1 \2 P=\3 \4\5:/' \
  | cut -c1-400
grep -E "^\|" "$OUT/time.txt"
el time
(cd /tmp && timeout 240 python3 -m pytest -q -p no:cacheprovider "$OLDPWD/tests/gpu" -k "dispatch_gemm or swiglu") \
  > "$OUT/pytest.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/pytest.log"; grep -E "^FAILED|^E  " "$OUT/pytest.log" | head -10
el pytest
if [ "$DG_REGRET" != 0 ]; then
  # Within one 600-second device call: what is left of it, at most 300 s.
  left=$(( 585 - ($(date +%s) - S) )); [ "$left" -gt 300 ] && left=300
  timeout "$left" "${loopback[@]}" --suite regret-push > "$OUT/regret.txt" 2>&1
  echo "regret-push rc $?"; grep -E "^FAIL|^REGRET|^regret" "$OUT/regret.txt" | cut -c1-300
  el regret-push
fi
if [ "$DG_ONLY_TIME" = 0 ]; then
  timeout 240 "${loopback[@]}" --suite full > "$OUT/full.txt" 2>&1
  echo "full rc $?"; grep -E "^FAIL|cases passed" "$OUT/full.txt" | cut -c1-240
  el full
fi
rm -f "$OUT/env.log" "$OUT/build.log" "$OUT/build_tools.log"
