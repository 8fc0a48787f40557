"""Sweep report: one summary row per run, LR sensitivity, intervals over seeds, plots, Markdown.

``summarize_run(run_dir)`` reduces one run directory (docs/interfaces.md layout) to a dict of
numbers, ``summary_table(sweep_dir)`` makes that a DataFrame with one row per run in the
sweep manifest (sweep axes in front), ``lr_sensitivity_table(df)`` computes Wortsman et al.'s
LR sensitivity for every group of runs that differ only in the learning rate,
``groups_table(df)`` groups the runs that differ only in the seed and gives per group and
metric the mean and a 95% confidence interval over seeds, ``paired_table(df)`` the paired
difference between mixers by seed with its interval, ``finding(df)`` one plain sentence saying
what differs between the mixers (computed from the numbers), and ``write_report(sweep_dir)``
writes ``report/`` with ``summary.md`` (the tables, the sentence, the figures with their captions
and every column's definition), ``summary.csv``, ``groups.csv``, ``paired.csv`` (two or more
mixers), ``lr_sensitivity.csv`` (when there is an lr axis) and PNG plots.

Intervals are Student t over seeds (mean ± t(0.975, n-1)·s/√n), not a bootstrap: with the
3-5 seeds a sweep affords, a percentile bootstrap's 95% interval covers the mean only about
73% (n = 3) to 82% (n = 5) of the time; see :mod:`mhc_jax.sweep.stats`. The :data:`LOG_SCALE`
columns (gains, gradient norms, stream spreads) are summarised on the log scale: geometric
means, intervals of the logs back-transformed, paired comparisons as ratios. The held-out loss
``eval_loss`` is the primary endpoint: the tables and the sentence lead with it.

Column definitions (also written into the report, see :data:`COLUMN_DOCS`). "Logged" values
are read from ``metrics.jsonl`` with records merged per step (later keys win, as
:func:`mhc_jax.logs.load_run` does) and a metric's series is the steps whose record *has*
that key, in step order; so an eval-only record never reads as a missing (NaN) loss, while
a NaN the trainer wrote is kept. Nothing non-finite is hidden: a mean or a "last" value over
NaN/inf is NaN/inf.

A directory without ``manifest.json`` but with ``metrics.jsonl`` or ``config.yaml`` is
treated as a one-run sweep, so a single run can be reported too.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import numpy as np
import pandas as pd

from mhc_jax import metrics, storage
from mhc_jax.logs import flatten_dict, load_events, load_run, read_jsonl
from mhc_jax.spikes import lr_sensitivity
from mhc_jax.storage import Path
from mhc_jax.sweep import stats

__all__ = [
  "FINAL_FRACTION",
  "COLUMN_DOCS",
  "final_loss_of",
  "summarize_run",
  "eval_columns",
  "summary_table",
  "shown_columns",
  "OPTIONAL_COLUMNS",
  "lr_sensitivity_table",
  "LATER_COLUMNS",
  "GROUP_METRICS",
  "LOG_SCALE",
  "COMPOSITE_SENTENCES",
  "group_columns",
  "groups_table",
  "paired_table",
  "finding",
  "write_report",
  "SCREEN_COLUMNS",
  "screen",
]

#: Fraction of the logged losses averaged into ``final_loss`` (at least one value).
FINAL_FRACTION = 0.05

#: The metric columns of :func:`summary_table`, in order, with their exact definitions.
COLUMN_DOCS: dict[str, str] = {
  "status": "the manifest's status (done | failed | running | pending); summary.json's status where "
  "the manifest has none",
  "steps": "last logged step in metrics.jsonl (0 when nothing is logged)",
  "loss_init": "first logged loss",
  "eval_loss": "held-out loss, the primary endpoint: last logged eval/loss in metrics.jsonl (the loss "
  "on data.eval_batches validation batches at the last evaluation, train.eval_every); NaN without "
  "evaluations",
  "final_loss": "final training loss (secondary): mean of the last 5% of the logged training losses "
  "(ceil(n/20), at least 1); NaN/inf if any of them is",
  "min_loss": "minimum over the finite logged losses",
  "spike_count": "number of events of kind spike/* in events.jsonl (a step where loss and grad norm "
  "both spike counts twice; mhc_jax/spikes.py has the rule); NA for a run with no metrics",
  "spike_score": "last logged spike_score (fraction of spike steps in the trailing window)",
  "max_grad_norm": "maximum logged grad_norm (before clipping) over the steps after the learning-rate "
  "warm-up (step >= optim.warmup_steps of config.yaml; every step where the config has none), NaN "
  "entries ignored, inf kept; the step-0 gradient of a fresh initialisation is not counted",
  "amax_fwd_composite_max": "token-averaged composite: max over steps of the last layer's amax_fwd_composite, "
  "the forward Amax gain (max |row sum|) of the whole-depth product of the token-mean H_res (what the mHC "
  "paper plots)",
  "amax_fwd_composite_tok_mean_max": "per-token composite, token mean: max over steps of the last layer's "
  "amax_fwd_composite_tok_mean, the forward Amax gain of each sampled token's own whole-depth product of its "
  "H_res, averaged over the token sample; n/a where the logs do not have it (written before it existed)",
  "amax_fwd_composite_tok_max_max": "per-token composite, worst token: the same for "
  "amax_fwd_composite_tok_max (max over the token sample); n/a where not logged",
  "amax_bwd_composite_max": "token-averaged composite, backward: as amax_fwd_composite_max for "
  "amax_bwd_composite (max |column sum|)",
  "amax_bwd_composite_tok_mean_max": "per-token composite, backward, token mean (amax_bwd_composite_tok_mean); "
  "n/a where not logged",
  "amax_bwd_composite_tok_max_max": "per-token composite, backward, worst token (amax_bwd_composite_tok_max); "
  "n/a where not logged",
  "amin_fwd_composite_min": "attenuation: min over steps of the last layer's amin_fwd_composite (min |row sum| "
  "of the whole-depth product of H_res; below 1 the residual path shrinks the signal); n/a where not logged",
  "amin_bwd_composite_min": "the same for amin_bwd_composite (min |column sum|); n/a where not logged",
  "amax_fwd_composite_max_all_layers": "max of amax_fwd_composite over all layers and steps (partial "
  "products from the input, layer 0 to l, included)",
  "amax_bwd_composite_max_all_layers": "max of amax_bwd_composite over all layers and steps",
  "amax_fwd_suffix_max_all_layers": "max over layers and steps of amax_fwd_suffix, the Amax gain of the "
  "suffix product of H_res from layer l to the output (the mHC paper's Eq. 4); n/a where not logged",
  "amax_bwd_suffix_max_all_layers": "the same for amax_bwd_suffix; n/a where not logged",
  "growth_exponent": "last logged growth_exponent (activations over the 2L mixer layers: "
  "(1/(2L)) ln(RMS(x_2L)/RMS(x_0)), x_0 the stream entering the first mixer layer, x_2L the one leaving the "
  "last)",
  "stream_spread_last": "stream spread after the last mixer layer at the last diagnostics step: "
  "RMS(x - mean over streams) / RMS(x) of the stream state (0 for a single stream; near 0 = the "
  "streams collapsed into one); n/a where the logs lack stream_spread (older logs, or a mixer whose "
  "state is not streams)",
  "stream_spread_mean": "the same, averaged over the 2L mixer layers (HC's spread peaks mid-depth "
  "and can fall near the output, so the last layer alone can hide it)",
  "stream_spread_min": "the same, the minimum over the mixer layers",
  "kl_bits": "last logged eval/kl_bits (KL to the exact posterior, bits; wind tunnels only, else NaN)",
  "attn_logit_max": "max over diagnostics steps and layers of attn_logit_max, the largest pre-softmax "
  "attention logit (Wortsman et al.'s attention-logit growth); NaN without per-layer diagnostics",
  "out_logit_max": "max over diagnostics steps of out_logit_max, the largest output logit; NaN without "
  "per-layer diagnostics",
  "logz_absmax": "max over diagnostics steps of |logsumexp_mean|, the mean log partition function of the "
  "output softmax (the quantity z-loss pulls to 0; its drift is Wortsman et al.'s output-logit "
  "divergence); NaN without per-layer diagnostics",
  "eval_kl_bits": "eval.json (the sweep's post-run `eval: N`, mhc-jax eval on N validation batches): "
  "KL(posterior || model) in bits per position at the last checkpoint; NaN without eval.json",
  "probe_key_ratio": "eval.json: mean |cos| between hypothesis-grouped attention keys (pre-RoPE) over "
  "that of random directions (1 = no more orthogonal than chance, lower = more orthogonal)",
  "probe_attn_on_target": "eval.json: attention weight the retrieval head puts on the answer's position "
  "(bijection)",
  "probe_qk_slope": "eval.json: slope of the retrieval head's pre-RoPE query-key cosine against evidence "
  "at fixed query-target distance (bijection)",
  "probe_pc1_entropy": "eval.json: |corr(PC1 of the last block's stream, posterior entropy)| with position "
  "partialled out (bijection new-key positions; HMM all positions)",
  "nonfinite": "last logged nonfinite counter (non-finite steps); where never logged, the number of "
  "logged non-finite losses; NA for a run with no metrics",
  "note": "what is missing or went wrong: no metrics yet, first non-finite loss, divergence event, "
  "summary.json status",
}
METRIC_COLUMNS = list(COLUMN_DOCS)
#: Columns from metrics added after the first logs were written: where a run's logs lack the
#: metric the cell is NaN, shown as "n/a" (not as a non-finite result), and the run's note says so.
#: column -> (metric in metrics.jsonl, reduction over steps of the whole-depth value, or "all
#: layers": over every layer).
LATER_COLUMNS: dict[str, tuple[str, str]] = {
  **{
    f"amax_{d}_composite_tok_{k}_max": (f"amax_{d}_composite_tok_{k}", "max")
    for d in ("fwd", "bwd")
    for k in ("mean", "max")
  },
  **{f"amin_{d}_composite_min": (f"amin_{d}_composite", "min") for d in ("fwd", "bwd")},
  **{f"amax_{d}_suffix_max_all_layers": (f"amax_{d}_suffix", "all layers") for d in ("fwd", "bwd")},
  **{f"stream_spread_{k}": ("stream_spread", f"last step: {k}") for k in ("last", "mean", "min")},
}
#: Numeric columns that are summarised over seeds (report/groups.csv, report/paired.csv).
GROUP_METRICS = [c for c in METRIC_COLUMNS if c not in ("status", "note", "steps")]
#: The summary columns summarised on the log scale (positive and heavy-tailed: gains, gradient
#: norms, stream spreads): geometric mean with the t interval of the logs, back-transformed, and
#: paired comparisons as ratios (:mod:`mhc_jax.sweep.stats`, docs/statistics.md). The one place
#: this is decided; every other metric is summarised on the raw scale.
LOG_SCALE = metrics.log_columns()
#: What the two kinds of composite gain mean, one sentence each (the report and notebook 02).
COMPOSITE_SENTENCES = {
  "token-averaged": "Token-averaged composite (amax_*_composite): the Amax gain of the product over layers "
  "of the token-mean H_res, which is what the mHC paper plots; averaging the matrices first cancels "
  "token-to-token variation, so it can read near 1 while individual tokens' products are not.",
  "per-token": "Per-token composite (amax_*_composite_tok_mean / _tok_max): each sampled token's own "
  "product of its H_res across all layers (mean and worst over the sample), i.e. what one token's signal "
  "actually passes through, which token averaging can hide.",
}

# Canonical short names for the sweep axes the plots need: role -> accepted last key parts.
_ROLES: dict[str, tuple[str, ...]] = {
  "mixer": ("mixer",),
  "depth": ("depth", "n_layers", "num_layers"),
  "width": ("width", "d_model"),
  "lr": ("lr", "learning_rate", "peak_lr"),
  "seed": ("seed",),
}
# Where the resolved config holds each role (for runs where it is not a sweep axis).
_CONFIG_KEYS = {
  "mixer": "model.mixer",
  "depth": "model.depth",
  "width": "model.width",
  "lr": "optim.lr",
  "seed": "train.seed",
}


# =========================================================================== one run
def _merged(path: Path) -> list[dict[str, Any]]:
  """metrics.jsonl records merged per step (later keys win), flattened, sorted by step."""
  if not path.exists():
    return []
  by_step: dict[Any, dict[str, Any]] = {}
  for rec in read_jsonl(path):
    if isinstance(rec, dict) and rec.get("step") is not None:
      by_step.setdefault(rec["step"], {}).update(flatten_dict(rec, sep="/"))
  return [by_step[s] for s in sorted(by_step)]


def _get(rec: Mapping[str, Any], key: str) -> Any:
  """A metric by name, accepting ``eval/x`` written nested (``{"eval": {"x": ..}}``) too."""
  return rec[key] if key in rec else rec.get(key.replace("/", "."), None)


def _has(rec: Mapping[str, Any], key: str) -> bool:
  return key in rec or key.replace("/", ".") in rec


def _scalars(records: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps, float values) of the records that have ``key`` (None -> NaN)."""
  steps, vals = [], []
  for r in records:
    if _has(r, key):
      v = _get(r, key)
      try:
        vals.append(math.nan if v is None else float(v))
      except (TypeError, ValueError):
        continue
      steps.append(r["step"])
  return np.asarray(steps), np.asarray(vals, dtype=np.float64)


