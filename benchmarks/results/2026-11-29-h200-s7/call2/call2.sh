#!/usr/bin/env bash
# Call 2 (session 7), one H200, branch wip/s6-decision: the GPU tests call 1 did not reach (the resource tests and
# synccheck; racecheck last, with what time is left), then #4's whole-layer shapes never run (seed-like T=16k,
# DeepSeek-like E_l=32, forward and forward+backward) and the decode-sized shapes (forward).
set -uo pipefail
S=$(date +%s)
el() { echo "== elapsed $(( $(date +%s) - S )) s: $*"; }
left() { echo $(( 570 - ($(date +%s) - S) )); }
exec > >(tee $OUT/call2.txt) 2>&1
source benchmarks/tokamax_wheels.sh
source tests/gpu/build_gpu.sh || exit 1
el build
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "test_gpu_resource or synccheck" --durations=8 \
  > $OUT/pytest.log 2>&1
echo "pytest rc $?"; tail -14 $OUT/pytest.log; grep -E "^FAILED|^E  " $OUT/pytest.log | head -20
el tests
export PYTHONPATH=$PWD:/tmp/site
timeout 200 python3 benchmarks/bench_layer.py --shapes "T=16k,deepseek" --out $OUT/layer.jsonl > $OUT/layer.log 2>&1
echo "== layer rc $?"; grep -E "^  shape|^\||rror|wrong" $OUT/layer.log | cut -c1-170
el layer
timeout 90 python3 benchmarks/bench_layer.py --decode --out $OUT/decode.jsonl > $OUT/decode.log 2>&1
echo "== decode rc $?"; grep -E "^\||rror|wrong" $OUT/decode.log | cut -c1-170
el decode
if [ $(left) -gt 60 ]; then
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  timeout $(( $(left) - 10 )) $CS --tool racecheck --error-exitcode 99 $JMO_LOOPBACK_BIN --suite small --timeout-ms 60000 \
    > $OUT/racecheck.log 2>&1
  echo "== racecheck rc $?"; grep -E "SUMMARY|cases passed|PASS|FAIL" $OUT/racecheck.log | head -20
fi
el racecheck
cd $OUT && tar -czf logs.tgz pytest.log env.log build.log 2>/dev/null; rm -f pytest.log env.log build.log; ls $OUT
