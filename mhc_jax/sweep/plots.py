"""Plots for the sweep report (matplotlib Agg: files only). Each function writes one PNG and
returns its path, or returns ``None`` (writing nothing) when there is nothing to draw.

Inputs: ``metrics`` (``load_run`` frames with a ``run`` column), ``runs``
(:func:`mhc_jax.sweep.report.summary_table`), ``events`` (``load_events`` frames with ``run``).
One colour per mixer; shade = lr; line style = other varying axes; seeds -> mean line and band
(docs/statistics.md, "Bands in the plots").
"""

from __future__ import annotations

import io
import math
import os
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg", force=False)
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.colors import LogNorm, Normalize, to_rgb  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter, NullLocator  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

from mhc_jax import storage  # noqa: E402
from mhc_jax.sweep import stats  # noqa: E402

_KNOWN = {"residual": "#4d4d4d", "hc": "#d62728", "mhc": "#1f77b4", "mhc_lite": "#2ca02c"}
_EXTRA = ["#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#7f7f7f"]
_STYLES = ["-", "--", ":", "-."]
_ROLE_COLS = ("run", "mixer", "lr", "seed")
_GREY = "#333333"

_BAND = dict(alpha=0.22, lw=0)
_GRID = dict(squeeze=False, layout="constrained")
_LEG = dict(loc="outside right upper", fontsize=9, frameon=False)
_SPIKE = dict(ls="none", marker="x", ms=8, mew=2, zorder=5)
_NAN = dict(ls="none", marker="v", ms=9, mec="black", mew=0.6, clip_on=False, zorder=6)
_DIV = dict(ls="none", marker="X", ms=10, mec="black", mew=0.8, zorder=5)
_KIND = {"avg": dict(marker="o", ls="-"), "tok": dict(marker="s", ls="--")}
_KIND_LABEL = {"avg": "token-averaged", "tok": "per-token (token mean)"}
_DIRS = {"fwd": "forward (max |row sum|)", "bwd": "backward (max |column sum|)"}

CAPTIONS = {
  "loss_curves": "Training loss (nats per token) against step, {panel_text}. Colour = "
  "mixer{shade_text}{style_text}.{seed_text} × marks a detected loss spike (a spike/loss event: a "
  "step change of the loss more than 6 robust SDs above the recent trend, mhc_jax/spikes.py); ▼ "
  "at the top edge marks the step where a run's loss first became NaN/inf, where its curve stops. "
  "Read: lower and smoother is better; x's and curves that turn upward are instabilities.",
  "grad_norms": "Global gradient norm (L2, before clipping) against step, log scale, "
  "{panel_text}. Colour = mixer{shade_text}{style_text}.{seed_text} × marks a gradient-norm spike "
  "(spike/grad event), ▼ the first non-finite gradient norm. Read: a flat or slowly falling band "
  "is healthy; jumps by a decade or more usually accompany or precede loss spikes.",
  "amax_vs_depth": "Amax gain of the whole-depth product ∏ H_res (the mHC paper's \"Amax Gain "
  'Magnitude"; forward = max |row sum|, backward = max |column sum|) maximum over training (the '
  "summary table's amax_*_composite_max and amax_*_composite_tok_mean_max columns, which the "
  "sentence quotes), against depth L (2L mixer layers; log2 axis when depths span 4x or more). "
  "Solid lines: the product of the token-averaged H_res (what the paper plots); dashed, where the "
  "logs have it: the per-token composite (each sampled token's own product, averaged over "
  "tokens), which token averaging can hide. One line per mixer; where several runs of a mixer "
  "differ only in the seed, the point is their geometric mean and the shaded band the 95% Student "
  "t interval over seeds (on log values); where they differ in other axes too (lr, width), the "
  "point is their median and the bar spans min to max. Log scale; the dotted line is 1 (the "
  "residual path neither amplifies nor attenuates). Read: a line that climbs with depth means "
  "per-layer gains compound (unconstrained HC); a flat line at 1 is what the doubly stochastic "
  "constraint of mHC buys.",
  "stream_spread": "Stream spread after each mixer layer at the last diagnostics step: RMS(x - "
  "mean over streams) / RMS(x) of the stream state, {panel_text}. Colour = "
  "mixer{style_text}.{seed_text} 0 means one stream (residual) or streams that collapsed into "
  "copies of each other; HC's spread typically peaks mid-depth and falls near the output. Log "
  "scale where every value is positive and they span 30x or more. Read: a multi-stream mixer "
  "whose line lies on the floor uses its n streams as one.",
  "h_res": "Per mixer layer at the last diagnostics step: stream spread (left), the mean diagonal "
  "of the token-averaged H_res (middle: 1 = the identity, 1/n = uniform mixing) and its RMS shift "
  "from step 0 (right). One line per group of runs that differ only in the seed (the mean over "
  "its seeds, n in the legend); colour = mixer, shades within a mixer. Read: a diagonal at 1 with "
  "no shift is a mixing that never moved from its init; a doubly stochastic H_res that moves off "
  "I shrinks the differences between streams, which the spread shows.",
  "heatmap": "Per-layer gains over training, one figure per run. Left: gain_fwd = RMS(stream out) "
  "/ RMS(stream in) of each mixer layer (rows, bottom = first attention sublayer, attention and "
  "MLP alternate); right: composite forward Amax gain of the product of H_res up to that layer "
  "(top row = whole depth). Columns are the steps where per-layer diagnostics were logged. Log "
  "colour scale centred on 1: white = 1, red amplifies, blue attenuates; grey = not logged or "
  "non-finite. Shown for {n_heatmaps} runs: {heatmap_text} (at most {max_heatmaps}; "
  "write_report(max_heatmaps=...) changes it).",
  "lr_sensitivity": "Final loss (mean of the last 5% of logged losses) against learning rate (log "
  "scale), {panel_text}; one line per group of runs that differ only in lr and seed (the legend "
  "names it), the mean over seeds of min(final loss, initial loss) with its 95% Student t band. X "
  "marks an lr where a seed diverged (non-finite, or at least 0.9 of its initial loss), counted "
  "at the initial loss as in Wortsman et al.'s LR sensitivity (lr_sensitivity.csv). Read: a wide "
  "flat valley means the mixer trains well over a broad range of lr.",
}