def _layer_lists(records: list[dict[str, Any]], key: str) -> list[np.ndarray]:
  out = []
  for r in records:
    v = _get(r, key)
    if isinstance(v, list) and v:
      out.append(np.asarray([math.nan if x is None else x for x in v], dtype=np.float64))
  return out


def _nanmax(a: np.ndarray) -> float:
  a = np.asarray(a, dtype=np.float64)
  return float(np.nanmax(a)) if a.size and not np.isnan(a).all() else math.nan


def _last(vals: np.ndarray) -> float:
  return float(vals[-1]) if len(vals) else math.nan


def _read_summary(run_dir: Path) -> dict[str, Any]:
  """summary.json as a dict ({} if missing, unreadable or half-written)."""
  try:
    out = json.loads((run_dir / "summary.json").read_text())
  except (OSError, ValueError):
    return {}
  return out if isinstance(out, dict) else {}


def _reduce(records: list[dict[str, Any]], m: metrics.Metric, how: str, warmup: int) -> float:
  """One report column: metric ``m`` reduced over training as ``how`` says
  (:data:`mhc_jax.metrics.REDUCTIONS`); NaN where the logs lack it."""
  if m.shape == "scalar":
    steps, v = _scalars(records, m.name)
    if how == "max_after_warmup":
      v = v[steps >= warmup]
  else:
    lists = _layer_lists(records, m.name)
    if how in ("last_layer", "layer_mean", "layer_min"):
      last = lists[-1] if lists else np.zeros(0)
      if not last.size:
        return math.nan
      return float(
        {"last_layer": last[-1], "layer_mean": np.mean(last), "layer_min": np.min(last)}[how]
      )
    if how == "max_all_layers":
      return _nanmax(np.concatenate(lists)) if lists else math.nan
    v = np.array([x[-1] for x in lists])  # the whole-depth value at each diagnostics step
  if how == "first":
    return _last(v[:1])
  if how == "last":
    return _last(v)
  if how == "final":
    return final_loss_of(v)
  if how == "min":
    return -_nanmax(-v) if v.size else math.nan
  if how in ("max", "max_after_warmup"):
    return _nanmax(v) if v.size else math.nan
  if how == "absmax":
    return _nanmax(np.abs(v))
  raise ValueError(f"unknown reduction {how!r} of {m.name}")


