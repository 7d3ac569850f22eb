"""Runs a command as a jax.distributed job of N processes on this host: process i gets the command with
``--num-processes N --process-id i --coordinator localhost:PORT`` (and ``--local-device-ids i``: one GPU each)
appended, the flags of examples/train_moe.py, and writes its output to LOG_DIR/process-i.log (--logs; by default a
fresh directory under the system's temporary directory, printed at the start). When one process fails or the
deadline passes, every other process is killed: a dead peer never leaves the others waiting.

  python -m benchmarks.launch_job --processes 4 --limit-s 300 --logs $OUT -- python3 examples/train_moe.py --preset gpu
  python -m benchmarks.launch_job --processes 2 --no-local-ids -- python3 examples/train_moe.py   # CPU processes

Exit status: 0 when every process exited 0; else the first failure's status (124 when the deadline passed). Prints
each process's exit status, the job's seconds and process 0's last lines.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
  """A TCP port of localhost that is free now (for the job's coordination service)."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run(command: list[str], processes: int, limit_s: float, logs: str, local_ids: bool = True,
        report: bool = True) -> int:
  """Starts the job, waits (polling) until every process has exited, one has failed or limit_s has passed, kills
  what is left, and returns the job's exit status (see the module docstring); prints the report unless told not
  to."""
  os.makedirs(logs, exist_ok=True)
  port = free_port()
  procs, files = [], []
  for i in range(processes):
    f = open(os.path.join(logs, f"process-{i}.log"), "w")  # pylint: disable=consider-using-with
    job = ["--num-processes", str(processes), "--process-id", str(i), "--coordinator", f"localhost:{port}"]
    procs.append(subprocess.Popen(command + job + (["--local-device-ids", str(i)] if local_ids else []),
                                  stdout=f, stderr=subprocess.STDOUT))
    files.append(f)
  start = time.monotonic()
  status = 0
  try:
    while True:
      codes = [p.poll() for p in procs]
      failed = [c for c in codes if c not in (None, 0)]
      if failed:
        status = failed[0]
        break
      if all(c == 0 for c in codes):
        break
      if time.monotonic() - start > limit_s:
        status = 124
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for p in procs:
      p.wait(timeout=60)
    for f in files:
      f.close()
  if not report:
    return status
  for i, p in enumerate(procs):
    print(f"process {i}: exit status {p.returncode}{' (killed)' if p.returncode and p.returncode < 0 else ''}")
  print(f"the job took {time.monotonic() - start:.1f} s")
  if status == 124:
    print(f"the job did not finish within {limit_s:.0f} s: every process was killed")
  with open(os.path.join(logs, "process-0.log")) as f:
    print("".join(f.readlines()[-8:]), end="")
  return status


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  ap = argparse.ArgumentParser(prog="python -m benchmarks.launch_job", description=__doc__.split("\n\n")[0],
                               usage="%(prog)s --processes N [options] -- COMMAND ...")
  ap.add_argument("--processes", type=int, required=True, help="processes of the job")
  ap.add_argument("--limit-s", type=float, default=600, help="deadline of the job in seconds (default: %(default)g)")
  ap.add_argument("--logs", default=None,
                  help="folder of the processes' logs (default: a fresh launch_job-* folder in the system's "
                       "temporary directory)")
  ap.add_argument("--no-local-ids", dest="local_ids", action="store_false",
                  help="do not pass --local-device-ids i (CPU processes: each uses its own devices)")
  cut = argv.index("--") if "--" in argv else len(argv)
  if cut == len(argv) and not {"-h", "--help"} & set(argv):   # the help needs no command
    raise SystemExit("launch_job: the command follows '--' (see --help)")
  args = ap.parse_args(argv[:cut])
  if args.processes < 1 or not argv[cut + 1:]:
    raise SystemExit("launch_job: --processes must be at least 1 and a command must follow '--'")
  logs = args.logs
  if logs is None:   # not the current directory: a job started from a checkout would leave its logs in the work tree
    logs = tempfile.mkdtemp(prefix="launch_job-")
    print(f"launch_job: the processes' logs go to {logs}", flush=True)
  return run(argv[cut + 1:], args.processes, args.limit_s, logs, args.local_ids)


if __name__ == "__main__":
  sys.exit(main())
