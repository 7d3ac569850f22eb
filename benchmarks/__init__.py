"""The benchmarks of jax_moe_overlap, a package run from the repository root: ``python3 -m benchmarks.bench_layer``.

Each ``bench_*`` module is a command line and its timing table; ``baselines`` holds the competitor paths they time
ours against, ``references`` the float32 references every row is checked against before it is timed, ``common`` the
timing, tables, shapes and routings they share; ``ideal_probes`` the probes behind bench_ep_layer's ideal and bound
rows.
"""
