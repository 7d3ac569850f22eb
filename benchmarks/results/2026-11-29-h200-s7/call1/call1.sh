#!/usr/bin/env bash
# Call 1 (session 7), one H200, branch wip/s6-decision (host-computed tile_m magic / col tiles, a one-barrier device
# decision, ProduceWgmma's tile prefix by a block scan): the decision probe (random tables vs the host, ns), all GPU
# tests incl. memcheck/racecheck/synccheck, the decision cost inside the sweep harness; then #4's unmeasured producer
# shapes and a per-kernel trace of the fused operator at E = 64.
set -uo pipefail
S=$(date +%s)
el() { echo "== elapsed $(( $(date +%s) - S )) s: $*"; }
left() { echo $(( 570 - ($(date +%s) - S) )); }
exec > >(tee $OUT/call1.txt) 2>&1
git -C . log --oneline -1 2>/dev/null
source benchmarks/tokamax_wheels.sh
nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -I ffi -I ffi/include \
  -o /tmp/decision_probe ffi/cuda/decision_probe.cu > /tmp/probe_build.log 2>&1 &
PB=$!
source tests/gpu/build_gpu.sh || exit 1
el build
wait $PB; tail -3 /tmp/probe_build.log
timeout 40 /tmp/decision_probe --seeds 6 > $OUT/decision_probe.txt 2>&1; echo "probe rc $?"
grep -E "^\||check|WRONG|ns per" $OUT/decision_probe.txt | head -30
el probe
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu --durations=8 > $OUT/pytest.log 2>&1
echo "pytest rc $?"; tail -14 $OUT/pytest.log; grep -E "^FAILED|^E  " $OUT/pytest.log | head -20
el tests
export PYTHONPATH=$PWD:/tmp/site
timeout 40 python3 benchmarks/bench_resource.py --only 0 --ranks 2 --ctas 4 --reps 2 --decision-iters 4000 \
  --out $OUT/decision.jsonl --log /tmp/loopback_d.log > $OUT/decision.txt 2>&1
echo "== decision (rc $?)"; grep -E "decision" $OUT/decision.txt | cut -c1-250
el decision
[ $(left) -gt 60 ] && timeout 60 python3 benchmarks/bench_fused.py --shapes E=64 --skews balanced \
  --impls "ours,bare+combine,bare gemm" --trace 10 --out $OUT/fused.jsonl > $OUT/fused.log 2>&1
echo "== fused rc $?"; grep -vE "^(WARNING|I0000|W0000)" $OUT/fused.log | cut -c1-170 | tail -60
el fused
[ $(left) -gt 30 ] && timeout $(( $(left) - 5 )) python3 benchmarks/bench_grouped_gemm.py --skews balanced \
  --shapes "T=16384,E=4,E=16,E=32" --methods "lax.ragged_dot,tokamax.mosaic,ours,ours (w^T)" --out $OUT/gemm.jsonl \
  > $OUT/gemm.log 2>&1; echo "== gemm rc $?"; grep -E "^\|" $OUT/gemm.log | cut -c1-170
el gemm
ls $OUT; rm -f $OUT/env.log $OUT/build.log
