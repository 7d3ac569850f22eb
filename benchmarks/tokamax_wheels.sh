# Sourced by the device scripts from the repository root: installs the wheels of .whl/ (tokamax and its
# dependencies, when the call carried them) into /tmp/site, with a stub xprof module (tokamax imports xprof only for
# its own profiling helpers: a stub is enough for benchmarking). The caller puts /tmp/site on PYTHONPATH.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  mkdir -p /tmp/site/xprof/cli && touch /tmp/site/xprof/__init__.py /tmp/site/xprof/cli/__init__.py
  echo 'get_kernel_stats_tool = None' > /tmp/site/xprof/cli/tools.py
fi