# =========================================================================== helpers
def _order(mixers: Sequence[Any]) -> list[str]:
  names = sorted({str(m) for m in mixers})
  return [m for m in _KNOWN if m in names] + [m for m in names if m not in _KNOWN]


def mixer_colors(mixers: Sequence[Any]) -> dict[str, str]:
  """Fixed colours for the known mixers, a fixed palette in sorted-name order for the rest."""
  extra = iter(_EXTRA * 4)
  return {m: _KNOWN.get(m) or next(extra) for m in _order(mixers)}


def _shade(color: str, k: int, n: int) -> tuple[float, float, float]:
  """k-th of n shades: lightest for k = 0, darkest for k = n - 1."""
  rgb = np.asarray(to_rgb(color))
  f = -0.6 + 0.9 * k / (n - 1) if n > 1 else 0.0  # < 0: mix with white, > 0: with black
  return tuple(rgb * (1 + f) - f if f < 0 else rgb * (1 - f))


def _num(s) -> pd.Series:
  return pd.to_numeric(pd.Series(s), errors="coerce")


def _varying(runs: pd.DataFrame, col: str) -> bool:
  return col in runs.columns and runs[col].dropna().astype(str).nunique() > 1


def _panel_col(runs: pd.DataFrame) -> str | None:
  return next((c for c in ("depth", "width") if _varying(runs, c)), None)


def _style_cols(runs: pd.DataFrame, panel: str | None) -> list[str]:
  ids = runs.attrs.get("id_columns") or [c for c in ("depth", "width") if c in runs.columns]
  return [c for c in ids if c not in _ROLE_COLS and c != panel and _varying(runs, c)]


def _fmt(v: Any) -> str:
  if isinstance(v, (float, np.floating)):
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e6 else f"{v:g}"
  return str(v)


def _panel_title(col: str | None, v: Any) -> str:
  if col == "depth":
    try:
      return f"depth L = {_fmt(v)}  ({2 * int(float(v))} mixer layers)"
    except (TypeError, ValueError):
      return f"depth = {v}"
  return f"width C = {_fmt(v)}" if col == "width" else ""


def describe(runs: pd.DataFrame) -> dict[str, str]:
  """Words for the captions: how panels, shades and line styles map to sweep axes."""
  panel = _panel_col(runs)
  styles = _style_cols(runs, panel)
  seed_text = (
    " Where runs differ only in the seed, the line is their mean (geometric mean on a log axis) "
    "and the shaded band the range (min to max) over the seeds at each step, stopping where any "
    "seed has no finite value; × and ▼ mark individual seeds. The 95% intervals of the summary "
    "numbers are in the groups table."
  )
  return {
    "panel_text": f"one panel per {panel}" if panel else "all runs in one panel",
    "shade_text": "; shade = learning rate (darker = larger)" if _varying(runs, "lr") else "",
    "style_text": f"; line style = {', '.join(styles)}" if styles else "",
    "heatmap_text": "the deepest run of each mixer (ties: the one with the largest composite gain)",
    "seed_text": seed_text if _varying(runs, "seed") else "",
  }


def _mixer_of(runs: pd.DataFrame) -> pd.Series:
  return runs["mixer"].astype(str) if "mixer" in runs else pd.Series("run", index=runs.index)


def _save(fig, path, dpi: int) -> str:
  """The figure as a PNG at ``path`` (local or object store), written whole; its path."""
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
  plt.close(fig)
  storage.write_bytes_atomic(path, buf.getvalue())
  return os.fspath(path)


def _series(df: pd.DataFrame, col: str) -> tuple[np.ndarray, np.ndarray]:
  if col not in df.columns:
    return np.zeros(0), np.zeros(0)
  num = (int, float, np.integer, np.floating)
  d = df[df[col].map(lambda v: isinstance(v, num) and not isinstance(v, bool))]
  return d["step"].to_numpy(dtype=np.float64), d[col].to_numpy(dtype=np.float64)


def _legend_handles(colors, styles, style_keys, max_band, lrs=(), band="range over seeds"):
  """Legend entries: one colour per mixer, lr shades, line styles, the seed band."""
  h = [Line2D([], [], color=colors[m], lw=2.5, label=m) for m in colors]
  if lrs:
    h.append(Line2D([], [], ls="none", label="learning rate:"))
    for k, lr in enumerate(lrs):
      h.append(Line2D([], [], color=_shade(_GREY, k, len(lrs)), lw=2.5, label=f"  lr = {lr:g}"))
  if styles:
    h.append(Line2D([], [], ls="none", label=", ".join(styles) + ":"))
    for i, k in enumerate(style_keys):
      h.append(Line2D([], [], color=_GREY, ls=_STYLES[i % 4], lw=1.5, label="  " + ", ".join(k)))
  if max_band:
    h.append(Patch(color=_GREY, alpha=0.22, label=f"{band} (≤ {max_band})"))
  return h


def _plain_log_ticks(ax) -> None:
  """Plain-number labels on a log y axis; round evenly spaced ticks within about a decade."""
  lo, hi = ax.get_ylim()
  if lo > 0 and hi / lo < 12:
    ax.yaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
    ax.yaxis.set_minor_locator(NullLocator())
  ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
  ax.yaxis.set_minor_formatter(NullFormatter())


