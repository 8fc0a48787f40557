"""Transparent huge pages for XLA's CPU buffers, so a train step does not page-fault its memory.

XLA's CPU runtime mallocs each execution's temporary buffer (every intermediate of the step)
and each large output afresh. glibc serves a request that large with a new ``mmap`` and
unmaps it on ``free``, so every step faults the whole buffer in again, 4 KiB at a time: at
step_bench's shape (width 256, 8 blocks, 2048 tokens) the residual step's 220 MB temp buffer
cost 56,185 minor faults per step, the mhc step's ~94,500. glibc's tunable
``glibc.malloc.hugetlb=1`` makes malloc ask the kernel for transparent huge pages
(``madvise``) on such mappings: ~490 faults per step, and 0.10 s less kernel CPU time (mhc:
0.14 s), about 4% of the two cores' time over the step (docs/performance.md: the
measurement and its command). Arithmetic is unchanged: the same losses bit for bit.

The tunable is read when the process starts, so :func:`ensure` re-executes the same command
(``sys.orig_argv``: same PID, same arguments) with it added to ``GLIBC_TUNABLES`` when it is
missing. Only programs call it (``mhc-jax``, the benchmarks), before they write anything or
run jax; child processes (sweep workers, ``jax.distributed`` ranks) inherit the variable. It
does nothing off Linux/glibc, where the kernel's THP mode is ``always`` (every mapping already
gets huge pages) or ``never`` (none can), or with ``MHC_JAX_HUGEPAGES=0``.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

VAR = "GLIBC_TUNABLES"
TUNABLE = "glibc.malloc.hugetlb"
OPT_OUT = "MHC_JAX_HUGEPAGES"  # "0": leave malloc as it is
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_MODE) -> str | None:
  """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``), or None."""
  try:
    text = open(path, encoding="ascii").read()
  except OSError:
    return None
  start, end = text.find("["), text.find("]")
  return text[start + 1 : end] if 0 <= start < end else None


def wanted(environ: Mapping[str, str], mode: str | None) -> bool:
  """Whether a process started with ``environ`` would gain from the tunable."""
  return (
    sys.platform == "linux"
    and platform.libc_ver()[0] == "glibc"
    and environ.get(OPT_OUT, "1") != "0"
    and mode == "madvise"
    and TUNABLE not in environ.get(VAR, "")
  )


def with_tunable(environ: Mapping[str, str]) -> dict[str, str]:
  """``environ`` with ``glibc.malloc.hugetlb=1`` added to ``GLIBC_TUNABLES`` (others kept)."""
  env = dict(environ)
  env[VAR] = ":".join(t for t in (env.get(VAR, ""), f"{TUNABLE}=1") if t)
  return env


def ensure() -> None:
  """Re-execute this process with the tunable if it would gain from it (see the module doc).

  Call before anything that cannot be repeated has happened (files written, jax run); an
  import is repeated harmlessly."""
  if wanted(os.environ, thp_mode()):
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, with_tunable(os.environ))
