#!/usr/bin/env bash
# Builds the CUDA extension and the tools (the loopback harness) on a GPU machine, then runs the GPU tests.
#
#   bash tests/gpu/run_device.sh [pytest args...]
# Logs go to $OUT (the device tool's output folder) or /tmp/jmo-gpu-out. Uses the machine's python3 (jax with CUDA,
# flax, nanobind, cmake, nvcc, cuda-python); builds into build/gpu and build/tools and puts the extension and the
# loopback runner next to their sources, so nothing is pip-installed.
set -uo pipefail
OUT=${OUT:-/tmp/jmo-gpu-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
source tests/gpu/build_gpu.sh || exit 1
python3 -m pytest -v -s -rs -p no:cacheprovider tests/gpu "$@" > "$OUT/pytest.log" 2>&1
rc=$?
grep -E "^(PASS|FAIL) |  |loopback: |ERROR SUMMARY|^tests/gpu|PASSED|FAILED|SKIPPED|passed|failed|^(balanced|skewed|empty)|^\{|Error" \
  "$OUT/pytest.log" | cut -c1-400 | tail -80
exit $rc
