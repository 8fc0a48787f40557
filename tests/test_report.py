"""Sweep report (mhc_jax.sweep.report / plots) on synthetic run directories (tests/fixtures_logs.py)."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from fixtures_logs import make_sweep, raw_records, write_run

from mhc_jax import cli
from mhc_jax.errors import UsageError
from mhc_jax.sweep import plots
from mhc_jax.sweep.lrmap import lr_sensitivity_table
from mhc_jax.sweep.report import COMPOSITE_SENTENCES, screen, write_report
from mhc_jax.sweep.report_tables import _paired_display, paired_table
from mhc_jax.sweep.sentences import finding
from mhc_jax.sweep.summary import (
  COLUMN_DOCS,
  GROUP_METRICS,
  LOG_SCALE,
  READS_OLD_LOGS,
  _axis_columns,
  summarize_run,
  summary_table,
)

PNG = b"\x89PNG\r\n\x1a\n"


def _small_sweep(root, mixers, **kw):
  """A one-depth, 30-step synthetic sweep of `mixers`, nothing planted."""
  return make_sweep(
    root,
    mixers=mixers,
    depths=(2,),
    lrs=None,
    steps=30,
    spike=None,
    diverge=None,
    pending=False,
    **kw,
  )


SPIKED = "mhc_L4_C32_lr0.01_s0"  # planted loss spike at step 80
DIVERGED = "hc_L4_C32_lr0.03_s0"  # NaN loss from step 75, halted


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
  root = make_sweep(tmp_path_factory.mktemp("sweep"), failed_empty=True)
  return root, write_report(root)


def _same(a, b):
  if isinstance(a, float) and math.isnan(a):
    return isinstance(b, float) and math.isnan(b)
  return a == pytest.approx(b, rel=1e-12)


# =========================================================================== the table
def test_one_row_per_run_with_axes_and_columns(sweep):
  root, _ = sweep
  manifest = json.loads((root / "manifest.json").read_text())["runs"]
  df = summary_table(root)
  assert sorted(df["run"]) == sorted(manifest)
  assert list(df.columns[:4]) == ["run", "mixer", "depth", "lr"]  # axes, shortened
  assert {"width", "seed"} <= set(df.columns)  # from config.yaml, not axes
  assert list(df.columns[-len(COLUMN_DOCS) :]) == list(COLUMN_DOCS)
  assert df.attrs["axes"] == {"model.mixer": "mixer", "model.depth": "depth", "optim.lr": "lr"}
  for name, info in manifest.items():
    row = df[df["run"] == name].iloc[0]
    assert row["status"] == info["status"]
    assert row["mixer"] == info["overrides"]["model.mixer"]
  assert df["depth"].dtype == "Int64" and df["width"].dtype == "Int64"


def test_cells_recomputed_from_raw_files(sweep):
  root, _ = sweep
  df = summary_table(root).set_index("run")
  checked = 0
  for rdir in sorted((root / "runs").iterdir()):
    if not (rdir / "metrics.jsonl").exists():
      continue
    recs = raw_records(rdir / "metrics.jsonl")
    evs = raw_records(rdir / "events.jsonl")
    row = df.loc[rdir.name]
    losses = [r["loss"] for r in recs if "loss" in r]
    k = max(1, math.ceil(len(losses) / 20))
    assert _same(row["final_loss"], sum(losses[-k:]) / k)
    grads = [r["grad_norm"] for r in recs if "grad_norm" in r and not math.isnan(r["grad_norm"])]
    assert _same(row["max_grad_norm"], max(grads))
    assert row["spike_count"] == sum(e["kind"].startswith("spike/") for e in evs)
    whole = [r["amax_fwd_composite"][-1] for r in recs if "amax_fwd_composite" in r]
    assert _same(row["amax_fwd_composite_max"], max(v for v in whole if not math.isnan(v)))
    every = [
      v
      for r in recs
      if "amax_bwd_composite" in r
      for v in r["amax_bwd_composite"]
      if not math.isnan(v)
    ]
    assert _same(row["amax_bwd_composite_max_all_layers"], max(every))
    assert _same(row["kl_bits"], [r["eval/kl_bits"] for r in recs if "eval/kl_bits" in r][-1])
    assert _same(row["loss_init"], losses[0])
    assert row["steps"] == max(r["step"] for r in recs)
    checked += 1
  assert checked == 18
  # the planted spike and the diverged run read as such, honestly
  assert df.loc[SPIKED, "spike_count"] >= 1 and df.loc[SPIKED, "max_grad_norm"] > 5
  div = df.loc[DIVERGED]
  assert math.isnan(div["final_loss"]) and div["max_grad_norm"] == math.inf
  raw = raw_records(root / "runs" / DIVERGED / "events.jsonl")
  div_step = next(e["step"] for e in raw if e["kind"] == "divergence")
  assert (
    div["status"] == "failed"
    and div["nonfinite"] == sum(e["kind"] == "nonfinite" for e in raw) >= 4
  )
  assert (
    "loss non-finite from step 75" in div["note"]
    and f"divergence at step {div_step}" in div["note"]
  )
  assert math.isfinite(div["min_loss"]) and math.isfinite(div["amax_fwd_composite_max"])


def test_runs_without_metrics_are_listed(sweep):
  root, _ = sweep
  df = summary_table(root).set_index("run")
  for name, status in (("mhc_lite_pending", "pending"), ("mhc_lite_failed", "failed")):
    row = df.loc[name]
    assert row["status"] == status and row["steps"] == 0
    assert math.isnan(row["final_loss"]) and row["spike_count"] is pd.NA
    assert "no metrics" in row["note"]
  empty = summarize_run(root / "does_not_exist")
  assert empty["steps"] == 0 and math.isnan(empty["final_loss"]) and empty["note"]


def test_eval_only_record_is_not_a_nan_loss(tmp_path):
  write_run(tmp_path, steps=40, eval_every=20)
  with open(tmp_path / "metrics.jsonl", "a") as f:  # a final eval after the last train step
    f.write(json.dumps({"step": 41, "eval/kl_bits": 0.125}) + "\n")
  s = summarize_run(tmp_path)
  assert math.isfinite(s["final_loss"]) and s["kl_bits"] == 0.125 and s["steps"] == 41


def test_axis_names_are_shortened_without_collisions():
  cols = _axis_columns(
    ["model.mixer", "optim.lr", "model.width", "data.width", "train.steps", "model.n_streams"]
  )
  assert cols == {
    "model.mixer": "mixer",
    "optim.lr": "lr",
    "model.width": "width",
    "data.width": "data.width",
    "train.steps": "train.steps",
    "model.n_streams": "n_streams",
  }


# =========================================================================== the report
def test_write_report_files(sweep):
  root, paths = sweep
  out = root / "report"
  pngs = sorted(out.glob("*.png"))
  assert {"loss_curves.png", "grad_norms.png", "amax_vs_depth.png", "lr_sensitivity.png"} <= {
    p.name for p in pngs
  }
  assert len([p for p in pngs if p.name.startswith("heatmap_")]) == 3  # one per mixer with metrics
  for p in pngs:
    data = p.read_bytes()
    assert data[:8] == PNG and len(data) > 8_000, p.name
  assert {Path(v) for k, v in paths.items() if v.endswith(".png")} == set(pngs)
  page = (out / "summary.md").read_text()
  assert set(re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page)) == {p.name for p in pngs}
  assert all(f"| {n} |" in page for n in summary_table(root)["run"])
  assert "lr_sensitivity" in page and "Wortsman et al.'s LR sensitivity" in page  # a caption
  assert (out / "summary.md").read_text().count("\n| ") >= 20
  assert paths["summary_md"] == str(out / "summary.md") and not (out / "index.html").exists()
  assert "index_html" not in paths  # no HTML page any more


def test_summary_csv_round_trips(sweep):
  root, paths = sweep
  df = summary_table(root)
  csv = pd.read_csv(paths["summary_csv"])
  assert list(csv.columns) == list(df.columns) and list(csv["run"]) == list(df["run"])
  assert list(csv["status"]) == list(df["status"])
  for c in df.columns:
    if c in ("run", "mixer", "status", "note"):
      continue
    want = df[c].astype("Float64").to_numpy(float, na_value=np.nan)
    np.testing.assert_array_equal(pd.to_numeric(csv[c]).to_numpy(float), want, err_msg=c)


def test_report_says_what_is_missing(sweep):
  root, _ = sweep
  page = (root / "report" / "summary.md").read_text()
  assert "mhc_lite_pending (pending) has no metrics yet" in page
  assert "mhc_lite_failed (failed) has no metrics yet" in page
  assert f"Run {DIVERGED}: final_loss is NaN" in page
  div = next(ln for ln in page.splitlines() if ln.startswith(f"| {DIVERGED} |"))
  assert " inf |" in div  # the diverged run's max grad norm


def test_no_lr_axis(tmp_path):
  root = make_sweep(
    tmp_path, mixers=("residual", "mhc"), depths=(2,), lrs=None, steps=50, spike=None, diverge=None
  )
  df = summary_table(root)
  assert "lr" in df.columns and "lr" not in df.attrs["axes"].values()  # constant lr from the config
  assert lr_sensitivity_table(df).empty
  paths = write_report(root, max_heatmaps=1)
  assert "lr_sensitivity" not in paths and "lr_sensitivity_csv" not in paths
  assert not (root / "report" / "lr_sensitivity.png").exists()
  page = Path(paths["summary_md"]).read_text()
  assert "no learning-rate axis" in page and "mhc_lite_pending (pending) has no metrics yet" in page
  assert len([k for k in paths if k.startswith("heatmap:")]) == 1


def test_single_run_sweep_and_bare_run_dir(tmp_path):
  root = make_sweep(
    tmp_path / "one",
    mixers=("hc",),
    depths=(3,),
    lrs=None,
    steps=60,
    spike=None,
    diverge=("hc", 3, 1e-2, 40),
    pending=False,
    wind_tunnel=False,
  )
  paths = write_report(root, out_dir=tmp_path / "out")
  df = summary_table(root)
  assert len(df) == 1 and math.isnan(df["final_loss"][0]) and math.isnan(df["kl_bits"][0])
  assert {"loss_curves", "grad_norms", "amax_vs_depth"} <= set(paths)
  assert all(Path(p).parent == tmp_path / "out" for p in paths.values())
  assert not (root / "report").exists()
  # a run directory without a manifest is a one-run sweep
  run_dir = next((root / "runs").iterdir())
  bare = summary_table(run_dir)
  assert list(bare["run"]) == [run_dir.name] and bare["status"][0] == "halted"
  assert bare["steps"][0] == df["steps"][0]


# =========================================================================== lr sensitivity
def test_lr_sensitivity_matches_formula_on_hand_grid():
  nan = math.nan
  rows = [  # run, mixer, depth, lr | status, steps, loss_init, final_loss
    ("a1", "mhc", 2, 1e-3, "done", 100, 2.0, 1.0),
    ("a2", "mhc", 2, 1e-2, "done", 100, 2.0, 0.5),
    ("a3", "mhc", 2, 1e-1, "failed", 40, 2.0, nan),  # diverged -> counts as loss_init
    ("a4", "mhc", 2, 1.0, "pending", 0, nan, nan),  # never ran -> left out
    ("b1", "hc", 2, 1e-3, "done", 100, 2.2, 3.0),  # above loss_init -> capped
    ("b2", "hc", 2, 1e-2, "done", 100, 1.8, 0.8),
    ("b3", "hc", 2, 1e-1, "done", 100, 2.0, 0.9),
    ("c1", "hc", 4, 1e-2, "done", 100, 2.0, 0.7),  # a single lr: no sensitivity
  ]
  df = pd.DataFrame(
    rows, columns=["run", "mixer", "depth", "lr", "status", "steps", "loss_init", "final_loss"]
  )
  out = lr_sensitivity_table(df).set_index("mixer")
  a = out.loc["mhc"]
  assert a["lr_sensitivity"] == pytest.approx(((1.0 - 0.5) + 0 + (2.0 - 0.5)) / 3)
  assert a["n_lr"] == 3 and a["n_diverged"] == 1 and a["best_lr"] == 1e-2 and a["loss_init"] == 2.0
  b = out[out["depth"] == 2].loc["hc"]
  assert b["loss_init"] == pytest.approx(2.0)  # mean of the group's first losses
  assert b["lr_sensitivity"] == pytest.approx(((2.0 - 0.8) + 0 + (0.9 - 0.8)) / 3)
  c = out[out["depth"] == 4].iloc[0]
  assert c["n_lr"] == 1 and math.isnan(c["lr_sensitivity"])


def test_lr_table_groups_by_other_axes(sweep):
  root, _ = sweep
  df = summary_table(root)
  out = lr_sensitivity_table(df)
  assert len(out) == 6 and set(out["n_lr"]) == {
    3
  }  # 3 mixers x 2 depths; the pending run has no metrics
  hc4 = out[(out["mixer"] == "hc") & (out["depth"] == 4)].iloc[0]
  assert (
    hc4["n_diverged"] == 1 and hc4["lr_sensitivity"] > out["lr_sensitivity"].drop(hc4.name).max()
  )


# =========================================================================== plots
def test_plots_skip_what_is_not_there(tmp_path):
  runs = pd.DataFrame(
    {"run": ["x"], "mixer": ["hc"], "depth": [2], "status": ["done"], "steps": [3]}
  )
  metrics = pd.DataFrame(
    {"run": ["x"] * 3, "step": [1, 2, 3], "loss": [math.nan, math.inf, math.nan]}
  )
  events = pd.DataFrame(columns=["run", "step", "kind", "value"])
  assert plots.loss_curves(metrics, runs, events, tmp_path / "l.png") is None
  assert plots.composite_gain_vs_depth(metrics, runs, tmp_path / "a.png") is None
  assert plots.pick_heatmap_runs(metrics, runs) == []
  assert not list(tmp_path.iterdir())
  colors = plots.mixer_colors(["zeta", "mhc", "residual", "alpha"])
  assert list(colors) == ["residual", "mhc", "alpha", "zeta"]
  assert colors == plots.mixer_colors(["alpha", "zeta", "mhc", "residual"])  # order-independent


# =========================================================================== seeds, intervals
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
  root = make_sweep(
    tmp_path_factory.mktemp("seeded"),
    mixers=("residual", "hc", "mhc"),
    depths=(2, 4),
    lrs=None,
    seeds=SEEDS,
    steps=60,
    spike=None,
    diverge=None,
    pending=False,
  )
  return root, write_report(root)


def _final_loss_raw(run_dir):
  losses = [r["loss"] for r in raw_records(run_dir / "metrics.jsonl") if "loss" in r]
  k = max(1, math.ceil(len(losses) / 20))
  return sum(losses[-k:]) / k


def _whole_depth_max_raw(run_dir, metric):
  return max(r[metric][-1] for r in raw_records(run_dir / "metrics.jsonl") if metric in r)


def test_groups_csv_interval_recomputed_from_raw_logs(seeded):
  from test_stats import ref_ci, ref_log_ci  # the stdlib-only Student t references

  root, paths = seeded
  groups = pd.read_csv(paths["groups_csv"])
  for m in GROUP_METRICS:
    mid = f"{m}_gmean" if m in LOG_SCALE else f"{m}_mean"
    assert {mid, f"{m}_ci_lo", f"{m}_ci_hi"} <= set(groups.columns), m
  assert len(groups) == 6 and set(groups["n_seeds"]) == {3} and "seed" not in groups.columns
  row = groups[(groups["mixer"] == "hc") & (groups["depth"] == 4)].iloc[0]
  runs = [root / "runs" / f"hc_L4_C32_lr0.01_s{s}" for s in SEEDS]
  want = ref_ci([_final_loss_raw(r) for r in runs])
  assert (
    row["final_loss_mean"],
    row["final_loss_ci_lo"],
    row["final_loss_ci_hi"],
  ) == pytest.approx(want, rel=1e-4)
  assert row["final_loss_ci_lo"] < row["final_loss_mean"] < row["final_loss_ci_hi"]
  # a gain: geometric mean and the interval of the mean log, back-transformed
  want = ref_log_ci([_whole_depth_max_raw(r, "amax_bwd_composite_tok_mean") for r in runs])
  got = tuple(row[f"amax_bwd_composite_tok_mean_max_{s}"] for s in ("gmean", "ci_lo", "ci_hi"))
  assert got == pytest.approx(want, rel=1e-4)
  assert "amax_bwd_composite_tok_mean_max_mean" not in groups.columns


def test_log_scale_columns_are_decided_in_one_place():
  assert {
    "max_grad_norm",
    "amax_fwd_composite_max",
    "amax_fwd_composite_tok_mean_max",
    "amax_bwd_composite_tok_max_max",
    "amin_fwd_composite_min",
    "amax_bwd_suffix_max_all_layers",
    "stream_spread_last",
  } <= LOG_SCALE
  assert not {"final_loss", "eval_loss", "kl_bits", "spike_count", "growth_exponent"} & LOG_SCALE
  assert LOG_SCALE <= set(GROUP_METRICS)


def test_paired_csv_recomputed_from_raw_logs(seeded):
  from test_stats import ref_ci, ref_log_ci

  root, paths = seeded
  paired = pd.read_csv(paths["paired_csv"])
  assert {
    "mixer_a",
    "mixer_b",
    "metric",
    "scale",
    "n_pairs",
    "diff_mean",
    "diff_ci_lo",
    "diff_ci_hi",
    "ratio_mean",
    "ratio_ci_lo",
    "ratio_ci_hi",
    "significant",
  } <= set(paired.columns)
  assert set(zip(paired["mixer_a"], paired["mixer_b"])) == {
    ("residual", "hc"),
    ("residual", "mhc"),
    ("hc", "mhc"),
  }
  sel = (paired["depth"] == 2) & (paired["mixer_a"] == "hc") & (paired["mixer_b"] == "mhc")
  row = paired[sel & (paired["metric"] == "final_loss")].iloc[0]
  diffs = [
    _final_loss_raw(root / "runs" / f"mhc_L2_C32_lr0.01_s{s}")
    - _final_loss_raw(root / "runs" / f"hc_L2_C32_lr0.01_s{s}")
    for s in SEEDS
  ]
  assert row["n_pairs"] == 3 and row["scale"] == "raw"
  assert (row["diff_mean"], row["diff_ci_lo"], row["diff_ci_hi"]) == pytest.approx(
    ref_ci(diffs), rel=1e-4
  )
  gain = paired[sel & (paired["metric"] == "amax_fwd_composite_tok_mean_max")].iloc[0]
  ratios = [
    _whole_depth_max_raw(root / "runs" / f"mhc_L2_C32_lr0.01_s{s}", "amax_fwd_composite_tok_mean")
    / _whole_depth_max_raw(root / "runs" / f"hc_L2_C32_lr0.01_s{s}", "amax_fwd_composite_tok_mean")
    for s in SEEDS
  ]
  assert gain["scale"] == "log" and math.isnan(gain["diff_mean"])
  assert (gain["ratio_mean"], gain["ratio_ci_lo"], gain["ratio_ci_hi"]) == pytest.approx(
    ref_log_ci(ratios), rel=1e-4
  )
  assert gain["ratio_ci_hi"] < 1 and gain["significant"]  # mhc's gain below hc's, every seed


def test_seed_sections_in_summary_md(seeded):
  root, paths = seeded
  page = Path(paths["summary_md"]).read_text()
  assert "Groups over seeds" in page and "Student t" in page and "groups.csv has" in page
  assert "Paired differences between mixers" in page and "paired.csv has" in page
  md = Path(paths["summary_md"]).read_text()
  assert re.search(
    r"\| hc \| 4 \| .*\| 3 \| [0-9.]+ \[[0-9.]+, [0-9.]+\]", md
  )  # mean [lo, hi] cells


def _capture(monkeypatch):
  figs = []
  real = plots._save

  def keep(fig, path, dpi):
    figs.append([(len(ax.collections), len(ax.get_lines())) for ax in fig.axes])
    return real(fig, path, dpi)

  monkeypatch.setattr(plots, "_save", keep)
  return figs


def _plot_inputs(root):
  from mhc_jax.logs import load_run

  runs = summary_table(root)
  frames = [
    load_run(d).assign(run=n)
    for n, d in runs.attrs["run_dirs"].items()
    if (Path(d) / "metrics.jsonl").exists()
  ]
  for f in frames:
    f.attrs = {}
  events = pd.DataFrame(columns=["run", "step", "kind", "value"])
  return pd.concat(frames, ignore_index=True), runs, events


def test_plots_draw_bands_over_seeds(seeded, tmp_path, monkeypatch):
  figs = _capture(monkeypatch)
  metrics, runs, events = _plot_inputs(seeded[0])
  assert plots.loss_curves(metrics, runs, events, tmp_path / "l.png")
  assert plots.composite_gain_vs_depth(metrics, runs, tmp_path / "a.png")
  loss_axes, amax_axes = figs
  for (
    n_coll,
    n_lines,
  ) in loss_axes:  # one panel per depth: 3 mixers -> 3 bands and 3 mean lines, not 9
    assert n_coll == 3 and n_lines == 3
  assert all(n_coll >= 3 for n_coll, _ in amax_axes)  # a band per mixer (and per composite kind)
  # without seeds: single lines, no bands
  root = _small_sweep(tmp_path / "one_seed", ("residual", "hc"))
  metrics, runs, events = _plot_inputs(root)
  assert plots.loss_curves(metrics, runs, events, tmp_path / "l1.png")
  assert figs[-1] == [(0, 2)]


# =========================================================================== per-token composite, old logs
def test_per_token_and_averaged_composite_side_by_side(seeded):
  root, paths = seeded
  df = summary_table(root).set_index("run")
  cols = list(df.columns)
  i = cols.index("amax_fwd_composite_max")
  assert cols[i : i + 3] == [
    "amax_fwd_composite_max",
    "amax_fwd_composite_tok_mean_max",
    "amax_fwd_composite_tok_max_max",
  ]
  run = root / "runs" / "hc_L4_C32_lr0.01_s1"
  row = df.loc[run.name]
  for col, metric in [
    ("amax_fwd_composite_tok_mean_max", "amax_fwd_composite_tok_mean"),
    ("amax_bwd_composite_tok_max_max", "amax_bwd_composite_tok_max"),
    ("amax_fwd_composite_max", "amax_fwd_composite"),
  ]:
    assert _same(row[col], _whole_depth_max_raw(run, metric)), col
  recs = raw_records(run / "metrics.jsonl")
  amin = [r["amin_bwd_composite"][-1] for r in recs if "amin_bwd_composite" in r]
  assert _same(row["amin_bwd_composite_min"], min(amin))
  suffix = [v for r in recs if "amax_fwd_suffix" in r for v in r["amax_fwd_suffix"]]
  assert _same(row["amax_fwd_suffix_max_all_layers"], max(suffix))
  assert (
    row["amax_fwd_composite_tok_mean_max"] > row["amax_fwd_composite_max"]
  )  # what averaging hides
  page = Path(paths["summary_md"]).read_text()
  for sentence in COMPOSITE_SENTENCES.values():
    assert sentence in page
  assert "per-token" in Path(paths["summary_md"]).read_text()


def test_old_logs_are_one_error_naming_the_version_that_reads_them(tmp_path, capsys):
  """Logs written before the per-token composite, amin and suffix metrics are not read (the
  compatibility code is gone): one error naming the mhc_jax that reads them, nothing written."""
  root = _small_sweep(tmp_path, ("hc", "mhc"), gain_metrics="old")
  with pytest.raises(UsageError, match="predate the per-token composite.*commit 3829cbd"):
    summary_table(root)
  assert cli.main(["report", str(root)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and READS_OLD_LOGS in err[0]
  assert not (root / "report").exists()


def test_growth_exponent_label_counts_mixer_layers():
  # train/step.py diag_metrics divides ln(RMS ratio) by 2L (mixer layers), not by L (blocks)
  doc = COLUMN_DOCS["growth_exponent"]
  assert "(1/(2L))" in doc and "(1/L)" not in doc


# =========================================================================== the sentence
def _table(
  rows,
  cols=(
    "run",
    "mixer",
    "depth",
    "seed",
    "status",
    "steps",
    "final_loss",
    "kl_bits",
    "spike_count",
    "amax_fwd_composite_max",
    "amax_fwd_composite_tok_mean_max",
  ),
):
  return pd.DataFrame(rows, columns=list(cols))


def _rows(spec, seeds=(0,)):
  """spec: {(mixer, depth): (final_loss, kl, spikes, amax_avg, amax_tok)} -> table rows."""
  rows = []
  for (m, d), (fl, kl, sp, av, tok) in spec.items():
    for s in seeds:
      jitter = 1 + 0.001 * s
      rows.append(
        (f"{m}_{d}_{s}", m, d, s, "done", 100, fl * jitter, kl * jitter, sp, av, tok * jitter)
      )
  return rows


def test_finding_says_who_learned():
  a = finding(
    _table(_rows({("residual", 4): (1.0, 0.05, 0, 1.0, 1.0), ("hc", 4): (2.0, 2.1, 0, 1.0, 1.0)}))
  )
  b = finding(
    _table(_rows({("residual", 4): (2.0, 2.1, 0, 1.0, 1.0), ("hc", 4): (1.0, 0.05, 0, 1.0, 1.0)}))
  )
  assert (
    a
    == "residual learned the task (KL 0.05 bits to the exact posterior) while hc did not (2.1 bits)."
  )
  assert b.startswith("hc learned the task") and "residual did not" in b and a != b


def test_finding_says_whose_gain_grew_with_depth():
  spec = {
    ("hc", 4): (2.0, 2.0, 0, 1.05, 1.1),
    ("hc", 16): (2.0, 2.0, 0, 1.6, 9.3),
    ("mhc", 4): (2.0, 2.0, 0, 1.0, 1.0),
    ("mhc", 16): (2.0, 2.0, 0, 1.0, 1.02),
  }
  a = finding(_table(_rows(spec)))
  assert a == (
    "hc's per-token forward composite gain grew from 1.1 at depth 4 to 9.3 at depth 16 while mhc's "
    "stayed within 1.00–1.02."
  )
  flipped = {(("mhc" if m == "hc" else "hc"), d): v for (m, d), v in spec.items()}
  b = finding(_table(_rows(flipped, seeds=(0, 1, 2))))
  assert b.startswith("mhc's per-token forward composite gain grew") and "hc's stayed" in b
  assert b.endswith("(geometric means over 3 seeds per mixer and depth).")
  # old logs without the per-token column: the token-averaged composite, named as such
  old = _table(_rows(spec)).assign(amax_fwd_composite_tok_mean_max=np.nan)
  assert finding(old).startswith(
    "hc's token-averaged forward composite gain grew from 1.05 at depth 4 to 1.6"
  )


def test_finding_loss_needs_an_interval_that_excludes_zero():
  spec = {("hc", 4): (2.0, 2.0, 0, 1.0, 1.0), ("mhc", 4): (1.8, 2.0, 0, 1.0, 1.0)}
  one = finding(_table(_rows(spec)))
  assert (
    one
    == "mhc reached a lower final training loss than hc (1.8 vs 2 nats per token, one run each)."
  )
  noisy = _table(_rows(spec, seeds=(0, 1, 2)))
  noisy.loc[(noisy["mixer"] == "mhc") & (noisy["seed"] == 1), "final_loss"] = (
    2.6  # seed 1 reverses it
  )
  assert finding(noisy).startswith(
    "The mixers did not differ clearly over 6 runs: final training losses"
  )
  steady = _table(_rows(spec, seeds=(0, 1, 2)))
  text = finding(steady)
  assert (
    text.startswith("mhc reached a lower final training loss than hc: 1.8") and "95% CI [" in text
  )
  assert "(means over 3 seeds each)" in text and "n = 3 seed pairs" in text


def test_finding_on_edge_cases(seeded):
  assert finding(_table([])) == "No run has logged metrics yet, so there is nothing to compare."
  assert finding(_table(_rows({("hc", 4): (2.0, 2.0, 0, 1.0, 1.0)}))).startswith(
    "Only one mixer (hc)"
  )
  same = finding(
    _table(_rows({("hc", 4): (2.0, 2.0, 0, 1.0, 1.0), ("mhc", 4): (2.01, 2.0, 0, 1.0, 1.0)}))
  )
  assert same == (
    "The mixers did not differ clearly over 2 runs: final training losses 2.00–2.01 nats, KL "
    "2.00 bits, per-token composite gains 1.00, no spikes."
  )
  spikes = finding(
    _table(_rows({("hc", 4): (2.0, 2.0, 4, 1.0, 1.0), ("mhc", 4): (2.0, 2.0, 0, 1.0, 1.0)}))
  )
  assert spikes == "hc had 4 loss/gradient spikes in its 1 run while mhc had none."
  root, paths = seeded
  text = finding(summary_table(root))
  assert text.startswith("hc's per-token")
  assert text.endswith("(geometric means over 3 seeds per mixer and depth).")
  assert (
    text in Path(paths["summary_md"]).read_text()
    and f"**{text}**" in Path(paths["summary_md"]).read_text()
  )


def test_mixer_without_h_res_says_so_not_old_logs(tmp_path):
  # diagnostics were logged (gain_fwd), but the mixer has no H_res: its composite columns are n/a
  # with that reason, and summary.md does not call its logs "written before these metrics existed"
  root = _small_sweep(tmp_path, ("mhc",))
  (name,) = json.loads((root / "manifest.json").read_text())["runs"]
  run = root / "runs" / name
  recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
  assert any("gain_fwd" in r for r in recs) and any("amax_fwd_composite" in r for r in recs)
  with open(run / "metrics.jsonl", "w") as f:
    for r in recs:
      f.write(json.dumps({k: v for k, v in r.items() if not k.startswith(("amax_", "amin_"))}))
      f.write("\n")
  df = summary_table(root)
  assert "no H_res: composite gains n/a" in df["note"].iloc[0]
  assert "no per-layer diagnostics" not in df["note"].iloc[0]
  amax_cols = [c for c in df.columns if c.startswith(("amax_", "amin_"))]
  assert amax_cols and df[amax_cols].isna().all().all()
  assert np.isfinite(df["growth_exponent"]).all()  # the per-layer gains are still read
  paths = write_report(root)
  assert "written before these metrics existed" not in Path(paths["summary_md"]).read_text()


def test_logit_columns_and_eval_columns_from_raw_files(tmp_path):
  run = tmp_path / "run"
  write_run(run, mixer="hc", steps=20)
  recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
  attn = {1: [1.0, 7.5, 2.0, 3.0], 10: [4.0, 2.0, 6.0, 1.0]}
  with open(run / "metrics.jsonl", "w") as f:
    for r in recs:
      if r["step"] in attn:
        r["attn_logit_max"] = attn[r["step"]]
        r["out_logit_max"] = 3.0 * r["step"]
        r["logsumexp_mean"] = -0.5 * r["step"]
      f.write(json.dumps(r) + "\n")
  row = summarize_run(run)
  assert row["attn_logit_max"] == 7.5 and row["out_logit_max"] == 30.0
  assert row["logz_absmax"] == 5.0
  eval_json = [c for c in COLUMN_DOCS if c.startswith(("eval_", "probe_")) and c != "eval_loss"]
  assert eval_json and all(math.isnan(row[c]) for c in eval_json)
  (run / "eval.json").write_text(
    json.dumps(
      {
        "step": 20,
        "metrics": {"kl_bits": 0.25},
        "probes": {
          "key_orthogonality": {"ratio_to_random": 0.5},
          "qk_alignment": {"attn_on_target": 0.9, "slope": None},
          "pca_entropy": {"corr_pc1_entropy": -0.75},
        },
      }
    )
  )
  row = summarize_run(run)
  assert row["eval_kl_bits"] == 0.25 and row["probe_key_ratio"] == 0.5
  assert row["probe_attn_on_target"] == 0.9 and math.isnan(row["probe_qk_slope"])  # skipped
  assert row["probe_pc1_entropy"] == 0.75  # |corr|
  (run / "eval.json").write_text("{not json")
  assert math.isnan(summarize_run(run)["eval_kl_bits"])


# =========================================================================== endpoints
def _rewrite(run_dir, edit):
  """Rewrite a run's metrics.jsonl record by record (``edit(rec)`` changes it in place)."""
  path = Path(run_dir) / "metrics.jsonl"
  recs = raw_records(path)
  for r in recs:
    edit(r)
  path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_eval_loss_and_max_grad_norm_after_warmup(tmp_path):
  run = tmp_path / "run"
  write_run(run, mixer="hc", steps=60, eval_every=20)
  _rewrite(run, lambda r: r.update(grad_norm=50.0) if r["step"] == 3 and "grad_norm" in r else None)
  recs = raw_records(run / "metrics.jsonl")
  row = summarize_run(run)
  assert row["eval_loss"] == [r["eval/loss"] for r in recs if "eval/loss" in r][-1]
  assert row["max_grad_norm"] == 50.0  # no warm-up in the config: every step counts
  cfg = yaml.safe_load((run / "config.yaml").read_text())
  cfg["optim"]["warmup_steps"] = 10
  (run / "config.yaml").write_text(yaml.safe_dump(cfg))
  row = summarize_run(run)
  after = [r["grad_norm"] for r in recs if "grad_norm" in r and r["step"] >= 10]
  assert row["max_grad_norm"] == max(after) < 50.0
  assert list(COLUMN_DOCS).index("eval_loss") < list(COLUMN_DOCS).index("final_loss")
  no_eval = tmp_path / "text"
  write_run(no_eval, steps=30, wind_tunnel=False)
  assert math.isnan(summarize_run(no_eval)["eval_loss"])


