"""The transfer study's tables and figure from its sweep directory or its committed runs.csv
(configs/studies/transfer.yaml, whose header pre-registers the endpoints and decision rules).

  python docs/studies/transfer/analysis.py SWEEP_DIR [--out docs/studies/transfer]
  python docs/studies/transfer/analysis.py docs/studies/transfer/runs.csv   # recompute
  python docs/studies/transfer/analysis.py docs/studies/transfer/runs.csv sweeps_out/transfer_edge_d4 ...

Several sources merge run by run (``study.merge_runs``): a later source's run replaces an
earlier one's (the extension of configs/studies/transfer.yaml).

Writes into ``--out`` (default: beside runs.csv, or docs/studies/transfer; README.md beside
this file says what each holds): ``runs.csv`` (``mhc_jax.sweep.study.read_runs``), ``best_lr.csv``
(``lrmap.lr_table`` per arm, parametrisation and size, with each seed's own best lr),
``transfer.csv`` (per arm, parametrisation and larger size against the base size w32_d4: the
drift of the best lr, the transfer regret and the verdict by the study file's rule) and
``transfer.png`` (``plots.lr_curves``: a line per size, its best lr starred, a panel per arm x
parametrisation, the figure of the muP and CompleteP papers).
"""

import math
from pathlib import Path

import numpy as np
import pandas as pd

from mhc_jax.sweep import lrmap, plots, stats, study
from mhc_jax.sweep.report import md_table

HERE = Path(__file__).resolve().parent
BY = ["arm", "parametrization", "width", "depth"]
BASE = (32, 4)  # (width, depth) where the lr is tuned
ARMS = ["residual", "hc", "mhc", "mhc_identity"]
#: Decision thresholds of the study file: |drift| <= 1 transfers, >= 2 drifts (grid steps of 2x);
#: a regret below 0.05 nats is transfer in practice.
TRANSFERS, DRIFTS, REGRET = 1.0, 2.0, 0.05


def _seed_best(g: pd.DataFrame) -> dict:
  """Each seed's own best lr (lrmap.best_lr of its runs alone)."""
  return {int(s): lrmap.best_lr(r) for s, r in g.groupby("seed")}


def best_table(runs: pd.DataFrame) -> pd.DataFrame:
  """best_lr.csv: ``lrmap.lr_table`` per :data:`BY` with each seed's best lr beside it (before
  the table's flags, where the column stood before they were added)."""
  tab = lrmap.lr_table(runs, BY)
  seeds = [_seed_best(g) for _, g in stats.split(runs, BY)]
  tab.insert(tab.columns.get_loc("first_unstable_lr") + 1, "seed_best_lrs", "")
  return tab.assign(seed_best_lrs=[",".join(f"{v:g}" for v in d.values()) for d in seeds])


def _loss_at(g: pd.DataFrame, lr: float) -> pd.Series:
  """eval_loss per seed at ``lr`` (a non-finite loss -> inf: it failed there)."""
  r = g[np.isclose(g["lr"], lr)].set_index("seed")[lrmap.ENDPOINT].astype(float)
  return r.where(np.isfinite(r), math.inf)


def transfer_table(runs: pd.DataFrame) -> pd.DataFrame:
  """transfer.csv (module doc): one row per arm, parametrisation and size other than the base."""
  rows = []
  for (arm, par), g in runs.groupby(["arm", "parametrization"], sort=False):
    base = g[(g["width"] == BASE[0]) & (g["depth"] == BASE[1])]
    if base.empty:
      continue
    lr0, seeds0 = lrmap.best_lr(base), _seed_best(base)
    for (w, d), big in g.groupby(["width", "depth"]):
      if (w, d) == BASE:
        continue
      lr1, seeds1 = lrmap.best_lr(big), _seed_best(big)
      drift = math.log2(lr1 / lr0)
      seed_drifts = [math.log2(seeds1[s] / seeds0[s]) for s in seeds0 if s in seeds1]
      regret = (_loss_at(big, lr0) - _loss_at(big, lr1)).dropna()
      mean, lo, hi, n = stats.mean_ci(regret.replace(math.inf, np.nan).dropna())
      worst = max(abs(drift), *map(abs, seed_drifts)) if seed_drifts else abs(drift)
      verdict = "transfers" if worst <= TRANSFERS else "drifts" if abs(drift) >= DRIFTS else "-"
      rows.append(
        dict(arm=arm, parametrization=par, width=w, depth=d, base_best_lr=lr0, best_lr=lr1)
        | dict(drift_log2=drift, seed_drifts_log2=",".join(f"{v:+g}" for v in seed_drifts))
        | dict(regret=mean, regret_ci_lo=lo, regret_ci_hi=hi, n_seeds=n)
        | dict(regret_failed=int(np.isinf(regret).sum()), verdict=verdict)
        | dict(regret_small=bool(mean < REGRET) if n else False)
      )
  return pd.DataFrame(rows)


