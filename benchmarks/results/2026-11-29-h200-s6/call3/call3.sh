#!/usr/bin/env bash
# Call 3 (session 6), one H200, branch wip/s6b after the fix of the combine gather's chunk loop: GPU tests; the fused
# operator at EP = 1 (ours vs bare GEMM + XLA combine, seeds E 8 / 64); the DeepSeek-like producer shapes under
# moderate / stress routing (what call 2's sweep did not reach; without lax.ragged_dot, which takes 78 ms a call).
set -uo pipefail
S=$(date +%s)
el() { echo "== elapsed $(( $(date +%s) - S )) s: $*"; }
left() { echo $(( 400 - ($(date +%s) - S) )); }
exec > >(tee $OUT/call3.txt) 2>&1
source benchmarks/tokamax_wheels.sh
source tests/gpu/build_gpu.sh || exit 1
el build
timeout 240 python3 -m pytest -v -p no:cacheprovider tests/gpu -k "not racecheck and not synccheck" -x > $OUT/pytest.log 2>&1
echo "pytest rc $?"; tail -2 $OUT/pytest.log; grep -E "^FAILED|^E  " $OUT/pytest.log | head -20; tail -3 $OUT/pytest.log | cut -c1-200
el tests
export PYTHONPATH=$PWD:/tmp/site
timeout 100 python3 benchmarks/bench_fused.py --quick --skews balanced --impls "ours,serialized,bare+combine,bare gemm" \
  --out $OUT/fused.jsonl > $OUT/fused.log 2>&1; echo "== fused rc $?"; grep -E "^\|" $OUT/fused.log | cut -c1-170
el fused
timeout $(( $(left) - 5 )) python3 benchmarks/bench_grouped_gemm.py --skews moderate,stress --shapes deepseek \
  --methods "tokamax.mosaic,ours,ours (w^T)" --out $OUT/gemm.jsonl > $OUT/gemm.log 2>&1
echo "== gemm rc $?"; grep -E "^  shape" $OUT/gemm.log | cut -c1-170
el gemm
rm -f $OUT/env.log $OUT/build.log; ls $OUT
