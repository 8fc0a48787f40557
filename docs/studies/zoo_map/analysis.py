"""The stability map of all 15 designs (18 arms): lr_curves's 441 committed runs and zoo_map's
693 as one table (configs/studies/zoo_map.yaml pre-registers the rule and the controls; the rules:
docs/sweeps.md, "Stability maps").

  python docs/studies/zoo_map/analysis.py SWEEP_DIR [--out docs/studies/zoo_map]
  python docs/studies/zoo_map/analysis.py docs/studies/zoo_map/runs.csv   # recompute

SWEEP_DIR is the zoo_map sweep; its runs join docs/studies/lr_curves/runs.csv (same grid, seeds,
data and regime). Writes, as docs/studies/lr_curves/analysis.py does, ``runs.csv`` (1,134 rows),
``lr_sensitivity.csv``, ``paired_best_lr.csv`` (each arm against residual and mhc, paired by
seed at each arm's own best lr), ``mechanism.csv``, ``lr_curves.png``, ``stable_lr.png`` and
``edges.png`` (the map: a row per arm grouped by family, a panel per depth).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd

from mhc_jax.sweep import report

HERE = Path(__file__).resolve().parent
LR_CURVES = HERE.parent / "lr_curves"
FAMILIES = {
  "pre-LN, one stream": ["residual", "residual_qk", "value_residual", "laurel", "ortho"],
  "norm placement": ["post_ln", "deepnorm", "peri_ln"],
  "sums over depth": ["denseformer", "attnres"],
  "streams, unconstrained": ["hc", "hc_qk", "frac"],
  "streams, doubly stochastic": ["mhc", "mhc_uniform", "mhc_lite", "kromhc"],
  "streams, fixed": ["mhc_identity"],
}
REFS = ("residual", "mhc")


def _lr_curves():
  spec = importlib.util.spec_from_file_location("lr_curves_analysis", LR_CURVES / "analysis.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def main(argv=None) -> int:
  src, out, _ = report.study_cli(argv, __doc__, HERE)
  runs = report.study_runs(src)
  if src.suffix != ".csv":  # the sweep's runs join the committed lr_curves rows
    runs = pd.concat([pd.read_csv(LR_CURVES / "runs.csv"), runs], ignore_index=True)
  report.save_runs(runs, src, out)
  _lr_curves().write(runs, out, FAMILIES, refs=REFS)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
