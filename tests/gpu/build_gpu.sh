# Sourced by the GPU scripts (tests/gpu/run_device.sh, benchmarks/run_resource_device.sh) from the repository root,
# with $OUT set: logs the machine, builds the extension and the loopback harness into build/gpu (sm_90a + sm_80),
# puts the extension next to the sources (nothing is pip-installed) and exports what the tests and benchmarks need.
# Returns 1 (after printing the build log's tail) if the build fails. Sets t0 = the start time in seconds.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
  date -u
  nvidia-smi -L
  nvcc --version | tail -2
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
  python3 -c "import cuda.bindings; print('cuda.bindings', cuda.bindings.__version__)"
  git log -1 --format='code at %h %s' 2>/dev/null || true
} 2>&1 | tee "$OUT/env.log"
t0=$(date +%s)
if ! { cmake -S . -B build/gpu -DPython_EXECUTABLE="$(command -v python3)" -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" \
       && cmake --build build/gpu -j"$(nproc)"; } > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  return 1
fi
echo "build: $(( $(date +%s) - t0 )) s"
cp build/gpu/_jmo*.so jax_moe_overlap/
export JMO_LOOPBACK_BIN=$PWD/build/gpu/csrc/cuda/jmo_loopback PYTHONPATH=$PWD JAX_PLATFORMS=cuda,cpu PYTHONUNBUFFERED=1
# R rank streams must not share hardware queues (a waiting kernel would block another rank's kernel behind it).
export CUDA_DEVICE_MAX_CONNECTIONS=32
