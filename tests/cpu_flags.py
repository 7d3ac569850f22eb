"""XLA_FLAGS for the CPU tests: pytest's own process (conftest.py) and the scripts it starts in child processes.

Each of these processes sets the flags before it imports jax. Besides the virtual device count and the collectives'
timeout (below), the flags lower LLVM's optimization level for the programs XLA:CPU compiles: most of a test's time
goes into compiling many small programs that then run a few times, and the level changes only how fast they run, not
what they compute. The library's own CPU handlers are C++ built by the extension's build, whatever XLA_FLAGS says.
"""

import os


# XLA:CPU aborts the process when a collective's participants have not all arrived within its terminate timeout
# (the default is tens of seconds). On a loaded 2-core CI machine two test workers each run 4 virtual devices, and one
# device's thread can be starved that long: a slow test, not a deadlock. 600 s keeps a real deadlock fatal.
CPU_COLLECTIVE_TIMEOUT_S = 600


def cpu_xla_flags(devices: int) -> str:
  return (f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0 "
          f"--xla_cpu_collective_call_terminate_timeout_seconds={CPU_COLLECTIVE_TIMEOUT_S}")


def set_cpu_flags(devices: int) -> None:
  """For a child script, before it imports jax: CPU only, with `devices` virtual devices."""
  os.environ["XLA_FLAGS"] = cpu_xla_flags(devices)
  os.environ["JAX_PLATFORMS"] = "cpu"
