"""How a sweep runs (not what it trains): the ``parallel`` and ``executor`` settings of a sweep
file and the ``--parallel`` / ``--executor`` flags, validated. Read by :mod:`mhc_jax.sweep.grid`
when it loads a sweep file and applied by :mod:`mhc_jax.sweep.runner`.

``executor`` is a kind (``local``: submitit's LocalExecutor; ``slurm``) or a mapping of ``kind``
and submitit parameters (``timeout_min``, ``gpus_per_node``, ``slurm_partition``, ...).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from mhc_jax.errors import ConfigError

__all__ = ["EXECUTORS", "parse_parallel", "executor_options", "import_submitit"]

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
  if "submitit" not in sys.modules:
    old = os.environ.get("SUBMITIT_LOG_LEVEL")
    os.environ["SUBMITIT_LOG_LEVEL"] = "NOCONFIG"
    try:
      import submitit  # noqa: F401
    finally:
      if old is None:
        os.environ.pop("SUBMITIT_LOG_LEVEL", None)
      else:
        os.environ["SUBMITIT_LOG_LEVEL"] = old
  return sys.modules["submitit"]
