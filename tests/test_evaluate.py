"""`mhc-jax eval`: a tiny run trained by the project's trainer (2 checkpoints), evaluated in-process."""

import json
import math

import numpy as np
import pytest

from mhc_jax import cli
from mhc_jax.train import config as C
from mhc_jax.train.loop import prepare, train


def _train(run_dir, overrides=()):
  cfg = C.load_config(
    "configs/debug.yaml",
    [
      "train.steps=4",
      "train.ckpt_every=2",
      "train.keep_ckpts=3",
      "train.diag_every=0",
      "data.seq_len=24",
      "data.options.n_symbols=5",
      "model.depth=2",
      *overrides,
    ],
  )
  train(prepare(cfg), run_dir, progress=False)
  return cfg


@pytest.fixture(scope="module")
def bijection_run(tmp_path_factory):

  run = tmp_path_factory.mktemp("evalrun") / "run"
  _train(run, ["train.steps=5", "train.ckpt_every=1", "train.keep_ckpts=5"])
  return run


def _finite(x):
  return isinstance(x, float) and math.isfinite(x)


def test_eval_bijection_writes_metrics_and_probes(bijection_run, capsys):
  assert cli.main(["eval", "--run", str(bijection_run), "--batches", "2"]) == 0
  out = capsys.readouterr().out
  assert "KL" in out and "eval.json" in out
  r = json.loads((bijection_run / "eval.json").read_text())
  assert r["step"] == 5 and r["checkpoint_steps"] == [1, 2, 3, 4, 5] and r["batches"] == 2
  m = r["metrics"]
  for k in ("eval_loss", "kl_bits", "entropy_gap_bits", "accuracy", "ece", "kl_bits_uniform"):
    assert _finite(m[k]), k
  assert m["kl_bits"] >= 0 and m["entropy_gap_bits"] >= 0
  assert 0 <= m["accuracy"] <= 1 and 0 <= m["ece"] <= 1
  # an untrained model is near the uniform guess, far from the exact posterior
  assert m["kl_bits"] > 0.1
  assert set(m["baselines"]) == {"uniform"} and "filtering" not in m
  assert m["baselines"]["uniform"]["kl_bits"] == m["kl_bits_uniform"]
  assert "baselines, KL bits/position: uniform" in out
  ev = m["by_evidence"]
  assert set(ev) == {"kl_bits", "entropy_gap_bits", "accuracy", "ece", "count"}
  assert len(ev["kl_bits"]) == len(ev["count"]) >= 2
  cnt = np.array(ev["count"])
  assert cnt.sum() == m["positions"] > 0
  kl_ev = np.array(ev["kl_bits"], float)
  assert np.all(np.isfinite(kl_ev[cnt > 0])) and np.all(kl_ev[cnt > 0] >= 0)
  assert np.all(np.isnan(kl_ev[cnt == 0]))
  assert len(m["by_position"]["kl_bits"]) == 24

  p = r["probes"]
  assert set(p["controls"]) == {"key_orthogonality", "qk_alignment", "pca_entropy"}
  ko = p["key_orthogonality"]
  assert (
    0 <= ko["mean_abs_cos"] <= 1 and ko["hypotheses"] >= 2 and ko["reads"] == "keys before RoPE"
  )
  assert "RoPE" in ko["controls"] and "random" in ko["controls"]
  assert len(ko["mean_abs_cos_by_layer"]) == len(ko["random_mean_abs_cos_by_layer"]) == 2
  assert all(0 < x < 1 for x in ko["random_mean_abs_cos_by_layer"])
  assert ko["ratio_to_random_by_layer"][-1] == pytest.approx(
    ko["mean_abs_cos_by_layer"][-1] / ko["random_mean_abs_cos_by_layer"][-1]
  )
  qk = p["qk_alignment"]
  assert 0 <= qk["attn_on_target"] <= 1 and qk["reads"] == "q and k before RoPE"
  assert "distance" in qk["controls"]
  assert _finite(qk["slope_unconditioned"])
  assert qk["layer"] in (0, 1) and qk["head"] in (0, 1)
  pc = p["pca_entropy"]
  assert "position partialled out" in pc["controls"] and pc["positions"].startswith("new keys")
  assert -1 <= pc["corr_pc1_entropy"] <= 1 and pc["entropy_std_within_position"] > 0
  assert all(0 <= v <= 1 for v in pc["explained_variance_ratio"])
  fp = p["paper"]["frame_precision"]
  assert fp["steps"] == [1, 2, 3, 4, 5] and isinstance(fp["frame_before_manifold"], bool)
  assert fp["frame_dist"][-1] == 0 and "attention settles before the value manifold" in out
  assert not list(bijection_run.glob(".eval.json.tmp*"))


