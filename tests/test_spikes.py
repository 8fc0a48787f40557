"""Spike detectors, divergence rule and offline instability measures (mhc_jax.spikes)."""

import json
import math

import numpy as np
import pytest

from mhc_jax.spikes import (
  DivergenceRule,
  RollingSpikeDetector,
  SpikeMonitor,
  lr_sensitivity,
  spike_mask,
)


def _noisy(n=600, seed=0, level=3.0, sigma=0.01):
  return level + sigma * np.random.default_rng(seed).normal(size=n)


def test_planted_jump_flags_exactly_that_step():
  x = _noisy()
  x[400] += 20 * 0.01
  det = RollingSpikeDetector(window=128, threshold=6.0)
  flags = [det.update(v)[0] for v in x]
  assert np.flatnonzero(flags).tolist() == [400]


def test_threshold_value_and_warmup():
  det = RollingSpikeDetector(window=4, threshold=2.0, min_history=4)
  for v in (1.0, 3.0, 1.0):
    assert det.update(v) == (False, math.inf)
  det.update(3.0)  # history 1,3,1,3: mean 2, std 1
  spike, thr = det.update(4.5)
  assert thr == pytest.approx(4.0) and spike
  assert len(det) == 4  # the spike did not enter the history
  assert det.update(3.9) == (False, pytest.approx(4.0))


def test_nonfinite_is_spike_and_skipped():
  det = RollingSpikeDetector(window=8, min_history=2)
  assert det.update(float("nan"))[0]  # even during warm-up
  assert det.update(np.float32("inf"))[0]
  assert len(det) == 0
  det.update(1.0)
  det.update(1.0)
  assert len(det) == 2 and math.isfinite(det.threshold_value())


def test_streaming_matches_offline_and_resume_is_identical():
  x = _noisy(800, seed=1)
  x[[300, 301, 550]] += 0.5
  x[700] = np.nan
  det = RollingSpikeDetector(window=64, threshold=4.0, min_history=16)
  stream = np.array([det.update(v)[0] for v in x])
  offline = spike_mask(x, window=64, threshold=4.0, min_history=16)
  np.testing.assert_array_equal(stream, offline)
  assert {300, 301, 550, 700} <= set(np.flatnonzero(offline).tolist())

  # stop at 450, save through JSON, resume in a fresh detector: identical thresholds
  a = RollingSpikeDetector(window=64, threshold=4.0, min_history=16)
  first = [a.update(v) for v in x[:450]]
  b = RollingSpikeDetector.from_state_dict(json.loads(json.dumps(a.state_dict())))
  resumed = first + [b.update(v) for v in x[450:]]
  ref = RollingSpikeDetector(window=64, threshold=4.0, min_history=16)
  assert resumed == [ref.update(v) for v in x]


def test_spike_monitor_events_score_and_state():
  loss, grad = _noisy(300, seed=2), _noisy(300, seed=3, level=1.0)
  loss[200] += 1.0
  grad[250] += 1.0
  grad[200] += 1.0  # same step as the loss spike: one spike step, two events
  mon = SpikeMonitor(window=64, threshold=6.0, score_window=100)
  saved, all_events, scores = None, [], []
  for step in range(300):
    if step == 150:
      saved = json.loads(json.dumps(mon.state_dict()))
    ev, score = mon.update(step, loss[step], grad[step])
    all_events += ev
    scores.append(score)
  kinds = [(e["step"], e["kind"]) for e in all_events]
  assert kinds == [(200, "spike/loss"), (200, "spike/grad"), (250, "spike/grad")]
  e = all_events[0]
  assert set(e) == {"step", "kind", "value", "threshold"} and e["value"] > e["threshold"]
  assert scores[-1] == pytest.approx(2 / 100)
  assert mon.total_spikes == 2 and mon.total_steps == 300

  mon2 = SpikeMonitor(window=64, score_window=100)
  mon2.load_state_dict(saved)
  again = []
  for step in range(150, 300):
    again += mon2.update(step, loss[step], grad[step])[0]
  assert again == all_events
  assert mon2.spike_score == pytest.approx(scores[-1])


