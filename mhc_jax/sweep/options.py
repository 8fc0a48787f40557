"""How a sweep runs (not what it trains): the sweep file's ``parallel`` and ``executor`` (a kind,
``local`` or ``slurm``, or a mapping of ``kind`` and submitit parameters) and the ``--parallel`` /
``--executor`` flags, validated."""

from __future__ import annotations

import os
import re
from typing import Any
from unittest import mock

from mhc_jax.errors import ConfigError

EXECUTORS = ("local", "slurm")


def parse_parallel(value: Any, where: str = "--parallel") -> int:
  """A positive integer, or ConfigError naming `where`."""
  text = value.strip() if isinstance(value, str) else value
  if isinstance(text, str) and re.fullmatch(r"[0-9]+", text):
    text = int(text)
  if isinstance(text, bool) or not isinstance(text, int) or text < 1:
    raise ConfigError(f"{where}: expected a positive integer, got {value!r}")
  return text


def executor_options(raw: Any, cli_kind: str | None) -> tuple[str, dict]:
  """(kind, submitit parameters) from the sweep file's ``executor`` setting and --executor."""
  raw = {"kind": raw} if isinstance(raw, str) else ({} if raw is None else raw)
  if not isinstance(raw, dict):
    raise ConfigError(
      f"executor: expected a mapping (kind: local|slurm, then submitit parameters) or a kind, "
      f"got {raw!r}"
    )
  if "folder" in raw:
    raise ConfigError("executor.folder: the submitit folder is SWEEP_DIR/submitit; do not set it")
  kind = cli_kind or raw.get("kind") or "local"
  if kind not in EXECUTORS:
    where = "--executor" if cli_kind else "executor.kind"
    raise ConfigError(f"{where}: unknown executor {kind!r} (known: {', '.join(EXECUTORS)})")
  params = {k: v for k, v in raw.items() if k != "kind"}
  if cli_kind and cli_kind != raw.get("kind", cli_kind):
    params = {}  # the file's parameters are for another kind
  submitit = import_submitit()
  cls = submitit.LocalExecutor if kind == "local" else submitit.SlurmExecutor
  valid = set(cls._valid_parameters()) | set(submitit.AutoExecutor._valid_parameters())
  valid |= {"timeout_min"} | (
    {f"slurm_{p}" for p in cls._valid_parameters()} if kind == "slurm" else set()
  )
  for k in params:
    if k not in valid:
      raise ConfigError(
        f"executor.{k}: not a submitit parameter for {kind} (known: {', '.join(sorted(valid))})"
      )
  return kind, params


def import_submitit():
  """submitit, without its import-time logging set-up in the sweep's process (that binds
  handlers to the sys.stdout/stderr of the moment, which need not outlive it)."""
  with mock.patch.dict(os.environ, SUBMITIT_LOG_LEVEL="NOCONFIG"):
    import submitit
  return submitit
