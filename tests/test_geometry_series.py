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
  assert "geometry_series.csv (4 rows: steps 0, 2, 4, 6)" in out
  df = pd.read_csv(query_run / "geometry_series.csv")
  ckpts = sorted(int(p.name) for p in (query_run / "checkpoints").iterdir() if p.name.isdigit())
  assert df["step"].tolist() == [0, *ckpts] and ckpts == [2, 4, 6]
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
  # the formation statistics (issue 55); step 0 is the trainer's initialisation
  for c in ("mae", "mae_uniform", "kl_bits_uniform", "frame_ratio", "frame_null", "frame_null_sd"):
    assert np.all(np.isfinite(df[c])), c
  assert np.allclose(df["frame_null"], 8 / 16, rtol=0.1)  # 8 value tokens in 16 dimensions
  assert {f"key_cos_h{h}" for h in range(2)} | {"key_cos_val_h0", "M", "M_gated"} <= set(df)
  assert np.allclose(df["key_cos"], (df["key_cos_h0"] + df["key_cos_h1"]) / 2)
  # six steps have taught nothing: no row passes the gate, so M never counts
  assert not df["learned"].any() and not df["M_gated"].any()
  assert np.all(df["kl_bits"] > df["kl_bits_uniform"] / 10)


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


# ------------------------------------------------------------ the formation statistics (issue 55)


def test_gated_m_fails_on_an_untrained_model_even_where_m_holds(query_run, monkeypatch):
  from mhc_jax.geometry import series

  monkeypatch.setattr(series, "M_Z", -np.inf)  # M now holds at every checkpoint
  assert cli.main(["eval", "--run", str(query_run), "--series", "--batches", "1"]) == 0
  df = pd.read_csv(query_run / "geometry_series.csv")
  assert df["M"].all() and not df["learned"].any() and not df["M_gated"].any()


def test_series_steps_picks_checkpoints(query_run, capsys):
  run = str(query_run)
  assert cli.main(["eval", "--run", run, "--series", "--batches", "1", "--steps", "4"]) == 0
  assert pd.read_csv(query_run / "geometry_series.csv")["step"].tolist() == [4]
  assert cli.main(["eval", "--run", run, "--series", "--batches", "1", "--steps", "4,0"]) == 0
  assert pd.read_csv(query_run / "geometry_series.csv")["step"].tolist() == [0, 4]
  assert cli.main(["eval", "--run", run, "--series", "--steps", "3"]) == 2
  assert "kept no checkpoint at [3]" in capsys.readouterr().err
  assert cli.main(["eval", "--run", run, "--series", "--steps", "4,x"]) == 2


def test_entropy_mae_is_zero_at_the_exact_posterior_and_the_gate_needs_learning():
  from mhc_jax.geometry import frame

  src = BijectionTask(seq_len=39, seed=0, n_symbols=20, replacement=False)
  b = {k: np.asarray(v) for k, v in src.batch(0, 32).items()}
  hyp = np.arange(20, 40)
  exact = np.log(np.maximum(b["posterior"], 1e-30))  # logits whose softmax is the posterior
  r = frame.entropy_mae(exact, b["posterior"], b["mask"], hyp)
  assert r["mae"] == pytest.approx(0, abs=1e-5)
  # their units: the mean over the 19 key positions of |log2 20 - log2(20 - t)|
  ref = np.mean(np.log2(20) - np.log2(20 - np.arange(19)))
  assert r["mae_uniform"] == pytest.approx(ref, rel=1e-5)
  flat = frame.entropy_mae(np.zeros_like(exact), b["posterior"], b["mask"], hyp)
  assert flat["mae"] == pytest.approx(ref, rel=1e-5)  # the uniform guess reads its own MAE
  assert frame.learned(0.05, 1.05) and not frame.learned(0.2, 1.05)
  assert not frame.learned(float("nan"), 1.05)