def final_loss_of(losses: np.ndarray) -> float:
  """Mean of the last ``ceil(n/20)`` (>= 1) values: the :data:`COLUMN_DOCS` ``final_loss``."""
  n = len(losses)
  if n == 0:
    return math.nan
  k = max(1, -(-n // round(1 / FINAL_FRACTION)))
  with np.errstate(invalid="ignore"):
    return float(np.mean(losses[-k:]))


def summarize_run(run_dir: str | os.PathLike) -> dict[str, Any]:
  """One run directory -> ``{column: value}`` for the :data:`COLUMN_DOCS` columns.

  Works on a run with no files at all (everything NaN, ``steps`` 0, a ``note`` saying
  so). ``status`` comes from ``summary.json`` (None without one); ``summary_table``
  prefers the manifest's. A :data:`LATER_COLUMNS` column whose metric the logs lack is NaN
  and the note names it.
  """
  return _summarize(run_dir)[0]


def _summarize(run_dir: str | os.PathLike) -> tuple[dict[str, Any], list[str]]:
  """(:func:`summarize_run`'s dict, the :data:`LATER_COLUMNS` the logs do not have)."""
  run_dir = storage.path(run_dir)
  records = _merged(run_dir / "metrics.jsonl")
  events = load_events(run_dir) if (run_dir / "events.jsonl").exists() else None
  summary = _read_summary(run_dir)

  loss_steps, losses = _scalars(records, "loss")
  warmup = _read_config(run_dir).get("optim.warmup_steps") or 0
  out: dict[str, Any] = {"status": summary.get("status")}
  out["steps"] = int(records[-1]["step"]) if records else 0
  kinds = (
    events["kind"].astype(str) if events is not None and len(events) else pd.Series([], dtype=str)
  )
  out["spike_count"] = int(kinds.str.startswith("spike/").sum())
  not_logged = []
  for m in metrics.METRICS:  # every column the registry derives from metrics.jsonl
    for col, how in m.summary.items():
      out[col] = _reduce(records, m, how, warmup)
      if col in LATER_COLUMNS and not _layer_lists(records, m.name):
        not_logged.append(col)
  out.update(eval_columns(run_dir))
  _, nf = _scalars(records, "nonfinite")
  out["nonfinite"] = (
    int(nf[-1]) if len(nf) and np.isfinite(nf[-1]) else int((~np.isfinite(losses)).sum())
  )

  notes = []
  if not records:
    notes.append("no metrics logged yet")
  elif not len(losses):
    notes.append("no loss logged")
  bad = np.flatnonzero(~np.isfinite(losses))
  if bad.size:
    notes.append(f"loss non-finite from step {int(loss_steps[bad[0]])} ({bad.size} logged steps)")
  if events is not None and len(events):
    div = events[kinds == "divergence"]
    if len(div):
      reason = div["reason"].iloc[0] if "reason" in div.columns else None
      why = f" ({reason})" if isinstance(reason, str) else ""
      notes.append(f"divergence at step {int(div['step'].iloc[0])}{why}")
  if records and not _layer_lists(records, "amax_fwd_composite"):
    if _layer_lists(records, "gain_fwd"):  # diagnostics, but a mixer without H_res
      notes.append("no H_res: composite gains n/a")
      not_logged = sorted(
        set(not_logged) | {c for c in METRIC_COLUMNS if c.startswith(("amax_", "amin_"))}
      )
    else:
      notes.append("no per-layer diagnostics")
  elif records and not_logged:
    kinds = {
      "per-token composite": "_tok_",
      "amin composite": "amin_",
      "suffix products": "_suffix",
      "stream spread": "stream_spread",
    }
    notes.append(
      "not logged: "
      + ", ".join(k for k, part in kinds.items() if any(part in c for c in not_logged))
    )
  if summary.get("status") not in (None, "done"):
    notes.append(f"summary.json: {summary['status']}")
  out["note"] = "; ".join(notes)
  return {k: out[k] for k in METRIC_COLUMNS}, not_logged


#: eval.json -> report column: (section, probe or metric, field); `abs` for a sign-free value.
_EVAL_FIELDS = {
  "eval_kl_bits": ("metrics", None, "kl_bits"),
  "probe_key_ratio": ("probes", "key_orthogonality", "ratio_to_random"),
  "probe_attn_on_target": ("probes", "qk_alignment", "attn_on_target"),
  "probe_qk_slope": ("probes", "qk_alignment", "slope"),
  "probe_pc1_entropy": ("probes", "pca_entropy", "corr_pc1_entropy"),
}


#: Shown in summary.md only where some run has them (summary.csv keeps them all).
OPTIONAL_COLUMNS = ("attn_logit_max", "out_logit_max", "logz_absmax", *_EVAL_FIELDS)


def shown_columns(table: pd.DataFrame) -> pd.DataFrame:
  """`table` without the :data:`OPTIONAL_COLUMNS` that no run has (attrs kept)."""
  drop = [c for c in OPTIONAL_COLUMNS if c in table.columns and table[c].isna().all()]
  out = table.drop(columns=drop)
  out.attrs = dict(table.attrs)
  return out


def eval_columns(run_dir: str | os.PathLike) -> dict[str, float]:
  """The ``eval_*`` / ``probe_*`` columns from ``run_dir/eval.json`` (NaN where absent or a probe
  was skipped)."""
  try:
    ev = json.loads((storage.path(run_dir) / "eval.json").read_text())
  except (OSError, ValueError):
    ev = {}
  out = {}
  for col, (section, probe, field) in _EVAL_FIELDS.items():
    d = ev.get(section) if isinstance(ev, dict) else None
    d = d.get(probe) if probe and isinstance(d, dict) else d
    v = d.get(field) if isinstance(d, dict) else None
    try:
      v = math.nan if v is None else float(v)
    except (TypeError, ValueError):
      v = math.nan
    out[col] = abs(v) if col == "probe_pc1_entropy" else v
  return out


# =========================================================================== a sweep
def _sweep_runs(sweep_dir: Path) -> dict[str, dict[str, Any]]:
  """The manifest's runs, or a one-run manifest for a bare run directory."""
  mpath = sweep_dir / "manifest.json"
  if mpath.exists():
    runs = json.loads(mpath.read_text()).get("runs", {})
    if isinstance(runs, list):
      runs = {r["name"]: r for r in runs}
    return dict(runs)
  if (sweep_dir / "metrics.jsonl").exists() or (sweep_dir / "config.yaml").exists():
    status = _read_summary(sweep_dir).get("status") or "running"
    return {_name(sweep_dir): {"status": status, "overrides": {}, "dir": "."}}
  raise FileNotFoundError(f"{sweep_dir}: neither a sweep (manifest.json) nor a run directory")


def _name(p: Path) -> str:
  """The directory's own name (a local path resolved first: ``.`` names its folder)."""
  return p.resolve().name if storage.is_local(p) else p.name


def _role(key: str) -> str | None:
  last = key.rsplit(".", 1)[-1]
  return next((r for r, names in _ROLES.items() if last in names), None)


def _axis_columns(keys: list[str]) -> dict[str, str]:
  """Dotted override keys -> short column names (canonical role names, else the last part;
  the full key where that would collide with another axis or a table column)."""
  reserved = {"run", *METRIC_COLUMNS}
  cols: dict[str, str] = {}
  # roles first, preferring the standard config key for each role
  for role in _ROLES:
    cands = [k for k in keys if _role(k) == role]
    if cands:
      best = _CONFIG_KEYS[role] if _CONFIG_KEYS[role] in cands else cands[0]
      cols[best] = role
  used = set(cols.values()) | reserved
  lasts = [k.rsplit(".", 1)[-1] for k in keys if k not in cols]
  for k in keys:
    if k in cols:
      continue
    short = k.rsplit(".", 1)[-1]
    cols[k] = short if short not in used and lasts.count(short) == 1 else k
    used.add(cols[k])
  return {k: cols[k] for k in keys}


def _read_config(run_dir: Path) -> dict[str, Any]:
  """The run's resolved config.yaml, flattened to dotted keys ({} if missing or unreadable)."""
  path = run_dir / "config.yaml"
  if not path.exists():
    return {}
  import yaml

  try:
    cfg = yaml.safe_load(path.read_text())
  except yaml.YAMLError:
    return {}
  return flatten_dict(cfg) if isinstance(cfg, Mapping) else {}


def _cell(v: Any) -> Any:
  return json.dumps(v) if isinstance(v, (list, dict, tuple)) else v


def summary_table(sweep_dir: str | os.PathLike) -> pd.DataFrame:
  """One row per run in the manifest: ``run``, the sweep axes (override keys shortened:
  ``model.mixer`` -> ``mixer``, ``optim.lr`` -> ``lr`` ...), the roles ``mixer``,
  ``depth``, ``width``, ``lr``, ``seed`` from ``config.yaml`` where they are not axes but
  the config has them, then the :data:`COLUMN_DOCS` columns.

  ``df.attrs``: ``axes`` (override key -> column), ``id_columns`` (the columns before
  ``status``, which identify a run), ``run_dirs`` (run -> path), ``sweep_dir``,
  ``not_logged`` (run -> the :data:`LATER_COLUMNS` its logs lack; shown as "n/a").
  """
  sweep_dir = storage.path(sweep_dir)
  runs = _sweep_runs(sweep_dir)
  keys: list[str] = []
  for info in runs.values():
    for k in info.get("overrides") or {}:
      if k not in keys:
        keys.append(k)
  axes = _axis_columns(keys)
  rows, configs, run_dirs, not_logged = [], {}, {}, {}
  for name, info in runs.items():
    rdir = sweep_dir / (info.get("dir") or name)
    run_dirs[name] = str(rdir)
    cfg = _read_config(rdir)
    configs[name] = cfg
    overrides = info.get("overrides") or {}
    row: dict[str, Any] = {"run": name}
    row.update({col: _cell(overrides.get(k, cfg.get(k))) for k, col in axes.items()})
    stats, missing = _summarize(rdir)
    if missing:
      not_logged[name] = missing
    if info.get("status"):
      stats["status"] = info["status"]
    elif stats["status"] is None:
      stats["status"] = "unknown"
    row["_stats"] = stats
    rows.append(row)
  context = [
    r
    for r in _ROLES
    if r not in axes.values() and any(_CONFIG_KEYS[r] in c for c in configs.values())
  ]
  id_cols = ["run", *axes.values(), *context]
  records = []
  for row in rows:
    cfg = configs[row["run"]]
    rec = {c: row.get(c) for c in ["run", *axes.values()]}
    rec.update({r: _cell(cfg.get(_CONFIG_KEYS[r])) for r in context})
    rec.update(row["_stats"])
    records.append(rec)
  df = pd.DataFrame(records, columns=[*id_cols, *METRIC_COLUMNS])
  for c in id_cols[1:]:  # integer axes stay integers even where a run lacks them
    raw = [rec[c] for rec in records]
    vals = [v for v in raw if v is not None]
    if vals and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in vals):
      df[c] = pd.array(raw, dtype="Int64")
  df["steps"] = df["steps"].astype("int64")
  for c in ("spike_count", "nonfinite"):  # unknown (NA) for a run that has logged nothing
    df[c] = pd.array([v if s > 0 else pd.NA for v, s in zip(df[c], df["steps"])], dtype="Int64")
  for c in METRIC_COLUMNS:
    if c not in ("status", "note", "steps", "spike_count", "nonfinite"):
      df[c] = df[c].astype("float64")
  df.attrs = {
    "axes": axes,
    "id_columns": id_cols,
    "run_dirs": run_dirs,
    "sweep_dir": str(sweep_dir),
    "not_logged": not_logged,
  }
  return df


def _id_columns(df: pd.DataFrame) -> list[str]:
  ids = df.attrs.get("id_columns")
  if ids:
    return [c for c in ids if c in df.columns]
  return list(df.columns[: df.columns.get_loc("status")]) if "status" in df.columns else ["run"]


def has_lr_axis(df: pd.DataFrame) -> bool:
  """True when the table has an ``lr`` column with at least two distinct learning rates."""
  return "lr" in df.columns and pd.to_numeric(df["lr"], errors="coerce").dropna().nunique() >= 2


LR_COLUMNS = [
  "n_lr",
  "lrs",
  "best_lr",
  "best_final_loss",
  "loss_init",
  "n_diverged",
  "lr_sensitivity",
]


def lr_sensitivity_table(df: pd.DataFrame) -> pd.DataFrame:
  """Wortsman et al.'s LR sensitivity per group of runs that differ only in ``lr``.

  Groups: equal values of every identifying column of ``df`` except ``run`` and ``lr``
  (the other sweep axes, seed included). Only runs with logged metrics (``steps > 0``)
  take part; a run whose ``final_loss`` is NaN/inf counts as diverged. Per group:
  ``lr_sensitivity = spikes.lr_sensitivity({lr: final_loss}, loss_init)`` =
  ``mean_lr min(final_loss(lr), loss_init) - min_lr min(final_loss, loss_init)`` with
  ``loss_init`` the mean of the group's first logged losses (equal for runs sharing model
  and seed). Runs sharing an lr within a group are averaged. A group with fewer than two
  learning rates gets NaN. No lr axis -> an empty frame with the columns.
  """
  group_cols = [c for c in _id_columns(df) if c not in ("run", "lr")]
  if not has_lr_axis(df):
    return pd.DataFrame(columns=[*group_cols, *LR_COLUMNS])
  d = df[df["steps"] > 0].copy()
  d["_lr"] = pd.to_numeric(d["lr"], errors="coerce")
  d = d[d["_lr"].notna()]
  rows = []
  keyed = d.groupby(group_cols, dropna=False, sort=False) if group_cols else [((), d)]
  for key, g in keyed:
    key = key if isinstance(key, tuple) else (key,)
    per_lr = g.groupby("_lr")["final_loss"].mean().sort_index()
    init = g["loss_init"][np.isfinite(g["loss_init"])]
    loss_init = float(init.mean()) if len(init) else math.nan
    finite = per_lr[np.isfinite(per_lr)]
    n_lr = len(per_lr)
    if n_lr >= 2 and math.isfinite(loss_init):
      sens = lr_sensitivity(per_lr.to_dict(), loss_init)
    else:
      sens = math.nan
    rows.append(
      {
        **dict(zip(group_cols, key)),
        "n_lr": n_lr,
        "lrs": ", ".join(f"{x:g}" for x in per_lr.index),
        "best_lr": float(finite.idxmin()) if len(finite) else math.nan,
        "best_final_loss": float(finite.min()) if len(finite) else math.nan,
        "loss_init": loss_init,
        "n_diverged": int((~np.isfinite(per_lr)).sum()),
        "lr_sensitivity": sens,
      }
    )
  out = pd.DataFrame(rows, columns=[*group_cols, *LR_COLUMNS])
  out.attrs = {"group_columns": group_cols}
  return out


# =========================================================================== seeds
_MIXER_ORDER = ("residual", "hc", "mhc", "mhc_lite")


def _mixer_order(values) -> list:
  """Mixers (or arm labels, "mhc (stream_init=symmetric)") in the usual order: residual, hc,
  mhc, mhc_lite, then by name; an arm right after its mixer."""
  names = list(dict.fromkeys(str(v) for v in values if v is not None and v is not pd.NA))

  def key(name: str) -> tuple:
    base = name.split(" (")[0]
    known = _MIXER_ORDER.index(base) if base in _MIXER_ORDER else len(_MIXER_ORDER)
    return known, base, name != base, name

  return sorted(names, key=key)


def _option_columns(df: pd.DataFrame) -> list[str]:
  """The axis columns that configure the mixer (``model.mixer_options.*``): with the mixer they
  name the *arm* that paired comparisons and the sentence compare (an arm "mhc with
  stream_init=symmetric" is compared with "mhc" and "hc", not grouped apart from them)."""
  axes = df.attrs.get("axes") or {}
  return [c for k, c in axes.items() if k.startswith("model.mixer_options.") and c in df.columns]


def arm_labels(df: pd.DataFrame, options: list[str] | None = None) -> pd.Series:
  """Each run's mixer with its :func:`_option_columns` values where set: "mhc",
  "mhc (stream_init=symmetric)"."""
  options = _option_columns(df) if options is None else options

  def label(r) -> str:
    extra = [f"{c}={r[c]}" for c in options if _is_set(r[c])]
    return str(r["mixer"]) + (f" ({', '.join(extra)})" if extra else "")

  return pd.Series([label(r) for _, r in df.iterrows()], index=df.index, dtype=object)


def _is_set(v) -> bool:
  return not (v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)))


