# The start of a script for one device call (benchmarks/run_dispatch_gemm.sh, run_fp8_overlap.sh), sourced from the
# repository root with $OUT set: the output folder made, everything printed also written to $OUT/summary.txt,
# `el NAME` printing the seconds since the start, then the build (tests/gpu/build_gpu.sh: the package installed, the
# tools built; with JMO_PREBUILT=out/prebuilt carried, tools/prebuild.sh's builds of the same sources instead). Returns
# 1 if the build fails.
mkdir -p "$OUT"
exec > >(tee "$OUT/summary.txt") 2>&1
S=$(date +%s)
el() { echo "== elapsed $(( $(date +%s) - S )) s: $*"; }
source tests/gpu/build_gpu.sh || return 1
el build
export CUDA_DEVICE_MAX_CONNECTIONS=32
