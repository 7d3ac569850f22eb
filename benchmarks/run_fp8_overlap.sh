#!/usr/bin/env bash
# The FP8 layer's overlapped operators on one Hopper GPU: its returns (expert_combine on e4m3 operands: GEMM2 and its
# way back, dx = da W1^T and its way back) and its dispatches (dispatch_gemm on packed e4m3 rows: x's with GEMM1, dy's
# with dh = dy W2^T), in three device calls of up to 9 minutes each (the default, FP8_ONLY_TIME=1, FP8_ONLY_TIME=2):
#   build (tests/gpu/build_gpu.sh) -> the GPU tests, -k fp8: the FP8 producer (test_gpu_expert_combine.py against
#   float64, test_gpu_loopback.py: the loopback suite combine-fp8), dispatch_gemm's FP8 kernel
#   (test_gpu_dispatch_gemm_fp8.py: bitwise dispatch + unpack + the FP8 grouped GEMMs, and the layer with it), two
#   processes sharing the GPU (test_gpu_multiprocess.py: the fused returns, then the fused dispatches too), the layer
#   as shipped (test_gpu_fp8_overlap.py, the fused returns where there are two GPUs) -> memcheck on one loopback rank;
#   then bench_fused's FP8 rows at EP = 1 (the producer against grouped_matmul_fp8 + XLA's combine and alone, beside
#   bf16's) -> the loopback suite combine-time-fp8 (R = 2, 4, 8 over the emulated NVLink against the serialized form
#   and GEMM2 alone: the overlap table) and combine-time for the bf16 rows of the same run, then the FP8 producer's C
#   swept on one case.
#
#   bash benchmarks/run_fp8_overlap.sh     ($OUT: summary.txt, pytest.log, memcheck.txt, memcheck-dg.txt)
#   FP8_ONLY_TIME=1 bash benchmarks/run_fp8_overlap.sh     (fused.log, time-fp8.txt, time-bf16.txt, sweep-fp8.txt)
#   FP8_ONLY_TIME=2 bash benchmarks/run_fp8_overlap.sh     (dg-time-fp8.txt, dg-time-bf16.txt)
#   FP8_ONLY_TIME=3 bash benchmarks/run_fp8_overlap.sh     (dg-time-fp8.txt, time-fp8.txt, sweep-fp8.txt: the FP8
#                                                           tables alone, one call for both)
#   FP8_ONLY_TIME=4 bash benchmarks/run_fp8_overlap.sh     (dg-shapes-fp8.txt, dg-shapes-bf16.txt: the fused
#                                                           dispatch's training forward at the Mixtral- and
#                                                           DeepSeek-like shapes, FP8 with x_recv both ways, and bf16)
# The default call: build, the tests, memcheck (the FP8 producer; dispatch_gemm's FP8 kernel); FP8_ONLY_TIME=1:
# build, bench_fused and the two combine timing suites with the FP8 C sweep; FP8_ONLY_TIME=2: build and the two
# dispatch_gemm timing suites (dispatch-gemm-time-fp8, dispatch-gemm-time). Three device calls of up to 9 minutes.
set -uo pipefail
export OUT=${OUT:-/tmp/jmo-fp8-overlap-out}
export PYTHONUNBUFFERED=1  # (a step its timeout stops still leaves its log)
cd "$(dirname "$0")/.."
source benchmarks/device_call.sh || exit 1  # $OUT/summary.txt, `el`, the build
REPO=$PWD
# One loopback suite under a time limit: its log in $OUT/FILE, its rc, the lines of it that PATTERN picks (default
# the cases' results and the overlap table), the elapsed time. suite LIMIT SUITE FILE [PATTERN]
suite() {
  timeout "$1" python3 -m tools.loopback.run --suite "$2" > "$OUT/$3" 2>&1
  echo "$2 rc $?"; grep -E "${4:-^(PASS|FAIL)|^\||cases passed}" "$OUT/$3" | cut -c1-240
  el "$2"
}
if [ "${FP8_ONLY_TIME:-0}" = 0 ]; then
  (cd /tmp && timeout 300 python3 -m pytest -v -s -rs -p no:cacheprovider "$REPO/tests/gpu/test_gpu_expert_combine.py" \
    "$REPO/tests/gpu/test_gpu_loopback.py" "$REPO/tests/gpu/test_gpu_dispatch_gemm_fp8.py" \
    "$REPO/tests/gpu/test_gpu_multiprocess.py" "$REPO/tests/gpu/test_gpu_fp8_overlap.py" -k "fp8") \
    > "$OUT/pytest.log" 2>&1
  echo "pytest rc $?"
  grep -E "PASSED|FAILED|SKIPPED|passed|failed|Error|^R=" "$OUT/pytest.log" | cut -c1-240 | tail -30
  el tests
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ -n "$CS" ]; then
    timeout 60 "$CS" --tool memcheck --error-exitcode 99 python3 -m tools.loopback.run --ranks 1 --experts 4 \
      --tokens 96 --d-model 128 --k-dim 384 --n-dim 640 --fp8 --iters 2 > "$OUT/memcheck.txt" 2>&1
    echo "memcheck rc $?"; grep -E "SUMMARY|^(PASS|FAIL)" "$OUT/memcheck.txt" | cut -c1-240
    # dispatch_gemm's FP8 kernel (and the FP8 combine after it) on one rank, the training forward's results.
    timeout 60 "$CS" --tool memcheck --error-exitcode 99 python3 -m tools.loopback.run --ranks 1 --experts 4 \
      --tokens 96 --d-model 512 --k-dim 256 --n-dim 128 --fp8 --dispatch-gemm 1 --dispatch-gemm-mode train \
      --iters 2 > "$OUT/memcheck-dg.txt" 2>&1
    echo "memcheck dispatch_gemm fp8 rc $?"; grep -E "SUMMARY|^(PASS|FAIL)" "$OUT/memcheck-dg.txt" | cut -c1-240
    el memcheck
  fi
  exit 0
