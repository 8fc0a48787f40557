"""The sweep manifest, safe for several workers (processes, or hosts on a shared filesystem).

``SWEEP_DIR/manifest.json`` is one JSON document (its fields: :mod:`mhc_jax.sweep.runner`).
Every change to it -- planning, claims, heartbeats, status changes, results -- goes through
one mechanism, :meth:`Manifest.transact`:

1. take an exclusive POSIX record lock (``fcntl.lockf``) on ``SWEEP_DIR/manifest.lock``
   (a file that is never replaced; within one process a thread lock serialises first, since
   POSIX locks do not exclude threads of the process that holds them);
2. read ``manifest.json`` and check its ``seq`` against the one the lock file holds: on NFS a
   client can briefly see the previous ``manifest.json`` (a cached directory entry), so a
   writer waits until it reads the latest one, and never writes over a newer one;
3. apply the change in memory; if anything changed, write ``seq + 1``, the ``updated`` time and
   the document to a temp file, fsync it, ``os.replace`` it over ``manifest.json`` (atomic on
   POSIX filesystems and NFS) and write the new ``seq`` into the lock file;
4. release the lock.

Readers that only look (the report, progress, tests) read ``manifest.json`` without the lock
and always see a whole document. POSIX locks work across hosts on NFSv3 (lockd) and NFSv4,
and on Lustre/GPFS mounts with locking enabled (Lustre: ``-o flock``); where the filesystem
refuses them (``ENOLCK``, ``EOPNOTSUPP``) the sweep stops with an error rather than running
unlocked. An object store (``gs://``, gcsfuse) has no locks: keep the sweep directory on a
POSIX filesystem; run directories can hold checkpoints there as usual.

Claims and leases: a worker owns a run while the run's entry says ``status: running`` with
its ``owner`` (a random token, host, pid, process start time, cluster job id) and a recent
``heartbeat`` (seconds since the epoch, renewed every ``lease/6`` seconds by
:class:`Heartbeat`). A run held by another owner can be claimed again when that owner is
gone: on the same machine (same hostname, boot id and pid namespace) when its process no
longer exists (pid + start time, so a reused pid does not count); elsewhere when its heartbeat
is older than the lease (``MHC_SWEEP_LEASE_S``, default 120 s; hosts' clocks must agree to
well within it, as NTP keeps them); and at once by a later life of the same cluster job (a
requeued SLURM job keeps its id). Every claim, status change and result is made inside one
transaction that first checks who owns the run, so two workers never both train a run and a
worker that lost its claim cannot overwrite the new owner's result. A run's ``attempts``
counts its claims.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

__all__ = [
  "Manifest",
  "Worker",
  "Heartbeat",
  "ManifestError",
  "lease_seconds",
  "claim_state",
  "FINISHED",
  "counts",
]

FINISHED = ("done", "failed")
MANIFEST, LOCK = "manifest.json", "manifest.lock"
DEFAULT_LEASE_S = 120.0


class ManifestError(RuntimeError):
  """The manifest cannot be read or locked (not bad input: an environment problem)."""


def lease_seconds() -> float:
  """How long a silent owner keeps its claim (``MHC_SWEEP_LEASE_S``, default 120 s)."""
  raw = os.environ.get("MHC_SWEEP_LEASE_S")
  try:
    v = float(raw) if raw else DEFAULT_LEASE_S
  except ValueError:
    v = DEFAULT_LEASE_S
  return v if v > 0 else DEFAULT_LEASE_S


# ------------------------------------------------------------------------------------------
# Who is working.


def _read(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read().strip()
  except OSError:
    return ""


def _machine_id() -> str:
  """Hostname + boot id + pid namespace: where a pid names the same process."""
  try:
    ns = os.readlink("/proc/self/ns/pid")
  except OSError:
    ns = ""
  return f"{socket.gethostname()}/{_read('/proc/sys/kernel/random/boot_id')}/{ns}"


def _start_time(pid: int) -> int | None:
  """The process's start time in clock ticks since boot (/proc/PID/stat field 22)."""
  stat = _read(f"/proc/{pid}/stat")
  if not stat:
    return None
  try:
    return int(stat.rsplit(")", 1)[1].split()[19])
  except (IndexError, ValueError):
    return None


