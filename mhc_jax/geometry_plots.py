"""The papers' three geometry figures side by side for several runs, from their ``eval.json``.

Reads only the ``probes.paper`` section ``mhc-jax eval`` writes (:mod:`mhc_jax.evaluate`), so it
works on any mixer (multi-stream ones included) and on bijection and HMM runs alike. One column
per run, three rows: the key orthogonality matrix (cosines between the hypothesis tokens' layer-0
keys, heads concatenated), query-key alignment against evidence (per layer: the query's cosine
with the matching earlier key minus the others', or the mean over earlier keys where no key
repeats), and the last-layer value PCA coloured by the posterior entropy. ``score_rows`` gives
the scores per run for a CSV. matplotlib is imported only inside ``draw``.
"""

from __future__ import annotations

import numpy as np

CSV_FIELDS = (
  "run",
  "task",
  "mixer",
  "step",
  "kl_bits",
  "key_mean_abs_cos_layer0",
  "key_random_mean_abs_cos",
  "key_ratio_to_random_layer0",
  "key_z_layer0",
  "qk_layer",
  "qk_measure",
  "qk_slope",
  "qk_slope_null_std",
  "qk_slope_z",
  "qk_slope_p",
  "qk_slope_within_position",
  "qk_slope_within_position_z",
  "value_pc1_variance",
  "value_pc1_variance_random",
  "value_abs_corr_pc1_entropy",
  "value_corr_null_mean",
  "value_corr_null_std",
  "value_corr_z",
  "value_abs_corr_within_position",
  "value_abs_corr_new_keys_within_position",
  "frame_settled_step",
  "manifold_settled_step",
  "frame_before_manifold",
)


def paper_section(ev: dict) -> dict:
  """The ``probes.paper`` section of an eval.json dict; ValueError naming what is missing."""
  p = ev.get("probes", {}).get("paper")
  if not p:
    raise ValueError(f"{ev.get('run', 'eval.json')}: no probes.paper (re-run mhc-jax eval)")
  return p


def _qk_measure(layer: dict) -> str:
  return "contrast" if "contrast" in layer else "mean"


def score_rows(evals: dict[str, dict]) -> list[dict]:
  """One row of CSV_FIELDS per run (``evals``: name -> eval.json dict); the q-k columns are
  the last layer's (contrast where keys repeat, else the mean alignment)."""
  rows = []
  for name, ev in evals.items():
    p = paper_section(ev)
    ko, qk, vm = p["key_orthogonality"], p["qk_alignment"], p["value_manifold"]
    fp = p.get("frame_precision", {})
    row = {
      "run": name,
      "task": ev.get("task"),
      "mixer": ev.get("mixer"),
      "step": ev.get("step"),
      "kl_bits": ev["metrics"].get("kl_bits"),
      "key_mean_abs_cos_layer0": ko["layer0"]["mean_abs_cos"],
      "key_random_mean_abs_cos": ko["layer0"]["random_mean_abs_cos"],
      "key_ratio_to_random_layer0": ko["layer0"]["ratio_to_random"],
      "key_z_layer0": ko["layer0"]["z"],
      "value_pc1_variance": vm["pc1_variance"],
      "value_pc1_variance_random": vm["pc1_variance_random"],
      "value_abs_corr_pc1_entropy": vm["abs_corr_pc1_entropy"],
      "value_corr_null_mean": vm.get("null_mean"),
      "value_corr_null_std": vm.get("null_std"),
      "value_corr_z": vm.get("z"),
      "value_abs_corr_within_position": vm["controls"]
      .get("within_position", {})
      .get("abs_corr_pc1_entropy"),
      "value_abs_corr_new_keys_within_position": vm["controls"]
      .get("new_keys_within_position", {})
      .get("abs_corr_pc1_entropy"),
      "frame_settled_step": fp.get("frame_settled_step"),
      "manifold_settled_step": fp.get("manifold_settled_step"),
      "frame_before_manifold": fp.get("frame_before_manifold"),
    }
    if "by_layer" in qk:
      l = len(qk["by_layer"]) - 1
      rec = qk["by_layer"][l]
      m = _qk_measure(rec)
      s = rec[f"{m}_slope" if m == "contrast" else "slope"]
      w = rec.get(f"{m}_slope_within_position" if m == "contrast" else "slope_within_position")
      row.update(
        qk_layer=l,
        qk_measure=m,
        qk_slope=s["slope"],
        qk_slope_null_std=s["null_std"],
        qk_slope_z=s["z"],
        qk_slope_p=s["p"],
        qk_slope_within_position=None if w is None else w["slope"],
        qk_slope_within_position_z=None if w is None else w["z"],
      )
    rows.append({k: row.get(k) for k in CSV_FIELDS})
  return rows


def draw(evals: dict[str, dict], path) -> None:
  """The three figures (rows) for every run (columns) into one image at ``path``."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  n = len(evals)
  fig, axes = plt.subplots(3, n, figsize=(3.6 * n, 10), squeeze=False)
  for j, (name, ev) in enumerate(evals.items()):
    p = paper_section(ev)
    ko, qk, vm = p["key_orthogonality"], p["qk_alignment"], p["value_manifold"]
    ax = axes[0, j]
    cos = np.asarray(ko["cos_layer0"], np.float64)
    im = ax.imshow(cos, vmin=-1, vmax=1, cmap="RdBu_r")
    l0 = ko["layer0"]
    ax.set_title(
      f"{name}\nlayer-0 token keys: |cos| {l0['mean_abs_cos']:.2f}/head\n"
      f"random {l0['random_mean_abs_cos']:.2f} (ratio {l0['ratio_to_random']:.2f})",
      fontsize=8,
    )
    ax.set_xlabel(f"hypothesis token ({ko['tokens']})", fontsize=7)
    fig.colorbar(im, ax=ax, fraction=0.046)
    ax = axes[1, j]
    if "by_layer" in qk:
      for l, rec in enumerate(qk["by_layer"]):
        m = _qk_measure(rec)
        y = np.asarray(rec[f"{m}_by_evidence"], np.float64)
        s = rec["contrast_slope" if m == "contrast" else "slope"]
        ax.plot(np.arange(len(y)), y, marker=".", label=f"L{l} {m}: z={s['z']:.1f}")
      ax.legend(fontsize=6)
      ax.set_xlabel("evidence", fontsize=7)
      ax.set_ylabel("q-k cosine (pre-RoPE, heads averaged)", fontsize=7)
      ax.set_title("query-key alignment vs evidence\n(z vs permuted evidence)", fontsize=8)
    else:
      ax.text(0.5, 0.5, qk.get("skipped", "no q-k alignment"), ha="center", fontsize=7)
    ax = axes[2, j]
    f = vm["figure"]
    pc = np.asarray(f["pc"], np.float64)
    sc = ax.scatter(pc[:, 0], pc[:, 1] if pc.shape[1] > 1 else 0 * pc[:, 0], c=f["entropy"], s=4)
    fig.colorbar(sc, ax=ax, fraction=0.046, label="posterior entropy (bits)")
    ax.set_xlabel(f"PC1 ({100 * vm['pc1_variance']:.0f}% var)", fontsize=7)
    ax.set_title(
      f"last-layer values: |r(PC1, H)| {vm['abs_corr_pc1_entropy']:.2f}\n"
      f"shuffled H {vm.get('null_mean', float('nan')):.2f} +- {vm.get('null_std', float('nan')):.2f}",
      fontsize=8,
    )
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
