"""The horizon study's tables and figure from its sweep directory or its committed runs.csv
(configs/studies/horizon.yaml pre-registers every rule used here).

  python docs/studies/horizon/analysis.py sweeps_out/horizon [--out docs/studies/horizon]
  python docs/studies/horizon/analysis.py docs/studies/horizon/runs.csv   # recompute

Writes ``runs.csv`` (one row per run: arm, parametrization, width, depth, length, steps,
warmup_steps, clip, lr, seed, status, loss_init, eval_loss, baseline, failure, and the held-out
loss's lowest point along the way ``eval_min`` with ``ground_lost`` = eval_loss - eval_min),
``best_lr.csv`` (per arm and length: ``lrmap.lr_table``'s best lr, largest working lr, first
failing lr and LR sensitivity, each seed's best and largest working lr, and whether the best or
the edge sits at a grid end), ``exponents.csv`` (per arm: beta in lr ~ steps^-beta over the
clipped lengths, for the best lr and the edge, seed-mean curve and each seed), ``ordering.csv``
(each pair of arms, stress150 against t2400), ``map_vs_long.csv`` (per arm and lr: the failure
labels at stress150 and t2400), ``ground_lost.csv``, ``length_transfer.csv`` (per arm, longer
clipped length and beta: t150's best lr carried to that length by ``optim.base_steps``'s rule
``lr (T / 150)^-beta``, beta the config default and Complete(d)P's 0.5, the grid lr that stands
for it, the seed-mean loss there, the regret against that length's best, and the regret of
keeping t150's lr) and ``horizon.png`` (loss against lr, a panel per arm, a line per length).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pandas as pd

from mhc_jax import logs
from mhc_jax.sweep import lrmap, plots, stats, study
from mhc_jax.sweep.report import md_table
from mhc_jax.train.config import OptimConfig
from mhc_jax.train.optim import peak_lr

HERE = Path(__file__).resolve().parent
ARMS = ["residual", "hc", "mhc"]
LONG = ["t150", "t600", "t2400"]  # the clipped lengths beta is fitted over
COLUMNS = ["arm", "parametrization", "width", "depth", "length", "steps", "warmup_steps", "clip"]
COLUMNS += ["lr", "seed", "status", "loss_init", "eval_loss", "eval_min", "ground_lost"]
COLUMNS += ["baseline", "diverged", "failure", "amax_fwd_composite_tok_mean_max"]
LOST = 0.05  # nats: a working run that ended this far above its own best lost ground
BASE = "t150"  # the length an lr is tuned at (length_transfer.csv)
BETAS = (0.25, 0.5)  # residual's beta_opt; Complete(d)P's and optim.steps_exponent's default
TIE, REGRET = 0.01, 0.05  # within 1% of two grid lrs' log-midpoint: the worse; regret in nats


def from_sweep(sweep) -> pd.DataFrame:
  """runs.csv's rows from the sweep directory: study.read_runs plus the eval series' minimum."""
  runs = study.read_runs(sweep)
  root = Path(sweep) / "runs"
  evals = [
    [r["eval/loss"] for r in logs.read_jsonl(root / run / "metrics.jsonl") if "eval/loss" in r]
    for run in runs["run"]
  ]
  cfgs = [logs.read_config(root / run) for run in runs["run"]]
  return runs.assign(
    parametrization=[c.get("model.parametrization") for c in cfgs],
    length=runs["run"].str.extract(r"length=([^,]+)", expand=False),
    steps=runs["train.steps"],
    eval_min=[min(e) if e else math.nan for e in evals],
  ).assign(ground_lost=lambda d: d["eval_loss"] - d["eval_min"])[COLUMNS]


def _grid_end(value, grid) -> bool:
  return bool(np.isfinite(value) and value in (min(grid), max(grid)))


def best_table(runs: pd.DataFrame) -> pd.DataFrame:
  """best_lr.csv: lrmap.lr_table per (arm, length), each seed's own beside it."""
  tab = lrmap.lr_table(runs, ["arm", "length"])
  per_seed = lrmap.lr_table(runs, ["arm", "length", "seed"])
  grid = sorted(runs["lr"].unique())
  for s, g in per_seed.groupby("seed"):
    g = g.set_index(["arm", "length"]).reindex(pd.MultiIndex.from_frame(tab[["arm", "length"]]))
    tab[f"best_lr_seed{s}"] = g["best_lr"].to_numpy()
    tab[f"largest_working_lr_seed{s}"] = g["largest_working_lr"].to_numpy()
  tab["best_censored"] = [_grid_end(v, grid) for v in tab["best_lr"]]
  tab["edge_censored"] = tab["first_failing_lr"].isna()  # nothing failed above: a lower bound
  return tab