def pid_alive(pid: int, started: int | None) -> bool:
  """Whether process `pid` (started at `started` ticks) still exists (a zombie does not)."""
  stat = _read(f"/proc/{pid}/stat")
  if stat:
    fields = stat.rsplit(")", 1)[1].split()
    if fields and fields[0] in ("Z", "X"):
      return False
    return started is None or _start_time(pid) == started
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _job_id() -> str | None:
  """The cluster job this process belongs to (SLURM, or submitit's local executor)."""
  env = os.environ
  if env.get("SLURM_JOB_ID"):
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
      return f"slurm:{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return f"slurm:{env['SLURM_JOB_ID']}"
  if env.get("SUBMITIT_LOCAL_JOB_ID"):
    return f"local:{socket.gethostname()}:{env['SUBMITIT_LOCAL_JOB_ID']}"
  return None


@dataclasses.dataclass(frozen=True)
class Worker:
  """The identity a claim records."""

  token: str
  host: str
  machine: str
  pid: int
  started: int | None
  job: str | None

  @classmethod
  def current(cls, token: str | None = None) -> "Worker":
    pid = os.getpid()
    return cls(
      token or uuid.uuid4().hex[:12],
      socket.gethostname(),
      _machine_id(),
      pid,
      _start_time(pid),
      _job_id(),
    )

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)

  def describe(self) -> str:
    return f"{self.host}:{self.pid}" + (f" ({self.job})" if self.job else "")


def _describe(owner: dict) -> str:
  return f"{owner.get('host')}:{owner.get('pid')}" + (
    f" ({owner['job']})" if owner.get("job") else ""
  )


def claim_state(
  info: dict, me: Worker, now: float | None = None, lease_s: float | None = None
) -> str:
  """What `me` may do with a run: ``finished`` (done or failed), ``mine`` (claimed by me),
  ``held`` (a live owner has it), ``free`` (pending, or its owner is gone)."""
  status = info.get("status")
  if status in FINISHED:
    return "finished"
  owner = info.get("owner")
  if status != "running" or not isinstance(owner, dict):
    return "free"
  if owner.get("token") == me.token:
    return "mine"
  if me.job and owner.get("job") == me.job:
    return "free"  # an earlier life of this cluster job (it was requeued)
  if owner.get("machine") == me.machine and owner.get("pid"):
    return "held" if pid_alive(int(owner["pid"]), owner.get("started")) else "free"
  now = time.time() if now is None else now
  lease_s = lease_seconds() if lease_s is None else lease_s
  return "held" if now - float(info.get("heartbeat") or 0.0) < lease_s else "free"


def counts(runs: dict) -> dict:
  """{status: number of runs} for pending, running, done and failed."""
  out = {"pending": 0, "running": 0, "done": 0, "failed": 0}
  for info in runs.values():
    s = info.get("status", "pending")
    out[s if s in out else "pending"] += 1
  return out


# ------------------------------------------------------------------------------------------
# The document.


def _dump(m: dict) -> str:
  return json.dumps(m, indent=1, default=str)


