"""The metrics record: an append-only JSONL writer and pandas readers for runs and sweeps.

The file format, the writer's repair and flush rules, resuming with :func:`truncate_after` and
the sweep manifest: docs/interfaces.md, "Writing and reading the records".
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

if TYPE_CHECKING:  # pandas is imported where a reader needs it: a training process never does
  import pandas as pd

from mhc_jax import storage

EVENT_COLUMNS = ["step", "kind", "value", "threshold"]
LONG_COLUMNS = ["step", "metric", "layer", "value"]


# =========================================================================== writing
def to_jsonable(record: Any) -> str:
  """One record as a single JSON line (no trailing newline); NaN/Infinity allowed."""
  return json.dumps(record, default=storage.json_default, allow_nan=True, separators=(",", ":"))


def _complete_lines(data: bytes) -> bytes:
  """``data`` ending at a line boundary: a last line without its newline is completed if it
  is a whole JSON object, otherwise (a write cut short by a kill) dropped."""
  if not data or data.endswith(b"\n"):
    return data
  cut = data.rfind(b"\n") + 1
  try:
    complete = isinstance(json.loads(data[cut:]), dict)
  except ValueError:
    complete = False
  return data + b"\n" if complete else data[:cut]


def _repair_tail(path: str) -> None:
  """Make the local file ``path`` end at a line boundary (see :func:`_complete_lines`)."""
  if os.path.exists(path):
    with open(path, "r+b") as f:
      data = f.read()
      fixed = _complete_lines(data)
      if fixed != data:
        f.seek(0)
        f.write(fixed)
        f.truncate()


class JsonlWriter:
  """Append-only JSONL writer, one object per line; local files are appended to, an object
  store's file rewritten by :meth:`flush` (docs/interfaces.md). A context manager."""

  def __init__(self, path: str | os.PathLike, fsync: bool = False, flush_secs: float = 30.0):
    self.path = storage.path(path)
    self.fsync = fsync
    self.local = storage.is_local(path)
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self.closed = False
    if self.local:
      _repair_tail(os.fspath(self.path))
      self._f = open(self.path, "a", encoding="utf-8")
    else:
      self._buf = [_complete_lines(self.path.read_bytes()) if self.path.exists() else b""]
      self._dirty = False
      self.flush_secs, self._last = flush_secs, time.monotonic()

  def write(self, record: Mapping[str, Any]) -> None:
    line = to_jsonable(dict(record))  # serialise first: a bad record writes nothing
    if self.local:
      self._f.write(line + "\n")
      self.flush()
      return
    self._buf.append(line.encode() + b"\n")
    self._dirty = True
    if time.monotonic() - self._last >= self.flush_secs:
      self.flush()

  def write_many(self, records: Iterable[Mapping[str, Any]]) -> None:
    for r in records:
      self.write(r)

  def flush(self) -> None:
    """Everything written so far is stored (locally: on disk with ``fsync``)."""
    if self.local:
      if not self.closed:
        self._f.flush()
        if self.fsync:
          os.fsync(self._f.fileno())
      return
    if self._dirty:
      data = b"".join(self._buf)
      self._buf = [data]
      self.path.write_bytes(data)
      self._dirty = False
    self._last = time.monotonic()

  def close(self) -> None:
    if self.closed:
      return
    self.flush()
    if self.local:
      self._f.close()
    self.closed = True

  def __enter__(self) -> "JsonlWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


# =========================================================================== reading
def _parse_lines(raw: bytes, path) -> list[tuple[bytes, Any]]:
  """(line, parsed) for each non-blank line; a bad *last* line is dropped (a write cut
  short), a bad line anywhere else is corruption and raises ValueError."""
  lines = [ln for ln in raw.split(b"\n") if ln.strip()]
  out = []
  for i, line in enumerate(lines):
    try:
      out.append((line, json.loads(line)))
    except ValueError as e:
      if i == len(lines) - 1:
        break
      raise ValueError(f"{path}: corrupt JSONL record {i + 1} (not the last line): {e}") from e
  return out


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
  """All records of a JSONL file; tolerates a truncated last line (dropped)."""
  path = storage.path(path)
  return [rec for _, rec in _parse_lines(path.read_bytes(), path)]


