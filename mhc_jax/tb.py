"""Optional TensorBoard event files (extra ``tb``: tensorboardX), mirroring metrics.jsonl.

Scalars go under their own name; per-layer lists become ``name/layer_00`` ... so TensorBoard's
scalar view shows one curve per layer. Enabled by ``train.tensorboard: true``.
"""

from __future__ import annotations

import math
from pathlib import Path


class TBWriter:
  def __init__(self, log_dir: str | Path):
    try:
      from tensorboardX import SummaryWriter
    except ImportError as e:  # pragma: no cover - depends on the environment
      raise ImportError("train.tensorboard needs the 'tb' extra: pip install -e '.[tb]'") from e
    self.w = SummaryWriter(str(log_dir))

  def write(self, record: dict) -> None:
    step = int(record["step"])
    for k, v in record.items():
      if k == "step":
        continue
      if isinstance(v, (int, float)) and not isinstance(v, bool):
        if math.isfinite(v):
          self.w.add_scalar(k, v, step)
      elif isinstance(v, list):
        for i, x in enumerate(v):
          if isinstance(x, (int, float)) and math.isfinite(x):
            self.w.add_scalar(f"{k}/layer_{i:02d}", x, step)

  def close(self) -> None:
    self.w.flush()
    self.w.close()
