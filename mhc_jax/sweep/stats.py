"""Error bars over seeds: means, 95% confidence intervals, paired differences.

Interval: **Student t**. For ``n`` finite values ``x_1..x_n`` (one per seed) the interval of
their mean is

    mean ± t_{0.975, n-1} · s / sqrt(n),    s² = Σ (x_i - mean)² / (n - 1)

(``t_{0.975, n-1}`` the 97.5% quantile of Student's t with ``n - 1`` degrees of freedom: 12.71
for 2 seeds, 4.30 for 3, 2.78 for 5). A paired difference is the same interval on the
per-seed differences ``b_i - a_i`` of two configurations that share seed ``i`` (same data
order and initialisation key), which removes the seed-to-seed variation the two share.

Why t and not the bootstrap: a sweep can afford 3-5 seeds, and at that size the percentile
bootstrap's interval is far too narrow; it can never be wider than the range of the seeds.
Simulated on normal data (20 000 draws), the bootstrap's 95% interval contains the true mean
73% of the time for n = 3, 82% for n = 5, 89% for n = 10. The t interval contains it 95% of
the time at every n. It is exact for normal seed-to-seed noise and widens sharply as n shrinks.
It assumes the seeds are independent draws, which they are here (each seed changes
the initialisation and the data order).

Non-finite values are not dropped. A mean over values with a NaN is NaN, with an inf it is
that inf, and the interval is then NaN. A diverged seed makes its group's loss undefined; it is
not quietly averaged away. One value gives its mean and a NaN interval; none gives NaN.

**The log scale.** Gains, gradient norms and stream spreads are positive and heavy-tailed: one
seed's composite gain can be 57 and another's 4443. Their raw-scale interval is centred on a
mean the largest seed dominates, reaches below 0 and covers the true mean far less than 95% of
the time (:func:`coverage`: 44-45% for such spreads, n = 3 and 5; docs/statistics.md). Such a
quantity (``log=True``) is summarised by its geometric mean ``exp(mean(log x))`` with the t
interval computed on ``log x`` and back-transformed, which covers the true geometric mean 95% of
the time when ``log x`` is normal; a paired comparison is the ratio ``b / a``, its interval the
t interval of the per-seed ``log b - log a``, back-transformed. A value <= 0 has no log: the
result is NaN, except that all zeros (the stream spread of a single-stream mixer) give 0 with
the interval [0, 0].

**Significance** (:func:`significant`): an interval counts as excluding 0 (or a ratio 1) only
when it clears it by more than ``SIGNIFICANCE_RTOL`` (1e-4) of the values' scale; float32
rounding of values near 1 (~1e-7) produced intervals like [2.4e-7, 2.4e-7] that are no effect.
"""

from __future__ import annotations

import math
from typing import Collection, Iterable, Sequence

import numpy as np
import pandas as pd

__all__ = [
  "CONFIDENCE",
  "METHOD",
  "LOG_METHOD",
  "SIGNIFICANCE_RTOL",
  "t_quantile",
  "mean_ci",
  "significant",
  "centre",
  "split",
  "group_stats",
  "paired_stats",
  "coverage",
  "coverage_table",
]

#: Two-sided confidence level of every interval.
CONFIDENCE = 0.95
#: How the intervals are computed, in words (written into the report).
METHOD = (
  "Student t over seeds: mean ± t(0.975, n-1)·s/√n, with s the sample standard deviation "
  "(n-1 denominator); paired differences use the same formula on the per-seed differences"
)
#: The same for the log-scale metrics (gains, gradient norms, stream spreads).
LOG_METHOD = (
  "log scale: geometric mean exp(mean(log x)) with the Student t interval of mean(log x), "
  "back-transformed; paired comparisons are ratios b/a, the t interval of the per-seed "
  "log(b/a) back-transformed"
)
#: An interval is significant only when it clears 0 by more than this fraction of the values'
#: scale (for a ratio: when its log clears 0 by more than this); float32 rounding is ~1e-7.
SIGNIFICANCE_RTOL = 1e-4


def t_quantile(p: float, df: int) -> float:
  """The ``p`` quantile of Student's t with ``df`` degrees of freedom (scipy, which jax
  requires)."""
  from scipy.stats import t

  return float(t.ppf(p, df))