fi
if [ "${FP8_ONLY_TIME}" = 4 ]; then
  suite 240 dispatch-gemm-shapes-fp8 dg-shapes-fp8.txt "^FAIL|^\||cases passed"
  suite 150 dispatch-gemm-shapes dg-shapes-bf16.txt "^FAIL|^\||cases passed"
  exit 0
fi
if [ "${FP8_ONLY_TIME}" = 3 ]; then
  # Both FP8 overlaps' tables in one call (no bf16 rows beside them): dispatch-gemm-time-fp8, combine-time-fp8, then
  # the FP8 C sweep below.
  suite 270 dispatch-gemm-time-fp8 dg-time-fp8.txt
fi
if [ "${FP8_ONLY_TIME}" = 2 ]; then
  # The FP8 dispatch fused with GEMM1 against the dispatch then the FP8 GEMM1 (on the rows unpacked beforehand: the
  # two calls without their unpack), beside bf16's dispatch-gemm-time in the same run.
  suite 270 dispatch-gemm-time-fp8 dg-time-fp8.txt
  suite 200 dispatch-gemm-time dg-time-bf16.txt "^\||cases passed"
  exit 0
fi
if [ "${FP8_ONLY_TIME}" = 1 ]; then
  timeout 90 python3 -m benchmarks.bench_fused --quick --skews balanced \
    --impls "ours,bare+combine,bare gemm,ours fp8,bare fp8+combine,bare fp8 gemm" --out "$OUT/fused.jsonl" \
    > "$OUT/fused.log" 2>&1
  echo "bench_fused rc $?"; grep -E "^\|" "$OUT/fused.log" | cut -c1-200
  el bench_fused
fi
suite 150 combine-time-fp8 time-fp8.txt
if [ "${FP8_ONLY_TIME}" = 1 ]; then
  suite 120 combine-time time-bf16.txt "^\||cases passed"
fi
# The FP8 producer's consumer count: every pinned C (8: the fixed C, SMs / 8) against the model's (the calibration
# the library loads on this GPU, the bf16 engine's, with the e4m3 tile's K counted by Fp8ModelK: its regret) on the
# seed shape at R = 2 over the emulated link.
MODEL=$(python3 -c "import sys; from tools.loopback import cases, run
print(run.use_device_calibration(run.load_runner(), cases.Case()), file=sys.stderr)
print(','.join(map(str, cases.calibrated_model(2, 185.0))))")
timeout 60 python3 -m tools.loopback.run --fp8 --ranks 2 --experts 8 --tokens 4096 --d-model 256 --k-dim 2048 \
  --n-dim 2048 --link-gbps 185 --routing 0 --datasets 1 --iters 2 --check-tokens 64 --time --warmup 2 --reps 10 \
  --consumers 0 --model "$MODEL" --sweep-consumers 1,2,3,4,6,8,12 > "$OUT/sweep-fp8.txt" 2>&1
echo "FP8 C sweep rc $?"; grep -E "^(PASS|FAIL|TIMED)" "$OUT/sweep-fp8.txt" | cut -c1-240
el sweep-fp8
