"""Several processes under jax.distributed on localhost CPU (gloo collectives), each running multiprocess_main.py.

An expert axis inside each process with the data axis across processes runs and matches a float32 oracle (outputs
and gradients); an expert axis spanning processes is refused at workspace creation on every process, quickly, with
exit status 0 (no call waits for a peer, nothing aborts at exit).
"""

import os
import socket
import subprocess
import sys

import pytest


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_processes(nproc: int, local: int, case: str, calls: int = 3):
  here = os.path.dirname(os.path.abspath(__file__))
  env = dict(os.environ, JMO_CALLS=str(calls))
  env.pop("XLA_FLAGS", None)
  port = str(_free_port())
  procs = [subprocess.Popen([sys.executable, os.path.join(here, "multiprocess_main.py"), str(i), str(nproc), port,
                             str(local), case], cwd=here, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for i in range(nproc)]
  outs = []
  try:
    for p in procs:
      outs.append((p.wait(timeout=240), p.stdout.read()))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return outs


@pytest.mark.parametrize("nproc,local,calls", [(2, 2, 100), (4, 1, 3)])
def test_data_axis_across_processes_matches_the_oracle(nproc, local, calls):
  for rc, out in run_processes(nproc, local, "data_across", calls):
    assert rc == 0 and ": match" in out, out


@pytest.mark.parametrize("nproc,local", [(2, 2), (4, 1)])
def test_expert_axis_across_processes_is_refused_at_creation(nproc, local):
  for rc, out in run_processes(nproc, local, "expert_across"):
    assert rc == 0, out
    line = next(l for l in out.splitlines() if l.startswith("refused after"))
    assert float(line.split()[2]) < 5.0, line
    assert "shares memory only within one process" in line and "spans processes" in line, line
