"""Intervals over seeds (mhc_jax.sweep.stats) against a reference written here from the formula.

The reference uses only the standard library: Student's t density integrated numerically
(Simpson's rule) and inverted by bisection, so it shares no code with scipy.
"""

import functools
import math

import numpy as np
import pandas as pd
import pytest

from mhc_jax.sweep import stats


def t_pdf(x: float, df: int) -> float:
  c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
  return c * (1 + x * x / df) ** (-(df + 1) / 2)


def t_cdf(x: float, df: int, n: int = 20000) -> float:
  """P(T <= x) for x >= 0: 1/2 + the integral of the density from 0 to x (Simpson)."""
  h = x / n
  s = t_pdf(0, df) + t_pdf(x, df) + sum((4 if i % 2 else 2) * t_pdf(i * h, df) for i in range(1, n))
  return 0.5 + s * h / 3


@functools.lru_cache(maxsize=None)
def t_ppf(p: float, df: int) -> float:
  lo, hi = 0.0, 100.0
  for _ in range(40):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if t_cdf(mid, df, 4000) < p else (lo, mid)
  return (lo + hi) / 2


def ref_ci(values):
  n = len(values)
  mean = sum(values) / n
  s = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
  half = t_ppf(0.975, n - 1) * s / math.sqrt(n)
  return mean, mean - half, mean + half


@pytest.mark.parametrize("df, known", [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262)])
def test_t_quantile_matches_the_reference_and_the_tables(df, known):
  assert stats.t_quantile(0.975, df) == pytest.approx(t_ppf(0.975, df), rel=1e-4)
  assert stats.t_quantile(0.975, df) == pytest.approx(known, abs=1e-3)


def test_mean_ci_is_the_student_t_interval():
  for vals in ([1.0, 2.0], [0.3, 0.5, 0.4], [2.5, 2.1, 2.9, 3.3, 2.2]):
    mean, lo, hi, n = stats.mean_ci(vals)
    want = ref_ci(vals)
    assert n == len(vals)
    assert (mean, lo, hi) == pytest.approx(want, rel=1e-4)


def test_non_finite_is_not_averaged_away():
  mean, lo, hi, n = stats.mean_ci([1.0, math.nan, 2.0])
  assert math.isnan(mean) and math.isnan(lo) and math.isnan(hi) and n == 3
  mean, lo, hi, _ = stats.mean_ci([1.0, math.inf, 2.0])
  assert mean == math.inf and math.isnan(lo) and math.isnan(hi)
  mean, lo, hi, n = stats.mean_ci([0.7])
  assert mean == 0.7 and math.isnan(lo) and n == 1
  assert all(math.isnan(v) for v in stats.mean_ci([])[:3])
  assert stats.mean_ci([3.0, 3.0, 3.0])[1:3] == (3.0, 3.0)


def test_paired_differences_by_seed():
  df = pd.DataFrame(
    {
      "mixer": ["a", "a", "a", "b", "b", "b", "b"],
      "depth": [2, 2, 2, 2, 2, 2, 4],
      "seed": [0, 1, 2, 0, 1, 3, 0],  # seed 2 has no b, seed 3 no a: 2 pairs at depth 2
      "loss": [1.0, 2.0, 9.0, 1.5, 2.75, 0.0, 5.0],
    }
  )
  out = stats.paired_stats(df, "mixer", ["depth"], ["loss"], order=["b", "a"])
  assert len(out) == 1  # depth 4 has one mixer only
  row = out.iloc[0]
  assert (row["a"], row["b"], row["n_pairs"], row["seeds"]) == ("b", "a", 2, "0,1")
  diffs = [1.0 - 1.5, 2.0 - 2.75]  # b - a with a = "b", b = "a" (the order given)
  assert (row["diff_mean"], row["diff_ci_lo"], row["diff_ci_hi"]) == pytest.approx(
    ref_ci(diffs), rel=1e-4
  )
  assert row["mean_a"] == pytest.approx(2.125) and row["mean_b"] == pytest.approx(1.5)


