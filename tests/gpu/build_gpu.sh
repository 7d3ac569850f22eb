# Sourced by the GPU scripts (tests/gpu/run_device.sh, benchmarks/run_*.sh) from the repository root, with $OUT set:
# logs the machine, pip-installs the package (CUDA kernels required: JMO_CUDA=on) into a fresh target $JMO_SITE
# (default /tmp/jmo-site), builds the tools (tools/CMakeLists.txt: the loopback runner) into build/tools, both at
# once, puts the runner next to tools/loopback/*.py, and exports what the tests and benchmarks need.
#
# Everything then runs against the installed package: PYTHONPATH puts $JMO_SITE first (the repository root after it,
# for the `tools` and `benchmarks` packages and examples/) and PYTHONSAFEPATH=1 keeps Python from putting the
# current directory (the checkout, with its own jax_moe_overlap/) in front; tests/gpu/conftest.py checks that the
# imported jax_moe_overlap is the installed one. The machine has no internet: pip uses its installed build tools
# (scikit-build-core, nanobind, cmake) and jax. JMO_CUDA_ARCHS (default "80;90a") picks the GPU targets;
# JMO_BUILD_TYPE (default Release) the tools build's CMAKE_BUILD_TYPE (RelWithDebInfo for backtraces).
# With JMO_PREBUILT=DIR (tools/prebuild.sh's out/prebuilt, carried to the device) whose recorded source hash is the
# tree's (tests/gpu/source_hash.sh), both builds are taken from DIR instead (the package: the tree's Python files and
# DIR's extension); otherwise, or where it does not match, both are built. The probes (not in the default build) then
# need build/tools configured by whoever builds them.
# Returns 1 (after printing the failed build log's tail) if a build fails. Sets t0 = the start time in seconds.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export JMO_SITE=${JMO_SITE:-/tmp/jmo-site}
{
  date -u
  nvidia-smi -L
  nvcc --version | tail -2
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
  python3 -c "import cuda.bindings; print('cuda.bindings', cuda.bindings.__version__)"
  git log -1 --format='code at %h %s' 2>/dev/null || true
  # (a copied tree may carry older git metadata than its files: the count says how far the files are from it)
  echo "files differing from that commit: $(git status --short --untracked-files=no 2>/dev/null | wc -l)"
} 2>&1 | tee "$OUT/env.log"
t0=$(date +%s)
rm -rf "$JMO_SITE"
src_hash=$(bash tests/gpu/source_hash.sh)
# The prebuilt files: gzipped (tools/prebuild.sh), or as they are (an older tree's prebuild).
jmo_unpack() {  # GLOB DIR: each file GLOB matches into DIR, gunzipped where its name ends in .gz
  local f
  for f in $1; do
    case $f in *.gz) gunzip -c "$f" > "$2/$(basename "${f%.gz}")" ;; *) cp "$f" "$2/" ;; esac
  done
}
if [ -n "${JMO_PREBUILT:-}" ] && [ "$(cat "$JMO_PREBUILT/src-hash" 2>/dev/null)" = "$src_hash" ] &&
   ls "$JMO_PREBUILT"/site/jax_moe_overlap/_jmo*.so* "$JMO_PREBUILT"/_jmo_loopback*.so* > /dev/null 2>&1; then
  # tools/prebuild.sh's builds of these very sources: the installed package is the tree's Python with that extension.
  mkdir -p "$JMO_SITE"
  cp -r jax_moe_overlap "$JMO_SITE/"
  rm -f "$JMO_SITE"/jax_moe_overlap/_jmo*.so   # (a stale extension in the tree's package is not these sources')
  jmo_unpack "$JMO_PREBUILT/site/jax_moe_overlap/_jmo*.so*" "$JMO_SITE/jax_moe_overlap"
  jmo_unpack "$JMO_PREBUILT/_jmo_loopback*.so*" tools/loopback
  echo "build: prebuilt for sm_$(cat "$JMO_PREBUILT/archs" 2>/dev/null) ($JMO_PREBUILT, sources $src_hash)," \
    "$(( $(date +%s) - t0 )) s"
else
  [ -z "${JMO_PREBUILT:-}" ] || echo "JMO_PREBUILT=$JMO_PREBUILT: not builds of these sources ($src_hash): building"
  # The two builds compile the kernels each; their largest translation units run in parallel this way.
  JMO_CUDA=on CUDACXX="$(command -v nvcc)" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    python3 -m pip install -v --no-index --no-build-isolation --no-deps --target "$JMO_SITE" . > "$OUT/build.log" 2>&1 &
  jmo_ext=$!
  bash tools/build_tools.sh > "$OUT/build_tools.log" 2>&1 &
  jmo_tools=$!
  wait $jmo_ext; jmo_ext_rc=$?
  wait $jmo_tools; jmo_tools_rc=$?
  if [ $jmo_ext_rc != 0 ]; then tail -60 "$OUT/build.log"; return 1; fi
  if [ $jmo_tools_rc != 0 ]; then tail -60 "$OUT/build_tools.log"; return 1; fi
  echo "build: $(( $(date +%s) - t0 )) s"
  cp build/tools/_jmo_loopback*.so tools/loopback/
fi
export PYTHONPATH="$JMO_SITE:$PWD:$PWD/examples:/tmp/site" PYTHONSAFEPATH=1 JAX_PLATFORMS=cuda,cpu PYTHONUNBUFFERED=1
(cd /tmp && python3 -c "import jax_moe_overlap as j; print('installed', j.__file__); print('build_info', j.build_info())") \
  2>&1 | tee -a "$OUT/env.log"
# R rank streams must not share hardware queues (a waiting kernel would block another rank's kernel behind it).
export CUDA_DEVICE_MAX_CONNECTIONS=32
