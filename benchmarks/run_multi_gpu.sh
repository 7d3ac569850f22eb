#!/usr/bin/env bash
# One device call on a machine with 2 or more GPUs, every step under its own time limit:
#   build (tests/gpu/build_gpu.sh) -> bench_links.py -> pytest tests/gpu -> examples/train_moe.py tokens/s, overlap vs
#   reference -> bench_ep_combine.py on all GPUs (expert_combine alone: ours, serialized, pinned C sweep, bare GEMM,
#   with the kernels' per-rank record of C, producer / consumer spans and push GB/s) -> bench_ep_layer.py on all GPUs
#   (a shape subset; ours, serialized, ideal, tokamax_ragged, xla_ragged).
#
#   bash benchmarks/run_multi_gpu.sh     (on the GPU machine; the tokamax wheels in .whl/ when the call carries them)
#
# Limits in seconds (0 skips a step): T_BUILD=150 T_LINKS=40 T_TESTS=120 T_TRAIN=45 (per impl) T_EP_COMBINE=120;
# bench_ep_layer, last, gets what is left of T_TOTAL=500 (at most T_EP=400): the whole script ends by about T_TOTAL.
# EP_SHAPES (a regex on "name skew"), EP_IMPLS, EP_ARGS (more bench_ep_layer flags), EPC_ARGS (bench_ep_combine flags),
# TESTS_K (pytest -k; '' runs every GPU test, racecheck/synccheck included), TRAIN_ARGS replace the defaults below.
# NCCL_NVLS_ENABLE=0 throughout: no NVLink multicast. A CPU dry run of the steps' plumbing (no build, no GPU tests;
# python3 with jax on PATH):
#   T_BUILD=0 T_TESTS=0 BENCH_PLATFORMS=cpu EP_ARGS=--quick EP_SHAPES=quick EPC_ARGS="--quick --ctas 4,8" \
#   TRAIN_ARGS="--steps 8 --log-every 1 --no-progress --plot=" bash benchmarks/run_multi_gpu.sh
# $OUT at the end (at most 8 files): summary.txt (what this prints, the links table included), env.log,
# ep_combine.jsonl, ep_layer.jsonl, ep_layer.log, pytest.log, train.log, logs.tgz (build.log, links.jsonl, the step
# logs not kept whole).
set -uo pipefail
export OUT=${OUT:-/tmp/jmo-multi-gpu-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
T_TOTAL=${T_TOTAL:-500} T_BUILD=${T_BUILD:-150} T_LINKS=${T_LINKS:-40} T_TESTS=${T_TESTS:-120} T_EP=${T_EP:-400}
T_TRAIN=${T_TRAIN:-45} T_EP_COMBINE=${T_EP_COMBINE:-120}
EPC_ARGS=${EPC_ARGS:---max-call-s 1}
EP_SHAPES=${EP_SHAPES:-'^seed T=8192 N=4096 E=8 (balanced|stress)$|^(mixtral|deepseek)-like balanced$'}
EP_IMPLS=${EP_IMPLS:-ours,serialized,ideal,tokamax_ragged,xla_ragged}
EP_ARGS=${EP_ARGS:---max-call-s 2}
TESTS_K=${TESTS_K-not racecheck and not synccheck}
TRAIN_ARGS=${TRAIN_ARGS:---steps 40 --layers 2 --d-model 1024 --heads 8 --d-ff 2048 --experts 8 --top-k 2 \
--batch-size 32 --seq-len 256 --dtype bfloat16 --eval-batches 1 --plot= --no-progress --log-every 1 --skip-check}
start=$(date +%s)
summary=$OUT/summary.txt
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }
since() { echo $(( $(date +%s) - start )); }
step() {  # name limit: prints the step's start; returns 1 if the step is to be skipped
  [ "$2" -gt 0 ] || { say "== $1: skipped (limit $2)"; return 1; }
  say "== $1 (limit $2 s) at $(since) s"
}
errors() {  # log: the lines that end a Python traceback, or say a process was stopped
  grep -E "^[A-Za-z_.]*(Error|Exception|Exit)\b|stopped by signal" "$1" | cut -c1-230 | tail -5 | tee -a "$summary"
}
bench_report() {  # log rc: a benchmark step's exit status, its markdown table (rows so far on timeout), its mesh and
  # consumer policy lines, errors
  say "rc $2$([ "$2" = 124 ] && echo ': out of time; the rows done by then:')"
  sed -n '/^| shape/,$p' "$1" | cut -c1-300 | tee -a "$summary"
  grep -E "^mesh|EXCLUDED|consumer policy" "$1" | cut -c1-230 | tee -a "$summary"
  errors "$1"
}

source benchmarks/tokamax_wheels.sh