def test_group_stats_columns_and_grouping():
  df = pd.DataFrame({"mixer": ["a", "a", "b"], "seed": [0, 1, 0], "x": [1.0, 3.0, np.nan]})
  out = stats.group_stats(df, ["mixer"], ["x"])
  assert list(out.columns) == ["mixer", "n_seeds", "seeds", "x_mean", "x_ci_lo", "x_ci_hi"]
  a, b = out.iloc[0], out.iloc[1]
  assert (a["n_seeds"], a["seeds"], a["x_mean"]) == (2, "0,1", 2.0)
  assert (a["x_ci_lo"], a["x_ci_hi"]) == pytest.approx(ref_ci([1.0, 3.0])[1:], rel=1e-4)
  assert b["n_seeds"] == 1 and math.isnan(b["x_mean"])


# =========================================================================== the log scale
def ref_log_ci(values):
  """Geometric mean and the t interval of the mean log, back-transformed (float64, stdlib)."""
  mean, lo, hi = ref_ci([math.log(v) for v in values])
  return math.exp(mean), math.exp(lo), math.exp(hi)


HC_GAINS = [4443.210938, 1736.524902, 57.178532]  # hc's per-token composite, 3 seeds (width 32)


def test_log_scale_interval_against_a_float64_reference():
  for vals in (HC_GAINS, [1.0, 1.000001, 1.000002], [0.004, 0.56, 0.2, 0.31, 0.05]):
    gmean, lo, hi, n = stats.mean_ci(vals, log=True)
    assert n == len(vals)
    assert (gmean, lo, hi) == pytest.approx(ref_log_ci(vals), rel=1e-4)
    assert lo < gmean < hi and lo > 0  # a positive quantity keeps a positive interval
  gmean, lo, hi, _ = stats.mean_ci(HC_GAINS, log=True)
  assert 500 < gmean < 900 and hi / gmean == pytest.approx(gmean / lo)  # symmetric in ratio
  raw = stats.mean_ci(HC_GAINS)
  assert raw[1] < 0  # the raw interval of a positive gain reaches below 0


def test_log_scale_edge_cases():
  assert stats.mean_ci([0.0, 0.0, 0.0], log=True) == (0.0, 0.0, 0.0, 3)  # single-stream spread
  for bad in ([0.0, 1.0, 2.0], [-1.0, 2.0], [1.0, math.nan], [1.0, math.inf]):
    gmean, lo, hi, n = stats.mean_ci(bad, log=True)
    assert math.isnan(lo) and math.isnan(hi) and n == len(bad), bad
    assert math.isnan(gmean) or gmean == math.inf, bad
  one = stats.mean_ci([5.0], log=True)
  assert one[0] == pytest.approx(5.0) and math.isnan(one[1])


def test_paired_ratios_on_the_log_scale():
  df = pd.DataFrame(
    {
      "mixer": ["mhc"] * 3 + ["hc"] * 3,
      "seed": [0, 1, 2, 0, 1, 2],
      "gain": [1.0, 1.000001, 1.0, *HC_GAINS],
      "loss": [2.6, 2.61, 2.6, 2.43, 2.46, 2.54],
    }
  )
  out = stats.paired_stats(df, "mixer", [], ["gain", "loss"], log_metrics={"gain"}).set_index(
    "metric"
  )
  g = out.loc["gain"]
  ratios = [b / a for a, b in zip([1.0, 1.000001, 1.0], HC_GAINS)]
  assert g["scale"] == "log" and g["n_pairs"] == 3
  want = ref_log_ci(ratios)
  assert (g["ratio_mean"], g["ratio_ci_lo"], g["ratio_ci_hi"]) == pytest.approx(want, rel=1e-4)
  assert g["mean_b"] == pytest.approx(ref_log_ci(HC_GAINS)[0], rel=1e-6)  # geometric means
  assert math.isnan(g["diff_mean"]) and bool(g["significant"])
  ln = out.loc["loss"]
  assert ln["scale"] == "raw" and math.isnan(ln["ratio_mean"])
  diffs = [b - a for a, b in zip([2.6, 2.61, 2.6], [2.43, 2.46, 2.54])]
  assert (ln["diff_mean"], ln["diff_ci_lo"], ln["diff_ci_hi"]) == pytest.approx(
    ref_ci(diffs), rel=1e-4
  )


