"""The report's tables over seeds: groups.csv (each metric's mean and 95% interval per group of
runs that differ only in the seed), paired.csv (differences and ratios between mixers or arms that
share a seed) and their Markdown (docs/sweeps.md, "The report"; docs/statistics.md).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from mhc_jax.sweep import stats
from mhc_jax.sweep.summary import GROUP_METRICS, LOG_SCALE, _id_columns

#: The metrics shown in the groups and paired tables of summary.md, led by the primary endpoint.
SHOWN_METRICS = """eval_loss final_loss kl_bits spike_count max_grad_norm
amax_fwd_composite_tok_mean_max amax_bwd_composite_tok_mean_max amax_fwd_composite_max
amax_bwd_composite_max stream_spread_last stream_spread_mean""".split()
SHOWN_METRICS += ["h_res_diag_mean", "h_res_shift_mean"]  # does the mixing move (issue 41)
_MIXER_ORDER = ("residual", "hc", "mhc", "mhc_lite")


def _mixer_order(values) -> list:
  """Mixers (or arms, "mhc (stream_init=symmetric)") in the order residual, hc, mhc, mhc_lite,
  then by name; an arm right after its mixer."""

  def key(name: str) -> tuple:
    base = name.split(" (")[0]
    known = _MIXER_ORDER.index(base) if base in _MIXER_ORDER else len(_MIXER_ORDER)
    return known, base, name != base, name

  return sorted(dict.fromkeys(str(v) for v in values if _is_set(v)), key=key)


def _option_columns(df: pd.DataFrame) -> list[str]:
  """The axis columns that configure the mixer (``model.mixer_options.*``): with the mixer they
  name the *arm* that paired comparisons and the sentence compare."""
  axes = df.attrs.get("axes") or {}
  return [c for k, c in axes.items() if k.startswith("model.mixer_options.") and c in df.columns]


def arm_labels(df: pd.DataFrame, options: list[str]) -> pd.Series:
  """Each run's mixer with its set option columns: "mhc", "mhc (stream_init=symmetric)"."""
  extra = [[f"{c}={r[c]}" for c in options if _is_set(r[c])] for _, r in df.iterrows()]
  labels = [f"{m} ({', '.join(e)})" if e else str(m) for m, e in zip(df["mixer"], extra)]
  return pd.Series(labels, index=df.index, dtype=object)


def _is_set(v) -> bool:
  return not (v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)))


def group_columns(df: pd.DataFrame) -> list[str]:
  """The columns that define a group of seeds: every identifying column but ``run`` and ``seed``."""
  return [c for c in _id_columns(df) if c not in ("run", "seed")]


def groups_table(df: pd.DataFrame) -> pd.DataFrame:
  """groups.csv: one row per group of runs that differ only in the seed, each metric's mean (or
  geometric mean) and 95% interval over seeds (docs/statistics.md)."""
  gcols = group_columns(df)
  cols = [m for m in GROUP_METRICS if m in df.columns]
  unit = "seed" if "seed" in df.columns else None
  stat_cols = [c for m in cols for c in (stats.centre(m, LOG_SCALE), f"{m}_ci_lo", f"{m}_ci_hi")]
  parts = []
  for key, g in stats.split(df, gcols):  # a group without metrics: n_seeds 0, NaNs
    row = stats.group_stats(g[g["steps"] > 0], [], cols, log_metrics=LOG_SCALE, unit_col=unit)
    parts.append(row.assign(**dict(zip(gcols, key)), n_runs=len(g)))
  all_cols = [*gcols, "n_runs", "n_seeds", "seeds", *stat_cols]
  out = pd.concat(parts, ignore_index=True)[all_cols] if parts else pd.DataFrame(columns=all_cols)
  for c in gcols:
    out[c] = out[c].astype("Int64") if str(df[c].dtype) == "Int64" else out[c]
  out.attrs = {"group_columns": gcols, "metrics": cols}
  return out


