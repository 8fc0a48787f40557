"""The study kit: what every docs/studies/*/analysis.py shares. Its command line (``SOURCE
[--out DIR]``: a sweep directory, or a committed runs.csv to recompute from), reading the runs
(:func:`read_runs`, each with its task's trivial-predictor ``baseline``), the tables of arms over
seeds and their paired comparisons with their Markdown, and the stability map's tables and
figures (:func:`write_lr_map`). The rules: docs/sweeps.md ("Stability maps"), docs/statistics.md.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import numpy as np
import pandas as pd

from mhc_jax import logs
from mhc_jax.storage import Path
from mhc_jax.sweep import lrmap, stats


# =========================================================================== reading
def cli(argv, doc: str, here, flags=(), many=False) -> tuple[Path, Path, argparse.Namespace]:
  """A study analysis's command line, ``SOURCE [--out DIR]`` (and ``flags``: ``(name, kwargs)``
  pairs): (source, the output folder, made: beside a runs.csv, else ``here``; the arguments).
  With ``many``, ``SOURCE...``: the source is a list (see :func:`merge_runs`)."""
  ap = argparse.ArgumentParser(description=doc.splitlines()[0])
  if many:
    ap.add_argument(
      "source",
      nargs="+",
      help="sweep directories or runs.csv files; a later one's run replaces an earlier one's",
    )
  else:
    ap.add_argument("source", help="a sweep directory, or a runs.csv to recompute from")
  ap.add_argument("--out", default=None)
  for name, kw in flags:
    ap.add_argument(name, **kw)
  args = ap.parse_args(argv)
  srcs = [Path(s) for s in (args.source if many else [args.source])]
  out = Path(args.out or (srcs[0].parent if srcs[0].suffix == ".csv" else here))
  out.mkdir(parents=True, exist_ok=True)
  return srcs if many else srcs[0], out, args


def merge_runs(frames: list[pd.DataFrame]) -> pd.DataFrame:
  """Runs from several sources, one row per ``run`` name: a later source's row replaces an
  earlier one's in its place; runs no earlier source has come after, in their order."""
  d = pd.concat(frames, ignore_index=True)
  ints = {c for f in frames for c in f if pd.api.types.is_integer_dtype(f[c])}
  whole = lambda c: pd.api.types.is_numeric_dtype(d[c]) and (d[c].dropna() % 1 == 0).all()
  d = d.astype({c: "Int64" for c in ints if whole(c)})  # a count stays one: 4, not 4.0
  first = d.drop_duplicates("run").reset_index().set_index("run")["index"]
  kept = d.drop_duplicates("run", keep="last")
  return kept.iloc[np.argsort(kept["run"].map(first).to_numpy(), kind="stable")]


def save_runs(runs: pd.DataFrame, src: Path, out: Path, changed: bool = False) -> None:
  """Write ``out/runs.csv``, unless that file is the source being recomputed from and nothing
  was added to it (a CSV round trip rewrites floats' last digits)."""
  if changed or (out / "runs.csv").resolve() != src.resolve():
    runs.to_csv(out / "runs.csv", index=False)


def read_runs(source) -> pd.DataFrame:
  """A stability study's runs (``lrmap``'s rows): its committed runs.csv (to recompute from),
  or :func:`lrmap.runs_table` of a sweep directory's summary table with each run's
  :func:`task_baseline`."""
  if str(source).endswith(".csv"):
    return pd.read_csv(source)
  from mhc_jax.sweep.summary import summary_table

  table = summary_table(source)
  dirs = table.attrs["run_dirs"]
  return lrmap.runs_table(table.assign(baseline=[task_baseline(dirs[r]) for r in table["run"]]))