def group_columns(df: pd.DataFrame) -> list[str]:
  """The columns that define a group of seeds: every identifying column but ``run`` and ``seed``."""
  return [c for c in _id_columns(df) if c not in ("run", "seed")]


def groups_table(df: pd.DataFrame) -> pd.DataFrame:
  """Runs that differ only in the seed, summarised: one row per group (equal values of
  :func:`group_columns`) with the group columns, ``n_runs`` (runs in the manifest),
  ``n_seeds`` (runs with logged metrics, the ones that count), ``seeds``, then for each of
  :data:`GROUP_METRICS` its centre, ``<metric>_ci_lo`` and ``<metric>_ci_hi``: the mean over
  the group's seeds (``<metric>_mean``) and its 95% Student t interval, or for the
  :data:`LOG_SCALE` metrics the geometric mean (``<metric>_gmean``) and the interval computed on
  the logs (:mod:`mhc_jax.sweep.stats`; a NaN or inf in any seed makes the centre NaN/inf and
  the interval NaN; one seed has no interval). A sweep without seeds gives one row per run with
  ``n_seeds`` 1.
  """
  gcols = group_columns(df)
  metrics = [m for m in GROUP_METRICS if m in df.columns]
  unit = "seed" if "seed" in df.columns else None
  stat_cols = [c for m in metrics for c in (stats.centre(m, LOG_SCALE), f"{m}_ci_lo", f"{m}_ci_hi")]
  parts = []
  for key, g in stats.split(df, gcols):
    done = g[g["steps"] > 0]
    row = stats.group_stats(done, [], metrics, log_metrics=LOG_SCALE, unit_col=unit)
    if not len(done):
      row = pd.DataFrame([{"n_seeds": 0, "seeds": "", **{c: math.nan for c in stat_cols}}])
    for c, v in reversed(list(zip(gcols, key))):
      row.insert(0, c, [v])
    row.insert(len(gcols), "n_runs", [len(g)])
    parts.append(row)
  cols = [*gcols, "n_runs", "n_seeds", "seeds", *stat_cols]
  out = pd.concat(parts, ignore_index=True)[cols] if parts else pd.DataFrame(columns=cols)
  for c in gcols:
    if c in df.columns and str(df[c].dtype) == "Int64":
      out[c] = out[c].astype("Int64")
  out.attrs = {"group_columns": gcols, "metrics": metrics}
  return out


#: The metrics shown (in this order) in the groups and paired tables of summary.md,
#: led by the primary endpoint; groups.csv and paired.csv have every metric.
SHOWN_METRICS = [
  "eval_loss",
  "final_loss",
  "kl_bits",
  "spike_count",
  "max_grad_norm",
  "amax_fwd_composite_tok_mean_max",
  "amax_bwd_composite_tok_mean_max",
  "amax_fwd_composite_max",
  "amax_bwd_composite_max",
  "stream_spread_last",
  "stream_spread_mean",
]


