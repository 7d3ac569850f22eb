"""tests/gpu/conftest.py's watchdog, on the CPU: a test that outlives $JMO_GPU_TEST_TIMEOUT_S ends the pytest run
with status 3 and its id on stderr; a test that finishes in time is unaffected. (Each case runs pytest in a
subprocess on a scratch directory holding a copy of that conftest.)"""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

CONFTEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu", "conftest.py")


def run_pytest(tmp_path, body: str, timeout_s: str):
  shutil.copy(CONFTEST, tmp_path / "conftest.py")
  (tmp_path / "test_case.py").write_text(textwrap.dedent(body))
  env = dict(os.environ, JMO_GPU_TEST_TIMEOUT_S=timeout_s)
  return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)], env=env,
                        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)


def test_a_hung_test_ends_the_run_and_is_named(tmp_path):
  r = run_pytest(tmp_path, """
      import time

      def test_stuck():
        time.sleep(60)
      """, "1")
  assert r.returncode == 3, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
  assert "JMO GPU TEST TIMEOUT: test_case.py::test_stuck ran longer than 1 s" in r.stderr, r.stderr[-2000:]
  assert "time.sleep" in r.stderr or "test_stuck" in r.stderr  # the stack of the stuck thread


@pytest.mark.slow  # sleeps 2 s and 1 s in a pytest subprocess; the default pass keeps the watchdog's other two cases
def test_a_watchdog_mark_sets_a_tests_own_limit(tmp_path):
  r = run_pytest(tmp_path, """
      import time
      import pytest

      @pytest.mark.watchdog_s(30)
      def test_slow_but_bounded():
        time.sleep(2)

      @pytest.mark.watchdog_s(1)
      def test_stuck():
        time.sleep(60)
      """, "1")
  assert r.returncode == 3, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
  assert "test_slow_but_bounded" not in r.stderr and "test_case.py::test_stuck ran longer than 1 s" in r.stderr


def test_tests_that_finish_in_time_pass(tmp_path):
  r = run_pytest(tmp_path, """
      import time

      def test_quick():
        time.sleep(0.2)

      def test_quick_too():
        assert 1 + 1 == 2
      """, "5")
  assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
  assert "2 passed" in r.stdout and "TIMEOUT" not in r.stderr
