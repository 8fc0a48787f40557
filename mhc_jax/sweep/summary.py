"""The summary table of a sweep: one row per run, its axes and roles, and the metric columns
reduced from its logs (metrics.jsonl, events.jsonl, eval.json) by the registry's rules. What
each column holds: docs/sweeps.md ("The report"). Paths go through :mod:`mhc_jax.storage`.
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
from mhc_jax.logs import load_events, read_jsonl
from mhc_jax.storage import Path

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
# Where the config holds each role (a sweep axis whose last key part is the role names it too).
_CONFIG_KEYS = {"mixer": "model.mixer", "depth": "model.depth", "width": "model.width"}
_CONFIG_KEYS |= {"lr": "optim.lr", "seed": "train.seed"}


# =========================================================================== one run
def _merged(path: Path) -> list[dict[str, Any]]:
  """metrics.jsonl records merged per step (later keys win), flattened to ``eval/x`` keys."""
  records = logs._records_by_step(read_jsonl(path) if path.exists() else [])
  return [{k.replace(".", "/"): v for k, v in r.items()} for r in records]


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
  logged = lambda name: bool(_layer_lists(records, name))  # noqa: E731
  if records and not logged("amax_fwd_composite"):
    if logged("gain_fwd"):  # diagnostics, but a mixer without H_res
      notes.append("no H_res: composite gains n/a")
      missing = [c for c in COLUMNS if c.startswith(("amax_", "amin_", "stream_spread"))]
    else:
      notes.append("no per-layer diagnostics")
  elif records and not all(logged(name) for name in CURRENT):
    raise UsageError(
      f"{run_dir}: its logs predate the per-token composite, amin and suffix metrics"
      f" ({', '.join(CURRENT)}); this mhc_jax does not read them: {READS_OLD_LOGS} does"
    )
  elif records and not logged("stream_spread"):
    notes.append("not logged: stream spread")
  if logged("amax_fwd_composite") and not logged("h_res_diag"):
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
  is_int = lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, bool)  # noqa: E731
  for c in id_cols[1:]:  # integer axes stay integers even where a run lacks them
    vals = [r[c] for r in records]
    if any(v is not None for v in vals) and all(v is None or is_int(v) for v in vals):
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
