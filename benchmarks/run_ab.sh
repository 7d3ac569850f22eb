#!/usr/bin/env bash
# A/B check of a change that must not change the kernels' speed (a refactor, a move), in one device call:
# builds this checkout ("new") and an older tree ("base", e.g. `git archive <commit> | tar -x -C .ab_base`, carried
# to the GPU machine) side by side, compares every kernel's registers, stack, shared memory and spills in the two
# extensions and loopback runners (cuobjdump -res-usage, every architecture), then times both trees' benchmarks in
# the order base, new, base, new.
#
#   AB_BASE=.ab_base bash benchmarks/run_ab.sh
# With JMO_PREBUILT=out/prebuilt set, each tree takes its own out/prebuilt where that holds builds of its sources
# (tests/gpu/build_gpu.sh), so neither builds on the device: `bash tools/prebuild.sh` here and, for a base tree whose
# tools/prebuild.sh gzips (both fit one call's carry), `(cd .ab_base && PYTHON=$PWD/../.venv/bin/python bash
# tools/prebuild.sh)`; carry ["out/prebuilt", ".ab_base/out/prebuilt"] (the base's own .gitignore ignores its out/).
# Steps and their limits (seconds): AB_TESTS (the new tree's GPU tests against its installed package, before the
# timings; 0, the default, skips them; AB_TESTS_K their -k expression), AB_BITS (tools/ab_outputs.py: the GEMM,
# SwiGLU and FP8 quantizer kernels' outputs on fixed inputs under each tree's package, compared element by element;
# 0, the default, skips), AB_LAYER (bench_layer, each run, with AB_LAYER_ARGS, default --quick; 0 skips), AB_DG (the
# loopback suite dispatch-gemm-time, each run; 0 skips), AB_CMD (a command of your own, each run, limit AB_CMD_LIMIT,
# default 300; its lines matching the regex AB_CMD_GREP, default "ms", kept; unset skips), AB_ROUNDS (rounds of base,
# new; default 2). Logs and tables in $OUT: resource_usage.diff (empty when the kernels match), ab_bits.txt,
# ab_layer.txt, ab_dg.txt, ab_cmd.txt, and each run's log. E.g. a kernel's own bench:
#   AB_BASE=.ab_base AB_LAYER=0 AB_DG=0 AB_CMD="python3 -m benchmarks.bench_gemm1_swiglu_fp8" bash benchmarks/run_ab.sh
set -uo pipefail
export OUT=${OUT:-/tmp/jmo-ab-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
NEW=$PWD
BASE=$(cd "${AB_BASE:?set AB_BASE to the older tree}" && pwd)
AB_LAYER=${AB_LAYER:-90} AB_DG=${AB_DG:-150} AB_ROUNDS=${AB_ROUNDS:-2} AB_TESTS=${AB_TESTS:-0} AB_BITS=${AB_BITS:-0}
AB_LAYER_ARGS=${AB_LAYER_ARGS:---quick}
AB_CMD=${AB_CMD:-} AB_CMD_LIMIT=${AB_CMD_LIMIT:-300} AB_CMD_GREP=${AB_CMD_GREP:-ms}
S=$(date +%s)
el() { echo "== elapsed $(( $(date +%s) - S )) s: $*"; }

# Both builds at once, each in its own pip target; tests/gpu/build_gpu.sh of each tree builds it as that tree
# expects (its own paths), and leaves its loopback runner beside that tree's tools/loopback/*.py.
build() {  # tree site out
  mkdir -p "$3"
  (cd "$1" && OUT=$3 JMO_SITE=$2 bash -c 'source tests/gpu/build_gpu.sh') > "$3/build_driver.log" 2>&1
}
build "$BASE" /tmp/jmo-site-base "$OUT/base" & b=$!
build "$NEW" /tmp/jmo-site-new "$OUT/new" & n=$!
wait $b; rb=$?; wait $n; rn=$?
el "builds (base rc $rb, new rc $rn)"
if [ $rb != 0 ] || [ $rn != 0 ]; then tail -n 30 "$OUT"/base/build_driver.log "$OUT"/new/build_driver.log; exit 1; fi

# Resource usage per (binary, architecture, kernel): cuobjdump prints a "Function <mangled>:" line, then a
# "REG:.. STACK:.. SHARED:.. LOCAL:.. ..." line, inside "arch = sm_XX" sections.
usage() {  # binary -> sorted "arch kernel usage" lines
  cuobjdump -res-usage "$1" 2>/dev/null | awk '
    /arch = /{for(i=1;i<=NF;i++) if($i=="=") arch=$(i+1)}
    /Function /{fn=$2; sub(/:$/,"",fn)}
    /REG:/{line=$0; gsub(/^[ \t]+/,"",line); print arch, fn, line}' | sort -u
}
for side in base new; do
  site=/tmp/jmo-site-$side; tree=$BASE; [ $side = new ] && tree=$NEW
  { usage "$(ls $site/jax_moe_overlap/_jmo*.so)"; usage "$(ls $tree/tools/loopback/_jmo_loopback*.so)"; } \
    > "$OUT/resource_usage_$side.txt"
done
diff "$OUT/resource_usage_base.txt" "$OUT/resource_usage_new.txt" > "$OUT/resource_usage.diff"
echo "kernels (arch x function): base $(wc -l < "$OUT/resource_usage_base.txt"), new $(wc -l < "$OUT/resource_usage_new.txt");" \
  "differing lines: $(grep -c '^[<>]' "$OUT/resource_usage.diff")"
grep '^[<>]' "$OUT/resource_usage.diff" | cut -c1-220 | head -8
grep -E "LOCAL:[1-9]" "$OUT/resource_usage_new.txt" | cut -c1-200 | head -5
el "resource usage"

export JAX_PLATFORMS=cuda,cpu PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 CUDA_DEVICE_MAX_CONNECTIONS=32
run_in() {  # side limit log cmd...: runs cmd in that side's tree against its installed package
  local side=$1 limit=$2 log=$3; shift 3
  local tree=$BASE; [ "$side" = new ] && tree=$NEW
  (cd "$tree" && PYTHONPATH="/tmp/jmo-site-$side:$tree:$tree/examples:/tmp/site" timeout "$limit" "$@") > "$log" 2>&1
  echo "$side rc $?"
}
if [ "$AB_TESTS" != 0 ]; then
  (cd /tmp && JMO_SITE=/tmp/jmo-site-new PYTHONPATH="/tmp/jmo-site-new:$NEW:$NEW/examples:/tmp/site" timeout "$AB_TESTS" python3 -m pytest -q -rs \
    -p no:cacheprovider "$NEW/tests/gpu" -k "${AB_TESTS_K:-not racecheck and not synccheck}") > "$OUT/gpu_tests.log" 2>&1
  echo "GPU tests rc $?: $(tail -n 1 "$OUT/gpu_tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | cut -c1-200 | head -10
  el "GPU tests"
fi
if [ "$AB_BITS" != 0 ]; then
  for side in base new; do
    (cd /tmp && PYTHONPATH="/tmp/jmo-site-$side:/tmp/site" timeout "$AB_BITS" python3 "$NEW/tools/ab_outputs.py" dump \
      "$OUT/bits_$side.npz") > "$OUT/bits_$side.log" 2>&1
    echo "bits $side rc $?: $(tail -n 1 "$OUT/bits_$side.log" | cut -c1-160)"
  done
  python3 "$NEW/tools/ab_outputs.py" compare "$OUT/bits_base.npz" "$OUT/bits_new.npz" > "$OUT/ab_bits.txt" 2>&1
  echo "bits compared, rc $? (0: every output the same bits; 2: one differs; 3: one in one dump only)"
  cat "$OUT/ab_bits.txt"
  rm -f "$OUT"/bits_*.npz
  el "bits"
fi
for r in $(seq 1 "$AB_ROUNDS"); do
  for side in base new; do
    if [ "$AB_LAYER" != 0 ]; then
      run_in $side "$AB_LAYER" "$OUT/layer_${side}_$r.log" python3 -m benchmarks.bench_layer $AB_LAYER_ARGS \
        --out "$OUT/layer_${side}_$r.jsonl"
      grep -E "shape=" "$OUT/layer_${side}_$r.log" | sed "s/^/$side $r /" | cut -c1-200 >> "$OUT/ab_layer.txt"
    fi
    if [ "$AB_DG" != 0 ]; then
      run_in $side "$AB_DG" "$OUT/dg_${side}_$r.log" python3 -m tools.loopback.run --suite dispatch-gemm-time
      # Each case's line, less its checks and timeline: the case, then "two calls .. us, .. dispatch_gemm .. us".
      grep -E "^(PASS|FAIL)|cases passed" "$OUT/dg_${side}_$r.log" \
        | sed -E 's/^(PASS|FAIL) ([^|]*)\|.*per call: ([^|]*).*/\1 \2| \3/' | sed "s/^/$side $r /" | cut -c1-220 \
        >> "$OUT/ab_dg.txt"
    fi
    if [ -n "$AB_CMD" ]; then
      run_in $side "$AB_CMD_LIMIT" "$OUT/cmd_${side}_$r.log" bash -c "$AB_CMD"
      grep -E "$AB_CMD_GREP" "$OUT/cmd_${side}_$r.log" | sed "s/^/$side $r /" | cut -c1-220 >> "$OUT/ab_cmd.txt"
    fi
    el "round $r $side"
  done
done
cat "$OUT/ab_layer.txt" 2>/dev/null
cat "$OUT/ab_dg.txt" 2>/dev/null
cat "$OUT/ab_cmd.txt" 2>/dev/null