def truncate_after(path: str | os.PathLike, step: int) -> int:
  """Drop records with ``record["step"] > step`` from a JSONL file, atomically (kept lines byte
  for byte, a partial last line dropped); returns how many (0 if the file is missing). Call it
  before opening a writer on the file."""
  path = storage.path(path)
  if not path.exists():
    return 0
  kept, dropped = [], 0
  for line, rec in _parse_lines(path.read_bytes(), path):
    if isinstance(rec, dict) and rec.get("step") is not None and rec["step"] > step:
      dropped += 1
    else:
      kept.append(line)
  mode = stat.S_IMODE(os.stat(path).st_mode) if storage.is_local(path) else None
  storage.write_bytes_atomic(path, b"".join(ln + b"\n" for ln in kept), mode=mode)
  return dropped


def flatten_dict(d: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
  """Nested mappings -> one level with dotted keys (``{"model": {"depth": 4}}`` ->
  ``{"model.depth": 4}``); lists and other values are kept as they are."""
  out: dict[str, Any] = {}
  for k, v in d.items():
    key = f"{prefix}{sep}{k}" if prefix else str(k)
    if isinstance(v, Mapping) and v:
      out.update(flatten_dict(v, key, sep))
    else:
      out[key] = v
  return out


def read_config(run_dir) -> dict[str, Any]:
  """The run's ``config.yaml`` flattened to dotted keys (``{}`` if missing or unreadable)."""
  import yaml

  try:
    cfg = yaml.safe_load((storage.path(run_dir) / "config.yaml").read_text())
  except (OSError, yaml.YAMLError):
    return {}
  return flatten_dict(cfg) if isinstance(cfg, Mapping) else {}


def read_json(path) -> dict[str, Any]:
  """The JSON object in ``path``; ``{}`` when missing, not yet valid, or not an object."""
  out = storage.read_json(path, {})
  return out if isinstance(out, dict) else {}


def _records_by_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Merge records per step (later keys win), flatten nested dicts, sort by step."""
  merged: dict[Any, dict[str, Any]] = {}
  for rec in records:
    if not isinstance(rec, dict) or rec.get("step") is None:
      continue
    merged.setdefault(rec["step"], {}).update(flatten_dict(rec))
  return [merged[s] for s in sorted(merged)]


def _to_long(df: pd.DataFrame) -> pd.DataFrame:
  """Per-layer (list-valued) columns of a wide frame -> rows (step, metric, layer, value)."""
  import pandas as pd

  cols = [c for c in df.columns if df[c].dtype == object]  # the list-valued ones among them
  m = df.melt(id_vars="step", value_vars=cols, var_name="metric")
  is_list = m["value"].map(lambda v: isinstance(v, list) and len(v) > 0).astype(bool)
  m = m.loc[is_list].explode("value")
  try:
    values = m["value"].to_numpy(np.float64)
  except (TypeError, ValueError):  # nested lists (e.g. matrices per layer)
    values = pd.Series(m["value"].tolist(), dtype=object)
  steps, layers = m["step"].to_numpy(np.int64), m.groupby(level=0).cumcount().to_numpy(np.int64)
  metric = pd.Series(m["metric"].tolist(), dtype="str")
  return pd.DataFrame({"step": steps, "metric": metric, "layer": layers, "value": values})


def load_run(run_dir: str | os.PathLike, long: bool = False) -> pd.DataFrame:
  """Metrics of one run: a row per logged step (scalars as columns, per-layer metrics as lists,
  nested dicts dotted), or with ``long`` a row per (step, metric, layer) of the per-layer ones;
  ``attrs``: ``config`` (flattened config.yaml), ``summary`` (summary.json) and ``run_dir``."""
  import pandas as pd

  run_dir = storage.path(run_dir)
  path = run_dir / "metrics.jsonl"
  rows = _records_by_step(read_jsonl(path)) if path.exists() else []
  df = pd.DataFrame(rows) if rows else pd.DataFrame({"step": pd.Series([], dtype=np.int64)})
  df = df[["step"] + [c for c in df.columns if c != "step"]]
  if long:
    df = _to_long(df)
  df.attrs = dict(config=read_config(run_dir), summary=read_json(run_dir / "summary.json"))
  df.attrs["run_dir"] = str(run_dir)
  return df


def load_events(run_dir: str | os.PathLike) -> pd.DataFrame:
  """Events of one run (``events.jsonl``): columns step, kind, value, threshold (+extras),
  in file order; an empty frame with those columns when there are none."""
  import pandas as pd

  path = storage.path(run_dir) / "events.jsonl"
  records = read_jsonl(path) if path.exists() else []
  df = pd.DataFrame(records)
  for c in EVENT_COLUMNS:
    if c not in df.columns:
      df[c] = pd.Series(dtype=np.float64 if c in ("value", "threshold") else object)
  return df[EVENT_COLUMNS + [c for c in df.columns if c not in EVENT_COLUMNS]]


# =========================================================================== sweeps
def sweep_runs(sweep_dir) -> dict[str, dict[str, Any]]:
  """``{name: {"status", "overrides", "dir"}}`` of a sweep's ``manifest.json``, or a one-run
  table for a bare run directory (``dir`` ``.``); FileNotFoundError for anything else."""
  sweep_dir = storage.path(sweep_dir)
  if (sweep_dir / "manifest.json").exists():
    return dict(read_json(sweep_dir / "manifest.json").get("runs", {}))
  if (sweep_dir / "metrics.jsonl").exists() or (sweep_dir / "config.yaml").exists():
    status = read_json(sweep_dir / "summary.json").get("status") or "running"
    return {dir_name(sweep_dir): {"status": status, "overrides": {}, "dir": "."}}
  raise FileNotFoundError(f"{sweep_dir}: neither a sweep (manifest.json) nor a run directory")


def dir_name(p) -> str:
  """The directory's own name (a local path resolved first: ``.`` names its folder)."""
  p = storage.path(p)
  return p.resolve().name if storage.is_local(p) else p.name


def _axis_names(runs: Mapping[str, Mapping[str, Any]]) -> list[str]:
  return list(dict.fromkeys(k for info in runs.values() for k in info.get("overrides") or {}))


def _put_axes(
  df: pd.DataFrame, name: str, overrides: Mapping[str, Any], axis_cols: Mapping[str, str]
) -> pd.DataFrame:
  import pandas as pd

  front: dict[str, Any] = {"run": name}
  for key, col in axis_cols.items():
    v = overrides.get(key)
    front[col] = [v] * len(df) if isinstance(v, (list, dict, tuple)) else v
  head = pd.DataFrame(front, index=df.index) if len(df) else pd.DataFrame({c: [] for c in front})
  return pd.concat([head, df.drop(columns=[c for c in front if c in df.columns])], axis=1)


def load_sweep(sweep_dir: str | os.PathLike, long: bool = False) -> pd.DataFrame:
  """:func:`load_run` of each run in the manifest with metrics, in one frame, ``run`` and a column
  per override key in front (``override.<key>`` where the key is also a metric's name, say
  ``lr``); ``attrs``: ``axes`` (override key -> column), ``runs`` (each run's attrs, status)."""
  import pandas as pd

  sweep_dir = storage.path(sweep_dir)
  runs = sweep_runs(sweep_dir)
  frames: dict[str, pd.DataFrame] = {}
  for name, info in runs.items():
    rdir = sweep_dir / (info.get("dir") or name)
    if not (rdir / "metrics.jsonl").exists():
      continue
    df = load_run(rdir, long=long)
    if len(df):
      frames[name] = df
  taken = {"run"} | {c for df in frames.values() for c in df.columns}
  axis_cols = {k: (f"override.{k}" if k in taken else k) for k in _axis_names(runs)}
  parts, meta = [], {}
  for name, df in frames.items():
    meta[name] = {**df.attrs, "status": runs[name].get("status")}
    parts.append(_put_axes(df, name, runs[name].get("overrides") or {}, axis_cols))
  if parts:
    out = pd.concat(parts, ignore_index=True)
  else:
    base = LONG_COLUMNS if long else ["step"]
    out = pd.DataFrame(columns=["run", *axis_cols.values(), *base])
  out.attrs = {"axes": axis_cols, "runs": meta, "sweep_dir": str(sweep_dir)}
  return out


def load_summaries(sweep_dir: str | os.PathLike) -> pd.DataFrame:
  """One row per run in the manifest: ``run``, ``status``, the override columns, then the
  flattened ``summary.json`` fields (missing summary -> NaN). A summary key that clashes
  with those front columns is prefixed ``summary.``."""
  import pandas as pd

  sweep_dir = storage.path(sweep_dir)
  runs = sweep_runs(sweep_dir)
  axes = _axis_names(runs)
  front = ["run", "status", *axes]
  rows = []
  for name, info in runs.items():
    overrides = info.get("overrides") or {}
    row: dict[str, Any] = {"run": name, "status": info.get("status")}
    row.update({k: overrides.get(k) for k in axes})
    summary = flatten_dict(read_json(sweep_dir / (info.get("dir") or name) / "summary.json"))
    row.update({(f"summary.{k}" if k in front else k): v for k, v in summary.items()})
    rows.append(row)
  df = pd.DataFrame(rows) if rows else pd.DataFrame(columns=front)
  df.attrs = {"axes": {k: k for k in axes}, "sweep_dir": str(sweep_dir)}
  return df