def _use_log(values: np.ndarray, ratio: float = 30.0) -> bool:
  v = values[np.isfinite(values) & (values > 0)]
  return bool(v.size) and v.max() / v.min() >= ratio


def _grid(n: int, w: float, h: float):
  """A figure of ``n`` panels ``w`` x ``h`` inches, at most 3 a row, sharing axes; unused hidden."""
  nr, nc = -(-n // 3), min(n, 3)
  fig, axes = plt.subplots(nr, nc, figsize=(w * nc, h * nr), sharex=True, sharey=True, **_GRID)
  for ax in axes.ravel()[n:]:
    ax.set_visible(False)
  return fig, axes


def _finish(fig, axes, handles, *, log, xlabel, ylabel, title=None) -> None:
  for ax in axes:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.label_outer()
    if log:
      ax.set_yscale("log")
      _plain_log_ticks(ax)
  fig.legend(handles=handles, **_LEG)
  if title:
    fig.suptitle(title, fontsize=12)


# =========================================================================== panels and seeds
def _seed_groups(runs: pd.DataFrame) -> list[pd.DataFrame]:
  """``runs`` split into groups that differ only in ``seed`` (each run alone without seeds)."""
  if not _varying(runs, "seed"):
    return [runs.iloc[[i]] for i in range(len(runs))]
  ids = runs.attrs.get("id_columns") or ["mixer", "depth", "width", "lr"]
  keys = [c for c in ids if c in runs and c not in ("run", "seed")]
  return [g for _, g in stats.split(runs, keys)]


def _seed_band(series: list[tuple[np.ndarray, np.ndarray]], log: bool) -> tuple[np.ndarray, ...]:
  """(x, mean, min, max) over replicate (x, values) series, geometric when ``log``: a range, not an
  interval; NaN where a series lacks a finite (positive) value, so lines stop."""
  xs = np.unique(np.concatenate([s for s, _ in series]))
  mat = np.full((len(series), xs.size), np.nan)
  for i, (s, v) in enumerate(series):
    mat[i, np.searchsorted(xs, s)] = v
  ok = np.isfinite(mat) & ((mat > 0) if log else True)
  v = np.where(ok, np.log(np.where(ok, mat, 1.0)) if log else mat, np.nan)
  with np.errstate(invalid="ignore"):
    out = v.mean(axis=0), v.min(axis=0), v.max(axis=0)
  return (xs, *(np.exp(x) for x in out)) if log else (xs, *out)


def _panels(runs, draw, title="", lrs=(), all_runs=None, groups=_seed_groups):
  """One panel per depth (else width) and a call ``draw(ax, members, colour, line style)`` per
  group of ``runs`` (:func:`_seed_groups`); colours and styles from ``all_runs`` (default
  ``runs``). Returns (fig, axes, panel column, colours, style columns, style keys)."""
  every = runs if all_runs is None else all_runs
  panel = _panel_col(runs)
  styles = _style_cols(every, panel)
  keys = sorted({tuple(str(r[c]) for c in styles) for _, r in runs.iterrows()})
  pvals = [None]
  if panel:
    pvals = sorted(runs[panel].dropna().unique(), key=lambda v: (_num([v])[0], str(v)))
  colors = mixer_colors(_mixer_of(every))
  fig, axes = _grid(len(pvals), 4.8, 3.6)
  axes = axes.ravel()[: len(pvals)]
  for ax, pv in zip(axes, pvals):
    for members in groups(runs if panel is None else runs[runs[panel] == pv]):
      r = members.iloc[0]
      c = colors[str(r["mixer"]) if "mixer" in r else "run"]
      lr = _num([r["lr"]])[0] if lrs else np.nan
      if lrs and pd.notna(lr):
        c = _shade(c, lrs.index(lr), len(lrs))
      key = tuple(str(r[c]) for c in styles)
      draw(ax, members, c, _STYLES[keys.index(key) % len(_STYLES)] if key in keys else "-")
    ax.set_title(_panel_title(panel, pv) if panel else title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
  return fig, axes, panel, colors, styles, keys


# =========================================================================== curves
def _curves(metrics, runs, events, path, col, spike_kind, ylabel, title, log, dpi) -> str | None:
  if metrics is None or not len(metrics) or col not in metrics.columns:
    return None
  runs = runs[runs["run"].isin(set(metrics["run"]))]
  series = {r: _series(metrics[metrics["run"] == r], col) for r in runs["run"]}
  allv = np.concatenate([np.zeros(0), *(v for _, v in series.values())])
  if not np.isfinite(allv).any():
    return None
  log = _use_log(allv) if log is None else log
  lrs = sorted(_num(runs["lr"]).dropna().unique()) if _varying(runs, "lr") else []
  seen = {"band": 0, "spike": False, "nonfinite": False}

  def draw(ax, members, c, ls):
    if len(members) > 1:  # replicate seeds: mean line and band, markers per seed
      steps, mid, lo, hi = _seed_band([series[n] for n in members["run"]], log)
      ax.fill_between(steps, lo, hi, color=c, **_BAND)
      ax.plot(steps, mid, color=c, ls=ls, lw=1.6, alpha=0.95)
      seen["band"] = max(seen["band"], len(members))
    for name in members["run"]:
      steps, vals = series[name]
      y = np.where(np.isfinite(vals) & ((vals > 0) if log else True), vals, np.nan)
      if len(members) == 1:
        ax.plot(steps, y, color=c, ls=ls, lw=1.4, alpha=0.95)
      ev = events[(events["run"] == name) & (events["kind"] == spike_kind)] if len(events) else []
      lookup = dict(zip(steps, y))
      pts = [(s, lookup.get(float(s), np.nan)) for s in (ev["step"] if len(ev) else [])]
      pts = [(s, v) for s, v in pts if np.isfinite(v)]
      if pts:
        ax.plot(*zip(*pts), color=c, **_SPIKE)
        seen["spike"] = True
      bad = np.flatnonzero(~np.isfinite(vals))
      if bad.size:  # a marker at the top edge where the run first became non-finite
        tr = blended_transform_factory(ax.transData, ax.transAxes)
        ax.plot([steps[bad[0]]], [0.97], transform=tr, color=c, **_NAN)
        seen["nonfinite"] = True

  fig, axes, panel, colors, styles, keys = _panels(runs, draw, title, lrs)
  handles = _legend_handles(colors, styles, keys, seen["band"], lrs)
  if seen["spike"]:
    handles.append(Line2D([], [], color=_GREY, label=f"{spike_kind} event", **_SPIKE))
  if seen["nonfinite"]:
    handles.append(Line2D([], [], color="#999999", label="became NaN/inf", **_NAN))
  t = title if panel else None
  _finish(fig, axes, handles, log=log, xlabel="training step", ylabel=ylabel, title=t)
  return _save(fig, path, dpi)


def loss_curves(
  metrics: pd.DataFrame,
  runs: pd.DataFrame,
  events: pd.DataFrame,
  path,
  *,
  dpi: int = 110,
  log: bool | None = None,
) -> str | None:
  """Training loss against step, spike/loss events as x's (``log=None``: log y at 30x span)."""
  y = "training loss (nats / token)"
  return _curves(metrics, runs, events, path, "loss", "spike/loss", y, "Training loss", log, dpi)


def grad_norm_curves(
  metrics: pd.DataFrame, runs: pd.DataFrame, events: pd.DataFrame, path, *, dpi: int = 110
) -> str | None:
  """Gradient norm (before clipping) against step, log y, spike/grad events as x's."""
  y, t = "gradient norm (L2, before clipping)", "Gradient norm"
  return _curves(metrics, runs, events, path, "grad_norm", "spike/grad", y, t, True, dpi)


# =========================================================================== per-layer
def _layer_matrix(df: pd.DataFrame, col: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps [S], values [layers, S]) of a list-valued column, NaN-padded."""
  d = df[df[col].map(lambda v: isinstance(v, list) and len(v) > 0)] if col in df.columns else []
  if not len(d):
    return np.zeros(0), np.zeros((0, 0))
  lists = [np.asarray([np.nan if x is None else x for x in v], dtype=np.float64) for v in d[col]]
  mat = np.full((max(len(x) for x in lists), len(lists)), np.nan)
  for j, x in enumerate(lists):
    mat[: len(x), j] = x
  return d["step"].to_numpy(dtype=np.float64), mat


def composite_gain_vs_depth(
  metrics: pd.DataFrame, runs: pd.DataFrame, path, *, dpi: int = 110
) -> str | None:
  """Whole-depth composite Amax gain (fwd, bwd; max over training) against depth, one line per
  mixer, log y; solid token-averaged, dashed per-token (token mean) where logged."""
  if metrics is None or not len(metrics):
    return None
  rows = []
  for name, df in metrics.groupby("run", sort=False):
    rr = runs[runs["run"] == name]
    mixer = str(rr["mixer"].iloc[0]) if "mixer" in rr.columns and len(rr) else "run"
    depth = _num(rr["depth"]).iloc[0] if "depth" in rr.columns and len(rr) else np.nan
    for d, kind in (("fwd", "avg"), ("bwd", "avg"), ("fwd", "tok"), ("bwd", "tok")):
      steps, mat = _layer_matrix(df, f"amax_{d}_composite" + ("_tok_mean" if kind == "tok" else ""))
      whole = mat[-1] if steps.size else np.zeros(0)  # the last layer's value: whole depth
      whole = whole[np.isfinite(whole) & (whole > 0)]
      if whole.size:
        dep = float(depth) if np.isfinite(depth) else mat.shape[0] / 2
        rows.append(dict(mixer=mixer, dir=d, kind=kind, depth=dep, value=whole.max(), run=name))
  if not rows:
    return None
  data = pd.DataFrame(rows)
  colors = mixer_colors(data["mixer"])
  # a band over seeds where every (mixer, depth) point's runs differ only in the seed
  groups = _seed_groups(runs[runs["run"].isin(set(data["run"]))]) if _varying(runs, "seed") else []
  keys = [(_mixer_of(g).iloc[0], str(g["depth"].iloc[0]) if "depth" in g else "") for g in groups]
  banded = len(set(keys)) == len(keys) and any(len(g) > 1 for g in groups)
  kinds = [k for k in ("avg", "tok") if (data["kind"] == k).any()]
  depths = sorted(data["depth"].unique())
  fig, axes = plt.subplots(1, 2, figsize=(10.5, 4.0), sharey=True, layout="constrained")
  for ax, d in zip(axes, ("fwd", "bwd")):
    ax.axhline(1.0, color="#888888", ls=":", lw=1)
    for i, (kind, m) in enumerate((k, m) for k in kinds for m in colors):
      sel = data[(data["mixer"] == m) & (data["dir"] == d) & (data["kind"] == kind)]
      g = sel.groupby("depth")["value"]
      if not len(sel):
        continue
      j = i % len(colors)  # earlier mixers bigger and below: coinciding lines stay visible
      style = dict(color=colors[m], ms=max(4.0, 10 - 1.5 * j), lw=max(1.2, 3.5 - 0.6 * j))
      style.update(_KIND[kind], zorder=2 + j)
      if banded:  # geometric mean and 95% Student t interval over seeds
        band = g.apply(lambda v: stats.mean_ci(v.to_numpy(dtype=float), log=True))
        mid, lo, hi = (np.array([b[k] if b[3] > 1 else b[0] for b in band]) for k in range(3))
        ax.fill_between(band.index, lo, hi, color=colors[m], zorder=1, **_BAND)
        ax.plot(band.index, mid, **style)
      else:  # median, bar min to max
        med, lo, hi = g.median(), g.min(), g.max()
        ax.errorbar(med.index, med, yerr=[med - lo, hi - med], capsize=4, **style)
    ax.set_yscale("log")
    ax.set_title(_DIRS[d], fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    if len(depths) > 1 and depths[0] > 0 and depths[-1] / depths[0] >= 4:
      ax.set_xscale("log", base=2)  # depth ladders usually double
      ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(depths, labels=[_fmt(v) for v in depths])
    if len(depths) == 1:
      ax.set_xlim(depths[0] - 1, depths[0] + 1)
  handles = [Line2D([], [], color=colors[m], marker="o", lw=2, label=m) for m in colors]
  if "tok" in kinds:
    handles += [Line2D([], [], color=_GREY, label=_KIND_LABEL[k], **_KIND[k]) for k in _KIND]
  handles.append(Line2D([], [], color="#888888", ls=":", label="gain 1"))
  if banded:
    n = int(data.groupby(["mixer", "dir", "kind", "depth"])["run"].nunique().max())
    handles.append(Patch(color=_GREY, alpha=0.22, label=f"95% CI over seeds (≤ {n})"))
  title = "Composite Amax gain against depth (max over training)"
  x = "depth L (blocks; 2L mixer layers)"
  _finish(fig, axes, handles, log=True, xlabel=x, ylabel="", title=title)
  axes[0].set_ylabel("composite Amax gain of ∏ H_res\n(whole depth, max over training)")
  return _save(fig, path, dpi)


def stream_spread_vs_layer(
  metrics: pd.DataFrame, runs: pd.DataFrame, path, *, dpi: int = 110
) -> str | None:
  """Stream spread per mixer layer at the last diagnostics step, one line per mixer (mean and
  min-max band over seeds); ``None`` where no run logged it."""
  if metrics is None or not len(metrics) or "stream_spread" not in metrics.columns:
    return None
  last = {}
  for name, df in metrics.groupby("run", sort=False):
    steps, mat = _layer_matrix(df, "stream_spread")
    if steps.size and np.isfinite(mat[:, -1]).any():
      last[name] = mat[:, -1]
  if not last:
    return None
  fin = np.concatenate(list(last.values()))
  log = _use_log(fin) and fin[np.isfinite(fin)].min() > 0  # log only when every finite value is > 0
  max_band = []

  def draw(ax, members, c, ls):
    vals = [last[n] for n in members["run"]]
    x, mid = np.arange(vals[0].size), vals[0]
    if len(vals) > 1:
      x, mid, lo, hi = _seed_band([(np.arange(v.size), v) for v in vals], log)
      ax.fill_between(x, lo, hi, color=c, **_BAND)
      max_band.append(len(vals))
    ax.plot(x, mid, color=c, ls=ls, lw=1.6, marker="o", ms=3)

  fig, axes, _, colors, styles, keys = _panels(runs[runs["run"].isin(set(last))], draw)
  handles = _legend_handles(colors, styles, keys, max(max_band, default=0))
  x, title = "mixer layer (attn 0, mlp 0, attn 1, ...)", "Stream spread against layer"
  _finish(fig, axes, handles, log=log, xlabel=x, ylabel="stream spread", title=title)
  return _save(fig, path, dpi)


def h_res_vs_layer(
  metrics: pd.DataFrame, runs: pd.DataFrame, path, *, dpi: int = 110
) -> str | None:
  """Does the mixing move (issue 41): per mixer layer at the last diagnostics step, the stream
  spread beside ``h_res_diag`` and ``h_res_shift``; one line per group of runs that differ only in
  the seed (mean over seeds), coloured by mixer, shaded within a mixer; ``None`` where no run
  logged ``h_res_diag``."""
  cols = ("stream_spread", "h_res_diag", "h_res_shift")
  if metrics is None or not len(metrics) or "h_res_diag" not in metrics.columns:
    return None
  last = {}  # run -> {col: values per layer at the last diagnostics step}
  for name, df in metrics.groupby("run", sort=False):
    got = {c: _layer_matrix(df, c)[1] for c in cols}
    if got["h_res_diag"].size:
      last[name] = {c: m[:, -1] if m.size else np.zeros(0) for c, m in got.items()}
  runs = runs[runs["run"].isin(set(last))]
  if not len(runs):
    return None
  groups, colors = _seed_groups(runs), mixer_colors(_mixer_of(runs))
  fig, axes = plt.subplots(1, 3, figsize=(14.0, 3.8), layout="constrained")
  handles, seen = [], dict.fromkeys(_mixer_of(runs), 0)
  for members in groups:
    mixer = str(_mixer_of(members).iloc[0])
    k = seen[mixer] = seen[mixer] + 1
    n = sum(str(_mixer_of(g).iloc[0]) == mixer for g in groups)
    c = _shade(colors[mixer], k - 1, n) if n > 1 else colors[mixer]
    for ax, col in zip(axes, cols):
      vals = [last[r][col] for r in members["run"] if last[r][col].size]
      if vals:
        size = min(v.size for v in vals)
        ax.plot(np.mean([v[:size] for v in vals], axis=0), color=c, lw=1.4, marker="o", ms=2.5)
    label = str(members["run"].iloc[0])
    label = ",".join(p for p in label.split(",") if not p.startswith("seed="))
    handles.append(Line2D([], [], color=c, lw=2, label=f"{label} (n={len(members)})"))
  ylabels = ("stream spread", "mean diagonal of H_res (1 = I)", "RMS(H_res - H_res at step 0)")
  for ax, col, yl in zip(axes, cols, ylabels):
    ax.set_title(col, fontsize=10)
    ax.set(xlabel="mixer layer (attn 0, mlp 0, attn 1, ...)", ylabel=yl)
    ax.grid(True, alpha=0.3)
  fig.legend(handles=handles, **_LEG)
  title = "Stream spread and H_res movement against layer (last diagnostics step)"
  fig.suptitle(title, fontsize=12)
  return _save(fig, path, dpi)


def pick_heatmap_runs(metrics: pd.DataFrame, runs: pd.DataFrame, max_runs: int = 6) -> list[str]:
  """Per mixer the deepest run with per-layer diagnostics (ties: largest composite peak, then
  name); at most ``max_runs``, mixers in the usual order."""
  if metrics is None or not len(metrics) or max_runs <= 0:
    return []
  cols = [c for c in ("gain_fwd", "amax_fwd_composite") if c in metrics.columns]
  listed = metrics[cols].map(lambda v: isinstance(v, list) and len(v) > 0).any(axis=1)
  cand = runs[runs["run"].isin(set(metrics.loc[listed, "run"]))].copy()
  if not len(cand):
    return []
  cand["_mixer"] = _mixer_of(cand)
  cand["_depth"] = _num(cand["depth"]).fillna(-1).to_numpy() if "depth" in cand.columns else -1
  peak = cand.get("amax_fwd_composite_max_all_layers", pd.Series(np.nan, index=cand.index))
  cand["_peak"] = _num(peak).replace(np.nan, -np.inf).to_numpy()
  order = ["_depth", "_peak", "run"]
  out = [
    str(cand[cand["_mixer"] == m].sort_values(order, ascending=[False, False, True])["run"].iloc[0])
    for m in _order(cand["_mixer"])
  ]
  return out[:max_runs]


def layer_heatmap(
  metrics_run: pd.DataFrame,
  run: pd.Series | dict,
  path,
  *,
  dpi: int = 110,
  cols: Sequence[str] = ("gain_fwd", "amax_fwd_composite"),
) -> str | None:
  """Per-layer metrics of one run over training (x = step, y = mixer layer), one panel per
  logged column of ``cols``; log colour scale centred on 1."""
  mats = [(c, *_layer_matrix(metrics_run, c)) for c in cols]
  mats = [(c, s, m) for c, s, m in mats if s.size and np.isfinite(m).any()]
  if not mats:
    return None
  nl = max(m.shape[0] for _, _, m in mats)
  height = 2.6 + min(nl, 48) * 0.13
  fig, axes = plt.subplots(1, len(mats), figsize=(6.0 * len(mats), height), layout="constrained")
  cmap = plt.get_cmap("RdBu_r").with_extremes(bad="#bbbbbb")
  names = {"gain_fwd": "gain_fwd: RMS(out) / RMS(in)"}
  for ax, (c, steps, mat) in zip(np.atleast_1d(axes), mats):
    mid = (steps[1:] + steps[:-1]) / 2 if steps.size > 1 else steps - 0.5
    edges = np.concatenate([[2 * steps[0] - mid[0]], mid, [2 * steps[-1] - mid[-1]]])
    pos = np.isfinite(mat) & (mat > 0)
    r = max(float(np.max(np.abs(np.log(mat[pos])))) if pos.any() else 0.0, math.log(1.05))
    norm = LogNorm(math.exp(-r), math.exp(r))
    ys = np.arange(mat.shape[0] + 1) - 0.5
    im = ax.pcolormesh(edges, ys, np.ma.masked_where(~pos, mat), cmap=cmap, norm=norm)
    ax.set_facecolor("#bbbbbb")
    fin = mat[np.isfinite(mat)]
    if fin.size and np.ptp(fin) <= 1e-9 * max(1.0, abs(fin[0])):
      msg = f"constant {fin[0]:.4g} at every layer and step"
      ax.text(0.5, 0.5, msg, transform=ax.transAxes, ha="center", bbox=dict(fc="white"))
    cb = fig.colorbar(im, ax=ax, pad=0.02)
    ticks = np.geomspace(norm.vmin, norm.vmax, 5)
    cb.set_ticks(ticks, labels=[f"{t:.3g}" for t in ticks])
    cb.ax.minorticks_off()
    cb.set_label(c + " (log scale)", fontsize=9)
    rows = list(range(0, mat.shape[0], max(1, math.ceil(mat.shape[0] / 16))))
    ax.set_yticks(rows, labels=[f"{'mlp' if i % 2 else 'attn'} {i // 2}" for i in rows], fontsize=8)
    ax.set(ylabel="mixer layer", xlabel="training step")
    ax.set_title(names.get(c, f"{c} of ∏ H_res"), fontsize=10)
  run = dict(run)
  parts = [
    f"{k}={_fmt(run[k])}"
    for k in ("mixer", "depth", "width", "lr", "seed")
    if k in run and run[k] is not None and not (isinstance(run[k], float) and math.isnan(run[k]))
  ]
  fig.suptitle(f"{run.get('run', '')}   ({', '.join(parts)})", fontsize=11)
  return _save(fig, path, dpi)


# =========================================================================== stability maps
def lr_curves(
  runs: pd.DataFrame,
  path,
  *,
  y: str = "eval_loss",
  panel="arm",
  line="depth",
  band: bool | str = True,
  best: bool = False,
  dpi: int = 110,
) -> str | None:
  """Loss against lr (log x), one panel per value of the ``panel`` column(s), one line per value
  of the ``line`` column(s) (darker = larger): the seed mean of min(y, loss_init) (non-finite ->
  loss_init, as the LR sensitivity counts it) and its 95% t band; X where any seed diverged
  (lrmap.diverged), an open circle where one did not train (``runs["failure"]``), a dashed line
  at the task's baseline; ``band=False``: no band (two seeds' is too wide to read),
  ``band="seeds"``: each seed's value as a dot instead (the spread without a t band), ``best``: a
  star at each line's lowest mean. The stability maps' figure (docs/sweeps.md), the report's and
  the transfer study's (muP's figure: the best lr of each size)."""
  from mhc_jax.sweep import lrmap

  panel = [panel] if isinstance(panel, str) else panel
  line = [line] if isinstance(line, str) else line
  d = runs.assign(_lr=_num(runs["lr"]).to_numpy(), _y=_num(runs[y]).to_numpy())
  d = d.assign(diverged=lrmap.diverged(d, y)) if "diverged" not in d else d
  if not len(d := d[np.isfinite(d["_lr"])]):
    return None
  d["_y"] = np.where(np.isfinite(d["_y"]), np.fmin(d["_y"], d["loss_init"]), d["loss_init"])
  panels = stats.split(d, panel)
  lines = sorted((k for k, _ in stats.split(d, line)), key=_rank)
  by_mixer = line[:1] == ["mixer"]  # the report's: a colour per mixer, else shades of one
  colors = mixer_colors(d["mixer"]) if by_mixer else {}
  grid = sorted(d["_lr"].unique())
  fig, axes = _grid(len(panels), 4.4, 3.4)
  for ax, (key, sub) in zip(axes.ravel(), panels):
    for lkey, rows in stats.split(sub, line):
      g, k = rows.groupby("_lr"), lines.index(lkey)
      mid, lo, hi = (np.array([stats.mean_ci(v)[i] for _, v in g["_y"]]) for i in range(3))
      c = colors[str(lkey[0])] if by_mixer else _shade("#1f3b73", k, len(lines))
      x, label = np.array(list(g.groups)), ", ".join(f"{n} {_fmt(v)}" for n, v in zip(line, lkey))
      ax.plot(x, mid, "o-", color=c, ms=3, label=label)
      if band == "seeds":
        ax.plot(rows["_lr"], rows["_y"], ".", color=c, ms=3, alpha=0.55, ls="")
      elif band:
        ax.fill_between(x, lo, hi, color=c, **_BAND)
      ax.plot(x[[np.nanargmin(mid)]], mid[[np.nanargmin(mid)]], "k*", ms=8) if best else None
      bad = g["diverged"].any().to_numpy(bool)
      ax.plot(x[bad], mid[bad], color=c, **_DIV)
      if "failure" in d:
        stuck = g["failure"].agg(lambda f: (f == "no_training").any()).to_numpy(bool)
        ax.plot(x[stuck], mid[stuck], "o", mfc="none", mec="#ff7f0e", ms=8, ls="")
    if "baseline" in d and np.isfinite(base := _num(d["baseline"]).mean()):
      ax.axhline(base, ls="--", lw=0.8, color="#ff7f0e", label="byte-frequency baseline")
    ax.set(xscale="log", title=", ".join(f"{c} {_fmt(v)}" for c, v in zip(panel, key)))
    ax.set_xticks(grid, labels=[f"{v:g}" for v in grid], minor=False)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.tick_params(axis="x", labelrotation=45 if len(grid) > 5 else 0)
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel(f"{y}, min(·, initial loss)") if ax.get_subplotspec().is_first_col() else None
    ax.grid(True, alpha=0.3)
  axes[0, 0].legend(fontsize=8, frameon=False)
  return _save(fig, path, dpi)


def _rank(key: tuple) -> tuple:
  """A group key's sort order: numbers by value (a missing one last), then by text."""
  num = lambda v: isinstance(v, (int, float, np.number)) and not isinstance(v, bool) and v == v
  return tuple((float(v) if num(v) else math.inf, str(v)) for v in key)


