"""Every test runs on CPU with 8 fake devices, so each sharding path runs here."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after the flags above)
import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def devices():
  assert jax.device_count() == 8, "conftest must fake 8 CPU devices before jax initialises"
  return jax.devices()


@pytest.fixture
def repo_root():
  return ROOT
