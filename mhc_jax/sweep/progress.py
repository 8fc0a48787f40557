"""Progress of a whole sweep: runs done / running / failed / pending and an ETA.

On a terminal it is a tqdm bar over the runs (``done+failed / total``, the other counts and the
ETA after it); elsewhere (logs, CI) one line each time a count changes, and at most every
``every_s`` seconds otherwise.

The ETA: each unfinished run's remaining fraction (a running run's from the last step in its
``metrics.jsonl`` over ``train.steps``; a pending run's is 1), summed, times the typical time of
one run (the median ``wall_s`` of the runs finished so far; before any has finished, the
running runs' elapsed time over their fraction done), divided by the number of runs that run at
once: ``parallel``, or more where populations train many runs in one process.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from mhc_jax.sweep.manifest import counts

__all__ = ["SweepProgress", "format_eta", "last_step"]


def format_eta(seconds: float | None) -> str:
  if seconds is None or seconds != seconds or seconds < 0:
    return "?"
  s = int(round(seconds))
  if s >= 3600:
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
  if s >= 60:
    return f"{s // 60}m{s % 60:02d}s"
  return f"{s}s"


def last_step(metrics: Path) -> int | None:
  """The last step logged in a metrics.jsonl (reads only its tail)."""
  try:
    with open(metrics, "rb") as f:
      f.seek(0, 2)
      size = f.tell()
      f.seek(max(0, size - 65536))
      lines = f.read().splitlines()
  except OSError:
    return None
  for line in reversed(lines):
    try:
      return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
      continue
  return None


class SweepProgress:
  def __init__(
    self,
    name: str,
    sweep_dir: Path,
    steps: dict,
    parallel: int,
    *,
    enabled: bool = True,
    every_s: float = 30.0,
    stream=None,
    tty: bool | None = None,
  ):
    """`steps`: {run name: train.steps} for the runs of this sweep."""
    self.name, self.dir, self.steps = name, Path(sweep_dir), dict(steps)
    self.parallel = max(1, parallel)
    self.enabled, self.every_s = enabled, every_s
    self.stream = stream or sys.stdout
    self.tty = enabled and (sys.stderr.isatty() if tty is None else tty)
    self.bar = None
    self.last_line, self.last_time = None, 0.0
    self.started: dict = {}  # run -> monotonic time it was first seen running

  def estimate(self, runs: dict) -> float | None:
    now = time.monotonic()
    walls = [
      float(i["wall_s"])
      for n, i in runs.items()
      if n in self.steps and i.get("status") == "done" and i.get("wall_s")
    ]
    remaining, rates, running = 0.0, [], 0
    for n, info in runs.items():
      if n not in self.steps:
        continue
      status = info.get("status")
      if status in ("done", "failed"):
        continue
      frac = 0.0
      if status == "running":
        running += 1
        self.started.setdefault(n, now)
        step = last_step(self.dir / info.get("dir", f"runs/{n}") / "metrics.jsonl")
        if step is not None and self.steps[n]:
          frac = min(1.0, (step + 1) / self.steps[n])
          done_since = frac - min(frac, (info.get("resumed_from") or 0) / self.steps[n])
          if done_since > 0.05:
            rates.append((now - self.started[n]) / done_since)
      remaining += 1.0 - frac
    if remaining == 0:
      return 0.0
    per_run = statistics.median(walls) if walls else (statistics.median(rates) if rates else None)
    if per_run is None:
      return None
    return remaining * per_run / max(self.parallel, running)

  def line(self, runs: dict) -> str:
    c = counts({n: i for n, i in runs.items() if n in self.steps})
    return (
      f"sweep {self.name}: {c['done']}/{len(self.steps)} done, {c['running']} running, "
      f"{c['failed']} failed, {c['pending']} pending; ETA {format_eta(self.estimate(runs))}"
    )

  def update(self, manifest: dict | None, force: bool = False) -> None:
    if not self.enabled or not manifest:
      return
    runs = manifest.get("runs", {})
    c = counts({n: i for n, i in runs.items() if n in self.steps})
    if self.tty:
      if self.bar is None:
        self.bar = tqdm(
          total=len(self.steps),
          unit="run",
          desc=f"sweep {self.name}",
          bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {postfix}",
          dynamic_ncols=True,
        )
      self.bar.n = c["done"] + c["failed"]
      self.bar.set_postfix_str(
        f"{c['running']} running, {c['failed']} failed, ETA {format_eta(self.estimate(runs))}"
      )
      return
    key = tuple(sorted(c.items()))
    now = time.monotonic()
    if force or key != self.last_line or now - self.last_time >= self.every_s:
      self.last_line, self.last_time = key, now
      print(self.line(runs), file=self.stream, flush=True)

  def write(self, msg: str) -> None:
    """A line that does not break the bar."""
    if self.bar is not None:
      self.bar.write(msg)
    else:
      print(msg, file=self.stream, flush=True)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
      self.bar = None
