"""The committed study results can be recomputed from their raw per-run rows: each study's
analysis, run on its committed runs.csv, gives the committed interval tables (docs/studies/)."""

from __future__ import annotations

import importlib.util
import itertools
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from mhc_jax.sweep import lrmap

STUDIES = Path(__file__).resolve().parents[1] / "docs" / "studies"


def _analysis(study: str):
  spec = importlib.util.spec_from_file_location(
    f"{study}_analysis", STUDIES / study / "analysis.py"
  )
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.parametrize("study", ["bayes_thesis"])
def test_committed_intervals_recompute_from_runs_csv(study, tmp_path):
  here = STUDIES / study
  runs = pd.read_csv(here / "runs.csv")
  assert len(runs) == 96 and runs.groupby(["depth", "arm"]).size().eq(8).all()
  groups, paired = _analysis(study).tables(runs)
  pd.testing.assert_frame_equal(
    groups.reset_index(drop=True), pd.read_csv(here / "groups.csv"), check_dtype=False, rtol=1e-9
  )
  pd.testing.assert_frame_equal(
    paired.reset_index(drop=True), pd.read_csv(here / "paired.csv"), check_dtype=False, rtol=1e-9
  )
  assert _analysis(study).main([str(here / "runs.csv"), "--out", str(tmp_path)]) == 0
  for name in ("groups.csv", "paired.csv", "geometry_groups.csv", "geometry_paired.csv"):
    got, want = pd.read_csv(tmp_path / name), pd.read_csv(here / name)
    pd.testing.assert_frame_equal(got, want, check_dtype=False, rtol=1e-9)
  assert (tmp_path / "kl_vs_step.png").read_bytes()[:4] == b"\x89PNG"
  # the README's primary answer: no hc - mhc difference survives Holm at any depth
  primary = paired[paired.family == "primary"]
  assert list(primary.depth) == [2, 4, 8] and (primary.p_holm > 0.05).all()
  assert ((primary.lo < 0) & (primary.hi > 0)).all()


def test_paired_rows_pair_by_seed_and_holm_is_monotone():
  """A planted difference: arm b is arm a + 1 log2 unit exactly on every seed, another arm pair
  differs by noise; the paired interval of the planted one is [1, 1] and its Holm p the smallest."""
  mod = _analysis("bayes_thesis")
  rows = []
  for seed in range(6):
    base = seed * 0.7  # a large between-seed spread that pairing removes
    for arm, v in (("hc", base + 1.0), ("mhc", base), ("residual", base + (seed % 2) * 0.3)):
      rows.append(dict(depth=2, arm=arm, seed=seed, primary_mean_log2_kl=v))
  tab = mod.paired(
    pd.DataFrame(rows), [("hc", "mhc"), ("mhc", "residual")], "primary_mean_log2_kl", "f"
  )
  hc = tab[tab.comparison == "hc - mhc"].iloc[0]
  assert hc["diff"] == pytest.approx(1.0) and hc["lo"] == pytest.approx(1.0)
  assert hc["ratio"] == pytest.approx(2.0) and hc["p_holm"] == min(tab.p_holm)
  assert (tab.p_holm >= tab.p).all()


@pytest.mark.parametrize("folder", ["lr_curves/pilot", "lr_curves"])
def test_lr_tables_recompute_from_runs_csv(folder, tmp_path):
  """lr_sensitivity.csv, paired_best_lr.csv and mechanism.csv, recomputed from the committed
  runs.csv by the study's analysis (the figures are drawn from the same rows)."""
  here = STUDIES / folder
  mod = _analysis("lr_curves")
  assert mod.main([str(here / "runs.csv"), "--out", str(tmp_path)]) == 0
  for name in ("lr_sensitivity.csv", "paired_best_lr.csv", "mechanism.csv"):
    pd.testing.assert_frame_equal(
      pd.read_csv(tmp_path / name), pd.read_csv(here / name), check_dtype=False, rtol=1e-9
    )
  assert {"lr_curves.png", "stable_lr.png"} <= {p.name for p in tmp_path.iterdir()}
  runs = pd.read_csv(here / "runs.csv")
  need = {"arm", "mixer", "depth", "width", "lr", "seed", "status", "loss_init", "eval_loss"}
  assert need <= set(runs.columns)
  assert runs.groupby(["arm", "depth", "lr"]).size().eq(runs["seed"].nunique()).all()


def test_mhc_init_tables_recompute_from_runs_csv():
  """docs/studies/mhc_init: arms.csv and paired_arms.csv from the committed per-run rows; every
  mhc arm is paired with mhc_identity by seed, and mhc_identity's H_res never moved."""
  here = STUDIES / "mhc_init"
  runs = pd.read_csv(here / "runs.csv")
  arms, paired = _analysis("mhc_init").tables(runs)
  pd.testing.assert_frame_equal(
    arms.reset_index(drop=True), pd.read_csv(here / "arms.csv"), check_dtype=False, rtol=1e-9
  )
  pd.testing.assert_frame_equal(
    paired.reset_index(drop=True),
    pd.read_csv(here / "paired_arms.csv"),
    check_dtype=False,
    rtol=1e-9,
  )
  assert set(paired["a"]) <= {"mhc_identity", "mhc_identity_a1"} and (paired["n_pairs"] >= 3).all()
  ident = runs[runs["arm"] == "mhc_identity"]
  assert (ident["h_res_diag_mean"] == 1).all() and (ident["h_res_shift_mean"] == 0).all()


