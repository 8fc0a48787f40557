"""Stability maps (mhc_jax.sweep.lrmap): best lr, LR sensitivity, largest stable lr and the phase
table against hand computations on planted frames; the report at each arm's best lr."""

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fixtures_logs import make_sweep

from mhc_jax.sweep import lrmap, plots, report, study
from mhc_jax.sweep.lrmap import best_lr_rows
from mhc_jax.sweep.report import write_report
from mhc_jax.sweep.summary import summary_table

nan = math.nan
T2 = 4.302652729911275  # t(0.975, 2)


def _frame(cells):
  """cells: {(arm, lr): [eval_loss per seed]}; loss_init 5 (seed 2: 6), depth 4, width 32."""
  rows = [
    dict(arm=a, depth=4, width=32, lr=lr, seed=s, loss_init=6.0 if s == 2 else 5.0, eval_loss=y)
    for (a, lr), ys in cells.items()
    for s, y in enumerate(ys)
  ]
  return pd.DataFrame(rows)


PLANTED = _frame(
  {
    ("a", 1e-3): [3.0, 3.2, 3.1],
    ("a", 1e-2): [2.0, 2.4, 2.2],  # the best finite seed-mean
    ("a", 1e-1): [1.9, nan, 1.8],  # lower where finite, but a seed diverged: not eligible
    ("a", 3e-1): [4.0, 4.0, 4.0],  # stable again above the hole: not the largest stable lr
    ("b", 1e-2): [nan, nan, nan],  # never finite: no best lr
    ("c", 1e-2): [2.0, 2.0, 2.0],
    ("c", 1e-1): [4.6, 2.5, 2.5],  # 4.6 >= 0.9 x 5: diverged although finite
  }
)


def test_best_lr_and_its_interval_by_hand():
  tab = lrmap.lr_table(PLANTED).set_index("arm")
  a = tab.loc["a"]
  assert a["best_lr"] == 1e-2 and a["n_seeds"] == 3 and a["n_lr"] == 4
  half = T2 * 0.2 / math.sqrt(3)  # s.d. of (2.0, 2.4, 2.2) is 0.2
  assert a["loss_at_best"] == pytest.approx(2.2)
  assert (a["loss_at_best_ci_lo"], a["loss_at_best_ci_hi"]) == pytest.approx(
    (2.2 - half, 2.2 + half)
  )
  assert math.isnan(tab.loc["b", "best_lr"]) and math.isnan(tab.loc["b", "largest_stable_lr"])


def test_lr_sensitivity_per_seed_by_hand():
  # per seed: mean over the 4 lrs of min(loss, init) minus the seed's best (NaN -> init)
  s0 = ((3.0 - 1.9) + (2.0 - 1.9) + 0 + (4.0 - 1.9)) / 4
  s1 = ((3.2 - 2.4) + 0 + (5.0 - 2.4) + (4.0 - 2.4)) / 4
  s2 = ((3.1 - 1.8) + (2.2 - 1.8) + 0 + (4.0 - 1.8)) / 4  # initial loss 6
  a = lrmap.lr_table(PLANTED).set_index("arm").loc["a"]
  mean, half = np.mean([s0, s1, s2]), T2 * np.std([s0, s1, s2], ddof=1) / math.sqrt(3)
  assert (s0, s1, s2) == pytest.approx((0.825, 1.25, 0.975))
  assert a["lr_sensitivity"] == pytest.approx(mean)
  assert a["lr_sensitivity_ci_lo"] == pytest.approx(mean - half)
  assert a["lr_sensitivity_ci_hi"] == pytest.approx(mean + half)


def test_largest_stable_lr_walks_up_from_the_best():
  tab = lrmap.lr_table(PLANTED).set_index("arm")
  assert tab.loc["a", "largest_stable_lr"] == 1e-2 and tab.loc["a", "first_unstable_lr"] == 1e-1
  assert tab.loc["c", "largest_stable_lr"] == 1e-2 and tab.loc["c", "first_unstable_lr"] == 1e-1
  stable = lrmap.lr_table(PLANTED[PLANTED["lr"] < 0.05]).set_index("arm")  # never diverged
  assert stable.loc["a", "largest_stable_lr"] == 1e-2 and math.isnan(
    stable.loc["a", "first_unstable_lr"]
  )
  assert list(lrmap.diverged(PLANTED[PLANTED["arm"] == "c"])) == [0, 0, 0, 1, 0, 0]


