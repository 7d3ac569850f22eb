#!/usr/bin/env bash
# Call 2 (session 8), one H200, branch wip/s7-dispatch-gemm rebased on main 6dc1f6a (the reference as one padded
# batched dot): #4's DeepSeek-like layer forward+backward and the DeepSeek-like decode shape, then dispatch_gemm's
# first run on a GPU (benchmarks/run_dispatch_gemm.sh: loopback checks, memcheck, timing, its GPU tests).
set -uo pipefail
S=$(date +%s)
el() { echo "== elapsed $(( $(date +%s) - S )) s: $*"; }
left() { echo $(( 570 - ($(date +%s) - S) )); }
exec > >(tee $OUT/call2.txt) 2>&1
source benchmarks/tokamax_wheels.sh
source tests/gpu/build_gpu.sh || exit 1
el build
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
timeout 170 python3 benchmarks/bench_layer.py --shapes deepseek --passes fwd+bwd --out /tmp/layer_ds.jsonl \
  > $OUT/layer_ds.log 2>&1
echo "== layer deepseek fwd+bwd rc $?"; grep -E "^  shape|^\||rror|wrong" $OUT/layer_ds.log | cut -c1-200
el layer_ds
timeout 60 python3 benchmarks/bench_layer.py --decode --shapes "decode deepseek" --out /tmp/layer_decode.jsonl \
  > $OUT/layer_decode.log 2>&1
echo "== layer decode deepseek rc $?"; grep -E "^  |^\||rror|wrong" $OUT/layer_decode.log | cut -c1-200
el decode
timeout $(( $(left) - 5 )) bash benchmarks/run_dispatch_gemm.sh > /dev/null 2>&1
echo "== run_dispatch_gemm rc $?"; cat $OUT/summary.txt | grep -v "^==.*elapsed" | grep -vE "^(Cuda|Build|GPU|jax|cuda)" | cut -c1-240
el dispatch_gemm
ls $OUT