def paired_table(df: pd.DataFrame) -> pd.DataFrame:
  """Paired comparisons between mixers by seed: for each group of the other identifying
  columns (depth, width, lr ...), each pair of mixers ``mixer_a`` before ``mixer_b`` (order:
  residual, hc, mhc, mhc_lite, then by name) and each of :data:`GROUP_METRICS`, the runs of
  the two mixers that share a seed are paired and the row holds ``scale``, ``n_pairs``,
  ``seeds``, ``mean_a``, ``mean_b``, the mean and 95% Student t interval of ``b - a``
  (``diff_mean``, ``diff_ci_lo``, ``diff_ci_hi``) or, for the :data:`LOG_SCALE` metrics, the
  geometric mean ratio ``b / a`` and its interval (``ratio_mean``, ``ratio_ci_lo``,
  ``ratio_ci_hi``; means geometric too), and ``significant`` (the interval clears 0, or 1,
  by more than rounding: :func:`mhc_jax.sweep.stats.significant`). Only runs with logged
  metrics count. An empty frame (with the columns) when fewer than two mixers have results.
  """
  options = _option_columns(df)
  context = [c for c in group_columns(df) if c != "mixer" and c not in options]
  metrics = [m for m in GROUP_METRICS if m in df.columns]
  cols = [*context, "mixer_a", "mixer_b", *stats.PAIRED_COLUMNS[2:]]
  if "mixer" not in df.columns:
    return pd.DataFrame(columns=cols)
  done = df[df["steps"] > 0]
  done = done.assign(mixer=arm_labels(done, options))
  if done["mixer"].nunique() < 2:
    return pd.DataFrame(columns=cols)
  out = stats.paired_stats(
    done,
    "mixer",
    context,
    metrics,
    log_metrics=LOG_SCALE,
    unit_col="seed",
    order=_mixer_order(done["mixer"]),
  )
  out = out.rename(columns={"a": "mixer_a", "b": "mixer_b"})[cols]
  out.attrs = {"context_columns": context}
  return out


def _ci_text(mean: float, lo: float, hi: float) -> str:
  if not math.isfinite(lo) or not math.isfinite(hi):
    return _fmt(mean)
  return f"{_fmt(mean)} [{_fmt(lo)}, {_fmt(hi)}]"


def _groups_display(groups: pd.DataFrame) -> pd.DataFrame:
  """The groups with "mean [ci_lo, ci_hi]" cells for the :data:`SHOWN_METRICS` (geometric means
  for the :data:`LOG_SCALE` ones, headed "<metric> (gmean)"), for summary.md."""
  out = groups[[*groups.attrs.get("group_columns", []), "n_seeds"]].copy()
  for m in SHOWN_METRICS:
    mid = stats.centre(m, LOG_SCALE)
    if mid not in groups.columns or not groups[mid].notna().any():
      continue
    head = f"{m} (gmean)" if m in LOG_SCALE else m
    out[head] = [
      _ci_text(a, b, c) for a, b, c in zip(groups[mid], groups[f"{m}_ci_lo"], groups[f"{m}_ci_hi"])
    ]
  return out


def _paired_display(paired: pd.DataFrame) -> pd.DataFrame:
  """One row per (context, mixer pair), one cell per :data:`SHOWN_METRICS` metric: "Δ <metric>"
  (b - a) or, on the log scale, "ratio <metric>" (b / a), as mean [95% CI] with a trailing *
  where the interval clears 0 (or 1) by more than rounding (``significant``)."""
  ctx = paired.attrs.get("context_columns", [])
  if not len(paired):
    return pd.DataFrame(columns=[*ctx, "mixer_a", "mixer_b", "n_pairs"])
  d = paired[paired["metric"].isin(SHOWN_METRICS)]
  cell = {m: ("ratio", "ratio") if m in LOG_SCALE else ("Δ", "diff") for m in SHOWN_METRICS}
  shown = [m for m in SHOWN_METRICS if d.loc[d["metric"] == m, f"{cell[m][1]}_mean"].notna().any()]
  rows = []
  for key, g in stats.split(d, [*ctx, "mixer_a", "mixer_b"]):
    row = dict(zip([*ctx, "mixer_a", "mixer_b"], key))
    row["n_pairs"] = int(g["n_pairs"].max())
    by = g.set_index("metric")
    for m in shown:
      word, col = cell[m]
      if m not in by.index:
        row[f"{word} {m}"] = ""
        continue
      mean, lo, hi = (float(by.loc[m, f"{col}_{k}"]) for k in ("mean", "ci_lo", "ci_hi"))
      star = " *" if bool(by.loc[m, "significant"]) else ""
      row[f"{word} {m}"] = _ci_text(mean, lo, hi) + star
    rows.append(row)
  return pd.DataFrame(
    rows,
    columns=[*ctx, "mixer_a", "mixer_b", "n_pairs", *(f"{cell[m][0]} {m}" for m in shown)],
  )


# =========================================================================== the sentence
#: Thresholds of :func:`finding` (what counts as a difference worth a sentence).
FINDING_RULES = {
  "learned_ratio": 0.25,  # a mixer "learned" where its KL is at most this fraction of the worst mixer's
  "learned_gap_bits": 0.1,  # ... and the worst is at least this many bits above it
  "growth_ratio": 1.5,  # a composite gain "grew" when deepest / shallowest >= this
  "flat_ratio": 1.2,  # ... and "stayed" within a band when max / min over depths <= this
  "loss_rel_gap": 0.03,  # final losses differ when the relative gap is at least 3%
}


def _num_series(s: pd.Series) -> np.ndarray:
  return pd.to_numeric(s, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)


def _g(v: float) -> str:
  """A number for a sentence: 3 significant digits, plain notation where reasonable."""
  if not math.isfinite(v):
    return _fmt(v)
  if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
    return f"{v:.2g}"
  return f"{v:.3g}"


def _band(lo: float, hi: float) -> str:
  """ "1.00–1.02": both ends with the decimals that tell them apart (2 to 4); one number where
  they agree to 4 decimals."""
  if abs(hi) >= 1e4 or abs(lo) >= 1e4:
    return f"{_g(lo)}–{_g(hi)}" if _g(lo) != _g(hi) else _g(lo)
  for dec in range(2, 5):
    if f"{lo:.{dec}f}" != f"{hi:.{dec}f}":
      return f"{lo:.{dec}f}–{hi:.{dec}f}"
  return f"{lo:.2f}"


def _join(names: list[str]) -> str:
  return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def finding(df: pd.DataFrame) -> str:
  """ONE plain sentence saying what differs between the mixers of a sweep, from the numbers
  of its summary table (:func:`summary_table`); never fixed text.

  Runs are compared within a *group*: equal values of every identifying column but the mixer
  and the seed (depth, width, lr ...), so the seeds of a group are the only runs averaged, and
  a sentence that quotes a group's numbers names it ("At width 32, ...") and says over how many
  runs or seed pairs. The first of these that the numbers show is said (thresholds in
  :data:`FINDING_RULES`): some mixer's runs diverged (final loss NaN/inf) and another's did not
  (counts of runs over the sweep); in a group, a mixer learned the wind tunnel (mean KL to the
  exact posterior at most 1/4 of the worst mixer's and 0.1 bits below it), with every mixer's
  count of runs that learned; a mixer's composite Amax gain (per-token mean where logged, else
  token-averaged; forward or backward, whichever grew more; geometric means over seeds) grew
  with depth by 1.5x or more while another's grew much less; a mixer had loss/gradient spikes
  and another none (totals over the sweep); in a group, the held-out loss (``eval_loss``; the
  final training loss where no run has one) differs by 3% or more, with seeds only where the
  group's paired 95% interval clears 0 (:func:`mhc_jax.sweep.stats.significant`), quoting that
  interval and counting the groups where it does. Otherwise it says the mixers did not differ
  clearly, with the ranges over all runs.
  """
  d = df[df["steps"] > 0] if "steps" in df.columns else df
  if not len(d):
    return "No run has logged metrics yet, so there is nothing to compare."
  options = _option_columns(df)
  if "mixer" in d.columns:
    d = d.assign(mixer=arm_labels(d, options))
  if "mixer" not in d.columns or d["mixer"].nunique() < 2:
    m = str(d["mixer"].iloc[0]) if "mixer" in d.columns else "one configuration"
    loss = _num_series(d["final_loss"])
    loss = loss[np.isfinite(loss)]
    tail = f" (final loss {_band(loss.min(), loss.max())})" if loss.size else ""
    return f"Only one mixer ({m}) has results{tail}, so there is no comparison between mixers."
  order = _mixer_order(d["mixer"])
  ctx = [
    c
    for c in group_columns(df)
    if c != "mixer" and c not in options and c in d.columns and d[c].map(stats._key).nunique() > 1
  ]
  for rule in (_finding_divergence, _finding_learning, _finding_growth, _finding_spikes):
    text = rule(d, order, ctx)
    if text:
      return text + "."
  paired = paired_table(df) if "seed" in d.columns and d["seed"].nunique() > 1 else None
  return (_finding_loss(d, order, ctx, paired) or _finding_none(d, order)) + "."


def _groups(d: pd.DataFrame, ctx: list[str]) -> list[tuple[tuple, pd.DataFrame]]:
  """``d`` split by the ``ctx`` columns, largest values first (deepest, widest)."""

  def rank(key: tuple) -> tuple:
    nums = _num_series(pd.Series(list(key), dtype=object))
    return tuple((-x if np.isfinite(x) else math.inf, str(v)) for x, v in zip(nums, key))

  return sorted(stats.split(d, ctx), key=lambda kv: rank(kv[0]))