def heat_norm(values: np.ndarray, *, log: bool = False, fraction: bool = False):
  """One colour scale for a quantity over every panel it is drawn in: [0, 1] for a fraction, the
  finite (positive, on the log scale) range otherwise; a constant quantity maps to mid-scale."""
  if fraction:
    return Normalize(0.0, 1.0)
  v = np.asarray(values, float)
  v = v[np.isfinite(v) & ((v > 0) if log else True)]
  lo, hi = (v.min(), v.max()) if v.size else (1.0, 1.0)
  if log:
    return LogNorm(lo, hi) if lo < hi else LogNorm(lo / 10, lo * 10)
  return Normalize(lo, hi) if lo < hi else Normalize(lo - 1, lo + 1)


def heatmaps(tab, path, *, x, y, values, panel=None, log=(), dpi: int = 110) -> str | None:
  """Annotated heatmaps of ``tab``: a row of panels per column of ``values``, a panel per value of
  ``panel``, cells ``y`` x ``x``; one colour scale per row (:func:`heat_norm`: log for the
  columns in ``log``, [0, 1] for ``frac_*``) with its colour bar; NaN grey."""
  if not len(tab):
    return None
  keys = list(dict.fromkeys(tab[panel])) if panel else [None]
  w, h = 0.9 * tab[x].nunique() * len(keys) + 3.5, (0.5 * tab[y].nunique() + 1.4) * len(values)
  fig, axes = plt.subplots(len(values), len(keys), figsize=(w, h), **_GRID)
  cmap = plt.get_cmap("viridis").with_extremes(bad="#cccccc")
  for i, col in enumerate(values):
    norm = heat_norm(tab[col], log=col in log, fraction=col.startswith("frac_"))
    for j, key in enumerate(keys):
      sub = tab if key is None else tab[tab[panel] == key]
      m = sub.pivot_table(index=y, columns=x, values=col, aggfunc="first", sort=False, dropna=False)
      v, ax = m.to_numpy(dtype=float), axes[i, j]
      im = ax.imshow(np.ma.masked_invalid(v), cmap=cmap, norm=norm, aspect="auto")
      for (r, c), val in np.ndenumerate(v):  # dark text on the bright end of viridis
        ink = "k" if np.isfinite(val) and norm(val) > 0.6 else "w"
        ax.text(c, r, f"{val:.3g}", ha="center", va="center", fontsize=7, color=ink)
      ax.set_xticks(range(v.shape[1]), [_fmt(c) for c in m.columns])
      ax.set_yticks(range(v.shape[0]), [_fmt(r) for r in m.index])
      ax.set(xlabel=x, ylabel=f"{col}\n{y}" if j == 0 else "")
      ax.set_title(f"{panel} {key}" if panel and i == 0 else "", fontsize=9)
    fig.colorbar(im, ax=list(axes[i]), shrink=0.9)
  return _save(fig, path, dpi)


