#!/usr/bin/env bash
# Call 3 (session 7), one H200, branch wip/s6-decision: #4's last whole-layer shape (DeepSeek-like E_l=32, forward and
# forward+backward), then whether tokamax's mosaic ragged_dot is right forward and backward on every GEMM of the layer
# shapes (call 2 found its forward+backward layer 52% off at seed-like T=16k).
set -uo pipefail
S=$(date +%s)
el() { echo "== elapsed $(( $(date +%s) - S )) s: $*"; }
exec > >(tee $OUT/call3.txt) 2>&1
source benchmarks/tokamax_wheels.sh
source tests/gpu/build_gpu.sh || exit 1
el build
export PYTHONPATH=$PWD:/tmp/site
timeout 200 python3 benchmarks/bench_layer.py --shapes deepseek --out $OUT/layer.jsonl > $OUT/layer.log 2>&1
echo "== layer rc $?"; grep -E "^  shape|^\||rror|wrong" $OUT/layer.log | cut -c1-170
el layer
timeout 150 python3 benchmarks/check_tokamax.py --out $OUT/tokamax_check.jsonl > $OUT/tokamax_check.log 2>&1
echo "== tokamax check rc $?"; grep -E "^\||rror" $OUT/tokamax_check.log | cut -c1-170
el check
rm -f $OUT/env.log $OUT/build.log; ls $OUT
