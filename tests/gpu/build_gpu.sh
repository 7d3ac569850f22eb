# Sourced by the GPU scripts (tests/gpu/run_device.sh, benchmarks/run_*.sh) from the repository root, with $OUT set:
# logs the machine, builds the extension into build/gpu and the tools (tools/CMakeLists.txt: the loopback runner)
# into build/tools, both sm_90a + sm_80 and side by side, puts the extension and the runner next to their Python
# sources (nothing is pip-installed) and exports what the tests and benchmarks need.
# JMO_BUILD_TYPE (default Release) sets both builds' CMAKE_BUILD_TYPE (RelWithDebInfo for backtraces).
# Returns 1 (after printing the failed build log's tail) if a build fails. Sets t0 = the start time in seconds.
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
# The two builds compile the kernels each; their largest translation units run in parallel this way.
jmo_cmake() {  # source dir, build dir
  cmake -S "$1" -B "$2" -DPython_EXECUTABLE="$(command -v python3)" -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" \
    -DCMAKE_BUILD_TYPE="${JMO_BUILD_TYPE:-Release}" && cmake --build "$2" -j"$(nproc)"
}
jmo_cmake . build/gpu > "$OUT/build.log" 2>&1 &
jmo_ext=$!
jmo_cmake tools build/tools > "$OUT/build_tools.log" 2>&1 &
jmo_tools=$!
wait $jmo_ext; jmo_ext_rc=$?
wait $jmo_tools; jmo_tools_rc=$?
if [ $jmo_ext_rc != 0 ]; then tail -60 "$OUT/build.log"; return 1; fi
if [ $jmo_tools_rc != 0 ]; then tail -60 "$OUT/build_tools.log"; return 1; fi
echo "build: $(( $(date +%s) - t0 )) s"
cp build/gpu/_jmo*.so jax_moe_overlap/
cp build/tools/_jmo_loopback*.so tools/loopback/
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda,cpu PYTHONUNBUFFERED=1
# R rank streams must not share hardware queues (a waiting kernel would block another rank's kernel behind it).
export CUDA_DEVICE_MAX_CONNECTIONS=32