# =========================================================================== stream spread
def _spread(mixer: str, nl: int, step: int) -> list[float]:
  """Made-up per-layer stream spreads: hc peaks mid-depth, mhc collapsed, residual 0."""
  x = np.arange(nl) / max(nl - 1, 1)
  if mixer == "residual":
    return [0.0] * nl
  if mixer == "hc":
    return (0.05 + 0.5 * np.sin(np.pi * (0.2 + 0.7 * x)) * (1 + step / 100)).tolist()
  return (0.004 + 0.002 * x).tolist()


def _with_spread(run_dir, mixer):
  _rewrite(
    run_dir,
    lambda r: (
      r.update(stream_spread=_spread(mixer, len(r["gain_fwd"]), r["step"]))
      if "gain_fwd" in r
      else None
    ),
  )


def test_stream_spread_columns_from_raw_logs(tmp_path):
  run = tmp_path / "hc"
  write_run(run, mixer="hc", depth=3, steps=40)
  _with_spread(run, "hc")
  last = [r["stream_spread"] for r in raw_records(run / "metrics.jsonl") if "stream_spread" in r][
    -1
  ]
  row = summarize_run(run)
  assert row["stream_spread_last"] == last[-1]
  assert row["stream_spread_min"] == min(last)
  assert row["stream_spread_mean"] == pytest.approx(sum(last) / len(last), rel=1e-12)
  assert "stream" not in row["note"]
  res = tmp_path / "residual"
  write_run(res, mixer="residual", steps=40)
  _with_spread(res, "residual")
  row = summarize_run(res)
  assert (row["stream_spread_last"], row["stream_spread_min"]) == (0.0, 0.0)
  old = tmp_path / "old"
  write_run(old, mixer="hc", steps=40)  # logs without the metric (older runs)
  row = summarize_run(old)
  assert all(math.isnan(row[c]) for c in row if c.startswith("stream_spread"))
  assert "stream spread" in row["note"]


