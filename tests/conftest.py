"""Test set-up: 4 virtual CPU devices (forced before jax is imported) and shared input generators."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
