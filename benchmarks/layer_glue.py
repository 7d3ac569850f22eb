"""The XLA glue of one MoE layer's forward + backward: every op of the optimized program outside this library's custom
calls that moves about as many bytes as the routed rows (concatenates, copies, gathers, elementwise passes), where it
comes from (its op_name), and with ``--calls`` the device time of each op from a trace.

  python -m benchmarks.layer_glue                  # the GPU training preset's layer: T=32768 D=1024 F=1024 E=16 k=4
  python -m benchmarks.layer_glue --calls 10       # and device ms per call, by op group and by op
  python -m benchmarks.layer_glue --impl collective --quantization fp8 --calls 10   # the FP8 recipe's layer

The program is ``jax.grad`` of the layer (x, gates, w1 and w2 differentiated, as in training), compiled without
XLA:GPU command buffers (``examples/step_profile.compiler_options``) so that every kernel of the trace names its HLO
op. "MiB" is what an op reads and writes, its operands' and results' sizes (a fusion reads each operand once). The
phase is "bwd" for ops whose op_name holds a transpose (JAX's reverse pass), else "fwd". docs/design.md ("The
layer's XLA glue") says which ops these are and why they remain.
"""

from __future__ import annotations

import argparse
import collections
import math
import re
import sys

import jax
import jax.numpy as jnp

import jax_moe_overlap as jmo
from jax_moe_overlap.checks import QUANTIZATIONS
from benchmarks import EXAMPLES
from benchmarks import common
from benchmarks import device_trace

sys.path.insert(0, EXAMPLES)
import step_profile  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_SKIP = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id",
         "replica-id"}
GROUPS = ("library custom calls", "concatenate", "copy / transpose", "gather / scatter / dynamic slices", "reduce",
          "other")


def _bytes(text: str) -> int:
  return sum(math.prod(int(d) for d in dims.split(",") if d) * _BYTES[t] for t, dims in _SHAPE.findall(text))