@pytest.fixture(scope="module")
def spread_sweep(tmp_path_factory):
  root = make_sweep(
    tmp_path_factory.mktemp("spread"),
    mixers=("residual", "hc", "mhc"),
    depths=(2, 4),
    lrs=None,
    seeds=(0, 1),
    steps=40,
    spike=None,
    diverge=None,
    pending=False,
  )
  for rdir in (root / "runs").iterdir():
    _with_spread(rdir, rdir.name.split("_L")[0])
  return root, write_report(root)


def test_stream_spread_in_the_report(spread_sweep, tmp_path, monkeypatch):
  root, paths = spread_sweep
  assert "stream_spread" in paths and Path(paths["stream_spread"]).read_bytes()[:8] == PNG
  page = Path(paths["summary_md"]).read_text()
  assert "(stream_spread.png)" in page and "stream spread" in page.lower()
  groups = pd.read_csv(paths["groups_csv"])
  hc = groups[(groups["mixer"] == "hc") & (groups["depth"] == 4)].iloc[0]
  mhc = groups[(groups["mixer"] == "mhc") & (groups["depth"] == 4)].iloc[0]
  assert hc["stream_spread_mean_gmean"] > 20 * mhc["stream_spread_mean_gmean"]
  # the figure: one panel per depth, a line and a band per mixer (2 seeds each)
  figs = _capture(monkeypatch)
  metrics, runs, _ = _plot_inputs(root)
  assert plots.stream_spread_vs_layer(metrics, runs, tmp_path / "s.png")
  assert figs[-1] == [(3, 3), (3, 3)]
  # logs without stream_spread: no figure, and summary.md says why
  assert (
    plots.stream_spread_vs_layer(metrics.drop(columns="stream_spread"), runs, tmp_path / "n.png")
    is None
  )
  other = _small_sweep(tmp_path / "old", ("hc", "mhc"))
  page = Path(write_report(other)["summary_md"]).read_text()
  assert "No stream spread plot" in page