def load(
  argv, doc: str, here, data: dict | None = None, many: bool = False
) -> tuple[pd.DataFrame, Path, Path]:
  """:func:`cli` and :func:`read_runs` (with ``many``, each source's, :func:`merge_runs`), then
  ``out/runs.csv`` (:func:`save_runs`); with the study's text ``data`` settings a runs.csv from
  before the baseline existed gets it (:func:`with_baseline`) and is rewritten. Returns (runs,
  the (first) source, out)."""
  src, out, _ = cli(argv, doc, here, many=many)
  srcs = src if many else [src]
  runs = merge_runs([read_runs(s) for s in srcs]) if len(srcs) > 1 else read_runs(srcs[0])
  upgrade = data is not None and "baseline" not in runs
  runs = with_baseline(runs, **data) if upgrade else runs
  save_runs(runs, srcs[0], out, changed=upgrade or len(srcs) > 1)
  return runs, srcs[0], out


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


def sweeps_cli(argv, doc: str) -> tuple[list, pathlib.Path | None] | None:
  """The command line of a study read from its sweeps' reports (``mhc-jax report`` first),
  ``SWEEP... [--out DIR]``: (the sweeps, the output folder, made, or None); None, with the error
  printed, where a sweep has no report/summary.csv."""
  ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("sweeps", type=pathlib.Path, nargs="+")
  ap.add_argument("--out", type=pathlib.Path, default=None, help="where to write the tables")
  a = ap.parse_args(argv)
  for s in a.sweeps:
    if not (s / "report" / "summary.csv").is_file():
      print(f"error: {s}/report/summary.csv not found (run mhc-jax report first)", file=sys.stderr)
      return None
  if a.out is not None:
    a.out.mkdir(parents=True, exist_ok=True)
  return a.sweeps, a.out


def write_tables(out, **tables: pd.DataFrame) -> None:
  """Each table as ``out/<name>.csv`` (no index)."""
  for name, t in tables.items():
    t.to_csv(out / f"{name}.csv", index=False)


def last_layers(run_dir, keys) -> dict:
  """The per-layer values of each of ``keys`` at the run's last step that logged it."""
  from mhc_jax.sweep.summary import _layer_lists, _merged

  records = _merged(Path(run_dir) / "metrics.jsonl")
  return {k: v[-1] for k in keys if (v := _layer_lists(records, k))}


def report_rows(sweep, done) -> pd.DataFrame:
  """A sweep's report/summary.csv (``mhc-jax report``) with each run's ``arm`` (and ``regime``
  where its name has one), the rows where ``done(run_name)``."""
  d = pd.read_csv(Path(sweep) / "report" / "summary.csv")
  d = d[[bool(done(r)) for r in d["run"]]].copy()
  for part in ("arm", "regime"):
    if d["run"].str.contains(f"{part}=").any():
      d[part] = d["run"].str.extract(rf"{part}=([^,]+)", expand=False)
  return d


def ordered(runs: pd.DataFrame, arms, by=("depth", "width", "lr", "seed")) -> pd.DataFrame:
  """``runs`` with the arms in the order of ``arms`` (others after, by name), then ``by``."""
  o = runs["arm"].map(lambda a: arms.index(a) if a in arms else len(arms))
  by = [c for c in by if c in runs]
  return runs.assign(_o=o).sort_values(["_o", "arm", *by], kind="stable").drop(columns="_o")


# =========================================================================== arms and pairs
def arm_table(d: pd.DataFrame, by: list[str], raw: list[str], log: list[str]) -> pd.DataFrame:
  """Per group of equal ``by`` (first-seen order): ``n_seeds``, then per metric its mean (the
  geometric mean for ``log``) as ``<metric>`` with ``_ci_lo`` and ``_ci_hi`` (stats.mean_ci)."""
  t = stats.group_stats(d, by, [*raw, *log], log_metrics=log)
  return t.drop(columns="seeds").rename(columns={stats.centre(m, log): m for m in [*raw, *log]})


