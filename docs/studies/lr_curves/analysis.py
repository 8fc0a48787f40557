"""The lr_curves study's tables and figures from its sweep directory or its committed runs.csv
(configs/studies/lr_curves.yaml; the rules: docs/sweeps.md, "Stability maps").

  python docs/studies/lr_curves/analysis.py SWEEP_DIR [--out docs/studies/lr_curves]
  python docs/studies/lr_curves/analysis.py docs/studies/lr_curves/runs.csv   # recompute

Writes into ``--out`` (default: beside runs.csv, or docs/studies/lr_curves):

- ``runs.csv``: one row per run (``mhc_jax.sweep.lrmap.runs_table``): arm, mixer, qk_norm,
  depth, width, lr, seed, status, loss_init, eval_loss, ..., diverged, baseline (the byte-
  frequency loss of the run's held-out batches), failure (none | diverged | no_training). A
  runs.csv from before the failure rule had a floor (issue 48) gets the last two from
  :data:`DATA` and is rewritten with them.
- ``lr_sensitivity.csv``: per arm and depth (``lrmap.lr_table``): the best lr and the held-out
  loss there with its 95% t interval over seeds, Wortsman's LR sensitivity with its interval,
  the largest working lr, the first failing one and its kind, the largest stable lr by
  divergence alone (the rule before issue 48).
- ``paired_best_lr.csv``: each pair of arms at their own best lr, per depth, paired by seed
  (``mhc_jax.sweep.stats.paired_stats`` on eval_loss).
- ``mechanism.csv``: per arm and depth at the arm's best lr, whether the mixing is used: the
  final ``H_res`` diagonal and its shift from step 0 (mHC arms), the per-token composite gain
  (geometric mean, log-scale interval) and the stream spread after the last layer.
- ``lr_curves.png`` (held-out loss against lr, a panel per arm, a line per depth, bands over
  seeds, the baseline dashed), ``edges.png`` (``plots.edge_chart``: best to largest working lr
  and the first failing lr by kind, per depth, beside LR sensitivity) and ``stable_lr.png`` (the
  largest working lr, the first failing lr, grey where none failed, the best lr, and the old
  rule's largest stable lr as arm x depth heatmaps).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from mhc_jax.sweep import lrmap, plots, report, stats

HERE = Path(__file__).resolve().parent
ARMS = ["residual", "residual_qk", "hc", "hc_qk", "mhc", "mhc_uniform", "mhc_identity"]
FAMILIES = {
  "single stream": ["residual", "residual_qk"],
  "unconstrained streams": ["hc", "hc_qk"],
  "doubly stochastic streams": ["mhc", "mhc_uniform"],
  "fixed streams": ["mhc_identity"],
}
#: The study's data settings (configs/studies/lr_curves.yaml, variant cpu), for the baseline.
DATA = dict(seq_len=64, batch_size=8, eval_batches=8, val_fraction=0.05)


MECHANISM = ["h_res_diag_mean", "h_res_shift_mean", lrmap.GAIN, "stream_spread_last"]


def mechanism(runs: pd.DataFrame) -> pd.DataFrame:
  """Is the mixing used? The :data:`MECHANISM` columns at each arm's own best lr, per depth."""
  best = lrmap.at_best_lr(runs, lrmap.BY)
  return stats.group_stats(best, lrmap.BY, MECHANISM, log_metrics=[lrmap.GAIN])


def tables(runs: pd.DataFrame, arms=ARMS, refs=()) -> tuple[pd.DataFrame, pd.DataFrame]:
  """(lr_sensitivity, paired_best_lr) from runs.csv's rows, in the order of ``arms``; the pairs
  are every two arms, or those with an arm of ``refs`` where it is given."""
  runs = runs.assign(_o=runs["arm"].map(lambda a: arms.index(a) if a in arms else len(arms)))
  runs = runs.sort_values(["_o", "arm", "depth", "lr", "seed"], kind="stable").drop(columns="_o")
  best = lrmap.at_best_lr(runs, lrmap.BY)
  order = [a for a in arms if a in set(runs["arm"])]
  paired = stats.paired_stats(best, "arm", ["depth", "width"], [lrmap.ENDPOINT], order=order)
  if refs:
    paired = paired[paired["a"].isin(refs) | paired["b"].isin(refs)].reset_index(drop=True)
  return lrmap.lr_table(runs), paired


def main(argv=None) -> int:
  src, out, _ = report.study_cli(argv, __doc__, HERE)
  runs = report.study_runs(src)
  upgrade = "baseline" not in runs
  runs = report.with_baseline(runs, **DATA) if upgrade else runs
  report.save_runs(runs, src, out, changed=upgrade)
  write(runs, out, FAMILIES)
  return 0


def write(runs, out: Path, families: dict, refs=()) -> pd.DataFrame:
  """Every table and figure of the module doc from ``runs`` into ``out`` (arms in the order of
  ``families``; pairs as :func:`tables`); returns the lr table."""
  lr_tab, paired = tables(runs, [a for fam in families.values() for a in fam], refs)
  lr_tab.to_csv(out / "lr_sensitivity.csv", index=False)
  paired.to_csv(out / "paired_best_lr.csv", index=False)
  mechanism(runs).to_csv(out / "mechanism.csv", index=False)
  plots.lr_curves(runs, out / "lr_curves.png")
  plots.edge_chart(lr_tab, out / "edges.png", families=families)
  # the first failing lr beside the largest working one: a grey NaN cell says no seed failed
  # above the best lr on the grid, so a largest working lr at the grid's top is a lower bound
  cols = ["largest_working_lr", "first_failing_lr", "best_lr", "largest_stable_lr"]
  plots.heatmaps(lr_tab, out / "stable_lr.png", x="depth", y="arm", values=cols, log=cols)
  print(report.md_table(lr_tab.round(4)))
  return lr_tab


if __name__ == "__main__":
  raise SystemExit(main())
