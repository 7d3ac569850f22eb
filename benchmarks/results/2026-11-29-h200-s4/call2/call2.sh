#!/usr/bin/env bash
# Call 2 (session 4): ncu per-kernel times of expert_combine vs the bare GEMM at EP=1; detailed sections of both GEMM kernels; 12-workload oracle sweep R=2.
set -uo pipefail
S=$(date +%s)
mkdir -p /tmp/snap && tar -xf .snap/head.tar -C /tmp/snap && cp -r $PWD/.whl $PWD/.snap /tmp/snap/ && cd /tmp/snap
source tests/gpu/build_gpu.sh || exit 1
export JAX_PLATFORMS=cuda
F="benchmarks/bench_fused.py --quick --skews balanced --shapes E=8 --out /tmp/f.jsonl"
NCU="ncu --clock-control none"
for impl in ours "bare gemm" "bare+combine"; do
  tag=${impl// /_}; tag=${tag//+/_}
  timeout 100 $NCU --metrics gpu__time_duration.sum --csv python3 $F --impls "$impl" --profile 3 > $OUT/ncu_$tag.csv 2> $OUT/ncu_$tag.err
  echo "== ncu times: $impl (rc $?)"; python3 .snap/ncu_tail.py $OUT/ncu_$tag.csv 16
done
echo "elapsed $(( $(date +%s) - S )) s"
timeout 90 $NCU --set detailed -k regex:ExpertKernel --launch-skip 1 --launch-count 1 python3 $F --impls ours --profile 2 > $OUT/ncu_detail_ours.txt 2>&1
timeout 90 $NCU --set detailed -k regex:GroupedGemmKernel --launch-skip 1 --launch-count 1 python3 $F --impls "bare gemm" --profile 2 > $OUT/ncu_detail_bare.txt 2>&1
for f in ours bare; do echo "== detail $f"; grep -E "^  [a-zA-Z]|Duration|Throughput|Registers|Achieved Occupancy|Block Limit|Executed Ipc|Shared Memory Configuration Size|Dynamic Shared|Grid Size|Waves Per SM|L2 Hit|Mem Busy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued" $OUT/ncu_detail_$f.txt | head -45; done
echo "elapsed $(( $(date +%s) - S )) s"
timeout $(( 560 - ($(date +%s) - S) )) python3 benchmarks/bench_resource.py --calibration jax_moe_overlap/calibration/nvidia_h200.json --ranks 2 \
  --ctas 1,2,3,4,6,8,12,16 --reps 3 --out $OUT/resource.jsonl --log $OUT/loopback.log > $OUT/resource.txt 2>&1
echo "== resource (rc $?)"; grep -E "^\||regret|mean|worst|fixed" $OUT/resource.txt | cut -c1-200
echo "elapsed $(( $(date +%s) - S )) s"
cd $OUT && tar -czf logs.tgz *.err loopback.log build.log env.log 2>/dev/null; rm -f *.err loopback.log build.log env.log; ls $OUT
