#!/usr/bin/env bash
# Call 1 (session 4): wip/next on one H200: GPU tests (with racecheck/synccheck), fused + layer quick, consumer ring sweep.
set -uo pipefail
S=$(date +%s)
mkdir -p /tmp/snap && tar -xf .snap/head.tar -C /tmp/snap && cp -r $PWD/.whl /tmp/snap/ && cd /tmp/snap
T_TESTS=240 T_LAYER=80 T_FUSED=60 T_GEMM=0 T_CONSUMER=0 bash benchmarks/run_device_suite.sh 2>&1 | tee $OUT/suite.txt | tail -60
echo "elapsed $(( $(date +%s) - S )) s"
export PYTHONPATH=$PWD:/tmp/site JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
for cfg in "12 4" "24 4" "24 16" "12 16"; do
  set -- $cfg
  echo "== consumer slots=$1 lag=$2"
  JMO_PUSH_SLOTS=$1 JMO_PUSH_READ_LAG=$2 timeout 40 python3 benchmarks/bench_consumer.py --ctas 1,4,16 --segment-kib 1024 --reps 5 \
     --out $OUT/consumer_s$1_l$2.jsonl 2>&1 | grep -E "^\||rror" | cut -c1-160
  [ $(( $(date +%s) - S )) -gt 520 ] && break
done
echo "elapsed $(( $(date +%s) - S )) s"
cd $OUT && tar -czf logs.tgz *.log *.jsonl 2>/dev/null; ls $OUT
