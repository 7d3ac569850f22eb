"""The benchmarks of jax_moe_overlap, a package run from the repository root: ``python3 -m benchmarks.bench_layer``.

Each ``bench_*`` module is a command line and its timing table; ``baselines`` holds the competitor paths they time
ours against, ``references`` the float32 references every row is checked against before it is timed, ``common`` the
timing, tables, shapes and routings they share; ``ideal_probes`` the probes behind bench_ep_layer's ideal and bound
rows.
"""

import ast
import importlib
import os

# This module imports the standard library alone, so that a benchmark may import it (and put EXAMPLES on sys.path)
# before jax is imported (train_moe sets the CPU device count first).

# The repository's examples folder (train_moe.py, model.py, step_profile.py), which some benchmarks import.
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def switch_values(text: str, flag: str = "--values") -> list:
  """The settings of a library switch given as comma-separated Python literals (train_switch_ab's and
  layer_memory's --values), each read by ast.literal_eval; a SystemExit naming a malformed one."""
  values = []
  for v in text.split(","):
    try:
      values.append(ast.literal_eval(v))
    except (ValueError, SyntaxError) as e:
      raise SystemExit(f"{flag} {text!r}: {v!r} is not a Python literal ({e})") from None
  return values


def set_switch(switch: str, value, who: str) -> None:
  """Sets the library switch MODULE.NAME (e.g. jax_moe_overlap.expert_gemms.PREACTIVATION_IN_COMPUTE_DTYPE) to
  value; a SystemExit naming it, from `who`, where the module has no such attribute. Switches are read when a program
  is traced: set one before tracing (or clear JAX's caches)."""
  module, name = switch.rsplit(".", 1)
  mod = importlib.import_module(module)
  if not hasattr(mod, name):
    raise SystemExit(f"{who}: {module} has no attribute {name}")
  setattr(mod, name, value)
