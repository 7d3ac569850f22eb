"""Runs a script of tests/ in a fresh Python process: for checks that need another device count than the 4 virtual
CPU devices of pytest's own process (the script sets XLA_FLAGS before it imports jax)."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_script(name: str, *args: str, timeout: float = 600) -> str:
  """Runs tests/<name> with `args` and this interpreter (XLA_FLAGS left to the script); returns its stdout, failing
  the test with both streams when it exits non-zero."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, os.path.join(HERE, name), *args], cwd=HERE, env=env, capture_output=True,
                        text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  return proc.stdout