def test_phase_table_fractions_and_gains_by_hand():
  runs = pd.DataFrame(
    dict(
      arm="hc",
      depth=[4, 4, 4, 8],
      width=32,
      seed=[0, 1, 2, 0],
      loss_init=5.0,
      eval_loss=[2.0, nan, 2.4, 2.2],
      spike_count=[0, 0, 3, 0],
      amax_fwd_composite_tok_mean_max=[1.0, 4.0, 16.0, 2.0],
    )
  )
  tab = lrmap.phase_table(runs).set_index("depth")
  d4 = tab.loc[4]
  assert (d4["frac_diverged"], d4["frac_spiked"], d4["frac_unstable"]) == pytest.approx(
    (1 / 3, 1 / 3, 2 / 3)
  )
  assert d4["amax_fwd_composite_tok_mean_max_gmean"] == pytest.approx(4.0)  # (1*4*16)^(1/3)
  assert math.isnan(d4["eval_loss_mean"]) and tab.loc[8, "frac_unstable"] == 0


def test_runs_table_names_arms_from_run_names():
  summary = pd.DataFrame(
    dict(
      run=["arm=hc_qk,depth=4,seed=0", "mixer=mhc,seed=0"],
      mixer=["hc", "mhc"],
      lr=0.01,
      seed=0,
      loss_init=5.0,
      eval_loss=[2.0, 4.9],
    )
  )
  runs = lrmap.runs_table(summary)
  assert list(runs["arm"]) == ["hc_qk", "mhc"] and list(runs["diverged"]) == [False, True]
  assert list(runs.columns) == ["arm", *summary.columns, "diverged", "failure"]


def test_runs_table_keeps_finished_runs_only():
  """A sweep looked at while it runs: a run still training (no eval_loss yet) is not a
  divergence, so only ended runs enter the map; a failed one (halted by the non-finite policy)
  is one."""
  summary = pd.DataFrame(
    dict(
      run=[f"arm=hc,lr={lr},seed=0" for lr in (0.01, 0.1, 1.0, 3.0)],
      status=["done", "running", "failed", "pending"],
      lr=[0.01, 0.1, 1.0, 3.0],
      seed=0,
      loss_init=5.0,
      eval_loss=[2.0, nan, nan, nan],
    )
  )
  runs = lrmap.runs_table(summary)
  assert list(runs["status"]) == ["done", "failed"] and list(runs["diverged"]) == [False, True]


def test_map_figures_draw_and_skip(tmp_path):
  runs = PLANTED.assign(diverged=lrmap.diverged(PLANTED), baseline=3.0)
  assert plots.lr_curves(runs.assign(failure=lrmap.failure(runs)), tmp_path / "c.png")
  tab = lrmap.lr_table(PLANTED)
  out = plots.heatmaps(tab, tmp_path / "h.png", x="depth", y="arm", values=["largest_stable_lr"])
  assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG" and out
  assert plots.lr_curves(runs.iloc[:0], tmp_path / "none.png") is None
  assert (
    plots.heatmaps(tab.iloc[:0], tmp_path / "n.png", x="depth", y="arm", values=["best_lr"]) is None
  )
  assert not (tmp_path / "none.png").exists() and not (tmp_path / "n.png").exists()


def test_report_compares_at_each_arms_best_lr(tmp_path, monkeypatch):
  root = make_sweep(
    tmp_path / "s",
    mixers=("hc", "mhc"),
    depths=(2,),
    seeds=(0, 1),
    steps=30,
    spike=None,
    diverge=None,
    pending=False,
  )
  table = summary_table(root)
  best = best_lr_rows(table)
  assert "lr" not in best.attrs["id_columns"] and best["best_lr"].notna().all()
  for (m, d), g in table.groupby(["mixer", "depth"]):  # the lowest seed-mean eval_loss
    want = g.groupby("lr")["eval_loss"].mean().idxmin()
    got = best[(best["mixer"] == m) & (best["depth"] == d)]
    assert set(got["best_lr"]) == {want} and len(got) == 2
  monkeypatch.setattr(report, "_figures", lambda *a: ([], []))  # the text, not the figures
  paths = write_report(root)
  page = open(paths["summary_md"]).read()
  assert "compares the arms at each fixed lr" in page and "At each arm's own best lr" in page
  assert "paired_best_lr_csv" in paths


