"""Where a jitted call's wall time goes: the device's kernel timeline of a few calls from a jax.profiler trace.

The wall time of a call can exceed the sum of its kernels' times (ncu measures each kernel alone) by launch gaps,
host time in an FFI handler, or idle time between calls. This runs ``fn`` a few times under ``jax.profiler.trace``,
reads the trace back with ``jax.profiler.ProfileData`` (part of jaxlib: no TensorBoard or xprof needed) and reports

  * per kernel name: calls, total and mean device microseconds;
  * the device busy time (union of all events on the GPU streams) against the span from the first event to the
    last, i.e. how much of the window the GPU was idle, and the largest idle gaps with the kernels on each side;
  * the longest host-side events (XLA's thunks, our FFI handlers) by name.

  summary = device_trace.trace_calls(fn, args, calls=10)
  print(device_trace.format_summary(summary))

On a machine without a GPU the device part is empty and only host events are reported.
"""

from __future__ import annotations

import collections
import os
import tempfile

import jax


def _events(plane):
  for line in plane.lines:
    for ev in line.events:
      yield line.name, ev


def _union_ns(spans):
  busy, end = 0, None
  for s, e in sorted(spans):
    if end is None or s > end:
      busy += e - s
      end = e
    elif e > end:
      busy += e - end
      end = e
  return busy


def summarize(data, *, top: int = 8) -> dict:
  """Kernel and gap statistics of a ``jax.profiler.ProfileData``: see the module docstring."""
  kernels = collections.defaultdict(lambda: [0, 0.0])
  spans = []
  host = collections.defaultdict(lambda: [0, 0.0])
  planes = []
  for plane in data.planes:
    planes.append(plane.name)
    if plane.name.startswith("/device:GPU"):
      for line_name, ev in _events(plane):
        # The stream lines carry one event per kernel / memcpy / memset; "XLA Ops" and "XLA Modules" lines repeat
        # them as ops and modules.
        if not line_name.startswith("Stream"):
          continue
        kernels[ev.name][0] += 1
        kernels[ev.name][1] += ev.duration_ns / 1e3
        spans.append((ev.start_ns, ev.end_ns, ev.name))
    elif plane.name.startswith("/host:CPU"):
      for _, ev in _events(plane):
        host[ev.name][0] += 1
        host[ev.name][1] += ev.duration_ns / 1e3
  out = {"planes": planes, "kernels": {}, "host": {}}
  for name, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
    out["kernels"][name] = {"calls": n, "total_us": us, "mean_us": us / n}
  for name, (n, us) in sorted(host.items(), key=lambda kv: -kv[1][1])[:3 * top]:
    out["host"][name] = {"calls": n, "total_us": us, "mean_us": us / n}
  if spans:
    spans.sort()
    window = (spans[-1][1] - spans[0][0]) / 1e3
    busy = _union_ns([(s, e) for s, e, _ in spans]) / 1e3
    gaps, end, end_name = [], spans[0][1], spans[0][2]
    for s, e, name in spans[1:]:
      if s > end:
        gaps.append(((s - end) / 1e3, end_name, name))
      if e > end:
        end, end_name = e, name
    gaps.sort(reverse=True)
    out.update(window_us=window, busy_us=busy, idle_us=window - busy, gaps=gaps[:top],
               gaps_total_us=sum(g[0] for g in gaps), gap_count=len(gaps))
  return out


def trace_calls(fn, args, *, calls: int = 10, warmup: int = 3, logdir: str | None = None) -> dict:
  """Runs ``fn(*args)`` ``warmup`` times, then ``calls`` times back to back under a trace; returns ``summarize``'s
  dict plus ``calls`` and the trace's wall microseconds per call."""
  logdir = logdir or tempfile.mkdtemp(prefix="jmo-trace-")
  data, wall = trace_data(fn, args, calls=calls, warmup=warmup, logdir=logdir)
  summary = summarize(data)
  summary.update(calls=calls, wall_us_per_call=wall / calls * 1e6, logdir=logdir)
  return summary


def trace_data(fn, args, *, calls: int, warmup: int = 1, logdir: str | None = None):
  """Runs ``fn(*args)`` ``warmup`` times, then ``calls`` times back to back under ``jax.profiler.trace``: returns
  (the trace as a ``jax.profiler.ProfileData``, wall seconds of the traced calls)."""
  import time  # pylint: disable=g-import-not-at-top
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  logdir = logdir or tempfile.mkdtemp(prefix="jmo-trace-")
  with jax.profiler.trace(logdir):
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    wall = time.perf_counter() - t0
  return read_trace(logdir), wall


def read_trace(logdir: str):
  """The newest trace under ``logdir`` (a ``jax.profiler`` log directory) as a ``jax.profiler.ProfileData``."""
  paths = [os.path.join(d, f) for d, _, fs in os.walk(logdir) for f in fs if f.endswith(".xplane.pb")]
  if not paths:
    raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {logdir}")
  return jax.profiler.ProfileData.from_file(max(paths, key=os.path.getmtime))


def format_summary(s: dict, *, kernels: int = 10, host: int = 8) -> str:
  n = s.get("calls", 1)
  lines = [f"trace: {n} calls, wall {s.get('wall_us_per_call', float('nan')):.1f} us per call (traced)"]
  if "window_us" in s:
    lines.append(f"  device window {s['window_us'] / n:.1f} us/call, busy {s['busy_us'] / n:.1f}, idle "
                 f"{s['idle_us'] / n:.1f} ({s['gap_count']} gaps)")
  for name, k in list(s["kernels"].items())[:kernels]:
    lines.append(f"  kernel {k['mean_us']:9.1f} us x {k['calls'] / n:4.1f}/call  {name[:110]}")
  for us, a, b in s.get("gaps", []):
    lines.append(f"  gap {us:9.1f} us after {a[:50]} before {b[:50]}")
  for name, h in list(s["host"].items())[:host]:
    lines.append(f"  host {h['mean_us']:9.1f} us x {h['calls'] / n:5.1f}/call  {name[:100]}")
  if "window_us" not in s:
    lines.append(f"  (no GPU events; planes: {', '.join(s['planes'])})")
  return "\n".join(lines)


def format_kernels(s: dict, *, per: int = 1, kernels: int = 40) -> str:
  """``summarize``'s kernels by total device time, in ms and calls per ``per`` (e.g. the traced steps)."""
  total = sum(k["total_us"] for k in s["kernels"].values())
  lines = [f"all kernels {total / 1e3 / per:.2f} ms per {per}"]
  for name, k in list(s["kernels"].items())[:kernels]:
    lines.append(f"{k['total_us'] / 1e3 / per:8.3f} ms {k['calls'] / per:6.1f}x  {name[:120]}")
  return "\n".join(lines)


def main(argv=None):
  """The kernels of a trace already written, e.g. the directory ``examples/train_moe.py --profile-steps N`` prints:

    python3 -m benchmarks.device_trace LOGDIR --per N
  """
  import argparse  # pylint: disable=g-import-not-at-top
  ap = argparse.ArgumentParser(description=main.__doc__.split("\n\n")[0])
  ap.add_argument("logdir")
  ap.add_argument("--per", type=int, default=1, help="divide times and calls by this (the traced steps)")
  ap.add_argument("--kernels", type=int, default=40, help="kernels listed")
  args = ap.parse_args(argv)
  print(format_kernels(summarize(read_trace(args.logdir)), per=args.per, kernels=args.kernels))


if __name__ == "__main__":
  main()