def _floats(values: Iterable[float]) -> np.ndarray:
  return np.asarray(
    [math.nan if v is None or v is pd.NA else float(v) for v in values], dtype=np.float64
  )


def mean_ci(
  values: Iterable[float], confidence: float = CONFIDENCE, *, log: bool = False
) -> tuple[float, float, float, int]:
  """``(mean, ci_lo, ci_hi, n)`` of ``values`` with the Student t interval (module docstring);
  with ``log=True`` the geometric mean and the interval computed on the logs, back-transformed.

  ``n`` counts every value (non-finite ones included); any non-finite value makes the mean
  NaN/inf and the interval NaN; ``n == 1`` gives a NaN interval; ``n == 0`` all NaN. On the log
  scale a value <= 0 makes everything NaN, except all zeros: ``(0, 0, 0, n)``.
  """
  x = _floats(values)
  n = int(x.size)
  if n == 0:
    return math.nan, math.nan, math.nan, 0
  if log:
    if np.isfinite(x).all() and (x == 0).all():
      return 0.0, 0.0, 0.0, n
    if (x[~np.isnan(x)] <= 0).any():
      return math.nan, math.nan, math.nan, n
    with np.errstate(divide="ignore", invalid="ignore"):
      mean, lo, hi, _ = mean_ci(np.log(x), confidence)
    return math.exp(mean), math.exp(lo), math.exp(hi), n
  with np.errstate(invalid="ignore", over="ignore"):
    mean = float(np.mean(x))
  if n == 1 or not np.isfinite(x).all():
    return mean, math.nan, math.nan, n
  s = float(np.std(x, ddof=1))
  half = t_quantile(0.5 + confidence / 2, n - 1) * s / math.sqrt(n)
  return mean, mean - half, mean + half, n


def significant(lo: float, hi: float, scale: float | None, rtol: float = SIGNIFICANCE_RTOL) -> bool:
  """True when the interval ``[lo, hi]`` excludes 0 by more than ``rtol * |scale|`` (``scale``:
  the size of the values compared, e.g. the larger of the two means). ``scale=None``: the
  interval is of a log ratio, and must clear 0 by more than ``rtol``. NaN bounds: False."""
  tol = rtol * (1.0 if scale is None else abs(float(scale)))
  lo, hi = float(lo), float(hi)
  if not (math.isfinite(lo) and math.isfinite(hi)):
    return False
  return lo > tol or hi < -tol


def _key(v) -> str:
  """A hashable, NaN-safe key for grouping on object/float/Int64 cells."""
  if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
    return "\0none"
  if isinstance(v, (float, np.floating)) and float(v).is_integer():
    return repr(int(v))
  if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
    return repr(int(v))
  if isinstance(v, (float, np.floating)):
    return repr(float(v))  # numpy 2 reprs np.float64(0.01) unlike 0.01
  return repr(v)


def split(df: pd.DataFrame, cols: Sequence[str]) -> list[tuple[tuple, pd.DataFrame]]:
  """Rows grouped by equal values of ``cols`` (None/NaN/NA equal to each other), in first-seen
  order; each group's key holds the first row's original values."""
  if not cols:
    return [((), df)]
  keys = [tuple(_key(v) for v in row) for row in df[list(cols)].itertuples(index=False, name=None)]
  order: dict[tuple, list[int]] = {}
  for i, k in enumerate(keys):
    order.setdefault(k, []).append(i)
  out = []
  for idx in order.values():
    g = df.iloc[idx]
    out.append((tuple(g[c].iloc[0] for c in cols), g))
  return out


def centre(metric: str, log_metrics: Collection[str] = ()) -> str:
  """The name of a metric's centre column: ``<metric>_gmean`` (geometric mean) for a log-scale
  metric, else ``<metric>_mean``."""
  return f"{metric}_gmean" if metric in log_metrics else f"{metric}_mean"


