#!/usr/bin/env bash
# Call 2 (session 6), one H200, branch wip/s6b = main 6563b77 + the warp-per-token CombineKernel + host-computed
# per-candidate decision constants: GPU tests; combine probe (both shapes); fused operator at EP = 1 (ours vs bare
# GEMM + XLA combine); decision cost (one workload of the oracle sweep); calibrate.py end to end (with its overlapped
# step 2b); the producer under moderate / stress routing (tokamax carried).
set -uo pipefail
S=$(date +%s)
el() { echo "== elapsed $(( $(date +%s) - S )) s: $*"; }
left() { echo $(( 540 - ($(date +%s) - S) )); }
exec > >(tee $OUT/call2.txt) 2>&1
source benchmarks/tokamax_wheels.sh
source tests/gpu/build_gpu.sh || exit 1
el build
nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -I ffi -I ffi/include \
  -o /tmp/combine_probe ffi/cuda/combine_probe.cu > $OUT/probe_build.log 2>&1 &
PB=$!
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not racecheck and not synccheck" > $OUT/pytest.log 2>&1
echo "pytest rc $?"; tail -2 $OUT/pytest.log; grep -E "^FAILED|^E  " $OUT/pytest.log | head -20
el tests
wait $PB; tail -3 $OUT/probe_build.log
{ timeout 30 /tmp/combine_probe; timeout 30 /tmp/combine_probe --tokens 4096 --k 8 --n 7168; } > $OUT/combine_probe.txt 2>&1
grep -E "^\||combine probe|WRONG" $OUT/combine_probe.txt
el probe
export PYTHONPATH=$PWD:/tmp/site
timeout 40 python3 benchmarks/bench_resource.py --only 0 --ranks 2 --ctas 4 --reps 2 --decision-iters 4000 \
  --out $OUT/decision.jsonl --log /tmp/loopback_d.log > $OUT/decision.txt 2>&1
echo "== decision (rc $?)"; grep -E "decision" $OUT/decision.txt | cut -c1-250
el decision
timeout 100 python3 benchmarks/bench_fused.py --quick --skews balanced --impls "ours,serialized,bare+combine,bare gemm" \
  --out $OUT/fused.jsonl > $OUT/fused.log 2>&1; echo "== fused rc $?"; grep -E "^\|" $OUT/fused.log | cut -c1-170
el fused
timeout 60 python3 benchmarks/calibrate.py --out $OUT/nvidia_h200.json --reps 3 --log /tmp/calibrate.log > $OUT/calibrate.txt 2>&1
echo "== calibrate rc $?"; tail -15 $OUT/calibrate.txt; cat $OUT/nvidia_h200.json
el calibrate
timeout $(( $(left) - 5 )) python3 benchmarks/bench_grouped_gemm.py --quick --skews moderate,stress --out $OUT/gemm.jsonl \
  > $OUT/gemm.log 2>&1; echo "== gemm rc $?"; grep -E "^\|" $OUT/gemm.log | cut -c1-170
el gemm
ls $OUT; rm -f $OUT/env.log $OUT/build.log $OUT/probe_build.log
