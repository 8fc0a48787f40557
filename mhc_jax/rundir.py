"""Run directories (local or ``gs://...``): naming, the never-overwrite and resume rules, the
one-trainer lock, summaries. The rules are in docs/interfaces.md ("Run directory")."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import time

from mhc_jax import storage
from mhc_jax.errors import RunLocked, UsageError

RUN_FILES = ("config.yaml", "metrics.jsonl", "events.jsonl", "summary.json", "checkpoints")
LOCK_NAME = ".lock"
FINISHED = ("done", "halted", "diverged")  # a resume of these changes nothing


def default_run_dir(name: str, config_hash: str) -> storage.Path:
  """``runs/<name>/<timestamp>-<config hash>``: never an existing directory."""
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  base = storage.path("runs") / name / f"{stamp}-{config_hash}"
  p, i = base, 1
  while p.exists():
    p, i = base.parent / f"{base.name}-{i}", i + 1
  return p


def holds_run(run_dir) -> bool:
  """Whether ``run_dir`` holds (part of) a run."""
  run_dir = storage.path(run_dir)
  return any((run_dir / n).exists() for n in RUN_FILES)


def check(run_dir, resume: bool, flag: str = "--out") -> None:
  """UsageError unless ``run_dir`` can take a new run (``resume=False``) or be resumed."""
  run_dir = storage.path(run_dir)
  if run_dir.exists() and not run_dir.is_dir():
    raise UsageError(f"{flag}: {run_dir} exists and is not a directory")
  if resume:
    if not (run_dir / "config.yaml").exists():
      raise UsageError(f"--resume: {run_dir} is not a run directory (no config.yaml)")
  elif run_dir.exists() and any(p.name != LOCK_NAME for p in run_dir.iterdir()):
    raise UsageError(
      f"{flag}: {run_dir} already holds a run; pass --resume to continue it or "
      f"choose another directory (runs are never overwritten)"
    )


def checkpoint_steps(run_dir) -> set[int]:
  """Steps of the finalised checkpoints on disk (orbax names step directories by the step)."""
  d = storage.path(run_dir) / "checkpoints"
  if not d.is_dir():
    return set()
  return {int(p.name) for p in d.iterdir() if p.name.isdigit() and p.is_dir()}


#: summary.json status -> the sweep's status of the run (anything else: not finished)
SWEEP_STATUS = {"done": "done", "diverged": "done", "halted": "failed", "failed": "failed"}


def read_summary(run_dir) -> dict:
  """``summary.json`` as a dict ({} when missing or unreadable)."""
  s = storage.read_json(storage.path(run_dir) / "summary.json", {})
  return s if isinstance(s, dict) else {}


def write_summary(run_dir, summary: dict) -> None:
  storage.write_json_atomic(storage.path(run_dir) / "summary.json", summary)


def record_mixer(run_dir, mixer: str) -> None:
  """``mixer_source.json``: where a mixer from outside the package came from (nothing for the
  zoo's): the file of its module and its package's ``__version__``."""
  from mhc_jax import mixers

  mod = sys.modules[mixers.resolve(mixer).__module__]
  if not mod.__name__.startswith("mhc_jax."):
    version = getattr(sys.modules[mod.__name__.split(".")[0]], "__version__", None)
    out = {"mixer": mixer, "file": getattr(mod, "__file__", None), "version": version}
    storage.write_json_atomic(storage.path(run_dir) / "mixer_source.json", out)


def mixer_note(run_dir) -> str:
  """What ``mixer_source.json`` says, for an error about the run's mixer ("" without one)."""
  s = storage.read_json(storage.path(run_dir) / "mixer_source.json", {})
  version = f" ({s['version']})" if s.get("version") else ""
  return f"; this run was trained with {s['mixer']} from {s['file']}{version}" if s else ""


# ------------------------------------------------------------------------------------------ Locking
def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # someone else's process
    return True
  return True


def _describe(info: dict | None) -> str:
  if not info:
    return "another trainer"
  since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
  return f"pid {info.get('pid')} on host {info.get('host')} (since {since})"


class Lock:
  """Exclusive use of a run directory by this process (taking it again nests); RunLocked names
  the holder. A context manager."""

  _held: dict[str, list] = {}  # key -> [depth, the flock's fd or None]

  def __init__(self, run_dir):
    self.run_dir = storage.path(run_dir)
    self.file = self.run_dir / LOCK_NAME
    local = storage.is_local(run_dir)
    self.key = os.path.abspath(os.fspath(run_dir)) if local else os.fspath(run_dir)

  def acquire(self) -> "Lock":
    if self.key in Lock._held:
      Lock._held[self.key][0] += 1
      return self
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    local = storage.is_local(self.run_dir)
    fd = self._flock(info) if local else self._claim(info)
    Lock._held[self.key] = [1, fd]
    return self

  def _locked(self, holder: dict | None) -> RunLocked:
    return RunLocked(
      f"--out: {self.run_dir} is in use by {_describe(holder)}; wait for it to finish or "
      f"stop it (a killed trainer's lock is released with it)"
    )

  def _flock(self, info: dict) -> int:
    import fcntl

    self.run_dir.mkdir(parents=True, exist_ok=True)
    path = os.fspath(self.file)
    while True:
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        raw = os.read(fd, 4096)
        os.close(fd)
        try:
          holder = json.loads(raw)
        except ValueError:
          holder = None
        raise self._locked(holder) from None
      try:  # the holder may have removed the file between our open and our flock
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
          break
      except FileNotFoundError:
        pass
      os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(info).encode())
    return fd

  def _claim(self, info: dict) -> None:
    """An object store has no flock: the file is the lock; a dead process's on this host is
    stale."""
    holder = storage.read_json(self.file)
    if holder is not None and not (
      holder.get("host") == info["host"] and not _pid_alive(int(holder.get("pid", -1)))
    ):
      raise self._locked(holder)
    self.run_dir.mkdir(parents=True, exist_ok=True)
    self.file.write_text(json.dumps(info))

  def release(self) -> None:
    held = Lock._held.get(self.key)
    if held is None:
      return
    held[0] -= 1
    if held[0]:
      return
    del Lock._held[self.key]
    with contextlib.suppress(FileNotFoundError):
      self.file.unlink()
    if held[1] is not None:
      os.close(held[1])  # closing releases the flock

  def __enter__(self) -> "Lock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()
