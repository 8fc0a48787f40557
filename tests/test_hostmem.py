"""Huge pages for XLA's CPU buffers (mhc_jax/hostmem.py): when the tunable applies, the re-exec,
and the page faults it saves."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from mhc_jax import hostmem

ON = f"{hostmem.TUNABLE}=1"


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if k not in (hostmem.VAR, hostmem.OPT_OUT)}
  return {**env, **extra}


def _python(code: str, timeout: float = 60, **env) -> subprocess.CompletedProcess:
  """``python -c code`` without the tunable or the opt-out set (``env`` added)."""
  return subprocess.run(
    [sys.executable, "-c", code], env=_env(**env), capture_output=True, text=True, timeout=timeout
  )


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
  f = tmp_path / "enabled"
  f.write_text("always [madvise] never\n")
  assert hostmem.thp_mode(str(f)) == "madvise"
  f.write_text("[always] madvise never\n")
  assert hostmem.thp_mode(str(f)) == "always"
  assert hostmem.thp_mode(str(tmp_path / "missing")) is None


@pytest.mark.skipif(
  sys.platform != "linux" or hostmem.platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_wanted_only_where_it_helps_and_not_yet_set():
  assert hostmem.wanted({}, "madvise")
  assert hostmem.wanted({hostmem.VAR: "glibc.malloc.arena_max=2"}, "madvise")
  assert not hostmem.wanted({hostmem.VAR: ON}, "madvise")
  assert not hostmem.wanted({hostmem.OPT_OUT: "0"}, "madvise")
  for mode in ("always", "never", None):
    assert not hostmem.wanted({}, mode)


def test_with_tunable_keeps_the_other_tunables():
  assert hostmem.with_tunable({})[hostmem.VAR] == ON
  env = hostmem.with_tunable({hostmem.VAR: "glibc.malloc.arena_max=2", "A": "b"})
  assert env[hostmem.VAR] == f"glibc.malloc.arena_max=2:{ON}" and env["A"] == "b"


needs_thp = pytest.mark.skipif(
  not hostmem.wanted({}, hostmem.thp_mode()),
  reason=f"the tunable does nothing here (Linux/glibc with THP 'madvise' needed; "
  f"THP mode: {hostmem.thp_mode()})",
)


@needs_thp
def test_ensure_reexecutes_the_same_process_with_the_tunable():
  code = textwrap.dedent(
    """
    import os, sys
    print("pid", os.getpid(), file=sys.stderr, flush=True)
    from mhc_jax import hostmem
    hostmem.ensure()
    print(os.environ["GLIBC_TUNABLES"])
    """
  )
  p = _python(code)
  assert p.returncode == 0, p.stderr
  pids = [line for line in p.stderr.splitlines() if line.startswith("pid ")]
  assert len(pids) == 2 and pids[0] == pids[1], p.stderr  # ran again, in the same process
  assert p.stdout.strip() == ON
  off = _python(code, MHC_JAX_HUGEPAGES="0", GLIBC_TUNABLES="x=1")
  assert off.returncode == 0 and off.stderr.count("pid ") == 1 and off.stdout.strip() == "x=1"


@needs_thp
def test_the_cli_reexecutes_only_as_a_program():
  code = "import os, sys; print('pid', os.getpid(), file=sys.stderr, flush=True)\n"
  # cli.main with an argv list (tests, scripts): never re-executes
  called = _python(code + "from mhc_jax import cli; cli.main(['--help'])")
  assert called.returncode == 0 and "usage" in called.stdout
  assert called.stderr.count("pid ") == 1, called.stderr
  # run as the program (argv from the command line): re-executes once
  run = _python(
    code + "import sys; sys.argv = ['mhc-jax', '--help']\nfrom mhc_jax import cli; cli.main()"
  )
  assert run.returncode == 0 and "usage" in run.stdout
  assert run.stderr.count("pid ") == 2, run.stderr


# A 64 MiB output per call: glibc maps it afresh each time and the first touch faults it in.
FAULTS = textwrap.dedent(
  """
  import resource, jax, jax.numpy as jnp
  f = jax.jit(lambda x: jnp.sin(x) + 1.0)
  x = jnp.ones((4096, 4096), jnp.float32)
  f(x).block_until_ready()
  flt = []
  for _ in range(5):
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y = f(x).block_until_ready()
    del y
    flt.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
  print(sorted(flt)[2])
  """
)


@needs_thp
def test_huge_pages_cut_the_page_faults_of_a_large_buffer():
  def faults(**env):
    p = _python(FAULTS, timeout=120, JAX_PLATFORMS="cpu", **env)
    assert p.returncode == 0, p.stderr
    return int(p.stdout.split()[-1])

  plain, huge = faults(), faults(GLIBC_TUNABLES=ON)
  assert plain >= 64 * 2**20 // 4096 * 3 // 4, plain  # most of its 4 KiB pages, every call
  assert huge * 8 < plain, (huge, plain)