def test_phase_table_recomputes_from_runs_csv(tmp_path):
  """phase.csv (failure fractions by kind, gains, losses per arm x width x depth) from the
  committed runs.csv; the committed failure kinds are the rule's on the stored losses."""
  from mhc_jax.sweep import lrmap

  here = STUDIES / "phase_map"
  assert _analysis("phase_map").main([str(here / "runs.csv"), "--out", str(tmp_path)]) == 0
  pd.testing.assert_frame_equal(
    pd.read_csv(tmp_path / "phase.csv"), pd.read_csv(here / "phase.csv"), check_dtype=False
  )
  runs = pd.read_csv(here / "runs.csv")
  assert len(runs) == 192 and runs["baseline"].between(3.0, 3.3).all()
  assert list(runs["failure"]) == list(lrmap.failure(runs))
  hc32 = runs[(runs.arm == "hc") & (runs.depth == 32)]
  assert (hc32["failure"] != "none").all()  # the endpoint: every hc run at depth 32 failed
  assert (runs[runs.arm != "hc"]["failure"] == "none").all()


def test_lr_curves_failure_kinds_are_the_rules():
  """The committed runs.csv's failure column is lrmap.failure of its stored losses and
  baselines (the byte-frequency loss per seed: 3.27, 3.26, 3.18 nats for seeds 0-2)."""
  from mhc_jax.sweep import lrmap

  runs = pd.read_csv(STUDIES / "lr_curves" / "runs.csv")
  assert list(runs["failure"]) == list(lrmap.failure(runs))
  per_seed = runs.groupby("seed")["baseline"].agg(["min", "max"])
  assert (per_seed["min"] == per_seed["max"]).all()
  assert per_seed["min"].round(2).tolist() == [3.27, 3.26, 3.18]


def _planted_transfer() -> pd.DataFrame:
  """Loss 2.5 + 0.1 (log2(lr / optimum))^2 + 0.01 seed: sp's optimum moves 0.032 -> 0.008 at
  width 128 and -> 0.016 at depth 32; completep's stays at 0.032; one sp run failed (NaN)."""
  import math

  opt = {("sp", 32, 4): 0.032, ("sp", 128, 4): 0.008, ("sp", 32, 32): 0.016}
  rows = []
  for par in ("sp", "completep"):
    for w, d in ((32, 4), (128, 4), (32, 32)):
      for lr in (0.004, 0.008, 0.016, 0.032, 0.064):
        for s in (0, 1):
          o = opt.get((par, w, d), 0.032)
          y = 2.5 + 0.1 * math.log2(lr / o) ** 2 + 0.01 * s
          rows.append(
            dict(arm="residual", parametrization=par, width=w, depth=d, lr=lr, seed=s)
            | dict(loss_init=5.5, eval_loss=y, baseline=3.2)
          )
  runs = pd.DataFrame(rows)
  runs.loc[
    (runs.parametrization == "sp") & (runs.width == 128) & (runs.lr == 0.064), "eval_loss"
  ] = float("nan")
  return runs


def test_transfer_tables_by_hand(tmp_path):
  """Drift and regret of a planted optimum: sp drifts -2 steps in width (regret 0.4 nats: two
  steps of 0.1 x 2^2), -1 in depth; completep transfers with zero regret."""
  mod = _analysis("transfer")
  runs = _planted_transfer()
  runs.to_csv(tmp_path / "runs.csv", index=False)
  assert mod.main([str(tmp_path / "runs.csv")]) == 0
  tab = pd.read_csv(tmp_path / "transfer.csv").set_index(["parametrization", "width", "depth"])
  sp_w, sp_d = tab.loc[("sp", 128, 4)], tab.loc[("sp", 32, 32)]
  assert sp_w["drift_log2"] == -2 and sp_w["seed_drifts_log2"] == "-2,-2"
  assert sp_w["regret"] == pytest.approx(0.4) and sp_w["verdict"] == "drifts"
  assert sp_d["drift_log2"] == -1 and sp_d["regret"] == pytest.approx(0.1)
  cp = tab.loc[("completep", 128, 4)]
  assert cp["drift_log2"] == 0 and cp["regret"] == pytest.approx(0) and cp["verdict"] == "transfers"
  assert bool(cp["regret_small"]) and not bool(sp_w["regret_small"])
  best = pd.read_csv(tmp_path / "best_lr.csv")
  assert len(best) == 6 and set(best["seed_best_lrs"]) == {
    "0.032,0.032",
    "0.008,0.008",
    "0.016,0.016",
  }
  assert (tmp_path / "transfer.png").read_bytes()[:4] == b"\x89PNG"