def pair_table(d, context: list[str], metrics, log, order, pairs) -> pd.DataFrame:
  """stats.paired_stats of the arms by seed within ``context``, only the ``(a, b)`` in ``pairs``."""
  out = stats.paired_stats(d, "arm", context, metrics, log_metrics=log, order=order)
  return out[[(a, b) in pairs for a, b in zip(out["a"], out["b"])]].reset_index(drop=True)


def show(arms: pd.DataFrame, paired: pd.DataFrame, keys: list[str], shown, log) -> None:
  """Print :func:`arm_table` (groups of ``keys``) and :func:`pair_table` (within ``keys[0]``) as
  the report's Markdown: the ``shown`` metrics' mean [95% CI], a pair's * where significant."""
  from mhc_jax.sweep.report_tables import _groups_display, _paired_display, md_table

  arms.attrs["group_columns"], paired.attrs["context_columns"] = keys, keys[:1]
  with np.errstate(all="ignore"):
    print(md_table(_groups_display(arms, shown, log)))
    print(md_table(_paired_display(paired, shown, log)))


# =========================================================================== stability maps
#: Is the mixing used? The columns of :func:`mechanism`.
MECHANISM = ["h_res_diag_mean", "h_res_shift_mean", lrmap.GAIN, "stream_spread_last"]


def mechanism(runs: pd.DataFrame) -> pd.DataFrame:
  """mechanism.csv: the :data:`MECHANISM` columns at each arm's own best lr, per depth."""
  best = lrmap.at_best_lr(runs, lrmap.BY)
  return stats.group_stats(best, lrmap.BY, MECHANISM, log_metrics=[lrmap.GAIN])


def lr_map_tables(runs: pd.DataFrame, arms, refs=()) -> tuple[pd.DataFrame, pd.DataFrame]:
  """(lr_sensitivity, paired_best_lr) from runs.csv's rows, in the order of ``arms``; the pairs
  are every two arms at their own best lr, or those with an arm of ``refs`` where it is given."""
  runs = ordered(runs, list(arms))
  best = lrmap.at_best_lr(runs, lrmap.BY)
  order = [a for a in arms if a in set(runs["arm"])]
  paired = stats.paired_stats(best, "arm", ["depth", "width"], [lrmap.ENDPOINT], order=order)
  if refs:
    paired = paired[paired["a"].isin(refs) | paired["b"].isin(refs)].reset_index(drop=True)
  return lrmap.lr_table(runs), paired


def write_lr_map(runs: pd.DataFrame, out: Path, families: dict, refs=()) -> pd.DataFrame:
  """A stability map's files from ``runs`` into ``out`` (arms in the order of ``families``, name
  -> arms; pairs as :func:`lr_map_tables`): lr_sensitivity.csv (lrmap.lr_table),
  paired_best_lr.csv, mechanism.csv, lr_curves.png (plots.lr_curves), edges.png
  (plots.edge_chart) and stable_lr.png (the lr edges as arm x depth heatmaps); returns the lr
  table."""
  from mhc_jax.sweep import plots
  from mhc_jax.sweep.report_tables import md_table

  lr_tab, paired = lr_map_tables(runs, [a for fam in families.values() for a in fam], refs)
  lr_tab.to_csv(out / "lr_sensitivity.csv", index=False)
  paired.to_csv(out / "paired_best_lr.csv", index=False)
  mechanism(runs).to_csv(out / "mechanism.csv", index=False)
  plots.lr_curves(runs, out / "lr_curves.png")
  plots.edge_chart(lr_tab, out / "edges.png", families=families)
  # the first failing lr beside the largest working one: a grey NaN cell says no seed failed
  # above the best lr on the grid, so a largest working lr at the grid's top is a lower bound
  cols = ["largest_working_lr", "first_failing_lr", "best_lr", "largest_stable_lr"]
  plots.heatmaps(lr_tab, out / "stable_lr.png", x="depth", y="arm", values=cols, log=cols)
  print(md_table(lr_tab.round(4)))
  return lr_tab
