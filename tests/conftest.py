"""Test session setup, before jax is imported anywhere: 8 simulated CPU devices, and one
persistent XLA compilation cache for the whole session.

The cache is shared by the xdist workers and every subprocess they start (``mhc-jax train``,
sweep workers, the multi-process tests): the suite compiles the same tiny programs in many
processes, and a hit skips only XLA's compile, not any check. It is keyed by the session's
controller process and removed when the session ends; a test that needs its own cache (or
none) sets ``JAX_COMPILATION_CACHE_DIR`` for its subprocesses itself.
"""

import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_CONTROLLER = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
_CACHE = os.path.join(tempfile.gettempdir(), f"mhc_jax_tests_xla_cache_{_CONTROLLER}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


# Subprocesses (mhc-jax, sweep workers) start with huge-page malloc, as a run of mhc-jax re-executes
# itself to get (mhc_jax/hostmem.py); set here so none of them re-executes.
from mhc_jax import hostmem  # noqa: E402 (standard library only: jax is not imported)

if hostmem.wanted(os.environ, hostmem.thp_mode()):
  os.environ.update(hostmem.with_tunable(os.environ))

import pytest  # noqa: E402


def pytest_unconfigure(config):
  if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller, after every worker is done
    shutil.rmtree(_CACHE, ignore_errors=True)


@pytest.fixture
def fast_compile():
  """XLA without most optimisations for the test (mhc_jax.testing.fast_compile)."""
  from mhc_jax.testing import fast_compile as context

  with context():
    yield
