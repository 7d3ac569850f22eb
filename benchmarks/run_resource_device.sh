#!/usr/bin/env bash
# The resource-manager measurements on one GPU, in one go (target: <= 6 minutes on an H200):
#   build (as tests/gpu/run_device.sh) -> GPU tests of the manager/serialized mode -> calibrate -> bench_consumer
#   -> bench_resource (the oracle sweep, using the calibration just measured); the last three drive the loopback
#   harness (tools/loopback).
#
#   bash benchmarks/run_resource_device.sh            # everything under $OUT (default /tmp/jmo-resource-out)
#   QUICK=1 bash benchmarks/run_resource_device.sh    # 4 workloads instead of 12
# Outputs: env.log build.log pytest.log calibration/<gpu>.json calibrate.log consumer.{txt,jsonl} resource.{txt,jsonl}
# loopback.log (every harness command and its full output). Commit calibration/<gpu>.json to
# jax_moe_overlap/calibration/ to make the module use the model on that GPU.
set -uo pipefail
OUT=${OUT:-/tmp/jmo-resource-out}
mkdir -p "$OUT/calibration"
cd "$(dirname "$0")/.."
source tests/gpu/build_gpu.sh || exit 1
rc=0
step() { echo "== $1: $(( $(date +%s) - t0 )) s since start"; }

step "GPU tests (tests/gpu/test_gpu_resource.py)"
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_gpu_resource.py > "$OUT/pytest.log" 2>&1 || rc=1
tail -3 "$OUT/pytest.log"

step "calibrate"
timeout 240 python3 -m benchmarks.calibrate --out "$OUT/calibration" --reps 5 --log "$OUT/loopback.log" \
  2>&1 | tee "$OUT/calibrate.log"
CAL=$(ls "$OUT"/calibration/*.json 2>/dev/null | head -1)
if [ -z "$CAL" ]; then echo "calibration failed: see $OUT/calibrate.log"; exit 1; fi

step "bench_consumer"
timeout 240 python3 -m benchmarks.bench_consumer --reps 10 --out "$OUT/consumer.jsonl" --log "$OUT/loopback.log" \
  2>&1 | tee "$OUT/consumer.txt" || rc=1

step "bench_resource"
timeout 420 python3 -m benchmarks.bench_resource --calibration "$CAL" --reps "${REPS:-5}" ${QUICK:+--quick} \
  --out "$OUT/resource.jsonl" --log "$OUT/loopback.log" 2>&1 | tee "$OUT/resource.txt" || rc=1
step "done (rc=$rc)"
exit $rc
