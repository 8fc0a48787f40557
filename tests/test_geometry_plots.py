"""benchmarks/geometry_figures.py and mhc_jax.geometry.plots at toy size: residual, hc and mhc
bijection runs and an HMM run, each trained a few steps, evaluated and drawn side by side."""

import csv
import importlib.util
import json
from pathlib import Path

import pytest

from mhc_jax.train import config as C
from mhc_jax.train.loop import prepare, train

ROOT = Path(__file__).resolve().parents[1]


def _cmd():
  spec = importlib.util.spec_from_file_location(
    "geometry_figures", ROOT / "benchmarks/geometry_figures.py"
  )
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _train(run_dir, overrides):
  cfg = C.load_config(
    str(ROOT / "configs/debug.yaml"),
    [
      "train.steps=3",
      "train.ckpt_every=1",
      "train.keep_ckpts=3",
      "train.diag_every=0",
      "data.seq_len=24",
      "model.depth=2",
      *overrides,
    ],
  )
  train(prepare(cfg), run_dir, progress=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  base = tmp_path_factory.mktemp("geom")
  out = {}
  for name, extra in {
    "residual": ["data.options.n_symbols=5"],
    "hc": ["data.options.n_symbols=5", "model.mixer=hc"],
    "mhc": ["data.options.n_symbols=5", "model.mixer=mhc"],
    "hmm": [
      "data.task=hmm",
      "data.options={n_states: 2, n_symbols: 2, n_levels: 4, stickiness: 0.5}",
    ],
  }.items():
    _train(base / name, extra)
    out[name] = base / name
  return out


def test_figures_and_scores_for_every_mixer_and_hmm(runs, tmp_path, capsys):
  g = _cmd()
  out = tmp_path / "fig"
  args = ["--runs", *(f"{k}={v}" for k, v in runs.items()), "--out", str(out)]
  assert g.main(args) == 0, capsys.readouterr().err
  assert (out / "geometry.png").stat().st_size > 10_000
  rows = list(csv.DictReader(open(out / "geometry_scores.csv")))
  assert [r["run"] for r in rows] == list(runs)
  assert [r["mixer"] for r in rows] == ["residual", "hc", "mhc", "residual"]
  for r in rows:
    assert 0 <= float(r["key_mean_abs_cos_layer0"]) <= 1
    assert 0 < float(r["value_pc1_variance"]) <= 1
    assert float(r["value_corr_null_std"]) > 0
    assert r["qk_slope_p"] and 0 < float(r["qk_slope_p"]) <= 1
  ev = json.loads((runs["hc"] / "eval.json").read_text())
  fp = ev["probes"]["paper"]["frame_precision"]
  assert fp["steps"] == [1, 2, 3] and fp["frame_dist"][-1] == 0


def test_bad_runs_exit_2_and_write_nothing(runs, tmp_path, capsys):
  g = _cmd()
  out = tmp_path / "none"
  assert g.main(["--runs", f"a={tmp_path}", "--out", str(out)]) == 2
  assert capsys.readouterr().err.startswith("error: --runs a:")
  assert g.main(["--runs", f"a={runs['hc']}", f"a={runs['hc']}", "--out", str(out)]) == 2
  assert g.main(["--runs", "noequals", "--out", str(out)]) == 2
  assert not out.exists()
