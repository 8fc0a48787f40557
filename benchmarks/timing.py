"""Timing shared by the benchmarks: medians after warm-up, each call blocked on; programs timed
round-robin, so a VM whose speed drifts during the run moves every program of a round alike."""

from __future__ import annotations

import statistics
import time

import jax


def median_time(fn, steps: int, warmup: int) -> tuple[float, float]:
  """(first call incl. compile [s], median of the timed calls [s])."""
  t = time.perf_counter()
  jax.block_until_ready(fn())
  first = time.perf_counter() - t
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return first, statistics.median(times)


def timed(fn) -> float:
  """Seconds of one call of ``fn``, blocked on."""
  t = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t


def round_robin(calls: dict, steps: int, warmup: int, after_round=None) -> dict:
  """``{name: [seconds per round]}``: ``warmup`` untimed rounds, then ``steps`` timed ones, each
  round one call of every program in ``calls`` (in order), then ``after_round()`` if given."""
  for _ in range(warmup):
    for fn in calls.values():
      timed(fn)
  times = {k: [] for k in calls}
  for _ in range(steps):
    for k, fn in calls.items():
      times[k].append(timed(fn))
    if after_round is not None:
      after_round()
  return times