def _label(ctx: list[str], key: tuple) -> str:
  """ "depth 8 and width 32" for a group (empty without group columns)."""
  return (
    _join([f"{c} {_g(float(v)) if _is_num(v) else v}" for c, v in zip(ctx, key)]) if ctx else ""
  )


def _is_num(v) -> bool:
  return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _head(ctx: list[str], key: tuple) -> str:
  """ "At depth 8, " (or nothing) in front of a sentence about one group."""
  return f"At {_label(ctx, key)}, " if ctx else ""


def _runs(n: int, unit: str = "run") -> str:
  return f"{n} {unit}{'s' if n != 1 else ''}"


def _means_over(ns: list[int], unit: str) -> str:
  """ "means over 3 seeds each", "means over 3 and 2 seeds", "one run each"."""
  if max(ns) == 1:
    return "one run each"
  if len(set(ns)) == 1:
    return f"means over {ns[0]} {unit}s each"
  return f"means over {_join([str(n) for n in ns])} {unit}s"


def _finding_divergence(d, order, ctx) -> str | None:
  bad = d.assign(_bad=~np.isfinite(_num_series(d["final_loss"])))
  counts = {m: (int(g["_bad"].sum()), len(g)) for m, g in bad.groupby("mixer")}
  if not any(k for k, _ in counts.values()) or len({k / n for k, n in counts.values()}) == 1:
    return None
  hit = [m for m in order if counts[m][0]]
  clean = [m for m in order if not counts[m][0]]
  parts = []
  for m in hit:
    k, n = counts[m]
    where = [_label(ctx, key) for key, g in _groups(bad[bad["mixer"] == m], ctx) if g["_bad"].any()]
    at = f" ({'; '.join(where)})" if ctx and where else ""
    parts.append(f"{m} diverged in {k} of {n} runs{at}")
  text = _join(parts)
  if clean:
    text += f" while {_join(clean)} never did"
  return text


def _finding_learning(d, order, ctx) -> str | None:
  if "kl_bits" not in d.columns:
    return None
  r = FINDING_RULES
  for key, g in _groups(d, ctx):
    kl = {m: _num_series(gm["kl_bits"]) for m, gm in g.groupby("mixer")}
    mean = {m: float(np.mean(v)) for m, v in kl.items() if v.size and np.isfinite(v).all()}
    if len(mean) < 2:
      continue
    worst, best = max(mean.values()), min(mean.values())
    if best > r["learned_ratio"] * worst or worst - best < r["learned_gap_bits"]:
      continue
    bar = min(r["learned_ratio"] * worst, worst - r["learned_gap_bits"])
    ranked = sorted((m for m in order if m in mean), key=lambda m: mean[m])
    learned = {m: int((kl[m] <= bar).sum()) for m in ranked}
    if max(len(kl[m]) for m in ranked) == 1:  # one run each: learned or not
      good = [m for m in ranked if learned[m]]
      poor = [m for m in ranked if not learned[m] and mean[m] >= 0.75 * worst]
      mid = [m for m in ranked if m not in good and m not in poor]
      bits = lambda ms: _join([_g(mean[m]) for m in ms])  # noqa: E731
      text = (
        f"{_head(ctx, key)}{_join(good)} learned the task (KL {bits(good)} bits to the exact "
        f"posterior) while {_join(poor)} did not ({bits(poor)} bits)"
      )
      return text + (f", with {_join(mid)} in between ({bits(mid)} bits)" if mid else "")
    first, rest = ranked[0], ranked[1:]
    text = (
      f"{_head(ctx, key)}{first} learned the task in {learned[first]} of {len(kl[first])} runs "
      f"(mean KL {_g(mean[first])} bits to the exact posterior)"
    )
    others = [f"{m} in {learned[m]} of {len(kl[m])} (mean {_g(mean[m])} bits)" for m in rest]
    return text + ", " + _join(others)
  return None


def _finding_growth(d, order, ctx) -> str | None:
  if "depth" not in ctx:
    return None
  rest_ctx = [c for c in ctx if c != "depth"]
  for key, g in _groups(d, rest_ctx):
    text = _growth_in(g.assign(_depth=_num_series(g["depth"])), order)
    if text:
      return _head(rest_ctx, key) + text
  return None


def _growth_in(d: pd.DataFrame, order: list[str]) -> str | None:
  r = FINDING_RULES
  best = None
  for kind, pattern in (
    ("per-token", "amax_{}_composite_tok_mean_max"),
    ("token-averaged", "amax_{}_composite_max"),
  ):
    for direction in ("fwd", "bwd"):
      col = pattern.format(direction)
      if col not in d.columns:
        continue
      tab = (  # geometric mean over the seeds of each mixer and depth
        d.assign(_v=_num_series(d[col]))
        .groupby(["mixer", "_depth"])["_v"]
        .apply(lambda v: stats.mean_ci(v, log=True)[0])
        .unstack()
      )
      tab = tab[[c for c in tab.columns if np.isfinite(c)]]
      if tab.shape[1] < 2:
        continue
      lo_d, hi_d = min(tab.columns), max(tab.columns)
      ok = tab[np.isfinite(tab[lo_d]) & np.isfinite(tab[hi_d]) & (tab[lo_d] > 0)]
      if len(ok) < 2:
        continue
      ratio = ok[hi_d] / ok[lo_d]
      top = ratio.idxmax()
      if ratio[top] < r["growth_ratio"] or ok.loc[top, hi_d] < r["growth_ratio"]:
        continue
      if best is None or (kind == best[0] and ratio[top] > best[4][best[3]]):
        best = (kind, direction, ok, top, ratio, lo_d, hi_d)
    if best is not None:
      break  # prefer the per-token measure where it shows the growth
  if best is None:
    return None
  kind, direction, ok, top, ratio, lo_d, hi_d = best
  rest = [
    m for m in order if m in ok.index and m != top and ratio[m] * r["growth_ratio"] <= ratio[top]
  ]
  if not rest:
    return None
  word = {"fwd": "forward", "bwd": "backward"}[direction]
  text = (
    f"{top}'s {kind} {word} composite gain grew from {_g(ok.loc[top, lo_d])} at depth {_g(lo_d)} to "
    f"{_g(ok.loc[top, hi_d])} at depth {_g(hi_d)}"
  )
  flat = []
  for m in rest:
    vals = ok.loc[m].to_numpy(dtype=float)
    vals = vals[np.isfinite(vals) & (vals > 0)]
    if vals.size and vals.max() / vals.min() <= r["flat_ratio"]:
      flat.append((m, vals.min(), vals.max()))
  if flat:
    lo = min(v for _, v, _ in flat)
    hi = max(v for _, _, v in flat)
    names = [f"{m}'s" for m, _, _ in flat]
    band = _band(lo, hi)
    text += f" while {_join(names)} stayed " + (f"within {band}" if "–" in band else f"at {band}")
  else:
    m = min(rest, key=lambda x: ratio[x])
    text += f" while {m}'s went only from {_g(ok.loc[m, lo_d])} to {_g(ok.loc[m, hi_d])}"
  sizes = d[d["mixer"].isin([top, *rest])].groupby(["mixer", "_depth"]).size()
  if sizes.max() > 1:
    n = f"{sizes.min()}-{sizes.max()}" if sizes.min() != sizes.max() else str(sizes.max())
    text += f" (geometric means over {n} seeds per mixer and depth)"
  return text


def _finding_spikes(d, order, ctx) -> str | None:
  if "spike_count" not in d.columns:
    return None
  sc = d.assign(_s=_num_series(d["spike_count"]))
  tot = {m: (float(np.nansum(g["_s"])), len(g)) for m, g in sc.groupby("mixer")}
  most = max(order, key=lambda m: tot[m][0])
  none = [m for m in order if tot[m][0] == 0]
  if tot[most][0] < 2:
    return None
  runs = lambda m: _runs(tot[m][1])  # noqa: E731
  if none:
    return (
      f"{most} had {int(tot[most][0])} loss/gradient spikes in its {runs(most)} while "
      f"{_join(none)} had none"
    )
  least = min(order, key=lambda m: tot[m][0])
  if tot[most][0] >= 3 * tot[least][0] and tot[most][0] - tot[least][0] >= 3:
    return (
      f"{most} had {int(tot[most][0])} loss/gradient spikes in its {runs(most)}, {least} only "
      f"{int(tot[least][0])} in {runs(least)}"
    )
  return None


def _endpoint(d: pd.DataFrame) -> tuple[str, str]:
  """(column, words) of the loss the sentence compares: held-out where any run has it."""
  if "eval_loss" in d.columns and np.isfinite(_num_series(d["eval_loss"])).any():
    return "eval_loss", "held-out loss"
  return "final_loss", "final training loss"


