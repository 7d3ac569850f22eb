#!/usr/bin/env bash
# Call 4 (session 7), one H200, branch wip/s6-decision, the session's last 200 s of device time: the DeepSeek-like
# layer forward+backward, ours and tokamax only (the XLA path's forward alone took 123.5 ms on call 3).
set -uo pipefail
S=$(date +%s)
exec > >(tee $OUT/call4.txt) 2>&1
source benchmarks/tokamax_wheels.sh
source tests/gpu/build_gpu.sh || exit 1
echo "== elapsed $(( $(date +%s) - S )) s: build"
export PYTHONPATH=$PWD:/tmp/site
python3 benchmarks/bench_layer.py --shapes deepseek --passes fwd+bwd --impls ours,tokamax --out $OUT/layer.jsonl \
  > $OUT/layer.log 2>&1
echo "== layer rc $?"; grep -E "^  shape|^\||rror|wrong" $OUT/layer.log | cut -c1-170
