"""Stability maps from per-run rows (``runs``: a study's runs.csv, with ``arm``, ``lr``,
``seed``, ``loss_init`` and the endpoint): each arm's best lr, Wortsman et al.'s LR sensitivity,
the largest stable lr, width x depth phase maps. The rules: docs/sweeps.md, "Stability maps"."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from mhc_jax.spikes import lr_sensitivity
from mhc_jax.sweep import stats
from mhc_jax.sweep.stats import _floats

ENDPOINT = "eval_loss"
#: A run diverged when its endpoint is non-finite or at least this fraction of its initial loss
#: (it came back up, or never left the uniform guess).
DIVERGED_FRACTION = 0.9
#: The best-lr selection rule, in words (written into the report).
RULE = "the lr with the lowest seed-mean loss among the lrs where every seed's is finite"
BY = ["arm", "depth", "width"]
GAIN = "amax_fwd_composite_tok_mean_max"


def diverged(runs: pd.DataFrame, endpoint: str = ENDPOINT) -> pd.Series:
  """Per run: endpoint non-finite or >= ``DIVERGED_FRACTION`` x ``loss_init``."""
  y, init = _floats(runs[endpoint]), _floats(runs["loss_init"])
  with np.errstate(invalid="ignore"):
    return pd.Series(~np.isfinite(y) | (y >= DIVERGED_FRACTION * init), index=runs.index)


#: The runs a map reads: those that ended (a failed run, halted by the non-finite policy or
#: crashed, has no endpoint and counts as diverged); a run still training or pending is not a
#: point of the map.
ENDED = ("done", "failed")


def runs_table(summary: pd.DataFrame) -> pd.DataFrame:
  """runs.csv from a report's summary table: the :data:`ENDED` runs, ``arm`` (the run name's
  ``arm=`` part, else the mixer) first, every summary column, then ``diverged``."""
  if "status" in summary:
    summary = summary[summary["status"].isin(ENDED)]
  arm = summary["run"].str.extract(r"(?:^|,)arm=([^,]+)", expand=False)
  d = summary.drop(columns="arm", errors="ignore").assign(diverged=diverged(summary))
  return d.assign(arm=arm.fillna(summary.get("mixer", summary["run"])))[["arm", *d.columns]]


def best_lr(g: pd.DataFrame, endpoint: str = ENDPOINT) -> float:
  """The best lr of one group's runs (all lrs and seeds) under :data:`RULE`; NaN if none."""
  mean = (
    g.assign(_lr=_floats(g["lr"]), _y=_floats(g[endpoint])).groupby("_lr")["_y"].mean(skipna=False)
  )
  mean = mean[np.isfinite(mean)]  # a non-finite seed makes its lr's mean non-finite
  return float(mean.idxmin()) if len(mean) else math.nan


def at_best_lr(runs: pd.DataFrame, by: list[str], endpoint: str = ENDPOINT) -> pd.DataFrame:
  """The runs at their group's :func:`best_lr` (groups: equal ``by`` columns)."""
  parts = [g[_floats(g["lr"]) == best_lr(g, endpoint)] for _, g in stats.split(runs, by)]
  return pd.concat(parts) if parts else runs.iloc[:0]


def _stable(grid: np.ndarray, bad: np.ndarray, best: float) -> tuple[float, float]:
  """(largest stable lr, first unstable lr): walking up the grid from ``best``, the last lr
  before the first where any seed diverged (NaN where none above did)."""
  above = grid >= best  # all False for a NaN best
  first = grid[above & bad]
  top = grid[above & ~bad & (grid < first.min() if first.size else True)]
  return float(top.max()) if top.size else math.nan, float(first.min()) if first.size else math.nan


def lr_table(runs: pd.DataFrame, by: list[str] = BY, endpoint: str = ENDPOINT) -> pd.DataFrame:
  """lr_sensitivity.csv per group of equal ``by``: the best lr, the endpoint there, Wortsman's LR
  sensitivity per seed (mean and t interval over seeds), the largest stable lr (:func:`_stable`)."""
  by = [c for c in by if c in runs.columns]
  rows = []
  for key, g in stats.split(runs, by):
    g = g.assign(_lr=_floats(g["lr"]), _y=_floats(g[endpoint]), _bad=diverged(g, endpoint))
    best = best_lr(g, endpoint)
    at, lo, hi, _ = stats.mean_ci(g.loc[g["_lr"] == best, "_y"])
    per_seed = [lr_sensitivity(list(s["_y"]), s["loss_init"].iloc[0]) for _, s in g.groupby("seed")]
    sens, s_lo, s_hi, n = stats.mean_ci(per_seed)
    bad = g.groupby("_lr")["_bad"].any()
    stable, first = _stable(bad.index.to_numpy(), bad.to_numpy(), best)
    rows.append(
      {**dict(zip(by, key)), "n_seeds": n, "n_lr": len(bad), "best_lr": best}
      | {"loss_at_best": at, "loss_at_best_ci_lo": lo, "loss_at_best_ci_hi": hi}
      | {"lr_sensitivity": sens, "lr_sensitivity_ci_lo": s_lo, "lr_sensitivity_ci_hi": s_hi}
      | {"largest_stable_lr": stable, "first_unstable_lr": first}
    )
  return pd.DataFrame(rows)


def phase_table(runs: pd.DataFrame, by: list[str] = BY, endpoint: str = ENDPOINT) -> pd.DataFrame:
  """Per group of equal ``by`` (one lr): the fractions of seeds that diverged, spiked (an event)
  or either; the endpoint's mean and the composite gain's geometric mean, with t intervals."""
  by = [c for c in by if c in runs.columns]
  d = runs.assign(_div=diverged(runs, endpoint), _spk=_floats(runs["spike_count"]) > 0)
  out = stats.group_stats(d, by, [endpoint, GAIN], log_metrics=[GAIN])
  frac = d.assign(_any=d["_div"] | d["_spk"]).groupby(by, sort=False)[["_div", "_spk", "_any"]]
  frac = frac.mean().set_axis(["frac_diverged", "frac_spiked", "frac_unstable"], axis=1)
  return out.merge(frac.reset_index(), on=by)
