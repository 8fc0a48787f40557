"""Whether a mixer's H_res is used (issue 41): h_res_diag, h_res_shift and h_res_dynamic_share on
planted cases, across a resume, and in a real run's metrics.jsonl."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mhc_jax import diagnostics as D, sinkhorn as sk, testing
from mhc_jax.train.config import load_config
from mhc_jax.train.recorder import Recorder

N, L2 = 4, 3
J = np.full((N, N), 1.0 / N, np.float32)


def _record(rec: Recorder, step: int, h_avg, h_tok=None) -> dict:
  """One diagnostics step through layer_metrics and the recorder, as the train loop does it."""
  stats = {"h_res": h_avg} if h_tok is None else {"h_res": h_avg, "h_res_tok": h_tok}
  out = {k: np.asarray(v).tolist() for k, v in D.layer_metrics(stats).items()}
  row = {"loss": 1.0, "grad_norm": 1.0, "finite": True, **out}
  rec.record(step, row, has_eval=False, dt=1.0, tokens=1)
  assert "h_res_avg" not in row  # consumed, never logged
  return row


def _recorder(tmp_path) -> Recorder:
  r = Recorder(tmp_path, load_config(None, ["train.steps=200"]), main=False)
  r.begin(0, None)
  return r


def test_h_res_held_at_identity_reads_diag_one_shift_zero_share_zero(tmp_path):
  r = _recorder(tmp_path)
  eye = np.broadcast_to(np.eye(N, dtype=np.float32), (L2, N, N))
  tok = np.broadcast_to(eye[:, None], (L2, 5, N, N))
  for step in (0, 5, 9):
    row = _record(r, step, eye, tok)
    np.testing.assert_array_equal(row["h_res_diag"], [1.0] * L2)
    np.testing.assert_array_equal(row["h_res_shift"], [0.0] * L2)
    np.testing.assert_array_equal(row["h_res_dynamic_share"], [0.0] * L2)


def test_layer_trained_towards_a_doubly_stochastic_target_reads_its_diag_and_shift(tmp_path):
  """A static mhc layer from the default init (diagonal 0.999), its b_res trained so that
  Sinkhorn(b_res) reaches T = 0.6 I + 0.4 J/n: diag 0.7, and the shift is RMS(T - H_0)."""
  _, params, x, _, apply = testing.setup("mhc", n=N, dynamic=False)
  target = 0.6 * np.eye(N, dtype=np.float32) + 0.4 * J
  h_of = lambda p: apply(p, x)[1]["h_res"]
  loss = lambda p: jnp.sum(jnp.square(h_of(p) - target))
  tx = optax.adam(0.1)
  opt = tx.init(params)
  h0 = np.asarray(h_of(params))
  np.testing.assert_allclose(np.diag(h0), 0.999, atol=1e-4)

  @jax.jit
  def step(params, opt):
    upd, opt = tx.update(jax.grad(loss)(params), opt, params)
    return optax.apply_updates(params, upd), opt

  for _ in range(300):
    params, opt = step(params, opt)
  h1 = np.asarray(h_of(params))
  np.testing.assert_allclose(h1, target, atol=2e-3)
  r = _recorder(tmp_path)
  _record(r, 0, np.stack([h0] * L2))
  row = _record(r, 10, np.stack([h0, h1, h1]))
  np.testing.assert_allclose(row["h_res_diag"], [0.999, 0.7, 0.7], atol=2e-3)
  want = np.sqrt(np.mean(np.square(target - h0)))  # layer 0 did not move
  np.testing.assert_allclose(row["h_res_shift"], [0.0, want, want], atol=2e-3)
  # by hand: the diagonal moved 0.999 - 0.7, the off-diagonal 0.1 - 0.001 / 3
  assert want == pytest.approx(np.sqrt((4 * 0.299**2 + 12 * (0.1 - 0.001 / 3) ** 2) / 16), 1e-3)


def test_dynamic_share_is_zero_for_a_static_h_res_and_measures_the_token_part():
  # a static mhc layer with random logits: every token's H_res is the same
  _, params, x, _, apply = testing.setup("mhc", n=N, dynamic=False)
  params = jax.tree.map(lambda a: a + jax.random.normal(jax.random.PRNGKey(1), a.shape), params)
  tok = apply(params, x)[1]["h_res_tok"][None]  # [1, S, n, n]
  assert float(np.ptp(np.asarray(tok))) > 0.1  # not J/n: the share is not 0 by 0/0
  np.testing.assert_allclose(D.h_res_dynamic_share(tok), [0.0], atol=1e-6)

  # dynamic layers: the default's logit gap of 8 drowns the token part; from J/n it is most
  def share(**opts):
    _, params, x, _, apply = testing.setup("mhc", n=N, **opts)
    return float(D.h_res_dynamic_share(apply(params, x)[1]["h_res_tok"][None])[0])

  assert 0.0 < share() < 1e-3
  assert 0.5 < share(h_res_init="uniform", alpha_init=1.0) <= 1.0
  # planted: half the tokens at I, half at J/n: variance = ||I - J/n||^2 / 2 of a total
  # ||I - J/n||^2, a share of 1/2; tokens all at J/n read 0 (no 0/0)
  planted = np.stack([np.eye(N), J] * 3).astype(np.float32)[None]
  np.testing.assert_allclose(D.h_res_dynamic_share(planted), [0.5], rtol=1e-6)
  np.testing.assert_array_equal(D.h_res_dynamic_share(np.stack([J] * 4)[None]), [0.0])
  # a Sinkhorn-projected random per-token H_res reads the same in numpy
  h = np.asarray(sk.sinkhorn(jax.random.normal(jax.random.PRNGKey(2), (2, 6, N, N)), iters=20))
  var = np.sum(np.square(h - h.mean(1, keepdims=True)), axis=(1, 2, 3))
  np.testing.assert_allclose(
    D.h_res_dynamic_share(h), var / np.sum(np.square(h - J), axis=(1, 2, 3)), rtol=1e-5
  )


def test_a_resumed_recorder_measures_the_shift_from_the_same_step_0(tmp_path):
  rng = np.random.default_rng(0)
  hs = [np.eye(N) + 0.1 * rng.random((L2, N, N)) for _ in range(3)]
  whole = _recorder(tmp_path / "a")
  want = [_record(whole, s, h)["h_res_shift"] for s, h in zip((0, 5, 9), hs)]
  first = _recorder(tmp_path / "b")
  _record(first, 0, hs[0])
  host = json.loads(json.dumps(first.host_state(5)))  # what a checkpoint keeps (JSON)
  resumed = Recorder(tmp_path / "b", load_config(None, ["train.steps=200"]), main=False)
  resumed.begin(5, host)
  got = [_record(resumed, s, h)["h_res_shift"] for s, h in zip((5, 9), hs[1:])]
  np.testing.assert_allclose(got, want[1:], rtol=1e-6)
  assert min(want[2]) > 0.01


@pytest.mark.parametrize("mixer", ["mhc", "mhc_identity"])
def test_train_writes_h_res_diag_and_shift_per_layer(tmp_path, mixer):
  from mhc_jax.train.loop import prepare, train

  over = ["model.depth=2", "model.width=16", "model.heads=2", f"model.mixer={mixer}"]
  over += ["model.mixer_options.n=4", "data.task=bijection", "data.options.n_symbols=8"]
  over += ["data.batch_size=4", "data.seq_len=16", "data.eval_batches=1", "train.steps=4"]
  over += ["optim.warmup_steps=1", "optim.lr=3e-2", "train.diag_every=3", "train.ckpt_every=0"]
  train(prepare(load_config(None, over), devices=jax.devices()[:1]), tmp_path, progress=False)
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  diag = [r for r in rows if "h_res_diag" in r]
  assert [r["step"] for r in diag] == [0, 3]
  for r in diag:
    assert len(r["h_res_diag"]) == len(r["h_res_shift"]) == 4  # 2L mixer layers
  last = diag[-1]
  if mixer == "mhc_identity":
    assert last["h_res_diag"] == [1.0] * 4 and last["h_res_shift"] == [0.0] * 4
  else:
    np.testing.assert_allclose(diag[0]["h_res_diag"], 0.999, atol=1e-3)
    assert diag[0]["h_res_shift"] == [0.0] * 4
    assert all(s > 0 for s in last["h_res_shift"])  # trained, it moved (a little)


def test_h_res_figure_draws_one_line_per_seed_group_and_nothing_without_the_metric(tmp_path):
  import pandas as pd

  from mhc_jax.sweep import plots

  names = [f"mixer={m},seed={s}" for m in ("mhc", "mhc_identity") for s in (0, 1)]
  runs = pd.DataFrame({"run": names, "mixer": [n.split(",")[0][6:] for n in names]})
  runs["seed"] = [0, 1, 0, 1]
  runs.attrs["id_columns"] = ["run", "mixer", "seed"]
  rows = [
    {"run": r, "step": s, "stream_spread": [0.1] * 4, "h_res_diag": [1.0 - s / 100] * 4}
    | {"h_res_shift": [s / 100] * 4}
    for r in names
    for s in (0, 10)
  ]
  m = pd.DataFrame(rows)
  out = plots.h_res_vs_layer(m, runs, tmp_path / "h.png")
  assert out and (tmp_path / "h.png").stat().st_size > 1000
  assert plots.h_res_vs_layer(m.drop(columns="h_res_diag"), runs, tmp_path / "x.png") is None
  assert not (tmp_path / "x.png").exists()
