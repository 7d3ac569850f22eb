#!/usr/bin/env bash
# Prints the hash of the sources that the compiled parts come from (the package's extension and the tools' loopback
# runner): every file under ffi/ and tools/ but Python files, shell scripts and build products, with CMakeLists.txt
# and pyproject.toml; paths relative to the repository root, so a copy of the tree hashes the same. tools/prebuild.sh
# records it beside its builds, and tests/gpu/build_gpu.sh takes them only while the tree still hashes the same.
cd "$(dirname "$0")/../.." || exit 1
find ffi tools CMakeLists.txt pyproject.toml -type f ! -name '*.so' ! -name '*.py' ! -name '*.pyc' ! -name '*.sh' \
  ! -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z | xargs -0 md5sum | md5sum | cut -c1-32