def test_transfer_merges_later_sources_row_by_row(tmp_path):
  """The extension's sweeps replace runs.csv's rows run by run (configs/studies/transfer.yaml):
  a later source's run wins, its new runs are added, the rest stay in their place."""
  runs = _planted_transfer()
  runs["run"] = [
    f"arm={a},parametrization={p},size=w{w}_d{d},lr={lr:g},seed={s}"
    for a, p, w, d, lr, s in runs[["arm", "parametrization", "width", "depth", "lr", "seed"]].values
  ]
  runs["n"] = np.where(runs["parametrization"] == "sp", 4, np.nan)  # streams: a count with holes
  runs.to_csv(tmp_path / "runs.csv", index=False)
  cell = (runs.parametrization == "completep") & (runs.width == 32) & (runs.depth == 32)
  later = runs[cell].assign(eval_loss=lambda d: d["eval_loss"] + 1.0, n=4)  # a rerun, worse
  more = later[later.lr == 0.064].assign(
    lr=0.128, run=lambda d: d["run"].str.replace("0.064", "0.128")
  )
  (tmp_path / "b").mkdir()
  pd.concat([later, more]).to_csv(tmp_path / "b" / "runs.csv", index=False)
  out = tmp_path / "out"
  mod = _analysis("transfer")
  assert (
    mod.main([str(tmp_path / "runs.csv"), str(tmp_path / "b" / "runs.csv"), "--out", str(out)]) == 0
  )
  merged = pd.read_csv(out / "runs.csv")
  assert "4.0" not in (out / "runs.csv").read_text()  # a count read from a sweep stays one
  assert len(merged) == len(runs) + 2 and merged["run"].is_unique
  assert merged["run"].tolist()[: len(runs)] == runs["run"].tolist()  # replaced in place
  m = merged.set_index("run")
  assert (m.loc[runs[cell]["run"], "eval_loss"].values == runs[cell]["eval_loss"].values + 1).all()
  np.testing.assert_array_equal(m.loc[runs[~cell]["run"], "eval_loss"], runs[~cell]["eval_loss"])
  best = pd.read_csv(out / "best_lr.csv").set_index(["parametrization", "width", "depth"])
  assert best.loc[("completep", 32, 32), "n_lr"] == 6 and best.loc[("sp", 32, 32), "n_lr"] == 5


def _edges(**cells) -> pd.DataFrame:
  """best_lr.csv rows at width 32: arm_par=(edge at depth 4, at 32, depth 4 censored)."""
  rows = []
  for key, (e4, e32, cens) in cells.items():
    arm, par = key.rsplit("_", 1)
    for d, e, c in ((4, e4, cens), (32, e32, False)):
      rows.append(dict(arm=arm, parametrization=par, width=32, depth=d, largest_working_lr=e))
      rows[-1] |= dict(edge_censored=c, edge_one_seed=False)
  return pd.DataFrame(rows)


def test_endpoint3_by_the_study_files_rule():
  """configs/studies/transfer.yaml, endpoint 3: completep's fall within a step and sp's >= 2
  removes it; completep's >= 2 with mhc's <= 1 still breaks; an edge above the grid at depth 4
  leaves the fall unbounded above, so it cannot show "within one step"."""
  mod = _analysis("transfer")
  v = lambda **c: set(mod.endpoint3(_edges(**c))["verdict"])
  removes = dict(hc_completep=(0.256, 0.128, False), hc_sp=(0.256, 0.032, False))
  removes |= dict(mhc_completep=(0.512, 0.512, False))
  assert v(**removes) == {"branch scaling removes HC's depth instability"}
  breaks = dict(hc_completep=(0.512, 0.064, False), hc_sp=(0.512, 0.032, False))
  assert v(**breaks, mhc_completep=(0.512, 0.256, False)) == {"unconstrained mixing still breaks"}
  assert v(**breaks, mhc_completep=(0.512, 0.128, False)) == {"not decided"}  # mhc falls 2
  censored = removes | dict(hc_completep=(0.256, 0.128, True))
  t = mod.endpoint3(_edges(**censored)).set_index(["arm", "parametrization"])
  assert (
    t.loc[("hc", "completep"), "fall"] == 1 and t.loc[("hc", "completep"), "fall_hi"] == math.inf
  )
  assert set(t["verdict"]) == {"not decided"}


def test_edge_against_width_with_its_bounds():
  """edge_width.csv: the change from width 32 to 128 in grid steps; an edge above the grid at
  width 32 bounds it from above only, at width 128 from below only; sp's prediction -1 (Haas
  et al.), completep's 0."""
  rows = [
    dict(arm="hc", parametrization=p, width=w, depth=4, largest_working_lr=e, edge_censored=c)
    for p, w, e, c in [
      ("sp", 32, 0.256, False),
      ("sp", 128, 0.128, False),
      ("completep", 32, 0.512, True),
      ("completep", 128, 0.512, False),
    ]
  ]
  t = _analysis("transfer").edge_width(pd.DataFrame(rows)).set_index("parametrization")
  assert t.loc["sp", ["change", "change_lo", "change_hi", "predicted"]].tolist() == [-1, -1, -1, -1]
  cp = t.loc["completep"]
  assert cp["change"] == 0 and cp["change_lo"] == -math.inf and cp["change_hi"] == 0
  assert cp["predicted"] == 0