class Manifest:
  """``SWEEP_DIR/manifest.json`` and its lock; see the module docstring."""

  _thread_lock = threading.RLock()  # POSIX locks do not exclude a process's own threads

  def __init__(self, sweep_dir: str | os.PathLike, lock_timeout_s: float = 300.0):
    self.dir = Path(sweep_dir)
    self.path = self.dir / MANIFEST
    self.lock_path = self.dir / LOCK
    self.lock_timeout_s = lock_timeout_s

  # ---- reading without the lock
  def read(self) -> dict | None:
    """The latest whole manifest (None when there is none yet); no lock needed."""
    try:
      text = self.path.read_text(encoding="utf-8")
    except FileNotFoundError:
      return None
    try:
      m = json.loads(text)
    except ValueError as e:
      raise ManifestError(f"{self.path} is not valid JSON ({e})") from None
    if not isinstance(m, dict) or not isinstance(m.get("runs"), dict):
      raise ManifestError(f"{self.path} is not a sweep manifest (no 'runs' mapping)")
    return m

  # ---- the one way to change it
  def report_lock(self):
    """An exclusive lock for writing the report (several sweep commands may finish at once)."""
    return self._locked(self.dir / "report.lock")

  @contextlib.contextmanager
  def _locked(self, path: Path | None = None):
    path = path or self.lock_path
    with self._thread_lock:
      self.dir.mkdir(parents=True, exist_ok=True)
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        deadline = time.monotonic() + self.lock_timeout_s
        delay = 0.005
        while True:
          try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
          except OSError as e:
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
              raise ManifestError(
                f"{path}: the filesystem refuses POSIX locks ({e.strerror}); keep "
                f"the sweep directory on a filesystem with locking (local disk, NFS with "
                f"lockd/NFSv4, Lustre mounted with -o flock)"
              ) from None
            if e.errno not in (errno.EACCES, errno.EAGAIN):
              raise
            if time.monotonic() > deadline:
              raise ManifestError(
                f"{path}: still locked after "
                f"{self.lock_timeout_s:.0f}s (is a worker stopped while "
                f"holding it?)"
              ) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
        try:
          yield fd
        finally:
          fcntl.lockf(fd, fcntl.LOCK_UN)
      finally:
        os.close(fd)

  def _read_current(self, fd: int) -> tuple[dict, int]:
    raw = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    want = int(raw) if raw.isdigit() else 0
    deadline = time.monotonic() + 30.0
    while True:
      m = self.read() or {}
      if int(m.get("seq") or 0) >= want:
        return m, want
      if time.monotonic() > deadline:  # the newer document is gone: say so, never regress
        raise ManifestError(
          f"{self.path}: holds seq {m.get('seq')} but {self.lock_path} says "
          f"{want} was written; the manifest was replaced from outside"
        )
      time.sleep(0.05)  # an NFS client still shows the previous file: wait for the new one

  def _write(self, fd: int, m: dict, last: int) -> None:
    m["seq"] = max(int(m.get("seq") or 0), last) + 1
    m["updated"] = datetime.datetime.now().isoformat(timespec="seconds")
    tmp = self.dir / f".{MANIFEST}.{socket.gethostname()}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(_dump(m))
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, self.path)
    with contextlib.suppress(OSError):  # the rename itself durable (a no-op on some filesystems)
      dfd = os.open(self.dir, os.O_RDONLY)
      try:
        os.fsync(dfd)
      finally:
        os.close(dfd)
    seq = str(m["seq"]).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, seq, 0)
    os.fsync(fd)

  def transact(self, fn: Callable[[dict], Any]) -> Any:
    """Run ``fn(manifest)`` under the lock on the latest manifest (``{}`` when there is none);
    what it changes in place is written atomically. Returns what `fn` returns."""
    with self._locked() as fd:
      m, last = self._read_current(fd)
      before = _dump({k: v for k, v in m.items() if k not in ("seq", "updated")})
      result = fn(m)
      after = _dump({k: v for k, v in m.items() if k not in ("seq", "updated")})
      if after != before:
        if not isinstance(m.get("runs"), dict):
          raise ManifestError("a manifest needs a 'runs' mapping")
        self._write(fd, m, last)
      return result

  # ---- the operations
  def claim(self, names: list[str], me: Worker) -> tuple[list[str], dict]:
    """Claim the runs of `names` that are free for `me`. Returns (claimed names, {name: why
    not} for the others: ``finished`` or ``held by HOST:PID``)."""
    now = time.time()
    lease = lease_seconds()

    def fn(m):
      got, why = [], {}
      for n in names:
        info = m["runs"].get(n)
        if info is None:
          why[n] = "not in the manifest"
          continue
        state = claim_state(info, me, now, lease)
        if state in ("finished", "held"):
          why[n] = state if state == "finished" else f"held by {_describe(info['owner'])}"
          continue
        old = info.get("owner") if info.get("status") == "running" else None
        if state == "free":
          info["attempts"] = int(info.get("attempts") or 0) + 1
          if old and old.get("token") != me.token:
            info["taken_over"] = (
              f"from {_describe(old)} (gone; last heartbeat "
              f"{now - float(info.get('heartbeat') or now):.0f}s before)"
            )
        if state == "free":
          info["claimed_at"] = now
          info.pop("resumed_from", None)  # the new owner says where it starts
        info.update(status="running", owner=me.as_dict(), heartbeat=now, host=me.host)
        info.pop("error", None)
        got.append(n)
      return got, why

    return self.transact(fn)

  def heartbeat(self, names: list[str], me: Worker) -> list[str]:
    """Renew `me`'s claims on `names`; returns the names `me` no longer owns."""
    now = time.time()

    def fn(m):
      lost = []
      for n in names:
        info = m["runs"].get(n, {})
        if info.get("status") == "running" and (info.get("owner") or {}).get("token") == me.token:
          info["heartbeat"] = now
        else:
          lost.append(n)
      return lost

    return self.transact(fn)

  def update_run(self, name: str, token: str | None, **fields) -> bool:
    """Set fields of a run `token` owns (any run when token is None); False if not owned."""

    def fn(m):
      info = m["runs"].get(name)
      if info is None:
        return False
      if token is not None and (
        info.get("status") != "running" or (info.get("owner") or {}).get("token") != token
      ):
        return False
      info.update(fields)
      return True

    return self.transact(fn)

  def finish(
    self, name: str, token: str | None, status: str, *, error: str | None = None, **fields
  ) -> bool:
    """Record a run's end (``done``, ``failed``, or ``pending`` to give it back) -- only by its
    owner `token` (or, with token None, by anyone while no live owner has it)."""

    def fn(m):
      info = m["runs"].get(name)
      if info is None:
        return False
      owner = info.get("owner") if info.get("status") == "running" else None
      if token is not None and (owner or {}).get("token") != token:
        return False
      if token is None and owner and claim_state(info, Worker.current()) == "held":
        return False
      info["status"] = status
      info.pop("owner", None)
      info.pop("heartbeat", None)
      info.pop("error", None)
      if error:
        info["error"] = error
      info.update({k: v for k, v in fields.items() if v is not None})
      return True

    return self.transact(fn)


