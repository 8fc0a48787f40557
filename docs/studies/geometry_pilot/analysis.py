"""The geometry pilot's decision from its sweep directory or its committed runs.csv
(configs/studies/geometry_pilot.yaml; the rule was written in its header before any run).

  OPENBLAS_NUM_THREADS=1 python docs/studies/geometry_pilot/analysis.py SWEEP_DIR [--out DIR]
  python docs/studies/geometry_pilot/analysis.py docs/studies/geometry_pilot/runs.csv  # recompute

From a sweep directory, every finished run's ``geometry_series.csv`` (``mhc-jax eval --run R
--series``; run here, with ``--batches``, where it is missing). Writes into ``--out`` (default:
beside runs.csv, or docs/studies/geometry_pilot; README.md beside this file says what each
holds): ``runs.csv`` (one row per setting, seed and checkpoint: :data:`SETTING`, each signature
with its null; docs/windtunnel_results.md, "The checkpoint series"), ``by_step.csv``
(:func:`by_step`), ``decision.csv`` (:func:`decision`, the rule at each setting's last
checkpoint) and ``signatures.png`` (each signature against its null over steps).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's SVD thrashes on a busy 2-core VM

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from mhc_jax.sweep import study  # noqa: E402

HERE = Path(__file__).resolve().parent
KEY_FACTOR = 1.5  # K: layer-0 token-key |cos| <= its random-direction null / 1.5
MIN_Z = 3.0  # M: |r(PC1, entropy)| among new keys within position >= null mean + 3 null s.d.
MIN_SEEDS = 2  # both rules on at least 2 seeds
SETTING = "setting replacement supervise target tied_embeddings depth width heads head_dim".split()
#: Where config.yaml holds each setting column.
CONFIG = dict(replacement="data.options.replacement", supervise="data.options.supervise")
CONFIG |= dict(target="data.target", tied_embeddings="model.tied_embeddings")
CONFIG |= {k: f"model.{k}" for k in ("depth", "width", "heads")} | dict(seed="train.seed")
DEFAULTS = {"replacement": True, "supervise": "all", "tied_embeddings": True}
#: (column, null column or None, threshold, title) of each panel of signatures.png
PANELS = [
  ("key_cos", "key_cos_null", 1 / KEY_FACTOR, "K: layer-0 token-key |cos| / random"),
  ("key_cos_centred", "key_cos_centred_null", 1 / KEY_FACTOR, "the same, keys centred (not ruled)"),
  ("value_r_new_wp", "value_r_new_wp_null", None, "|r(PC1, H)| new keys, within pos. / null"),
  ("value_r_new_wp_z", None, MIN_Z, "M: z of the above against its null"),
  ("qk_slope_wp_z", None, None, "q-k slope vs evidence within pos.: z"),
  ("kl_bits", None, None, "KL (bits), the run's own supervised positions"),
  ("frame_dist", None, None, "attention distance to its final pattern"),
]


def collect(sweep_dir: Path, batches: int = 8) -> pd.DataFrame:
  """runs.csv's rows from a sweep directory, running the series eval where it is missing."""
  from mhc_jax import evaluate, logs, storage

  frames = []
  for name, info in logs.sweep_runs(sweep_dir).items():
    run = sweep_dir / (info.get("dir") or name)
    if logs.read_json(run / "summary.json").get("status") not in ("done", "diverged"):
      print(f"{name}: not finished, left out")
      continue
    csv = run / evaluate.SERIES_CSV
    if not csv.exists():
      print(f"{name}: mhc-jax eval --series")
      rows = evaluate.evaluate_series(run, batches)
      storage.write_text_atomic(csv, pd.DataFrame(rows).to_csv(index=False))
    cfg = logs.read_config(run)
    ids = {k: cfg.get(key, DEFAULTS.get(k)) for k, key in CONFIG.items()}
    parts = dict(p.split("=", 1) for p in name.split(",") if "=" in p)  # setting=X,seed=S
    ids["setting"] = parts.get("setting", name)
    ids["head_dim"] = ids["width"] // ids["heads"]
    frames.append(pd.read_csv(csv).assign(**ids))
  runs = pd.concat(frames, ignore_index=True)
  first = [*SETTING, "seed", "step"]
  return runs[first + [c for c in runs.columns if c not in first]]


def with_rule(runs: pd.DataFrame) -> pd.DataFrame:
  """``key_ratio``, ``K``, ``M`` and ``geometry`` (K and M) per row (NaN counts as not met)."""
  ratio = runs["key_cos"] / runs["key_cos_null"]
  k, m = ratio <= 1 / KEY_FACTOR, runs["value_r_new_wp_z"] >= MIN_Z
  centred = (
    runs["key_cos_centred"] / runs["key_cos_centred_null"] if "key_cos_centred" in runs else np.nan
  )
  return runs.assign(key_ratio=ratio, key_ratio_centred=centred, K=k, M=m, geometry=k & m)