def paired_table(df: pd.DataFrame) -> pd.DataFrame:
  """paired.csv: differences (ratios on the log scale) between mixers (arms) that share a seed,
  within each group of the other axes (docs/statistics.md); empty under two mixers."""
  options = _option_columns(df)
  context = [c for c in group_columns(df) if c != "mixer" and c not in options]
  cols = [*context, "mixer_a", "mixer_b", *stats.PAIRED_COLUMNS[2:]]
  if "mixer" not in df.columns:
    return pd.DataFrame(columns=cols)
  done = df[df["steps"] > 0]
  done = done.assign(mixer=arm_labels(done, options))
  if done["mixer"].nunique() < 2:
    return pd.DataFrame(columns=cols)
  ms = [m for m in GROUP_METRICS if m in df.columns]
  order = _mixer_order(done["mixer"])
  out = stats.paired_stats(done, "mixer", context, ms, log_metrics=LOG_SCALE, order=order)
  out = out.rename(columns={"a": "mixer_a", "b": "mixer_b"})[cols]
  out.attrs = {"context_columns": context}
  return out


def _ci_text(mean: float, lo: float, hi: float) -> str:
  ok = math.isfinite(lo) and math.isfinite(hi)
  return f"{_fmt(mean)} [{_fmt(lo)}, {_fmt(hi)}]" if ok else _fmt(mean)


def _groups_display(groups: pd.DataFrame, shown=SHOWN_METRICS, log=LOG_SCALE) -> pd.DataFrame:
  """The groups with "mean [ci_lo, ci_hi]" cells for the ``shown`` metrics (a metric's centre
  column is :func:`stats.centre`'s, or the metric's own name as in the studies' arm tables)."""
  out = groups[[*groups.attrs.get("group_columns", []), "n_seeds"]].copy()
  for m in shown:
    mid = stats.centre(m, log) if stats.centre(m, log) in groups.columns else m
    if mid in groups.columns and groups[mid].notna().any():
      cells = zip(groups[mid], groups[f"{m}_ci_lo"], groups[f"{m}_ci_hi"])
      out[f"{m} (gmean)" if m in log else m] = [_ci_text(*c) for c in cells]
  return out


def _paired_display(paired: pd.DataFrame, shown=SHOWN_METRICS, log=LOG_SCALE) -> pd.DataFrame:
  """One row per (context, pair), a cell per ``shown`` metric: "Δ <metric>" (b - a) or "ratio
  <metric>" (b / a), mean [95% CI], with * where ``significant`` (pairs: mixer_a/mixer_b, or
  a/b as stats.paired_stats names them)."""
  pair = ["mixer_a", "mixer_b"] if "mixer_a" in paired.columns else ["a", "b"]
  keys = [*paired.attrs.get("context_columns", []), *pair]
  d = paired[paired["metric"].isin(shown)]
  cell = {m: ("ratio", "ratio") if m in log else ("Δ", "diff") for m in shown}
  shown = [m for m in shown if d.loc[d["metric"] == m, f"{cell[m][1]}_mean"].notna().any()]
  rows = []
  for key, g in stats.split(d, keys) if len(d) else []:
    row = {**dict(zip(keys, key)), "n_pairs": int(g["n_pairs"].max())}
    by = g.set_index("metric")
    for m in shown:
      word, col = cell[m]
      row[f"{word} {m}"] = ""
      if m in by.index:
        ci = (float(by.loc[m, f"{col}_{k}"]) for k in ("mean", "ci_lo", "ci_hi"))
        row[f"{word} {m}"] = _ci_text(*ci) + (" *" if bool(by.loc[m, "significant"]) else "")
    rows.append(row)
  return pd.DataFrame(rows, columns=[*keys, "n_pairs", *(f"{cell[m][0]} {m}" for m in shown)])


def _fmt(v: Any) -> str:
  if v is pd.NA:
    return "NA"
  if v is None or (isinstance(v, float) and math.isnan(v)):
    return "NaN"
  if isinstance(v, (bool, np.bool_)):
    return str(bool(v))
  if isinstance(v, (int, np.integer)):
    return str(int(v))
  if isinstance(v, (float, np.floating)):
    return f"{float(v):.4g}" if math.isfinite(v) else ("inf" if v > 0 else "-inf")
  return str(v)


def md_table(df: pd.DataFrame) -> str:
  """A Markdown table; the cells of metrics a run's logs lack (``attrs["not_logged"]``): n/a."""
  if df.empty:
    return "_(no rows)_\n"
  esc = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
  nl = df.attrs.get("not_logged") or {}
  lines = ["| " + " | ".join(esc(c) for c in df.columns) + " |", "|" + " --- |" * df.shape[1]]
  for _, r in df.iterrows():
    absent = set(nl.get(r["run"], ())) if isinstance(r.get("run"), str) else set()
    cells = [esc("n/a" if c in absent else _fmt(v)) for c, v in r.items()]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"
