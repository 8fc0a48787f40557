"""How a sweep runs (not what it trains): the ``parallel`` and ``executor`` settings of a sweep
file and the ``--parallel`` / ``--executor`` flags, validated. Read by :mod:`mhc_jax.sweep.grid`
when it loads a sweep file and applied by :mod:`mhc_jax.sweep.executor`; kept apart from both so
that neither imports the other.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from mhc_jax.train.config import ConfigError

__all__ = ["EXECUTORS", "parse_parallel", "executor_options", "import_submitit"]

EXECUTORS = ("process", "submitit-local", "slurm")
_RESERVED_EXECUTOR_KEYS = ("kind", "folder")


def parse_parallel(value: Any, where: str = "--parallel") -> int:
  """A positive integer, or ConfigError naming `where`."""
  if isinstance(value, bool):
    raise ConfigError(f"{where}: expected a positive integer, got {value!r}")
  raw = value
  if isinstance(value, str):
    text = value.strip()
    if not re.fullmatch(r"[0-9]+", text) or int(text) < 1:
      raise ConfigError(f"{where}: expected a positive integer, got {raw!r}")
    value = int(text)
  if not isinstance(value, int) or value < 1:
    raise ConfigError(f"{where}: expected a positive integer, got {value!r}")
  return value


def executor_options(raw: Any, cli_kind: str | None) -> tuple[str, dict]:
  """(kind, submitit parameters) from the sweep file's ``executor`` setting and --executor."""
  if raw is None:
    raw = {}
  if isinstance(raw, str):
    raw = {"kind": raw}
  if not isinstance(raw, dict):
    raise ConfigError(
      f"executor: expected a mapping (kind: process|submitit-local|slurm, then "
      f"submitit parameters) or a kind, got {raw!r}"
    )
  params = {k: v for k, v in raw.items() if k not in _RESERVED_EXECUTOR_KEYS}
  kind = cli_kind or raw.get("kind") or "process"
  where = "--executor" if cli_kind else "executor.kind"
  if kind not in EXECUTORS:
    raise ConfigError(f"{where}: unknown executor {kind!r} (known: {', '.join(EXECUTORS)})")
  if "folder" in raw:
    raise ConfigError("executor.folder: the submitit folder is SWEEP_DIR/submitit; do not set it")
  if kind == "process" and params and cli_kind:
    params = {}  # --executor process: the file's submitit parameters are for another kind
  if kind == "process" and params:
    raise ConfigError(
      f"executor.{next(iter(params))}: the process executor takes no parameters "
      f"(they are for submitit-local and slurm)"
    )
  if kind != "process":
    _check_submitit_params(kind, params)
  return kind, params


def import_submitit():
  """submitit, without its import-time logging set-up in this (the sweep's) process: that binds
  handlers to the sys.stdout/stderr of the moment, which need not outlive it (a job's own
  process still configures submitit's logging as usual)."""
  if "submitit" in sys.modules:
    return sys.modules["submitit"]
  old = os.environ.get("SUBMITIT_LOG_LEVEL")
  os.environ["SUBMITIT_LOG_LEVEL"] = "NOCONFIG"
  try:
    import submitit
  finally:
    if old is None:
      os.environ.pop("SUBMITIT_LOG_LEVEL", None)
    else:
      os.environ["SUBMITIT_LOG_LEVEL"] = old
  return submitit


def _check_submitit_params(kind: str, params: dict) -> None:
  try:
    submitit = import_submitit()
  except ImportError:
    raise ConfigError(f"--executor {kind}: needs submitit (pip install -e '.[cluster]')") from None
  cls = submitit.LocalExecutor if kind == "submitit-local" else submitit.SlurmExecutor
  generic = set(submitit.AutoExecutor._valid_parameters())
  valid = set(cls._valid_parameters()) | generic | {"timeout_min"}
  if kind == "slurm":
    valid |= {f"slurm_{p}" for p in cls._valid_parameters()}
  for k in params:
    if k not in valid:
      raise ConfigError(
        f"executor.{k}: not a submitit parameter for {kind} (known: {', '.join(sorted(valid))})"
      )
