"""Test set-up: 4 virtual CPU devices (forced before jax is imported) and shared input generators."""

import os

from cpu_flags import cpu_xla_flags  # noqa: E402  (tests/, on pytest's pythonpath)

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CPU flags (cpu_flags.py) only where the run is CPU-only: the GPU tests keep XLA's default code generation.
os.environ.setdefault("XLA_FLAGS", cpu_xla_flags(4) if os.environ["JAX_PLATFORMS"] == "cpu" else
                      "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402  pylint: disable=g-import-not-at-top
import pytest  # noqa: E402


def pytest_configure(config):
  del config
  if jax.default_backend() == "cpu" and jax.device_count() < 4:
    raise RuntimeError("the CPU tests need 4 virtual devices: XLA_FLAGS was set before this process imported jax "
                       f"({os.environ.get('XLA_FLAGS')!r})")


@pytest.fixture(scope="session")
def cpu_devices():
  return jax.devices("cpu")
