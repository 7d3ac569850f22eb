#!/usr/bin/env bash
# Builds the CUDA extension and the loopback harness on a GPU machine, then runs the GPU tests.
#
#   bash tests/gpu/run_device.sh [pytest args...]
# Logs go to $OUT (the device tool's output folder) or /tmp/jmo-gpu-out. Uses the machine's python3 (jax with CUDA,
# flax, nanobind, cmake, nvcc, cuda-python); builds into build/gpu and puts the extension next to the sources, so
# nothing is pip-installed.
set -uo pipefail
OUT=${OUT:-/tmp/jmo-gpu-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
  date -u
  nvidia-smi -L
  nvcc --version | tail -2
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
  python3 -c "import cuda.bindings; print('cuda.bindings', cuda.bindings.__version__)"
} 2>&1 | tee "$OUT/env.log"
t0=$(date +%s)
if ! { cmake -S . -B build/gpu -DPython_EXECUTABLE="$(command -v python3)" -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" \
       && cmake --build build/gpu -j"$(nproc)"; } > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  exit 1
fi
echo "build: $(( $(date +%s) - t0 )) s"
cp build/gpu/_jmo*.so jax_moe_overlap/
export JMO_LOOPBACK_BIN=$PWD/build/gpu/ffi/cuda/jmo_loopback PYTHONPATH=$PWD JAX_PLATFORMS=cuda,cpu PYTHONUNBUFFERED=1
export CUDA_DEVICE_MAX_CONNECTIONS=32
python3 -m pytest -v -s -rs -p no:cacheprovider tests/gpu "$@" > "$OUT/pytest.log" 2>&1
rc=$?
grep -E "^(PASS|FAIL) |  |loopback: |ERROR SUMMARY|^tests/gpu|PASSED|FAILED|SKIPPED|passed|failed|^(balanced|skewed|empty)|^\{|Error" \
  "$OUT/pytest.log" | cut -c1-400 | tail -80
exit $rc
