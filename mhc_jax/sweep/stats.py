"""Error bars over seeds: means, 95% Student t intervals, paired differences and ratios.

Why Student t and not the bootstrap, why gains are summarised on the log scale, how non-finite
values and significance are treated, and the coverage numbers: docs/statistics.md.
"""

from __future__ import annotations

import itertools
import math
from typing import Collection, Iterable, Sequence

import numpy as np
import pandas as pd

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
#: The columns of :func:`paired_stats` after its context columns.
PAIRED_COLUMNS = """a b metric scale n_pairs seeds mean_a mean_b diff_mean diff_ci_lo diff_ci_hi
ratio_mean ratio_ci_lo ratio_ci_hi significant""".split()


def t_quantile(p: float, df: int) -> float:
  """The ``p`` quantile of Student's t with ``df`` degrees of freedom (scipy, which jax requires)."""
  from scipy.stats import t

  return float(t.ppf(p, df))


def _floats(values: Iterable) -> np.ndarray:
  """Values as float64; None, NA and what is not a number -> NaN."""
  s = pd.to_numeric(pd.Series(list(values), dtype=object), errors="coerce")
  return s.to_numpy(dtype=np.float64, na_value=np.nan)


def mean_ci(
  values: Iterable[float], confidence: float = CONFIDENCE, *, log: bool = False
) -> tuple[float, float, float, int]:
  """``(mean, ci_lo, ci_hi, n)`` with the Student t interval (``n`` counts every value); ``log``:
  the geometric mean and the back-transformed interval of the logs. Non-finite, single, missing
  and (on the log scale) non-positive values: docs/statistics.md."""
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
  half = t_quantile(0.5 + confidence / 2, n - 1) * float(np.std(x, ddof=1)) / math.sqrt(n)
  return mean, mean - half, mean + half, n


def t_test(values: Iterable[float]) -> float:
  """The two-sided p value of a one-sample Student t test of mean 0 (on paired differences: the
  paired t test); 0 where the values do not spread (docs/studies/bayes_thesis/README.md)."""
  from scipy.stats import t

  x = _floats(values)
  se = float(np.std(x, ddof=1)) / math.sqrt(x.size)
  return 2 * float(t.sf(abs(float(np.mean(x)) / se), x.size - 1)) if se > 0 else 0.0


def holm(p: Iterable[float]) -> np.ndarray:
  """Holm's step-down adjusted p values of one family of tests, in the order given: the k-th
  smallest times (m - k + 1), at most 1, never below the one before it."""
  p = _floats(p)
  adj, running = np.empty_like(p), 0.0
  for rank, i in enumerate(np.argsort(p)):
    running = max(running, min(1.0, (len(p) - rank) * p[i]))
    adj[i] = running
  return adj


def significant(lo: float, hi: float, scale: float | None, rtol: float = SIGNIFICANCE_RTOL) -> bool:
  """True when ``[lo, hi]`` excludes 0 by more than ``rtol * |scale|`` (``scale=None``: a log
  ratio's interval, which must clear 0 by more than ``rtol``); NaN bounds: False."""
  tol = rtol * (1.0 if scale is None else abs(float(scale)))
  lo, hi = float(lo), float(hi)
  return math.isfinite(lo) and math.isfinite(hi) and (lo > tol or hi < -tol)


def _key(v) -> str:
  """A hashable, NaN-safe key for grouping on object/float/Int64 cells (64 == 64.0 == int64)."""
  if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
    return "\0none"
  if isinstance(v, (int, np.integer, float, np.floating)) and not isinstance(v, bool):
    return repr(int(v)) if float(v).is_integer() else repr(float(v))
  return repr(v)


def split(df: pd.DataFrame, cols: Sequence[str]) -> list[tuple[tuple, pd.DataFrame]]:
  """Rows grouped by equal values of ``cols`` (None/NaN/NA equal to each other), in first-seen
  order; each group's key holds the first row's original values."""
  if not cols:
    return [((), df)]
  keys = [df[c].map(_key).to_numpy() for c in cols]
  return [(tuple(g[c].iloc[0] for c in cols), g) for _, g in df.groupby(keys, sort=False)]


def centre(metric: str, log_metrics: Collection[str] = ()) -> str:
  """A metric's centre column: ``<metric>_gmean`` on the log scale, else ``<metric>_mean``."""
  return f"{metric}_gmean" if metric in log_metrics else f"{metric}_mean"


def _units(values: Iterable) -> str:
  """Seeds as "0,1,2" (3.0 -> "3", a missing one -> "?")."""
  out = []
  for v in values:
    whole = isinstance(v, (float, np.floating)) and float(v).is_integer()
    out.append("?" if _key(v) == "\0none" else str(int(v)) if whole else str(v))
  return ",".join(out)


