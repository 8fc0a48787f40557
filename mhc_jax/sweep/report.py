"""Sweep report: one summary row per run, intervals over seeds, paired differences between mixers,
LR sensitivity, one computed sentence, the figures, and ``report/summary.md`` with the CSVs.

What each file and column holds: docs/sweeps.md ("The report"); the intervals and the sentence's
rules: docs/statistics.md. Paths go through :mod:`mhc_jax.storage`, so ``gs://`` works.
"""

from __future__ import annotations

import os

import numpy as np
import pandas as pd

from mhc_jax import logs, storage
from mhc_jax.sweep import lrmap, stats
from mhc_jax.sweep.lrmap import best_lr_rows, has_lr_axis, lr_sensitivity_table
from mhc_jax.sweep.report_figures import _figures
from mhc_jax.sweep.report_tables import (
  _fmt,
  _groups_display,
  _paired_display,
  groups_table,
  md_table,
  paired_table,
)
from mhc_jax.sweep.sentences import finding
from mhc_jax.sweep.summary import (
  _CONFIG_KEYS,
  _EVAL_FIELDS,
  COLUMN_DOCS,
  LOG_SCALE,
  eval_columns,
  summary_table,
)

#: What the report's callers (cli, runner, notebook 02, the map command) import from here; the
#: rest lives in summary, report_tables, sentences, report_figures and lrmap beside it.
__all__ = ["COLUMN_DOCS", "LOG_SCALE", "_EVAL_FIELDS", "eval_columns", "finding", "groups_table"]
__all__ += ["md_table", "paired_table", "screen", "summary_table", "write_report"]
#: Shown in summary.md only where some run has them (summary.csv keeps them all).
OPTIONAL_COLUMNS = ("attn_logit_max", "out_logit_max", "logz_absmax", *_EVAL_FIELDS)
#: The columns a finished sweep prints after the run's axes (summary.csv has every column).
SCREEN_COLUMNS = """status eval_loss kl_bits spike_count amax_fwd_composite_max
amax_fwd_composite_tok_mean_max""".split()
#: What the two kinds of composite gain mean (summary.md and notebook 02).
COMPOSITE_SENTENCES = {
  "token-averaged": "Token-averaged composite (amax_*_composite): the Amax gain of the product over "
  "layers of the token-mean H_res, which is what the mHC paper plots; averaging the matrices first "
  "cancels token-to-token variation, so it can read near 1 while individual tokens' products are not.",
  "per-token": "Per-token composite (amax_*_composite_tok_mean / _tok_max): each sampled token's own "
  "product of its H_res across all layers (mean and worst over the sample), i.e. what one token's "
  "signal actually passes through, which token averaging can hide.",
}


