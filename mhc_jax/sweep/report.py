"""Sweep report: one summary row per run, intervals over seeds, paired differences between mixers,
LR sensitivity, one computed sentence, the figures, and ``report/summary.md`` with the CSVs.

What each file and column holds: docs/sweeps.md ("The report"); the intervals and the sentence's
rules: docs/statistics.md. Paths go through :mod:`mhc_jax.storage`, so ``gs://`` works.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
import pandas as pd

from mhc_jax import logs, metrics, rundir, storage
from mhc_jax.errors import UsageError
from mhc_jax.logs import flatten_dict, load_events, load_run, read_jsonl
from mhc_jax.spikes import lr_sensitivity
from mhc_jax.storage import Path
from mhc_jax.sweep import lrmap, stats

#: Fraction of the logged losses averaged into ``final_loss`` (at least one value).
FINAL_FRACTION = 0.05
#: eval.json -> report column: (section, probe or None, field).
_EVAL_FIELDS = {
  "eval_kl_bits": ("metrics", None, "kl_bits"),
  "probe_key_ratio": ("probes", "key_orthogonality", "ratio_to_random"),
  "probe_attn_on_target": ("probes", "qk_alignment", "attn_on_target"),
  "probe_qk_slope": ("probes", "qk_alignment", "slope"),
  "probe_pc1_entropy": ("probes", "pca_entropy", "corr_pc1_entropy"),
}
#: Logs with the composite gains but without these (written before them) are not read here.
CURRENT = ("amax_fwd_composite_tok_mean", "amin_fwd_composite", "amax_fwd_suffix")
#: The mhc_jax that reads such logs (the summary then shows their cells as n/a).
READS_OLD_LOGS = "mhc_jax 0.1.0 at commit 3829cbd (git checkout 3829cbd)"
#: The definitions of the columns not read from metrics.jsonl through the registry.
_OTHER_DOCS = {
  "status": "the manifest's status (done | failed | running | pending); summary.json's where the "
  "manifest has none or says running while summary.json says the run ended (a --parallel sweep "
  "refreshes its manifest when every job is collected)",
  "steps": "last logged step in metrics.jsonl (0 when nothing is logged)",
  "spike_count": "events of kind spike/* in events.jsonl (a step where loss and grad norm both "
  "spike counts twice; mhc_jax/spikes.py); NA for a run with no metrics",
  "eval_kl_bits": "eval.json (mhc-jax eval, the sweep's `eval: N`): KL(posterior || model), bits "
  "per position, at the last checkpoint; NaN without eval.json",
  "probe_key_ratio": "eval.json: mean |cos| between hypothesis-grouped attention keys over that of "
  "random directions (1 = chance, lower = more orthogonal)",
  "probe_attn_on_target": "eval.json: attention the retrieval head puts on the answer's position",
  "probe_qk_slope": "eval.json: slope of the retrieval head's query-key cosine against evidence",
  "probe_pc1_entropy": "eval.json: |corr(PC1 of the last block's stream, posterior entropy)|",
  "nonfinite": "last logged nonfinite counter; where never logged, the number of logged "
  "non-finite losses; NA for a run with no metrics",
  "note": "what is missing or went wrong: no metrics, first non-finite loss, divergence event, "
  "summary.json status",
}
#: Column order of the summary table (registry columns not named here follow the named ones).
_ORDER = """status steps loss_init eval_loss final_loss min_loss spike_count spike_score
max_grad_norm amax_fwd_composite_max amax_fwd_composite_tok_mean_max amax_fwd_composite_tok_max_max
amax_bwd_composite_max amax_bwd_composite_tok_mean_max amax_bwd_composite_tok_max_max
amin_fwd_composite_min amin_bwd_composite_min amax_fwd_composite_max_all_layers
amax_bwd_composite_max_all_layers amax_fwd_suffix_max_all_layers amax_bwd_suffix_max_all_layers
growth_exponent stream_spread_last stream_spread_mean stream_spread_min kl_bits attn_logit_max
out_logit_max logz_absmax""".split()


def _doc(m: metrics.Metric, col: str, how: str) -> str:
  depth = " (whole depth)" if m.shape == "layer" and how in ("max", "min") else ""
  return f"`{m.name}`{depth}, {metrics.REDUCTIONS[how]}: {m.meaning}"


_DOCS = {c: _doc(m, c, how) for m in metrics.METRICS for c, how in m.summary.items()}
_ALL = [*_ORDER, *_DOCS, *_EVAL_FIELDS, "nonfinite", "note"]
#: The metric columns of :func:`summary_table`, in order, with their definitions.
COLUMN_DOCS = {c: {**_OTHER_DOCS, **_DOCS}[c] for c in dict.fromkeys(_ALL)}
COLUMNS = list(COLUMN_DOCS)
#: Numeric columns summarised over seeds (groups.csv, paired.csv).
GROUP_METRICS = [c for c in COLUMNS if c not in ("status", "note", "steps")]
#: Columns summarised on the log scale (geometric means, ratios; docs/statistics.md).
LOG_SCALE = metrics.log_columns()
#: Shown in summary.md only where some run has them (summary.csv keeps them all).
OPTIONAL_COLUMNS = ("attn_logit_max", "out_logit_max", "logz_absmax", *_EVAL_FIELDS)
#: The metrics shown in the groups and paired tables of summary.md, led by the primary endpoint.
SHOWN_METRICS = """eval_loss final_loss kl_bits spike_count max_grad_norm
amax_fwd_composite_tok_mean_max amax_bwd_composite_tok_mean_max amax_fwd_composite_max
amax_bwd_composite_max stream_spread_last stream_spread_mean""".split()
SHOWN_METRICS += ["h_res_diag_mean", "h_res_shift_mean"]  # does the mixing move (issue 41)
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
# Where the config holds each role (a sweep axis whose last key part is the role names it too).
_CONFIG_KEYS = {"mixer": "model.mixer", "depth": "model.depth", "width": "model.width"}
_CONFIG_KEYS |= {"lr": "optim.lr", "seed": "train.seed"}
_MIXER_ORDER = ("residual", "hc", "mhc", "mhc_lite")


# =========================================================================== one run
def _merged(path: Path) -> list[dict[str, Any]]:
  """metrics.jsonl records merged per step (later keys win), flattened to ``eval/x`` keys."""
  by_step: dict[Any, dict[str, Any]] = {}
  for rec in read_jsonl(path) if path.exists() else []:
    if isinstance(rec, dict) and rec.get("step") is not None:
      flat = flatten_dict(rec, sep="/").items()
      by_step.setdefault(rec["step"], {}).update({k.replace(".", "/"): v for k, v in flat})
  return [by_step[s] for s in sorted(by_step)]


def _scalars(records: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps, float values) of the records that have ``key`` (None -> NaN)."""
  steps, vals = [], []
  for r in records:
    if key in r and (r[key] is None or isinstance(r[key], (int, float))):
      steps.append(r["step"])
      vals.append(math.nan if r[key] is None else float(r[key]))
  return np.asarray(steps), np.asarray(vals, dtype=np.float64)


