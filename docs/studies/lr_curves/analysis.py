"""The lr_curves study's tables and figures from its sweep directory or its committed runs.csv
(configs/studies/lr_curves.yaml; the rules: docs/sweeps.md, "Stability maps").

  python docs/studies/lr_curves/analysis.py SWEEP_DIR [--out docs/studies/lr_curves]
  python docs/studies/lr_curves/analysis.py docs/studies/lr_curves/runs.csv   # recompute

Reads the runs (``mhc_jax.sweep.study.read_runs``; a runs.csv from before issue 48 gets its
``baseline`` and ``failure`` from :data:`DATA` and is rewritten). Writes into ``--out`` (default:
beside runs.csv, or docs/studies/lr_curves) ``runs.csv`` and the stability map
(``study.write_lr_map``): lr_sensitivity.csv, paired_best_lr.csv, mechanism.csv, lr_curves.png,
edges.png, stable_lr.png; what each holds: README.md beside this file.
"""

from pathlib import Path

from mhc_jax.sweep import study

HERE = Path(__file__).resolve().parent
FAMILIES = {
  "single stream": ["residual", "residual_qk"],
  "unconstrained streams": ["hc", "hc_qk"],
  "doubly stochastic streams": ["mhc", "mhc_uniform"],
  "fixed streams": ["mhc_identity"],
}
#: The study's data settings (configs/studies/lr_curves.yaml, variant cpu), for the baseline.
DATA = dict(seq_len=64, batch_size=8, eval_batches=8, val_fraction=0.05)


def main(argv=None) -> int:
  runs, _, out = study.load(argv, __doc__, HERE, DATA)
  study.write_lr_map(runs, out, FAMILIES)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