def test_spike_score_window_counts_recent_steps_only():
  mon = SpikeMonitor(window=8, score_window=10, min_history=2)
  for s in range(5):
    assert mon.skip(s) == ([], 1.0)  # non-finite steps: unstable, but no spike events
  assert mon.spike_score == 1.0 and mon.total_spikes == 0
  for s in range(5, 15):
    mon.update(s, 1.0)
  assert mon.spike_score == 0.0


def _decaying(n=600, seed=0):
  t = np.arange(n)
  return 2.0 + 8.0 * np.exp(-t / 80) + 0.05 * np.random.default_rng(seed).normal(size=n)


def test_divergence_rule_quiet_on_normal_curve():
  rule = DivergenceRule()
  assert not any(rule.update(v) for v in _decaying())
  assert rule.reason is None


def test_divergence_rule_fires_on_runaway_after_patience():
  x = _decaying()
  x[400:] = x[399] * np.exp(0.2 * np.arange(1, 201))  # run-away
  rule = DivergenceRule(factor=2.0, window=100, patience=5)
  fired = [rule.update(v) for v in x]
  first = fired.index(True)
  ratio_bad = [i for i in range(400, 600) if x[i] > 2 * x[i - 100 : i].mean()]
  assert first == ratio_bad[0] + 4  # five bad steps in a row, then latched
  assert all(fired[first:]) and rule.reason == "ratio"


def test_divergence_rule_single_spike_and_nonfinite_and_above_init():
  x = _decaying(300)
  x[250] *= 10  # one spike: not persistent
  rule = DivergenceRule()
  assert not any(rule.update(v) for v in x)
  assert not rule.update(float("nan"))  # one skipped step is not divergence
  assert not rule.update(x[-1])  # and a finite loss ends the streak


def test_divergence_rule_sees_nonfinite_losses():
  """A run whose updates are all skipped as non-finite diverges (reason "nonfinite") after
  `patience` such steps in a row; they do not enter the window."""
  rule = DivergenceRule(patience=3)
  for v in _decaying(50):
    rule.update(v)
  fired = [rule.update(v) for v in (np.nan, np.inf, np.nan, 1.0)]
  assert fired == [False, False, True, True] and rule.reason == "nonfinite"
  assert all(math.isfinite(v) for v in rule.state_dict()["hist"])
  mixed = DivergenceRule(window=4, patience=2, warmup=100)
  for v in [1.0] * 4:
    mixed.update(v)
  assert [mixed.update(v) for v in (5.0, np.nan)] == [False, True]
  assert mixed.reason == "nonfinite"

  up = DivergenceRule(window=10, patience=3, warmup=20)
  vals = [5.0] * 20 + [4.0] * 10 + [5.5] * 3  # slow drift back above the initial loss
  out = [up.update(v) for v in vals]
  assert out.index(True) == 32 and up.reason == "above_init"


def test_divergence_rule_state_round_trip():
  x = _decaying()
  x[400:] = x[399] * np.exp(0.2 * np.arange(1, 201))
  a = DivergenceRule()
  for v in x[:402]:
    a.update(v)
  b = DivergenceRule()
  b.load_state_dict(json.loads(json.dumps(a.state_dict())))
  assert [a.update(v) for v in x[402:]] == [b.update(v) for v in x[402:]]


def test_lr_sensitivity_hand_grid():
  grid = {1e-4: 3.0, 1e-3: 2.0, 1e-2: 2.5, 1e-1: float("nan"), 1.0: 20.0}
  # capped at init 4: [3, 2, 2.5, 4, 4] - 2 -> mean([1, 0, .5, 2, 2]) = 1.1
  assert lr_sensitivity(grid, 4.0) == pytest.approx(1.1)
  assert lr_sensitivity([2.0, 2.0], 4.0) == 0.0
  assert lr_sensitivity([5.0, 6.0], 4.0) == 0.0
