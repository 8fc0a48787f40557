"""The mhc_init study's answer from its sweep directories (configs/studies/mhc_init.yaml).

  .venv/bin/mhc-jax report SWEEP_DIR/d16 && .venv/bin/mhc-jax report SWEEP_DIR/d32
  .venv/bin/python docs/studies/mhc_init/analysis.py SWEEP_DIR/d16 SWEEP_DIR/d32 \\
      SWEEP_DIR/d16_control SWEEP_DIR/d32_control [--out docs/studies/mhc_init]

Reads every finished run's row (its summary.json says done) of each sweep's report/summary.csv (one sweep per depth variant),
names its arm from the run name, and reads the per-layer ``stream_spread``, ``h_res_diag`` and
``h_res_shift`` of its last diagnostics step from metrics.jsonl. Writes and prints as Markdown:

- ``runs.csv``: one row per run, the per-run summaries behind every interval (arm, depth, seed,
  held-out loss, final train loss, stream spread after the last mixer layer, H_res diagonal and
  shift (layer mean and min / max), dynamic share, max gradient norm after warm-up);
- ``arms.csv``: per depth and arm: n; held-out loss, mean and 95% t interval; stream spread after
  the last layer and the max gradient norm as geometric means with the log-scale 95% t interval;
  the layer means of ``h_res_diag``, ``h_res_shift`` and ``h_res_dynamic_share`` at the last
  diagnostics step, mean and 95% t interval over seeds;
- ``paired_arms.csv``: per depth, every mhc arm against ``mhc_identity`` (no mixing), and
  ``mhc_a1`` against ``mhc_identity_a1`` (no mixing at the same ``alpha_init`` 1.0, from
  configs/studies/mhc_init_control.yaml), paired by seed: held-out loss ``b - a`` with its 95% t
  interval, the stream spread ratio ``b / a`` on the log scale; ``significant`` as in the report (``mhc_jax.sweep.stats.significant``);
- ``h_res_layers.png``: per mixer layer at the last diagnostics step, the stream spread, H_res
  diagonal and shift of each arm (mean over seeds), one row per depth;
- ``tradeoff.png``: per arm and depth, the H_res shift against the held-out loss difference to
  mhc_identity (paired, with its interval) and against the stream spread.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from mhc_jax.sweep import stats, study

ARMS = [
  "mhc_identity",
  "mhc_identity_a1",
  "mhc_uniform",
  "mhc_d050",
  "mhc_d080",
  "mhc_d090",
  "mhc_d095",
  "mhc_d099",
  "mhc_d999",
  "mhc_a1",
]
#: (a, b) compared as b - a: every mhc arm against no mixing, and the alpha_init 1.0 arm against
#: no mixing at the same alpha_init (configs/studies/mhc_init_control.yaml)
PAIRS = [("mhc_identity", a) for a in ARMS[1:]] + [("mhc_identity_a1", "mhc_a1")]
RAW = ["eval_loss", "final_loss", "h_res_diag_mean", "h_res_shift_mean", "h_res_dynamic_share_mean"]
LOG = ["stream_spread_last", "max_grad_norm"]
LAYER = ("stream_spread", "h_res_diag", "h_res_shift")


def last_layers(run_dir: Path) -> dict[str, np.ndarray]:
  """The per-layer values of ``LAYER`` at the run's last diagnostics step."""
  out = {}
  for line in (run_dir / "metrics.jsonl").read_text().splitlines():
    r = json.loads(line)
    for k in LAYER:
      if isinstance(r.get(k), list):
        out[k] = np.asarray(r[k], float)
  return out


def _status(run_dir: Path) -> str:
  f = run_dir / "summary.json"
  return json.loads(f.read_text()).get("status", "") if f.is_file() else ""


def load(sweeps: list[Path]) -> tuple[pd.DataFrame, dict]:
  rows, layers = [], {}
  for sweep in sweeps:
    # finished runs: the run's own summary.json (the manifest lags while the sweep runs)
    d = study.report_rows(sweep, done=lambda r: _status(sweep / "runs" / r) == "done")
    for _, r in d.iterrows():
      lay = last_layers(sweep / "runs" / r["run"])
      layers[(int(r["depth"]), r["arm"], int(r["seed"]))] = lay
      shift = lay.get("h_res_shift", np.full(1, np.nan))
      diag = lay.get("h_res_diag", np.full(1, np.nan))
      rows.append(
        {
          "arm": r["arm"],
          "depth": int(r["depth"]),
          "seed": int(r["seed"]),
          **{m: r[m] for m in RAW + LOG},
          "h_res_diag_min": float(np.min(diag)),
          "h_res_shift_max": float(np.max(shift)),
          "run": f"{sweep.name}/{r['run']}",
        }
      )
  runs = pd.DataFrame(rows)
  order = runs["arm"].map(ARMS.index)
  runs = runs.assign(_o=order).sort_values(["depth", "_o", "seed"]).drop(columns="_o")
  return runs.reset_index(drop=True), layers


