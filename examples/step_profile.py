"""Where a jitted training step's device time goes, by part of the model: a ``jax.profiler`` trace of a few steps,
each device op attributed through the compiled step's HLO (its op metadata carries the model's named scopes).

Parts (``PARTS``):
  routed_experts  this library's custom calls (custom-call targets ``jmo_*``): the MoE layers' dispatch, expert GEMMs
                  and combine, forward and backward;
  moe_other       the other ops under the MoE layers' named scope: router, top-k, shared experts (with impl "xla" or
                  "reference", the routed experts too);
  attention       the ops under the attention scope and cuDNN's fused attention calls: ``jax.nn.dot_product_attention``,
                  forward and backward;
  rest            everything else: projections, norms, embedding, head, loss, optimizer update, and device work no
                  instruction of the step's HLO annotates (copies without an op, a CUDA graph's kernels); the table
                  says how much of it there is.

Each GPU kernel is attributed to the HLO instruction whose thunk launched it (a cuDNN attention call's kernels to
its custom call). XLA:GPU command buffers (CUDA graphs) hide that: the kernels of a graph carry only the graph's
name. So the profiled steps run a jit of their own, compiled with ``compiler_options(platform)``, which turns
command buffers off for its executable alone (the process's XLA_FLAGS and the other steps' executable keep them).

Device time: on GPUs the kernels and copies on the device planes' streams; on CPU the XLA:CPU thunks on the host
threads, each without the thunks nested in it (a loop's body counts once). The trace is read back with
``jax.profiler.ProfileData`` (part of jaxlib), so nothing beyond JAX is needed.

  step = jax.jit(step_fn, compiler_options=step_profile.compiler_options(platform))
  hlo = step.lower(*args).compile().as_text()      # the executable the steps below run (jit's cache)
  profile = step_profile.StepProfile(hlo, moe_scope="moe", attention_scope="attention")
  profile.start(); ...run steps through step...; profile.stop(steps=3)
  print(step_profile.format_table(profile.result(num_devices=4), flops_per_device_step))
"""

from __future__ import annotations

import collections
import os
import re
import tempfile
import time
import warnings

import jax

PARTS = ("routed_experts", "moe_other", "attention", "rest")
LABELS = {"routed_experts": "MoE, this library's custom calls", "moe_other": "MoE, router / shared experts / other",
          "attention": "attention (dot_product_attention)", "rest": "rest (projections, norms, head, optimizer)"}
LIBRARY_TARGET_PREFIX = "jmo_"     # every custom call of jax_moe_overlap
# cuDNN's fused attention (jax.nn.dot_product_attention(implementation="cudnn")): its custom call is partitioned in a
# context of its own, so its op metadata need not carry the caller's named scope.
CUDNN_ATTENTION_TARGET_PREFIX = "__cudnn$fmha"

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=%]+)\s*=")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_MODULE = re.compile(r"^HloModule\s+([^\s,]+)")


GPU_PLATFORMS = ("gpu", "cuda", "rocm")
# XLA DebugOptions for the profiled executable on GPUs: an empty list of command-buffer op types, so that no op runs
# inside a CUDA graph and every kernel carries its own instruction's name. (A compile option naming a repeated field
# replaces the whole list; "" leaves it empty.)
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": ""}


def compiler_options(platform: str) -> dict[str, str]:
  """The ``Lowered.compile(compiler_options=...)`` of a profiled step on devices of ``platform`` (a jax Device's
  ``.platform``): GPU_COMPILER_OPTIONS on GPUs, none elsewhere (XLA:CPU has no command buffers)."""
  return dict(GPU_COMPILER_OPTIONS) if platform in GPU_PLATFORMS else {}


def _in_scope(op_name: str, scope: str) -> bool:
  """Whether ``scope`` is one of op_name's components: "jit(step)/moe/...", ".../transpose(jvp(moe))/..."."""
  return re.search(rf"(?:^|[/(]){re.escape(scope)}(?:[/)]|$)", op_name) is not None


