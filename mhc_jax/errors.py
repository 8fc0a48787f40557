"""What can go wrong that a user can act on, and the exit codes of ``mhc-jax``: bad input exits 2
with one ``error: ...`` line before anything is written; a run halted by policy exits 3; SIGTERM
exits 143 after a checkpoint; a sweep with a failed run exits 1."""

from __future__ import annotations

import sys

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_HALTED, EXIT_PREEMPTED = 0, 1, 2, 3, 143


class BadInput(Exception):
  """Input the user must fix: exit 2, one line, nothing written."""


class ConfigError(BadInput, ValueError):
  """A bad config. The message names the dotted key and says what is wrong."""


class UsageError(BadInput):
  """Bad input that is not a config key (paths, flags)."""


class RunLocked(UsageError):
  """The run directory is in use by another trainer (the message names it)."""


class RunHalted(RuntimeError):
  """The run stopped by policy (non-finite values or divergence) after saving a checkpoint."""


class Preempted(RuntimeError):
  """SIGTERM: a checkpoint was saved and the run can be resumed."""


def report(message: str, code: int = EXIT_BAD_INPUT) -> int:
  """Print ``error: message`` (one line) on stderr; returns ``code``."""
  print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
  return code
