"""The lr_curves study's tables and figures from its sweep directory or its committed runs.csv
(configs/studies/lr_curves.yaml; the rules: docs/sweeps.md, "Stability maps").

  python docs/studies/lr_curves/analysis.py SWEEP_DIR [--out docs/studies/lr_curves]
  python docs/studies/lr_curves/analysis.py docs/studies/lr_curves/runs.csv   # recompute

Writes into ``--out`` (default: beside runs.csv, or docs/studies/lr_curves):

- ``runs.csv``: one row per run (``mhc_jax.sweep.lrmap.runs_table``): arm, mixer, qk_norm,
  depth, width, lr, seed, status, loss_init, eval_loss, ..., diverged.
- ``lr_sensitivity.csv``: per arm and depth (``lrmap.lr_table``): the best lr and the held-out
  loss there with its 95% t interval over seeds, Wortsman's LR sensitivity with its interval,
  the largest stable lr and the first unstable one.
- ``paired_best_lr.csv``: each pair of arms at their own best lr, per depth, paired by seed
  (``mhc_jax.sweep.stats.paired_stats`` on eval_loss).
- ``mechanism.csv``: per arm and depth at the arm's best lr, whether the mixing is used: the
  final ``H_res`` diagonal and its shift from step 0 (mHC arms), the per-token composite gain
  (geometric mean, log-scale interval) and the stream spread after the last layer.
- ``lr_curves.png`` (held-out loss against lr, a panel per arm, a line per depth, bands over
  seeds) and ``stable_lr.png`` (the largest stable lr, the first unstable lr, grey where no seed
  diverged on the grid, and the best lr as arm x depth heatmaps).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from mhc_jax.sweep import lrmap, plots, report, stats

HERE = Path(__file__).resolve().parent
ARMS = ["residual", "residual_qk", "hc", "hc_qk", "mhc", "mhc_uniform", "mhc_identity"]


MECHANISM = ["h_res_diag_mean", "h_res_shift_mean", lrmap.GAIN, "stream_spread_last"]


def mechanism(runs: pd.DataFrame) -> pd.DataFrame:
  """Is the mixing used? The :data:`MECHANISM` columns at each arm's own best lr, per depth."""
  best = lrmap.at_best_lr(runs, lrmap.BY)
  return stats.group_stats(best, lrmap.BY, MECHANISM, log_metrics=[lrmap.GAIN])


def tables(runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
  """(lr_sensitivity, paired_best_lr) from runs.csv's rows."""
  runs = runs.assign(_o=runs["arm"].map(lambda a: ARMS.index(a) if a in ARMS else len(ARMS)))
  runs = runs.sort_values(["_o", "arm", "depth", "lr", "seed"], kind="stable").drop(columns="_o")
  best = lrmap.at_best_lr(runs, lrmap.BY)
  order = [a for a in ARMS if a in set(runs["arm"])]
  paired = stats.paired_stats(best, "arm", ["depth", "width"], [lrmap.ENDPOINT], order=order)
  return lrmap.lr_table(runs), paired


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("source", help="a sweep directory, or a runs.csv to recompute from")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  src = Path(args.source)
  runs = report.study_runs(src)
  out = Path(args.out or (src.parent if src.suffix == ".csv" else HERE))
  out.mkdir(parents=True, exist_ok=True)
  lr_tab, paired = tables(runs)
  if (out / "runs.csv").resolve() != src.resolve():  # recomputing leaves the source as it is
    runs.to_csv(out / "runs.csv", index=False)
  lr_tab.to_csv(out / "lr_sensitivity.csv", index=False)
  paired.to_csv(out / "paired_best_lr.csv", index=False)
  mechanism(runs).to_csv(out / "mechanism.csv", index=False)
  plots.lr_curves(runs, out / "lr_curves.png")
  # first_unstable_lr beside the largest stable one: a grey NaN cell says no seed diverged on
  # the grid, so a largest stable lr at the grid's top is a lower bound on the edge
  cols = logs = ["largest_stable_lr", "first_unstable_lr", "best_lr"]
  plots.heatmaps(lr_tab, out / "stable_lr.png", x="depth", y="arm", values=cols, log=logs)
  print(report.md_table(lr_tab.round(4)))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