def group_stats(
  df: pd.DataFrame,
  group_cols: Sequence[str],
  metrics: Sequence[str],
  *,
  log_metrics: Collection[str] = (),
  unit_col: str | None = "seed",
  confidence: float = CONFIDENCE,
) -> pd.DataFrame:
  """One row per group of equal ``group_cols``: those columns, ``n_seeds`` (its rows), ``seeds``
  (their ``unit_col``), then per metric its :func:`centre`, ``_ci_lo`` and ``_ci_hi``
  (:func:`mean_ci`). ``df`` holds only the rows that count (e.g. runs with metrics)."""
  cols = [*group_cols, "n_seeds", "seeds"]
  cols += [c for m in metrics for c in (centre(m, log_metrics), f"{m}_ci_lo", f"{m}_ci_hi")]
  rows = []
  for key, g in split(df, group_cols):
    row = {**dict(zip(group_cols, key)), "n_seeds": len(g)}
    row["seeds"] = _units(g[unit_col]) if unit_col and unit_col in g else ""
    for m in metrics:
      vals = g[m] if m in g.columns else [math.nan] * len(g)
      mid, lo, hi, _ = mean_ci(vals, confidence, log=m in log_metrics)
      row |= {centre(m, log_metrics): mid, f"{m}_ci_lo": lo, f"{m}_ci_hi": hi}
    rows.append(row)
  return pd.DataFrame(rows, columns=cols)


def _compare(va: np.ndarray, vb: np.ndarray, log: bool, confidence: float) -> dict:
  """The :data:`PAIRED_COLUMNS` from ``scale`` on of one metric's paired values."""
  ma, mb = (mean_ci(v, confidence, log=log)[0] for v in (va, vb))
  out = {"scale": "log" if log else "raw", "mean_a": ma, "mean_b": mb}
  out |= dict.fromkeys(PAIRED_COLUMNS[8:14], math.nan)
  with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
    if log:  # the per-pair log ratios, NaN where a value is <= 0
      ok = (va > 0) & (vb > 0)
      mean, lo, hi, _ = mean_ci(np.where(ok, np.log(vb / va), np.nan), confidence)
      out |= dict(ratio_mean=math.exp(mean), ratio_ci_lo=math.exp(lo), ratio_ci_hi=math.exp(hi))
      return out | {"significant": significant(lo, hi, None)}
    mean, lo, hi, _ = mean_ci(vb - va, confidence)
  out |= dict(diff_mean=mean, diff_ci_lo=lo, diff_ci_hi=hi)
  return out | {"significant": significant(lo, hi, max(abs(ma), abs(mb)))}


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
  """Paired comparisons between the values of ``pair_col`` (mixers) by ``unit_col`` (seed),
  within each group of equal ``context_cols``: per pair ``a`` before ``b`` in ``order`` (default
  first-seen) and metric, the :data:`PAIRED_COLUMNS` (``diff_*`` of ``b - a`` on the raw scale,
  ``ratio_*`` of ``b / a`` for ``log_metrics``; docs/statistics.md). A unit twice on one side
  uses its first row; without ``unit_col`` each side is one unit."""
  rows = []
  for ctx, g in split(df, context_cols):
    present = list(dict.fromkeys(g[pair_col].tolist()))
    if order is not None:
      present = [v for v in order if v in present] + [v for v in present if v not in order]
    units = g[unit_col].map(_key).to_numpy() if unit_col in g.columns else "\0one"
    side = g.assign(_u=units).drop_duplicates([pair_col, "_u"])
    for a, b in itertools.combinations(present, 2):
      both = side[side[pair_col] == a].merge(side[side[pair_col] == b], on="_u")
      head = {**dict(zip(context_cols, ctx)), "a": a, "b": b}
      head |= {"n_pairs": len(both), "seeds": ""}
      if unit_col in g.columns:
        head["seeds"] = _units(both[f"{unit_col}_x"])
      for m in metrics:
        va, vb = _floats(both[f"{m}_x"]), _floats(both[f"{m}_y"])
        rows.append({**head, "metric": m, **_compare(va, vb, m in log_metrics, confidence)})
  return pd.DataFrame(rows, columns=[*context_cols, *PAIRED_COLUMNS])


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
  """How the 95% intervals of ``n`` log-normal values ``gmean * exp(N(0, sigma^2))`` behave over
  ``draws`` simulated groups: ``spread`` (median max/min), how often the raw interval covers the
  mean (``raw``) and the log one the geometric mean (``log``), and how often each excludes 1
  (``raw_excludes_1``, ``log_excludes_1``); docs/statistics.md quotes it."""
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


def coverage_table(
  ns: Sequence[int] = (3, 5),
  sigmas: Sequence[float] = (0.25, 1.0, 2.3),
  *,
  gmean: float = 765.0,
  draws: int = 20000,
  seed: int = 0,
) -> pd.DataFrame:
  """:func:`coverage` for every ``n`` and ``sigma``, one row each (docs/statistics.md)."""
  kw = dict(gmean=gmean, draws=draws, seed=seed)
  return pd.DataFrame([{"n": n, "sigma": s, **coverage(n, s, **kw)} for n in ns for s in sigmas])
