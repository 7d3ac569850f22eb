#!/usr/bin/env bash
# Call 5 (session 6), one H200, wip/s6b at 7217528 (the choice of C moved into consumer_choice.cuh, identical SASS):
# the decision probe (the library's choice against the host's on random tables, ns per decision), GPU tests, and the
# whole layer at EP = 1 on the Mixtral-like shape (never reached before), as far as the time allows.
set -uo pipefail
S=$(date +%s)
el() { echo "== elapsed $(( $(date +%s) - S )) s: $*"; }
left() { echo $(( 215 - ($(date +%s) - S) )); }
exec > >(tee $OUT/call5.txt) 2>&1
source benchmarks/tokamax_wheels.sh
nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -I ffi -I ffi/include \
  -o /tmp/decision_probe ffi/cuda/decision_probe.cu > /tmp/probe_build.log 2>&1 &
PB=$!
source tests/gpu/build_gpu.sh || exit 1
el build
wait $PB; tail -3 /tmp/probe_build.log
timeout 30 /tmp/decision_probe --seeds 6 > $OUT/decision_probe.txt 2>&1; echo "probe rc $?"
grep -E "^\||check|WRONG|ns per" $OUT/decision_probe.txt | head -30
el probe
timeout 110 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not racecheck and not synccheck" -x > $OUT/pytest.log 2>&1
echo "pytest rc $?"; tail -2 $OUT/pytest.log; grep -E "^FAILED|^E  " $OUT/pytest.log | head -10
el tests
export PYTHONPATH=$PWD:/tmp/site
[ $(left) -gt 25 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_layer.py --shapes mixtral --out $OUT/layer.jsonl \
  > $OUT/layer.log 2>&1; echo "== layer rc $?"; grep -E "^  shape|^\|" $OUT/layer.log | cut -c1-170
el layer
rm -f $OUT/env.log $OUT/build.log; ls $OUT
