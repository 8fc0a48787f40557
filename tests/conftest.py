"""Test session setup: 8 simulated CPU devices, set before jax is imported anywhere."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import pytest  # noqa: E402


@pytest.fixture
def fast_compile():
  """XLA without most optimisations: ~30% less compile time, which is most of a tiny run."""
  import jax

  old = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", old)