def _planted_geometry() -> pd.DataFrame:
  """runs.csv of the geometry pilot, planted: 'tied' meets both rules on both seeds from step
  2000 (key ratio 0.5 <= 1/1.5, manifold z 5 >= 3), 'untied' has the key frame on both seeds
  but the manifold on seed 0 only, 'sample' is everywhere at its nulls."""
  rows = []
  for setting in ("tied", "untied", "sample"):
    for seed in (0, 1):
      for step in (1000, 2000, 3000):
        grown = setting != "sample" and step >= 2000
        ratio = 0.5 if grown else 1.0
        z = 5.0 if grown and (setting == "tied" or seed == 0) else 0.5
        rows.append(
          dict(setting=setting, replacement=True, supervise="all", target="posterior")
          | dict(tied_embeddings=setting != "untied", depth=2, width=64, heads=2, head_dim=32)
          | dict(seed=seed, step=step, eval_loss=1.0, kl_bits=0.1 / step, frame_dist=1 / step)
          | dict(key_cos=0.14 * ratio, key_cos_null=0.14, key_cos_null_sd=0.01, key_cos_z=0.0)
          | dict(value_r_new_wp=0.02 + 0.02 * z, value_r_new_wp_null=0.02)
          | dict(value_r_new_wp_null_sd=0.02, value_r_new_wp_z=z, value_r=0.9)
          | dict(qk_slope_wp=0.0, qk_slope_wp_z=1.0)
        )
  return pd.DataFrame(rows)


def test_geometry_pilot_decision_from_planted_runs(tmp_path):
  """The pre-registered rule (configs/studies/geometry_pilot.yaml) recomputed from runs.csv:
  both signatures beyond their nulls on >= 2 seeds at the last checkpoint."""
  _planted_geometry().to_csv(tmp_path / "runs.csv", index=False)
  before = (tmp_path / "runs.csv").read_bytes()
  assert _analysis("geometry_pilot").main([str(tmp_path / "runs.csv")]) == 0
  assert (tmp_path / "runs.csv").read_bytes() == before  # the source is left as it is
  dec = pd.read_csv(tmp_path / "decision.csv").set_index("setting")
  assert dec["exists"].to_dict() == {"tied": "yes", "untied": "no", "sample": "no"}
  assert dec.loc["tied", "first_step"] == 2000 and dec["first_step"].isna().sum() == 2
  assert dec.loc["tied", "step"] == 3000 and (dec["n_seeds"] == 2).all()
  assert dec.loc["untied", "k_seeds"] == 2 and dec.loc["untied", "m_seeds"] == 1
  assert dec.loc["sample", "k_seeds"] == 0 and dec.loc["tied", "key_ratio_by_seed"] == "0.500,0.500"
  assert dec.loc["untied", "value_r_new_wp_z_by_seed"] == "5.0,0.5"
  assert (dec["head_dim"] == 32).all()
  steps = pd.read_csv(tmp_path / "by_step.csv")
  assert steps[steps["setting"] == "tied"]["exists"].tolist() == [False, True, True]
  assert (tmp_path / "signatures.png").read_bytes()[:4] == b"\x89PNG"


def test_transfer_tables_recompute_from_runs_csv(tmp_path):
  """docs/studies/transfer: its tables recomputed from the committed runs.csv (336 runs: 4 arms
  x 2 parametrisations x 3 sizes x 7 lrs x 2 seeds, seeds paired; then the extension's hc and
  mhc at depth 4 and hc under completep at depth 32, 10 lrs x 4 seeds, replacing 70: 466)."""
  here = STUDIES / "transfer"
  assert _analysis("transfer").main([str(here / "runs.csv"), "--out", str(tmp_path)]) == 0
  for name in ("best_lr.csv", "transfer.csv", "endpoint3.csv", "edge_width.csv"):
    pd.testing.assert_frame_equal(
      pd.read_csv(tmp_path / name), pd.read_csv(here / name), check_dtype=False, rtol=1e-9
    )
  runs = pd.read_csv(here / "runs.csv")
  need = {"arm", "mixer", "parametrization", "width", "depth", "lr", "seed", "status"}
  assert need | {"loss_init", "eval_loss"} <= set(runs.columns) and len(runs) == 466
  d4 = runs[(runs["depth"] == 4) & (runs["width"] == 32) & runs["arm"].isin(["hc", "mhc"])]
  assert d4.groupby(["arm", "parametrization"])["seed"].nunique().eq(4).all()
  cells = runs.groupby(["arm", "parametrization", "width", "depth", "lr"])["seed"]
  ext = lambda k: (
    (k[0] in ("hc", "mhc") and k[2:4] == (32, 4)) or k[:4] == ("hc", "completep", 32, 32)
  )
  seeds = {k: sorted(v) for k, v in cells}
  assert all(s == ([0, 1, 2, 3] if ext(k) else [0, 1]) for k, s in seeds.items())
  assert len(seeds) == 168 + 5 * 3  # 0.256, 0.512 and 1.024 in the 5 extended cells


