"""Stability maps from per-run rows (``runs``: a study's runs.csv, with ``arm``, ``lr``,
``seed``, ``loss_init``, the endpoint and the task's ``baseline``): each arm's best lr, Wortsman
et al.'s LR sensitivity, the largest working lr, width x depth phase maps. The rules:
docs/sweeps.md, "Stability maps"."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from mhc_jax.spikes import lr_sensitivity
from mhc_jax.sweep import stats
from mhc_jax.sweep.stats import _floats
from mhc_jax.sweep.summary import _id_columns

ENDPOINT = "eval_loss"
#: A run diverged when its endpoint is non-finite or at least this fraction of its initial loss
#: (it came back up, or never left the uniform guess).
DIVERGED_FRACTION = 0.9
#: A run that did not train: finite and below the divergence line, but not at least this many
#: nats below the task's trivial predictor (``baseline``: for text, the byte-frequency loss on the
#: same held-out batches, ``ByteWindows.baseline``). Why 0.1: docs/sweeps.md, "Stability maps".
NO_TRAINING_MARGIN = 0.1
#: A verdict near the margin: its largest working lr moves when the margin moves this many nats.
NEAR_MARGIN = 0.05
#: The best-lr selection rule, in words (written into the report).
RULE = "the lr with the lowest seed-mean loss among the lrs where every seed's is finite"
BY = ["arm", "depth", "width"]
GAIN = "amax_fwd_composite_tok_mean_max"


def diverged(runs: pd.DataFrame, endpoint: str = ENDPOINT) -> pd.Series:
  """Per run: endpoint non-finite or >= ``DIVERGED_FRACTION`` x ``loss_init``."""
  y, init = _floats(runs[endpoint]), _floats(runs["loss_init"])
  with np.errstate(invalid="ignore"):
    return pd.Series(~np.isfinite(y) | (y >= DIVERGED_FRACTION * init), index=runs.index)


def failure(runs: pd.DataFrame, endpoint: str = ENDPOINT, margin=NO_TRAINING_MARGIN) -> pd.Series:
  """Per run: ``diverged`` (:func:`diverged`), else ``no_training`` (endpoint above ``baseline``
  minus ``margin``; never where the baseline is missing), else ``none``."""
  y = _floats(runs[endpoint])
  base = _floats(runs["baseline"]) if "baseline" in runs else np.full(len(runs), np.nan)
  with np.errstate(invalid="ignore"):
    stuck = y > base - margin
  kind = np.where(diverged(runs, endpoint), "diverged", np.where(stuck, "no_training", "none"))
  return pd.Series(kind, index=runs.index)


#: The runs a map reads: those that ended (a failed run, halted by the non-finite policy or
#: crashed, has no endpoint and counts as diverged); a run still training or pending is not a
#: point of the map.
ENDED = ("done", "failed")


def runs_table(summary: pd.DataFrame) -> pd.DataFrame:
  """runs.csv from a report's summary table: the :data:`ENDED` runs, ``arm`` (the run name's
  ``arm=`` part, else the mixer) first, every summary column, then ``diverged`` and ``failure``."""
  if "status" in summary:
    summary = summary[summary["status"].isin(ENDED)]
  arm = summary["run"].str.extract(r"(?:^|,)arm=([^,]+)", expand=False)
  d = summary.drop(columns="arm", errors="ignore")
  d = d.assign(diverged=diverged(summary), failure=failure(summary))
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


def _kind(kinds: set) -> str:
  return "both" if {"diverged", "no_training"} <= kinds else (kinds - {"none"} or {""}).pop()


def _flags(g: pd.DataFrame, endpoint: str, best: float, working: float, first: float) -> dict:
  """Where one group's verdict rests on little (docs/sweeps.md, "Stability maps"): no failure
  above the best lr (the edge is a lower bound), one failing seed at the first failing lr, an
  edge that moves with the margin +- :data:`NEAR_MARGIN`, a best lr at an end of the grid."""
  moved = []
  for m in (NO_TRAINING_MARGIN - NEAR_MARGIN, NO_TRAINING_MARGIN + NEAR_MARGIN):
    f = (failure(g, endpoint, m) != "none").groupby(g["_lr"]).any()
    moved.append(_stable(f.index.to_numpy(), f.to_numpy(), best)[0])
  grid = np.sort(g["_lr"].unique())
  return {"edge_censored": math.isfinite(best) and math.isnan(first)} | {
    "edge_one_seed": int((g.loc[g["_lr"] == first, "_f"] != "none").sum()) == 1,
    "edge_near_margin": not np.array_equal(moved, [working, working], equal_nan=True),
    "best_censored": bool(grid.size and best in (grid[0], grid[-1])),
  }


def lr_table(runs: pd.DataFrame, by: list[str] = BY, endpoint: str = ENDPOINT) -> pd.DataFrame:
  """lr_sensitivity.csv per group of equal ``by``: the best lr, the endpoint there, Wortsman's LR
  sensitivity per seed (mean and t interval over seeds), the largest working lr and the first
  failing one with its kind (:func:`failure`; ``both``: diverged and no_training seeds), the
  largest stable lr by divergence alone (the rule before issue 48), each by :func:`_stable`; then
  the flags of :func:`_flags`."""
  by = [c for c in by if c in runs.columns]
  rows = []
  for key, g in stats.split(runs, by):
    g = g.assign(_lr=_floats(g["lr"]), _y=_floats(g[endpoint]), _f=failure(g, endpoint))
    g = g.assign(_bad=g["_f"] == "diverged")
    best = best_lr(g, endpoint)
    at, lo, hi, _ = stats.mean_ci(g.loc[g["_lr"] == best, "_y"])
    per_seed = [lr_sensitivity(list(s["_y"]), s["loss_init"].iloc[0]) for _, s in g.groupby("seed")]
    sens, s_lo, s_hi, n = stats.mean_ci(per_seed)
    bad, failed = g.groupby("_lr")["_bad"].any(), g.groupby("_lr")["_f"].agg(set)
    stable, first = _stable(bad.index.to_numpy(), bad.to_numpy(), best)
    failing = np.array([k != {"none"} for k in failed])
    working, first_fail = _stable(failed.index.to_numpy(), failing, best)
    rows.append(
      {**dict(zip(by, key)), "n_seeds": n, "n_lr": len(bad), "best_lr": best}
      | {"loss_at_best": at, "loss_at_best_ci_lo": lo, "loss_at_best_ci_hi": hi}
      | {"lr_sensitivity": sens, "lr_sensitivity_ci_lo": s_lo, "lr_sensitivity_ci_hi": s_hi}
      | {"largest_working_lr": working, "first_failing_lr": first_fail}
      | {"first_failure": "" if math.isnan(first_fail) else _kind(failed[first_fail])}
      | {f"n_{k}": int((g["_f"] == k).sum()) for k in ("diverged", "no_training")}
      | {"largest_stable_lr": stable, "first_unstable_lr": first}
      | _flags(g, endpoint, best, working, first_fail)
    )
  return pd.DataFrame(rows)


def phase_table(runs: pd.DataFrame, by: list[str] = BY, endpoint: str = ENDPOINT) -> pd.DataFrame:
  """Per group of equal ``by`` (one lr): the fractions of seeds that diverged, did not train,
  failed (either: :func:`failure`), spiked (an event) or diverged or spiked; the endpoint's mean
  and the composite gain's geometric mean, with t intervals."""
  by = [c for c in by if c in runs.columns]
  kind = failure(runs, endpoint)
  d = runs.assign(_div=kind == "diverged", _no=kind == "no_training", _fail=kind != "none")
  d = d.assign(_spk=_floats(runs["spike_count"]) > 0)
  out = stats.group_stats(d, by, [endpoint, GAIN], log_metrics=[GAIN])
  cols = ["_div", "_no", "_fail", "_spk", "_any"]
  frac = d.assign(_any=d["_div"] | d["_spk"]).groupby(by, sort=False)[cols].mean()
  names = ["frac_diverged", "frac_no_training", "frac_failed", "frac_spiked", "frac_unstable"]
  frac = frac.set_axis(names, axis=1)
  return out.merge(frac.reset_index(), on=by)


