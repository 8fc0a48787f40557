"""The mhc_init study's answer from its sweep directories (configs/studies/mhc_init.yaml).

  .venv/bin/mhc-jax report SWEEP_DIR/d16 && .venv/bin/mhc-jax report SWEEP_DIR/d32
  .venv/bin/python docs/studies/mhc_init/analysis.py SWEEP_DIR/d16 SWEEP_DIR/d32 \\
      SWEEP_DIR/d16_control SWEEP_DIR/d32_control [--out docs/studies/mhc_init]

Reads each finished run's row (its summary.json says done) of every sweep's report/summary.csv
and the per-layer :data:`LAYER` of its last diagnostics step. Writes (README.md beside this file
says what each holds) and prints as Markdown: ``runs.csv`` (one row per run), ``arms.csv`` (per
depth and arm over seeds: :data:`RAW` means, :data:`LOG` geometric means, 95% t intervals),
``paired_arms.csv`` (the :data:`PAIRS`, paired by seed, b - a or b / a), ``h_res_layers.png``
(``plots.h_res_vs_layer``: :data:`LAYER` per mixer layer, a line per arm and depth) and
``tradeoff.png`` (the H_res shift against the loss difference to mhc_identity and against the
stream spread).
"""

import sys

import numpy as np
import pandas as pd

from mhc_jax import logs
from mhc_jax.sweep import plots, stats, study

ARMS = "mhc_identity mhc_identity_a1 mhc_uniform mhc_d050 mhc_d080 mhc_d090 mhc_d095 mhc_d099"
ARMS = [*ARMS.split(), "mhc_d999", "mhc_a1"]
#: (a, b) compared as b - a: every mhc arm against no mixing, and the alpha_init 1.0 arm against
#: no mixing at the same alpha_init (configs/studies/mhc_init_control.yaml)
PAIRS = [("mhc_identity", a) for a in ARMS[1:]] + [("mhc_identity_a1", "mhc_a1")]
RAW = ["eval_loss", "final_loss", "h_res_diag_mean", "h_res_shift_mean", "h_res_dynamic_share_mean"]
LOG = ["stream_spread_last", "max_grad_norm"]
LAYER = ("stream_spread", "h_res_diag", "h_res_shift")
#: The metrics the printed tables show.
SHOWN = ["eval_loss", "stream_spread_last", *RAW[2:]]


def load(sweeps) -> tuple[pd.DataFrame, dict]:
  """(runs.csv's rows, {(depth, arm, seed): the run's :data:`LAYER` at its last step})."""
  rows, layers = [], {}
  for sweep in sweeps:
    # finished runs: the run's own summary.json (the manifest lags while the sweep runs)
    done = lambda r: logs.read_json(sweep / "runs" / r / "summary.json").get("status") == "done"
    for _, r in study.report_rows(sweep, done).iterrows():
      lay = study.last_layers(sweep / "runs" / r["run"], LAYER)
      layers[(int(r["depth"]), r["arm"], int(r["seed"]))] = lay
      rows.append(
        dict(arm=r["arm"], depth=int(r["depth"]), seed=int(r["seed"]), **r[RAW + LOG])
        | dict(h_res_diag_min=float(np.min(lay.get("h_res_diag", np.nan))))
        | dict(h_res_shift_max=float(np.max(lay.get("h_res_shift", np.nan))))
        | dict(run=f"{sweep.name}/{r['run']}")
      )
  runs = pd.DataFrame(rows)
  runs = runs.assign(_o=runs["arm"].map(ARMS.index)).sort_values(["depth", "_o", "seed"])
  return runs.drop(columns="_o").reset_index(drop=True), layers


def tables(runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
  """(arms.csv, paired_arms.csv) from runs.csv's rows (tests/test_studies.py recomputes them)."""
  paired = study.pair_table(runs, ["depth"], RAW + LOG, LOG, ARMS, PAIRS)
  paired = paired.sort_values(["depth", "metric"], kind="stable").reset_index(drop=True)
  return study.arm_table(runs, ["depth", "arm"], RAW, LOG), paired


def figures(runs: pd.DataFrame, layers: dict, paired: pd.DataFrame, out) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.lines import Line2D

  arms = [a for a in ARMS if a in set(runs["arm"])]
  mixing = [a for a in arms if not a.startswith("mhc_identity")]
  color = {a: plt.get_cmap("viridis")(i / max(1, len(mixing) - 1)) for i, a in enumerate(mixing)}
  color |= {"mhc_identity": "black", "mhc_identity_a1": "grey"}
  depths = sorted(runs["depth"].unique())
  names = {k: f"arm={k[1]},depth={k[0]},seed={k[2]}" for k in layers}
  lists = [
    dict(run=names[k], step=0, **{c: list(a) for c, a in v.items()}) for k, v in layers.items()
  ]
  tags = pd.DataFrame([dict(run=n, mixer=k[1], depth=k[0], seed=k[2]) for k, n in names.items()])
  plots.h_res_vs_layer(pd.DataFrame(lists), tags, out / "h_res_layers.png")

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
  marker = dict(zip(depths, "os^"))
  bars = lambda ax, x, m, lo, hi, a, d: ax.errorbar(
    x, m, yerr=[[m - lo], [hi - m]], color=color[a], marker=marker[d], capsize=3
  )
  for depth in depths:
    for arm in arms:
      if len(g := runs[(runs["depth"] == depth) & (runs["arm"] == arm)]):
        x = g["h_res_shift_mean"].mean()
        bars(axes[1], x, *stats.mean_ci(g["stream_spread_last"], log=True)[:3], arm, depth)
        at = (paired["depth"] == depth) & (paired["b"] == arm) & (paired["metric"] == "eval_loss")
        for _, r in paired[at].head(1).iterrows():
          bars(axes[0], x, r["diff_mean"], r["diff_ci_lo"], r["diff_ci_hi"], arm, depth)
  axes[0].axhline(0, color="grey", ls=":")
  shift = "H_res shift from step 0 (layer mean)"
  axes[0].set(xlabel=shift, ylabel="held-out loss, arm - mhc_identity (paired, 95% t)")
  axes[1].set(xlabel=shift, ylabel="stream spread, last layer (gmean, 95% t)", yscale="log")
  hs = [Line2D([], [], color=color[a], lw=2, label=a) for a in arms]
  hs += [
    Line2D([], [], color="grey", ls="none", marker=marker[d], label=f"depth {d}") for d in depths
  ]
  fig.legend(handles=hs, loc="outside right upper", fontsize=8, frameon=False)
  fig.suptitle("Mixing that moves: loss against mhc_identity and stream spread")
  fig.savefig(out / "tradeoff.png", dpi=110, bbox_inches="tight")
  plt.close(fig)


def main(argv=None) -> int:
  if (cli := study.sweeps_cli(argv, __doc__)) is None:
    return 2
  runs, layers = load(cli[0])
  arms, paired = tables(runs)
  if out := cli[1]:
    study.write_tables(out, runs=runs, arms=arms, paired_arms=paired)
    figures(runs, layers, paired, out)
  study.show(arms, paired, ["depth", "arm"], SHOWN, LOG)
  return 0


if __name__ == "__main__":
  sys.exit(main())
