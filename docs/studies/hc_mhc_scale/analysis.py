"""The hc_mhc_scale study's answer from its sweep directory (configs/studies/hc_mhc_scale.yaml).

  .venv/bin/mhc-jax report SWEEP_DIR       # writes SWEEP_DIR/report/summary.csv
  .venv/bin/python docs/studies/hc_mhc_scale/analysis.py SWEEP_DIR [--out docs/studies/hc_mhc_scale]

Reads every run's row of report/summary.csv, names its arm and regime from the run name, and
recounts its loss and gradient-norm spikes from the logged series with the current rule
(``mhc_jax.spikes.spike_mask``, default settings; the study logs every step, and the sweep's
workers kept the rule they started with). Writes and prints as Markdown:

- ``arms.csv``: per regime and arm, the number of seeds; held-out loss (``eval_loss``, the primary
  endpoint) and final train loss, mean and 95% t interval; the stream spread after the last mixer
  layer, the per-token composite gains (forward and backward, max over training) and the max
  gradient norm after warm-up as geometric means with the log-scale 95% t interval; loss and
  gradient spikes per run (mean).
- ``paired_arms.csv``: per regime, the comparisons the study asks for, paired by seed: mhc against
  residual and hc, mhc_identity and mhc_sym against mhc, and hc and mhc_identity against residual. Differences
  ``b - a`` with their 95% t interval on the raw scale, ratios ``b / a`` on the log scale;
  ``significant`` as in the report (``mhc_jax.sweep.stats.significant``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from mhc_jax import spikes
from mhc_jax.sweep import stats

ARMS = ["residual", "hc", "mhc", "mhc_sym", "mhc_identity"]
PAIRS = [
  ("residual", "mhc"),
  ("hc", "mhc"),
  ("mhc", "mhc_identity"),
  ("mhc", "mhc_sym"),
  ("residual", "hc"),
  ("residual", "mhc_identity"),
]
RAW = ["eval_loss", "final_loss", "loss_spikes", "grad_spikes"]
LOG = [
  "stream_spread_last",
  "amax_fwd_composite_max",
  "amax_fwd_composite_tok_mean_max",
  "amax_bwd_composite_tok_mean_max",
  "max_grad_norm",
]


def recount_spikes(run_dir: Path) -> tuple[int, int]:
  """(loss spikes, grad-norm spikes) in the run's logged series under the current rule."""
  loss, grad = [], []
  for line in (run_dir / "metrics.jsonl").read_text().splitlines():
    r = json.loads(line)
    if "loss" in r and "grad_norm" in r:
      loss.append(r["loss"])
      grad.append(r["grad_norm"])
  return int(spikes.spike_mask(loss).sum()), int(spikes.spike_mask(grad).sum())


def load(sweep: Path) -> pd.DataFrame:
  d = pd.read_csv(sweep / "report" / "summary.csv")
  d = d[d["status"] == "done"].copy()
  d["arm"] = d["run"].str.extract(r"arm=([^,]+)", expand=False)
  d["regime"] = d["run"].str.extract(r"regime=([^,]+)", expand=False)
  counts = [recount_spikes(sweep / "runs" / r) for r in d["run"]]
  d["loss_spikes"] = [c[0] for c in counts]
  d["grad_spikes"] = [c[1] for c in counts]
  return d


def arm_table(d: pd.DataFrame) -> pd.DataFrame:
  rows = []
  for regime in dict.fromkeys(d["regime"]):
    for arm in ARMS:
      g = d[(d["regime"] == regime) & (d["arm"] == arm)]
      if not len(g):
        continue
      row = {"regime": regime, "arm": arm, "n_seeds": len(g)}
      for m in RAW + LOG:
        mean, lo, hi, _ = stats.mean_ci(g[m].astype(float), log=m in LOG)
        row |= {m: mean, f"{m}_ci_lo": lo, f"{m}_ci_hi": hi}
      rows.append(row)
  return pd.DataFrame(rows)


def paired_table(d: pd.DataFrame) -> pd.DataFrame:
  out = stats.paired_stats(d, "arm", ["regime"], RAW[:2] + LOG, log_metrics=LOG, order=ARMS)
  keep = out.apply(lambda r: (r["a"], r["b"]) in PAIRS, axis=1)
  return out[keep].reset_index(drop=True)


def _ci(mean, lo, hi, digits=3) -> str:
  f = lambda v: f"{v:.{digits}g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"
  if not math.isfinite(lo):
    return f(mean)
  return f"{f(mean)} [{f(lo)}, {f(hi)}]"


def markdown_arms(t: pd.DataFrame) -> str:
  head = (
    "| regime | arm | n | held-out loss | final train loss | stream spread, last layer | "
    "composite fwd, token-averaged / per token / per token bwd (gmean) | max grad norm after "
    "warm-up (gmean) | loss / grad spikes per run |\n" + "| --- " * 9 + "|"
  )
  lines = [head]
  for _, r in t.iterrows():
    c = lambda m, k=3: _ci(r[m], r[f"{m}_ci_lo"], r[f"{m}_ci_hi"], k)
    lines.append(
      f"| {r['regime']} | {r['arm']} | {r['n_seeds']} | {c('eval_loss')} | {c('final_loss')} | "
      f"{c('stream_spread_last', 2)} | {c('amax_fwd_composite_max')} / "
      f"{c('amax_fwd_composite_tok_mean_max')} / {c('amax_bwd_composite_tok_mean_max')} | "
      f"{c('max_grad_norm', 2)} | "
      f"{r['loss_spikes']:.1f} / {r['grad_spikes']:.1f} |"
    )
  return "\n".join(lines)


def markdown_paired(p: pd.DataFrame) -> str:
  lines = [
    "| regime | comparison | n pairs | held-out loss b - a | stream spread b / a | "
    "per-token composite fwd b / a |\n" + "| --- " * 6 + "|"
  ]
  for (regime, a, b), g in p.groupby(["regime", "a", "b"], sort=False):
    cell = {}
    for _, r in g.iterrows():
      if r["scale"] == "log":
        txt = _ci(r["ratio_mean"], r["ratio_ci_lo"], r["ratio_ci_hi"])
      else:
        txt = _ci(r["diff_mean"], r["diff_ci_lo"], r["diff_ci_hi"])
      cell[r["metric"]] = txt + (" *" if r["significant"] else "")
    lines.append(
      f"| {regime} | {b} vs {a} | {g['n_pairs'].iloc[0]} | {cell.get('eval_loss', '')} | "
      f"{cell.get('stream_spread_last', '')} | {cell.get('amax_fwd_composite_tok_mean_max', '')} |"
    )
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("sweep", type=Path)
  ap.add_argument("--out", type=Path, default=None, help="where to write arms.csv, paired_arms.csv")
  a = ap.parse_args(argv)
  if not (a.sweep / "report" / "summary.csv").is_file():
    print(
      f"error: {a.sweep}/report/summary.csv not found (run mhc-jax report first)", file=sys.stderr
    )
    return 2
  d = load(a.sweep)
  arms, paired = arm_table(d), paired_table(d)
  if a.out is not None:
    a.out.mkdir(parents=True, exist_ok=True)
    arms.to_csv(a.out / "arms.csv", index=False)
    paired.to_csv(a.out / "paired_arms.csv", index=False)
  with np.errstate(all="ignore"):
    print(markdown_arms(arms))
    print()
    print(markdown_paired(paired))
  return 0


if __name__ == "__main__":
  sys.exit(main())
