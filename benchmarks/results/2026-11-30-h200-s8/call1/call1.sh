#!/usr/bin/env bash
# Call 1 (session 8), one H200, main at 876f9cf: #4's last unmeasured shape (the DeepSeek-like layer, forward+backward,
# ours / XLA / tokamax), the decode shapes with the new ideal row, tokamax's ragged_dot checked on all 10 GEMMs of the
# layer shapes, and whether racecheck finishes the small-mma suite.
set -uo pipefail
S=$(date +%s)
el() { echo "== elapsed $(( $(date +%s) - S )) s: $*"; }
left() { echo $(( 560 - ($(date +%s) - S) )); }
exec > >(tee $OUT/call1.txt) 2>&1
source benchmarks/tokamax_wheels.sh
source tests/gpu/build_gpu.sh || exit 1
el build
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
timeout 220 python3 benchmarks/bench_layer.py --shapes deepseek --passes fwd+bwd --out $OUT/layer_ds.jsonl \
  > $OUT/layer_ds.log 2>&1
echo "== layer deepseek fwd+bwd rc $?"; grep -E "^  shape|^\||rror|wrong" $OUT/layer_ds.log | cut -c1-200
el layer_ds
timeout 100 python3 benchmarks/bench_layer.py --decode --out $OUT/layer_decode.jsonl > $OUT/layer_decode.log 2>&1
echo "== layer decode rc $?"; grep -E "^  shape|^\||rror|wrong" $OUT/layer_decode.log | cut -c1-200
el decode
timeout 100 python3 benchmarks/check_tokamax.py --out $OUT/tokamax_check.jsonl > $OUT/tokamax_check.log 2>&1
echo "== tokamax check rc $?"; grep -E "^\||rror" $OUT/tokamax_check.log | cut -c1-200
el check
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
T=$(( $(left) - 5 ))
if [ "$T" -gt 30 ]; then
  timeout $T "$CS" --tool racecheck --error-exitcode 99 "$JMO_LOOPBACK_BIN" --suite small-mma --timeout-ms 60000 \
    > /tmp/racecheck.txt 2>&1
  echo "== racecheck (limit $T s) rc $?"; grep -E "SUMMARY|cases passed|^FAIL" /tmp/racecheck.txt | head; tail -c 3000 /tmp/racecheck.txt > $OUT/racecheck_tail.txt
fi
el racecheck
rm -f $OUT/env.log $OUT/build.log; ls $OUT
