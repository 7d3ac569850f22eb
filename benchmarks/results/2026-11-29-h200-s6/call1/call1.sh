#!/usr/bin/env bash
# Call 1 (session 6), one H200, branch wip/s6 = main 42f4f11 + wip/s5-kernels + wip/s5-decision: the CUDA probes
# (push / combine / decision), the GPU tests, and the full 12-workload oracle sweep with the shipped calibration
# (its decision-cost and table-build rows are the branch's numbers).
set -uo pipefail
S=$(date +%s)
el() { echo "== elapsed $(( $(date +%s) - S )) s: $*"; }
left() { echo $(( 560 - ($(date +%s) - S) )); }
exec > >(tee $OUT/call1.txt) 2>&1
source tests/gpu/build_gpu.sh || exit 1
el build
SKIP_DEEPSEEK= OUT=$OUT/probes bash benchmarks/run_probes.sh > $OUT/probes.txt 2>&1
cat $OUT/probes.txt | cut -c1-200 | head -120
(cd $OUT/probes && tar -czf ../probes.tgz . ) ; rm -rf $OUT/probes
el probes
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not racecheck and not synccheck" > $OUT/pytest.log 2>&1
echo "pytest rc $?"; tail -2 $OUT/pytest.log; grep -E "^FAILED|^E  " $OUT/pytest.log | head -20
el tests
export PYTHONPATH=$PWD:/tmp/site
timeout $(( $(left) - 10 )) python3 benchmarks/bench_resource.py --ranks 2 --ctas 1,2,4,8,16 --reps 3 \
  --out $OUT/resource.jsonl --log /tmp/loopback.log > $OUT/resource.txt 2>&1
echo "== resource (rc $?)"; grep -E "^\||regret|mean|worst|fixed|decision" $OUT/resource.txt | cut -c1-220
el resource
cd $OUT && tar -czf logs.tgz env.log build.log 2>/dev/null; rm -f env.log build.log; ls $OUT
