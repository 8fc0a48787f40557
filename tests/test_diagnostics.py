"""Known answers for the per-layer diagnostics (mhc_jax.diagnostics)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mhc_jax import diagnostics as D


def _mats(seed=0, depth=5, n=3, positive=False):
  rng = np.random.default_rng(seed)
  m = rng.normal(size=(depth, n, n)).astype(np.float32)
  return np.abs(m) if positive else m


def _np_products(h):
  out, p = [], np.eye(h.shape[-1], dtype=np.float64)
  for hl in h.astype(np.float64):
    p = hl @ p  # later layer on the left
    out.append(p)
  return np.stack(out)


def test_identity_composite_gain_is_one():
  h = jnp.broadcast_to(jnp.eye(4, dtype=jnp.float32), (6, 4, 4))
  for fn in (D.amax_fwd_composite, D.amax_bwd_composite):
    np.testing.assert_allclose(fn(h), np.ones(6), rtol=0, atol=0)
  np.testing.assert_allclose(D.log_colsum_max(h), np.zeros(6), atol=0)
  np.testing.assert_allclose(D.amax_fwd(h), np.ones(6))


@pytest.mark.parametrize("n", [2, 3])
def test_composite_matches_numpy_product_order(n):
  h = _mats(seed=n, depth=5, n=n)
  want = _np_products(h)
  got = np.asarray(D.composite(h))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # the order matters for these matrices: the reversed product is different
  assert not np.allclose(want[-1], h[0] @ h[1] @ h[2] @ h[3] @ h[4], atol=1e-3)
  np.testing.assert_allclose(D.amax_fwd_composite(h), np.abs(want.sum(-1)).max(-1), rtol=1e-5)
  np.testing.assert_allclose(D.amax_bwd_composite(h), np.abs(want.sum(-2)).max(-1), rtol=1e-5)


def test_amax_single_layer_signed_sums():
  h = jnp.array([[[1.0, -3.0], [0.5, 0.25]]])
  np.testing.assert_allclose(D.amax_fwd(h), [2.0])  # rows: -2, 0.75
  np.testing.assert_allclose(D.amax_bwd(h), [2.75])  # cols: 1.5, -2.75


def test_log_colsum_max_known_and_guarded():
  h = np.array([[[2.0, 0.0], [0.0, 0.5]], [[1.0, 0.0], [0.0, 1.0]]], np.float32)
  np.testing.assert_allclose(D.log_colsum_max(h), [math.log(2.0), math.log(2.0)], rtol=1e-6)
  # a zero and a negative column sum stay finite (log of |s| floored at 1e-30)
  h0 = np.array([[[1.0, -1.0], [-1.0, -1.0]]], np.float32)  # col sums 0, -2
  v = np.asarray(D.log_colsum_max(h0))
  assert np.isfinite(v).all()
  np.testing.assert_allclose(v, [-math.log(D.LOG_FLOOR)], rtol=1e-5)


def test_composite_batched_leading_axes():
  h = np.stack([_mats(1, 4, 2), _mats(2, 4, 2)])  # [pop=2, 2L=4, 2, 2]
  got = np.asarray(D.composite(h))
  for i in range(2):
    np.testing.assert_allclose(got[i], _np_products(h[i]), rtol=1e-5, atol=1e-5)


def test_gain_fwd_and_branch_ratio():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(6, 8, 3)).astype(np.float32)
  k = 2.5
  rms = lambda a: np.sqrt(np.mean(np.square(a), axis=(1, 2)))
  np.testing.assert_allclose(D.gain_fwd(rms(x), rms(k * x)), np.full(6, k), rtol=1e-6)
  np.testing.assert_allclose(D.branch_ratio(jnp.ones(3), jnp.full(3, 4.0)), np.full(3, 0.25))


def test_growth_exponent():
  L = 7
  assert float(D.growth_exponent(1.0, math.exp(L), L)) == pytest.approx(1.0, rel=1e-6)
  assert float(D.growth_exponent(2.0, 2.0, L)) == 0.0
  # vectorised over a batch of runs
  np.testing.assert_allclose(
    D.growth_exponent(jnp.ones(2), jnp.exp(jnp.array([3.0, -6.0])), 3), [1.0, -2.0], rtol=1e-6
  )


def test_gain_bwd_indexing():
  g = jnp.array([8.0, 4.0, 2.0, 1.0])
  out = np.asarray(D.gain_bwd(g))
  np.testing.assert_allclose(out[:3], [2.0, 2.0, 2.0])
  assert out.shape == (4,) and np.isnan(out[3])
  np.testing.assert_allclose(D.gain_bwd(g, grad_rms_out=0.5), [2.0, 2.0, 2.0, 2.0])


def test_tree_norms_match_manual_loop():
  rng = np.random.default_rng(3)
  tree = {
    "attn": {"w": rng.normal(size=(3, 4, 5)), "b": rng.normal(size=(3, 5))},
    "mlp": [rng.normal(size=(3, 2, 2, 2)), rng.normal(size=(3,))],
  }
  leaves = jax.tree_util.tree_leaves(tree)
  manual = [math.sqrt(sum(float(np.sum(np.square(x[l]))) for x in leaves)) for l in range(3)]
  norms = jax.jit(lambda t: (D.tree_layer_norms(t), D.tree_norm(t), D.tree_rms(t)))
  per_layer, total, rms = norms(tree)
  np.testing.assert_allclose(per_layer, manual, rtol=1e-5)
  flat = np.concatenate([np.ravel(x) for x in leaves])
  assert float(total) == pytest.approx(np.linalg.norm(flat), rel=1e-5)
  assert float(rms) == pytest.approx(np.sqrt(np.mean(flat**2)), rel=1e-5)
  with pytest.raises(ValueError):
    D.tree_layer_norms({"a": np.ones((3, 2)), "b": np.ones((4, 2))})


def _stats(L=2, n=3, seed=0):
  rng = np.random.default_rng(seed)
  return {
    "h_res": _mats(seed, 2 * L, n, positive=True),
    "h_pre": np.ones((2 * L, n), np.float32),
    "h_post": np.ones((2 * L, n), np.float32),
    "rms_in": rng.uniform(0.5, 2, 2 * L).astype(np.float32),
    "rms_out": rng.uniform(0.5, 2, 2 * L).astype(np.float32),
    "branch_rms": rng.uniform(0.5, 2, 2 * L).astype(np.float32),
    "sinkhorn_err": np.zeros(2 * L, np.float32),
    "attn_logit_max": rng.uniform(size=L).astype(np.float32),
    "out_logit_max": np.float32(3.0),
  }


def test_layer_metrics_under_jit_matches_eager():
  stats = _stats()
  grad_rms = jnp.array([4.0, 3.0, 2.0, 1.0])
  eager = D.layer_metrics(stats, grad_rms, grad_rms_out=1.0)
  jitted = jax.jit(D.layer_metrics)(stats, grad_rms, 1.0)
  expected = {
    "gain_fwd",
    "branch_ratio",
    "amax_fwd",
    "amax_bwd",
    "amax_fwd_composite",
    "amax_bwd_composite",
    "log_colsum_max",
    "grad_rms",
    "gain_bwd",
    "amin_fwd_composite",
    "amin_bwd_composite",
    "amax_fwd_suffix",
    "amax_bwd_suffix",
    "h_res_diag",
    "h_res_avg",
    "sinkhorn_err",
    "attn_logit_max",
    "out_logit_max",
  }
  assert set(eager) == expected == set(jitted)
  for k in expected:
    assert jitted[k].dtype == jnp.float32, k
    np.testing.assert_allclose(jitted[k], eager[k], rtol=1e-6, err_msg=k)
  for k in ("gain_fwd", "amax_fwd_composite", "log_colsum_max", "gain_bwd"):
    assert eager[k].shape == (4,), k
  assert eager["attn_logit_max"].shape == (2,)
  want = _np_products(stats["h_res"])
  np.testing.assert_allclose(eager["amax_bwd_composite"], np.abs(want.sum(-2)).max(-1), rtol=1e-5)
  np.testing.assert_allclose(eager["gain_fwd"], stats["rms_out"] / stats["rms_in"], rtol=1e-6)
  assert "gain_bwd" not in D.layer_metrics(stats)


def test_all_functions_jit_and_bf16_input():
  h = jnp.asarray(_mats(0, 4, 2), jnp.bfloat16)
  tree = {"w": jnp.ones((2, 3), jnp.bfloat16)}

  @jax.jit
  def everything(h, tree):
    mats = [
      fn(h)
      for fn in (
        D.amax_fwd,
        D.amax_bwd,
        D.composite,
        D.amax_fwd_composite,
        D.amax_bwd_composite,
        D.log_colsum_max,
      )
    ]
    trees = [fn(tree) for fn in (D.tree_layer_norms, D.tree_norm, D.tree_rms)]
    return mats, trees, D.growth_exponent(1.0, jnp.e, 1), D.gain_bwd(jnp.ones(4), 1.0)

  mats, trees, growth, gb = everything(h, tree)
  assert all(x.dtype == jnp.float32 for x in mats + trees)
  np.testing.assert_allclose(trees[0], [math.sqrt(3)] * 2, rtol=1e-6)
  assert float(growth) == pytest.approx(1.0)
  assert gb.shape == (4,)


# ----------------------------------------------------------------- per-token, suffix, attenuation
def _np_suffix(h):
  out, p = [], np.eye(h.shape[-1], dtype=np.float64)
  for hl in h.astype(np.float64)[::-1]:
    p = p @ hl  # earlier layer on the right
    out.append(p)
  return np.stack(out[::-1])


def _correlated_tokens(depth=6, S=8, n=4, seed=0):
  """Dynamic-HC-like per-token H_res: I + a_s M_l with a per-token amplitude a_s shared by all
  layers (a token that amplifies does so at every layer), half the tokens with a_s < 0."""
  rng = np.random.default_rng(seed)
  m = rng.normal(size=(depth, 1, n, n)) * 0.3
  a = np.concatenate([np.linspace(0.5, 1.5, S // 2), -np.linspace(0.5, 1.5, S // 2)])
  return (np.eye(n) + a[None, :, None, None] * m).astype(np.float32)  # [2L, S, n, n]


def test_per_token_and_averaged_composites_differ_and_match_numpy():
  h_tok = _correlated_tokens()
  h_avg = h_tok.mean(axis=1)
  got = D.layer_metrics({"h_res": h_avg, "h_res_tok": h_tok})
  # numpy float64 references
  avg_fwd = np.abs(_np_products(h_avg).sum(-1)).max(-1)
  per = np.stack([_np_products(h_tok[:, s]) for s in range(h_tok.shape[1])])  # [S, 2L, n, n]
  tok_fwd = np.abs(per.sum(-1)).max(-1)
  tok_bwd = np.abs(per.sum(-2)).max(-1)
  np.testing.assert_allclose(got["amax_fwd_composite"], avg_fwd, rtol=1e-5)
  np.testing.assert_allclose(got["amax_fwd_composite_tok_mean"], tok_fwd.mean(0), rtol=1e-5)
  np.testing.assert_allclose(got["amax_fwd_composite_tok_max"], tok_fwd.max(0), rtol=1e-5)
  np.testing.assert_allclose(got["amax_bwd_composite_tok_mean"], tok_bwd.mean(0), rtol=1e-5)
  np.testing.assert_allclose(got["amax_bwd_composite_tok_max"], tok_bwd.max(0), rtol=1e-5)
  # averaging the matrices first hides the per-token growth (the case this metric exists for)
  assert got["amax_fwd_composite_tok_mean"][-1] > 1.5 * got["amax_fwd_composite"][-1]


def test_suffix_is_layer_to_output_and_agrees_with_prefix_only_for_the_whole_depth():
  h = _mats(seed=3, depth=6, n=3)
  sfx = np.asarray(D.suffix(h))
  np.testing.assert_allclose(sfx, _np_suffix(h), rtol=1e-4, atol=1e-4)
  pre = np.asarray(D.composite(h))
  np.testing.assert_allclose(sfx[0], pre[-1], rtol=1e-4, atol=1e-4)
  assert not np.allclose(sfx[2], pre[2], atol=1e-2)
  got = D.layer_metrics({"h_res": h})
  np.testing.assert_allclose(
    got["amax_fwd_suffix"], np.abs(_np_suffix(h).sum(-1)).max(-1), rtol=1e-4
  )
  np.testing.assert_allclose(
    got["amax_bwd_suffix"], np.abs(_np_suffix(h).sum(-2)).max(-1), rtol=1e-4
  )


def test_amin_shows_attenuation_that_amax_hides():
  # column sums 1.5 and 0.5: Amax says 1.5 (mild), Amin says one direction halves per layer
  h = np.broadcast_to(np.array([[1.0, 0.0], [0.5, 0.5]], np.float32), (4, 2, 2))
  got = D.layer_metrics({"h_res": h})
  cols = np.abs(_np_products(h).sum(-2))
  np.testing.assert_allclose(got["amin_bwd_composite"], cols.min(-1), rtol=1e-6)
  np.testing.assert_allclose(
    got["amin_fwd_composite"], np.abs(_np_products(h).sum(-1)).min(-1), rtol=1e-6
  )
  assert float(got["amin_bwd_composite"][-1]) < 0.1 < float(got["amax_bwd_composite"][-1])


def test_growth_exponent_grad_by_hand():
  """2L = 4 mixer layers; gradient RMS at the collapse input 0.5, then 1, 2, 4, 8 towards the
  input: it doubles per layer on its way back, so lambda_grad = ln(8 / 0.5) / 4 = ln 2."""
  from mhc_jax.train.step import diag_metrics

  L2, n, c = 4, 2, 3
  scales = np.array([8.0, 4.0, 2.0, 1.0], np.float32)  # RMS of dLoss/d(stream entering layer l)
  # what the squared-norm taps hand over: Σ g² per layer over the n x c state, and at the output
  sq_layers = (scales**2 * n * c).reshape(2, 2)
  sq_out = np.float32(0.5**2 * n * c)
  stats = {
    "h_res": np.broadcast_to(np.eye(n, dtype=np.float32), (L2, n, n)),
    "rms_in": np.ones(L2, np.float32),
    "rms_out": np.full(L2, np.e**2, np.float32),
    "branch_rms": np.ones(L2, np.float32),
  }
  aux = {
    "stats": stats,
    "attn_logit_max": np.zeros(2, np.float32),
    "out_logit_max": 0.0,
    "logsumexp_mean": 0.0,
    "logsumexp_max": 0.0,
  }
  out = diag_metrics(aux, (sq_layers, sq_out), {"params": {}}, depth=2, size=n * c)
  assert float(out["growth_exponent_grad"]) == pytest.approx(math.log(2.0), rel=1e-5)
  assert float(out["growth_exponent"]) == pytest.approx(2.0 / L2, rel=1e-5)