# =========================================================================== the tables
def test_tables_lead_with_the_held_out_loss(seeded):
  root, paths = seeded
  md = Path(paths["summary_md"]).read_text()
  groups_head = next(ln for ln in md.splitlines() if "| n_seeds |" in ln).split(" | ")
  i = groups_head.index("n_seeds")
  assert groups_head[i + 1 : i + 3] == ["eval_loss", "final_loss"]
  assert "max_grad_norm (gmean)" in groups_head
  paired_head = next(ln for ln in md.splitlines() if "mixer_a | mixer_b" in ln)
  cells = paired_head.split(" | ")
  assert cells[cells.index("n_pairs") + 1].startswith("Δ eval_loss")
  assert "ratio max_grad_norm" in paired_head or "ratio amax_fwd_composite" in paired_head


def test_a_star_needs_more_than_rounding():
  rows = []
  for m, gain, loss in (
    ("mhc", 1.0, 2.6),
    ("mhc_lite", 1.0 + 2.4e-7, 2.6 + 2.4e-7),
    ("hc", 9.0, 2.4),
  ):
    for s in range(3):
      rows.append(
        (f"{m}{s}", m, 4, s, "done", 100, loss + 0.01 * s, gain * (1 + 0.1 * s * (m == "hc")))
      )
  df = pd.DataFrame(
    rows,
    columns=[
      "run",
      "mixer",
      "depth",
      "seed",
      "status",
      "steps",
      "eval_loss",
      "amax_fwd_composite_max",
    ],
  )
  shown = _paired_display(paired_table(df)).set_index(["mixer_a", "mixer_b"])
  assert not shown.loc[("mhc", "mhc_lite"), "Δ eval_loss"].endswith("*")  # 2.4e-7: rounding
  assert not shown.loc[("mhc", "mhc_lite"), "ratio amax_fwd_composite_max"].endswith("*")
  assert shown.loc[("hc", "mhc"), "Δ eval_loss"].endswith("*")
  assert shown.loc[("hc", "mhc"), "ratio amax_fwd_composite_max"].endswith("*")


