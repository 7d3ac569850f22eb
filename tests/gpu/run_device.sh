#!/usr/bin/env bash
# Installs the package with its CUDA kernels and builds the tools (the loopback harness) on a GPU machine, then runs
# the GPU tests against the installed package, from outside the checkout.
#
#   bash tests/gpu/run_device.sh [pytest args...]
# Logs go to $OUT (the device tool's output folder) or /tmp/jmo-gpu-out. Uses the machine's python3 (jax with CUDA,
# flax, scikit-build-core, nanobind, cmake, nvcc, cuda-python); pip-installs into $JMO_SITE (tests/gpu/build_gpu.sh).
set -uo pipefail
OUT=${OUT:-/tmp/jmo-gpu-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
source tests/gpu/build_gpu.sh || exit 1
REPO=$PWD
(cd /tmp && python3 -m pytest -v -s -rs -p no:cacheprovider "$REPO/tests/gpu" "$@") > "$OUT/pytest.log" 2>&1
rc=$?
grep -E "^(PASS|FAIL) |  |loopback: |ERROR SUMMARY|^tests/gpu|PASSED|FAILED|SKIPPED|passed|failed|^(balanced|skewed|empty)|^\{|Error" \
  "$OUT/pytest.log" | cut -c1-400 | tail -80
exit $rc
