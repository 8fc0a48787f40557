"""Sweep report: one summary row per run, LR sensitivity, plots and a static HTML page.

``summarize_run(run_dir)`` reduces one run directory (docs/interfaces.md layout) to a dict of
numbers, ``summary_table(sweep_dir)`` makes that a DataFrame with one row per run in the
sweep manifest (sweep axes in front), ``lr_sensitivity_table(df)`` computes Wortsman et al.'s
LR sensitivity for every group of runs that differ only in the learning rate, and
``write_report(sweep_dir)`` writes ``report/`` with ``summary.md``, ``summary.csv``,
``lr_sensitivity.csv`` (when there is an lr axis), PNG plots and ``index.html``.

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

import datetime as _dt
import html
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd

from mhc_jax.logs import flatten_dict, load_events, load_run, read_jsonl
from mhc_jax.spikes import lr_sensitivity

__all__ = [
    "FINAL_FRACTION",
    "COLUMN_DOCS",
    "final_loss_of",
    "summarize_run",
    "summary_table",
    "lr_sensitivity_table",
    "write_report",
]

#: Fraction of the logged losses averaged into ``final_loss`` (at least one value).
FINAL_FRACTION = 0.05

#: The metric columns of :func:`summary_table`, in order, with their exact definitions.
COLUMN_DOCS: dict[str, str] = {
    "status": "the manifest's status (done | failed | running | pending); summary.json's status where "
    "the manifest has none",
    "steps": "last logged step in metrics.jsonl (0 when nothing is logged)",
    "loss_init": "first logged loss",
    "final_loss": "mean of the last 5% of the logged losses (ceil(n/20), at least 1); NaN/inf if any "
    "of them is",
    "min_loss": "minimum over the finite logged losses",
    "spike_count": "number of events of kind spike/* in events.jsonl (a step where loss and grad norm "
    "both spike counts twice); NA for a run with no metrics",
    "spike_score": "last logged spike_score (fraction of spike steps in the trailing window)",
    "max_grad_norm": "maximum logged grad_norm (before clipping) over steps, NaN entries ignored, inf kept",
    "amax_fwd_composite_max": "max over steps of the last layer's amax_fwd_composite, i.e. the forward Amax "
    "gain (max |row sum|) of the whole-depth product of H_res",
    "amax_bwd_composite_max": "the same for amax_bwd_composite (max |column sum|)",
    "amax_fwd_composite_max_all_layers": "max of amax_fwd_composite over all layers and steps (partial "
    "products included)",
    "amax_bwd_composite_max_all_layers": "max of amax_bwd_composite over all layers and steps",
    "growth_exponent": "last logged growth_exponent (activations, (1/L) ln(RMS(x_L)/RMS(x_0)))",
    "kl_bits": "last logged eval/kl_bits (KL to the exact posterior, bits; wind tunnels only, else NaN)",
    "nonfinite": "last logged nonfinite counter (non-finite steps); where never logged, the number of "
    "logged non-finite losses; NA for a run with no metrics",
    "note": "what is missing or went wrong: no metrics yet, first non-finite loss, divergence event, "
    "summary.json status",
}
METRIC_COLUMNS = list(COLUMN_DOCS)

# Canonical short names for the sweep axes the plots need: role -> accepted last key parts.
_ROLES: dict[str, tuple[str, ...]] = {
    "mixer": ("mixer",),
    "depth": ("depth", "n_layers", "num_layers"),
    "width": ("width", "d_model"),
    "lr": ("lr", "learning_rate", "peak_lr"),
    "seed": ("seed",),
}
# Where the resolved config holds each role (for runs where it is not a sweep axis).
_CONFIG_KEYS = {"mixer": "model.mixer", "depth": "model.depth", "width": "model.width", "lr": "optim.lr",
                "seed": "train.seed"}


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
    prefers the manifest's.
    """
    run_dir = Path(run_dir)
    records = _merged(run_dir / "metrics.jsonl")
    events = load_events(run_dir) if (run_dir / "events.jsonl").exists() else None
    summary = _read_summary(run_dir)

    loss_steps, losses = _scalars(records, "loss")
    _, grads = _scalars(records, "grad_norm")
    out: dict[str, Any] = {"status": summary.get("status")}
    out["steps"] = int(records[-1]["step"]) if records else 0
    out["loss_init"] = _last(losses[:1])
    out["final_loss"] = final_loss_of(losses)
    finite = losses[np.isfinite(losses)]
    out["min_loss"] = float(finite.min()) if finite.size else math.nan
    kinds = events["kind"].astype(str) if events is not None and len(events) else pd.Series([], dtype=str)
    out["spike_count"] = int(kinds.str.startswith("spike/").sum())
    out["spike_score"] = _last(_scalars(records, "spike_score")[1])
    out["max_grad_norm"] = _nanmax(grads)
    for d in ("fwd", "bwd"):
        lists = _layer_lists(records, f"amax_{d}_composite")
        out[f"amax_{d}_composite_max"] = _nanmax(np.array([x[-1] for x in lists]))
        out[f"amax_{d}_composite_max_all_layers"] = _nanmax(np.concatenate(lists)) if lists else math.nan
    out["growth_exponent"] = _last(_scalars(records, "growth_exponent")[1])
    out["kl_bits"] = _last(_scalars(records, "eval/kl_bits")[1])
    _, nf = _scalars(records, "nonfinite")
    out["nonfinite"] = int(nf[-1]) if len(nf) and np.isfinite(nf[-1]) else int((~np.isfinite(losses)).sum())

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
        notes.append("no per-layer diagnostics")
    if summary.get("status") not in (None, "done"):
        notes.append(f"summary.json: {summary['status']}")
    out["note"] = "; ".join(notes)
    return {k: out[k] for k in METRIC_COLUMNS}


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
        return {sweep_dir.resolve().name: {"status": status, "overrides": {}, "dir": "."}}
    raise FileNotFoundError(f"{sweep_dir}: neither a sweep (manifest.json) nor a run directory")


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
    ``status``, which identify a run), ``run_dirs`` (run -> path), ``sweep_dir``.
    """
    sweep_dir = Path(sweep_dir)
    runs = _sweep_runs(sweep_dir)
    keys: list[str] = []
    for info in runs.values():
        for k in info.get("overrides") or {}:
            if k not in keys:
                keys.append(k)
    axes = _axis_columns(keys)
    rows, configs, run_dirs = [], {}, {}
    for name, info in runs.items():
        rdir = sweep_dir / (info.get("dir") or name)
        run_dirs[name] = str(rdir)
        cfg = _read_config(rdir)
        configs[name] = cfg
        overrides = info.get("overrides") or {}
        row: dict[str, Any] = {"run": name}
        row.update({col: _cell(overrides.get(k, cfg.get(k))) for k, col in axes.items()})
        stats = summarize_run(rdir)
        if info.get("status"):
            stats["status"] = info["status"]
        elif stats["status"] is None:
            stats["status"] = "unknown"
        row["_stats"] = stats
        rows.append(row)
    context = [r for r in _ROLES if r not in axes.values() and any(_CONFIG_KEYS[r] in c for c in configs.values())]
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
    df.attrs = {"axes": axes, "id_columns": id_cols, "run_dirs": run_dirs, "sweep_dir": str(sweep_dir)}
    return df


def _id_columns(df: pd.DataFrame) -> list[str]:
    ids = df.attrs.get("id_columns")
    if ids:
        return [c for c in ids if c in df.columns]
    return list(df.columns[: df.columns.get_loc("status")]) if "status" in df.columns else ["run"]


def has_lr_axis(df: pd.DataFrame) -> bool:
    """True when the table has an ``lr`` column with at least two distinct learning rates."""
    return "lr" in df.columns and pd.to_numeric(df["lr"], errors="coerce").dropna().nunique() >= 2


LR_COLUMNS = ["n_lr", "lrs", "best_lr", "best_final_loss", "loss_init", "n_diverged", "lr_sensitivity"]


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
        rows.append({
            **dict(zip(group_cols, key)),
            "n_lr": n_lr,
            "lrs": ", ".join(f"{x:g}" for x in per_lr.index),
            "best_lr": float(finite.idxmin()) if len(finite) else math.nan,
            "best_final_loss": float(finite.min()) if len(finite) else math.nan,
            "loss_init": loss_init,
            "n_diverged": int((~np.isfinite(per_lr)).sum()),
            "lr_sensitivity": sens,
        })
    out = pd.DataFrame(rows, columns=[*group_cols, *LR_COLUMNS])
    out.attrs = {"group_columns": group_cols}
    return out


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


def _md_table(df: pd.DataFrame) -> str:
    if df.empty:
        return "_(no rows)_\n"
    esc = lambda s: s.replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(esc(str(c)) for c in df.columns) + " |",
             "| " + " | ".join("---" for _ in df.columns) + " |"]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(esc(_fmt(v)) for v in r.tolist()) + " |")
    return "\n".join(lines) + "\n"


def _html_table(df: pd.DataFrame, cls: str = "runs") -> str:
    if df.empty:
        return "<p><em>(no rows)</em></p>"
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    body = []
    for _, r in df.iterrows():
        status = r.get("status") if "status" in df.columns else None
        rcls = f' class="status-{html.escape(str(status))}"' if isinstance(status, str) else ""
        cells = []
        for c, v in zip(df.columns, r.tolist()):
            bad = isinstance(v, (float, np.floating)) and not math.isfinite(float(v)) and c not in ("kl_bits",)
            num = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
            klass = " ".join(k for k, on in (("num", num), ("bad", bad and r.get("steps", 1) != 0)) if on)
            attr = f' class="{klass}"' if klass else ""
            cells.append(f"<td{attr}>{html.escape(_fmt(v))}</td>")
        body.append(f"<tr{rcls}>" + "".join(cells) + "</tr>")
    return (f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>\n' + "\n".join(body)
            + "\n</tbody></table>")


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:2em auto;max-width:1400px;
 padding:0 1.5em;color:#222;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em} h2{margin-top:2em;border-bottom:1px solid #ddd;padding-bottom:.2em}
.meta{color:#666} .note{background:#fff8e1;border-left:4px solid #f0b400;padding:.5em 1em;margin:1em 0}
.scroll{overflow-x:auto} table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
th,td{border:1px solid #ddd;padding:.25em .5em;white-space:nowrap} th{background:#f3f3f3;position:sticky;top:0}
td.num{text-align:right;font-variant-numeric:tabular-nums} td.bad{color:#b00020;font-weight:600}
tr.status-pending td,tr.status-running td{color:#777} tr.status-failed td:first-child{color:#b00020}
tbody tr:nth-child(even){background:#fafafa}
figure{margin:1.5em 0} figure img{max-width:100%;border:1px solid #eee}
figcaption{color:#444;max-width:75em;margin-top:.4em} dt{font-family:monospace;font-weight:600}
dd{margin:0 0 .4em 1.5em}
"""


