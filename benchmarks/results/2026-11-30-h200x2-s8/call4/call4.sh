#!/usr/bin/env bash
# Call 4 (session 8), two H200s, branch wip/s7-dispatch-gemm with GEMM1 in bands of 8 row blocks: dispatch_gemm's
# loopback checks again, then the EP = 2 layer, ours against ours_dg with 16 and with 8 pushing CTAs (forward), seed
# and Mixtral-like shapes.
set -uo pipefail
S=$(date +%s)
el() { echo "== elapsed $(( $(date +%s) - S )) s: $*"; }
exec > >(tee $OUT/call4.txt) 2>&1
source tests/gpu/build_gpu.sh || exit 1
el build
export CUDA_DEVICE_MAX_CONNECTIONS=32 PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
timeout 90 "$JMO_LOOPBACK_BIN" --suite dispatch-gemm > $OUT/loopback.txt 2>&1
echo "loopback dispatch-gemm rc $?"; grep -E "^FAIL|cases passed|^  " $OUT/loopback.txt | cut -c1-200 | head -20
timeout 60 "$JMO_LOOPBACK_BIN" --suite small > $OUT/small.txt 2>&1
echo "loopback small rc $?"; grep -E "^FAIL|cases passed|^  " $OUT/small.txt | cut -c1-200 | head
el loopback
for P in 16 8; do
  timeout 150 env JAX_PLATFORMS=cuda python3 benchmarks/bench_ep_layer.py --passes fwd \
    --shapes '^seed T=8192 N=4096 E=8 balanced$|^mixtral-like balanced$' --impls ours,ours_dg --dispatch-pushers $P \
    --max-call-s 5 --out $OUT/ep_layer_p$P.jsonl > $OUT/ep_layer_p$P.log 2>&1
  echo "== bench_ep_layer pushers=$P rc $?"; sed -n '/^| shape/,$p' $OUT/ep_layer_p$P.log | cut -c1-130
  el "pushers $P"
done
ls $OUT
