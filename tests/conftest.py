"""Test session setup, before jax is imported anywhere: 8 simulated CPU devices, XLA set to
compile fast, and one persistent XLA compilation cache for the whole session.

The suite compiles hundreds of tiny programs and runs most of them a few steps, so XLA's
compile is most of its time. The session (and every subprocess and notebook kernel, through
the environment) compiles without most optimisations (``jax_disable_most_optimizations``) and
(on jaxlib < 0.11, whose XLA still has them) with XLA's element-wise emitters instead of its MLIR
fusion emitters: an mhc train step's compile 6.7 s -> 2.8 s (docs/results.md, "make test"). Each compile's LLVM code is generated as one
module, not split for parallel codegen (``--xla_cpu_parallel_codegen_split_count=1``): the
two xdist workers already keep both cores busy, and the split costs CPU time. A test whose
claim is about the optimised program, or that runs enough steps for its speed to matter,
takes the ``optimized`` fixture.

The cache is shared by the xdist workers and every subprocess they start (``mhc-jax train``,
sweep workers, the multi-process tests): the suite compiles the same tiny programs in many
processes, and a hit skips only XLA's compile, not any check. It is keyed by the session's
controller process and removed when the session ends; a test that needs its own cache (or
none) sets ``JAX_COMPILATION_CACHE_DIR`` for its subprocesses itself.
"""

import os
import shutil
import tempfile
from importlib.metadata import version

_FLAGS = (
  "--xla_force_host_platform_device_count=8",
  "--xla_cpu_parallel_codegen_split_count=1",
)
# The element-wise emitters' flag is gone from jax 0.11's XLA, which aborts on an unknown flag.
if tuple(int(p) for p in version("jaxlib").split(".")[:2]) < (0, 11):
  _FLAGS += ("--xla_cpu_use_fusion_emitters=false",)
_flags = os.environ.get("XLA_FLAGS", "")
for _f in _FLAGS:
  if _f.split("=")[0] not in _flags:
    _flags = f"{_flags} {_f}".strip()
os.environ["XLA_FLAGS"] = _flags
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_CONTROLLER = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
_CACHE = os.path.join(tempfile.gettempdir(), f"mhc_jax_tests_xla_cache_{_CONTROLLER}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# matplotlib's font cache: one place for the session, not $HOME, which tests that run commands
# as a user point at their own folder (tests/test_docs_commands.py checks nothing is written)
os.environ.setdefault("MPLCONFIGDIR", os.path.join(_CACHE, "matplotlib"))


import pytest  # noqa: E402
from fake_gcs import gcs  # noqa: E402, F401  (the gs:// fixture, for any test)


def pytest_unconfigure(config):
  if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller, after every worker is done
    shutil.rmtree(_CACHE, ignore_errors=True)


@pytest.fixture
def optimized():
  """XLA's optimisations on for the test, as a user's run compiles (mhc_jax.testing)."""
  from mhc_jax.testing import xla_optimizations

  with xla_optimizations(True):
    yield


#: The files with the most CPU time (benchmarks/suite_times.py, 2026-12-07: 470, 270, 220 and
#: 200 CPU s of about 2,600) start first, so no worker begins one of them near the end.
LONGEST = ("test_parity.py", "test_docs_commands.py", "test_bench.py", "test_mixers.py")


def pytest_collection_modifyitems(config, items):
  """The :data:`LONGEST` files first, then the modules that hold a ``slow`` test, each module
  kept together and in file order otherwise. xdist hands out tests in this order, so the last
  ones to start are short and the two workers finish together, not one idle while the other
  runs a 90 s test. ``make test`` hands out whole files (``--dist loadfile``): a module's
  fixtures are built, and its programs traced, in one worker instead of in both."""
  slow = {item.path for item in items if item.get_closest_marker("slow")}
  # stable sort: file order within each group
  items.sort(key=lambda item: (item.path.name not in LONGEST, item.path not in slow))