def test_phase_map_analysis_from_a_runs_csv(tmp_path):
  import importlib.util

  root = Path(__file__).resolve().parents[1] / "docs" / "studies" / "phase_map" / "analysis.py"
  spec = importlib.util.spec_from_file_location("phase_map_analysis", root)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  rows = [
    dict(arm=a, width=w, depth=d, seed=s, loss_init=5.0, spike_count=0, eval_loss=2.0 + 0.1 * s)
    | {lrmap.GAIN: 1.0 + d * (a == "hc")}
    for a in ("hc", "mhc")
    for w in (16, 32)
    for d in (4, 8)
    for s in range(2)
  ]
  rows[-1]["eval_loss"] = nan  # mhc, width 32, depth 8, seed 1 diverged
  pd.DataFrame(rows).to_csv(tmp_path / "runs.csv", index=False)
  assert mod.main([str(tmp_path / "runs.csv")]) == 0
  phase = pd.read_csv(tmp_path / "phase.csv")
  assert len(phase) == 8 and phase["frac_unstable"].sum() == 0.5
  assert (tmp_path / "phase_map.png").read_bytes()[:4] == b"\x89PNG"


def _floor(ys, baseline=3.2):
  """Runs at depth 4 with initial loss 5.5 and the trivial predictor's loss ``baseline``."""
  return pd.DataFrame(dict(eval_loss=ys, loss_init=5.5, baseline=baseline))


def test_failure_kinds_by_hand():
  """diverged: non-finite or >= 0.9 x the initial loss (4.95 here); no_training: finite, below
  that, but not at least NO_TRAINING_MARGIN (0.1) below the baseline (3.1 here); else none."""
  runs = _floor([2.5, 3.05, 3.15, 3.3, 4.9, 4.95, 5.6, nan])
  want = ["none", "none", "no_training", "no_training", "no_training", "diverged", "diverged"]
  assert list(lrmap.failure(runs)) == [*want, "diverged"]
  # without a baseline (a task that reports none) only the divergence rule applies
  assert list(lrmap.failure(runs.drop(columns="baseline")))[:5] == ["none"] * 5
  assert list(lrmap.failure(runs.assign(baseline=nan)))[:5] == ["none"] * 5


def test_working_edge_counts_runs_that_learned_nothing():
  """An arm whose high lrs end at the baseline: the old rule (diverged only) calls every lr
  stable; the floor puts its edge where it stops learning and names the failure."""
  cells = {
    ("a", 1e-2): [2.5, 2.6, 2.55],
    ("a", 1e-1): [2.7, 2.8, 2.75],
    ("a", 1.0): [3.2, 3.25, 3.0],  # two seeds at the baseline: no_training
    ("h", 1e-2): [2.5, 2.6, 2.55],
    ("h", 1e-1): [3.19, 5.4, 2.9],  # one stuck, one back at the uniform guess
    ("p", 1e-2): [3.2, 3.3, 3.25],  # never learned
    ("p", 1e-1): [3.3, 3.3, 3.3],
  }
  runs = _frame(cells).assign(baseline=3.2, loss_init=5.5)
  tab = lrmap.lr_table(runs).set_index("arm")
  assert tab.loc["a", "largest_stable_lr"] == 1.0 and math.isnan(tab.loc["a", "first_unstable_lr"])
  assert tab.loc["a", "largest_working_lr"] == 1e-1 and tab.loc["a", "first_failing_lr"] == 1.0
  assert tab.loc["a", "first_failure"] == "no_training"
  assert tab.loc["h", "largest_working_lr"] == 1e-2 and tab.loc["h", "first_failure"] == "both"
  assert tab.loc["h", "largest_stable_lr"] == 1e-2  # 5.4 >= 0.9 x 5.5: diverged as before
  p = tab.loc["p"]  # its best lr failed: no working lr on the grid
  assert math.isnan(p["largest_working_lr"]) and p["first_failing_lr"] == 1e-2
  assert p["first_failure"] == "no_training" and p["largest_stable_lr"] == 1e-1
  assert list(tab["n_no_training"]) == [2, 1, 6] and list(tab["n_diverged"]) == [0, 1, 0]


