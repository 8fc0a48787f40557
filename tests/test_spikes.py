"""Spike detectors, divergence rule and offline instability measures (mhc_jax.spikes)."""

import json
import math
import statistics

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


def _ref_bar(history, k=6.0, floor=1e-2, m=8):
  """The rule written out with the standard library: the last value, plus the median of the
  last m step changes, plus the median surprise and k robust SDs of the surprises."""
  d = [b - a for a, b in zip(history, history[1:])]
  expected = [statistics.median(d[max(0, j - m + 1) : j + 1]) for j in range(len(d))]
  surprise = [d[j] - expected[j - 1] for j in range(1, len(d))]
  typical = statistics.median(surprise)
  spread = 1.4826 * statistics.median([abs(e - typical) for e in surprise])
  return history[-1] + expected[-1] + typical + k * max(spread, floor * abs(history[-1]))


def test_threshold_value_and_warmup():
  det = RollingSpikeDetector(window=8, threshold=2.0, min_history=4)
  for v in (1.0, 3.0, 1.0):
    assert det.update(v) == (False, math.inf)
  det.update(3.0)
  # changes 2, -2, 2; expected (median up to each) 2, 0, 2; surprises -2 - 2, 2 - 0; median -1,
  # MAD 3: bar = 3 + 2 - 1 + 2 * 1.4826 * 3
  assert det.threshold_value() == pytest.approx(3 + 2 - 1 + 2 * 1.4826 * 3)
  spike, thr = det.update(13.0)
  assert spike and thr == pytest.approx(12.8956)
  assert len(det) == 5  # the spike entered the history: medians are not moved by one value
  keep_out = RollingSpikeDetector(window=8, threshold=2.0, min_history=4, add_spikes=False)
  for v in (1.0, 3.0, 1.0, 3.0, 13.0):
    keep_out.update(v)
  assert len(keep_out) == 4


def test_threshold_matches_a_reference_over_a_window():
  rng = np.random.default_rng(4)
  x = 3.0 + np.cumsum(0.1 * rng.standard_normal(300))
  det = RollingSpikeDetector(window=50)
  for i, v in enumerate(x):
    want = _ref_bar(x[max(0, i - 50) : i].tolist()) if i >= 8 else math.inf
    assert det.update(v)[1] == pytest.approx(want, rel=1e-12), i


def test_nonfinite_is_spike_and_skipped():
  det = RollingSpikeDetector(window=8, min_history=3)
  assert det.update(float("nan"))[0]  # even during warm-up
  assert det.update(np.float32("inf"))[0]
  assert len(det) == 0
  for v in (1.0, 1.0, 1.0):
    det.update(v)
  assert len(det) == 3 and math.isfinite(det.threshold_value())


def test_streaming_matches_offline_and_resume_is_identical():
  x = _noisy(800, seed=1)
  x[[300, 301, 550]] += 0.5
  x[700] = np.nan
  det = RollingSpikeDetector(window=64, threshold=4.0, min_history=16)
  stream = np.array([det.update(v)[0] for v in x])
  offline = spike_mask(x, window=64, threshold=4.0, min_history=16)
  np.testing.assert_array_equal(stream, offline)
  flagged = set(np.flatnonzero(offline).tolist())
  assert {300, 550, 700} <= flagged and 301 not in flagged  # a two-step jump counts at its onset

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
  assert all(math.isfinite(v) for v in rule.state_dict()["_hist"]["items"])
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


# =========================================================================== from the first steps
def _toy_run(n=200, seed=0, vocab=256, floor=2.5, tau=8.0, sigma=0.03):
  """A toy training loss: falling fast from ln(V) to a floor, with noise (steps 0..n-1)."""
  t = np.arange(n)
  rng = np.random.default_rng(seed)
  return floor + (math.log(vocab) - floor) * np.exp(-t / tau) + sigma * rng.normal(size=n)


def test_planted_spike_at_step_10_is_detected():
  for seed in range(5):
    x = _toy_run(seed=seed)
    x[10] += 0.5  # a jump of ~17 noise sigmas, while the loss still falls ~0.15 per step
    assert np.flatnonzero(spike_mask(x)).tolist() == [10], seed
    mon = SpikeMonitor()
    events = [e for s, v in enumerate(x) for e in mon.update(s, v)[0]]
    assert [(e["step"], e["kind"]) for e in events] == [(10, "spike/loss")]
    assert events[0]["threshold"] < x[10] < x[0]  # a bar between the jump and the initial loss


def test_smooth_early_transient_is_not_a_spike():
  for seed in range(20):
    for tau in (2.0, 5.0, 20.0):  # loss falling from ln(256) = 5.5, fast to slow
      assert not spike_mask(_toy_run(seed=seed, tau=tau)).any(), (seed, tau)
  # the same with a linear warm-up: flat for a few steps, then the fast fall
  t = np.arange(150)
  lr = np.minimum(1.0, t / 15)
  x = 2.5 + 3.0 * np.exp(-np.cumsum(lr) / 6) + 0.03 * np.random.default_rng(7).normal(size=150)
  assert not spike_mask(x).any()


def test_threshold_is_not_inflated_by_the_transient():
  """After the fast fall the bar sits a few noise widths above the loss, not at the transient's
  spread: a jump of 10 noise sigmas at step 40 is caught (the mean + 6 std of the first 40
  values would be above ln V)."""
  x = _toy_run(seed=3, sigma=0.03)
  hist = x[:40]
  assert hist.mean() + 6 * hist.std() > math.log(256)
  x[40] += 0.3
  assert spike_mask(x)[40]
  det = RollingSpikeDetector()
  for v in x[:40]:
    det.update(v)
  assert det.threshold_value() - x[39] < 12 * 0.03


def test_monitor_and_the_pure_function_agree():
  """The running monitor (training) and spike_mask on the logged series flag the same steps."""
  rng = np.random.default_rng(11)
  loss = _toy_run(400, seed=5)
  grad = 3.0 * np.exp(-np.arange(400) / 30) + 0.5 + 0.05 * rng.standard_normal(400)
  loss[[12, 13, 90, 91, 92, 300]] += [0.8, 0.6, 0.5, 0.5, 0.5, 0.5]
  grad[[9, 150, 151]] *= [8.0, 5.0, 3.0]
  mon = SpikeMonitor()
  events = [e for s in range(400) for e in mon.update(s, loss[s], grad[s])[0]]
  by_kind = {k: [e["step"] for e in events if e["kind"] == k] for k in ("spike/loss", "spike/grad")}
  assert by_kind["spike/loss"] == np.flatnonzero(spike_mask(loss)).tolist()
  assert by_kind["spike/grad"] == np.flatnonzero(spike_mask(grad)).tolist()
  assert {12, 90, 300} <= set(by_kind["spike/loss"]) and {9, 150} <= set(by_kind["spike/grad"])
  assert not {13, 91, 92} & set(by_kind["spike/loss"])  # a jump that stays up counts once
  assert mon.total_spikes == len({e["step"] for e in events})