def hlo_parts(hlo_text: str, moe_scope: str, attention_scope: str) -> tuple[str, dict[str, str]]:
  """(module name, {instruction name: part}) of a compiled module's HLO text (``Compiled.as_text()``)."""
  module, parts = "", {}
  for line in hlo_text.splitlines():
    if not module and (m := _MODULE.match(line)):
      module = m.group(1)
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    target = _TARGET.search(line)
    op_name = _OP_NAME.search(line)
    op_name = op_name.group(1) if op_name else ""
    target = target.group(1) if target else ""
    if target.startswith(LIBRARY_TARGET_PREFIX):
      parts[m.group(1)] = "routed_experts"
    elif _in_scope(op_name, moe_scope):
      parts[m.group(1)] = "moe_other"
    elif _in_scope(op_name, attention_scope) or target.startswith(CUDNN_ATTENTION_TARGET_PREFIX):
      parts[m.group(1)] = "attention"
    else:
      parts[m.group(1)] = "rest"
  return module, parts


def _self_times(events):
  """[(start_ns, end_ns, key)] of one thread -> [(key, ns)]: each event's duration less that of the events nested
  directly in it."""
  out, stack = [], []               # stack entries: [end, start, key, nested ns]
  for start, end, key in sorted(events, key=lambda e: (e[0], -e[1])):
    while stack and stack[-1][0] <= start:
      e, s, k, nested = stack.pop()
      out.append((k, e - s - nested))
    if stack:
      stack[-1][3] += end - start
    stack.append([end, start, key, 0])
  out.extend((k, e - s - nested) for e, s, k, nested in stack)
  return out


def device_time_by_part(data, module: str, parts: dict[str, str]) -> dict:
  """Sums the device time of a ``jax.profiler.ProfileData`` by part: {"ns": {part: ns}, "ops": {part: {op: ns}},
  "device_planes": the GPU planes with events of the module (0 on CPU), "unnamed_ns": time of device events that no
  instruction of ``parts`` annotates (GPU events without an HLO op, events whose op the HLO text lacks, such as a
  CUDA graph's); they count as "rest"}. Events of other modules than ``module`` are left out. With GPU planes in the
  trace only they count: the host threads then only launch work."""
  ns = collections.Counter()
  ops = collections.defaultdict(collections.Counter)
  unnamed, gpu_planes, other_modules = 0, 0, set()
  planes = [p for p in data.planes if p.name.startswith("/device:GPU")]
  gpu = bool(planes)
  planes = planes or [p for p in data.planes if p.name.startswith("/host:CPU")]
  for plane in planes:
    seen = False
    for line in plane.lines:
      if gpu and not line.name.startswith("Stream"):   # "XLA Ops" and "XLA Modules" lines repeat the kernels
        continue
      timed = []
      for ev in line.events:
        with warnings.catch_warnings():   # jaxlib's stats type warns that it has no __module__ (nanobind)
          warnings.simplefilter("ignore", DeprecationWarning)
          st = dict(ev.stats)
        if st.get("hlo_module", module) != module:
          other_modules.add(str(st["hlo_module"]))
          continue
        if "hlo_op" in st:
          timed.append((ev.start_ns, ev.end_ns, _innermost_op(str(st["hlo_op"]), parts)))
        elif gpu:                                        # a copy or kernel that no HLO op annotates
          unnamed += ev.duration_ns
          ns["rest"] += ev.duration_ns
      # A stream runs its kernels one after another: none nests in another, though their recorded times can overlap
      # by a few hundred ns (nesting those would take a whole kernel off its neighbour). Host thunks nest.
      for op, duration in ([(k, e - s) for s, e, k in timed] if gpu else _self_times(timed)):
        part = parts.get(op, "rest")
        ns[part] += duration
        ops[part][op] += duration
        if op not in parts:
          unnamed += duration
      seen = seen or bool(timed)
    gpu_planes += gpu and seen
  if not ns:
    raise RuntimeError(f"step_profile: no device event of module {module} in the trace (other modules: "
                       f"{sorted(other_modules) or 'none'})")
  return {"ns": {p: ns.get(p, 0) for p in PARTS}, "ops": {p: dict(ops[p]) for p in PARTS},
          "device_planes": gpu_planes, "unnamed_ns": unnamed}


