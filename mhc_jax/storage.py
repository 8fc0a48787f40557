"""Paths that may be local or on an object store, and atomic writes.

:func:`path` is an etils ``epath`` (orbax's), so ``gs://bucket/runs/x`` stays an object-store
path instead of a local ``gs:/bucket`` folder; :func:`is_local` tells the kinds apart.
:func:`write_bytes_atomic` (and the text / JSON forms) never leaves half a file for a reader:
locally a fsynced temporary file renamed over the target; on an object store one whole upload.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
from etils import epath

Path = epath.Path


def path(p: str | os.PathLike) -> epath.Path:
  """An epath for ``p`` (local path or URL such as ``gs://bucket/dir``)."""
  return p if isinstance(p, epath.Path) else epath.Path(p)


def is_local(p: str | os.PathLike) -> bool:
  return "://" not in os.fspath(p)


def json_default(o: Any) -> Any:
  """``json`` ``default`` hook: numpy / jax scalars and arrays -> plain Python (lists)."""
  if isinstance(o, np.generic) or hasattr(o, "__array__"):
    a = np.asarray(o)
    if a.dtype.kind == "V":  # bfloat16 and other ml_dtypes floats
      a = a.astype(np.float64)
    if a.dtype.kind == "c":
      raise TypeError(f"complex values are not JSON-serialisable: {o!r}")
    return a.tolist()
  if isinstance(o, Mapping):
    return dict(o)
  if isinstance(o, (set, frozenset)):
    return sorted(o)
  if isinstance(o, os.PathLike):
    return os.fspath(o)
  raise TypeError(f"Object of type {type(o).__name__} is not JSON serialisable")


def _fsync_dir(d: str) -> None:
  with contextlib.suppress(OSError):  # not every platform can open or fsync a directory
    fd = os.open(d, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


def write_bytes_atomic(p: str | os.PathLike, data: bytes, mode: int | None = None) -> None:
  """Replace ``p`` with ``data`` so that readers see the old file or the new one, never half
  (its directory is made if missing)."""
  if not is_local(p):
    path(p).write_bytes(data)
    return
  target = os.fspath(p)
  d = os.path.dirname(os.path.abspath(target))
  os.makedirs(d, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=d)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o644 if mode is None else mode)
    os.replace(tmp, target)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise
  _fsync_dir(d)


def write_text_atomic(p: str | os.PathLike, text: str) -> None:
  write_bytes_atomic(p, text.encode("utf-8"))


def write_json_atomic(p: str | os.PathLike, obj: Any) -> None:
  """JSON (indented, numpy values as plain Python, non-finite floats as NaN/Infinity)."""
  write_text_atomic(p, json.dumps(obj, indent=1, default=json_default, allow_nan=True) + "\n")


def read_json(p: str | os.PathLike, default: Any = None) -> Any:
  """The JSON in ``p``; ``default`` when it is missing or not (yet) valid JSON."""
  p = path(p)
  try:
    return json.loads(p.read_text())
  except (FileNotFoundError, NotADirectoryError, ValueError):
    return default