def _finding_loss(d, order, ctx, paired: pd.DataFrame | None) -> str | None:
  """The loss rule of :func:`finding`; ``paired``: :func:`paired_table` of the sweep (None
  without seeds)."""
  col, what = _endpoint(d)
  unit = "seed" if "seed" in d.columns else "run"
  if paired is not None:
    paired = paired[paired["metric"] == col] if len(paired) else None

  def row_for(key, a, b):
    if paired is None:
      return None
    sel = paired[paired["mixer_a"].isin([a, b]) & paired["mixer_b"].isin([a, b])]
    for c, v in zip(ctx, key):
      sel = sel[sel[c].map(stats._key) == stats._key(v)]
    return sel.iloc[0] if len(sel) and sel["n_pairs"].iloc[0] > 1 else None

  for key, g in _groups(d, ctx):
    vals = {m: _num_series(gm[col]) for m, gm in g.groupby("mixer")}
    mean = pd.Series({m: float(np.mean(v)) for m, v in vals.items()})
    mean = mean[np.isfinite(mean)]
    if len(mean) < 2:
      continue
    lo_m, hi_m = mean.idxmin(), mean.idxmax()
    if (mean[hi_m] - mean[lo_m]) < FINDING_RULES["loss_rel_gap"] * abs(mean[lo_m]):
      continue
    head = _head(ctx, key)
    means = f"{_g(mean[lo_m])} vs {_g(mean[hi_m])} nats per token"
    over = _means_over([len(vals[lo_m]), len(vals[hi_m])], unit)
    row = row_for(key, lo_m, hi_m)
    if row is None:
      if max(len(vals[lo_m]), len(vals[hi_m])) > 1 and paired is not None:
        continue  # seeds, but no pairs to tell the difference from seed noise
      return f"{head}{lo_m} reached a lower {what} than {hi_m} ({means}, {over})"
    if not row["significant"]:
      continue  # not distinguishable from seed noise
    sign = 1 if row["mixer_b"] == hi_m else -1
    lo, hi = sorted((sign * float(row["diff_ci_lo"]), sign * float(row["diff_ci_hi"])))
    text = (
      f"{head}{lo_m} reached a lower {what} than {hi_m}: {means} ({over}); paired difference "
      f"{hi_m} - {lo_m} {sign * float(row['diff_mean']):+.3g} nats, 95% CI [{_g(lo)}, {_g(hi)}], "
      f"n = {int(row['n_pairs'])} seed pairs"
    )
    keys = [k for k, _ in _groups(d, ctx)]
    rows = [row_for(k, lo_m, hi_m) for k in keys]
    rows = [r for r in rows if r is not None]
    if len(rows) > 1:
      same = sum(
        bool(r["significant"]) and (1 if r["mixer_b"] == hi_m else -1) * r["diff_mean"] > 0
        for r in rows
      )
      where = f"{ctx[0]}s" if len(ctx) == 1 else "groups"
      text += f"; the paired interval excludes 0 at {same} of {len(rows)} {where}"
    return text
  return None


def _finding_none(d, order) -> str:
  parts = []
  col, what = _endpoint(d)
  loss = _num_series(d[col])
  loss = loss[np.isfinite(loss)]
  if loss.size:
    parts.append(f"{what}es {_band(loss.min(), loss.max())} nats")
  if "kl_bits" in d.columns:
    kl = _num_series(d["kl_bits"])
    kl = kl[np.isfinite(kl)]
    if kl.size:
      parts.append(f"KL {_band(kl.min(), kl.max())} bits")
  for c, name in (
    ("amax_fwd_composite_tok_mean_max", "per-token composite gains"),
    ("amax_fwd_composite_max", "token-averaged composite gains"),
  ):
    if c in d.columns:
      g = _num_series(d[c])
      g = g[np.isfinite(g)]
      if g.size:
        parts.append(f"{name} {_band(g.min(), g.max())}")
        break
  if "spike_count" in d.columns:
    n = float(np.nansum(_num_series(d["spike_count"])))
    parts.append("no spikes" if n == 0 else f"{int(n)} spikes in all")
  return f"The mixers did not differ clearly over {_runs(len(d))}: " + (
    ", ".join(parts) if parts else "no comparable numbers"
  )


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
    v = float(v)
    if math.isinf(v):
      return "inf" if v > 0 else "-inf"
    return f"{v:.4g}"
  return str(v)


def _absent(df: pd.DataFrame, r: pd.Series) -> set:
  """The columns of row ``r`` whose metric its run's logs do not have (``attrs["not_logged"]``)."""
  nl = df.attrs.get("not_logged") or {}
  return set(nl.get(r["run"], ())) if "run" in r.index and isinstance(r["run"], str) else set()


def md_table(df: pd.DataFrame) -> str:
  if df.empty:
    return "_(no rows)_\n"
  esc = lambda s: s.replace("|", "\\|").replace("\n", " ")  # noqa: E731
  lines = [
    "| " + " | ".join(esc(str(c)) for c in df.columns) + " |",
    "| " + " | ".join("---" for _ in df.columns) + " |",
  ]
  for _, r in df.iterrows():
    absent = _absent(df, r)
    lines.append(
      "| " + " | ".join(esc("n/a" if c in absent else _fmt(v)) for c, v in r.items()) + " |"
    )
  return "\n".join(lines) + "\n"


def _composite_note() -> str:
  return (
    "Composite gains, side by side: "
    + COMPOSITE_SENTENCES["token-averaged"]
    + " "
    + COMPOSITE_SENTENCES["per-token"]
  )


#: The columns the sweep command prints (after the run's identifying columns); summary.csv has
#: every column.
SCREEN_COLUMNS = [
  "status",
  "eval_loss",
  "kl_bits",
  "spike_count",
  "amax_fwd_composite_max",
  "amax_fwd_composite_tok_mean_max",
]


def screen(sweep_dir: str | os.PathLike) -> str:
  """What a sweep prints when it ends: one row per run with the run's axes and the
  :data:`SCREEN_COLUMNS` that some run has, the sentence (:func:`finding`) and where the full
  table is."""
  table = summary_table(sweep_dir)
  ids = [c for c in table.attrs["id_columns"] if c != "run" and c in table.attrs["axes"].values()]
  shown = [c for c in SCREEN_COLUMNS if table[c].notna().any() or c == "status"]
  out = storage.path(sweep_dir) / "report" / "summary.csv"
  return (
    md_table(table[(ids or ["run"]) + shown])
    + finding(table)
    + f"\nEvery column, with its definition: {out} and summary.md beside it."
  )


