"""The phase_map study's table and figure from its sweep directory or its committed runs.csv
(configs/studies/phase_map.yaml; the rules: docs/sweeps.md, "Stability maps").

  python docs/studies/phase_map/analysis.py SWEEP_DIR [--out docs/studies/phase_map]
  python docs/studies/phase_map/analysis.py docs/studies/phase_map/runs.csv   # recompute

Writes ``runs.csv`` (``mhc_jax.sweep.lrmap.runs_table``), ``phase.csv`` (``lrmap.phase_table``:
per arm, width and depth the fractions of seeds that diverged, spiked or either, eval_loss and
the per-token composite gain with their intervals) and ``phase_map.png`` (those three as width x
depth heatmaps, one column per arm).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mhc_jax.sweep import lrmap, plots, report, stats

HERE = Path(__file__).resolve().parent
SHOWN = ["frac_unstable", stats.centre(lrmap.GAIN, [lrmap.GAIN]), "eval_loss_mean"]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("source", help="a sweep directory, or a runs.csv to recompute from")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  src = Path(args.source)
  runs = report.study_runs(src)
  out = Path(args.out or (src.parent if src.suffix == ".csv" else HERE))
  out.mkdir(parents=True, exist_ok=True)
  phase = lrmap.phase_table(runs)
  if (out / "runs.csv").resolve() != src.resolve():  # recomputing leaves the source as it is
    runs.to_csv(out / "runs.csv", index=False)
  phase.to_csv(out / "phase.csv", index=False)
  plots.heatmaps(
    phase, out / "phase_map.png", x="width", y="depth", values=SHOWN, panel="arm", log=SHOWN[1:2]
  )
  print(report.md_table(phase[["arm", "width", "depth", "n_seeds", *SHOWN]].round(4)))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