def _layer_lists(records: list[dict[str, Any]], key: str) -> list[np.ndarray]:
  lists = [r[key] for r in records if isinstance(r.get(key), list) and r[key]]
  return [np.asarray([math.nan if x is None else x for x in v], dtype=np.float64) for v in lists]


def _nanmax(a: np.ndarray) -> float:
  return float(np.nanmax(a)) if a.size and not np.isnan(a).all() else math.nan


def _reduce(records: list[dict[str, Any]], m: metrics.Metric, how: str, warmup: int) -> float:
  """Metric ``m`` reduced over training as ``how`` says (:data:`mhc_jax.metrics.REDUCTIONS`)."""
  if m.shape == "scalar":
    steps, v = _scalars(records, m.name)
    v = v[steps >= warmup] if how == "max_after_warmup" else v
  else:
    lists = _layer_lists(records, m.name)
    at_last_step = {"last_layer": lambda x: x[-1], "layer_mean": np.mean, "layer_min": np.min}
    if how in at_last_step:
      return float(at_last_step[how](lists[-1])) if lists else math.nan
    if how == "max_all_layers":
      return _nanmax(np.concatenate(lists)) if lists else math.nan
    v = np.array([x[-1] for x in lists])  # the whole-depth value at each diagnostics step
  if not v.size:
    return math.nan
  if how in ("first", "last"):
    return float(v[0 if how == "first" else -1])
  if how == "final":  # the mean of the last ceil(n/20) values (at least one)
    k = max(1, -(-len(v) // round(1 / FINAL_FRACTION)))
    with np.errstate(invalid="ignore"):
      return float(np.mean(v[-k:]))
  return -_nanmax(-v) if how == "min" else _nanmax(np.abs(v) if how == "absmax" else v)


def summarize_run(run_dir: str | os.PathLike) -> dict[str, Any]:
  """One run directory -> ``{column: value}`` for the :data:`COLUMN_DOCS` columns."""
  return _summarize(storage.path(run_dir))[0]


def _summarize(run_dir: Path) -> tuple[dict[str, Any], list[str]]:
  """(:func:`summarize_run`'s dict, the columns of metrics its mixer has not: n/a)."""
  records = _merged(run_dir / "metrics.jsonl")
  events = load_events(run_dir)
  kinds = events["kind"].astype(str)
  status = logs.read_json(run_dir / "summary.json").get("status")
  loss_steps, losses = _scalars(records, "loss")
  warmup = logs.read_config(run_dir).get("optim.warmup_steps") or 0
  out: dict[str, Any] = {"status": status, "steps": int(records[-1]["step"]) if records else 0}
  out["spike_count"] = int(kinds.str.startswith("spike/").sum())
  for m in metrics.METRICS:
    out.update({col: _reduce(records, m, how, warmup) for col, how in m.summary.items()})
  out.update(eval_columns(run_dir))
  nf = _scalars(records, "nonfinite")[1]
  bad = np.flatnonzero(~np.isfinite(losses))
  out["nonfinite"] = int(nf[-1]) if len(nf) and np.isfinite(nf[-1]) else bad.size
  missing = []
  notes = [] if len(losses) else ["no loss logged" if records else "no metrics logged yet"]
  if bad.size:
    notes.append(f"loss non-finite from step {int(loss_steps[bad[0]])} ({bad.size} logged steps)")
  for _, e in events[kinds == "divergence"].head(1).iterrows():
    why = f" ({e['reason']})" if isinstance(e.get("reason"), str) else ""
    notes.append(f"divergence at step {int(e['step'])}{why}")
  if records and not _layer_lists(records, "amax_fwd_composite"):
    if _layer_lists(records, "gain_fwd"):  # diagnostics, but a mixer without H_res
      notes.append("no H_res: composite gains n/a")
      missing = [c for c in COLUMNS if c.startswith(("amax_", "amin_", "stream_spread"))]
    else:
      notes.append("no per-layer diagnostics")
  elif records and not all(_layer_lists(records, name) for name in CURRENT):
    raise UsageError(
      f"{run_dir}: its logs predate the per-token composite, amin and suffix metrics"
      f" ({', '.join(CURRENT)}); this mhc_jax does not read them: {READS_OLD_LOGS} does"
    )
  elif records and not _layer_lists(records, "stream_spread"):
    notes.append("not logged: stream spread")
  if (
    records
    and _layer_lists(records, "amax_fwd_composite")
    and not _layer_lists(records, "h_res_diag")
  ):
    notes.append("not logged: H_res movement (h_res_*)")
  if status not in (None, "done"):
    notes.append(f"summary.json: {status}")
  out["note"] = "; ".join(notes)
  return {k: out[k] for k in COLUMNS}, missing


def eval_columns(run_dir: str | os.PathLike) -> dict[str, float]:
  """The ``eval_*`` / ``probe_*`` columns from ``run_dir/eval.json`` (NaN where absent)."""
  ev = logs.read_json(storage.path(run_dir) / "eval.json")
  out = {}
  for col, (section, probe, field) in _EVAL_FIELDS.items():
    d = ev.get(section)
    d = d.get(probe) if probe and isinstance(d, dict) else d
    v = d.get(field) if isinstance(d, dict) else None
    v = float(v) if isinstance(v, (int, float)) else math.nan
    out[col] = abs(v) if col == "probe_pc1_entropy" else v
  return out


# =========================================================================== a sweep
def _axis_columns(keys: list[str]) -> dict[str, str]:
  """Dotted override keys -> short column names (canonical role names, else the last part;
  the full key where that would collide with another axis or a table column)."""
  cols: dict[str, str] = {}
  for role, key in _CONFIG_KEYS.items():  # roles first, preferring the standard config key
    cands = [k for k in keys if k.rsplit(".", 1)[-1] == role]
    if cands:
      cols[key if key in cands else cands[0]] = role
  used = {"run", *COLUMNS, *cols.values()}
  lasts = [k.rsplit(".", 1)[-1] for k in keys if k not in cols]
  for k in keys:
    if k not in cols:
      short = k.rsplit(".", 1)[-1]
      cols[k] = short if short not in used and lasts.count(short) == 1 else k
      used.add(cols[k])
  return {k: cols[k] for k in keys}


def _cell(v: Any) -> Any:
  return json.dumps(v) if isinstance(v, (list, dict, tuple)) else v


def study_cli(argv, doc: str, here, flags=()) -> tuple[Path, Path, Any]:
  """A study analysis's command line, ``SOURCE [--out DIR]`` (and ``flags``: ``(name, kwargs)``
  pairs): (source, the output folder, made: beside a runs.csv, else ``here``; the arguments)."""
  import argparse

  ap = argparse.ArgumentParser(description=doc.splitlines()[0])
  ap.add_argument("source", help="a sweep directory, or a runs.csv to recompute from")
  ap.add_argument("--out", default=None)
  for name, kw in flags:
    ap.add_argument(name, **kw)
  args = ap.parse_args(argv)
  src = Path(args.source)
  out = Path(args.out or (src.parent if src.suffix == ".csv" else here))
  out.mkdir(parents=True, exist_ok=True)
  return src, out, args


def save_runs(runs: pd.DataFrame, src: Path, out: Path, changed: bool = False) -> None:
  """Write ``out/runs.csv``, unless that file is the source being recomputed from and nothing
  was added to it (a CSV round trip rewrites floats' last digits)."""
  if changed or (out / "runs.csv").resolve() != src.resolve():
    runs.to_csv(out / "runs.csv", index=False)


def study_runs(source) -> pd.DataFrame:
  """A stability study's runs (``lrmap``'s rows): its committed runs.csv (to recompute from),
  or :func:`lrmap.runs_table` of a sweep directory's :func:`summary_table` with each run's
  :func:`task_baseline`."""
  if str(source).endswith(".csv"):
    return pd.read_csv(source)
  table = summary_table(source)
  dirs = table.attrs["run_dirs"]
  return lrmap.runs_table(table.assign(baseline=[task_baseline(dirs[r]) for r in table["run"]]))


def task_baseline(run_dir) -> float:
  """The held-out loss of the run's task's trivial predictor on the batches its evaluation reads
  (the data source's ``baseline``, from config.yaml; NaN for a task that reports none)."""
  c = logs.read_config(run_dir)
  opts = {k.split(".", 2)[2]: v for k, v in c.items() if k.startswith("data.options.")}
  keys = ("data.task", "data.seq_len", "data.batch_size", "data.eval_batches", "train.seed")
  return baseline(*(c.get(k) for k in keys), **opts)


def baseline(task, seq_len, batch_size, eval_batches, seed, **options) -> float:
  """:func:`task_baseline` from the data settings; text tasks only (else NaN); cached."""
  key = (task, seq_len, seed, *sorted(options.items()))
  if key not in _BASELINES:
    from mhc_jax.data import make_source

    src = make_source(task, seq_len=seq_len, seed=seed, **options) if task == "text" else None
    _BASELINES[key] = src.baseline if src else None
  f = _BASELINES[key]
  return f(batch_size, eval_batches) if f else math.nan


def with_baseline(runs: pd.DataFrame, **data) -> pd.DataFrame:
  """A runs.csv written before the ``baseline`` column existed, with it (from each row's seed
  and the study's text ``data`` settings: seq_len, batch_size, eval_batches) and ``failure``."""
  per_seed = {s: baseline("text", seed=int(s), **data) for s in runs["seed"].unique()}
  runs = runs.assign(baseline=runs["seed"].map(per_seed))
  return runs.assign(failure=lrmap.failure(runs))


_BASELINES: dict = {}  # the sources of task_baseline, by data settings (one corpus read each)


def summary_table(sweep_dir: str | os.PathLike) -> pd.DataFrame:
  """One row per run: ``run``, the sweep axes, the roles from config.yaml, the :data:`COLUMN_DOCS`
  columns (docs/sweeps.md); ``attrs``: axes, id_columns, run_dirs, sweep_dir, not_logged."""
  sweep_dir = storage.path(sweep_dir)
  runs = logs.sweep_runs(sweep_dir)
  keys = dict.fromkeys(k for info in runs.values() for k in info.get("overrides") or {})
  axes = _axis_columns(list(keys))
  dirs = {n: sweep_dir / (info.get("dir") or n) for n, info in runs.items()}
  cfgs = {n: logs.read_config(d) for n, d in dirs.items()}
  known = {k for cfg in cfgs.values() for k in cfg}
  roles = [r for r, k in _CONFIG_KEYS.items() if k in known and r not in axes.values()]
  records, not_logged = [], {}
  for name, info in runs.items():
    row, missing = _summarize(dirs[name])
    not_logged |= {name: missing} if missing else {}
    # a --parallel sweep refreshes the manifest only when it has collected every job: a run
    # whose summary.json says it ended is read as ended while the manifest still says running
    status = info.get("status")
    if status in ("running", "pending"):
      status = rundir.SWEEP_STATUS.get(row["status"], status)
    row["status"] = status or row["status"] or "unknown"
    ov, cfg = info.get("overrides") or {}, cfgs[name]
    ids = {c: _cell(ov.get(k, cfg.get(k))) for k, c in axes.items()}
    records.append(
      {"run": name, **ids, **{r: _cell(cfg.get(_CONFIG_KEYS[r])) for r in roles}, **row}
    )
  id_cols = ["run", *axes.values(), *roles]
  df = pd.DataFrame(records, columns=[*id_cols, *COLUMNS])
  for c in id_cols[1:]:  # integer axes stay integers even where a run lacks them
    vals = [r[c] for r in records]
    if any(v is not None for v in vals) and all(
      v is None or (isinstance(v, (int, np.integer)) and not isinstance(v, bool)) for v in vals
    ):
      df[c] = pd.array(vals, dtype="Int64")
  df["steps"] = df["steps"].astype("int64")
  for c in ("spike_count", "nonfinite"):  # unknown (NA) for a run that has logged nothing
    df[c] = pd.array([v if s else None for v, s in zip(df[c], df["steps"])], dtype="Int64")
  floats = [c for c in GROUP_METRICS if c not in ("spike_count", "nonfinite")]
  df[floats] = df[floats].astype("float64")
  run_dirs = {n: str(d) for n, d in dirs.items()}
  df.attrs = dict(axes=axes, id_columns=id_cols, run_dirs=run_dirs, sweep_dir=str(sweep_dir))
  df.attrs["not_logged"] = not_logged
  return df


def _id_columns(df: pd.DataFrame) -> list[str]:
  if df.attrs.get("id_columns"):
    return [c for c in df.attrs["id_columns"] if c in df.columns]
  return list(df.columns[: df.columns.get_loc("status")]) if "status" in df.columns else ["run"]


def has_lr_axis(df: pd.DataFrame) -> bool:
  """True when the table has an ``lr`` column with at least two distinct learning rates."""
  return "lr" in df.columns and pd.to_numeric(df["lr"], errors="coerce").dropna().nunique() >= 2


LR_COLUMNS = "n_lr lrs best_lr best_final_loss loss_init n_diverged lr_sensitivity".split()


def lr_sensitivity_table(df: pd.DataFrame) -> pd.DataFrame:
  """Wortsman et al.'s LR sensitivity (:func:`mhc_jax.spikes.lr_sensitivity`) per group of runs
  that differ only in ``lr`` (a NaN/inf ``final_loss`` counts as diverged); no lr axis: empty."""
  group_cols = [c for c in _id_columns(df) if c not in ("run", "lr")]
  rows, groups = [], []
  if has_lr_axis(df):
    d = df[df["steps"] > 0].assign(_lr=lambda x: pd.to_numeric(x["lr"], errors="coerce"))
    groups = stats.split(d[d["_lr"].notna()], group_cols)
  for key, g in groups:
    per_lr = g.groupby("_lr")["final_loss"].mean().sort_index()
    init = g["loss_init"][np.isfinite(g["loss_init"])]
    loss_init = float(init.mean()) if len(init) else math.nan
    finite = per_lr[np.isfinite(per_lr)]
    ok = len(per_lr) >= 2 and math.isfinite(loss_init)
    rows.append(
      {
        **dict(zip(group_cols, key)),
        "n_lr": len(per_lr),
        "lrs": ", ".join(f"{x:g}" for x in per_lr.index),
        "best_lr": float(finite.idxmin()) if len(finite) else math.nan,
        "best_final_loss": float(finite.min()) if len(finite) else math.nan,
        "loss_init": loss_init,
        "n_diverged": int((~np.isfinite(per_lr)).sum()),
        "lr_sensitivity": lr_sensitivity(per_lr.to_dict(), loss_init) if ok else math.nan,
      }
    )
  out = pd.DataFrame(rows, columns=[*group_cols, *LR_COLUMNS])
  out.attrs = {"group_columns": group_cols}
  return out


def best_lr_rows(df: pd.DataFrame) -> pd.DataFrame:
  """The runs at their arm's own best lr (``lrmap.RULE``) per group of the other axes, as ``best_lr``."""
  d, ids = df[df["steps"] > 0], [c for c in _id_columns(df) if c != "lr"]
  out = lrmap.at_best_lr(d, [c for c in ids if c not in ("run", "seed")], _endpoint(d)[0])
  out = out.rename(columns={"lr": "best_lr"})
  out.attrs = {**df.attrs, "id_columns": ids}
  return out


# =========================================================================== seeds
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


def _groups_display(groups: pd.DataFrame) -> pd.DataFrame:
  """The groups with "mean [ci_lo, ci_hi]" cells for the :data:`SHOWN_METRICS`."""
  out = groups[[*groups.attrs.get("group_columns", []), "n_seeds"]].copy()
  for m in SHOWN_METRICS:
    mid = stats.centre(m, LOG_SCALE)
    if mid in groups.columns and groups[mid].notna().any():
      cells = zip(groups[mid], groups[f"{m}_ci_lo"], groups[f"{m}_ci_hi"])
      out[f"{m} (gmean)" if m in LOG_SCALE else m] = [_ci_text(*c) for c in cells]
  return out


def _paired_display(paired: pd.DataFrame) -> pd.DataFrame:
  """One row per (context, mixer pair), a cell per :data:`SHOWN_METRICS` metric: "Δ <metric>"
  (b - a) or "ratio <metric>" (b / a), mean [95% CI], with * where ``significant``."""
  keys = [*paired.attrs.get("context_columns", []), "mixer_a", "mixer_b"]
  d = paired[paired["metric"].isin(SHOWN_METRICS)]
  cell = {m: ("ratio", "ratio") if m in LOG_SCALE else ("Δ", "diff") for m in SHOWN_METRICS}
  shown = [m for m in SHOWN_METRICS if d.loc[d["metric"] == m, f"{cell[m][1]}_mean"].notna().any()]
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


# =========================================================================== the sentence
#: Thresholds of :func:`finding` (docs/statistics.md, "The sentence under the table").
FINDING_RULES = {
  "learned_ratio": 0.25,  # learned: mean KL at most this fraction of the worst mixer's ...
  "learned_gap_bits": 0.1,  # ... and at least this many bits below it
  "growth_ratio": 1.5,  # a composite gain grew: deepest / shallowest >= this
  "flat_ratio": 1.2,  # ... and another's stayed: max / min over depths <= this
  "loss_rel_gap": 0.03,  # losses differ: relative gap at least 3%
}


def _num(s) -> np.ndarray:
  return pd.to_numeric(pd.Series(s), errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)


def _finite(d: pd.DataFrame, col: str) -> np.ndarray:
  v = _num(d[col]) if col in d.columns else np.zeros(0)
  return v[np.isfinite(v)]


def _g(v: float) -> str:
  """A number for a sentence: 3 significant digits, plain notation where reasonable."""
  if math.isfinite(v) and v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
    return f"{v:.2g}"
  return f"{v:.3g}" if math.isfinite(v) else _fmt(v)


def _band(lo: float, hi: float) -> str:
  """ "1.00–1.02": both ends with the decimals that tell them apart (2 to 4)."""
  if abs(hi) >= 1e4 or abs(lo) >= 1e4:
    return f"{_g(lo)}–{_g(hi)}" if _g(lo) != _g(hi) else _g(lo)
  dec = next((k for k in range(2, 5) if f"{lo:.{k}f}" != f"{hi:.{k}f}"), None)
  return f"{lo:.{dec}f}–{hi:.{dec}f}" if dec else f"{lo:.2f}"


def _join(names: list[str]) -> str:
  return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def finding(df: pd.DataFrame) -> str:
  """ONE plain sentence saying what differs between the mixers, computed from a
  :func:`summary_table`; its rules, in order, are in docs/statistics.md."""
  d = df[df["steps"] > 0] if "steps" in df.columns else df
  if not len(d):
    return "No run has logged metrics yet, so there is nothing to compare."
  options = _option_columns(df)
  d = d.assign(mixer=arm_labels(d, options)) if "mixer" in d.columns else d
  if "mixer" not in d.columns or d["mixer"].nunique() < 2:
    m = str(d["mixer"].iloc[0]) if "mixer" in d.columns else "one configuration"
    loss = _finite(d, "final_loss")
    tail = f" (final loss {_band(loss.min(), loss.max())})" if loss.size else ""
    return f"Only one mixer ({m}) has results{tail}, so there is no comparison between mixers."
  order = _mixer_order(d["mixer"])
  varies = lambda c: c in d.columns and d[c].map(stats._key).nunique() > 1  # noqa: E731
  ctx = [c for c in group_columns(df) if c != "mixer" and c not in options and varies(c)]
  for rule in (_divergence, _learning, _growth, _spikes):
    if text := rule(d, order, ctx):
      return text + "."
  return (_loss(df, d, ctx) or _no_difference(d)) + "."


def _groups(d: pd.DataFrame, ctx: list[str]) -> list[tuple[tuple, pd.DataFrame]]:
  """``d`` split by the ``ctx`` columns, largest values first (deepest, widest)."""

  def rank(key: tuple) -> tuple:
    return tuple((-x if np.isfinite(x) else math.inf, str(v)) for x, v in zip(_num(key), key))

  return sorted(stats.split(d, ctx), key=lambda kv: rank(kv[0]))


def _label(ctx: list[str], key: tuple) -> str:
  """ "depth 8 and width 32" for a group."""
  num = lambda v: isinstance(v, (int, float, np.number)) and not isinstance(v, bool)  # noqa: E731
  return _join([f"{c} {_g(float(v)) if num(v) else v}" for c, v in zip(ctx, key)]) if ctx else ""


def _head(ctx: list[str], key: tuple) -> str:
  return f"At {_label(ctx, key)}, " if ctx else ""


def _divergence(d, order, ctx) -> str | None:
  bad = d.assign(_bad=~np.isfinite(_num(d["final_loss"])))
  counts = {m: (int(g["_bad"].sum()), len(g)) for m, g in bad.groupby("mixer")}
  if not any(k for k, _ in counts.values()) or len({k / n for k, n in counts.values()}) == 1:
    return None
  parts = []
  for m in [m for m in order if counts[m][0]]:
    where = [_label(ctx, k) for k, g in _groups(bad[bad["mixer"] == m], ctx) if g["_bad"].any()]
    at = f" ({'; '.join(where)})" if ctx and where else ""
    parts.append(f"{m} diverged in {counts[m][0]} of {counts[m][1]} runs{at}")
  clean = [m for m in order if not counts[m][0]]
  return _join(parts) + (f" while {_join(clean)} never did" if clean else "")


def _learning(d, order, ctx) -> str | None:
  r = FINDING_RULES
  for key, g in _groups(d, ctx) if "kl_bits" in d.columns else []:
    kl = {m: _num(gm["kl_bits"]) for m, gm in g.groupby("mixer")}
    mean = {m: float(np.mean(v)) for m, v in kl.items() if v.size and np.isfinite(v).all()}
    worst, best = max(mean.values(), default=0), min(mean.values(), default=0)
    if len(mean) < 2 or best > r["learned_ratio"] * worst or worst - best < r["learned_gap_bits"]:
      continue
    bar = min(r["learned_ratio"] * worst, worst - r["learned_gap_bits"])
    ranked = sorted((m for m in order if m in mean), key=lambda m: mean[m])
    n_ok = {m: int((kl[m] <= bar).sum()) for m in ranked}
    bits = lambda ms: _join([_g(mean[m]) for m in ms])  # noqa: E731
    if max(len(kl[m]) for m in ranked) == 1:  # one run each: learned or not
      good = [m for m in ranked if n_ok[m]]
      poor = [m for m in ranked if not n_ok[m] and mean[m] >= 0.75 * worst]
      mid = [m for m in ranked if m not in good and m not in poor]
      text = (
        f"{_head(ctx, key)}{_join(good)} learned the task (KL {bits(good)} bits to the exact "
        f"posterior) while {_join(poor)} did not ({bits(poor)} bits)"
      )
      return text + (f", with {_join(mid)} in between ({bits(mid)} bits)" if mid else "")
    first, rest = ranked[0], ranked[1:]
    others = [f"{m} in {n_ok[m]} of {len(kl[m])} (mean {_g(mean[m])} bits)" for m in rest]
    return (
      f"{_head(ctx, key)}{first} learned the task in {n_ok[first]} of {len(kl[first])} runs "
      f"(mean KL {_g(mean[first])} bits to the exact posterior), " + _join(others)
    )
  return None


def _growth(d, order, ctx) -> str | None:
  rest_ctx = [c for c in ctx if c != "depth"]
  for key, g in _groups(d, rest_ctx) if "depth" in ctx else []:
    if text := _growth_in(g.assign(_depth=_num(g["depth"])), order):
      return _head(rest_ctx, key) + text
  return None


def _grown(d: pd.DataFrame, col: str) -> tuple | None:
  """(ratio, table of geometric means over seeds [mixer x depth], shallowest, deepest, ratios)
  of ``col`` where some mixer's grew by the growth ratio; None where none did."""
  v = d.assign(_v=_num(d[col])).groupby(["mixer", "_depth"])["_v"]
  tab = v.apply(lambda x: stats.mean_ci(x, log=True)[0]).unstack()
  tab = tab[[c for c in tab.columns if np.isfinite(c)]]
  if tab.shape[1] < 2:
    return None
  lo, hi = min(tab.columns), max(tab.columns)
  ok = tab[np.isfinite(tab[lo]) & np.isfinite(tab[hi]) & (tab[lo] > 0)]
  ratio = ok[hi] / ok[lo]
  r = FINDING_RULES["growth_ratio"]
  if len(ok) < 2 or ratio.max() < r or ok.loc[ratio.idxmax(), hi] < r:
    return None
  return ratio.max(), ok, lo, hi, ratio


def _growth_in(d: pd.DataFrame, order: list[str]) -> str | None:
  """The growth rule within one group: geometric means over seeds per mixer and depth; the
  per-token measure where it shows the growth, forward or backward, whichever grew more."""
  for kind, suffix in (("per-token", "_tok_mean_max"), ("token-averaged", "_max")):
    found = [
      (*g, direction)
      for short, direction in (("fwd", "forward"), ("bwd", "backward"))
      if f"amax_{short}_composite{suffix}" in d.columns
      and (g := _grown(d, f"amax_{short}_composite{suffix}"))
    ]
    if found:
      break
  else:
    return None
  _, ok, lo, hi, ratio, direction = max(found, key=lambda f: f[0])
  top, r = ratio.idxmax(), FINDING_RULES["growth_ratio"]
  rest = [m for m in order if m in ok.index and m != top and ratio[m] * r <= ratio[top]]
  if not rest:
    return None
  text = (
    f"{top}'s {kind} {direction} composite gain grew from {_g(ok.loc[top, lo])} at depth "
    f"{_g(lo)} to {_g(ok.loc[top, hi])} at depth {_g(hi)}"
  )
  vals = {m: ok.loc[m][np.isfinite(ok.loc[m]) & (ok.loc[m] > 0)] for m in rest}
  flat_r = FINDING_RULES["flat_ratio"]
  flat = [m for m in rest if len(vals[m]) and vals[m].max() <= flat_r * vals[m].min()]
  if flat:
    band = _band(min(vals[m].min() for m in flat), max(vals[m].max() for m in flat))
    names = _join([f"{m}'s" for m in flat])
    text += f" while {names} stayed " + (f"within {band}" if "–" in band else f"at {band}")
  else:
    m = min(rest, key=lambda x: ratio[x])
    text += f" while {m}'s went only from {_g(ok.loc[m, lo])} to {_g(ok.loc[m, hi])}"
  sizes = d[d["mixer"].isin([top, *rest])].groupby(["mixer", "_depth"]).size()
  if sizes.max() > 1:
    n = f"{sizes.min()}-{sizes.max()}" if sizes.min() != sizes.max() else str(sizes.max())
    text += f" (geometric means over {n} seeds per mixer and depth)"
  return text


def _spikes(d, order, ctx) -> str | None:
  if "spike_count" not in d.columns:
    return None
  tot = {m: (int(np.nansum(_num(g["spike_count"]))), len(g)) for m, g in d.groupby("mixer")}
  most, none = max(order, key=lambda m: tot[m][0]), [m for m in order if tot[m][0] == 0]
  if tot[most][0] < 2 or not none:
    return None
  (n, k), runs = tot[most], "run" if tot[most][1] == 1 else "runs"
  return f"{most} had {n} loss/gradient spikes in its {k} {runs} while {_join(none)} had none"


def _endpoint(d: pd.DataFrame) -> tuple[str, str]:
  """(column, words) of the loss the sentence compares: held-out where any run has it."""
  if _finite(d, "eval_loss").size:
    return "eval_loss", "held-out loss"
  return "final_loss", "final training loss"


def _loss(df, d, ctx) -> str | None:
  """The loss rule: ``df`` the summary table, ``d`` its runs with metrics, labelled by arm."""
  col, what = _endpoint(d)
  unit = "seed" if "seed" in d.columns else "run"
  seeded = "seed" in d.columns and d["seed"].nunique() > 1
  pairs = {}  # (context keys, {mixer_a, mixer_b}) -> the first paired row of ``col``
  for _, p in paired_table(df).iterrows() if seeded else []:
    if p["metric"] == col:
      pairs.setdefault((*map(stats._key, p[ctx]), frozenset(p[["mixer_a", "mixer_b"]])), p)

  def row_for(key, a, b):
    p = pairs.get((*map(stats._key, key), frozenset((a, b))))
    return p if p is not None and p["n_pairs"] > 1 else None

  for key, g in _groups(d, ctx):
    vals = {m: _num(gm[col]) for m, gm in g.groupby("mixer")}
    mean = pd.Series({m: float(np.mean(v)) for m, v in vals.items()})
    mean = mean[np.isfinite(mean)]
    if len(mean) < 2:
      continue
    lo_m, hi_m = mean.idxmin(), mean.idxmax()
    if (mean[hi_m] - mean[lo_m]) < FINDING_RULES["loss_rel_gap"] * abs(mean[lo_m]):
      continue
    na, nb = len(vals[lo_m]), len(vals[hi_m])
    over = f"means over {na} {unit}s each" if na == nb else f"means over {na} and {nb} {unit}s"
    over = "one run each" if max(na, nb) == 1 else over
    means = f"{_g(mean[lo_m])} vs {_g(mean[hi_m])} nats per token"
    row = row_for(key, lo_m, hi_m)
    if row is None and not (seeded and max(na, nb) > 1):
      return f"{_head(ctx, key)}{lo_m} reached a lower {what} than {hi_m} ({means}, {over})"
    if row is None or not row["significant"]:
      continue  # seeds, but no pairs or no difference beyond seed noise
    sign = 1 if row["mixer_b"] == hi_m else -1
    lo, hi = sorted((sign * float(row["diff_ci_lo"]), sign * float(row["diff_ci_hi"])))
    text = (
      f"{_head(ctx, key)}{lo_m} reached a lower {what} than {hi_m}: {means} ({over}); paired "
      f"difference {hi_m} - {lo_m} {sign * float(row['diff_mean']):+.3g} nats, 95% CI "
      f"[{_g(lo)}, {_g(hi)}], n = {int(row['n_pairs'])} seed pairs"
    )
    rows = [x for x in (row_for(k, lo_m, hi_m) for k, _ in _groups(d, ctx)) if x is not None]
    if len(rows) > 1:
      same = sum(
        bool(x["significant"]) and (1 if x["mixer_b"] == hi_m else -1) * x["diff_mean"] > 0
        for x in rows
      )
      where = f"{ctx[0]}s" if len(ctx) == 1 else "groups"
      text += f"; the paired interval excludes 0 at {same} of {len(rows)} {where}"
    return text
  return None


def _no_difference(d) -> str:
  col, what = _endpoint(d)
  parts = [
    f"{name} {_band(v.min(), v.max())}{unit}"
    for c, name, unit in ((col, f"{what}es", " nats"), ("kl_bits", "KL", " bits"))
    if (v := _finite(d, c)).size
  ]
  for c, kind in (
    ("amax_fwd_composite_tok_mean_max", "per-token"),
    ("amax_fwd_composite_max", "token-averaged"),
  ):
    if (v := _finite(d, c)).size:
      parts.append(f"{kind} composite gains {_band(v.min(), v.max())}")
      break
  if "spike_count" in d.columns:
    n = int(np.nansum(_num(d["spike_count"])))
    parts.append("no spikes" if n == 0 else f"{n} spikes in all")
  said = ", ".join(parts) if parts else "no comparable numbers"
  n = len(d)
  return f"The mixers did not differ clearly over {n} run{'s' if n != 1 else ''}: {said}"


# =========================================================================== writing
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


def _figures(table, lr_tab, out, paths, max_heatmaps, dpi) -> tuple[list, list[str]]:
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
      lambda p: plots.lr_sensitivity_curves(runs, lr_tab, p, dpi=dpi),
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
    figures.append(
      (heat, "Per-layer gains over training", plots.CAPTIONS["heatmap"].format(**words))
    )
  if not chosen:
    missing.append(
      "No per-layer heatmaps: no run has logged per-layer gain_fwd / amax_fwd_composite."
    )
  return figures, missing


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
  figures, missing = _figures(table, tabs["lr_sensitivity"], out, paths, max_heatmaps, dpi)
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
  table, groups, paired, lr_tab = (
    tabs[k] for k in ("summary", "groups", "paired", "lr_sensitivity")
  )
  status = ", ".join(f"{v} {k}" for k, v in table["status"].value_counts().items()) or "no runs"
  axes = table.attrs["axes"]
  md = [
    f"# Sweep report: {logs.dir_name(sweep_dir)}\n",
    f"{len(table)} runs ({status}). Sweep axes: "
    + (", ".join(f"{c} ({k})" for k, c in axes.items()) or "none")
    + ".\n",
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
  if len(lr_tab):
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
