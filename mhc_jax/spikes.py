"""Loss / gradient-norm spike detection and divergence rules (host side, numpy).

The streaming detectors, fed one value per step by the training loop, save and restore their
state with a checkpoint (JSON-safe), so a resumed run decides exactly as an uninterrupted one.
The spike rule (:func:`spike_threshold`), its choices and how it compares with OLMo-core's:
docs/statistics.md ("Spikes"). Offline: ``spike_mask`` (the streaming rule over a whole series)
and the learning-rate sensitivity of Wortsman et al. (2023).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any, Mapping, Sequence

import numpy as np


def _scalar(value) -> float:
  """float() of a Python/numpy/jax scalar (or size-1 array)."""
  return float(np.asarray(value, dtype=np.float64).reshape(()))


#: 1.4826 * MAD (median absolute deviation) estimates the standard deviation of normal values.
MAD_TO_SD = 1.4826
#: A value's expected step change is the median of the step changes of this many steps before it.
TREND_STEPS = 8


def _recent_medians(d: np.ndarray, m: int) -> np.ndarray:
  """``out[j] = median(d[max(0, j - m + 1) : j + 1])``: the median of the (up to) ``m`` values
  of ``d`` ending at ``j``."""
  head = [statistics.median(d[: j + 1].tolist()) for j in range(min(m - 1, d.size))]
  full = np.lib.stride_tricks.sliding_window_view(d, m) if d.size >= m else np.zeros((0, m))
  return np.concatenate([np.asarray(head, dtype=np.float64), np.median(full, axis=1)])


def spike_threshold(history, threshold: float = 6.0, rel_std_floor: float = 1e-2) -> float:
  """The bar the next value must exceed to be a spike, from the trailing ``history`` (oldest
  first, at least 3 finite values): ``last + median(last 8 step changes) + median(surprises) +
  threshold * max(1.4826 * MAD(surprises), rel_std_floor * |last|)``, a step change's surprise
  being its difference from the median of the 8 changes before it."""
  h = np.asarray(history, dtype=np.float64)
  d = np.diff(h)  # step changes
  expected = _recent_medians(d, TREND_STEPS)  # expected[j]: median of the changes up to j
  surprise = d[1:] - expected[:-1]  # each change against the median of the ones before it
  typical = float(np.median(surprise))
  spread = MAD_TO_SD * float(np.median(np.abs(surprise - typical)))
  last = float(h[-1])
  return last + float(expected[-1]) + typical + threshold * max(spread, rel_std_floor * abs(last))


class _Saved:
  """``state_dict()`` / ``load_state_dict()`` of the instance's attributes as JSON-safe plain
  values (deques with their length limit, nested detectors as their own dicts): a detector
  restored from a checkpoint decides exactly as one that never stopped."""

  def state_dict(self) -> dict[str, Any]:
    def plain(v):
      if isinstance(v, _Saved):
        return v.state_dict()
      if isinstance(v, deque):
        return {"maxlen": v.maxlen, "items": list(v)}
      return v

    return {k: plain(v) for k, v in vars(self).items()}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    for k, v in state.items():
      cur = getattr(self, k)
      if isinstance(cur, _Saved):
        cur.load_state_dict(v)
      elif isinstance(cur, deque):
        setattr(self, k, deque(v["items"], maxlen=v["maxlen"]))
      else:
        setattr(self, k, v)


class RollingSpikeDetector(_Saved):
  """Streaming robust spike detector over a trailing window (:func:`spike_threshold`), from
  ``min_history`` values; a non-finite value is a spike and never enters the history."""

  def __init__(
    self,
    window: int = 128,
    threshold: float = 6.0,
    min_history: int = 8,
    rel_std_floor: float = 1e-2,
    add_spikes: bool = True,
  ):
    if window < 3:
      raise ValueError(f"window must be >= 3, got {window}")
    self.threshold = float(threshold)
    self.min_history = max(3, min(int(min_history), int(window)))
    self.rel_std_floor = float(rel_std_floor)
    self.add_spikes = bool(add_spikes)
    self._hist: deque[float] = deque(maxlen=int(window))  # the accepted values, oldest first

  def __len__(self) -> int:
    return len(self._hist)

  def history(self) -> np.ndarray:
    """The accepted values in the window, oldest first."""
    return np.asarray(self._hist, dtype=np.float64)

  def threshold_value(self) -> float:
    """The current bar a value must exceed to be a spike (+inf while warming up)."""
    if len(self._hist) < self.min_history:
      return math.inf
    return spike_threshold(self.history(), self.threshold, self.rel_std_floor)

  def update(self, value) -> tuple[bool, float]:
    """Feed one value; returns ``(is_spike, threshold_value)`` (threshold before the value)."""
    v = _scalar(value)
    thr = self.threshold_value()
    if not math.isfinite(v):
      return True, thr
    spike = v > thr
    if not spike or self.add_spikes:
      self._hist.append(v)
    return spike, thr

  @classmethod
  def from_state_dict(cls, state: Mapping[str, Any]) -> "RollingSpikeDetector":
    det = cls()
    det.load_state_dict(state)
    return det


class SpikeMonitor(_Saved):
  """Loss and grad-norm spike detection plus a running spike score.

  ``update(step, loss, grad_norm=None) -> (events, spike_score)``: the ``spike/loss`` and
  ``spike/grad`` events (docs/interfaces.md) of the finite values above their threshold. A
  non-finite step goes to :meth:`skip` instead. ``spike_score``: the fraction of unstable steps
  (a spike or non-finite) among the last ``score_window``; ``total_spikes``: steps with a spike.
  """

  def __init__(
    self,
    window: int = 128,
    threshold: float = 6.0,
    score_window: int = 1000,
    min_history: int = 8,
    rel_std_floor: float = 1e-2,
  ):
    kw = dict(
      window=window, threshold=threshold, min_history=min_history, rel_std_floor=rel_std_floor
    )
    self.loss = RollingSpikeDetector(**kw)
    self.grad = RollingSpikeDetector(**kw)
    self.score_window = int(score_window)
    self._flags: deque[int] = deque(maxlen=self.score_window)
    self.total_steps = 0
    self.total_spikes = 0

  @property
  def spike_score(self) -> float:
    return sum(self._flags) / len(self._flags) if self._flags else 0.0

  def update(self, step: int, loss, grad_norm=None) -> tuple[list[dict[str, Any]], float]:
    events: list[dict[str, Any]] = []
    for kind, det, value in (("spike/loss", self.loss, loss), ("spike/grad", self.grad, grad_norm)):
      if value is None:
        continue
      v = _scalar(value)
      if not math.isfinite(v):
        continue
      is_spike, thr = det.update(v)
      if is_spike:
        events.append({"step": int(step), "kind": kind, "value": v, "threshold": thr})
    spiked = int(bool(events))
    self._flags.append(spiked)
    self.total_steps += 1
    self.total_spikes += spiked
    return events, self.spike_score

  def skip(self, step: int) -> tuple[list[dict[str, Any]], float]:
    """A non-finite step: no spike event, no history, an unstable step in the score."""
    self._flags.append(1)
    self.total_steps += 1
    return [], self.spike_score


class DivergenceRule(_Saved):
  """Persistent divergence of the training loss (llm-foundry ``KillLossSpike`` style).

  ``update(loss) -> bool`` is True once the run has diverged (latched; ``reason`` and
  ``threshold`` say why): after ``patience`` bad steps in a row, a step being bad when

  * ``loss > factor * mean(last window losses)``, once a full window exists (every finite loss
    enters the window, bad or not; as in llm-foundry): ``reason`` ``"ratio"``;
  * ``loss > initial loss`` (the first fed) after ``warmup`` updates (default ``window``: still
    above its start after a window of steps is going the wrong way): ``"above_init"``;
  * the loss is non-finite (a skipped step; not in the window): ``"nonfinite"``. So a run whose
    every update is skipped diverges, one skipped step does not.
  """

  def __init__(
    self, factor: float = 2.0, window: int = 100, patience: int = 5, warmup: int | None = None
  ):
    self.factor = float(factor)
    self.window = int(window)
    self.patience = int(patience)
    self.warmup = self.window if warmup is None else int(warmup)
    self._hist: deque[float] = deque(maxlen=self.window)
    self.initial: float | None = None
    self.steps = 0
    self.streak = 0
    self.diverged = False
    self.reason: str | None = None
    self.threshold = math.nan

  def update(self, loss) -> bool:
    if self.diverged:
      return True
    v = _scalar(loss)
    self.steps += 1
    if not math.isfinite(v):
      self.streak += 1
      if self.streak >= self.patience:
        self.diverged, self.reason, self.threshold = True, "nonfinite", math.nan
      return self.diverged
    if self.initial is None:
      self.initial = v
    reason, thr = None, math.nan
    if len(self._hist) == self.window:
      bar = self.factor * float(np.mean(np.asarray(self._hist, dtype=np.float64)))
      if v > bar:
        reason, thr = "ratio", bar
    if reason is None and self.steps > self.warmup and v > self.initial:
      reason, thr = "above_init", self.initial
    self.streak = self.streak + 1 if reason else 0
    self._hist.append(v)
    if self.streak >= self.patience:
      self.diverged, self.reason, self.threshold = True, reason, thr
    return self.diverged


# ============================================================================ offline
def spike_mask(
  series: Sequence[float] | np.ndarray,
  window: int = 128,
  threshold: float = 6.0,
  min_history: int = 8,
  rel_std_floor: float = 1e-2,
  add_spikes: bool = True,
) -> np.ndarray:
  """Boolean spike mask of a whole series: exactly what streaming the detector gives."""
  det = RollingSpikeDetector(window, threshold, min_history, rel_std_floor, add_spikes)
  x = np.asarray(series, dtype=np.float64).ravel()
  return np.fromiter((det.update(v)[0] for v in x), dtype=bool, count=x.size)


def lr_sensitivity(
  losses_by_lr: Mapping[float, float] | Sequence[float], loss_init: float
) -> float:
  """LR sensitivity (Wortsman et al.): ``mean_eta min(loss(eta), loss_init) - min_eta loss(eta)``
  of the final loss per lr on the grid ({lr: loss} or a sequence), a non-finite loss counted as
  ``loss_init``; the minimum is over the capped losses, so the result is >= 0."""
  values = list(losses_by_lr.values()) if isinstance(losses_by_lr, Mapping) else list(losses_by_lr)
  if not values:
    raise ValueError("lr_sensitivity: empty LR grid")
  loss = np.asarray([_scalar(v) for v in values], dtype=np.float64)
  init = _scalar(loss_init)
  capped = np.where(np.isfinite(loss), np.minimum(loss, init), init)
  return float(np.mean(capped - capped.min()))
