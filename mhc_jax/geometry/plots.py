"""The papers' three geometry figures side by side for several runs, from their ``eval.json``.

Reads only the ``probes.paper`` section ``mhc-jax eval`` writes, so any mixer and task will do.
A column per run; rows: the layer-0 token keys' cosine matrix, q-k alignment against evidence per
layer, the last-layer value PCA coloured by the posterior entropy (docs/windtunnel_results.md).
``score_rows`` gives the scores per run for a CSV; matplotlib is imported only inside ``draw``.
"""

from __future__ import annotations

import numpy as np

# CSV columns read from probes.paper: column -> path (missing: empty)
_KEY_COLUMNS = {
  "key_mean_abs_cos_layer0": "key_orthogonality.layer0.mean_abs_cos",
  "key_random_mean_abs_cos": "key_orthogonality.layer0.random_mean_abs_cos",
  "key_ratio_to_random_layer0": "key_orthogonality.layer0.ratio_to_random",
  "key_z_layer0": "key_orthogonality.layer0.z",
}
_QK_COLUMNS = {  # the last layer's slope (contrast where keys repeat, else the mean alignment)
  "qk_slope": "slope",
  "qk_slope_null_std": "null_std",
  "qk_slope_z": "z",
  "qk_slope_p": "p",
}
_VALUE_COLUMNS = {
  "value_pc1_variance": "value_manifold.pc1_variance",
  "value_pc1_variance_random": "value_manifold.pc1_variance_random",
  "value_abs_corr_pc1_entropy": "value_manifold.abs_corr_pc1_entropy",
  "value_corr_null_mean": "value_manifold.null_mean",
  "value_corr_null_std": "value_manifold.null_std",
  "value_corr_z": "value_manifold.z",
  "value_abs_corr_within_position": (
    "value_manifold.controls.within_position.abs_corr_pc1_entropy"
  ),
  "value_abs_corr_new_keys_within_position": (
    "value_manifold.controls.new_keys_within_position.abs_corr_pc1_entropy"
  ),
  "frame_settled_step": "frame_precision.frame_settled_step",
  "manifold_settled_step": "frame_precision.manifold_settled_step",
  "frame_before_manifold": "frame_precision.frame_before_manifold",
}
_QK_WITHIN = ("qk_slope_within_position", "qk_slope_within_position_z")
CSV_FIELDS = (
  *("run", "task", "mixer", "step", "kl_bits"),
  *_KEY_COLUMNS,
  *("qk_layer", "qk_measure", *_QK_COLUMNS, *_QK_WITHIN),
  *_VALUE_COLUMNS,
)


def paper_section(ev: dict) -> dict:
  """The ``probes.paper`` section of an eval.json dict; ValueError naming what is missing."""
  p = ev.get("probes", {}).get("paper")
  if not p:
    raise ValueError(f"{ev.get('run', 'eval.json')}: no probes.paper (re-run mhc-jax eval)")
  return p


def _get(d: dict, path: str):
  for key in path.split("."):
    d = d.get(key) if isinstance(d, dict) else None
  return d


def _qk_measure(layer: dict) -> str:
  return "contrast" if "contrast" in layer else "mean"


def score_rows(evals: dict[str, dict]) -> list[dict]:
  """One row of CSV_FIELDS per run (``evals``: name -> eval.json dict)."""
  rows = []
  for name, ev in evals.items():
    p = paper_section(ev)
    row = {"run": name, **{k: ev.get(k) for k in ("task", "mixer", "step")}}
    row["kl_bits"] = ev["metrics"].get("kl_bits")
    row.update({k: _get(p, path) for k, path in {**_KEY_COLUMNS, **_VALUE_COLUMNS}.items()})
    qk = p["qk_alignment"]
    if "by_layer" in qk:
      row["qk_layer"] = len(qk["by_layer"]) - 1
      rec = qk["by_layer"][-1]
      row["qk_measure"] = m = _qk_measure(rec)
      s = rec["contrast_slope" if m == "contrast" else "slope"]
      row.update({k: s[key] for k, key in _QK_COLUMNS.items()})
      w = rec.get("contrast_slope_within_position" if m == "contrast" else "slope_within_position")
      if w is not None:
        row.update(zip(_QK_WITHIN, (w["slope"], w["z"])))
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
    im = ax.imshow(np.asarray(ko["cos_layer0"], np.float64), vmin=-1, vmax=1, cmap="RdBu_r")
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
