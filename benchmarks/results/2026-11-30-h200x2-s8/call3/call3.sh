#!/usr/bin/env bash
# Call 3 (session 8), two H200s, branch wip/s7-dispatch-gemm with the loopback's pinned-buffer fix: dispatch_gemm's
# checks again (loopback suite dispatch-gemm, the regular kernels' small suite, the GPU tests named dispatch_gemm),
# then the EP = 2 layer with ours_dg (dispatch + GEMM1 in one launch, 16 pushing CTAs) beside ours / serialized / ideal.
set -uo pipefail
S=$(date +%s)
el() { echo "== elapsed $(( $(date +%s) - S )) s: $*"; }
mkdir -p /tmp/dg $OUT/mg
exec > >(tee $OUT/call3.txt) 2>&1
nvidia-smi -L
source tests/gpu/build_gpu.sh || exit 1
el build
export CUDA_DEVICE_MAX_CONNECTIONS=32 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 90 "$JMO_LOOPBACK_BIN" --suite dispatch-gemm > /tmp/dg/loopback.txt 2>&1
echo "loopback dispatch-gemm rc $?"; grep -E "^(PASS|FAIL)|cases passed|^  " /tmp/dg/loopback.txt | cut -c1-200 | head -30
el loopback
timeout 60 "$JMO_LOOPBACK_BIN" --suite small > /tmp/dg/small.txt 2>&1
echo "loopback small rc $?"; grep -E "^FAIL|cases passed|^  " /tmp/dg/small.txt | cut -c1-200 | head
el small
timeout 130 python3 -m pytest -q -p no:cacheprovider tests/gpu -k dispatch_gemm > /tmp/dg/pytest.log 2>&1
echo "pytest -k dispatch_gemm rc $?"; tail -2 /tmp/dg/pytest.log; grep -E "^FAILED|^E  " /tmp/dg/pytest.log | head
el pytest
R=$(( 560 - ($(date +%s) - S) ))
echo "== run_multi_gpu with T_TOTAL=$R"
OUT=$OUT/mg T_TOTAL=$R T_BUILD=60 T_LINKS=0 T_TESTS=0 T_TRAIN=0 T_EP_COMBINE=0 \
  EP_SHAPES='^seed T=8192 N=4096 E=8 balanced$|^mixtral-like balanced$' EP_IMPLS=ours,serialized,ideal,ours_dg \
  EP_ARGS="--dispatch-pushers 16 --max-call-s 5" bash benchmarks/run_multi_gpu.sh > /dev/null 2>&1
echo "run_multi_gpu rc $?"; grep -vE "^\| *(compute|comm)_alone" $OUT/mg/summary.txt | cut -c1-260
el multi_gpu
tar czf $OUT/dg.tgz -C /tmp dg; ls $OUT $OUT/mg
