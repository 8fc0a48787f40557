"""The phase_map study's table and figure from its sweep directory or its committed runs.csv
(configs/studies/phase_map.yaml; the rules: docs/sweeps.md, "Stability maps").

  python docs/studies/phase_map/analysis.py SWEEP_DIR [--out docs/studies/phase_map]
  python docs/studies/phase_map/analysis.py docs/studies/phase_map/runs.csv   # recompute

Writes ``runs.csv`` (``mhc_jax.sweep.study.read_runs``; a runs.csv from before issue 48 gets its
``baseline`` and ``failure`` from :data:`DATA` and is rewritten), ``phase.csv``
(``lrmap.phase_table``: per arm, width and depth the fractions of seeds that diverged, did not
train, failed, spiked, eval_loss and the per-token composite gain with their intervals) and
``phase_map.png`` (:data:`SHOWN` as width x depth heatmaps, a column per arm).
"""

from pathlib import Path

from mhc_jax.sweep import lrmap, plots, stats, study
from mhc_jax.sweep.report import md_table

HERE = Path(__file__).resolve().parent
SHOWN = [
  "frac_diverged",
  "frac_no_training",
  stats.centre(lrmap.GAIN, [lrmap.GAIN]),
  "eval_loss_mean",
]
#: The study's data settings (configs/studies/phase_map.yaml, variant cpu), for the baseline.
DATA = dict(seq_len=64, batch_size=8, eval_batches=8, val_fraction=0.05)


def main(argv=None) -> int:
  runs, _, out = study.load(argv, __doc__, HERE, DATA)
  phase = lrmap.phase_table(runs)
  phase.to_csv(out / "phase.csv", index=False)
  plots.heatmaps(
    phase, out / "phase_map.png", x="width", y="depth", values=SHOWN, panel="arm", log=SHOWN[2:3]
  )
  print(md_table(phase[["arm", "width", "depth", "n_seeds", *SHOWN]].round(4)))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
