"""GPU test set-up: the installed package, and a watchdog.

The GPU tests run against the installed package: with $JMO_SITE set (tests/gpu/build_gpu.sh installs there), that
directory goes first on sys.path, ahead of the repository root that pytest's `pythonpath` setting puts there for the
CPU tests, and the session stops at once if jax_moe_overlap would still come from anywhere else.

The watchdog ends the run, naming the test, once a test has run longer than
$JMO_GPU_TEST_TIMEOUT_S seconds (default 300; 0 turns it off), or than its own `@pytest.mark.watchdog_s(seconds)`
(tests that wait on a subprocess with a longer time limit of its own).

A device kernel that never finishes (a wait that is not bounded, a warp that deadlocks) blocks the test's thread in
C: pytest would wait until the caller's own time limit killed it, and the log would not say which test hung (a
deadlocked kernel leaves only "." in the log). The watchdog runs on its own thread, so it fires while
the test's thread is stuck; it prints the test's id and every thread's Python stack to the real stderr (pytest's
output capture suspended) and exits the process with status 3.
"""

import faulthandler
import os
import sys
import threading

import pytest

JMO_SITE = os.environ.get("JMO_SITE")
if JMO_SITE:
  _site = os.path.realpath(JMO_SITE)
  sys.path[:] = [_site] + [p for p in sys.path if os.path.realpath(p or ".") != _site]
  import jax_moe_overlap  # noqa: E402  pylint: disable=g-import-not-at-top

  if not os.path.realpath(jax_moe_overlap.__file__).startswith(_site + os.sep):
    raise pytest.UsageError(f"JMO_SITE={JMO_SITE} but jax_moe_overlap comes from {jax_moe_overlap.__file__}: the "
                            "GPU tests must run against the installed package")

TIMEOUT_S = float(os.environ.get("JMO_GPU_TEST_TIMEOUT_S", "300"))
EXIT_STATUS = 3


def pytest_configure(config):
  config.addinivalue_line("markers", "watchdog_s(seconds): this test's own limit for the hang watchdog")


@pytest.fixture(autouse=True)
def _hang_watchdog(request):
  marker = request.node.get_closest_marker("watchdog_s")
  limit = float(marker.args[0]) if marker and TIMEOUT_S > 0 else TIMEOUT_S
  if limit <= 0:
    yield
    return
  capman = request.config.pluginmanager.getplugin("capturemanager")

  def expire():
    if capman is not None:
      capman.suspend_global_capture(in_=False)
    sys.stderr.write(f"\nJMO GPU TEST TIMEOUT: {request.node.nodeid} ran longer than {limit:g} s "
                     f"($JMO_GPU_TEST_TIMEOUT_S or its watchdog_s mark); ending the run with status {EXIT_STATUS}. "
                     "Python stacks:\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(EXIT_STATUS)  # the test's thread may be stuck in a CUDA call: no clean shutdown is possible

  timer = threading.Timer(limit, expire)
  timer.daemon = True
  timer.start()
  try:
    yield
  finally:
    timer.cancel()
