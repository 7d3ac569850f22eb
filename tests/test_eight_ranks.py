"""R = 8: the pytest process has 4 virtual devices, so this runs the comparison in a child process with 8."""

import os
import subprocess
import sys

import pytest


@pytest.mark.slow  # a second process with 8 devices, compiling every program again
def test_eight_ranks_match_reference():
  here = os.path.dirname(os.path.abspath(__file__))
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, os.path.join(here, "eight_ranks_main.py")], cwd=here, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert proc.stdout.count(": match") == 3, proc.stdout
