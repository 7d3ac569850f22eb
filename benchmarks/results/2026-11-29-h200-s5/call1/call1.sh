#!/usr/bin/env bash
# Call 1 (session 5), one H200: GPU tests; where the fused EP=1 wall time goes (jax.profiler trace); per-rank device
# timelines of a skewed loopback workload (why skewed producers took 40-80 ms); bulk-copy probe (loads / stores alone,
# ring depth, chunk size); calibration with the 4-issuer consumer.
set -uo pipefail
S=$(date +%s)
el() { echo "== elapsed $(( $(date +%s) - S )) s: $*"; }
(nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -I ffi -o /tmp/push_probe ffi/cuda/push_probe.cu > $OUT/probe_build.log 2>&1) &
source tests/gpu/build_gpu.sh || exit 1
wait
el build
LB=build/gpu/ffi/cuda/jmo_loopback
M=$(python3 -c "
import json; p=json.load(open('jax_moe_overlap/calibration/nvidia_h200.json'))
print(','.join(str(float(p[k])) for k in ['sms','ctas_per_sm','tile_m','tile_n','tile_us_base','tile_us_per_k','cta_gbps','link_gbps','seg_us']))")
for wl in "8192 8192 32 1 2.0" "8192 4096 8 0 0" "16384 4096 8 1 2.0"; do
  set -- $wl
  for R in 2 1; do
    echo "== loopback R=$R tokens=$1 N=$2 E=$3 routing=$4 zipf=$5"
    timeout 60 $LB --ranks $R --tokens $1 --top-k 2 --experts $3 --d-model 64 --k-dim 2048 --n-dim $2 --iters 1 \
      --datasets 1 --check-tokens 16 --model $M --time --per-call-stats --warmup 1 --reps 3 --timeout-ms 60000 \
      --routing $4 --zipf $5 --consumers 0 --sweep-consumers 4,8 2>&1 | grep -E "^(PASS|FAIL|TIMED|TIMELINE)" | cut -c1-700
  done
done
el loopback
timeout 45 /tmp/push_probe --mib 256 --reps 5 2>&1 | tee $OUT/push_probe.txt
el probe
timeout 100 python3 benchmarks/bench_fused.py --quick --skews balanced --shapes E=8 --impls "ours,serialized,bare gemm" \
  --trace 10 --out $OUT/fused.jsonl 2>&1 | grep -vE "^(WARNING|I0000|E0000|W0000)" | cut -c1-200 | tail -60
el fused
python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not racecheck and not synccheck" > $OUT/pytest.log 2>&1
tail -3 $OUT/pytest.log; grep -E "FAILED|Error" $OUT/pytest.log | head -10
el tests
timeout $(( 570 - ($(date +%s) - S) )) python3 benchmarks/calibrate.py --out $OUT/nvidia_h200.json --reps 3 --log $OUT/calibrate.log 2>&1 | tail -15
el calibrate
cd $OUT && tar -czf logs.tgz env.log build.log probe_build.log calibrate.log 2>/dev/null; rm -f env.log build.log probe_build.log calibrate.log; ls $OUT
