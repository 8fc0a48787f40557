"""Data sources: wind-tunnel tasks with exact posteriors, and byte-level text.

`make_source(task, seq_len=..., seed=..., **options)` builds one by name; the sources, their
options and the `batch` contract: docs/interfaces.md, "Data sources".
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Protocol

from mhc_jax.data.text import ByteWindows as ByteWindows, TextSource
from mhc_jax.data.windtunnel import BijectionTask, HMMTask, WindTunnel as WindTunnel


class Source(Protocol):
  vocab_size: int
  seq_len: int
  has_posterior: bool

  def batch(self, step: int, batch_size: int, split: str = "train") -> dict[str, Any]: ...


def _tfds() -> type:
  from mhc_jax.data.tfds_source import TFDSSource  # imports tensorflow_datasets lazily

  return TFDSSource


def _options_of(cls) -> set[str]:
  params = inspect.signature(cls).parameters
  return {n for n in params if n not in ("seq_len", "seed")}


SOURCES: dict[str, tuple[Callable[..., Source], Callable[[], set[str]]]] = {
  "bijection": (BijectionTask, lambda: _options_of(BijectionTask)),
  "hmm": (HMMTask, lambda: _options_of(HMMTask)),
  "text": (TextSource, lambda: _options_of(TextSource)),
  "tfds": (lambda **kw: _tfds()(**kw), lambda: _options_of(_tfds())),
}


def make_source(task: str, *, seq_len: int, seed: int, **options: Any) -> Source:
  """Build data source `task` (docs/interfaces.md). Unknown names or options raise ValueError."""
  if task not in SOURCES:
    raise ValueError(f"unknown data task {task!r}; known: {sorted(SOURCES)}")
  factory, known = SOURCES[task]
  allowed = known()
  unknown = sorted(set(options) - allowed)
  if unknown:
    raise ValueError(
      f"unknown option(s) {unknown} for data task {task!r}; known options: {sorted(allowed)}"
    )
  return factory(seq_len=seq_len, seed=seed, **options)
