#!/usr/bin/env bash
# One device call: build + GPU tests + the layer, fused, grouped-GEMM (and consumer) benchmarks, each step under its
# own time limit, logs in $OUT.
#
#   bash benchmarks/run_device_suite.sh        (on the GPU machine; tokamax wheels in .whl/ if present)
# Steps (seconds): GPU tests (build included) <= $T_TESTS, bench_layer <= $T_LAYER, bench_fused <= $T_FUSED,
# bench_grouped_gemm <= $T_GEMM. A step that runs out of time leaves its partial table in $OUT/<step>.log.
# bench_consumer <= $T_CONSUMER (0 by default: skipped). A limit of 0 skips a step; LAYER_ARGS / FUSED_ARGS /
# GEMM_ARGS / CONSUMER_ARGS replace a step's default arguments.
set -uo pipefail
OUT=${OUT:-/tmp/jmo-suite-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
T_TESTS=${T_TESTS:-150} T_LAYER=${T_LAYER:-75} T_FUSED=${T_FUSED:-50} T_GEMM=${T_GEMM:-80} T_CONSUMER=${T_CONSUMER:-0}
source benchmarks/tokamax_wheels.sh
[ "$T_TESTS" = 0 ] || timeout "$T_TESTS" bash tests/gpu/run_device.sh -k "not racecheck and not synccheck" 2>&1 | tail -25
# The package that run_device.sh installed (tests/gpu/build_gpu.sh), not the checkout's jax_moe_overlap/.
export PYTHONPATH=${JMO_SITE:-/tmp/jmo-site}:$PWD:/tmp/site PYTHONSAFEPATH=1 JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
# The GEMM engine every op selects on GPU 0 for bf16 GEMMs with K = 2048, N = 4096 (and GEMM1's fused SwiGLU).
python3 -c "from jax_moe_overlap import _jmo, workspace_cuda as w; cc = w.device_info(0).compute_capability; \
print('GPU', cc, '| gemm engine', _jmo.select_gemm_engine(cc, 'bfloat16', 2048, 4096), \
'| with the SwiGLU', _jmo.select_gemm_engine(cc, 'bfloat16', 2048, 4096, swiglu=True))"
run() {  # name limit cmd...
  local name=$1 limit=$2; shift 2
  [ "$limit" = 0 ] && return
  timeout "$limit" "$@" --out "$OUT/$name.jsonl" > "$OUT/$name.log" 2>&1
  echo "== $name (rc $?)"; grep -E "^\|" "$OUT/$name.log" | cut -c1-160
}
run layer "$T_LAYER" python3 -m benchmarks.bench_layer ${LAYER_ARGS:---quick}
run fused "$T_FUSED" python3 -m benchmarks.bench_fused ${FUSED_ARGS:---quick --skews balanced}
run gemm "$T_GEMM" python3 -m benchmarks.bench_grouped_gemm ${GEMM_ARGS:---quick --skews balanced}
run consumer "$T_CONSUMER" python3 -m benchmarks.bench_consumer ${CONSUMER_ARGS:-}
