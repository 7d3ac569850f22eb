"""GPU link probe: peer access and peer-write bandwidth between the visible GPUs.

For every ordered pair (src, dst) of visible CUDA devices it reports ``cudaDeviceCanAccessPeer(src, dst)`` (and
enables peer access where it is possible), then measures, through cuda-python's runtime bindings (every return code
checked):

pair             one pair at a time: cudaMemcpyPeerAsync of --mib MiB from a buffer on src to one on dst, issued on a
                 stream of src (with peer access the copy engines write straight into dst's memory over NVLink or PCIe;
                 without it the runtime stages the copy, marked "no" in the peer column); the median over --reps of
                 the CUDA-event time around the copy, after one warm-up copy.
all-pairs        every device sending --mib MiB to every other device at once (one stream per ordered pair, the
                 copies enqueued round-robin over the sources). Per source GPU: its egress, (R-1) x MiB over the span
                 from its first copy's start to its last copy's end (CUDA events of that device).
all-pairs total  the aggregate: R (R-1) x MiB over the host's wall time from enqueueing the first copy to the end of
                 the last (so it includes the enqueue skew between devices: a conservative number).
local copy       cudaMemcpyAsync device-to-device on each GPU, for scale (copied bytes per second: the memory moves
                 twice that, a read and a write).

GB/s are 1e9 bytes per second. Prints a markdown table and an R x R matrix of the pair numbers (diagonal: the local
copy), writes JSON lines (a meta line first) to --out. With no GPU, or no cuda-python, it says so, writes that as its
only row, and exits 0; with one GPU it measures the local copy only.

  python3 -m benchmarks.bench_links --out $OUT/links.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks import common

COLUMNS = ["kind", "src", "dst", "peer", "MiB", "ms", "GBps"]     # MiB: moved in the ms of the row


def load_runtime():
  """(cuda.bindings.runtime, None), or (None, why it is unavailable)."""
  try:
    from cuda.bindings import runtime  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    return None, f"cuda-python is not installed ({e})"
  return runtime, None


class Cuda:
  """Checked calls of the CUDA runtime: ``cuda("cudaMalloc", n)`` returns what the call returns after its error code
  (one value, a tuple of several, or None) and raises a RuntimeError naming the call and the error otherwise."""

  def __init__(self, rt):
    self.rt = rt

  def __call__(self, name: str, *args, ok=()):
    err, *values = getattr(self.rt, name)(*args)
    if err != self.rt.cudaError_t.cudaSuccess and err not in ok:
      raise RuntimeError(f"{name}{args}: {getattr(err, 'name', err)}: {self.error_text(err)}")
    if not values:
      return None
    return values[0] if len(values) == 1 else tuple(values)

  def error_text(self, err) -> str:
    _, text = self.rt.cudaGetErrorString(err)
    return text.decode() if isinstance(text, bytes) else str(text)

  def device_count(self) -> tuple[int, str]:
    """(visible devices, "") or (0, why none is usable): no driver, no device."""
    err, n = self.rt.cudaGetDeviceCount()
    if err != self.rt.cudaError_t.cudaSuccess:
      return 0, f"no usable CUDA device: cudaGetDeviceCount: {getattr(err, 'name', err)}: {self.error_text(err)}"
    return int(n), ""

  def device_name(self, d: int) -> str:
    name = self("cudaGetDeviceProperties", d).name
    return (name.decode() if isinstance(name, bytes) else str(name)).rstrip("\x00")


class Links:
  """Buffers, streams and events of R devices: send[d] (the source of every copy from d), recv[d][s] (what s writes
  to d; recv[d][d] is the local copy's destination), one stream and one (start, end) event pair per (src, dst)."""

  def __init__(self, cuda: Cuda, R: int, nbytes: int):
    self.cuda, self.R, self.nbytes = cuda, R, nbytes
    self.send, self.recv, self.streams, self.events = [], [], [], []
    for d in range(R):
      cuda("cudaSetDevice", d)
      self.send.append(cuda("cudaMalloc", nbytes))
      cuda("cudaMemset", self.send[d], d + 1, nbytes)
      self.recv.append([cuda("cudaMalloc", nbytes) for _ in range(R)])
      self.streams.append([cuda("cudaStreamCreateWithFlags", cuda.rt.cudaStreamNonBlocking) for _ in range(R)])
      self.events.append([(cuda("cudaEventCreate"), cuda("cudaEventCreate")) for _ in range(R)])
    for d in range(R):
      cuda("cudaSetDevice", d)
      cuda("cudaDeviceSynchronize")

  def enable_peer_access(self) -> dict:
    """{(src, dst): cudaDeviceCanAccessPeer(src, dst)} for src != dst, with peer access enabled where possible."""
    cuda, access = self.cuda, {}
    for s in range(self.R):
      cuda("cudaSetDevice", s)
      for d in range(self.R):
        if d != s:
          access[s, d] = bool(cuda("cudaDeviceCanAccessPeer", s, d))
          if access[s, d]:
            cuda("cudaDeviceEnablePeerAccess", d, 0, ok=(cuda.rt.cudaError_t.cudaErrorPeerAccessAlreadyEnabled,))
    return access

  def issue(self, s: int, d: int):
    """Enqueues the copy s -> d (the local copy when s == d) between the start and end events of its stream."""
    cuda, stream, (start, end) = self.cuda, self.streams[s][d], self.events[s][d]
    cuda("cudaEventRecord", start, stream)
    if s == d:
      cuda("cudaMemcpyAsync", self.recv[d][s], self.send[s], self.nbytes,
           cuda.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, stream)
    else:
      cuda("cudaMemcpyPeerAsync", self.recv[d][s], d, self.send[s], s, self.nbytes, stream)
    cuda("cudaEventRecord", end, stream)

  def elapsed_ms(self, a, b) -> float:
    return float(self.cuda("cudaEventElapsedTime", a, b))

  def time_one(self, s: int, d: int, reps: int) -> float:
    """Median ms of the copy s -> d alone (after one warm-up copy)."""
    self.cuda("cudaSetDevice", s)
    times = []
    for i in range(reps + 1):
      self.issue(s, d)
      self.cuda("cudaEventSynchronize", self.events[s][d][1])
      if i:
        times.append(self.elapsed_ms(*self.events[s][d]))
    return statistics.median(times)

  def time_all_pairs(self, reps: int) -> tuple[list[float], float]:
    """Every device sending to every other at once: (median span ms per source device, median wall ms)."""
    cuda, R = self.cuda, self.R
    spans, walls = [[] for _ in range(R)], []
    for i in range(reps + 1):
      for d in range(R):
        cuda("cudaSetDevice", d)
        cuda("cudaDeviceSynchronize")
      t0 = time.perf_counter()
      for k in range(1, R):                      # round-robin: every source gets its first copy going early
        for s in range(R):
          cuda("cudaSetDevice", s)
          self.issue(s, (s + k) % R)
      for s in range(R):
        for d in range(R):
          if d != s:
            cuda("cudaEventSynchronize", self.events[s][d][1])
      wall = (time.perf_counter() - t0) * 1e3
      if not i:
        continue                                 # warm-up
      walls.append(wall)
      for s in range(R):
        ref = self.events[s][(s + 1) % R][0]
        peers = [d for d in range(R) if d != s]
        first = min(self.elapsed_ms(ref, self.events[s][d][0]) for d in peers)
        last = max(self.elapsed_ms(ref, self.events[s][d][1]) for d in peers)
        spans[s].append(last - first)
    return [statistics.median(x) for x in spans], statistics.median(walls)

  def free(self):
    cuda = self.cuda
    for d in range(self.R):
      cuda("cudaSetDevice", d)
      cuda("cudaDeviceSynchronize")
      for stream in self.streams[d]:
        cuda("cudaStreamDestroy", stream)
      for pair in self.events[d]:
        for e in pair:
          cuda("cudaEventDestroy", e)
      for ptr in [self.send[d]] + self.recv[d]:
        cuda("cudaFree", ptr)


def gbps(nbytes: float, ms: float) -> str:
  return f"{nbytes / ms / 1e6:.1f}"


def measure(cuda: Cuda, R: int, mib: int, reps: int, table: common.Table) -> dict:
  """Adds every measurement's row to table; returns {(src, dst): GB/s} of the single copies (src == dst: local)."""
  nbytes = mib * 2 ** 20
  links = Links(cuda, R, nbytes)
  try:
    access = links.enable_peer_access()
    single = {}

    def add(kind, s, d, ms, moved, peer=""):
      table.add(kind=kind, src=s, dst=d, peer=peer, MiB=moved // 2 ** 20, ms=f"{ms:.3f}", GBps=gbps(moved, ms))

    for d in range(R):
      ms = links.time_one(d, d, reps)
      single[d, d] = nbytes / ms / 1e6
      add("local copy", d, d, ms, nbytes)
    for s in range(R):
      for d in range(R):
        if d != s:
          ms = links.time_one(s, d, reps)
          single[s, d] = nbytes / ms / 1e6
          add("pair", s, d, ms, nbytes, peer="yes" if access[s, d] else "no")
    if R > 1:
      spans, wall = links.time_all_pairs(reps)
      for s in range(R):
        add("all-pairs", s, "all others", spans[s], (R - 1) * nbytes)
      add("all-pairs total", "all", "all", wall, R * (R - 1) * nbytes)
    return single
  finally:
    links.free()


def matrix(R: int, single: dict) -> str:
  """The pair GB/s as an R x R markdown matrix (row: src, column: dst; diagonal: local copy)."""
  lines = ["| src \\ dst | " + " | ".join(str(d) for d in range(R)) + " |", "|---" * (R + 1) + "|"]
  lines += [f"| {s} | " + " | ".join(f"{single[s, d]:.1f}" for d in range(R)) + " |" for s in range(R)]
  return "\n".join(lines)


def main(argv=None, runtime=None) -> int:
  """Runs the probe; returns the exit status (0 also when there is nothing to measure). ``runtime``: a stand-in for
  cuda.bindings.runtime (tests)."""
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--mib", type=int, default=256, help="MiB per copy")
  ap.add_argument("--reps", type=int, default=10, help="timed copies per measurement (median)")
  ap.add_argument("--out", default="links.jsonl")
  args = ap.parse_args(argv)
  meta = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command=common.command_line(), mib=args.mib,
              reps=args.reps)
  rt, why = (runtime, None) if runtime is not None else load_runtime()
  R = 0
  if rt is not None:
    cuda = Cuda(rt)
    R, why = cuda.device_count()
  if R == 0:
    print(f"bench_links: nothing to measure: {why}")
    common.Table(["kind", "reason"], [dict(kind="skipped", reason=why)]).save(args.out, meta)
    return 0
  meta.update(devices=[cuda.device_name(d) for d in range(R)], driver=cuda("cudaDriverGetVersion"),
              runtime=cuda("cudaRuntimeGetVersion"))
  print(f"bench_links: {R} visible GPU(s): {meta['devices']}; driver {meta['driver']}, runtime {meta['runtime']}")
  if R < 2:
    print("bench_links: fewer than 2 GPUs: no pairs to measure, only the local copy")
  table = common.Table(COLUMNS)
  single = measure(cuda, R, args.mib, args.reps, table)
  table.save(args.out, meta)
  print(f"\n{meta}\n\n{table.render()}\n\nGB/s of single copies (row: src, column: dst; diagonal: local copy)\n\n"
        f"{matrix(R, single)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
