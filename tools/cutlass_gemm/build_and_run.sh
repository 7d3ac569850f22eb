#!/usr/bin/env bash
# Build the CUTLASS grouped-GEMM probe for sm_90a and run it.
#   build_and_run.sh <builddir> [sanitize]
# sanitize: run the smallest case only, under compute-sanitizer memcheck.
# Env: CUTLASS_DIR  a CUTLASS root containing include/cutlass/cutlass.h (a repo checkout, or the
#                   wheel's cutlass_library/source); otherwise searched in /tmp/site (the wheel
#                   installed with pip --target), the python site-packages, /tmp/cutlass.
#      SKIP_BUILD=1 reuse an existing <builddir>/cutlass_probe.
#      PROBE_ARGS   extra arguments for the probe (e.g. "--only bal8").
#      NVCC_EXTRA   extra nvcc flags (e.g. "-DCGG_TILE_N=128 -DCGG_CLUSTER_N=1" for tuning).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BUILD="${1:?usage: build_and_run.sh <builddir> [sanitize]}"
MODE="${2:-}"
mkdir -p "$BUILD"
BUILD="$(cd "$BUILD" && pwd)"

find_cutlass() {
  local c
  for c in "${CUTLASS_DIR:-}" "${CUTLASS_DIR:+$CUTLASS_DIR/cutlass_library/source}" \
           /tmp/site/cutlass_library/source \
           "$(python3 -c 'import os, cutlass_library as c; print(os.path.join(os.path.dirname(c.__file__), "source"))' 2>/dev/null || true)" \
           /tmp/cutlass/cutlass_library/source; do
    if [[ -n "$c" && -f "$c/include/cutlass/cutlass.h" ]]; then echo "$c"; return 0; fi
  done
  return 1
}

if [[ "${SKIP_BUILD:-0}" != "1" ]]; then
  if ! CUTLASS_ROOT="$(find_cutlass)"; then
    WHL="$(ls "$REPO"/.whl/nvidia_cutlass*.whl 2>/dev/null | head -n1 || true)"
    if [[ -n "$WHL" ]]; then
      echo "CUTLASS headers not found; installing $WHL into /tmp/site"
      python3 -m pip install -q --no-deps --target /tmp/site "$WHL" ||
        (mkdir -p /tmp/site && cd /tmp/site && python3 -m zipfile -e "$WHL" .)
    fi
    CUTLASS_ROOT="$(find_cutlass)" || {
      echo "ERROR: CUTLASS headers not found (set CUTLASS_DIR, or install nvidia-cutlass==4.2.0.0 with"
      echo "       python3 -m pip install --no-deps --target /tmp/site nvidia_cutlass-4.2.0.0-py3-none-any.whl)"
      exit 2
    }
  fi
  echo "CUTLASS headers: $CUTLASS_ROOT/include (+ tools/util/include)"
  NVCC="${NVCC:-nvcc}"
  "$NVCC" --version | tail -n 2
  FLAGS=(-gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -DNDEBUG
         -I"$CUTLASS_ROOT/include" -I"$CUTLASS_ROOT/tools/util/include" -I"$HERE" ${NVCC_EXTRA:-})

  secs_since() { local now; now=$(date +%s%N); printf '%d.%03d' $(( (now - $1) / 1000000000 )) $(( (now - $1) / 1000000 % 1000 )); }
  t0=$(date +%s%N)
  pids=()
  for src in cutlass_grouped_gemm cutlass_grouped_outer cutlass_probe; do
    (
      s=$(date +%s%N)
      "$NVCC" "${FLAGS[@]}" -c "$HERE/$src.cu" -o "$BUILD/$src.o"
      echo "compiled $src.cu in $(secs_since "$s") s"
    ) &
    pids+=($!)
  done
  fail=0
  for p in "${pids[@]}"; do wait "$p" || fail=1; done
  [[ $fail == 0 ]] || { echo "ERROR: compilation failed"; exit 2; }
  "$NVCC" -gencode=arch=compute_90a,code=sm_90a -o "$BUILD/cutlass_probe" \
    "$BUILD/cutlass_probe.o" "$BUILD/cutlass_grouped_gemm.o" "$BUILD/cutlass_grouped_outer.o"
  echo "compile time (wall, $(nproc) cores, 3 TUs in parallel): $(secs_since "$t0") s"
  echo "binary: $BUILD/cutlass_probe ($(stat -c %s "$BUILD/cutlass_probe") bytes)"
fi

[[ -x "$BUILD/cutlass_probe" ]] || { echo "ERROR: $BUILD/cutlass_probe missing"; exit 2; }
if [[ "$MODE" == "sanitize" ]]; then
  SAN="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
  set -x
  exec "$SAN" --tool memcheck --error-exitcode 4 "$BUILD/cutlass_probe" --only small1 --warmup 1 --iters 2 --timeout 300 ${PROBE_ARGS:-}
else
  set -x
  exec "$BUILD/cutlass_probe" ${PROBE_ARGS:-}
fi
