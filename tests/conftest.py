"""Test setup: eight fake CPU devices, set before JAX is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

try:
  from hypothesis import settings
  settings.register_profile("harpjax", deadline=None, derandomize=True, max_examples=60)
  settings.load_profile("harpjax")
except ImportError:  # pragma: no cover - hypothesis is in the test extra
  pass


import pytest  # noqa: E402


@pytest.fixture
def x64():
  """``jax_enable_x64`` on for one test (float64 comparisons with ``jax.jit``)."""
  import jax
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", prev)


@pytest.fixture
def sigint():
  """Ctrl-C raises ``KeyboardInterrupt`` in this test (as at a user's terminal), whatever
  handler the test process inherited; the handler is restored afterwards."""
  import signal
  prev = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, prev)
