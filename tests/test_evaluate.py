"""`mhc-jax eval`: a tiny run trained by the project's trainer (2 checkpoints), evaluated in-process."""
import json
import math

import numpy as np
import pytest

from mhc_jax import cli
from mhc_jax.train import config as C
from mhc_jax.train.loop import prepare, train


def _train(run_dir, overrides=()):
  cfg = C.load_config("configs/debug.yaml", [
      "train.steps=4", "train.ckpt_every=2", "train.keep_ckpts=3", "train.diag_every=0",
      "data.seq_len=24", "data.options.n_symbols=5", "model.depth=2", *overrides])
  train(prepare(cfg), run_dir, progress=False)
  return cfg


@pytest.fixture(scope="module")
def bijection_run(tmp_path_factory):
  import jax
  run = tmp_path_factory.mktemp("evalrun") / "run"
  old = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)  # as conftest's fast_compile
  try:
    _train(run)
  finally:
    jax.config.update("jax_disable_most_optimizations", old)
  return run


def _finite(x):
  return isinstance(x, float) and math.isfinite(x)


def test_eval_bijection_writes_metrics_and_probes(bijection_run, capsys, fast_compile):
  assert cli.main(["eval", "--run", str(bijection_run), "--batches", "2"]) == 0
  out = capsys.readouterr().out
  assert "KL" in out and "eval.json" in out
  r = json.loads((bijection_run / "eval.json").read_text())
  assert r["step"] == 4 and r["checkpoint_steps"] == [2, 4] and r["batches"] == 2
  m = r["metrics"]
  for k in ("eval_loss", "kl_bits", "entropy_gap_bits", "accuracy", "ece", "kl_bits_uniform"):
    assert _finite(m[k]), k
  assert m["kl_bits"] >= 0 and m["entropy_gap_bits"] >= 0
  assert 0 <= m["accuracy"] <= 1 and 0 <= m["ece"] <= 1
  # an untrained model is near the uniform guess, far from the exact posterior
  assert m["kl_bits"] > 0.1
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
  ko = p["key_orthogonality"]
  assert 0 <= ko["mean_abs_cos"] <= 1 and ko["hypotheses"] >= 2
  assert len(ko["mean_abs_cos_by_layer"]) == 2
  qk = p["qk_alignment"]
  assert 0 <= qk["attn_on_target"] <= 1 and _finite(qk["slope"])
  assert qk["layer"] in (0, 1) and qk["head"] in (0, 1)
  pc = p["pca_entropy"]
  assert -1 <= pc["corr_pc1_entropy"] <= 1
  assert all(0 <= v <= 1 for v in pc["explained_variance_ratio"])
  dr = p["drift"]
  assert dr["steps"] == [2, 4] and isinstance(dr["attention_settles_first"], bool)
  assert len(dr["attn_drift"]) == 1 and dr["attn_drift"][0] >= 0 and dr["value_drift"][0] > 0
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


def test_eval_text_run_reports_bits_per_byte(tmp_path, capsys, fast_compile):
  corpus = tmp_path / "corpus.txt"
  corpus.write_bytes(bytes(range(32, 127)) * 40)
  run = tmp_path / "run"
  _train(run, ["data.task=text", f"data.options={{path: {corpus}}}", "train.steps=2",
               "train.ckpt_every=0", "model.depth=1"])
  assert cli.main(["eval", "--run", str(run), "--batches", "1"]) == 0
  r = json.loads((run / "eval.json").read_text())
  m = r["metrics"]
  assert set(m) == {"eval_loss", "bits_per_byte", "positions"}
  assert m["bits_per_byte"] == pytest.approx(m["eval_loss"] / math.log(2))
  assert 0 < m["bits_per_byte"] < 9 and "probes" not in r
  assert "bits/byte" in capsys.readouterr().out


def test_eval_model_vocab_larger_than_data_vocab(tmp_path, capsys, fast_compile):
  """Issue 12, defect 3: model.vocab may exceed the data's vocabulary (the posterior is padded)."""
  run = tmp_path / "run"
  _train(run, ["model.vocab=40", "train.steps=2", "train.ckpt_every=0", "model.depth=1"])
  assert cli.main(["eval", "--run", str(run), "--batches", "1"]) == 0, capsys.readouterr().err
  m = json.loads((run / "eval.json").read_text())["metrics"]
  assert _finite(m["kl_bits"]) and m["kl_bits"] > 0
  # the uniform guess is over the 5 answer values, not over the padded vocabulary
  assert m["kl_bits_uniform"] < math.log2(5) + 1e-6