def has_lr_axis(df: pd.DataFrame) -> bool:
  """True when the table has an ``lr`` column with at least two distinct learning rates."""
  return "lr" in df.columns and pd.to_numeric(df["lr"], errors="coerce").dropna().nunique() >= 2


LR_COLUMNS = "n_lr lrs best_lr best_final_loss loss_init n_diverged lr_sensitivity".split()


def lr_sensitivity_table(df: pd.DataFrame) -> pd.DataFrame:
  """Wortsman et al.'s LR sensitivity (:func:`mhc_jax.spikes.lr_sensitivity`) per group of runs
  that differ only in ``lr`` (a NaN/inf ``final_loss`` counts as diverged); no lr axis: empty."""
  group_cols = [c for c in _id_columns(df) if c not in ("run", "lr")]
  rows, groups = [], []
  if has_lr_axis(df):
    d = df[df["steps"] > 0].assign(_lr=lambda x: pd.to_numeric(x["lr"], errors="coerce"))
    groups = stats.split(d[d["_lr"].notna()], group_cols)
  for key, g in groups:
    per_lr = g.groupby("_lr")["final_loss"].mean().sort_index()
    init = g["loss_init"][np.isfinite(g["loss_init"])]
    loss_init = float(init.mean()) if len(init) else math.nan
    finite = per_lr[np.isfinite(per_lr)]
    ok = len(per_lr) >= 2 and math.isfinite(loss_init)
    best = (float(finite.idxmin()), float(finite.min())) if len(finite) else (math.nan, math.nan)
    rows.append(
      {**dict(zip(group_cols, key)), "n_lr": len(per_lr)}
      | {"lrs": ", ".join(f"{x:g}" for x in per_lr.index)}
      | {"best_lr": best[0], "best_final_loss": best[1], "loss_init": loss_init}
      | {"n_diverged": int((~np.isfinite(per_lr)).sum())}
      | {"lr_sensitivity": lr_sensitivity(per_lr.to_dict(), loss_init) if ok else math.nan}
    )
  out = pd.DataFrame(rows, columns=[*group_cols, *LR_COLUMNS])
  out.attrs = {"group_columns": group_cols}
  return out


def best_lr_rows(df: pd.DataFrame) -> pd.DataFrame:
  """The runs at their arm's own best lr (:data:`RULE`) per group of the other axes, the lr
  column renamed ``best_lr`` (the report's paired_best_lr.csv)."""
  d, ids = df[df["steps"] > 0], [c for c in _id_columns(df) if c != "lr"]
  out = at_best_lr(d, [c for c in ids if c not in ("run", "seed")], endpoint_of(d)[0])
  out = out.rename(columns={"lr": "best_lr"})
  out.attrs = {**df.attrs, "id_columns": ids}
  return out


def endpoint_of(d: pd.DataFrame) -> tuple[str, str]:
  """(column, words) of the loss the sentence compares: held-out where any run has it."""
  if "eval_loss" in d.columns and np.isfinite(_floats(d["eval_loss"])).any():
    return "eval_loss", "held-out loss"
  return "final_loss", "final training loss"
