"""Timing shared by the benchmarks: medians after warm-up, each call blocked on."""

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