def test_significant_only_beyond_rounding():
  # float32 rounding of gains near 1: an interval that excludes 0 by 2e-7 is not an effect
  assert not stats.significant(2.384e-07, 2.384e-07, scale=1.0)
  assert not stats.significant(3.026e-07, 1.207e-06, scale=1.0)
  assert stats.significant(0.093, 0.193, scale=2.5)
  assert stats.significant(-0.3, -0.01, scale=2.5)
  assert not stats.significant(-0.01, 0.3, scale=2.5)
  assert not stats.significant(math.nan, 1.0, scale=1.0)
  assert not stats.significant(0.0, 0.0, scale=0.0)  # spike counts 0 vs 0
  # ratios: the interval of the log ratio must clear 0 (ratio 1) by more than the tolerance
  assert not stats.significant(math.log(1.0000002), math.log(1.0000005), scale=None)
  assert stats.significant(math.log(1.2), math.log(1.5), scale=None)
  df = pd.DataFrame(
    {"mixer": ["a"] * 3 + ["b"] * 3, "seed": [0, 1, 2] * 2, "x": [1.0] * 3 + [1.0 + 2.4e-7] * 3}
  )
  row = stats.paired_stats(df, "mixer", [], ["x"]).iloc[0]
  assert row["diff_ci_lo"] > 0 and not row["significant"]


def test_coverage_of_raw_and_log_intervals_for_hc_like_spreads():
  cov = stats.coverage(3, sigma=2.3, draws=4000, seed=1)
  assert cov["log"] == pytest.approx(0.95, abs=0.015)
  assert cov["raw"] < 0.75  # the raw interval misses the mean of heavy-tailed gains
  table = stats.coverage_table(ns=(3,), sigmas=(2.3,), draws=4000, seed=1)
  assert list(table.columns) == [
    "n",
    "sigma",
    "spread",
    "raw",
    "log",
    "raw_excludes_1",
    "log_excludes_1",
  ]
  assert cov["log_excludes_1"] > cov["raw_excludes_1"]  # HC's gain told apart from 1
  assert table["log"].iloc[0] == cov["log"] and table["raw"].iloc[0] == cov["raw"]


def test_group_keys_agree_across_numpy_and_python_scalars():
  """A numpy float and the equal Python float are one group key (numpy 2 reprs them apart:
  'np.float64(0.01)'), so the report's sentence finds the paired row of a group."""
  assert stats._key(np.float64(0.01)) == stats._key(0.01)
  assert stats._key(np.int64(64)) == stats._key(64) == stats._key(64.0)
  assert stats._key(np.float32(0.5)) == stats._key(0.5)
  assert stats._key("mhc") != stats._key(0.01)


def test_t_test_and_holm_match_scipy_and_the_definition():
  """stats.t_test is scipy's one-sample t test; Holm multiplies the k-th smallest p by (m - k + 1),
  caps at 1 and never lets an adjusted p fall below the one before it."""
  from scipy.stats import ttest_1samp

  x = [0.3, -0.1, 0.5, 0.2, 0.4]
  assert stats.t_test(x) == pytest.approx(ttest_1samp(x, 0.0).pvalue, rel=1e-12)
  assert stats.t_test([0.25, 0.25, 0.25]) == 0.0  # no spread: the bayes_thesis convention
  adj = stats.holm([0.01, 0.04, 0.03, 0.5])
  assert adj.tolist() == pytest.approx([0.04, 0.09, 0.09, 0.5])
