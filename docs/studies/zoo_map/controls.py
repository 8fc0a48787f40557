"""The controls follow-up (configs/studies/zoo_controls.yaml): post_ln, deepnorm and residual with
warm-up 60 and clipping 1.0 beside the same runs in zoo_map's stress regime (warm-up 15, no
clipping), paired by arm, depth, lr and seed.

  python docs/studies/zoo_map/controls.py SWEEP_DIR        # writes controls_runs.csv, controls.csv
  python docs/studies/zoo_map/controls.py docs/studies/zoo_map/controls_runs.csv   # recompute

``controls.csv``: per arm, depth and lr, each regime's seed-mean held-out loss, its distance
below the byte-frequency baseline and its failure kinds, and the paired difference warm - stress.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from mhc_jax.sweep import study
from mhc_jax.sweep.report import md_table

HERE = Path(__file__).resolve().parent
KEY = ["arm", "depth", "lr", "seed"]


def table(warm: pd.DataFrame, stress: pd.DataFrame) -> pd.DataFrame:
  """controls.csv from the follow-up's rows and zoo_map's (lr_curves's for residual)."""
  cols = [*KEY, "eval_loss", "baseline", "failure"]
  both = warm[cols].merge(stress[cols], on=KEY, suffixes=("_warm", "_stress"))
  both["diff"] = both["eval_loss_warm"] - both["eval_loss_stress"]
  rows = []
  for (arm, depth, lr), g in both.groupby(["arm", "depth", "lr"], sort=False):
    row = dict(arm=arm, depth=depth, lr=lr, n_seeds=len(g))
    for r in ("stress", "warm"):
      row[f"loss_{r}"] = g[f"eval_loss_{r}"].mean()
      row[f"below_baseline_{r}"] = (g[f"baseline_{r}"] - g[f"eval_loss_{r}"]).mean()
      row[f"failure_{r}"] = ",".join(g[f"failure_{r}"])
    rows.append(row | {"warm_minus_stress": g["diff"].mean()})
  return pd.DataFrame(rows)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("source", help="the zoo_controls sweep directory, or controls_runs.csv")
  args = ap.parse_args(argv)
  src = Path(args.source)
  warm = study.read_runs(src)
  if src.suffix != ".csv":
    warm.to_csv(HERE / "controls_runs.csv", index=False)
  out = src.parent if src.suffix == ".csv" else HERE
  tab = table(warm, pd.read_csv(HERE / "runs.csv"))
  tab.to_csv(out / "controls.csv", index=False)
  print(md_table(tab.round(3)))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