def _innermost_op(hlo_op: str, parts: dict[str, str]) -> str:
  """The op of an event's hlo_op stat: the stat itself, or where a profiler joins the ops of nested annotations
  into one string, the last of them that the module has."""
  if hlo_op in parts:
    return hlo_op
  known = [op for op in re.split(r"[,;\s]+", hlo_op) if op in parts]
  return known[-1] if known else hlo_op


class StepProfile:
  """A trace around some steps of one compiled step function, attributed by part when it stops."""

  def __init__(self, hlo_text: str, *, moe_scope: str, attention_scope: str, logdir: str | None = None):
    self.module, self.parts = hlo_parts(hlo_text, moe_scope, attention_scope)
    if not self.module:
      raise ValueError("step_profile: the HLO text names no module (expected Compiled.as_text())")
    self.logdir = logdir or tempfile.mkdtemp(prefix="moe-step-profile-")
    self.steps = 0
    self.wall_s = 0.0
    self._t0 = None
    self._summary = None

  def start(self) -> None:
    jax.profiler.start_trace(self.logdir)
    self._t0 = time.perf_counter()

  def stop(self, steps: int) -> None:
    """Ends the trace after ``steps`` steps, all finished (the caller waited for their results)."""
    self.wall_s = time.perf_counter() - self._t0
    self.steps = steps
    jax.profiler.stop_trace()
    paths = [os.path.join(d, f) for d, _, fs in os.walk(self.logdir) for f in fs if f.endswith(".xplane.pb")]
    if not paths:
      raise RuntimeError(f"step_profile: jax.profiler wrote no .xplane.pb under {self.logdir}")
    data = jax.profiler.ProfileData.from_file(max(paths, key=os.path.getmtime))
    self._summary = device_time_by_part(data, self.module, self.parts)

  def result(self, num_devices: int) -> dict:
    """Per device and step: {"wall_ms", "busy_ms", "ms": {part: ms}, "top_ops": {part: [(op, ms)]}, "steps",
    "logdir", "unnamed_ms"}. ``num_devices``: this process's devices of the mesh (the GPU planes of the trace
    count instead when there are any)."""
    s = self._summary
    devices = s["device_planes"] or num_devices
    per = 1e-6 / (devices * self.steps)
    ms = {p: s["ns"][p] * per for p in PARTS}
    top = {p: [(op, v * per) for op, v in sorted(s["ops"][p].items(), key=lambda kv: -kv[1])[:3]] for p in PARTS}
    return {"wall_ms": self.wall_s * 1e3 / self.steps, "busy_ms": sum(ms.values()), "ms": ms, "top_ops": top,
            "steps": self.steps, "devices": devices, "logdir": self.logdir, "unnamed_ms": s["unnamed_ns"] * per}


def format_table(result: dict, flops: dict[str, float] | None = None) -> str:
  """The per-part table of ``StepProfile.result``: ms per step and device, share of the step's wall time, and with
  ``flops`` ({part: model FLOPs per device and step}) the TFLOP/s each part achieves."""
  wall = result["wall_ms"]
  lines = [f"profile: {result['steps']} steps traced on {result['devices']} devices, {wall:.2f} ms per step (wall), "
           f"device time per step and device by part (trace: {result['logdir']}):",
           f"  {'part':44s} {'ms':>9s} {'of step':>8s} {'TFLOP/s':>8s}   largest ops"]
  for part in PARTS + ("busy",):
    ms = result["busy_ms"] if part == "busy" else result["ms"][part]
    label = "device busy (sum of the parts)" if part == "busy" else LABELS[part]
    f = sum(flops.values()) if flops and part == "busy" else (flops or {}).get(part, 0.0)
    rate = f"{f / (ms * 1e-3) / 1e12:8.3g}" if f and ms > 0 else f"{'-':>8s}"
    ops = "" if part == "busy" else ", ".join(f"{op} {v:.2f}" for op, v in result["top_ops"][part])
    lines.append(f"  {label:44s} {ms:9.2f} {100 * ms / wall:7.1f}% {rate}   {ops}")
  if result["unnamed_ms"]:
    lines.append(f"  ({result['unnamed_ms']:.2f} ms of the rest are device events that no instruction of the step's "
                 f"HLO annotates)")
  return "\n".join(lines)