def endpoint3(best: pd.DataFrame) -> pd.DataFrame:
  """endpoint3.csv: HC's edge against depth by the study file's rule, per arm and
  parametrisation from best_lr.csv's width-32 rows: the edges, their fall from depth 4 to 32 in
  grid steps (log2) with the bounds censoring leaves (an edge above the grid at depth 4 bounds
  the fall from below, at depth 32 from above), and the verdict (the same on every row)."""
  rows = []
  for (arm, par), c in best[best["width"] == BASE[0]].groupby(["arm", "parametrization"]):
    d4, d32 = (c[c["depth"] == d].iloc[0] for d in (4, 32))
    f = math.log2(d4["largest_working_lr"] / d32["largest_working_lr"])
    lo, hi = -math.inf if d32["edge_censored"] else f, math.inf if d4["edge_censored"] else f
    rows.append(dict(arm=arm, parametrization=par, edge_d4=d4["largest_working_lr"]))
    rows[-1] |= dict(edge_d32=d32["largest_working_lr"], fall=f, fall_lo=lo, fall_hi=hi)
    rows[-1] |= dict(one_seed_d4=d4["edge_one_seed"], one_seed_d32=d32["edge_one_seed"])
  t = pd.DataFrame(rows).set_index(["arm", "parametrization"])
  keys = [("hc", "completep"), ("hc", "sp"), ("mhc", "completep")]
  hc_cp, hc_sp, mhc_cp = (t.reindex([k]).iloc[0] for k in keys)  # NaN where absent: no verdict
  verdict = "not decided"
  if hc_cp["fall_hi"] <= TRANSFERS and hc_sp["fall_lo"] >= DRIFTS:
    verdict = "branch scaling removes HC's depth instability"
  elif hc_cp["fall_lo"] >= DRIFTS and mhc_cp["fall_hi"] <= TRANSFERS:
    verdict = "unconstrained mixing still breaks"
  return t.reset_index().assign(verdict=verdict)


def edge_width(best: pd.DataFrame) -> pd.DataFrame:
  """edge_width.csv: the largest working lr at width 128 against width 32 (depth 4), its change
  in grid steps (log2) with the bounds censoring leaves, beside the predicted change: Haas et
  al.'s sp edge ~ width^-1/2 (-1 step over 4x) and CompleteP's flat edge (0)."""
  rows = []
  for (arm, par), c in best[best["depth"] == BASE[1]].groupby(["arm", "parametrization"]):
    if {32, 128} <= set(c["width"]):
      a, b = (c[c["width"] == w].iloc[0] for w in (32, 128))
      f = math.log2(b["largest_working_lr"] / a["largest_working_lr"])
      lo, hi = -math.inf if a["edge_censored"] else f, math.inf if b["edge_censored"] else f
      rows.append(dict(arm=arm, parametrization=par, edge_w32=a["largest_working_lr"]))
      rows[-1] |= dict(edge_w128=b["largest_working_lr"], change=f, change_lo=lo, change_hi=hi)
      rows[-1] |= dict(predicted=-1.0 if par == "sp" else 0.0)
  return pd.DataFrame(rows)


def main(argv=None) -> int:
  runs, _, out = study.load(argv, __doc__, HERE, many=True)
  best = best_table(runs)
  best.to_csv(out / "best_lr.csv", index=False)
  endpoint3(best).to_csv(out / "endpoint3.csv", index=False)
  edge_width(best).to_csv(out / "edge_width.csv", index=False)
  tab = transfer_table(runs)
  tab.to_csv(out / "transfer.csv", index=False)
  order = study.ordered(runs, ARMS, by=["parametrization", "width", "depth", "lr", "seed"])
  plots.lr_curves(
    order,
    out / "transfer.png",
    panel=["arm", "parametrization"],
    line=["width", "depth"],
    band="seeds",
    best=True,
  )
  print(md_table(tab.round(3)))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
