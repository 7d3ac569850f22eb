"""XLA:GPU command buffers (CUDA graphs) and this library's custom calls.

XLA:GPU records runs of a program's thunks into *command buffers*, CUDA graphs that later executions replay with one
launch. ``--xla_gpu_enable_command_buffer`` lists the kinds of thunk it records (XLA's default list includes
CUSTOM_CALL: custom calls whose FFI handler declares the command-buffer trait, as every CUDA handler of this library
does), and ``--xla_gpu_graph_min_graph_size`` the fewest consecutive thunks worth a graph. An executable's first
execution runs this library's custom calls on the stream, outside any graph, and a failure there follows the
stream's rule (reported by the next call). Later executions record the graph, XLA recording a custom call by
running its handler once on a capturing stream and again only when the addresses of its buffers change; a replay
runs no host code of the library, and a failure inside a recorded or replayed graph follows the graph's rule
(docs/design.md, "CUDA graphs (XLA command buffers)").

* ``scheduling_refusal(xla_flags)``: why XLA_FLAGS would let a CUDA graph reorder the workspace calls (None: it
  would not). The protocol needs every rank to run its workspace calls one after another in program order. XLA's
  default scheduling of a command buffer (LHS) and SERIALIZE make each command wait for the one before it, as the
  one stream does without graphs; CONCURRENT and CONCURRENT_REGIONS order the commands by the buffers they share
  alone, so two workspace calls that no data connects (two independent layers, a layer recomputed by remat beside
  another layer's backward pass) could run in either order, or at once. ``RankInfo`` checks the process's
  XLA_FLAGS for every CUDA call site; options given to one compilation (``compiler_options``) are not seen here.
* ``handler_calls()``: how often each CUDA handler ran on the host and how many of those runs were traces into a
  CUDA graph: a program whose calls were captured runs its handlers far fewer times than it makes calls.
"""

from __future__ import annotations

import os
import re

from jax_moe_overlap import _jmo

# The command-buffer scheduling modes that order commands by their buffers alone.
BUFFER_ORDERED_MODES = ("CONCURRENT", "CONCURRENT_REGIONS")

_FLAG = re.compile(r"--?(xla_gpu_command_buffer_scheduling_mode|xla_gpu_graph_enable_concurrent_region|"
                   r"xla_gpu_enable_command_buffer)=(\S*)")


def _scheduling_mode(xla_flags: str) -> tuple[str, str | None]:
  """(the scheduling mode XLA_FLAGS sets, "" for XLA's default; the value of --xla_gpu_enable_command_buffer, None
  for XLA's default). XLA applies the flags in order, so the last one wins; the older
  --xla_gpu_graph_enable_concurrent_region=true|false sets CONCURRENT or SERIALIZE."""
  mode, enable = "", None
  for name, value in _FLAG.findall(xla_flags or ""):
    value = value.strip("'\"")
    if name == "xla_gpu_enable_command_buffer":
      enable = value
    elif name == "xla_gpu_command_buffer_scheduling_mode":
      mode = value.upper()
    else:
      mode = "CONCURRENT" if value.lower() in ("true", "1") else "SERIALIZE"
  return mode, enable


def custom_calls_recorded(enable_command_buffer: str | None) -> bool:
  """Whether a value of --xla_gpu_enable_command_buffer lets XLA record custom calls: the default list (None) does;
  an explicit list does when it names CUSTOM_CALL; a list of +/- changes to the default does unless it removes it."""
  if enable_command_buffer is None:
    return True
  items = [i.strip().upper() for i in enable_command_buffer.split(",") if i.strip()]
  if items and all(i[0] in "+-" for i in items):
    return "-CUSTOM_CALL" not in items
  return "CUSTOM_CALL" in items


def scheduling_refusal(xla_flags: str | None) -> str | None:
  """Why these XLA_FLAGS would let XLA reorder the workspace calls inside a CUDA graph, or None."""
  mode, enable = _scheduling_mode(xla_flags or "")
  if mode not in BUFFER_ORDERED_MODES or not custom_calls_recorded(enable):
    return None
  return (f"XLA_FLAGS sets the command buffer scheduling mode {mode} while custom calls may be recorded into "
          "command buffers (CUDA graphs): XLA then orders a graph's commands by the buffers they share alone, so two "
          "workspace calls with no data between them could run in either order or at once, and every rank must run "
          "its workspace calls one after another in program order. Use LHS (XLA's default) or SERIALIZE, or keep "
          "custom calls out of command buffers (--xla_gpu_enable_command_buffer=-CUSTOM_CALL)")


def check_scheduling() -> None:
  """Raises ValueError when the process's XLA_FLAGS would let a CUDA graph reorder the workspace calls."""
  why = scheduling_refusal(os.environ.get("XLA_FLAGS"))
  if why is not None:
    raise ValueError(f"jax_moe_overlap: {why}")


def handler_calls() -> dict[str, tuple[int, int]]:
  """{custom call target: (host runs of its CUDA handler, of which traced into a CUDA graph)} since the process
  started; {} in a build without the CUDA kernels."""
  if not _jmo.with_cuda:
    return {}
  return {name: (int(calls), int(captured)) for name, (calls, captured) in _jmo.cuda_handler_calls().items()}