def _scale_table():
  """hc_mhc_scale as it was: hc and mhc at depth 32, widths 32-128, 3 seeds each (held-out loss
  and per-token composite gain per run, from docs/studies/hc_mhc_scale/summary.csv's final
  losses)."""
  loss = {
    ("hc", 32): (2.433, 2.461, 2.536),
    ("hc", 64): (2.253, 2.317, 2.327),
    ("hc", 128): (2.213, 2.219, 2.316),
    ("mhc", 32): (2.588, 2.609, 2.603),
    ("mhc", 64): (2.324, 2.408, 2.506),
    ("mhc", 128): (2.318, 2.443, 2.562),
  }
  rows = []
  for (m, w), vals in loss.items():
    for s, v in enumerate(vals):
      rows.append((f"{m}_{w}_{s}", m, w, s, 32, "done", 149, v, v + 0.01, 0, 2.0, 2.0))
  return pd.DataFrame(
    rows,
    columns=[
      "run",
      "mixer",
      "width",
      "seed",
      "depth",
      "status",
      "steps",
      "eval_loss",
      "final_loss",
      "spike_count",
      "amax_fwd_composite_max",
      "amax_fwd_composite_tok_mean_max",
    ],
  )


def test_finding_quotes_one_group_with_its_n():
  table = _scale_table()
  text = finding(table)
  m = re.match(
    r"At width (\d+), hc reached a lower held-out loss than mhc: ([\d.]+) vs ([\d.]+) nats per "
    r"token \(means over 3 seeds each\); paired difference mhc - hc \+([\d.]+) nats, 95% CI "
    r"\[([-\d.e]+), ([-\d.e]+)\], n = 3 seed pairs",
    text,
  )
  assert m, text
  width = int(m.group(1))
  g = table[table["width"] == width].groupby("mixer")["eval_loss"].mean()
  assert float(m.group(2)) == pytest.approx(g["hc"], rel=2e-3)
  assert float(m.group(3)) == pytest.approx(g["mhc"], rel=2e-3)
  row = paired_table(table)
  row = row[(row["width"] == width) & (row["metric"] == "eval_loss")].iloc[0]
  assert (float(m.group(4)), float(m.group(5)), float(m.group(6))) == pytest.approx(
    (row["diff_mean"], row["diff_ci_lo"], row["diff_ci_hi"]), rel=2e-3
  )
  pooled = table.groupby("mixer")["eval_loss"].mean()
  assert f"{pooled['hc']:.3g} vs" not in text  # never the means pooled over widths
  assert "9 runs" not in text and "means over 9" not in text
  # the other widths are counted, not quoted
  n_sig = sum(
    bool(r["significant"]) for _, r in paired_table(table).iterrows() if r["metric"] == "eval_loss"
  )
  assert text.endswith(f"the paired interval excludes 0 at {n_sig} of 3 widths.")


