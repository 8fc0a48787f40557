"""`mhc-jax eval --series`: the papers' signatures over a run's kept checkpoints (issue 49), and
the bijection's query-only layout (`data.options.supervise: query`) the papers train on."""

import numpy as np
import pandas as pd
import pytest

from mhc_jax import cli
from mhc_jax.data.windtunnel import BijectionTask
from mhc_jax.train import config as C
from mhc_jax.train.loop import prepare, train

SIGNATURES = ("key_cos", "key_cos_centred", "qk_slope", "qk_slope_wp", "value_r", "value_r_new_wp")


@pytest.fixture(scope="module")
def query_run(tmp_path_factory):
  """The papers' layout (keys without replacement, only the query supervised), 3 checkpoints."""
  run = tmp_path_factory.mktemp("series") / "run"
  cfg = C.load_config(
    "configs/debug.yaml",
    [
      "train.steps=6",
      "train.ckpt_every=2",
      "train.keep_ckpts=5",
      "train.diag_every=0",
      "data.seq_len=24",
      "data.target=sample",
      "data.options={n_symbols: 8, replacement: false, supervise: query}",
      "model.depth=2",
      "model.tied_embeddings=false",
    ],
  )
  train(prepare(cfg), run, progress=False)
  return run


def test_series_writes_one_row_per_checkpoint_with_nulls(query_run, capsys):
  assert cli.main(["eval", "--run", str(query_run), "--series", "--batches", "1"]) == 0
  out = capsys.readouterr().out
  assert "geometry_series.csv (3 checkpoints)" in out
  df = pd.read_csv(query_run / "geometry_series.csv")
  ckpts = sorted(int(p.name) for p in (query_run / "checkpoints").iterdir() if p.name.isdigit())
  assert df["step"].tolist() == ckpts == [2, 4, 6]
  for s in SIGNATURES:
    for c in (s, f"{s}_null", f"{s}_null_sd", f"{s}_z"):
      assert np.all(np.isfinite(df[c])), c
  assert np.all(np.isfinite(df[["eval_loss", "kl_bits", "frame_dist"]]))
  # layer-0 token keys, heads of 16 / 2 = 8 dimensions: the null is 8 random directions in 8-d,
  # E|cos| ~ sqrt(2 / (pi d)) = 0.28
  assert np.all((df["key_cos"] > 0) & (df["key_cos"] < 1)) and df["key_cos_null"].nunique() == 1
  assert df["key_cos_null"].iloc[0] == pytest.approx(np.sqrt(2 / (np.pi * 8)), rel=0.15)
  # the new-key probe reads within-position entropy although the run's own data has none
  assert np.all(df["value_r_new_wp_null"] > 0) and np.all(df["value_r_new_wp_null_sd"] > 0)
  assert df["frame_dist"].iloc[-1] == 0 and df["frame_dist"].iloc[0] > 0
  assert not (query_run / "eval.json").exists()  # the flag writes only the series


def test_series_bad_input_exits_2(query_run, tmp_path, capsys):
  assert cli.main(["eval", "--run", str(query_run), "--series", "--batches", "0"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and "--batches" in err and len(err.strip().splitlines()) == 1
  assert cli.main(["eval", "--run", str(tmp_path / "nope"), "--series"]) == 2
  assert "does not exist" in capsys.readouterr().err
  assert not (tmp_path / "nope").exists()


def test_query_layout_supervises_one_context_key():
  src = BijectionTask(seq_len=24, seed=0, n_symbols=8, replacement=False, supervise="query")
  assert src.n_pairs == 8  # (24 - 2) // 2 = 11 pairs fit, at most V = 8 distinct keys
  b = {k: np.asarray(v) for k, v in src.batch(0, 16).items()}
  q = 2 * src.n_pairs + 1
  assert np.all(b["mask"][:, q] == 1) and b["mask"].sum() == 16
  keys = b["inputs"][:, 1:q:2]
  query = b["inputs"][:, q]
  assert all(query[i] in keys[i] for i in range(16))  # drawn from the context
  hit = np.argmax(keys == query[:, None], axis=1)
  answer = b["inputs"][np.arange(16), 2 + 2 * hit]
  np.testing.assert_array_equal(b["targets"][:, q], answer)  # the value shown in context
  assert np.all(b["posterior"][np.arange(16), q, answer] == 1) and np.all(b["entropy"] == 0)
  np.testing.assert_array_equal(b["evidence"][:, q], 8)
  base = src.baselines(b["inputs"])["uniform"]
  assert base.sum() == pytest.approx(16) and np.all(base[:, q, 8:16] == 1 / 8)
  assert len(set(query.tolist())) > 1  # the query varies over sequences
  with pytest.raises(ValueError, match="supervise"):
    BijectionTask(seq_len=24, seed=0, supervise="last")
  with pytest.raises(ValueError, match="n_pairs"):  # no room for the query after 12 pairs
    BijectionTask(seq_len=24, seed=0, n_pairs=12, supervise="query")