def group_stats(
  df: pd.DataFrame,
  group_cols: Sequence[str],
  metrics: Sequence[str],
  *,
  log_metrics: Collection[str] = (),
  unit_col: str | None = "seed",
  confidence: float = CONFIDENCE,
) -> pd.DataFrame:
  """One row per group of ``df`` rows with equal ``group_cols``: the group columns,
  ``n_seeds`` (rows in the group), ``seeds`` (their ``unit_col`` values, comma-separated),
  then per metric its centre (:func:`centre`: ``<metric>_mean``, or ``<metric>_gmean`` for
  the ``log_metrics``), ``<metric>_ci_lo`` and ``<metric>_ci_hi`` (:func:`mean_ci`).

  ``df`` should hold only the rows that count (e.g. runs with metrics); pass groups with no
  such rows yourself if they must appear.
  """
  cols = [*group_cols, "n_seeds", "seeds"] + [
    c for m in metrics for c in (centre(m, log_metrics), f"{m}_ci_lo", f"{m}_ci_hi")
  ]
  rows = []
  for key, g in split(df, group_cols):
    row = dict(zip(group_cols, key))
    row["n_seeds"] = len(g)
    row["seeds"] = ",".join(_fmt_unit(v) for v in g[unit_col]) if unit_col and unit_col in g else ""
    for m in metrics:
      vals = g[m].tolist() if m in g.columns else [math.nan] * len(g)
      mid, lo, hi, _ = mean_ci(vals, confidence, log=m in log_metrics)
      row.update({centre(m, log_metrics): mid, f"{m}_ci_lo": lo, f"{m}_ci_hi": hi})
    rows.append(row)
  return pd.DataFrame(rows, columns=cols)


def _fmt_unit(v) -> str:
  if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
    return "?"
  if isinstance(v, (float, np.floating)) and float(v).is_integer():
    return str(int(v))
  return str(v)


PAIRED_COLUMNS = [
  "a",
  "b",
  "metric",
  "scale",
  "n_pairs",
  "seeds",
  "mean_a",
  "mean_b",
  "diff_mean",
  "diff_ci_lo",
  "diff_ci_hi",
  "ratio_mean",
  "ratio_ci_lo",
  "ratio_ci_hi",
  "significant",
]


def paired_stats(
  df: pd.DataFrame,
  pair_col: str,
  context_cols: Sequence[str],
  metrics: Sequence[str],
  *,
  log_metrics: Collection[str] = (),
  unit_col: str = "seed",
  order: Sequence | None = None,
  confidence: float = CONFIDENCE,
) -> pd.DataFrame:
  """Paired comparisons between the values of ``pair_col`` (e.g. mixers), by ``unit_col``
  (seed), within each group of equal ``context_cols``.

  For every context and every pair ``a`` before ``b`` in ``order`` (default: first-seen
  order) that both occur there, the units both have are matched; per metric the row holds
  ``scale`` ("raw", or "log" for the ``log_metrics``), ``n_pairs``, ``seeds``, ``mean_a``,
  ``mean_b`` (over the matched units; geometric means on the log scale), then on the raw scale
  the :func:`mean_ci` of ``b - a`` as ``diff_mean``, ``diff_ci_lo``, ``diff_ci_hi`` (ratio
  columns NaN), on the log scale the geometric mean of ``b / a`` and its back-transformed
  interval as ``ratio_mean``, ``ratio_ci_lo``, ``ratio_ci_hi`` (diff columns NaN), and
  ``significant`` (:func:`significant`; raw: scale the larger of ``|mean_a|``, ``|mean_b|``).
  A unit that occurs twice for one side (should not happen) uses its first row. Without a
  ``unit_col`` column every side has one unit, so ``n_pairs`` is 1 and there is no interval.
  """
  cols = [*context_cols, *PAIRED_COLUMNS]
  rows = []
  for ctx, g in split(df, context_cols):
    present = list(dict.fromkeys(g[pair_col].tolist()))
    if order is not None:
      present = [v for v in order if v in present] + [v for v in present if v not in order]
    units = g[unit_col].map(_key) if unit_col in g.columns else pd.Series("\0one", index=g.index)
    for i, a in enumerate(present):
      for b in present[i + 1 :]:
        ga = g[g[pair_col] == a].assign(_u=units).drop_duplicates("_u").set_index("_u")
        gb = g[g[pair_col] == b].assign(_u=units).drop_duplicates("_u").set_index("_u")
        common = [u for u in ga.index if u in gb.index]
        seeds = ",".join(
          _fmt_unit(ga.loc[u, unit_col]) if unit_col in ga.columns else "" for u in common
        )
        for m in metrics:
          va = np.asarray([_float(ga.loc[u, m]) for u in common], dtype=np.float64)
          vb = np.asarray([_float(gb.loc[u, m]) for u in common], dtype=np.float64)
          log = m in log_metrics
          ma = mean_ci(va, confidence, log=log)[0]
          mb = mean_ci(vb, confidence, log=log)[0]
          row = {
            **dict(zip(context_cols, ctx)),
            "a": a,
            "b": b,
            "metric": m,
            "scale": "log" if log else "raw",
            "n_pairs": len(common),
            "seeds": seeds,
            "mean_a": ma,
            "mean_b": mb,
            **{c: math.nan for c in PAIRED_COLUMNS[8:14]},
          }
          with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            if log:
              ok = (va > 0) & (vb > 0)
              logr = np.where(ok, np.log(np.where(ok, vb, 1.0) / np.where(ok, va, 1.0)), np.nan)
              mean, lo, hi, _ = mean_ci(logr, confidence)
              row.update(ratio_mean=math.exp(mean), ratio_ci_lo=math.exp(lo))
              row.update(ratio_ci_hi=math.exp(hi), significant=significant(lo, hi, None))
            else:
              mean, lo, hi, _ = mean_ci(vb - va, confidence)
              row.update(diff_mean=mean, diff_ci_lo=lo, diff_ci_hi=hi)
              row["significant"] = significant(lo, hi, max(abs(ma), abs(mb)))
          rows.append(row)
  return pd.DataFrame(rows, columns=cols)