@pytest.mark.parametrize("folder", ["geometry_pilot", "geometry_pilot/long"])
def test_geometry_pilot_decision_recomputes_from_its_runs(folder, tmp_path):
  """docs/studies/geometry_pilot: decision.csv and by_step.csv recomputed from the committed
  runs.csv by the pre-registered rule; every setting has both seeds at every checkpoint."""
  here = STUDIES / folder
  assert _analysis("geometry_pilot").main([str(here / "runs.csv"), "--out", str(tmp_path)]) == 0
  for name in ("decision.csv", "by_step.csv"):
    pd.testing.assert_frame_equal(
      pd.read_csv(tmp_path / name), pd.read_csv(here / name), check_dtype=False, rtol=1e-9
    )
  runs = pd.read_csv(here / "runs.csv")
  assert runs.groupby(["setting", "step"])["seed"].nunique().eq(2).all()
  assert (runs["head_dim"] == 32).all() and runs["key_cos_null"].gt(0).all()


def test_zoo_map_tables_recompute_from_runs_csv(tmp_path):
  """docs/studies/zoo_map: the 18-arm map (all 15 designs) recomputed from its committed
  runs.csv; every arm has every depth x lr x seed, the seeds pair across arms, and the failure
  column is the rule's on the stored losses."""
  from mhc_jax.sweep import lrmap

  here = STUDIES / "zoo_map"
  mod = _analysis("zoo_map")
  assert mod.main([str(here / "runs.csv"), "--out", str(tmp_path)]) == 0
  for name in ("lr_sensitivity.csv", "paired_best_lr.csv", "mechanism.csv"):
    pd.testing.assert_frame_equal(
      pd.read_csv(tmp_path / name), pd.read_csv(here / name), check_dtype=False, rtol=1e-9
    )
  runs = pd.read_csv(here / "runs.csv")
  arms = [a for fam in mod.FAMILIES.values() for a in fam]
  assert len(arms) == 18 and set(runs["arm"]) == set(arms) and len(runs) == 18 * 63
  seeds = runs.groupby(["arm", "depth", "lr"])["seed"].apply(lambda v: sorted(v) == [0, 1, 2])
  assert seeds.all() and len(seeds) == 18 * 21
  assert list(runs["failure"]) == list(lrmap.failure(runs))
  paired = pd.read_csv(here / "paired_best_lr.csv")
  assert (paired["a"].isin(mod.REFS) | paired["b"].isin(mod.REFS)).all()
  assert {"edges.png", "lr_curves.png", "stable_lr.png"} <= {p.name for p in tmp_path.iterdir()}


def test_zoo_controls_table_recomputes_from_its_runs():
  """controls.csv (the warm-up + clipping follow-up beside zoo_map's stress runs) from the
  committed rows; DeepNorm at depth 16, lr 0.01 trains far better with warm-up and clipping."""
  here = STUDIES / "zoo_map"
  mod = _analysis("zoo_map")  # the folder's second script, controls.py
  spec = importlib.util.spec_from_file_location("zoo_controls", here / "controls.py")
  ctl = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(ctl)
  tab = ctl.table(pd.read_csv(here / "controls_runs.csv"), pd.read_csv(here / "runs.csv"))
  pd.testing.assert_frame_equal(tab, pd.read_csv(here / "controls.csv"), check_dtype=False)
  assert len(tab) == 18 and (tab["n_seeds"] == 2).all() and mod.REFS == ("residual", "mhc")
  dn = tab.set_index(["arm", "depth", "lr"]).loc[("deepnorm", 16, 0.01)]
  assert dn["below_baseline_warm"] > dn["below_baseline_stress"] + 0.3


def test_hc_mhc_scale_tables_recompute_from_its_summary():
  """docs/studies/hc_mhc_scale: paired_arms.csv, and arms.csv but for the spike counts (recounted
  from each run's metrics.jsonl, which is not committed), from the committed summary.csv."""
  here = STUDIES / "hc_mhc_scale"
  d = pd.read_csv(here / "summary.csv")
  d = d[d["status"] == "done"].assign(loss_spikes=0.0, grad_spikes=0.0)
  for part in ("arm", "regime"):
    d[part] = d["run"].str.extract(rf"{part}=([^,]+)", expand=False)
  arms, paired = _analysis("hc_mhc_scale").tables(d)
  pd.testing.assert_frame_equal(
    paired, pd.read_csv(here / "paired_arms.csv"), check_dtype=False, rtol=1e-9
  )
  want = pd.read_csv(here / "arms.csv")
  keep = [c for c in want.columns if "spikes" not in c]
  pd.testing.assert_frame_equal(arms[keep], want[keep], check_dtype=False, rtol=1e-9)
  assert len(arms) == 15 and (arms["n_seeds"] == 5).all()


