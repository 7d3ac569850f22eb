#!/usr/bin/env bash
# Builds on the development machine what a GPU device call would otherwise build first (tests/gpu/build_gpu.sh, about
# 200 s of device time): the package's extension for JMO_CUDA_ARCHS (default 90a, Hopper) and the tools' loopback
# runner, into out/prebuilt/ (ignored by git), gzipped, with the hash of the sources they come from
# (tests/gpu/source_hash.sh). A device call that carries out/prebuilt (the run tool's `carry`; about 18 MB for 90a,
# within its 64 MiB) and sets JMO_PREBUILT=out/prebuilt has build_gpu.sh take them while the tree's sources still hash
# the same, the package's Python files from the tree; otherwise it builds as before. Gzipped, two trees' builds fit
# one call's carry: an A/B of an older tree (benchmarks/run_ab.sh) whose own out/prebuilt was made by its own
# tools/prebuild.sh builds nothing on the device. The device's python3 must be the minor version this
# builds for (PYTHON, default .venv/bin/python: 3.12, as the device's).
#
#   bash tools/prebuild.sh      then: run(command="JMO_PREBUILT=out/prebuilt bash tests/gpu/run_device.sh",
#                                         carry=["out/prebuilt"])
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(realpath -s "${PYTHON:-.venv/bin/python}")   # (-s: a venv's python is a symlink to keep)
ARCHS=${JMO_CUDA_ARCHS:-90a}
dest=out/prebuilt
rm -rf "$dest"
mkdir -p "$dest"
JMO_CUDA=on JMO_CUDA_ARCHS="$ARCHS" CUDACXX="$(command -v nvcc)" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  "$PY" -m pip install -q --no-index --no-build-isolation --no-deps --target "$dest/pip" .
mkdir -p "$dest/site/jax_moe_overlap"
for so in "$dest"/pip/jax_moe_overlap/_jmo*.so; do   # the extension alone: the Python is the tree's
  gzip -c "$so" > "$dest/site/jax_moe_overlap/$(basename "$so").gz"
done
rm -rf "$dest/pip"
JMO_TOOLS_BUILD=build/tools-prebuilt PYTHON="$PY" JMO_BUILD_TYPE=Release JMO_CUDA_ARCHS="$ARCHS" \
  bash tools/build_tools.sh _jmo_loopback > /dev/null
for so in build/tools-prebuilt/_jmo_loopback*.so; do gzip -c "$so" > "$dest/$(basename "$so").gz"; done
bash tests/gpu/source_hash.sh > "$dest/src-hash"
echo "$ARCHS" > "$dest/archs"
du -sh "$dest"
echo "prebuilt for sm_$ARCHS, sources $(cat "$dest/src-hash"): carry [\"$dest\"] with JMO_PREBUILT=$dest"