def _float(v) -> float:
  if v is None or v is pd.NA:
    return math.nan
  try:
    return float(v)
  except (TypeError, ValueError):
    return math.nan


# =========================================================================== coverage
def coverage(
  n: int,
  sigma: float,
  *,
  gmean: float = 765.0,
  draws: int = 20000,
  seed: int = 0,
  confidence: float = CONFIDENCE,
) -> dict[str, float]:
  """How the 95% intervals of ``n`` log-normal values ``gmean * exp(N(0, sigma^2))`` behave,
  over ``draws`` simulated groups (numpy generator ``seed``):

  - ``spread``: the median over groups of max / min of the ``n`` values (HC's per-token
    composite over 3 seeds at width 32, 57 to 4443, is 78x; the SD of its logs is 2.3 and its
    geometric mean 765, the default ``gmean``);
  - ``raw``: how often the raw-scale t interval contains the true mean ``gmean *
    exp(sigma^2 / 2)``; ``log``: how often the log-scale interval contains ``gmean``;
  - ``raw_excludes_1``, ``log_excludes_1``: how often each interval excludes a gain of 1, i.e.
    tells the gain apart from "no amplification".
  """
  x = gmean * np.exp(sigma * np.random.default_rng(seed).standard_normal((draws, n)))
  t = t_quantile(0.5 + confidence / 2, n - 1)

  def interval(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    half = t * v.std(axis=1, ddof=1) / math.sqrt(n)
    return v.mean(axis=1) - half, v.mean(axis=1) + half

  raw_lo, raw_hi = interval(x)
  log_lo, log_hi = interval(np.log(x))
  mean = gmean * math.exp(sigma**2 / 2)
  return {
    "spread": float(np.median(x.max(axis=1) / x.min(axis=1))),
    "raw": float(np.mean((raw_lo <= mean) & (mean <= raw_hi))),
    "log": float(np.mean((log_lo <= math.log(gmean)) & (math.log(gmean) <= log_hi))),
    "raw_excludes_1": float(np.mean((raw_lo > 1) | (raw_hi < 1))),
    "log_excludes_1": float(np.mean((log_lo > 0) | (log_hi < 0))),
  }


COVERAGE_COLUMNS = ["n", "sigma", "spread", "raw", "log", "raw_excludes_1", "log_excludes_1"]


def coverage_table(
  ns: Sequence[int] = (3, 5),
  sigmas: Sequence[float] = (0.25, 1.0, 2.3),
  *,
  gmean: float = 765.0,
  draws: int = 20000,
  seed: int = 0,
) -> pd.DataFrame:
  """:func:`coverage` for every ``n`` and ``sigma`` (columns :data:`COVERAGE_COLUMNS`);
  docs/statistics.md quotes it."""
  rows = [
    {"n": n, "sigma": s, **coverage(n, s, gmean=gmean, draws=draws, seed=seed)}
    for n in ns
    for s in sigmas
  ]
  return pd.DataFrame(rows, columns=COVERAGE_COLUMNS)