def _reported_sweep(root: Path, arms, extra: dict) -> Path:
  """A sweep directory as the two summary-reading studies see it: report/summary.csv with a row
  per arm x seed and each run's summary.json and metrics.jsonl (a flat loss, layer lists)."""
  import json

  import numpy as np

  rows = []
  for arm in arms:
    for seed in (0, 1, 2):
      name = f"arm={arm},seed={seed}"
      rows.append(dict(run=name, depth=4, seed=seed, status="done") | extra)
      rows[-1]["eval_loss"] = 2.0 + 0.1 * arms.index(arm) + 0.01 * seed
      run = root / "runs" / name
      run.mkdir(parents=True)
      (run / "summary.json").write_text(json.dumps({"status": "done"}))
      recs = [dict(step=s, loss=3.0 - s / 100, grad_norm=1.0) for s in range(60)]
      layers = dict(stream_spread=[0.1, 0.2], h_res_diag=[1.0, 0.9], h_res_shift=[0.0, 0.1])
      recs.append(dict(step=60, **layers))
      (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, recs)) + "\n")
  (root / "report").mkdir(parents=True)
  pd.DataFrame(rows).to_csv(root / "report" / "summary.csv", index=False)
  assert np.isfinite(pd.read_csv(root / "report" / "summary.csv")["eval_loss"]).all()
  return root


def test_summary_reading_studies_run_on_a_reported_sweep(tmp_path):
  """mhc_init and hc_mhc_scale from their sweeps' report/summary.csv: every arm over its three
  seeds, the pairs the studies ask for, the last layer values, and no report -> exit 2."""
  one = dict(final_loss=2.0, stream_spread_last=0.2, max_grad_norm=1.0, h_res_diag_mean=0.95)
  one |= dict(h_res_shift_mean=0.05, h_res_dynamic_share_mean=0.1)
  init = _analysis("mhc_init")
  sweep = _reported_sweep(tmp_path / "init", ["mhc_identity", "mhc_uniform", "mhc_d050"], one)
  assert init.main([str(sweep), "--out", str(tmp_path / "a")]) == 0
  runs = pd.read_csv(tmp_path / "a" / "runs.csv")
  assert len(runs) == 9 and (runs["h_res_diag_min"] == 0.9).all()
  assert (runs["h_res_shift_max"] == 0.1).all()
  paired = pd.read_csv(tmp_path / "a" / "paired_arms.csv")
  assert set(zip(paired["a"], paired["b"])) == {
    ("mhc_identity", "mhc_uniform"),
    ("mhc_identity", "mhc_d050"),
  }
  eval_pairs = paired[paired["metric"] == "eval_loss"].set_index("b")
  assert eval_pairs.loc["mhc_d050", "diff_mean"] == pytest.approx(0.2)
  assert {"h_res_layers.png", "tradeoff.png"} <= {p.name for p in (tmp_path / "a").iterdir()}
  scale = _analysis("hc_mhc_scale")
  gains = dict.fromkeys(scale.LOG, 1.5) | dict(final_loss=2.0)
  sweep = _reported_sweep(tmp_path / "scale", ["residual", "hc", "mhc"], gains)
  summary = pd.read_csv(sweep / "report" / "summary.csv")
  summary.assign(run=summary["run"].str.replace("seed=", "regime=r,seed=")).to_csv(
    sweep / "report" / "summary.csv", index=False
  )
  for d in (sweep / "runs").iterdir():
    d.rename(d.parent / d.name.replace("seed=", "regime=r,seed="))
  assert scale.main([str(sweep), "--out", str(tmp_path / "b")]) == 0
  arms = pd.read_csv(tmp_path / "b" / "arms.csv")
  assert list(arms["arm"]) == ["residual", "hc", "mhc"] and (arms["n_seeds"] == 3).all()
  assert (arms["loss_spikes"] == 0).all() and (arms["grad_spikes"] == 0).all()
  paired = pd.read_csv(tmp_path / "b" / "paired_arms.csv")
  assert set(zip(paired["a"], paired["b"])) == {
    ("residual", "mhc"),
    ("hc", "mhc"),
    ("residual", "hc"),
  }
  assert scale.main([str(tmp_path / "nothing")]) == 2