def write_report(
  sweep_dir: str | os.PathLike,
  out_dir: str | os.PathLike | None = None,
  *,
  max_heatmaps: int = 6,
  dpi: int = 110,
) -> dict[str, str]:
  """Write the sweep report; returns ``{name: path}`` of every file written.

  ``out_dir`` defaults to ``<sweep_dir>/report``. Files: ``summary_md``, ``summary_csv``,
  ``groups_csv`` (:func:`groups_table`: mean and 95% interval over seeds per group),
  ``paired_csv`` (:func:`paired_table`: paired differences between mixers by seed; only with
  two or more mixers), ``lr_sensitivity_csv`` (only with an lr axis) and one key per PNG
  (``loss_curves``, ``grad_norms``, ``amax_vs_depth``, ``stream_spread``, ``lr_sensitivity``,
  ``heatmap:<run>``); a plot with nothing to show is not written and summary.md says why.
  Prints nothing.
  """
  from mhc_jax.sweep import plots  # matplotlib only when plotting

  sweep_dir = storage.path(sweep_dir)
  out = storage.path(out_dir) if out_dir is not None else sweep_dir / "report"
  out.mkdir(parents=True, exist_ok=True)
  table = summary_table(sweep_dir)
  lr_tab = lr_sensitivity_table(table)
  groups = groups_table(table)
  paired = paired_table(table)
  sentence = finding(table)
  paths: dict[str, str] = {}

  # ----------------------------------------------------------- frames for the plots
  keep = [
    "step",
    "loss",
    "grad_norm",
    "gain_fwd",
    "amax_fwd_composite",
    "amax_bwd_composite",
    "amax_fwd_composite_tok_mean",
    "amax_bwd_composite_tok_mean",
    "stream_spread",
  ]
  frames, evs = [], []
  for name, rdir in table.attrs["run_dirs"].items():
    if not (storage.path(rdir) / "metrics.jsonl").exists():
      continue
    m = load_run(rdir)
    m.attrs = {}  # pandas deep-copies attrs on every operation; the plots do not need them
    if len(m):
      frames.append(m[[c for c in keep if c in m.columns]].assign(run=name))
    e = load_events(rdir)
    e.attrs = {}
    if len(e):
      evs.append(e[["step", "kind", "value"]].assign(run=name))
  metrics = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["run", *keep])
  events = (
    pd.concat(evs, ignore_index=True)
    if evs
    else pd.DataFrame(columns=["run", "step", "kind", "value"])
  )
  runs = table.copy()

  figures: list[tuple[list[str], str, str]] = []  # (keys in paths, title, caption)
  missing: list[str] = []
  info = plots.describe(runs)

  p = plots.loss_curves(metrics, runs, events, out / "loss_curves.png", dpi=dpi)
  if p:
    paths["loss_curves"] = str(p)
    figures.append((["loss_curves"], "Training loss", plots.CAPTIONS["loss_curves"].format(**info)))
  else:
    missing.append("No loss curves: no run has logged a finite loss yet.")
  p = plots.grad_norm_curves(metrics, runs, events, out / "grad_norms.png", dpi=dpi)
  if p:
    paths["grad_norms"] = str(p)
    figures.append((["grad_norms"], "Gradient norm", plots.CAPTIONS["grad_norms"].format(**info)))
  else:
    missing.append("No gradient-norm curves: no run has logged a finite grad_norm.")
  p = plots.composite_gain_vs_depth(metrics, runs, out / "amax_vs_depth.png", dpi=dpi)
  if p:
    paths["amax_vs_depth"] = str(p)
    figures.append(
      (
        ["amax_vs_depth"],
        "Composite Amax gain against depth",
        plots.CAPTIONS["amax_vs_depth"].format(**info),
      )
    )
  else:
    missing.append(
      "No composite Amax gain plot: no run has logged amax_fwd_composite / amax_bwd_composite "
      "(or no depth is known)."
    )
  p = plots.stream_spread_vs_layer(metrics, runs, out / "stream_spread.png", dpi=dpi)
  if p:
    paths["stream_spread"] = str(p)
    figures.append(
      (
        ["stream_spread"],
        "Stream spread against layer",
        plots.CAPTIONS["stream_spread"].format(**info),
      )
    )
  else:
    missing.append(
      "No stream spread plot: no run has logged stream_spread (logs written before it existed, "
      "or mixers whose state is not streams)."
    )
  if has_lr_axis(table):
    p = plots.lr_sensitivity_curves(runs, lr_tab, out / "lr_sensitivity.png", dpi=dpi)
    if p:
      paths["lr_sensitivity"] = str(p)
      figures.append(
        (
          ["lr_sensitivity"],
          "Learning-rate sensitivity",
          plots.CAPTIONS["lr_sensitivity"].format(**info),
        )
      )
    else:
      missing.append("No LR-sensitivity plot: no run on the lr grid has finished logging.")
  else:
    missing.append(
      "This sweep has no learning-rate axis (fewer than two distinct lr values), so there "
      "is no LR-sensitivity table or plot."
    )
  chosen = plots.pick_heatmap_runs(metrics, runs, max_heatmaps)
  heat = []
  for name in chosen:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
    p = plots.layer_heatmap(
      metrics[metrics["run"] == name],
      runs[runs["run"] == name].iloc[0],
      out / f"heatmap_{safe}.png",
      dpi=dpi,
    )
    if p:
      paths[f"heatmap:{name}"] = str(p)
      heat.append(f"heatmap:{name}")
  if heat:
    figures.append(
      (
        heat,
        "Per-layer gains over training",
        plots.CAPTIONS["heatmap"].format(**info, n_heatmaps=len(heat), max_heatmaps=max_heatmaps),
      )
    )
  if not chosen:
    missing.append(
      "No per-layer heatmaps: no run has logged per-layer gain_fwd / amax_fwd_composite."
    )

  # ----------------------------------------------------------- notes on missing data
  no_metrics = table[table["steps"] == 0]
  for _, r in no_metrics.iterrows():
    missing.append(
      f"Run {r['run']} ({r['status']}) has no metrics yet: listed in the table, not plotted."
    )
  for _, r in table[(table["steps"] > 0) & ~np.isfinite(table["final_loss"])].iterrows():
    missing.append(
      f"Run {r['run']}: final_loss is {_fmt(r['final_loss'])} ({r['note']}); curves stop at "
      "the last finite point."
    )
  no_hres = set(table.loc[table["note"].astype(str).str.contains("no H_res"), "run"])
  lacking = [
    n
    for n, cols in table.attrs.get("not_logged", {}).items()
    if n in set(table.loc[table["steps"] > 0, "run"]) and cols and n not in no_hres
  ]
  if lacking:
    names = sorted({LATER_COLUMNS[c][0] for n in lacking for c in table.attrs["not_logged"][n]})
    missing.append(
      f"{len(lacking)} of {int((table['steps'] > 0).sum())} runs with metrics have logs without "
      f"{', '.join(names)} (written before these metrics existed, or for stream_spread a mixer "
      "whose state is not streams): those cells read n/a, and their group means are NaN."
    )

  # ----------------------------------------------------------- tables
  for name, frame, always in (
    ("summary", table, True),
    ("lr_sensitivity", lr_tab, False),
    ("groups", groups, True),
    ("paired", paired, False),
  ):
    if always or len(frame):
      csv_path = out / f"{name}.csv"
      storage.write_text_atomic(csv_path, frame.to_csv(index=False, na_rep="NaN"))
      paths[f"{name}_csv"] = str(csv_path)
  n_seeds_max = int(groups["n_seeds"].max()) if len(groups) else 0
  group_text = (
    f"Runs that differ only in the seed, grouped ({len(groups)} groups, up to {n_seeds_max} seeds "
    f"each). Cells are mean [95% CI] over the group's seeds: {stats.METHOD}. Columns marked (gmean) "
    f"are on the {stats.LOG_METHOD} (gains, "
    "gradient norms and stream spreads are positive and heavy-tailed; their raw-scale interval "
    "covers the mean less than half the time for spreads like HC's, docs/statistics.md). The t "
    "interval is used rather than a bootstrap because with 3-5 seeds a percentile bootstrap is far "
    "too narrow (its 95% interval covers the mean about 73% of the time for 3 seeds); a NaN or inf "
    "in any seed makes the mean NaN/inf and the interval NaN, and one seed has no interval. The "
    "held-out loss (eval_loss) is the primary endpoint, the final training loss secondary. "
    "groups.csv has every metric as <metric>_mean (or <metric>_gmean), <metric>_ci_lo, "
    "<metric>_ci_hi and n_seeds."
  )
  paired_text = (
    "Paired comparisons between mixers: runs of two mixers that share a seed (and every other axis) "
    "are paired. A Δ cell is mixer_b's value minus mixer_a's, mean [95% Student t interval] over the "
    "n_pairs pairs; a ratio cell (gains, gradient norms, stream spreads) is mixer_b's value over "
    "mixer_a's, the geometric mean of the per-seed ratios [its 95% interval, from the t interval of "
    "the log ratios]. * marks an interval that clears 0 (a ratio: 1) by more than rounding "
    f"({stats.SIGNIFICANCE_RTOL:g} of the values' scale), a difference the seeds cannot explain. "
    "paired.csv has every metric, with mean_a and mean_b."
  )
  if len(paired) == 0:
    missing.append("No paired differences: fewer than two mixers have results.")

  counts = table["status"].value_counts().to_dict()
  status_line = ", ".join(f"{v} {k}" for k, v in counts.items()) or "no runs"
  axes_line = ", ".join(f"{c} ({k})" for k, c in table.attrs["axes"].items()) or "none"
  context = [c for c in table.attrs["id_columns"][1:] if c not in table.attrs["axes"].values()]
  defs = {
    "run": "run name in the manifest",
    **{c: f"sweep axis {k}" for k, c in table.attrs["axes"].items()},
    **{c: f"{_CONFIG_KEYS[c]} from the run's config.yaml (not a sweep axis)" for c in context},
    **COLUMN_DOCS,
  }

  md = [
    f"# Sweep report: {_name(sweep_dir)}",
    "",
    f"{len(table)} runs ({status_line}). Sweep axes: {axes_line}.",
    "",
    f"**{sentence}**",
    "",
    "## Runs",
    "",
    _composite_note(),
    "",
    md_table(shown_columns(table)),
  ]
  if n_seeds_max > 1 or len(paired):
    md += ["## Groups over seeds", "", group_text, "", md_table(_groups_display(groups))]
  if len(paired):
    shown = _paired_display(paired)
    md += [
      "## Paired differences between mixers",
      "",
      paired_text,
      "",
      md_table(shown) if len(shown) else "_(no pairs with finite values)_\n",
    ]
  if len(lr_tab):
    md += [
      "## Learning-rate sensitivity",
      "",
      "Wortsman et al.: mean over the lr grid of min(final_loss, loss_init) - its minimum; lower is "
      "more robust to the choice of lr.",
      "",
      md_table(lr_tab),
    ]
  if missing:
    md += ["## Missing or non-finite", ""] + [f"- {m}" for m in missing] + [""]
  md += ["## Figures", ""]
  for keys, title, caption in figures:
    imgs = " ".join(f"![{title}]({storage.path(paths[k]).name})" for k in keys)
    md += [f"### {title}", "", imgs, "", caption, ""]
  md += ["## Column definitions", ""] + [f"- `{k}`: {v}" for k, v in defs.items()] + [""]
  md_path = out / "summary.md"
  storage.write_text_atomic(md_path, "\n".join(md))
  paths["summary_md"] = str(md_path)

  return paths