def test_finding_counts_the_runs_that_learned():
  kl = {  # docs/studies/bayes_depth at depth 8: one residual seed learned
    "residual": (1.313, 1.704, 0.0075),
    "hc": (2.059, 0.0447, 0.00018),
    "mhc": (1.547, 0.00097, 0.00006),
    "mhc_lite": (0.0011, 0.0949, 0.0116),
  }
  rows = [
    (f"{m}{s}", m, 8, s, "done", 2000, 0.65 + v, v, 30, 1.0, 1.0)
    for m, vals in kl.items()
    for s, v in enumerate(vals)
  ]
  text = finding(_table(rows))
  assert "did not" not in text, text
  assert text.startswith("mhc_lite learned the task in 3 of 3 runs (mean KL 0.0359 bits"), text
  assert "residual in 1 of 3 (mean 1.01 bits)" in text


# =========================================================================== arms
@pytest.fixture(scope="module")
def arm_sweep(tmp_path_factory):
  """hc_mhc_scale's design in small: arms that share a mixer and differ in its options (mhc with
  the default init and with stream_init=symmetric), 3 seeds each; the symmetric arm's held-out
  loss is 0.3 nats higher."""
  root = tmp_path_factory.mktemp("arms")
  arms = {
    "hc": {"model.mixer": "hc"},
    "mhc": {"model.mixer": "mhc"},
    "mhc_sym": {"model.mixer": "mhc", "model.mixer_options.stream_init": "symmetric"},
  }
  runs = {}
  for arm, ov in arms.items():
    for s in range(3):
      name = f"arm={arm},seed={s}"
      write_run(root / "runs" / name, mixer=ov["model.mixer"], seed=s, steps=40, eval_every=20)
      if arm == "mhc_sym":
        _rewrite(
          root / "runs" / name,
          lambda r: r.update({"eval/loss": r["eval/loss"] + 0.3}) if "eval/loss" in r else None,
        )
      runs[name] = {"status": "done", "overrides": {**ov, "train.seed": s}, "dir": f"runs/{name}"}
  (root / "manifest.json").write_text(json.dumps({"runs": runs}))
  return root