# Build in a subshell under the limit (build_gpu.sh is sourced: its exports are captured and read back).
rm -f /tmp/jmo-build-env.sh
if step build "$T_BUILD"; then
  timeout "$T_BUILD" bash -c 'source tests/gpu/build_gpu.sh && export -p > /tmp/jmo-build-env.sh' 2>&1 |
    tee -a "$summary"
  if [ ! -s /tmp/jmo-build-env.sh ]; then say "build failed or ran out of time: see build.log"; fi
fi
[ -s /tmp/jmo-build-env.sh ] && source /tmp/jmo-build-env.sh
# PYTHONPATH and PYTHONSAFEPATH come from the build's environment: the installed package first (build_gpu.sh).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
# The benchmarks run on the GPUs alone (BENCH_PLATFORMS=cpu: a dry run of this script on a CPU machine); the tests
# keep build_gpu.sh's cuda,cpu.
bench_env=(env JAX_PLATFORMS="${BENCH_PLATFORMS:-cuda}")

if step links "$T_LINKS"; then
  timeout "$T_LINKS" "${bench_env[@]}" python3 -m benchmarks.bench_links --out "$OUT/links.jsonl" \
    > "$OUT/links.log" 2>&1
  say "rc $?"
  grep "^bench_links" "$OUT/links.log" | tee -a "$summary"
  errors "$OUT/links.log"
  sed -n '/^| kind/,$p' "$OUT/links.log" | tee -a "$summary"
fi

if step "pytest tests/gpu" "$T_TESTS"; then
  timeout "$T_TESTS" python3 -m pytest -q -rs -p no:cacheprovider tests/gpu ${TESTS_K:+-k "$TESTS_K"} \
    > "$OUT/pytest.log" 2>&1
  say "rc $?"
  grep -E "FAILED|ERROR|SKIPPED|passed|failed" "$OUT/pytest.log" | cut -c1-300 | tail -25 | tee -a "$summary"
fi

median_tok_s() {  # log: the median tokens/s of its per-step lines after the first 5 (compilation, warm-up)
  grep -o 'tokens/s [0-9,]*' "$1" | tail -n +6 | tr -d , | awk '{print $2}' | sort -n |
    awk '{v[NR] = $1} END {print NR ? v[int((NR + 1) / 2)] " (median of " NR " steps)" : "n/a"}'
}
for impl in overlap reference; do
  step "train_moe --impl $impl" "$T_TRAIN" || continue
  # TRAIN_ARGS is split on spaces (flags and numbers only).
  timeout "$T_TRAIN" "${bench_env[@]}" python3 examples/train_moe.py --impl $impl $TRAIN_ARGS \
    > "$OUT/train_$impl.log" 2>&1
  say "rc $?: tokens/s $(median_tok_s "$OUT/train_$impl.log")"
  grep -E "devices \||^step [0-9]+: train" "$OUT/train_$impl.log" | cut -c1-230 | tee -a "$summary"
  errors "$OUT/train_$impl.log"
  { echo "== $impl"; cat "$OUT/train_$impl.log"; } >> "$OUT/train.log"
done

# expert_combine alone, with the kernels' per-rank record (EPC_ARGS split on spaces: flags and numbers only). On
# timeout's SIGTERM it still writes its rows so far.
if step "bench_ep_combine" "$T_EP_COMBINE"; then
  timeout -k 10 "$T_EP_COMBINE" "${bench_env[@]}" python3 -m benchmarks.bench_ep_combine $EPC_ARGS \
    --out "$OUT/ep_combine.jsonl" > "$OUT/ep_combine.log" 2>&1
  bench_report "$OUT/ep_combine.log" $?
fi

# Last, with what is left of T_TOTAL: the one open-ended step. On timeout's SIGTERM it still writes its rows so far.
ep_limit=$(( T_TOTAL - $(since) - 15 ))
ep_limit=$(( ep_limit < T_EP ? ep_limit : T_EP ))
if step "bench_ep_layer" "$ep_limit"; then
  # EP_ARGS is split on spaces (flags and numbers only); EP_SHAPES stays one argument.
  timeout -k 10 "$ep_limit" "${bench_env[@]}" python3 -m benchmarks.bench_ep_layer --shapes "$EP_SHAPES" \
    --impls "$EP_IMPLS" $EP_ARGS --out "$OUT/ep_layer.jsonl" > "$OUT/ep_layer.log" 2>&1
  bench_report "$OUT/ep_layer.log" $?
fi

say "== done at $(since) s"
keep="summary.txt env.log ep_combine.jsonl ep_layer.jsonl ep_layer.log pytest.log train.log"
(
  cd "$OUT" || exit 1
  rest=$(ls -A | grep -v -x -F "$(printf '%s\n' $keep)")
  [ -z "$rest" ] || { tar czf logs.tgz $rest && rm -rf $rest; }
)
ls "$OUT"
