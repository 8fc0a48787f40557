"""geometry_formation's decision from its sweep directory or its committed runs.csv
(configs/studies/geometry_formation.yaml; the rule was written in its header before any run).

  python docs/studies/geometry_formation/analysis.py SWEEP_DIR [--out DIR]   # eval, then decide
  python docs/studies/geometry_formation/analysis.py docs/studies/geometry_formation/runs.csv

From a sweep directory: each run's pre-registered checkpoints that exist so far (a run still
training is read as far as it got) and its initialisation, by ``mhc-jax eval --series --steps``
(only the steps its ``geometry_series.csv`` lacks). Writes into ``--out`` (default: beside
runs.csv, or docs/studies/geometry_formation): ``runs.csv`` (one row per arm, seed and step),
``decision.csv`` (:func:`decision` with :data:`RULE`) and
``formation.png`` (each statistic against steps beside the authors' points).
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's SVD thrashes on a busy 2-core VM

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

HERE = Path(__file__).resolve().parent
STEPS = (100, 200, 300, 400, 500, 750, 1000, 1500, 2000, 2500)  # and 0, the initialisation
BATCHES = 2  # 512 validation sequences, as the authors' MAE
# the authors' dense-checkpoint retrain, one seed (experiments/jlens/results/phase5_dense_summary
# .json): frame ratio to null (their 50k model's frame) and entropy MAE (bits) by step
AUTHORS = pd.DataFrame(
  {
    "step": [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1500, 2000, 2500],
    "frame_ratio": [1.02, 1.02, 2.26, 3.65, 4.22, 4.61, 4.91, 5.13, 5.31, 5.45, 5.95, 6.24, 6.32],
    "mae": [2.82, 0.778, 1.04, 0.913, 0.649, 0.352, 0.201, 0.142, 0.115, 0.086, 0.0647, 0.0434,
            0.0316],
  }
)  # fmt: skip
AUTHORS_PILOTS = {2166: 0.05, 4500: 0.02}  # their substrate pilots, 3 seeds: MAE reached by step
RULE = dict(
  step=2500,
  mean_ratio=3.0,  # (a) seed mean of the frame ratio at step 2500
  min_ratio=2.0,  # (a) every seed
  init_max=1.5,  # (b) the random-init control, every seed below
  mae_ref={s: float(AUTHORS.set_index("step")["mae"][s]) for s in (1000, 1500, 2000, 2500)},
  mae_factor=2.0,  # (c) seed geometric mean within this factor of theirs
)
FIRST = ["arm", "seed", "step"]


def _geo_mean(x) -> float:
  x = np.asarray(x, np.float64)
  return float(np.exp(np.log(x).mean())) if len(x) and np.all(x > 0) else math.nan


def _verdict(parts) -> str:
  return "no" if "no" in parts else ("yes" if set(parts) == {"yes"} else "pending")


def decision(runs: pd.DataFrame, *, step, mean_ratio, min_ratio, init_max, mae_ref, mae_factor):
  """The rule from ``runs`` (one row per arm, seed and step; step 0 is each seed's random
  initialisation): per arm each part (``frame`` (a), ``init`` (b), ``mae`` (c): yes / no /
  pending while a seed has not reached the step) and ``reproduced`` (yes when all three are,
  no when one is not), with the numbers each part read."""
  out = []
  for arm, g in runs.groupby("arm", sort=False):
    n = g["seed"].nunique()
    at = g[g["step"] == step]["frame_ratio"]
    init = g[g["step"] == 0]["frame_ratio"]
    ok = at.mean() >= mean_ratio and at.min() >= min_ratio
    row = {"arm": arm, "seeds": n, "step": step}
    row |= {"frame_ratio_mean": at.mean(), "frame_ratio_min": at.min()}
    row["frame"] = "pending" if len(at) < n else ("yes" if ok else "no")
    row["init_ratio_max"] = init.max()
    row["init"] = "pending" if len(init) < n else ("yes" if init.max() < init_max else "no")
    parts = []
    for s, ref in sorted(mae_ref.items()):
      got = g[g["step"] == s]["mae"]
      row[f"mae_{s}"], row[f"mae_{s}_ref"] = (_geo_mean(got) if len(got) == n else math.nan), ref
      inside = ref / mae_factor <= row[f"mae_{s}"] <= ref * mae_factor
      parts.append("pending" if math.isnan(row[f"mae_{s}"]) else ("yes" if inside else "no"))
    row["mae"] = _verdict(parts)
    row["reproduced"] = _verdict([row["frame"], row["init"], row["mae"]])
    out.append(row)
  return pd.DataFrame(out)


def collect(sweep_dir: Path, batches: int = BATCHES) -> pd.DataFrame:
  """runs.csv's rows: every run's series at the pre-registered steps it has reached."""
  from mhc_jax import evaluate, logs, storage

  frames = []
  for name, info in logs.sweep_runs(sweep_dir).items():
    run = sweep_dir / (info.get("dir") or name)
    ck = run / "checkpoints"
    kept = {int(p.name) for p in ck.iterdir() if p.name.isdigit()} if ck.is_dir() else set()
    want = [0, *sorted(kept & set(STEPS))]
    csv = run / evaluate.SERIES_CSV
    old = pd.read_csv(csv) if csv.exists() else pd.DataFrame({"step": []})
    missing = [s for s in want if s not in set(old["step"])]
    if missing and kept:
      print(f"{name}: mhc-jax eval --series --steps {','.join(map(str, missing))}")
      new = pd.DataFrame(evaluate.evaluate_series(run, batches, missing))
      old = pd.concat([old, new], ignore_index=True).sort_values("step")
      storage.write_text_atomic(csv, old.to_csv(index=False))
    cfg = logs.read_config(run)
    arm = cfg.get("model.mixer", "residual")
    frames.append(old[old["step"].isin(want)].assign(arm=arm, seed=cfg.get("train.seed", 0)))
  runs = pd.concat(frames, ignore_index=True).drop(columns=["frame_dist"], errors="ignore")
  return runs[FIRST + [c for c in runs.columns if c not in FIRST]]


PANELS = [  # (column or ratio, log y, title, authors' column)
  ("frame_ratio", False, "frame overlap / its null (emb + block 0)", "frame_ratio"),
  ("mae", True, "entropy MAE (bits, value tokens)", "mae"),
  ("key_ratio", False, "layer-0 token keys |cos| / null, per head", None),
  ("kl_bits", True, "KL (bits / position)", None),
  ("value_r_new_wp_z", False, "value manifold z (M: >= 3; filled: gated M)", None),
]


def figure(runs: pd.DataFrame, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.6))
  heads = sorted(c for c in runs if c.startswith("key_cos_h"))
  for ax, (col, logy, title, theirs) in zip(axes, PANELS):
    for (arm, seed), g in runs.groupby(["arm", "seed"]):
      g = g.sort_values("step")
      x = np.maximum(g["step"], 10)  # the initialisation drawn at step 10 on the log axis
      if col == "key_ratio":
        for h in heads:
          ax.plot(x, g[h] / g["key_cos_null"], ".-", lw=0.8, label=f"{arm} s{seed} {h[-2:]}")
      else:
        ax.plot(x, g[col], "o-", ms=3, label=f"{arm} seed {seed}")
      if col == "value_r_new_wp_z":
        on = g[g["M_gated"].astype(bool)]
        ax.plot(np.maximum(on["step"], 10), on[col], "ks", ms=6)
    if theirs:
      ax.plot(AUTHORS["step"], AUTHORS[theirs], "k^--", ms=4, label="authors (dense run)")
    if col in ("mae", "kl_bits"):
      ax.axhline(runs[f"{col}_uniform"].median(), color="grey", ls=":", label="uniform guess")
    if col == "mae":
      ax.plot(list(AUTHORS_PILOTS), list(AUTHORS_PILOTS.values()), "kx", ms=7, label="their pilots")
    for y in {"frame_ratio": (3.0, 2.0, 1.5), "value_r_new_wp_z": (3.0,)}.get(col, ()):
      ax.axhline(y, color="grey", lw=0.6, ls=":")
    ax.set_xscale("log")
    ax.set_xlim(7, 3500)
    ax.set_yscale("log" if logy else "linear")
    ax.set_xlabel("step (init at 10)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=5)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("source", help="a sweep directory, or a runs.csv to recompute from")
  ap.add_argument("--out", help="where to write (default: beside runs.csv, or this folder)")
  args = ap.parse_args(argv)
  src = Path(args.source)
  runs = pd.read_csv(src) if src.suffix == ".csv" else collect(src)
  out = Path(args.out) if args.out else (src.parent if src.suffix == ".csv" else HERE)
  out.mkdir(parents=True, exist_ok=True)
  dec = decision(runs, **RULE)
  if src.suffix != ".csv":
    runs.to_csv(out / "runs.csv", index=False)
  dec.to_csv(out / "decision.csv", index=False)
  figure(runs, out / "formation.png")
  print(dec.T.to_string(header=False))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