def test_arms_that_share_a_mixer_are_compared(arm_sweep):
  table = summary_table(arm_sweep)
  assert list(table["stream_init"].dropna().unique()) == ["symmetric"]
  paired = paired_table(table)
  pairs = set(zip(paired["mixer_a"], paired["mixer_b"]))
  assert pairs == {
    ("hc", "mhc"),
    ("hc", "mhc (stream_init=symmetric)"),
    ("mhc", "mhc (stream_init=symmetric)"),
  }
  assert "stream_init" not in paired.columns  # the option names the arm, not a group
  row = paired[
    (paired["mixer_a"] == "mhc")
    & (paired["mixer_b"] == "mhc (stream_init=symmetric)")
    & (paired["metric"] == "eval_loss")
  ].iloc[0]
  assert row["n_pairs"] == 3 and row["diff_mean"] == pytest.approx(0.3) and row["significant"]
  text = finding(table)
  assert "mhc (stream_init=symmetric)" in text, text


def test_screen_fits_a_screen_and_says_the_sentence(seeded):
  from mhc_jax.sweep.report import SCREEN_COLUMNS, screen

  root, paths = seeded
  text = screen(root)
  table = summary_table(root)
  assert finding(table) in text and paths["summary_csv"] in text
  head = text.splitlines()[0].strip("| ").split(" | ")
  assert head == ["mixer", "depth", "seed", *[c for c in SCREEN_COLUMNS if table[c].notna().any()]]
  assert len(head) <= 9 and len(table.columns) > 30  # the few that matter; the CSV has all
  assert max(len(ln) for ln in text.splitlines()[: len(table) + 2]) <= 160


