"""The hc_mhc_scale study's answer from its sweep directory (configs/studies/hc_mhc_scale.yaml).

  .venv/bin/mhc-jax report SWEEP_DIR       # writes SWEEP_DIR/report/summary.csv
  .venv/bin/python docs/studies/hc_mhc_scale/analysis.py SWEEP_DIR [--out docs/studies/hc_mhc_scale]

Reads every finished run's row of report/summary.csv (its arm and regime from the run name) and
recounts its loss and gradient-norm spikes with the current rule (``mhc_jax.spikes.spike_mask``;
the sweep's workers kept the rule they started with). Writes (README.md beside this file says
what each holds) and prints as Markdown ``arms.csv`` (per regime and arm over seeds: :data:`RAW`
means, :data:`LOG` geometric means, 95% t intervals) and ``paired_arms.csv`` (the :data:`PAIRS`,
paired by seed: b - a on the raw scale, b / a on the log scale, ``significant`` as in the report).
"""

import sys

import pandas as pd

from mhc_jax import logs, spikes
from mhc_jax.sweep import study

ARMS = ["residual", "hc", "mhc", "mhc_sym", "mhc_identity"]
PAIRS = [("residual", "mhc"), ("hc", "mhc"), ("mhc", "mhc_identity"), ("mhc", "mhc_sym")]
PAIRS += [("residual", "hc"), ("residual", "mhc_identity")]
RAW = ["eval_loss", "final_loss", "loss_spikes", "grad_spikes"]
LOG = ["stream_spread_last", "amax_fwd_composite_max", "amax_fwd_composite_tok_mean_max"]
LOG += ["amax_bwd_composite_tok_mean_max", "max_grad_norm"]
#: The metrics the printed tables show.
SHOWN = [*RAW, *LOG]


def recount_spikes(run_dir) -> tuple[int, int]:
  """(loss spikes, grad-norm spikes) in the run's logged series under the current rule."""
  recs = [r for r in logs.read_jsonl(run_dir / "metrics.jsonl") if "loss" in r and "grad_norm" in r]
  return tuple(int(spikes.spike_mask([r[k] for r in recs]).sum()) for k in ("loss", "grad_norm"))


def load(sweep) -> pd.DataFrame:
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


def main(argv=None) -> int:
  if (cli := study.sweeps_cli(argv, __doc__)) is None:
    return 2
  arms, paired = tables(pd.concat([load(s) for s in cli[0]]))
  if cli[1]:
    study.write_tables(cli[1], arms=arms, paired_arms=paired)
  study.show(arms, paired, ["regime", "arm"], SHOWN, LOG)
  return 0


if __name__ == "__main__":
  sys.exit(main())
