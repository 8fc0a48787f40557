"""Byte-level LM from a TFDS text dataset (extra `tfds`), e.g. tiny_shakespeare.

Read once into a byte corpus, then windowed like local text (`text.ByteWindows`); how it is read
and what TensorFlow is needed for: docs/interfaces.md, "Data sources".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mhc_jax.data.text import ByteWindows


def _import_tfds():
  try:
    import tensorflow_datasets as tfds
  except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
      "the 'tfds' data source needs tensorflow-datasets: pip install 'mhc_jax[tfds]'"
    ) from e
  return tfds


def _to_bytes(value: Any, feature: str) -> bytes:
  if isinstance(value, bytes):
    return value
  if isinstance(value, str):
    return value.encode("utf-8")
  if isinstance(value, (np.ndarray, np.generic)) and np.ndim(value) == 0:
    return _to_bytes(value.item(), feature)
  raise ValueError(f"TFDS feature {feature!r} is not text (got {type(value).__name__})")


def _raise_if_not_prepared(tfds, name: str, data_dir: str | None, cause: Exception) -> None:
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except Exception:
    return
  if not builder.is_prepared():
    raise FileNotFoundError(
      f"TFDS dataset {name!r} is not prepared in data_dir {data_dir!r} "
      f"(looked in {builder.data_dir!r}); prepare it there or set download=True"
    ) from cause


def read_tfds_text(
  name: str,
  *,
  split: str,
  data_dir: str | None = None,
  feature: str = "text",
  separator: bytes = b"\n",
  download: bool = False,
) -> np.ndarray:
  """The bytes of feature `feature` of every example of `name[split]`, joined by `separator`."""
  tfds = _import_tfds()
  try:
    ds = tfds.data_source(name, split=split, data_dir=data_dir, download=download)
    examples = (ds[i] for i in range(len(ds)))
  except Exception as e:
    from tensorflow_datasets.core.registered import DatasetNotFoundError

    if isinstance(e, DatasetNotFoundError):
      raise ValueError(f"option 'name': no TFDS dataset {name!r} ({e.args[0][:200]})") from e
    _raise_if_not_prepared(tfds, name, data_dir, e)
    if not isinstance(e, NotImplementedError):
      raise
    # Prepared as TFRecord: no random access; read sequentially with TensorFlow.
    try:
      import tensorflow  # noqa: F401
    except ImportError as e2:
      raise ImportError(
        f"TFDS dataset {name!r} in {data_dir!r} is stored as TFRecord, which needs "
        "TensorFlow to read (pip install tensorflow-cpu), or re-prepare it with "
        "file_format='array_record'"
      ) from e2
    examples = tfds.as_numpy(tfds.load(name, split=split, data_dir=data_dir, download=download))
  parts = []
  for ex in examples:
    if feature not in ex:
      raise ValueError(
        f"TFDS dataset {name!r} has no feature {feature!r} (features: {sorted(ex)}); "
        "set option 'feature'"
      )
    parts.append(_to_bytes(ex[feature], feature))
  if not parts:
    raise ValueError(f"TFDS dataset {name!r} split {split!r} has no examples")
  return np.frombuffer(separator.join(parts), dtype=np.uint8)


class TFDSSource(ByteWindows):
  """Byte windows over TFDS `name[split]`; validation `val_split`, or with None the last
  `val_fraction` of train."""

  def __init__(
    self,
    *,
    seq_len: int,
    seed: int,
    name: str = "tiny_shakespeare",
    data_dir: str | None = None,
    split: str = "train",
    val_split: str | None = "validation",
    feature: str = "text",
    val_fraction: float = 0.05,
    download: bool = False,
  ):
    for opt, v in (("name", name), ("split", split), ("feature", feature)):
      if not isinstance(v, str) or not v:
        raise ValueError(f"option {opt!r} must be a non-empty string, got {v!r}")
    if not isinstance(download, bool):
      raise ValueError(f"option 'download' must be a bool, got {download!r}")
    self.name, self.data_dir = name, data_dir
    kw = dict(data_dir=data_dir, feature=feature, download=download)
    corpus = read_tfds_text(name, split=split, **kw)
    validation = None if val_split is None else read_tfds_text(name, split=val_split, **kw)
    super().__init__(
      corpus,
      seq_len=seq_len,
      seed=seed,
      val_fraction=val_fraction,
      validation=validation,
      name=f"TFDS dataset {name!r}[{split}]",
    )
