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
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from mhc_jax import spikes
from mhc_jax.sweep import study

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
  d = study.report_rows(sweep, done=lambda r: True)
  d = d[d["status"] == "done"]
  counts = [recount_spikes(sweep / "runs" / r) for r in d["run"]]
  return d.assign(loss_spikes=[c[0] for c in counts], grad_spikes=[c[1] for c in counts])


def tables(d: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
  """(arms.csv, paired_arms.csv) from the runs' rows (tests/test_studies.py recomputes them)."""
  regimes = list(dict.fromkeys(d["regime"]))  # in the order they ran, the arms in ARMS's
  d = d.assign(_r=d["regime"].map(regimes.index), _a=d["arm"].map(ARMS.index))
  d = d.sort_values(["_r", "_a"], kind="stable")
  arms = study.arm_table(d, ["regime", "arm"], RAW, LOG)
  return arms, study.pair_table(d, ["regime"], RAW[:2] + LOG, LOG, ARMS, PAIRS)


ARM_CELLS = {
  "held-out loss": [("eval_loss", 3)],
  "final train loss": [("final_loss", 3)],
  "stream spread, last layer": [("stream_spread_last", 2)],
  "composite fwd, token-averaged / per token / per token bwd (gmean)": [
    ("amax_fwd_composite_max", 3),
    ("amax_fwd_composite_tok_mean_max", 3),
    ("amax_bwd_composite_tok_mean_max", 3),
  ],
  "max grad norm after warm-up (gmean)": [("max_grad_norm", 2)],
  "loss / grad spikes per run": [("loss_spikes", 2), ("grad_spikes", 2)],
}
PAIR_CELLS = {
  "held-out loss b - a": "eval_loss",
  "stream spread b / a": "stream_spread_last",
  "per-token composite fwd b / a": "amax_fwd_composite_tok_mean_max",
}


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
  arms, paired = tables(d)
  if a.out is not None:
    a.out.mkdir(parents=True, exist_ok=True)
    arms.to_csv(a.out / "arms.csv", index=False)
    paired.to_csv(a.out / "paired_arms.csv", index=False)
  with np.errstate(all="ignore"):
    print(study.arms_markdown(arms, ["regime", "arm"], ARM_CELLS))
    print()
    print(study.pairs_markdown(paired, "regime", PAIR_CELLS))
  return 0


if __name__ == "__main__":
  sys.exit(main())
