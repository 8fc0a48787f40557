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
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

__all__ = ["CONFIDENCE", "METHOD", "t_quantile", "mean_ci", "split", "group_stats", "paired_stats"]

#: Two-sided confidence level of every interval.
CONFIDENCE = 0.95
#: How the intervals are computed, in words (written into the report).
METHOD = (
  "Student t over seeds: mean ± t(0.975, n-1)·s/√n, with s the sample standard deviation "
  "(n-1 denominator); paired differences use the same formula on the per-seed differences"
)


def t_quantile(p: float, df: int) -> float:
  """The ``p`` quantile of Student's t with ``df`` degrees of freedom (scipy, which jax
  requires)."""
  from scipy.stats import t

  return float(t.ppf(p, df))


def mean_ci(
  values: Iterable[float], confidence: float = CONFIDENCE
) -> tuple[float, float, float, int]:
  """``(mean, ci_lo, ci_hi, n)`` of ``values`` with the Student t interval (module docstring).

  ``n`` counts every value (non-finite ones included); any non-finite value makes the mean
  NaN/inf and the interval NaN; ``n == 1`` gives a NaN interval; ``n == 0`` all NaN.
  """
  x = np.asarray(
    [math.nan if v is None or v is pd.NA else float(v) for v in values], dtype=np.float64
  )
  n = int(x.size)
  if n == 0:
    return math.nan, math.nan, math.nan, 0
  with np.errstate(invalid="ignore", over="ignore"):
    mean = float(np.mean(x))
  if n == 1 or not np.isfinite(x).all():
    return mean, math.nan, math.nan, n
  s = float(np.std(x, ddof=1))
  half = t_quantile(0.5 + confidence / 2, n - 1) * s / math.sqrt(n)
  return mean, mean - half, mean + half, n


def _key(v) -> str:
  """A hashable, NaN-safe key for grouping on object/float/Int64 cells."""
  if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
    return "\0none"
  if isinstance(v, (float, np.floating)) and float(v).is_integer():
    return repr(int(v))
  if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
    return repr(int(v))
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


def group_stats(
  df: pd.DataFrame,
  group_cols: Sequence[str],
  metrics: Sequence[str],
  *,
  unit_col: str | None = "seed",
  confidence: float = CONFIDENCE,
) -> pd.DataFrame:
  """One row per group of ``df`` rows with equal ``group_cols``: the group columns,
  ``n_seeds`` (rows in the group), ``seeds`` (their ``unit_col`` values, comma-separated),
  then ``<metric>_mean``, ``<metric>_ci_lo``, ``<metric>_ci_hi`` per metric (:func:`mean_ci`).

  ``df`` should hold only the rows that count (e.g. runs with metrics); pass groups with no
  such rows yourself if they must appear.
  """
  cols = [*group_cols, "n_seeds", "seeds"] + [
    f"{m}_{s}" for m in metrics for s in ("mean", "ci_lo", "ci_hi")
  ]
  rows = []
  for key, g in split(df, group_cols):
    row = dict(zip(group_cols, key))
    row["n_seeds"] = len(g)
    row["seeds"] = ",".join(_fmt_unit(v) for v in g[unit_col]) if unit_col and unit_col in g else ""
    for m in metrics:
      vals = g[m].tolist() if m in g.columns else [math.nan] * len(g)
      mean, lo, hi, _ = mean_ci(vals, confidence)
      row.update({f"{m}_mean": mean, f"{m}_ci_lo": lo, f"{m}_ci_hi": hi})
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
  "n_pairs",
  "seeds",
  "mean_a",
  "mean_b",
  "diff_mean",
  "diff_ci_lo",
  "diff_ci_hi",
]


def paired_stats(
  df: pd.DataFrame,
  pair_col: str,
  context_cols: Sequence[str],
  metrics: Sequence[str],
  *,
  unit_col: str = "seed",
  order: Sequence | None = None,
  confidence: float = CONFIDENCE,
) -> pd.DataFrame:
  """Paired differences between the values of ``pair_col`` (e.g. mixers), by ``unit_col``
  (seed), within each group of equal ``context_cols``.

  For every context and every pair ``a`` before ``b`` in ``order`` (default: first-seen
  order) that both occur there, the units both have are matched; per metric the row holds
  ``n_pairs``, ``seeds``, ``mean_a``, ``mean_b`` (over the matched units) and the
  :func:`mean_ci` of ``b - a`` as ``diff_mean``, ``diff_ci_lo``, ``diff_ci_hi``. A unit
  that occurs twice for one side (should not happen) uses its first row. Without a
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
          with np.errstate(invalid="ignore", over="ignore"):
            mean, lo, hi, n = mean_ci(vb - va, confidence)
            ma = float(np.mean(va)) if va.size else math.nan
            mb = float(np.mean(vb)) if vb.size else math.nan
          rows.append(
            {
              **dict(zip(context_cols, ctx)),
              "a": a,
              "b": b,
              "metric": m,
              "n_pairs": n,
              "seeds": seeds,
              "mean_a": ma,
              "mean_b": mb,
              "diff_mean": mean,
              "diff_ci_lo": lo,
              "diff_ci_hi": hi,
            }
          )
  return pd.DataFrame(rows, columns=cols)


def _float(v) -> float:
  if v is None or v is pd.NA:
    return math.nan
  try:
    return float(v)
  except (TypeError, ValueError):
    return math.nan