def test_a_report_on_the_object_store(gcs, tmp_path_factory, capsys):
  """``mhc-jax report gs://...``: the sweep's runs are read from the store and every file of the
  report (summary.md, the CSVs, the PNGs) is written there, nothing on the local disk (the gcs
  fixture checks); the same tables as the report of the same sweep on local disk."""
  from fake_gcs import keys

  from mhc_jax import storage

  local = _small_sweep(tmp_path_factory.mktemp("to_upload"), ("residual", "hc", "mhc"))
  for f in local.rglob("*"):
    if f.is_file():
      storage.path(f"{gcs}/sw/{f.relative_to(local)}").write_bytes(f.read_bytes())
  paths = write_report(f"{gcs}/sw")
  stored = keys()
  for name in ("summary.md", "summary.csv", "groups.csv", "paired.csv", "loss_curves.png"):
    assert f"bucket/sw/report/{name}" in stored, name
  assert paths["summary_md"] == f"{gcs}/sw/report/summary.md"
  png = storage.path(f"{gcs}/sw/report/loss_curves.png").read_bytes()
  assert png[:8] == PNG and len(png) > 8_000
  page = storage.path(paths["summary_md"]).read_text()
  assert page.startswith("# Sweep report: sw\n")
  assert all(f"| {n} |" in page for n in summary_table(local)["run"])
  here = summary_table(local).drop(columns=["run"])
  there = summary_table(f"{gcs}/sw").drop(columns=["run"])
  pd.testing.assert_frame_equal(here, there)
  from mhc_jax import cli

  capsys.readouterr()
  assert cli.main(["report", f"{gcs}/sw"]) == 0  # the command, as a user types it
  assert capsys.readouterr().out.endswith(f"report: {gcs}/sw/report/summary.md\n")


def test_report_command_prints_the_screen_table(tmp_path, capsys):
  """``mhc-jax report`` prints what a finished sweep prints (the screen-sized table, the
  sentence, where the full CSV is: under ``--out`` when given), not every column."""
  from mhc_jax import cli

  sweep = _small_sweep(tmp_path / "sw", ("residual", "hc"))
  capsys.readouterr()
  assert cli.main(["report", str(sweep), "--out", str(tmp_path / "rep")]) == 0
  out = capsys.readouterr().out
  assert out.startswith(screen(sweep, tmp_path / "rep").split("\n")[0])
  assert f"Every column, with its definition: {tmp_path / 'rep' / 'summary.csv'}" in out
  assert "amax_bwd_composite_tok_max_max" not in out  # a column of the full table only
  assert out.endswith(f"report: {tmp_path / 'rep' / 'summary.md'}\n")


def test_finding_says_who_diverged_first():
  """Rule 1 of docs/statistics.md ("The sentence under the table"): a mixer whose runs diverged
  (final loss NaN/inf) while another's did not comes before every other finding, counted over
  the sweep and naming where; equal divergence in every mixer says nothing of it."""
  nan = math.nan
  spec = {
    ("residual", 4): (1.0, 0.05, 0, 1.0, 1.0),
    ("hc", 4): (1.0, 0.05, 0, 1.0, 1.0),
    ("residual", 8): (1.0, 0.05, 0, 1.0, 1.0),
    ("hc", 8): (nan, 2.1, 3, 9.0, 9.0),  # would also make rules 2-4 fire: rule 1 comes first
  }
  text = finding(_table(_rows(spec, seeds=(0, 1, 2))))
  assert text.startswith("hc diverged in 3 of 6 runs (depth 8) while residual never did"), text
  both = {k: (nan if k[1] == 8 else v[0], *v[1:]) for k, v in spec.items()}
  assert "diverged" not in finding(_table(_rows(both, seeds=(0, 1, 2))))


def test_a_parallel_sweeps_finished_runs_read_as_done_while_it_runs(tmp_path):
  """A --parallel sweep writes "running" for every run it submits and refreshes the manifest
  only when all are collected; a run whose summary.json says it finished is read as finished
  (the report and the stability maps look at a sweep while it runs), one still training as
  running."""
  root = make_sweep(tmp_path / "s", mixers=("hc",), depths=(2,), lrs=None, pending=False)
  manifest = json.loads((root / "manifest.json").read_text())
  (name,) = manifest["runs"]
  manifest["runs"][name]["status"] = "running"
  manifest["runs"]["training"] = {
    "status": "running", "overrides": {"model.mixer": "hc", "model.depth": 4}, "dir": "runs/t"
  }  # fmt: skip
  (root / "manifest.json").write_text(json.dumps(manifest))
  (root / "runs" / "t").mkdir()
  status = summary_table(root).set_index("run")["status"]
  assert status[name] == "done" and status["training"] == "running"
