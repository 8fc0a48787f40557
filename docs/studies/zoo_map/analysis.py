"""The stability map of all 15 designs (18 arms): lr_curves's 441 committed runs and zoo_map's
693 as one table (configs/studies/zoo_map.yaml pre-registers the rule and the controls; the rules:
docs/sweeps.md, "Stability maps").

  python docs/studies/zoo_map/analysis.py SWEEP_DIR [--out docs/studies/zoo_map]
  python docs/studies/zoo_map/analysis.py docs/studies/zoo_map/runs.csv   # recompute

SWEEP_DIR is the zoo_map sweep; its runs join docs/studies/lr_curves/runs.csv (same grid, seeds,
data and regime). Writes ``runs.csv`` (1,134 rows) and the stability map
(``mhc_jax.sweep.study.write_lr_map``: each arm paired against residual and mhc at each arm's own
best lr; ``edges.png`` is the map: a row per arm grouped by family, a panel per depth).
"""

from pathlib import Path

import pandas as pd

from mhc_jax.sweep import design_map, study

HERE = Path(__file__).resolve().parent
FAMILIES = design_map.FAMILIES  # the map's rows by family, shared with `mhc-jax map`
REFS = ("residual", "mhc")


def main(argv=None) -> int:
  src, out, _ = study.cli(argv, __doc__, HERE)
  runs = study.read_runs(src)
  if src.suffix != ".csv":  # the sweep's runs join the committed lr_curves rows
    runs = pd.concat([pd.read_csv(HERE.parent / "lr_curves" / "runs.csv"), runs], ignore_index=True)
  study.save_runs(runs, src, out)
  study.write_lr_map(runs, out, FAMILIES, refs=REFS)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
