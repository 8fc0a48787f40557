"""Byte-level language modelling from local text files, with resumable deterministic batches.

Windows of `seq_len + 1` bytes, stride `seq_len`, the last `val_fraction` of the bytes held out;
batch `step` is a pure function of `(seed, split, step)` (docs/interfaces.md, "Data sources").
"""

from __future__ import annotations

import glob
import os
from typing import Iterable

import numpy as np

SPLITS = {"train": 0, "validation": 1}
_GLOB_CHARS = set("*?[")


def stdlib_dir() -> str:
  """Folder of the Python standard library's own source files."""
  return os.path.dirname(os.__file__)


def resolve_files(path: str | None, pattern: str | None = None) -> list[str]:
  """The files a `path` (file, folder, or glob) names, sorted.

  A folder is searched with `pattern` (recursive `**` allowed; default `**/*`, all files).
  `path=None` is the standard library with pattern `*.py`. Raises FileNotFoundError naming the
  path when it does not exist or matches no file.
  """
  if path is None:
    path, pattern = stdlib_dir(), pattern or "*.py"
  path = os.path.expanduser(str(path))
  if os.path.isfile(path):
    return [path]
  if os.path.isdir(path):
    pat = os.path.join(path, pattern or "**/*")
    missing = f"no files matching {pattern or '**/*'!r} in text data folder {path!r}"
  elif _GLOB_CHARS & set(path):
    pat, missing = path, f"no files match the text data glob {path!r}"
  else:
    raise FileNotFoundError(f"text data path does not exist: {path!r}")
  files = sorted(f for f in glob.glob(pat, recursive=True) if os.path.isfile(f))
  if not files:
    raise FileNotFoundError(missing)
  return files


def read_corpus(files: Iterable[str], max_bytes: int | None = None) -> np.ndarray:
  """Concatenated bytes of `files` as uint8, at most `max_bytes` of them."""
  chunks, total = [], 0
  for f in files:
    with open(f, "rb") as fh:
      data = fh.read() if max_bytes is None else fh.read(max_bytes - total)
    chunks.append(data)
    total += len(data)
    if max_bytes is not None and total >= max_bytes:
      break
  return np.frombuffer(b"".join(chunks), dtype=np.uint8)


class ByteWindows:
  """Train/validation windows over a byte corpus and the step -> batch map (see module doc)."""

  vocab_size = 256
  has_posterior = False

  def __init__(
    self,
    corpus: np.ndarray,
    *,
    seq_len: int,
    seed: int,
    val_fraction: float = 0.05,
    validation: np.ndarray | None = None,
    name: str = "text corpus",
  ):
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
      raise ValueError(f"option 'seq_len' must be a positive integer, got {seq_len!r}")
    number = isinstance(val_fraction, (int, float)) and not isinstance(val_fraction, bool)
    if not (number and 0.0 <= val_fraction < 1.0):
      raise ValueError(f"option 'val_fraction' must be in [0, 1), got {val_fraction!r}")
    self.seq_len, self.seed = int(seq_len), int(seed)
    corpus = np.asarray(corpus, dtype=np.uint8)
    if validation is None:
      n_val = int(round(len(corpus) * val_fraction))
      train, validation = corpus[: len(corpus) - n_val], corpus[len(corpus) - n_val :]
    else:
      train, validation = corpus, np.asarray(validation, dtype=np.uint8)
    self._data = {"train": train, "validation": validation}
    self._n_windows = {s: max(0, (len(a) - 1) // self.seq_len) for s, a in self._data.items()}
    if self._n_windows["train"] == 0:
      raise ValueError(
        f"{name} has {len(train)} train bytes, fewer than one window of seq_len + 1 = "
        f"{self.seq_len + 1}; use more data or a smaller seq_len"
      )
    self._perm_cache: dict[tuple[int, int], np.ndarray] = {}

  def num_windows(self, split: str = "train") -> int:
    return self._n_windows[self._check_split(split)]

  def num_bytes(self, split: str = "train") -> int:
    return len(self._data[self._check_split(split)])

  def epoch(self, step: int, batch_size: int, split: str = "train") -> int:
    """The epoch that batch `step` starts in."""
    return (step * batch_size) // self.num_windows(split)

  def _check_split(self, split: str) -> str:
    if split not in SPLITS:
      raise ValueError(f"unknown split {split!r}; expected one of {sorted(SPLITS)}")
    return split

  def _perm(self, split: str, epoch: int) -> np.ndarray:
    key = (SPLITS[split], epoch)
    if key not in self._perm_cache:
      if len(self._perm_cache) > 4:
        self._perm_cache.clear()
      rng = np.random.default_rng([self.seed, SPLITS[split], epoch])
      self._perm_cache[key] = rng.permutation(self._n_windows[split])
    return self._perm_cache[key]

  def window_starts(self, step: int, batch_size: int, split: str = "train") -> np.ndarray:
    """Byte offsets (within the split) of the windows of batch `step`."""
    split = self._check_split(split)
    if step < 0 or batch_size < 1:
      raise ValueError(f"need step >= 0 and batch_size >= 1, got {step}, {batch_size}")
    n = self._n_windows[split]
    if n == 0:
      raise ValueError(
        f"the {split!r} split has no window of seq_len + 1 = {self.seq_len + 1} bytes "
        f"({len(self._data[split])} bytes); raise 'val_fraction' or lower seq_len"
      )
    pos = step * batch_size + np.arange(batch_size, dtype=np.int64)
    epochs, idx = pos // n, pos % n
    win = np.empty(batch_size, dtype=np.int64)
    for e in np.unique(epochs):
      sel = epochs == e
      win[sel] = self._perm(split, int(e))[idx[sel]]
    return win * self.seq_len

  def baseline(self, batch_size: int, batches: int) -> float:
    """The held-out loss (nats per byte) of the context-free byte-frequency predictor:
    training-split counts, add-one smoothed, scored on validation batches ``0 .. batches-1``
    (the batches a run's evaluation reads). A run not clearly below it has learned no context
    (the failure rule: docs/sweeps.md, "Stability maps")."""
    counts = np.bincount(self._data["train"], minlength=self.vocab_size) + 1.0
    logp = np.log(counts / counts.sum())
    val = [self.batch(i, batch_size, "validation")["targets"] for i in range(batches)]
    return float(-logp[np.concatenate(val).ravel()].mean())

  def batch(self, step: int, batch_size: int, split: str = "train") -> dict[str, np.ndarray]:
    starts = self.window_starts(step, batch_size, split)
    w = self._data[split][starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)
    mask = np.ones((batch_size, self.seq_len), np.float32)
    return {"inputs": w[:, :-1], "targets": w[:, 1:], "mask": mask}


class TextSource(ByteWindows):
  """Byte-level LM over the files `path` names (:func:`resolve_files`), at most `max_bytes`."""

  def __init__(
    self,
    *,
    seq_len: int,
    seed: int,
    path: str | None = None,
    pattern: str | None = None,
    val_fraction: float = 0.05,
    max_bytes: int | None = None,
  ):
    bad = isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1
    if max_bytes is not None and bad:
      raise ValueError(f"option 'max_bytes' must be a positive integer, got {max_bytes!r}")
    self.files = resolve_files(path, pattern)
    self.path = path if path is not None else stdlib_dir()
    corpus = read_corpus(self.files, max_bytes)
    name = f"text data at {self.path!r}"
    super().__init__(corpus, seq_len=seq_len, seed=seed, val_fraction=val_fraction, name=name)
