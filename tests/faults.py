"""Faults the tests plant around the production code (never inside it).

``NanAt(source, step)``: a data source whose training batch ``step`` has a NaN mask, so the
train step's loss and gradients are non-finite at that step only (the non-finite policy's input).
Tests put it in place of the prepared source: ``dataclasses.replace(setup, source=NanAt(...))``.
"""

from __future__ import annotations

import numpy as np


class NanAt:
  def __init__(self, source, step: int):
    self.source, self.step = source, step

  def __getattr__(self, name):  # vocab_size, seq_len, has_posterior, baselines, ...
    return getattr(self.source, name)

  def batch(self, step: int, batch_size: int, split: str = "train") -> dict:
    b = self.source.batch(step, batch_size, split)
    if split == "train" and step == self.step:
      b = dict(b, mask=np.full(np.shape(b["mask"]), np.nan, np.float32))
    return b
