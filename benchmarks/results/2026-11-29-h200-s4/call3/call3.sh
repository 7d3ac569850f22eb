#!/usr/bin/env bash
# Call 3 (session 4): CombineKernel rewrite + issuers: GPU tests, push probe, fused EP=1, consumer by issuers, ncu kernel times.
set -uo pipefail
S=$(date +%s)
mkdir -p /tmp/snap && tar -xf .snap/head.tar -C /tmp/snap && cp -r $PWD/.whl $PWD/.snap /tmp/snap/ && cd /tmp/snap
(nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -I ffi -o /tmp/push_probe ffi/cuda/push_probe.cu > $OUT/probe_build.log 2>&1) &
bash tests/gpu/run_device.sh -k "not racecheck and not synccheck" 2>&1 | tail -6
wait
echo "elapsed $(( $(date +%s) - S )) s"
cp $OUT/pytest.log /tmp/pytest.log
source tests/gpu/build_gpu.sh > /dev/null 2>&1
export JAX_PLATFORMS=cuda
timeout 60 /tmp/push_probe --mib 256 --reps 5 2>&1 | tee $OUT/push_probe.txt
echo "elapsed $(( $(date +%s) - S )) s"
timeout 60 python3 benchmarks/bench_fused.py --quick --skews balanced --shapes E=8 --impls "ours,serialized,bare+combine,bare gemm" --out $OUT/fused.jsonl 2>&1 | grep -E "^\||shape=" | cut -c1-170
for W in 1 4 8; do
  echo "== consumer issuers=$W"
  JMO_PUSH_ISSUERS=$W timeout 40 python3 benchmarks/bench_consumer.py --ctas 1,4,16 --segment-kib 1024 --reps 5 --out $OUT/consumer_w$W.jsonl 2>&1 | grep -E "^\||rror" | cut -c1-160
done
echo "elapsed $(( $(date +%s) - S )) s"
timeout 60 ncu --clock-control none --metrics gpu__time_duration.sum --csv python3 benchmarks/bench_fused.py --quick --skews balanced --shapes E=8 --impls ours --profile 2 --out /tmp/f.jsonl > /tmp/ncu_ours.csv 2>/dev/null
python3 .snap/ncu_tail.py /tmp/ncu_ours.csv 6
echo "elapsed $(( $(date +%s) - S )) s"
cd $OUT && tar -czf logs.tgz env.log build.log probe_build.log 2>/dev/null; rm -f env.log build.log probe_build.log; ls $OUT