def test_frame_overlap_reads_a_planted_frame_and_not_noise():
  from mhc_jax.geometry import frame

  rng = np.random.default_rng(0)
  C, k, T = 64, 16, 5
  F = rng.normal(size=(k, C))  # the hypothesis frame: 16 directions in 64 dimensions
  W = frame.orthonormal(F)
  inside = W @ rng.normal(size=(k, 40))  # Jacobian rows inside the frame
  noise = rng.normal(size=(C, 40))
  planted = np.stack([[inside @ inside.T] * T, [noise @ noise.T] * T])  # layer 0 planted
  planted[:, -1] = 0  # the last position has no later target: left out, not read as a basis
  r = frame.frame_overlap(planted, np.arange(T), F, rank=8, nulls=300)
  assert r["null_mean"] == pytest.approx(k / C, rel=0.05)
  assert r["ratio_by_layer"][0] == pytest.approx(C / k, rel=0.05)  # overlap 1: 4x the null
  assert 0.6 < r["ratio_by_layer"][1] < 1.6  # random rows: the null
  assert r["ratio"] == pytest.approx(r["ratio_by_layer"].mean())


def test_jacobian_grams_match_the_explicit_jacobian():
  """The stacked Gram from the vmapped per-target backward passes equals sum g g^T built from
  jax.jacrev of the hypothesis logits, with only later targets counted (min horizon 1)."""
  import jax
  import jax.numpy as jnp

  from mhc_jax.geometry import frame
  from mhc_jax.model import Transformer
  from mhc_jax.model.transformer import zero_probes

  cfg = C.load_config("configs/debug.yaml", ["model.depth=2", "data.seq_len=12"])
  model = Transformer(C.with_data_vocab(cfg, 10).model)
  tokens = np.array([[8, 0, 4, 1, 5, 2, 6, 3, 7, 0, 4, 1]])
  params = model.init(jax.random.PRNGKey(1), jnp.asarray(tokens))
  hyp, first, last = np.arange(4, 8), 1, 9
  got = frame.jacobian_grams(model, params, tokens, hyp, first, last)
  probes, _ = zero_probes(model.cfg, 1, 12)
  jac = jax.jacrev(lambda p: model.apply(params, tokens, probes=p, stats=False)[0][0][:, hyp])(
    probes
  )  # [T, V, L, 2, 1, T, C]
  want = np.zeros_like(got)
  for k, layer in enumerate(frame.FRAME_LAYERS):
    for i in range(12):
      g = np.asarray(jac[first + 1 : last + 1, :, layer, 0, 0, i])  # targets p' in (first, last]
      g = g[(np.arange(first + 1, last + 1) > i)].reshape(-1, g.shape[-1])
      want[k, i] = g.T @ g
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)
  assert np.all(got[:, last:] == 0) and np.abs(got[:, 3]).max() > 0


def test_runs_of_one_model_share_their_compiled_series_functions():
  """The seeds of an arm (one model config, separate runs) reuse one jitted Gram sweep and one
  jitted forward: each run's series compiles nothing the previous run of that model compiled."""
  from mhc_jax import evaluate
  from mhc_jax.geometry import frame
  from mhc_jax.model import Transformer

  cfg = C.load_config("configs/debug.yaml", ["model.width=24"])
  a, b = Transformer(cfg.model), Transformer(cfg.model)  # one per run, as evaluate opens them
  hyp = (1, 2, 3)
  assert frame._gram_fn(a, hyp, (0, 1), 1, 4) is frame._gram_fn(b, hyp, (0, 1), 1, 4)
  assert evaluate._forward_fns(a, cfg) == evaluate._forward_fns(b, cfg)
  wide = Transformer(C.load_config("configs/debug.yaml", ["model.width=32"]).model)
  assert frame._gram_fn(wide, hyp, (0, 1), 1, 4) is not frame._gram_fn(a, hyp, (0, 1), 1, 4)
  assert evaluate._forward_fns(wide, cfg) != evaluate._forward_fns(a, cfg)
