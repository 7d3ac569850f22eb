#!/usr/bin/env bash
# Call 4 (session 5), one H200, final main: GPU tests; the fused operator and the whole layer at EP = 1 with the
# effect-free custom calls (JAX's C++ dispatch fast path); the oracle sweep with cta_gbps taken from an overlapped
# run (call4/cal_overlap.json) against call 3's sweep with the serialized calibration.
set -uo pipefail
S=$(date +%s)
el() { echo "== elapsed $(( $(date +%s) - S )) s: $*"; }
left() { echo $(( 395 - ($(date +%s) - S) )); }
exec > >(tee $OUT/call4.txt) 2>&1
source benchmarks/tokamax_wheels.sh
source tests/gpu/build_gpu.sh || exit 1
el build
python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not racecheck and not synccheck" > $OUT/pytest.log 2>&1
tail -2 $OUT/pytest.log; grep -E "^FAILED|^E  " $OUT/pytest.log | head -10
el tests
export PYTHONPATH=$PWD:/tmp/site
timeout 85 python3 benchmarks/bench_fused.py --quick --skews balanced --impls "ours,serialized,bare+combine,bare gemm,tokamax" \
  --out $OUT/fused.jsonl > $OUT/fused.log 2>&1; echo "== fused rc $?"; grep -E "^\|" $OUT/fused.log | cut -c1-170
el fused
timeout 110 python3 benchmarks/bench_resource.py --calibration benchmarks/results/2026-11-29-h200-s5/call4/cal_overlap.json \
  --ranks 2 --ctas 1,2,4,8,16 --reps 3 --out $OUT/resource.jsonl --log /tmp/loopback.log > $OUT/resource.txt 2>&1
echo "== resource (rc $?)"; grep -E "^\||regret|mean|worst|fixed" $OUT/resource.txt | cut -c1-220
el resource
[ $(left) -gt 30 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_layer.py --quick --out $OUT/layer.jsonl > $OUT/layer.log 2>&1
echo "== layer rc $?"; grep -E "^\|" $OUT/layer.log | cut -c1-170
el layer
cd $OUT && tar -czf logs.tgz env.log build.log 2>/dev/null; rm -f env.log build.log; ls $OUT
