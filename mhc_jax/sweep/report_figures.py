"""The report's figures: the runs' logged series gathered for :mod:`mhc_jax.sweep.plots`, each
PNG drawn with its caption or the sentence that says why it could not be (docs/sweeps.md).
"""

from __future__ import annotations

import pandas as pd

from mhc_jax import storage
from mhc_jax.logs import load_events, load_run
from mhc_jax.sweep.lrmap import has_lr_axis
from mhc_jax.sweep.report_tables import group_columns


def _plot_frames(table: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
  """(metrics, events) of every run with metrics, with a ``run`` column, for the plots."""
  keep = ["step", "loss", "grad_norm", "gain_fwd", "stream_spread"]
  keep += ["h_res_diag", "h_res_shift"]
  keep += [f"amax_{d}_composite{t}" for t in ("", "_tok_mean") for d in ("fwd", "bwd")]
  frames, evs = [], []
  for name, rdir in table.attrs["run_dirs"].items():
    if (storage.path(rdir) / "metrics.jsonl").exists():
      m, e = load_run(rdir), load_events(rdir)
      m.attrs = e.attrs = {}  # pandas deep-copies attrs on every operation
      frames += [m[[c for c in keep if c in m.columns]].assign(run=name)] if len(m) else []
      evs += [e[["step", "kind", "value"]].assign(run=name)] if len(e) else []
  m = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["run", *keep])
  e = pd.DataFrame(columns=["run", "step", "kind", "value"])
  return m, pd.concat(evs, ignore_index=True) if evs else e


def _lr_curves(plots, runs: pd.DataFrame, path, dpi: int) -> str | None:
  """Final loss against lr (plots.lr_curves): a panel per depth (else width) where it varies, a
  line per group of runs that differ only in lr and seed."""
  d = runs[runs["steps"] > 0]
  panel = plots._panel_col(d)
  keep = lambda c: c not in ("lr", panel) and (c == "mixer" or plots._varying(d, c))
  line = [c for c in group_columns(runs) if keep(c)]
  panels = [panel] if panel else []
  return plots.lr_curves(d, path, y="final_loss", panel=panels, line=line, dpi=dpi)


def _figures(table, out, paths, max_heatmaps, dpi) -> tuple[list, list[str]]:
  """Draw the PNGs into ``out`` (their paths into ``paths``): ([(keys, title, caption)], notes
  on the figures that could not be drawn)."""
  from mhc_jax.sweep import plots  # matplotlib only when plotting

  m, ev = _plot_frames(table)
  runs, info = table.copy(), plots.describe(table)
  draw = {  # each figure: (title, drawing, what summary.md says where there is nothing to draw)
    "loss_curves": (
      "Training loss",
      lambda p: plots.loss_curves(m, runs, ev, p, dpi=dpi),
      "No loss curves: no run has logged a finite loss yet.",
    ),
    "grad_norms": (
      "Gradient norm",
      lambda p: plots.grad_norm_curves(m, runs, ev, p, dpi=dpi),
      "No gradient-norm curves: no run has logged a finite grad_norm.",
    ),
    "amax_vs_depth": (
      "Composite Amax gain against depth",
      lambda p: plots.composite_gain_vs_depth(m, runs, p, dpi=dpi),
      "No composite Amax gain plot: no run has logged amax_fwd_composite / amax_bwd_composite "
      "(or no depth is known).",
    ),
    "stream_spread": (
      "Stream spread against layer",
      lambda p: plots.stream_spread_vs_layer(m, runs, p, dpi=dpi),
      "No stream spread plot: no run has logged stream_spread (logs written before it existed, "
      "or mixers whose state is not streams).",
    ),
    "h_res": (
      "Stream spread and H_res movement against layer",
      lambda p: plots.h_res_vs_layer(m, runs, p, dpi=dpi),
      "No H_res movement plot: no run has logged h_res_diag (logs written before it existed).",
    ),
    "lr_sensitivity": (
      "Learning-rate sensitivity",
      lambda p: _lr_curves(plots, runs, p, dpi),
      "No LR-sensitivity plot: no run on the lr grid has finished logging.",
    ),
  }
  missing, figures = [], []
  if not has_lr_axis(table):
    del draw["lr_sensitivity"]
    missing.append(
      "This sweep has no learning-rate axis (fewer than two distinct lr values), so there is no "
      "LR-sensitivity table or plot."
    )
  for key, (title, plot, none) in draw.items():
    if p := plot(out / f"{key}.png"):
      paths[key] = str(p)
      figures.append(([key], title, plots.CAPTIONS[key].format(**info)))
    else:
      missing.append(none)
  chosen = plots.pick_heatmap_runs(m, runs, max_heatmaps)
  for name in chosen:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
    row = runs[runs["run"] == name].iloc[0]
    if p := plots.layer_heatmap(m[m["run"] == name], row, out / f"heatmap_{safe}.png", dpi=dpi):
      paths[f"heatmap:{name}"] = str(p)
  if heat := [k for k in paths if k.startswith("heatmap:")]:
    words = dict(info, n_heatmaps=len(heat), max_heatmaps=max_heatmaps)
    caption = plots.CAPTIONS["heatmap"].format(**words)
    figures.append((heat, "Per-layer gains over training", caption))
  if not chosen:
    missing.append(
      "No per-layer heatmaps: no run has logged per-layer gain_fwd / amax_fwd_composite."
    )
  return figures, missing