def _planted_horizon() -> pd.DataFrame:
  """Two arms, the clipped lengths 150, 600, 2400 and the stress regime, lrs 2x apart, 2 seeds:
  'fast' has its optimum at 0.032 / 0.016 / 0.008 (halving per 4x steps: beta 0.5) and fails
  (no_training) two steps above it; 'slow' keeps 0.032 and never fails (a censored edge)."""
  lrs, rows = [0.004 * 2**k for k in range(6)], []
  lengths = {"stress150": (150, 0.0), "t150": (150, 1.0), "t600": (600, 1.0), "t2400": (2400, 1.0)}
  for arm, (length, (steps, clip)), lr, seed in itertools.product(
    ["fast", "slow"], lengths.items(), lrs, [0, 1]
  ):
    best = 0.032 / (steps / 150) ** 0.5 if arm == "fast" else 0.032
    loss = 2.0 + 0.1 * math.log2(lr / best) ** 2 + 0.01 * seed
    if arm == "fast" and lr >= 4 * best:
      loss = 3.5  # within 0.1 nats of the baseline 3.55: did not train
    rows.append(
      {"arm": arm, "length": length, "steps": steps, "clip": clip, "lr": lr, "seed": seed}
      | {"loss_init": 5.5, "eval_loss": loss, "baseline": 3.55, "ground_lost": 0.0}
    )
  runs = pd.DataFrame(rows)
  return runs.assign(failure=lrmap.failure(runs))


def test_horizon_exponents_and_ordering_by_hand():
  """beta is the slope of -log lr* on log steps; a censored edge says so; an ordering that
  flips with both differences at least a grid step is a flip."""
  horizon = _analysis("horizon")
  horizon.ARMS = ["fast", "slow"]
  runs = _planted_horizon()
  best = horizon.best_table(runs)
  exp = horizon.exponents(best, runs).set_index("arm")
  assert exp.loc["fast", "beta_opt"] == pytest.approx(0.5)
  assert exp.loc["fast", "beta_edge"] == pytest.approx(0.5)
  assert exp.loc["fast", "beta_opt_seed1"] == pytest.approx(0.5)
  assert exp.loc["slow", "beta_opt"] == pytest.approx(0.0, abs=1e-9)
  assert exp.loc["slow", "beta_edge_censored"] and not exp.loc["fast", "beta_edge_censored"]
  order = horizon.ordering(best).set_index("metric")
  edge = order.loc["largest_working_lr"]  # fast's edge: 0.064 at 150, 0.016 at 2400; slow: 0.128
  assert edge["diff_stress150"] == pytest.approx(-1) and edge["diff_t2400"] == pytest.approx(-3)
  assert not edge["flips"]
  versus = horizon.map_vs_long(runs).set_index(["arm", "lr"])
  assert versus.loc[("fast", 0.032), "t2400"] == "no_training/no_training"
  assert not versus.loc[("fast", 0.032), "agree"] and versus.loc[("slow", 0.032), "agree"]


def test_horizon_length_transfer_by_hand():
  """t150's best lr carried to a longer length by lr (T / 150)^-beta lands on the grid lr
  nearest in log space; a prediction at two grid lrs' log-midpoint takes the worse of the two
  (for 'fast' the upper, for 'slow' the lower); the regret is its seed mean against the best."""
  horizon = _analysis("horizon")
  runs = _planted_horizon()
  tab = horizon.length_transfer(horizon.best_table(runs), runs)
  tab = tab.set_index(["arm", "length", "beta"])
  assert len(tab) == 8 and set(tab.index.get_level_values("length")) == {"t600", "t2400"}
  tie = tab.loc[("fast", "t600", 0.25)]  # 0.032 / 4^0.25 = 0.0226, between 0.016 and 0.032
  assert tie["predicted_lr"] == pytest.approx(0.032 / 2**0.5) and tie["tie_took_worse"]
  assert tie["grid_lr"] == 0.032 and tie["regret"] == pytest.approx(0.1)
  assert tab.loc[("slow", "t600", 0.25), "grid_lr"] == 0.016  # slow's worse neighbour
  exact = tab.loc[("fast", "t2400", 0.5)]  # fast's own beta: the best lr, no regret
  assert exact["grid_lr"] == 0.008 and not exact["tie_took_worse"]
  assert exact["regret"] == pytest.approx(0) and exact["regret_small"]
  assert exact["regret_kept"] == pytest.approx(1.495)  # 0.032 does not train at 2400 steps
  assert tab.loc[("fast", "t2400", 0.25), "regret"] == pytest.approx(0.1)
  assert tab.loc[("slow", "t2400", 0.25), "regret_kept"] == pytest.approx(0)


def test_horizon_tables_recompute_from_runs_csv(tmp_path):
  """docs/studies/horizon: every table recomputed from the committed runs.csv (partial: the
  arms and lengths that have run, each cell with both seeds)."""
  here = STUDIES / "horizon"
  assert _analysis("horizon").main([str(here / "runs.csv"), "--out", str(tmp_path)]) == 0
  tables = ("best_lr", "exponents", "ordering", "map_vs_long", "ground_lost", "length_transfer")
  for name in tables:
    pd.testing.assert_frame_equal(
      pd.read_csv(tmp_path / f"{name}.csv"), pd.read_csv(here / f"{name}.csv"), rtol=1e-9
    )
  runs = pd.read_csv(here / "runs.csv")
  need = {"arm", "parametrization", "width", "depth", "steps", "warmup_steps", "clip", "lr"}
  need |= {"seed", "status", "loss_init", "eval_loss", "baseline", "failure"}
  assert need <= set(runs.columns) and (runs["parametrization"] == "completep").all()
  cells = runs.groupby(["arm", "length", "lr"])["seed"]
  assert cells.apply(lambda v: sorted(v) == [0, 1]).all()