def tables(runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
  """(arms.csv, paired_arms.csv) from runs.csv's rows (tests/test_studies.py recomputes them)."""
  paired = study.pair_table(runs, ["depth"], RAW + LOG, LOG, ARMS, PAIRS)
  paired = paired.sort_values(["depth", "metric"], kind="stable").reset_index(drop=True)
  return study.arm_table(runs, ["depth", "arm"], RAW, LOG), paired


ARM_CELLS = {
  "held-out loss": [("eval_loss", 4)],
  "stream spread, last layer (gmean)": [("stream_spread_last", 2)],
  "H_res diagonal (layer mean)": [("h_res_diag_mean", 3)],
  "H_res shift from step 0 (layer mean)": [("h_res_shift_mean", 2)],
  "dynamic share (layer mean)": [("h_res_dynamic_share_mean", 2)],
}
PAIR_CELLS = {"held-out loss b - a": "eval_loss", "stream spread b / a": "stream_spread_last"}


def figures(runs: pd.DataFrame, layers: dict, paired: pd.DataFrame, out: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  arms = [a for a in ARMS if a in set(runs["arm"])]
  cmap = plt.get_cmap("viridis")
  mixing = [a for a in arms if not a.startswith("mhc_identity")]
  color = {a: cmap(i / max(1, len(mixing) - 1)) for i, a in enumerate(mixing)}
  color |= {"mhc_identity": "black", "mhc_identity_a1": "grey"}
  depths = sorted(runs["depth"].unique())
  fig, axes = plt.subplots(len(depths), 3, figsize=(15, 3.8 * len(depths)), squeeze=False)
  for row, depth in zip(axes, depths):
    for arm in arms:
      vals = [v for (dp, a, _), v in layers.items() if dp == depth and a == arm]
      for ax, k in zip(row, LAYER):
        got = [v[k] for v in vals if k in v]
        if got:
          ax.plot(np.mean(got, axis=0), color=color[arm], lw=1.5, label=f"{arm} (n={len(got)})")
    for ax, k in zip(row, LAYER):
      ax.set_title(f"depth {depth}: {k}", fontsize=10)
      ax.set_xlabel("mixer layer (attn 0, mlp 0, attn 1, ...)")
      ax.grid(True, alpha=0.3)
    row[0].set_yscale("log")
  axes[0, 2].legend(fontsize=8, loc="upper left")
  fig.suptitle(
    "At the last diagnostics step, mean over seeds: stream spread, H_res diagonal, shift"
  )
  fig.tight_layout()
  fig.savefig(out / "h_res_layers.png", dpi=110)
  plt.close(fig)

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
  marker = {d: m for d, m in zip(depths, "os^")}
  for depth in depths:
    for arm in arms:
      g = runs[(runs["depth"] == depth) & (runs["arm"] == arm)]
      if not len(g):
        continue
      x = g["h_res_shift_mean"].mean()
      sp = stats.mean_ci(g["stream_spread_last"], log=True)
      axes[1].errorbar(
        x,
        sp[0],
        yerr=[[sp[0] - sp[1]], [sp[2] - sp[0]]],
        color=color[arm],
        marker=marker[depth],
        capsize=3,
      )
      p = paired[
        (paired["depth"] == depth) & (paired["b"] == arm) & (paired["metric"] == "eval_loss")
      ]
      if len(p):
        r = p.iloc[0]
        axes[0].errorbar(
          x,
          r["diff_mean"],
          yerr=[[r["diff_mean"] - r["diff_ci_lo"]], [r["diff_ci_hi"] - r["diff_mean"]]],
          color=color[arm],
          marker=marker[depth],
          capsize=3,
        )
  axes[0].axhline(0, color="grey", ls=":")
  axes[0].set(
    xlabel="H_res shift from step 0 (layer mean)",
    ylabel="held-out loss, arm - mhc_identity (paired, 95% t)",
  )
  axes[1].set(
    xlabel="H_res shift from step 0 (layer mean)",
    ylabel="stream spread, last layer (gmean, 95% t)",
    yscale="log",
  )
  from matplotlib.lines import Line2D

  hs = [Line2D([], [], color=color[a], lw=2, label=a) for a in arms]
  hs += [
    Line2D([], [], color="grey", ls="none", marker=marker[d], label=f"depth {d}") for d in depths
  ]
  fig.legend(handles=hs, loc="outside right upper", fontsize=8, frameon=False)
  fig.suptitle("Mixing that moves: loss against mhc_identity and stream spread")
  fig.savefig(out / "tradeoff.png", dpi=110, bbox_inches="tight")
  plt.close(fig)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("sweeps", type=Path, nargs="+")
  ap.add_argument("--out", type=Path, default=None, help="where to write the CSVs and figures")
  a = ap.parse_args(argv)
  for s in a.sweeps:
    if not (s / "report" / "summary.csv").is_file():
      print(f"error: {s}/report/summary.csv not found (run mhc-jax report first)", file=sys.stderr)
      return 2
  runs, layers = load(a.sweeps)
  arms, paired = tables(runs)
  if a.out is not None:
    a.out.mkdir(parents=True, exist_ok=True)
    runs.to_csv(a.out / "runs.csv", index=False)
    arms.to_csv(a.out / "arms.csv", index=False)
    paired.to_csv(a.out / "paired_arms.csv", index=False)
    figures(runs, layers, paired, a.out)
  with np.errstate(all="ignore"):
    print(study.arms_markdown(arms, ["depth", "arm"], ARM_CELLS))
    print()
    print(study.pairs_markdown(paired, "depth", PAIR_CELLS))
  return 0


if __name__ == "__main__":
  sys.exit(main())