#: How :func:`edge_chart` marks the first failing lr, by its kind (lrmap.failure).
_FAIL_MARKS = {
  "diverged": dict(marker="X", color="#d62728", label="diverged"),
  "no_training": dict(marker="o", mfc="none", color="#ff7f0e", label="did not train"),
  "both": dict(marker="P", color="#8c564b", label="both"),
}


def edge_chart(lr_tab: pd.DataFrame, path, *, families: dict, dpi: int = 110) -> str | None:
  """The stability map of ``lr_tab`` (lrmap.lr_table): a panel per depth, a row per arm grouped
  by ``families`` (name -> arms): a bar from the best lr (dot) to the largest working lr, the
  first failing lr marked by its kind (an arrow where no lr on the grid failed); last panel, LR
  sensitivity with its 95% interval, a colour per depth."""
  if not len(lr_tab):
    return None
  arms = [a for fam in families.values() for a in fam if a in set(lr_tab["arm"])]
  arms += [a for a in dict.fromkeys(lr_tab["arm"]) if a not in arms]
  depths, row = sorted(lr_tab["depth"].unique()), {a: i for i, a in enumerate(arms)}
  size = (3 * len(depths) + 3.5, 0.32 * len(arms) + 1.6)
  fig, axes = plt.subplots(1, len(depths) + 1, figsize=size, **_GRID, sharey=True)
  cols = ["best_lr", "largest_working_lr", "first_failing_lr"]
  low, top = np.nanmin(lr_tab[cols].to_numpy(float)), np.nanmax(lr_tab[cols].to_numpy(float))
  for ax, d in zip(axes[0], depths):
    for r in lr_tab[lr_tab["depth"] == d].itertuples():
      y, bar = row[r.arm], [r.best_lr, r.largest_working_lr]
      ax.plot(bar, [y, y], color="#1f77b4", lw=3, solid_capstyle="butt")
      dead = not np.isfinite(r.largest_working_lr)  # the best lr's own runs failed
      ax.plot([r.best_lr], [y], "o", color="#999999" if dead else "#1f77b4", ms=4)
      if r.first_failure in _FAIL_MARKS:
        ax.plot([r.first_failing_lr], [y], ls="", ms=7, **_FAIL_MARKS[r.first_failure])
      elif np.isfinite(r.largest_working_lr):  # nothing failed above the best lr
        ax.plot([r.largest_working_lr * 1.6], [y], ">", color="#2ca02c", ms=6)
    ax.set(xscale="log", title=f"depth {d}", xlabel="learning rate")
    ax.set_xlim(low / 2, top * 3)  # one range in every depth's panel
    _plain_log_ticks(ax)
  sens = axes[0][-1]
  for k, d in enumerate(depths):
    g = lr_tab[lr_tab["depth"] == d]
    y = g["arm"].map(row).to_numpy() + (k - (len(depths) - 1) / 2) * 0.22
    s, lo, hi = (g[f"lr_sensitivity{c}"] for c in ("", "_ci_lo", "_ci_hi"))
    err = np.abs(np.asarray([s - lo, hi - s], float))
    sens.errorbar(s, y, xerr=err, fmt="o", ms=3, label=f"depth {d}")
  sens.set(title="LR sensitivity (nats)", xlabel="mean excess loss over the grid")
  sens.legend(fontsize=7, loc="lower right")
  first = axes[0][0]
  first.set_yticks(range(len(arms)), arms)
  first.invert_yaxis()
  start = 0
  for name, fam in families.items():
    n = sum(a in row for a in fam)
    if n:
      for ax in axes[0]:
        ax.axhline(start - 0.5, color="#999999", lw=0.6)
      tr = first.get_yaxis_transform()
      first.text(0.01, start - 0.45, name, transform=tr, fontsize=7, va="top", color="#555555")
      start += n
  handles = [Line2D([], [], ls="", ms=7, **m) for m in _FAIL_MARKS.values()]
  handles += [Line2D([], [], ls="", marker=">", color="#2ca02c", label="above the grid")]
  handles += [
    Line2D([], [], color="#1f77b4", lw=3, marker="o", ms=4, label="best .. largest working lr"),
    Line2D([], [], ls="", marker="o", color="#999999", ms=4, label="best lr, failed too"),
  ]
  fig.legend(
    handles=handles, loc="outside lower center", ncols=6, fontsize=8, title="first failing lr"
  )
  return _save(fig, path, dpi)
