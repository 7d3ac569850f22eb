#!/usr/bin/env bash
# Configures and builds the tools' CMake project (tools/CMakeLists.txt: the loopback runner, the probes), from the
# repository root, with the machine's nvcc:
#
#   bash tools/build_tools.sh [TARGET...]     (no target: the default build, the loopback runner)
#
# JMO_TOOLS_BUILD: the build directory (default build/tools). PYTHON: the interpreter the runner's extension is built
# for (default python3). JMO_BUILD_TYPE: CMAKE_BUILD_TYPE (default Release; RelWithDebInfo for backtraces).
# JMO_CUDA_ARCHS, when set, picks the GPU targets (tools/CMakeLists.txt's default otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${JMO_TOOLS_BUILD:-build/tools}
cmake -S tools -B "$build" -DPython_EXECUTABLE="$(command -v "${PYTHON:-python3}")" \
  -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" -DCMAKE_BUILD_TYPE="${JMO_BUILD_TYPE:-Release}" \
  ${JMO_CUDA_ARCHS:+-DJMO_CUDA_ARCHS="$JMO_CUDA_ARCHS"} > /dev/null
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$build" -j"$(nproc)" "${targets[@]}"