def screen(sweep_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> str:
  """What a finished sweep prints: the runs' axes with the :data:`SCREEN_COLUMNS` some run has,
  the sentence, and where the full table is (``out_dir``, default ``SWEEP_DIR/report``)."""
  table = summary_table(sweep_dir)
  ids = [c for c in table.attrs["id_columns"] if c != "run" and c in table.attrs["axes"].values()]
  shown = [c for c in SCREEN_COLUMNS if table[c].notna().any() or c == "status"]
  out = storage.path(out_dir or storage.path(sweep_dir) / "report") / "summary.csv"
  return (
    md_table(table[(ids or ["run"]) + shown])
    + finding(table)
    + f"\nEvery column, with its definition: {out} and summary.md beside it."
  )


def _data_notes(table: pd.DataFrame) -> list[str]:
  """What summary.md says about runs without metrics and non-finite losses."""
  notes = [
    f"Run {r['run']} ({r['status']}) has no metrics yet: listed in the table, not plotted."
    for _, r in table[table["steps"] == 0].iterrows()
  ]
  for _, r in table[(table["steps"] > 0) & ~np.isfinite(table["final_loss"])].iterrows():
    notes.append(
      f"Run {r['run']}: final_loss is {_fmt(r['final_loss'])} ({r['note']}); curves stop at the "
      "last finite point."
    )
  return notes


def write_report(
  sweep_dir: str | os.PathLike,
  out_dir: str | os.PathLike | None = None,
  *,
  max_heatmaps: int = 6,
  dpi: int = 110,
) -> dict[str, str]:
  """Write summary.md, the CSVs and the PNGs into ``out_dir`` (default ``<sweep_dir>/report``;
  docs/sweeps.md); ``{name: path}`` of every file written."""
  sweep_dir = storage.path(sweep_dir)
  out = storage.path(out_dir) if out_dir is not None else sweep_dir / "report"
  table = summary_table(sweep_dir)
  out.mkdir(parents=True, exist_ok=True)
  tabs = {"summary": table, "lr_sensitivity": lr_sensitivity_table(table)}
  tabs |= {"groups": groups_table(table), "paired": paired_table(table)}
  tabs |= {"paired_best_lr": paired_table(best_lr_rows(table))} if has_lr_axis(table) else {}
  paths: dict[str, str] = {}
  for name, frame in tabs.items():
    if name in ("summary", "groups") or len(frame):
      storage.write_text_atomic(out / f"{name}.csv", frame.to_csv(index=False, na_rep="NaN"))
      paths[f"{name}_csv"] = str(out / f"{name}.csv")
  figures, missing = _figures(table, out, paths, max_heatmaps, dpi)
  missing += _data_notes(table)
  if not len(tabs["paired"]):
    missing.append("No paired differences: fewer than two mixers have results.")
  storage.write_text_atomic(out / "summary.md", _page(sweep_dir, tabs, figures, paths, missing))
  paths["summary_md"] = str(out / "summary.md")
  return paths


def _best_lr_text(table) -> str:
  return (
    "With an lr axis, the sentence above compares the arms at each fixed lr. At each arm's own "
    f"best lr ({lrmap.RULE}; paired_best_lr.csv): **{finding(best_lr_rows(table))}**\n"
  )


def _page(sweep_dir, tabs, figures, paths, missing) -> str:
  """summary.md: the sentence, the tables, the notes, the figures, the column definitions."""
  table, groups, paired = tabs["summary"], tabs["groups"], tabs["paired"]
  status = ", ".join(f"{v} {k}" for k, v in table["status"].value_counts().items()) or "no runs"
  axes = table.attrs["axes"]
  axes_text = ", ".join(f"{c} ({k})" for k, c in axes.items()) or "none"
  md = [
    f"# Sweep report: {logs.dir_name(sweep_dir)}\n",
    f"{len(table)} runs ({status}). Sweep axes: {axes_text}.\n",
    f"**{finding(table)}**\n",
    *([_best_lr_text(table)] if "paired_best_lr" in tabs else []),
    "## Runs\n",
    "Composite gains, side by side: " + " ".join(COMPOSITE_SENTENCES.values()) + "\n",
    md_table(table.drop(columns=[c for c in OPTIONAL_COLUMNS if table[c].isna().all()])),
  ]
  n_seeds = int(groups["n_seeds"].max()) if len(groups) else 0
  if n_seeds > 1 or len(paired):
    md += [
      "## Groups over seeds\n",
      f"Runs that differ only in the seed ({len(groups)} groups, up to {n_seeds} seeds each): "
      f"mean [95% CI] over seeds, {stats.METHOD}; (gmean) columns on the {stats.LOG_METHOD}. "
      "The held-out loss (eval_loss) is the primary endpoint. groups.csv has every metric "
      "(docs/statistics.md).\n",
      md_table(_groups_display(groups)),
    ]
  if len(paired):
    shown = _paired_display(paired)
    md += [
      "## Paired differences between mixers\n",
      "Runs of two mixers that share a seed (and every other axis) are paired: Δ = mixer_b - "
      "mixer_a, ratio = mixer_b / mixer_a (gains, gradient norms, stream spreads), mean [95% "
      "Student t interval] over the n_pairs pairs; * marks an interval that clears 0 (a ratio: 1) "
      f"by more than rounding ({stats.SIGNIFICANCE_RTOL:g} of the scale). paired.csv has every "
      "metric.\n",
      md_table(shown) if len(shown) else "_(no pairs with finite values)_\n",
    ]
  if len(lr_tab := tabs["lr_sensitivity"]):
    md += [
      "## Learning-rate sensitivity\n",
      "Wortsman et al.'s LR sensitivity: mean over the lr grid of min(final_loss, loss_init) - "
      "its minimum; lower is more robust to the choice of lr.\n",
      md_table(lr_tab),
    ]
  md += ["## Missing or non-finite\n", *(f"- {m}" for m in missing), ""] if missing else []
  md += ["## Figures\n"]
  for keys, title, caption in figures:
    imgs = " ".join(f"![{title}]({storage.path(paths[k]).name})" for k in keys)
    md += [f"### {title}\n", imgs + "\n", caption + "\n"]
  context = [c for c in table.attrs["id_columns"][1:] if c not in axes.values()]
  defs = {"run": "run name in the manifest", **{c: f"sweep axis {k}" for k, c in axes.items()}}
  defs |= {c: f"{_CONFIG_KEYS[c]} from the run's config.yaml (not a sweep axis)" for c in context}
  md += ["## Column definitions\n", *(f"- `{k}`: {v}" for k, v in {**defs, **COLUMN_DOCS}.items())]
  return "\n".join(md) + "\n"
