"""The benchmarks of jax_moe_overlap, a package run from the repository root: ``python3 -m benchmarks.bench_layer``.

Each ``bench_*`` module is a command line and its timing table; ``baselines`` holds the competitor paths they time
ours against, ``references`` the float32 references every row is checked against before it is timed, ``common`` the
timing, tables, shapes and routings they share; ``ideal_probes`` the probes behind bench_ep_layer's ideal and bound
rows.
"""

import os

# The repository's examples folder (train_moe.py, model.py, step_profile.py), which some benchmarks import. This
# module imports nothing but os, so that a benchmark may put the folder on sys.path before jax is imported (train_moe
# sets the CPU device count first).
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