def test_flags_say_where_a_verdict_rests_on_little():
  """Margin line 3.1 (baseline 3.2): an edge set by one seed stuck 0.02 nats above the line
  (one seed, near the margin: a 0.05 margin lets lr 1 work); two seeds stuck 0.2-0.3 above
  (neither); nothing failing (censored, the best lr at the grid's top); a working seed 0.03 below
  the line (a 0.15 margin fails it); a stuck seed near the line beside a diverged one (the
  divergence holds the edge: not near)."""
  cells = {
    ("one", 1e-2): [2.5, 2.6, 2.55],
    ("one", 1e-1): [2.7, 2.8, 2.75],
    ("one", 1.0): [3.12, 2.9, 2.95],
    ("two", 1e-3): [2.9, 2.9, 2.9],
    ("two", 1e-2): [2.5, 2.6, 2.55],
    ("two", 1e-1): [3.3, 3.4, 2.7],
    ("top", 1e-2): [2.5, 2.6, 2.55],
    ("top", 1e-1): [2.4, 2.45, 2.5],
    ("low", 1e-2): [2.5, 2.6, 2.55],
    ("low", 1e-1): [3.07, 2.8, 2.8],
    ("low", 1.0): [nan, nan, nan],
    ("div", 1e-2): [2.5, 2.6, 2.55],
    ("div", 1e-1): [3.12, nan, 2.8],
  }
  tab = lrmap.lr_table(_frame(cells).assign(baseline=3.2, loss_init=5.5)).set_index("arm")
  flags = ["edge_censored", "edge_one_seed", "edge_near_margin", "best_censored"]
  assert list(tab.columns[-4:]) == flags and tab[flags].dtypes.eq(bool).all()
  assert tab.loc["one", flags].tolist() == [False, True, True, True]
  assert tab.loc["two", flags].tolist() == [False, False, False, False]
  assert tab.loc["top", flags].tolist() == [True, False, False, True]
  assert tab.loc["low", flags].tolist() == [False, False, True, True]
  assert tab.loc["div", flags].tolist() == [False, False, False, True]
  assert tab.loc[["one", "low"], "largest_working_lr"].tolist() == [1e-1, 1e-1]
  no_best = lrmap.lr_table(PLANTED).set_index("arm").loc["b", flags]  # never finite: no verdict
  assert not no_best.any()


def test_phase_table_separates_the_failure_kinds():
  runs = _floor([2.5, 3.15, nan, 2.6]).assign(arm="x", depth=[4, 4, 4, 8], width=32, seed=0)
  runs = runs.assign(seed=[0, 1, 2, 0], spike_count=0, **{lrmap.GAIN: 1.0})
  d4 = lrmap.phase_table(runs).set_index("depth").loc[4]
  assert (d4["frac_diverged"], d4["frac_no_training"], d4["frac_failed"]) == pytest.approx(
    (1 / 3, 1 / 3, 2 / 3)
  )


def test_study_runs_reads_each_runs_task_baseline(tmp_path):
  """A text sweep's runs get the byte-frequency loss of their own seed's held-out batches, from
  their config.yaml; a task that reports no baseline (a wind tunnel) gets NaN: no floor."""
  import yaml

  from mhc_jax.data import make_source

  corpus = tmp_path / "c.txt"
  corpus.write_bytes(np.random.default_rng(0).choice([97, 98, 99, 32], 5000).astype(np.uint8))
  root = make_sweep(tmp_path / "s", mixers=("hc",), depths=(2,), seeds=(0, 1), wind_tunnel=False)
  data = dict(task="text", seq_len=16, batch_size=4, eval_batches=2, options={"path": str(corpus)})
  for d in (root / "runs").iterdir():
    if (d / "config.yaml").exists():
      c = yaml.safe_load((d / "config.yaml").read_text()) | {"data": data}
      (d / "config.yaml").write_text(yaml.safe_dump(c))
  runs = study.read_runs(root)
  for seed in (0, 1):
    want = make_source("text", seq_len=16, seed=seed, path=str(corpus)).baseline(4, 2)
    assert np.allclose(runs.loc[runs["seed"] == seed, "baseline"], want)
  assert runs["baseline"].nunique() == 2 and "failure" in runs
  tunnel = study.read_runs(make_sweep(tmp_path / "w", mixers=("hc",), depths=(2,), seeds=(0,)))
  assert tunnel["baseline"].isna().all()


