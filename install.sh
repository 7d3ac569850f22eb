#!/usr/bin/env bash
# Sets up .venv (Python >= 3.12, pinned jax) and builds + installs jax-moe-overlap with its test and example extras.
# The C++ FFI handlers always build; the CUDA kernels build too when nvcc is found (JMO_CUDA=auto, the default;
# JMO_CUDA=on makes a missing nvcc an error, JMO_CUDA=off skips them; JMO_CUDA_ARCHS="80;90a" picks the GPU targets).
# A GPU install without this script: pip install "jax-moe-overlap[cuda12]" (or [cuda13]) from the checkout.
set -euo pipefail
cd "$(dirname "$0")"

find_python() {
  local c
  for c in "${PYTHON:-}" python3.12 python3.13 python3; do
    [ -n "$c" ] || continue
    if "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then echo "$c"; return 0; fi
  done
  for c in "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python; do
    [ -x "$c" ] && { echo "$c"; return 0; }
  done
  return 1
}

PY=$(find_python) || { echo "install.sh: need Python >= 3.12 (jax >= 0.11); set PYTHON=/path/to/python3.12" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# Build requirements first, pinned, so that the extension compiles against the same jax FFI headers it runs with.
.venv/bin/python -m pip install -q -c constraints.txt scikit-build-core nanobind jax jaxlib
.venv/bin/python -m pip install -q -c constraints.txt --no-build-isolation -e ".[test,examples]"
.venv/bin/python - <<'PY'
import sys
import jax_moe_overlap as jmo
info = jmo.build_info()
print("jax-moe-overlap installed:", info)
if not info["cuda"]:
  print("install.sh: CUDA kernels not built (nvcc not found, or JMO_CUDA=off): this install runs on CPU only",
        file=sys.stderr)
PY