def _beta(steps, lrs) -> float:
  """-slope of log lr on log steps (least squares); NaN where a point is missing or fewer than
  two lengths have run."""
  x, y = np.log(np.asarray(steps, float)), np.log(np.asarray(lrs, float))
  return -float(np.polyfit(x, y, 1)[0]) if len(y) >= 2 and np.isfinite(y).all() else math.nan


def exponents(best: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
  """exponents.csv: beta_opt and beta_edge per arm over :data:`LONG`, mean curve and per seed."""
  steps = runs.groupby("length")["steps"].first()
  seeds = sorted(runs["seed"].unique())
  rows = []
  for arm, g in best[best["length"].isin(LONG)].groupby("arm", sort=False):
    g = g.set_index("length").loc[[l for l in LONG if l in set(g["length"])]]
    row = {"arm": arm, "lengths": len(g)}
    for name, col in (("opt", "best_lr"), ("edge", "largest_working_lr")):
      row[f"beta_{name}"] = _beta(steps[g.index], g[col])
      for s in seeds:
        row[f"beta_{name}_seed{s}"] = _beta(steps[g.index], g[f"{col}_seed{s}"])
      flag = "best_censored" if name == "opt" else "edge_censored"
      row[f"beta_{name}_censored"] = bool(g[flag].any())
    rows.append(row)
  return pd.DataFrame(rows)


def ordering(best: pd.DataFrame, a="stress150", b="t2400") -> pd.DataFrame:
  """ordering.csv: per pair of arms and metric, the difference at ``a`` and at ``b``, and whether
  the order flips with both differences outside noise (a grid step for the edge, disjoint 95%
  intervals for LR sensitivity and the loss at each arm's best lr)."""
  rows = []
  for x, y in itertools.combinations([r for r in ARMS if r in set(best["arm"])], 2):
    for metric in ("largest_working_lr", "lr_sensitivity", "loss_at_best"):
      row = {"a": x, "b": y, "metric": metric}
      for length in (a, b):
        rx, ry = (best[(best["arm"] == r) & (best["length"] == length)] for r in (x, y))
        if not len(rx) or not len(ry):
          row[f"diff_{length}"], row[f"clear_{length}"] = math.nan, False
          continue
        rx, ry = rx.iloc[0], ry.iloc[0]
        if metric == "largest_working_lr":
          d = math.log2(rx[metric] / ry[metric])
          clear = abs(d) >= 1 - 1e-9
        else:
          d = rx[metric] - ry[metric]
          lo, hi = f"{metric}_ci_lo", f"{metric}_ci_hi"
          clear = rx[lo] > ry[hi] or ry[lo] > rx[hi]
        row[f"diff_{length}"], row[f"clear_{length}"] = d, bool(clear)
      flip = np.sign(row[f"diff_{a}"]) * np.sign(row[f"diff_{b}"]) < 0
      row["flips"] = bool(flip and row[f"clear_{a}"] and row[f"clear_{b}"])
      rows.append(row)
  return pd.DataFrame(rows)


def _labels(g: pd.DataFrame) -> str:
  return "/".join(g.sort_values("seed")["failure"])


def map_vs_long(runs: pd.DataFrame, a="stress150", b="t2400") -> pd.DataFrame:
  """map_vs_long.csv: per arm and lr, each seed's failure label at ``a`` and at ``b``."""
  d = runs[runs["length"].isin([a, b])]
  tab = d.groupby(["arm", "lr", "length"], sort=False).apply(_labels, include_groups=False)
  tab = tab.unstack("length").reindex(columns=[a, b]).reset_index()
  return tab.assign(agree=tab[a] == tab[b])


def ground_lost(runs: pd.DataFrame) -> pd.DataFrame:
  """ground_lost.csv: per (arm, length, lr) the seed mean of eval_loss - eval_min, and how many
  working runs lost more than :data:`LOST` nats."""
  working = runs["failure"] == "none"
  g = runs.assign(_lost=working & (runs["ground_lost"] > LOST)).groupby(
    ["arm", "length", "lr"], sort=False
  )
  return g.agg(ground_lost=("ground_lost", "mean"), n_lost=("_lost", "sum")).reset_index()


def _grid_lr(pred: float, mean: pd.Series) -> tuple[float, bool]:
  """The grid lr (``mean``'s index, sorted) nearest ``pred`` in log space, and whether ``pred``
  fell within :data:`TIE` of the log-midpoint of two: then the one with the higher seed mean."""
  grid = mean.index.to_numpy()
  i = int(np.clip(np.searchsorted(grid, pred), 1, len(grid) - 1))
  lo, hi = grid[i - 1], grid[i]
  if abs(pred / math.sqrt(lo * hi) - 1) <= TIE:
    worse = mean.fillna(math.inf)
    return float(lo if worse[lo] >= worse[hi] else hi), True
  return float(grid[np.argmin(np.abs(np.log(grid / pred)))]), False


def length_transfer(best: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
  """length_transfer.csv (module doc): one row per arm, length longer than :data:`BASE` in
  :data:`LONG` with data, and beta in :data:`BETAS`."""
  steps, rows = runs.groupby("length")["steps"].first(), []
  at = best.set_index(["arm", "length"])
  for (arm, length), b in at.iterrows():
    if length not in LONG or steps[length] <= steps[BASE] or (arm, BASE) not in at.index:
      continue
    g = runs[(runs["arm"] == arm) & (runs["length"] == length)]
    mean = g.groupby("lr")[lrmap.ENDPOINT].agg(lambda y: stats.mean_ci(y)[0]).sort_index()
    lr0 = at.loc[(arm, BASE), "best_lr"]
    kept = mean.get(lr0, math.nan) - b["loss_at_best"]
    for beta in BETAS:
      opt = OptimConfig(lr=lr0, base_steps=int(steps[BASE]), steps_exponent=beta)
      pred = peak_lr(opt, int(steps[length]))
      lr, tie = _grid_lr(pred, mean)
      regret = mean[lr] - b["loss_at_best"]
      rows.append(
        dict(arm=arm, length=length, steps=steps[length], beta=beta, base_best_lr=lr0)
        | dict(predicted_lr=pred, grid_lr=lr, tie_took_worse=tie, loss_at_grid_lr=mean[lr])
        | dict(best_lr=b["best_lr"], loss_at_best=b["loss_at_best"], regret=regret)
        | dict(regret_small=regret < REGRET, loss_kept=mean.get(lr0, math.nan), regret_kept=kept)
      )
  return pd.DataFrame(rows)


def main(argv=None) -> int:
  src, out, _ = study.cli(argv, __doc__, HERE)
  runs = pd.read_csv(src) if src.suffix == ".csv" else from_sweep(src)
  runs = study.ordered(runs, ARMS, by=("steps", "clip", "lr", "seed"))
  study.save_runs(runs, src, out)
  best = best_table(runs)
  tables = dict(best_lr=best, exponents=exponents(best, runs), ordering=ordering(best))
  tables |= dict(map_vs_long=map_vs_long(runs), ground_lost=ground_lost(runs))
  tables |= dict(length_transfer=length_transfer(best, runs))
  study.write_tables(out, **tables)
  plots.lr_curves(
    runs, out / "horizon.png", panel="arm", line=["steps", "clip"], band="seeds", best=True
  )
  shown = ["arm", "length", "n_seeds", "best_lr", "loss_at_best", "lr_sensitivity"]
  shown += ["largest_working_lr", "first_failing_lr", "first_failure"]
  print(md_table(best[shown].round(4)))
  print(md_table(tables["exponents"].round(3)))
  print(md_table(tables["length_transfer"].round(4)))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
