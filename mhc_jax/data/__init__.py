"""Data sources: wind-tunnel tasks with exact posteriors, and byte-level text.

`make_source(task, seq_len=..., seed=..., **options)` builds one by name:

| name | class | options |
| --- | --- | --- |
| `bijection` | `BijectionTask` | `n_symbols`, `n_pairs`, `replacement` |
| `hmm` | `HMMTask` | `n_states`, `n_symbols`, `length`, `alpha`, `n_levels`, `predict` (`state` = filtering, default; `observation`), `stickiness` |
| `text` | `TextSource` | `path`, `pattern`, `val_fraction`, `max_bytes` |
| `tfds` | `TFDSSource` (extra `tfds`) | `name`, `data_dir`, `split`, `val_split`, `feature`, `val_fraction`, `download` |

Every source has `vocab_size`, `seq_len`, `has_posterior` and
`batch(step, batch_size, split="train") -> dict` (a deterministic function of
`(seed, split, step)`; splits `train` and `validation`). Batch keys are in docs/interfaces.md and
the module docs of `windtunnel` and `text`. Wind tunnels also have `baselines(inputs)`: exact
reference guesses whose KL to the posterior `mhc-jax eval` prints beside the model's.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Protocol

from mhc_jax.data.text import ByteWindows, TextSource
from mhc_jax.data.windtunnel import BijectionTask, HMMTask, WindTunnel


class Source(Protocol):
  vocab_size: int
  seq_len: int
  has_posterior: bool

  def batch(self, step: int, batch_size: int, split: str = "train") -> dict[str, Any]: ...


def _tfds_source(**kw):
  from mhc_jax.data.tfds_source import TFDSSource  # imports tensorflow_datasets lazily

  return TFDSSource(**kw)


def _tfds_options() -> set[str]:
  from mhc_jax.data import tfds_source

  return _options_of(tfds_source.TFDSSource)


def _options_of(cls) -> set[str]:
  params = inspect.signature(cls).parameters
  return {n for n in params if n not in ("seq_len", "seed")}


SOURCES: dict[str, tuple[Callable[..., Source], Callable[[], set[str]]]] = {
  "bijection": (BijectionTask, lambda: _options_of(BijectionTask)),
  "hmm": (HMMTask, lambda: _options_of(HMMTask)),
  "text": (TextSource, lambda: _options_of(TextSource)),
  "tfds": (_tfds_source, _tfds_options),
}


def make_source(task: str, *, seq_len: int, seed: int, **options: Any) -> Source:
  """Build data source `task` (see the table above). Unknown names or options raise ValueError."""
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


__all__ = [
  "BijectionTask",
  "ByteWindows",
  "HMMTask",
  "SOURCES",
  "Source",
  "TextSource",
  "WindTunnel",
  "make_source",
]