def by_step(runs: pd.DataFrame) -> pd.DataFrame:
  """Per setting and checkpoint step: seeds, seeds meeting K, M and both, ``exists``."""
  g = with_rule(runs).groupby(SETTING + ["step"], sort=False, dropna=False)
  out = g.agg(
    n_seeds=("seed", "nunique"),
    k_seeds=("K", "sum"),
    m_seeds=("M", "sum"),
    both_seeds=("geometry", "sum"),
    key_ratio=("key_ratio", "mean"),
    value_r_new_wp=("value_r_new_wp", "mean"),
    value_r_new_wp_z=("value_r_new_wp_z", "mean"),
    kl_bits=("kl_bits", "mean"),
  ).reset_index()
  return out.assign(exists=out["both_seeds"] >= MIN_SEEDS)


def _first_step(steps: pd.DataFrame):
  """The earliest step from which the geometry exists at every later checkpoint (NaN: never)."""
  steps = steps.sort_values("step")
  ok = steps["exists"].to_numpy(bool)
  if not ok[-1]:
    return float("nan")
  bad = np.nonzero(~ok)[0]
  return int(steps["step"].iloc[bad[-1] + 1 if bad.size else 0])


def decision(runs: pd.DataFrame) -> pd.DataFrame:
  """Per setting, the rule at its last checkpoint with every seed (the pre-registered verdict)."""
  rows, ruled, steps = [], with_rule(runs), by_step(runs)
  for key, st in steps.groupby(SETTING, sort=False, dropna=False):
    st = st[st["n_seeds"] == st["n_seeds"].max()]
    last = st.loc[st["step"].idxmax()]
    sel = ruled[(ruled["setting"] == key[0]) & (ruled["step"] == last["step"])]
    sel = sel.sort_values("seed")
    fmt = lambda c, f: ",".join(f % v for v in sel[c])  # noqa: E731
    rows.append(
      dict(zip(SETTING, key))
      | {
        "step": int(last["step"]),
        "n_seeds": int(last["n_seeds"]),
        "exists": "yes" if last["exists"] else "no",
        "first_step": _first_step(st),
        "k_seeds": int(last["k_seeds"]),
        "m_seeds": int(last["m_seeds"]),
        "key_ratio_by_seed": fmt("key_ratio", "%.3f"),
        "key_cos_null": float(sel["key_cos_null"].mean()),
        "key_ratio_centred_by_seed": fmt("key_ratio_centred", "%.3f"),  # reported, not ruled
        "value_r_new_wp_by_seed": fmt("value_r_new_wp", "%.3f"),
        "value_r_new_wp_z_by_seed": fmt("value_r_new_wp_z", "%.1f"),
        "qk_slope_wp_z_by_seed": fmt("qk_slope_wp_z", "%.1f"),
        "value_r_by_seed": fmt("value_r", "%.3f"),
        "kl_bits": float(sel["kl_bits"].mean()),
      }
    )
  return pd.DataFrame(rows)


def figure(runs: pd.DataFrame, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  panels = [p for p in PANELS if p[0] in runs]  # runs.csv from before a column existed
  fig, axes = plt.subplots(2, 4, figsize=(19, 8), constrained_layout=True)
  colours = dict(zip(runs["setting"].unique(), plt.cm.tab10.colors))
  for ax in axes.flat[len(panels) :]:
    ax.axis("off")
  for ax, (col, null, line, title) in zip(axes.flat, panels):
    for (setting, seed), r in runs.sort_values(["step", "seed"], kind="stable").groupby(
      ["setting", "seed"], sort=False
    ):
      y = r[col] / r[null] if null else r[col]
      ls = "-" if seed == runs["seed"].min() else "--"
      ax.plot(r["step"], y, ls, color=colours[setting], label=f"{setting} s{seed}")
    if line is not None:
      ax.axhline(line, color="k", ls=":", lw=1)
    if null:
      ax.axhline(1.0, color="grey", lw=0.5)
    ax.set(title=title, xlabel="step")
  axes.flat[0].legend(fontsize=7)
  axes.flat[[p[0] for p in panels].index("kl_bits")].set_yscale("log")
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> int:
  flags = [("--batches", dict(type=int, default=8, help="eval batches of a missing series"))]
  src, out, args = study.cli(argv, __doc__, HERE, flags)
  runs = pd.read_csv(src) if src.suffix == ".csv" else collect(src, args.batches)
  study.save_runs(runs, src, out)
  by_step(runs).to_csv(out / "by_step.csv", index=False)
  dec = decision(runs)
  dec.to_csv(out / "decision.csv", index=False)
  figure(runs, out / "signatures.png")
  print(dec[["setting", "step", "exists", "first_step", "key_ratio_by_seed"]].to_string())
  print(dec[["setting", "value_r_new_wp_z_by_seed", "kl_bits"]].to_string())
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