def test_the_default_steps_exponent_keeps_the_horizon_regret_under_005_nats():
  """optim.steps_exponent's default is the measured one that works: tuned at 150 steps and
  carried to 600 and 2400, every arm run so far loses less than 0.05 nats against that length's
  best (docs/studies/horizon/length_transfer.csv)."""
  from mhc_jax.train.config import OptimConfig

  tab = pd.read_csv(STUDIES / "horizon" / "length_transfer.csv")
  mine = tab[tab["beta"] == OptimConfig().steps_exponent]
  assert set(mine["arm"]) == {"residual", "hc", "mhc"} and set(mine["steps"]) == {600, 2400}
  assert (mine["regret"] < 0.05).all(), mine[["arm", "steps", "regret"]]


def _formation_runs(frame=(4.0, 2.5), init=(1.1, 1.2), mae_factor=1.0, last=2500):
  """Two seeds through the pre-registered steps: the frame ratio rising to `frame` at 2500, the
  MAE the authors' times `mae_factor`."""
  ref = {1000: 0.086, 1500: 0.0647, 2000: 0.0434, 2500: 0.0316}
  rows = []
  for seed, (top, start) in enumerate(zip(frame, init)):
    for step in (0, 100, 300, 1000, 1500, 2000, 2500):
      if step > last and seed == 1:
        continue
      ratio = start if step == 0 else start + (top - start) * min(step / 2500, 1)
      mae = ref.get(step, 1.0) * mae_factor * (1.2 if seed else 0.9)
      rows.append({"arm": "residual", "seed": seed, "step": step, "frame_ratio": ratio, "mae": mae})
  return pd.DataFrame(rows)


def _formation_decide(runs):
  analysis = _analysis("geometry_formation")
  (row,) = analysis.decision(runs, **analysis.RULE).to_dict("records")
  return row


def test_geometry_formation_rule_reproduced_only_when_all_three_parts_hold():
  row = _formation_decide(_formation_runs())
  assert (row["frame"], row["init"], row["mae"], row["reproduced"]) == ("yes",) * 4
  assert row["frame_ratio_mean"] == pytest.approx(3.25) and row["frame_ratio_min"] == 2.5
  assert row["mae_1000"] == pytest.approx(0.086 * math.sqrt(0.9 * 1.2))  # geometric mean
  weak = _formation_decide(_formation_runs(frame=(4.5, 1.9)))  # mean 3.2 but one seed below 2x
  assert weak["frame"] == "no" and weak["reproduced"] == "no"
  low = _formation_decide(
    _formation_runs(frame=(3.1, 2.8))
  )  # every seed >= 2x but the mean below 3x
  assert low["frame"] == "no"
  assert _formation_decide(_formation_runs(init=(1.1, 1.6)))["init"] == "no"
  assert _formation_decide(_formation_runs(mae_factor=2.5))["mae"] == "no"
  assert (
    _formation_decide(_formation_runs(mae_factor=0.45))["mae"] == "no"
  )  # too good is outside too
  partial = _formation_decide(_formation_runs(last=1500))
  assert partial["frame"] == "pending" and partial["mae"] == "pending"
  assert partial["reproduced"] == "pending" and partial["init"] == "yes"
  bad_partial = _formation_decide(_formation_runs(last=1500, mae_factor=3.0))
  assert bad_partial["reproduced"] == "no"  # a part already failed at 1000 on both seeds


def test_geometry_formation_decision_recomputes_from_runs_csv(tmp_path):
  """geometry_formation's rule (configs/studies/geometry_formation.yaml, issue 55) from its
  committed runs.csv, every seed and step so far."""
  DIR, analysis = STUDIES / "geometry_formation", _analysis("geometry_formation")
  assert analysis.main([str(DIR / "runs.csv"), "--out", str(tmp_path)]) == 0
  got = pd.read_csv(tmp_path / "decision.csv")
  want = pd.read_csv(DIR / "decision.csv")
  pd.testing.assert_frame_equal(got, want, check_exact=False, rtol=1e-9)
  assert (tmp_path / "formation.png").stat().st_size > 10_000
  runs = pd.read_csv(DIR / "runs.csv")
  assert {
    "arm",
    "seed",
    "step",
    "frame_ratio",
    "frame_null",
    "mae",
    "kl_bits",
    "M",
    "M_gated",
  } <= set(runs)
  assert not (runs["M_gated"] & ~runs["learned"]).any()  # M counts only where learned
  assert np.all(runs["frame_null"] > 0) and 0 in set(runs["step"])  # the init control is there