def write_report(sweep_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None, *,
                 max_heatmaps: int = 6, dpi: int = 110) -> dict[str, str]:
    """Write the sweep report; returns ``{name: path}`` of every file written.

    ``out_dir`` defaults to ``<sweep_dir>/report``. Files: ``summary_md``, ``summary_csv``,
    ``index_html``, ``lr_sensitivity_csv`` (only with an lr axis) and one key per PNG
    (``loss_curves``, ``grad_norms``, ``amax_vs_depth``, ``lr_sensitivity``,
    ``heatmap:<run>``); a plot with nothing to show is not written and the page says why.
    Prints nothing.
    """
    from mhc_jax.sweep import plots  # matplotlib only when plotting

    sweep_dir = Path(sweep_dir)
    out = Path(out_dir) if out_dir is not None else sweep_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    table = summary_table(sweep_dir)
    lr_tab = lr_sensitivity_table(table)
    paths: dict[str, str] = {}

    # ----------------------------------------------------------- frames for the plots
    keep = ["step", "loss", "grad_norm", "gain_fwd", "amax_fwd_composite", "amax_bwd_composite"]
    frames, evs = [], []
    for name, rdir in table.attrs["run_dirs"].items():
        if not (Path(rdir) / "metrics.jsonl").exists():
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
    events = pd.concat(evs, ignore_index=True) if evs else pd.DataFrame(columns=["run", "step", "kind", "value"])
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
        figures.append((["amax_vs_depth"], "Composite Amax gain against depth",
                        plots.CAPTIONS["amax_vs_depth"].format(**info)))
    else:
        missing.append("No composite Amax gain plot: no run has logged amax_fwd_composite / amax_bwd_composite "
                       "(or no depth is known).")
    if has_lr_axis(table):
        p = plots.lr_sensitivity_curves(runs, lr_tab, out / "lr_sensitivity.png", dpi=dpi)
        if p:
            paths["lr_sensitivity"] = str(p)
            figures.append((["lr_sensitivity"], "Learning-rate sensitivity",
                            plots.CAPTIONS["lr_sensitivity"].format(**info)))
        else:
            missing.append("No LR-sensitivity plot: no run on the lr grid has finished logging.")
    else:
        missing.append("This sweep has no learning-rate axis (fewer than two distinct lr values), so there "
                       "is no LR-sensitivity table or plot.")
    chosen = plots.pick_heatmap_runs(metrics, runs, max_heatmaps)
    heat = []
    for name in chosen:
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
        p = plots.layer_heatmap(metrics[metrics["run"] == name], runs[runs["run"] == name].iloc[0],
                                out / f"heatmap_{safe}.png", dpi=dpi)
        if p:
            paths[f"heatmap:{name}"] = str(p)
            heat.append(f"heatmap:{name}")
    if heat:
        figures.append((heat, "Per-layer gains over training",
                        plots.CAPTIONS["heatmap"].format(**info, n_heatmaps=len(heat), max_heatmaps=max_heatmaps)))
    if not chosen:
        missing.append("No per-layer heatmaps: no run has logged per-layer gain_fwd / amax_fwd_composite.")

    # ----------------------------------------------------------- notes on missing data
    no_metrics = table[table["steps"] == 0]
    for _, r in no_metrics.iterrows():
        missing.append(f"Run {r['run']} ({r['status']}) has no metrics yet: listed in the table, not plotted.")
    for _, r in table[(table["steps"] > 0) & ~np.isfinite(table["final_loss"])].iterrows():
        missing.append(f"Run {r['run']}: final_loss is {_fmt(r['final_loss'])} ({r['note']}); curves stop at "
                       "the last finite point.")

    # ----------------------------------------------------------- tables
    csv_path = out / "summary.csv"
    table.to_csv(csv_path, index=False, na_rep="NaN")
    paths["summary_csv"] = str(csv_path)
    if len(lr_tab):
        lr_csv = out / "lr_sensitivity.csv"
        lr_tab.to_csv(lr_csv, index=False, na_rep="NaN")
        paths["lr_sensitivity_csv"] = str(lr_csv)

    counts = table["status"].value_counts().to_dict()
    status_line = ", ".join(f"{v} {k}" for k, v in counts.items()) or "no runs"
    axes_line = ", ".join(f"{c} ({k})" for k, c in table.attrs["axes"].items()) or "none"
    context = [c for c in table.attrs["id_columns"][1:] if c not in table.attrs["axes"].values()]
    defs = {"run": "run name in the manifest", **{c: f"sweep axis {k}" for k, c in table.attrs["axes"].items()},
            **{c: f"{_CONFIG_KEYS[c]} from the run's config.yaml (not a sweep axis)" for c in context},
            **COLUMN_DOCS}

    md = [f"# Sweep report: {sweep_dir.resolve().name}", "",
          f"{len(table)} runs ({status_line}). Sweep axes: {axes_line}.", "", "## Runs", "", _md_table(table)]
    if len(lr_tab):
        md += ["## Learning-rate sensitivity", "",
               "Wortsman et al.: mean over the lr grid of min(final_loss, loss_init) - its minimum; lower is "
               "more robust to the choice of lr.", "", _md_table(lr_tab)]
    if missing:
        md += ["## Missing or non-finite", ""] + [f"- {m}" for m in missing] + [""]
    md += ["## Plots", ""] + [f"- `{Path(paths[k]).name}`: {t}" for ks, t, _ in figures for k in ks] + [""]
    md += ["## Column definitions", ""] + [f"- `{k}`: {v}" for k, v in defs.items()] + [""]
    md_path = out / "summary.md"
    md_path.write_text("\n".join(md))
    paths["summary_md"] = str(md_path)

    # ----------------------------------------------------------- the page
    e = html.escape
    now = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>Sweep report: {e(sweep_dir.resolve().name)}</title>", f"<style>{_CSS}</style></head><body>",
        f"<h1>Sweep report: {e(sweep_dir.resolve().name)}</h1>",
        f'<p class="meta">{e(str(sweep_dir.resolve()))} &middot; generated {now} &middot; {len(table)} runs '
        f"({e(status_line)}) &middot; sweep axes: {e(axes_line)}</p>",
    ]
    if missing:
        parts.append('<div class="note"><strong>Missing or non-finite</strong><ul>'
                     + "".join(f"<li>{e(m)}</li>" for m in missing) + "</ul></div>")
    parts += ["<h2>Runs</h2>",
              "<p>One row per run. Non-finite numbers are shown as they are (NaN, inf) in red; grey rows have "
              "not finished. Definitions of every column are at the bottom of the page; "
              '<a href="summary.csv">summary.csv</a> has full precision.</p>',
              f'<div class="scroll">{_html_table(table)}</div>']
    if len(lr_tab):
        parts += ["<h2>Learning-rate sensitivity</h2>",
                  "<p>Runs that differ only in the learning rate, grouped. <code>lr_sensitivity</code> "
                  "(Wortsman et al. 2023) is the mean over the lr grid of min(final_loss, loss_init) minus its "
                  "minimum: 0 means every lr on the grid reaches the best loss, larger means the result "
                  "depends more on tuning the lr; diverged runs count as loss_init.</p>",
                  f'<div class="scroll">{_html_table(lr_tab, "lr")}</div>']
    parts.append("<h2>Plots</h2>")
    for keys, title, cap in figures:
        names = [Path(paths[k]).name for k in keys]
        imgs = "".join(f'<img src="{e(n)}" alt="{e(title)}: {e(n)}">' for n in names)
        parts.append(f'<figure id="{e(Path(names[0]).stem)}"><h3>{e(title)}</h3>{imgs}'
                     f"<figcaption>{e(cap)}</figcaption></figure>")
    parts += ["<h2>Column definitions</h2><dl>"]
    parts += [f"<dt>{e(k)}</dt><dd>{e(v)}</dd>" for k, v in defs.items()]
    parts += ["</dl></body></html>"]
    html_path = out / "index.html"
    html_path.write_text("\n".join(parts), encoding="utf-8")
    paths["index_html"] = str(html_path)
    return paths