def test_eval_bad_run_exits_2(tmp_path, capsys, bijection_run):
  assert cli.main(["eval", "--run", str(tmp_path / "nope")]) == 2
  assert "does not exist" in capsys.readouterr().err
  assert cli.main(["eval", "--run", str(tmp_path)]) == 2
  assert "no config.yaml" in capsys.readouterr().err
  (tmp_path / "config.yaml").write_text((bijection_run / "config.yaml").read_text())
  assert cli.main(["eval", "--run", str(tmp_path)]) == 2
  assert "no checkpoint" in capsys.readouterr().err
  assert not (tmp_path / "checkpoints").exists()
  assert cli.main(["eval", "--run", str(bijection_run), "--batches", "0"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and "--batches" in err and len(err.strip().splitlines()) == 1


def test_eval_text_run_reports_bits_per_byte(tmp_path, capsys):
  corpus = tmp_path / "corpus.txt"
  corpus.write_bytes(bytes(range(32, 127)) * 40)
  run = tmp_path / "run"
  _train(
    run,
    [
      "data.task=text",
      f"data.options={{path: {corpus}}}",
      "train.steps=2",
      "train.ckpt_every=0",
      "model.depth=1",
    ],
  )
  assert cli.main(["eval", "--run", str(run), "--batches", "1"]) == 0
  r = json.loads((run / "eval.json").read_text())
  m = r["metrics"]
  assert set(m) == {"eval_loss", "bits_per_byte", "positions"}
  assert m["bits_per_byte"] == pytest.approx(m["eval_loss"] / math.log(2))
  assert 0 < m["bits_per_byte"] < 9 and "probes" not in r
  assert "bits/byte" in capsys.readouterr().out


def test_eval_hmm_baselines_filtering_and_larger_model_vocab(tmp_path, capsys):
  """HMM filtering: the baselines and the filtering verdict are printed and in eval.json; and
  (issue 12, defect 3) model.vocab may exceed the data's vocabulary (the posterior is padded)."""
  run = tmp_path / "run"
  _train(
    run,
    [
      "data.task=hmm",
      "data.options={n_states: 2, n_symbols: 2, n_levels: 4, stickiness: 0.5}",
      "model.vocab=40",
      "train.steps=2",
      "train.ckpt_every=0",
      "model.depth=1",
    ],
  )
  assert cli.main(["eval", "--run", str(run), "--batches", "1"]) == 0, capsys.readouterr().err
  out = capsys.readouterr().out
  r = json.loads((run / "eval.json").read_text())
  m = r["metrics"]
  assert _finite(m["kl_bits"]) and m["kl_bits"] > 0
  b = m["baselines"]
  assert set(b) == {"uniform", "header_only", "header_blind", "last_obs"}
  assert b["header_blind"]["kl_bits"] == pytest.approx(b["uniform"]["kl_bits"])
  assert (
    0 < b["last_obs"]["kl_bits"] < b["header_only"]["kl_bits"] <= b["uniform"]["kl_bits"] + 1e-9
  )
  assert m["kl_bits_uniform"] == b["uniform"]["kl_bits"] < 1.0  # over the 2 state labels
  f = m["filtering"]
  assert f["threshold_bits"] == pytest.approx(b["header_only"]["kl_bits"] / 10)
  assert f["reached"] is False  # two steps of training do not filter
  assert "header-only" in out and "last-obs" in out and "NOT reached" in out
  assert r["probes"]["paper"]["frame_precision"]["skipped"].startswith("needs 3+ checkpoints")


def test_sweep_posteval_fills_eval_json_once(bijection_run, tmp_path):
  """A sweep's `eval: N`: every done run with a checkpoint gets eval.json (its probe columns reach
  the report), a failing run is reported, not fatal, and a second pass evaluates nothing."""
  import shutil

  from mhc_jax.sweep import posteval, report

  out = tmp_path / "sweep"
  shutil.copytree(bijection_run, out / "runs" / "good", ignore=shutil.ignore_patterns("eval.json"))
  (out / "runs" / "broken" / "checkpoints" / "3").mkdir(parents=True)  # a checkpoint, no config
  shutil.copytree(
    bijection_run, out / "runs" / "failed", ignore=shutil.ignore_patterns("eval.json")
  )
  manifest = {
    "runs": {
      "good": {"status": "done", "dir": "runs/good"},
      "broken": {"status": "done", "dir": "runs/broken"},
      "failed": {"status": "failed", "dir": "runs/failed"},
    }
  }
  assert [n for n, _ in posteval.pending(out, manifest)] == ["good", "broken"]
  said = []
  assert posteval.evaluate_runs(out, manifest, 1, said.append) == 1
  assert any("good: KL" in s for s in said) and any("broken: failed" in s for s in said)
  ev = json.loads((out / "runs" / "good" / "eval.json").read_text())
  assert ev["step"] == 5 and ev["batches"] == 1
  assert not (out / "runs" / "failed" / "eval.json").exists()  # only done runs
  cols = report.eval_columns(out / "runs" / "good")
  assert cols["eval_kl_bits"] == ev["metrics"]["kl_bits"] > 0
  assert cols["probe_key_ratio"] == ev["probes"]["key_orthogonality"]["ratio_to_random"]
  assert cols["probe_pc1_entropy"] == abs(ev["probes"]["pca_entropy"]["corr_pc1_entropy"])
  assert [n for n, _ in posteval.pending(out, manifest)] == ["broken"]  # good is up to date
  said.clear()
  assert posteval.evaluate_runs(out, manifest, 1, said.append) == 1
  assert not any("good" in s for s in said)


def test_eval_on_the_object_store(bijection_run, gcs, monkeypatch, capsys):
  """`mhc-jax eval --run gs://...` reads the run and writes eval.json in the store, nothing
  locally. Orbax reads gs:// through tensorstore (no offline stand-in, see test_storage), so the
  run's files are copied to the fake store and the checkpoint manager reads the local copy."""
  from fake_gcs import keys

  from mhc_jax import storage
  from mhc_jax.train import checkpoint

  run = f"{gcs}/runs/x"
  local = {p: p.read_bytes() for p in bijection_run.rglob("*") if p.is_file()}
  for p, data in local.items():
    if p.name != "eval.json":
      storage.path(f"{run}/{p.relative_to(bijection_run)}").write_bytes(data)

  class LocalCheckpoints(checkpoint.Checkpoints):
    def __init__(self, directory, **kw):
      assert str(directory) == f"{run}/checkpoints"
      super().__init__(bijection_run / "checkpoints", **kw)

  monkeypatch.setattr(checkpoint, "Checkpoints", LocalCheckpoints)
  assert cli.main(["eval", "--run", run, "--batches", "1"]) == 0, capsys.readouterr().err
  assert f"wrote {run}/eval.json" in capsys.readouterr().out
  r = json.loads(storage.path(f"{run}/eval.json").read_text())
  assert r["run"] == run and r["step"] == 5 and r["checkpoint_steps"] == [1, 2, 3, 4, 5]
  assert (
    _finite(r["metrics"]["kl_bits"])
    and "frame_before_kl" in r["probes"]["paper"]["frame_precision"]
  )
  assert "bucket/runs/x/eval.json" in keys()
  assert {p: p.read_bytes() for p in bijection_run.rglob("*") if p.is_file()} == local
  assert cli.main(["eval", "--run", f"{gcs}/runs/nope"]) == 2
  assert "does not exist" in capsys.readouterr().err


def test_previous_occurrence_finds_the_latest_earlier_token():
  """Bijection targets and the papers' q-k positions share one helper: for each asked position,
  the latest earlier position (among `seen`) holding the same token, else -1."""
  from mhc_jax.geometry.readout import previous_occurrence

  inputs = np.array([[3, 1, 3, 3, 1, 2]])
  seen = np.ones_like(inputs, bool)
  np.testing.assert_array_equal(previous_occurrence(inputs, seen), [[-1, -1, 0, 2, 1, -1]])
  ask = np.array([[0, 0, 0, 1, 1, 0]], bool)
  seen2 = np.array([[1, 0, 1, 1, 1, 1]], bool)  # position 1 is not a key position
  np.testing.assert_array_equal(previous_occurrence(inputs, seen2, ask), [[-1, -1, -1, 2, -1, -1]])