class Heartbeat:
  """Renews `me`'s claims on `names` in a background thread while the block runs. If a claim
  is lost (another worker took the run over after this one went silent past the lease),
  ``on_lost(names)`` is called (default: exit the process at once, without writing anything
  more: the run belongs to someone else now)."""

  def __init__(
    self,
    manifest: Manifest,
    me: Worker,
    names: list[str],
    every_s: float | None = None,
    on_lost: Callable[[list[str]], None] | None = None,
  ):
    self.manifest, self.me, self.names = manifest, me, list(names)
    self.every_s = every_s or max(0.2, lease_seconds() / 6)
    self.on_lost = on_lost or _exit_lost
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="sweep-heartbeat", daemon=True)

  def _run(self):
    while not self._stop.wait(self.every_s):
      try:
        lost = self.manifest.heartbeat(self.names, self.me)
      except Exception as e:  # noqa: BLE001 - a transient filesystem error: try again later
        print(f"warning: sweep heartbeat failed: {e}", flush=True)
        continue
      if lost and not self._stop.is_set():
        self.on_lost(lost)
        return

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join(timeout=30)


EXIT_LOST_CLAIM = 75


def _exit_lost(names: list[str]) -> None:
  print(
    f"error: lost the claim on {', '.join(names)} (another worker took it over after this "
    f"one missed its heartbeats); stopping without writing",
    flush=True,
  )
  os._exit(EXIT_LOST_CLAIM)