def glue_ops(hlo_text: str) -> list[dict]:
  """The ops that run on their own in a compiled module (not the instructions inside fusions or called
  computations' bodies other than the entry's and loops'): [{"name", "kind", "group", "phase", "shape", "bytes",
  "op_name"}], kind = the custom call's target, a fusion's root opcode as "fusion:ROOT", or the opcode."""
  computations, current = {}, None
  for line in hlo_text.splitlines():
    m = _COMPUTATION.match(line)
    if m and not line.startswith(" "):
      current = computations.setdefault(m.group(1), [])
      continue
    if current is not None and line.startswith(" ") and line.strip() not in ("}", ""):
      current.append(line)
  inner = set()
  for lines in computations.values():
    for line in lines:
      if re.search(r"\s(fusion|reduce|reduce-window|scatter|select-and-scatter|sort|map|all-reduce|reduce-scatter)\(",
                   line):
        inner.update(re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", line))

  def root_of(name):
    for line in computations.get(name, ()):
      if line.lstrip().startswith("ROOT"):
        m = _INSTRUCTION.match(line)
        return m.group(3) if m else "?"
    return "?"

  ops = []
  for comp, lines in computations.items():
    if comp in inner:
      continue
    for line in lines:
      m = _INSTRUCTION.match(line)
      if not m or m.group(3) in _SKIP:
        continue
      name, result, opcode, rest = m.groups()
      operands = rest.split("), ")[0] if opcode != "custom-call" else rest.split("custom_call_target")[0]
      target = re.search(r'custom_call_target="([^"]*)"', line)
      if opcode == "custom-call" and target:
        kind = target.group(1)
      elif opcode == "fusion":
        called = re.search(r"calls=%?([\w.\-]+)", line)
        kind = "fusion:" + (root_of(called.group(1)) if called else "?")
      else:
        kind = opcode
      op_name = re.search(r'op_name="((?:[^"\\]|\\.)*)"', line)
      op_name = op_name.group(1) if op_name else ""
      ops.append({"name": name, "kind": kind, "group": _group(kind),
                  "phase": "bwd" if "transpose(" in op_name else "fwd", "shape": re.sub(r"\{[^}]*\}", "", result),
                  "bytes": _bytes(result) + _bytes(operands), "op_name": op_name})
  return ops


def _group(kind: str) -> str:
  root = kind.split(":", 1)[-1]
  if kind.startswith(step_profile.LIBRARY_TARGET_PREFIX):
    return "library custom calls"
  if root == "concatenate":
    return "concatenate"
  if root in ("copy", "copy-start", "copy-done", "transpose"):
    return "copy / transpose"
  if root in ("gather", "scatter", "dynamic-slice", "dynamic-update-slice"):
    return "gather / scatter / dynamic slices"
  if root == "reduce":
    return "reduce"
  return "other"


def device_ms_per_op(step, args, hlo_text: str, calls: int) -> tuple[float, dict[str, float]]:
  """(wall ms per call, {op: device ms per call and device}) over ``calls`` traced calls of ``step``, each device op
  attributed to the HLO op that launched it (step_profile.device_time_by_part)."""
  module, parts = step_profile.hlo_parts(hlo_text, moe_scope="", attention_scope="")
  data, wall = device_trace.trace_data(step, args, calls=calls)
  summary = step_profile.device_time_by_part(data, module, parts)
  per = 1e-6 / (max(1, summary["device_planes"]) * calls)
  ms = collections.Counter()
  for by_op in summary["ops"].values():
    for op, ns in by_op.items():
      ms[op] += ns * per
  return wall * 1e3 / calls, dict(ms)


def layer_grad(T: int, D: int, F: int, E: int, k: int, R: int = 1, impl: str = "overlap",
               capacity_factor: float | None = 1.25, quantization: str | None = None):
  """``jax.grad`` of one layer (x, gates, w1 and w2 differentiated, as in training) on the first R devices, jitted
  as the trace takes it, with its operands and its optimized HLO: (step, args, hlo_text)."""
  mesh = jax.make_mesh((R,), (common.AXIS,), devices=jax.devices()[:R])
  x, ids, gates, w1, w2 = common.layer_operands(T, D, F, E, k)
  platform = jax.devices()[0].platform

  def loss(x, gates, w1, w2):
    y, _ = jmo.moe_experts(x, ids, gates, w1, w2, mesh=mesh, axis_name=common.AXIS, impl=impl,
                           capacity_factor=capacity_factor, quantization=quantization)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)), compiler_options=step_profile.compiler_options(platform))
  args = (x, gates, w1, w2)
  return step, args, step.lower(*args).compile().as_text()


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--tokens", type=int, default=32768, help="tokens of the whole layer (over every rank)")
  ap.add_argument("--d-model", type=int, default=1024)
  ap.add_argument("--d-ff", type=int, default=1024)
  ap.add_argument("--experts", type=int, default=16)
  ap.add_argument("--top-k", type=int, default=4)
  ap.add_argument("--capacity-factor", type=float, default=1.25, help="0: dropless")
  ap.add_argument("--ranks", type=int, default=1, help="the expert axis' size (the first devices)")
  ap.add_argument("--impl", default="overlap")
  ap.add_argument("--quantization", choices=("none", *filter(None, QUANTIZATIONS)), default="none",
                  help="an FP8 mode: the FP8 recipe's layer (d-model and d-ff multiples of 128)")
  ap.add_argument("--min-mib", type=float, default=-1.0,
                  help="list ops moving at least this many MiB (default: half of a rank's routed rows)")
  ap.add_argument("--calls", type=int, default=0, help="trace this many calls and report device time")
  a = ap.parse_args(argv)
  T, D, F, E, k, R = a.tokens, a.d_model, a.d_ff, a.experts, a.top_k, a.ranks
  if len(jax.devices()) < R:
    raise SystemExit(f"--ranks {R}: only {len(jax.devices())} devices (on CPU set XLA_FLAGS="
                     f"--xla_force_host_platform_device_count={R})")
  quantization = None if a.quantization == "none" else a.quantization
  step, args, hlo = layer_grad(T, D, F, E, k, R, a.impl, a.capacity_factor or None, quantization)
  platform = jax.devices()[0].platform
  ops = glue_ops(hlo)
  routed = T * k * D * 2 // R                                   # one rank's routed rows (the program is per rank)
  floor = a.min_mib * 2**20 if a.min_mib >= 0 else routed / 2
  recipe = f", quantization {quantization}" if quantization else ""
  print(f"one layer, forward + backward ({a.impl}): T={T} D={D} F={F} E={E} k={k} cf={a.capacity_factor or None} "
        f"bf16{recipe}, R={R}, {platform}; a rank's routed rows [T*k/R, D]: {routed / 2**20:.1f} MiB")
  timed = {}
  if a.calls:
    wall, timed = device_ms_per_op(step, args, hlo, a.calls)
    busy = sum(timed.values())
    print(f"{a.calls} calls traced: {wall:.3f} ms per call (wall), device busy {busy:.3f} ms per call and device")
    group_of = {op["name"]: op["group"] for op in ops}
    by_group = collections.Counter()
    for name, ms in timed.items():
      by_group[group_of.get(name, "other")] += ms
    for g in GROUPS:
      print(f"  {g:36s} {by_group[g]:8.3f} ms")
  print(f"ops moving >= {floor / 2**20:.1f} MiB (MiB read + written{', device ms per call' if timed else ''}):")
  total = collections.Counter()
  for op in ops:
    total[op["group"] == "library custom calls"] += op["bytes"]
    if op["bytes"] >= floor:
      ms = f" {timed.get(op['name'], 0.0):7.3f} ms" if timed else ""
      print(f"  {op['phase']} {op['kind'][:28]:28s} {op['bytes'] / 2**20:8.0f} MiB{ms}  {op['shape'][:44]:44s} "
            f"{op['op_name'][-90:]}")
  print(f"MiB moved by every op: library custom calls {total[True] / 2**20:.0f}, the rest {total[False] / 2**20:.0f}")


if __name__ == "__main__":
  main()