def test_heatmaps_share_one_colour_scale_per_quantity(tmp_path, monkeypatch):
  """A panel of 1.00s beside one spanning 1e4-1e30: one log scale for the quantity across the
  panels, so the constant panel is one colour; fractions on a fixed [0, 1] scale."""
  tab = pd.DataFrame(
    dict(
      arm=["mhc"] * 4 + ["hc"] * 4,
      width=[16, 32] * 4,
      depth=[4, 4, 8, 8] * 2,
      gain=[1.0] * 4 + [1e4, 1e8, 1e20, 1e30],
      frac_failed=[0.0] * 4 + [0.0, 0.25, 0.5, 0.5],
    )
  )
  figs = []
  monkeypatch.setattr(plots, "_save", lambda fig, path, dpi: figs.append(fig) or str(path))
  plots.heatmaps(
    tab,
    tmp_path / "p.png",
    x="width",
    y="depth",
    values=["gain", "frac_failed"],
    panel="arm",
    log=["gain"],
  )
  (fig,) = figs
  images = [ax.images[0] for ax in fig.axes if ax.images]
  assert len(images) == 4
  gain, frac = images[:2], images[2:]
  assert {(im.norm.vmin, im.norm.vmax) for im in gain} == {(1.0, 1e30)}
  assert {(im.norm.vmin, im.norm.vmax) for im in frac} == {(0.0, 1.0)}
  constant = gain[0].get_array()  # mhc's panel: every cell maps to one colour
  assert len({tuple(gain[0].to_rgba(v)) for v in constant.compressed()}) == 1
  titles = [ax.get_title() for ax in fig.axes if ax.images]
  assert all(len(t) <= 20 for t in titles), titles  # short titles: none run into the next
  assert plots.heat_norm(np.array([2.0, 2.0]), log=True)(2.0) == pytest.approx(0.5)


def test_edge_chart_marks_each_failure_kind(tmp_path, monkeypatch):
  """One row per arm grouped by family, a panel per depth: the working range (best lr to the
  largest working lr) and the first failing lr marked by its kind; then LR sensitivity."""
  tab = pd.DataFrame(
    dict(
      arm=["a", "a", "b", "b"],
      depth=[4, 8, 4, 8],
      best_lr=[0.03, 0.03, 0.03, 0.1],
      largest_working_lr=[1.0, 0.1, nan, 0.1],
      first_failing_lr=[nan, 0.3, 0.03, 1.0],
      first_failure=["", "diverged", "no_training", "both"],
      lr_sensitivity=[0.4, 0.9, 0.5, 0.6],
      lr_sensitivity_ci_lo=[0.3, 0.8, 0.4, 0.5],
      lr_sensitivity_ci_hi=[0.5, 1.0, 0.6, 0.7],
    )
  )
  figs = []
  monkeypatch.setattr(plots, "_save", lambda fig, path, dpi: figs.append(fig) or str(path))
  plots.edge_chart(tab, tmp_path / "e.png", families={"fam A": ["a"], "fam B": ["b"]})
  (fig,) = figs
  assert len(fig.axes) == 3  # depths 4, 8 and the LR sensitivity panel
  labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
  assert labels == ["a", "b"] and "fam B" in [t.get_text() for t in fig.axes[0].texts]
  kinds = {h.get_label() for h in fig.legends[0].legend_handles}
  assert {"diverged", "did not train", "both", "above the grid"} <= kinds
  assert plots.edge_chart(tab.iloc[:0], tmp_path / "none.png", families={}) is None


def test_lr_curves_can_show_each_seed_instead_of_a_band(tmp_path, monkeypatch):
  """band="seeds": every seed's value is drawn as a point and nothing reaches past the data
  (two seeds' t band, t = 12.7, ran far outside it in the horizon study's figure)."""
  drawn = {}
  monkeypatch.setattr(plots, "_save", lambda fig, path, dpi: drawn.setdefault("fig", fig) and path)
  runs = PLANTED[PLANTED["arm"].isin(["a", "c"])].assign(baseline=3.0, study="one panel")
  runs = runs.assign(diverged=lrmap.diverged(runs), failure=lrmap.failure(runs))
  plots.lr_curves(runs, tmp_path / "c.png", panel="study", line="arm", band="seeds")
  ax = drawn["fig"].axes[0]
  dots = [ln for ln in ax.lines if ln.get_marker() == "."]
  assert sum(len(ln.get_xdata()) for ln in dots) == len(runs)  # each run once, on its own line
  points = {(round(x, 6), round(y, 6)) for ln in ax.lines for x, y in ln.get_xydata()}
  y = np.where(
    np.isfinite(runs["eval_loss"]), np.fmin(runs["eval_loss"], runs["loss_init"]), runs["loss_init"]
  )
  assert {(round(a, 6), round(b, 6)) for a, b in zip(runs["lr"], y)} <= points
  assert not ax.collections  # no t band (fill_between) drawn
  lo, hi = ax.get_ylim()
  assert lo >= min(y) - 0.5 and hi <= max(y) + 0.5
  drawn.clear()
  plots.lr_curves(runs, tmp_path / "c.png", panel="study", line="arm", band=True)
  assert drawn["fig"].axes[0].collections  # the default draws it
