#!/usr/bin/env bash
# Call 2 (session 5), one H200: (a) the fused operator with the CUDA custom calls effect-free (JAX's C++ dispatch fast
# path), traced; (b) why waiting consumer CTAs slow the producer: the polling variants of WaitAtLeast (JMO_POLL_MODE
# bits: 1 rare reads of the host-mapped abort word, 2 relaxed polling loads + one acquire fence, 4 longer sleeps) on
# the serialized next-rank workload (producer span vs C) and the skewed one; (c) the bulk-copy probe at C = 16;
# (d) the GPU tests.
set -uo pipefail
S=$(date +%s)
el() { echo "== elapsed $(( $(date +%s) - S )) s: $*"; }
exec > >(tee $OUT/call2.txt) 2>&1
(nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -I ffi -o /tmp/push_probe ffi/cuda/push_probe.cu > $OUT/probe_build.log 2>&1) &
source tests/gpu/build_gpu.sh || exit 1
wait
el build
timeout 100 python3 benchmarks/bench_fused.py --quick --skews balanced --shapes E=8 --impls "ours,serialized,bare+combine,bare gemm" \
  --trace 5 --out $OUT/fused.jsonl 2>&1 | grep -E "^==|^  (device|kernel|gap)|^\|" | cut -c1-180
el fused
LB=build/gpu/ffi/cuda/jmo_loopback
M=$(python3 -c "
import json; p=json.load(open('jax_moe_overlap/calibration/nvidia_h200.json'))
print(','.join(str(float(p[k])) for k in ['sms','ctas_per_sm','tile_m','tile_n','tile_us_base','tile_us_per_k','cta_gbps','link_gbps','seg_us']))")
COMMON="--top-k 2 --d-model 64 --iters 1 --datasets 1 --time --per-call-stats --warmup 1 --reps 3 --check-tokens 16 --timeout-ms 60000"
for mode in 0 1 2 4 3 7; do
  echo "== JMO_POLL_MODE=$mode next_rank K=64 N=4096 serialized"
  JMO_POLL_MODE=$mode timeout 40 $LB $COMMON --ranks 2 --routing 4 --tokens 8192 --experts 16 --k-dim 64 --n-dim 4096 \
    --serialize --consumers 1 --sweep-consumers 1,8,32 2>&1 | grep -E "^(FAIL|TIMED)" | cut -c1-240
  echo "== JMO_POLL_MODE=$mode next_rank K=2048 N=4096 overlapped"
  JMO_POLL_MODE=$mode timeout 40 $LB $COMMON --ranks 2 --routing 4 --tokens 8192 --experts 16 --k-dim 2048 --n-dim 4096 \
    --consumers 1 --sweep-consumers 8,32 2>&1 | grep -E "^(FAIL|TIMED)" | cut -c1-240
done
el poll modes
for mode in 0 7; do
  echo "== JMO_POLL_MODE=$mode skewed T=8192 N=8192 E=32 zipf 2"
  JMO_POLL_MODE=$mode timeout 60 $LB $COMMON --ranks 2 --routing 1 --zipf 2.0 --tokens 8192 --experts 32 --k-dim 2048 --n-dim 8192 \
    --model $M --consumers 0 --sweep-consumers 8 2>&1 | grep -E "^(FAIL|TIMED|TIMELINE)" | cut -c1-400
done
el skew
timeout 60 /tmp/push_probe --mib 256 --reps 5 2>&1 > $OUT/push_probe.txt; grep -E "C=16|memcpy" $OUT/push_probe.txt
el probe
python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not racecheck and not synccheck" > $OUT/pytest.log 2>&1
tail -2 $OUT/pytest.log; grep -E "^FAILED|^E  " $OUT/pytest.log | head -10
el tests
cd $OUT && tar -czf logs.tgz env.log build.log probe_build.log 2>/dev/null; rm -f env.log build.log probe_build.log; ls $OUT
