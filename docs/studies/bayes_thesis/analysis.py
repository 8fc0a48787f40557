"""The pre-registered analysis of configs/studies/bayes_thesis.yaml (see its header).

  python docs/studies/bayes_thesis/analysis.py SWEEP_DIR [--out DIR]
  python docs/studies/bayes_thesis/analysis.py docs/studies/bayes_thesis/runs.csv   # recompute

Reads every finished run's metrics.jsonl, summary.json and eval.json under SWEEP_DIR/runs (runs
not finished yet are left out and counted), or a committed runs.csv. Writes into --out (default:
beside runs.csv, or this directory) and prints runs.csv (one row per run), groups.csv (per arm
and depth: geometric mean KL, 95% log-scale t interval), paired.csv (the pre-registered paired
differences: 95% t intervals, paired t test p values, Holm-adjusted within each family),
geometry_groups.csv and geometry_paired.csv (exploratory, intervals only) and kl_vs_step.png.
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pandas as pd
import yaml

from mhc_jax.geometry import plots as geometry_plots
from mhc_jax.sweep import stats, study

HERE = pathlib.Path(__file__).parent
PRIMARY_STEPS = (999, 1249, 1499, 1749, 1999)
THRESHOLD_BITS = 0.03  # header-only / 10 on this task
PRIMARY = [("hc", "mhc")]
SECONDARY = [("mhc", "residual"), ("mhc", "mhc_identity"), ("hc", "residual")]
# Exploratory geometry scores (mhc_jax/geometry/plots.py's CSV fields, from eval.json): the
# papers' key orthogonality (mean |cos| over random directions' at layer 0, log scale: < 1 is
# more orthogonal than chance), its z against the random null, the value manifold's |corr(PC1,
# posterior entropy)| and its z against shuffled entropies, and the same correlation with
# position partialled out. HMM filtering has no retrieval target, so no q-k alignment score.
GEOMETRY = [
  "kl_bits",
  "key_ratio_to_random_layer0",
  "key_z_layer0",
  "value_abs_corr_pc1_entropy",
  "value_corr_z",
  "value_abs_corr_within_position",
]
LOG_SCALE = {"kl_bits", "key_ratio_to_random_layer0"}


def _last_layer(v):
  return v[-1] if isinstance(v, list) else v


def run_row(run: pathlib.Path) -> dict | None:
  summary = (
    json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
  )
  if summary.get("status") != "done":
    return None
  cfg = dict(part.partition("=")[::2] for part in run.name.split(","))  # name=value,...
  evals, diags = {}, []
  for line in (run / "metrics.jsonl").read_text().splitlines():
    r = json.loads(line)
    if "eval/kl_bits" in r:
      evals[r["step"]] = r["eval/kl_bits"]
    if "stream_spread" in r or "amax_fwd_composite_tok_max" in r:
      diags.append(r)
  steps = sorted(evals)
  row = {
    "arm": cfg.get("mixer"),
    "depth": int(
      cfg.get("depth") or yaml.safe_load((run / "config.yaml").read_text())["model"]["depth"]
    ),
    "seed": int(cfg["seed"]),
    "final_kl_bits": evals[steps[-1]],
    # the pilot (1500 steps) has the first three of these evaluations only
    "primary_mean_log2_kl": float(
      np.mean([math.log2(evals[s]) for s in PRIMARY_STEPS if s in evals])
    ),
    "first_step_kl_below_0.03": next((s for s in steps if evals[s] <= THRESHOLD_BITS), math.nan),
    "wall_s": summary.get("wall_s"),
  }
  row |= {f"kl_bits@{s}": evals[s] for s in steps}
  ev = run / "eval.json"
  if ev.exists():  # exploratory: `mhc-jax eval --run RUN` on the final checkpoint
    (scores,) = geometry_plots.score_rows({run.name: json.loads(ev.read_text())})
    row.update({k: scores[k] for k in GEOMETRY})
  if diags:
    last = diags[-1]
    for k in ("stream_spread", "amax_fwd_composite_tok_max", "amax_bwd_composite_tok_max"):
      if k in last:
        row[f"{k}_last"] = _last_layer(last[k])
  return row


def paired(df: pd.DataFrame, pairs, endpoint: str, family: str) -> pd.DataFrame:
  """Per depth and pair, ``a - b`` paired by seed: mean, 95% t interval, ratio 2^diff, the
  paired t test's p (stats.t_test) and, over the family, Holm's adjusted p (stats.holm)."""
  rows = []
  for depth in sorted(df.depth.unique()):
    at = df[df.depth == depth].pivot(index="seed", columns="arm", values=endpoint)
    for a, b in pairs:
      if a in at and b in at and len(d := (at[a] - at[b]).dropna()) >= 2:
        mean, lo, hi, n = stats.mean_ci(d)
        rows.append(
          dict(family=family, depth=depth, comparison=f"{a} - {b}", endpoint=endpoint, n=n)
          | dict(diff=mean, lo=lo, hi=hi, ratio=2**mean, p=stats.t_test(d))
        )
  out = pd.DataFrame(rows)
  return out.assign(p_holm=stats.holm(out["p"])) if len(out) else out


def _t_interval(x, log: bool) -> tuple[float, float, float]:
  """Mean and 95% t interval (on log2 and back when ``log``)."""
  m, lo, hi, _ = stats.mean_ci(np.log2(x) if log else x)
  return (2**m, 2**lo, 2**hi) if log else (m, lo, hi)


def exploratory(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
  """Per arm and depth: each geometry score's mean (geometric where LOG_SCALE) with its 95% t
  interval; paired by seed: hc - mhc and mhc - residual (log2 ratios where LOG_SCALE). Intervals
  only, no tests: these are not the pre-registered endpoint."""
  cols = [c for c in GEOMETRY if c in df]
  groups, pairs = [], []
  for (depth, arm), g in df.groupby(["depth", "arm"]):
    for c in cols:
      if len(x := g[c].dropna().to_numpy(float)) >= 2:
        m, lo, hi = _t_interval(x, c in LOG_SCALE)
        groups.append(dict(depth=depth, arm=arm, score=c, n=len(x), mean=m, lo=lo, hi=hi))
  for c in cols:
    v = np.log2(df[c].astype(float)) if c in LOG_SCALE else df[c].astype(float)
    scale = "log2 ratio" if c in LOG_SCALE else "difference"
    for a, b in [("hc", "mhc"), ("mhc", "residual")]:
      for depth in sorted(df.depth.unique()):
        at = df.assign(v=v)[df.depth == depth].pivot(index="seed", columns="arm", values="v")
        if a in at and b in at and len(d := (at[a] - at[b]).dropna().to_numpy()) >= 2:
          m, lo, hi = _t_interval(d, False)
          pairs.append(
            dict(depth=depth, comparison=f"{a} - {b}", score=c, n=len(d), scale=scale)
            | dict(diff=m, lo=lo, hi=hi)
          )
  return pd.DataFrame(groups), pd.DataFrame(pairs)


def kl_figure(df: pd.DataFrame, path: pathlib.Path) -> None:
  """KL to the exact posterior against training step, one panel per depth, one line per arm:
  geometric mean over seeds with its 95% log-scale t band (the primary endpoint averages the
  last five evaluations of these curves)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  cols = sorted((c for c in df if c.startswith("kl_bits@")), key=lambda c: int(c.split("@")[1]))
  steps = [int(c.split("@")[1]) + 1 for c in cols]
  depths = sorted(df.depth.unique())
  fig, axes = plt.subplots(1, len(depths), figsize=(4.2 * len(depths), 3.4), sharey=True)
  for ax, depth in zip(np.atleast_1d(axes), depths):
    for arm, color in zip(["residual", "hc", "mhc", "mhc_identity"], ["k", "C3", "C0", "C2"]):
      g = df[(df.depth == depth) & (df.arm == arm)]
      if not len(g):
        continue
      ms = [_t_interval(g[c].dropna().to_numpy(float), True) for c in cols]
      ax.plot(steps, [m[0] for m in ms], color=color, label=f"{arm} (n={len(g)})")
      ax.fill_between(steps, [m[1] for m in ms], [m[2] for m in ms], color=color, alpha=0.15)
    ax.set_yscale("log")
    ax.set_title(f"depth {depth}")
    ax.set_xlabel("step")
  np.atleast_1d(axes)[0].set_ylabel("KL(posterior || model), bits")
  np.atleast_1d(axes)[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def tables(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
  """From the per-run rows (runs.csv): groups (per depth and arm: n, mean and s.d. of the primary
  endpoint, geometric-mean KL and its 95% log-scale t interval) and the pre-registered paired
  differences (primary and secondary families, each Holm-corrected)."""
  ep, rows = "primary_mean_log2_kl", []
  for (depth, arm), g in df.groupby(["depth", "arm"]):
    m, lo, hi, n = stats.mean_ci(g[ep])
    rows.append(dict(depth=depth, arm=arm, count=n, mean=m, std=g[ep].std()))
    rows[-1] |= dict(geomean_kl_bits=2**m, lo=2**lo, hi=2**hi)
  tab = pd.concat([paired(df, PRIMARY, ep, "primary"), paired(df, SECONDARY, ep, "secondary")])
  return pd.DataFrame(rows), tab


def main(argv=None) -> int:
  src, out, _ = study.cli(argv, __doc__, HERE)
  if src.suffix == ".csv":  # recompute from a committed runs.csv
    df = pd.read_csv(src)
  else:
    runs = sorted((src / "runs").iterdir())
    rows = [r for r in map(run_row, runs) if r is not None]
    print(f"{len(rows)} of {len(runs)} runs finished")
    if not rows:
      return 0
    df = pd.DataFrame(rows).sort_values(["depth", "arm", "seed"])
  study.save_runs(df, src, out)
  groups, tab = tables(df)
  study.write_tables(out, groups=groups, paired=tab)
  kl_figure(df, out / "kl_vs_step.png")
  geo_groups, geo_paired = exploratory(df)
  if len(geo_groups):
    study.write_tables(out, geometry_groups=geo_groups, geometry_paired=geo_paired)
  with pd.option_context("display.width", 160, "display.precision", 3):
    print(groups.to_string(index=False), tab.to_string(index=False), sep="\n")
    print(geo_paired.to_string(index=False)) if len(geo_paired) else None
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
