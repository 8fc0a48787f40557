"""Posterior-fidelity metrics: known answers (exact model, uniform guess, hand cases), bits, jit."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mhc_jax import posterior as P
from mhc_jax.data import make_source


@pytest.fixture(scope="module")
def batch():
  src = make_source("bijection", seq_len=24, seed=0, n_symbols=6)
  return jax.device_get(src.batch(0, 16))


def test_exact_model_scores_perfectly(batch):
  p, mask = batch["posterior"], batch["mask"]
  logits = jnp.log(p)  # -inf off the support
  assert float(P.kl_bits(p, logits, mask)) == pytest.approx(0.0, abs=1e-5)
  assert float(P.entropy_gap_bits(p, logits, mask)) == pytest.approx(0.0, abs=1e-5)
  assert float(P.ece(p, logits, mask)) == pytest.approx(0.0, abs=1e-5)
  want_acc = (p.max(-1) * mask).sum() / mask.sum()
  assert float(P.accuracy(p, logits, mask)) == pytest.approx(want_acc, abs=1e-5)
  m = P.fidelity_metrics(batch, logits)  # all -inf rows at unsupervised positions: no NaN leaks
  for k in ("kl_bits", "entropy_gap_bits", "ece"):
    assert float(m[k]) == pytest.approx(0.0, abs=1e-5), k


def test_uniform_guess_kl_is_log_vocab_minus_entropy(batch):
  p, mask = batch["posterior"], batch["mask"]
  V = p.shape[-1]
  logits = jnp.zeros(p.shape)
  h = batch["entropy"]
  want = math.log2(V) - (h * mask).sum() / mask.sum()
  assert float(P.kl_bits(p, logits, mask)) == pytest.approx(want, rel=1e-5)
  assert float(P.entropy_gap_bits(p, logits, mask)) == pytest.approx(want, rel=1e-5)
  # per position index: the same closed form position by position, NaN where nothing counts
  per = np.asarray(P.kl_bits_per_position(p, logits, mask))
  cnt = mask.sum(0)
  with np.errstate(invalid="ignore"):
    want_t = math.log2(V) - (h * mask).sum(0) / cnt
  np.testing.assert_allclose(per[cnt > 0], want_t[cnt > 0], rtol=1e-5)
  assert np.all(np.isnan(per[cnt == 0]))


def test_units_are_bits_and_hand_cases():
  p = jnp.array([[[1.0, 0.0], [0.5, 0.5]]])
  logits = jnp.log(jnp.array([[[0.5, 0.5], [0.25, 0.75]]]))
  mask = jnp.ones((1, 2))
  kl = np.asarray(P.kl_bits_pointwise(p, logits))
  np.testing.assert_allclose(kl, [[1.0, 0.5 + 0.5 * math.log2(2 / 3)]], atol=1e-6)
  assert float(P.kl_bits(p, logits, mask)) == pytest.approx(kl.mean(), abs=1e-6)
  # entropy gap: |0 - 1| and |1 - H(0.25, 0.75)|
  h = -(0.25 * math.log2(0.25) + 0.75 * math.log2(0.75))
  np.testing.assert_allclose(P.entropy_gap_bits_pointwise(p, logits), [[1.0, 1 - h]], atol=1e-6)
  # expected accuracy: model argmax is 0 (tie -> first) then 1: posterior mass 1.0 and 0.5
  assert float(P.accuracy(p, logits, mask)) == pytest.approx(0.75, abs=1e-6)
  assert float(P.accuracy(p, logits, mask, targets=jnp.array([[0, 0]]))) == pytest.approx(0.5)
  # soft cross-entropy (nats) = (KL + H) * ln 2
  ce = float(P.soft_cross_entropy(p, logits, mask))
  assert ce == pytest.approx((kl.sum() + 1.0) / 2 * math.log(2), abs=1e-6)


def test_ece_hand_cases():
  # two positions in one bin: confidence 0.9, expected correctness 0.5 -> ECE 0.4
  logits = jnp.log(jnp.array([[[0.9, 0.1], [0.9, 0.1]]]))
  p = jnp.array([[[0.5, 0.5], [0.5, 0.5]]])
  assert float(P.ece(p, logits, jnp.ones((1, 2)))) == pytest.approx(0.4, abs=1e-6)
  # different bins: (conf .9, acc 1) and (conf .6, acc .2) -> (0.1 + 0.4) / 2
  logits = jnp.log(jnp.array([[[0.9, 0.1], [0.6, 0.4]]]))
  p = jnp.array([[[1.0, 0.0], [0.2, 0.8]]])
  assert float(P.ece(p, logits, jnp.ones((1, 2)))) == pytest.approx(0.25, abs=1e-6)
  per = np.asarray(P.ece_per_position(p, logits, jnp.ones((1, 2))))
  np.testing.assert_allclose(per, [0.1, 0.4], atol=1e-6)
  # a masked-out position changes nothing
  assert float(P.ece(p, logits, jnp.array([[1.0, 0.0]]))) == pytest.approx(0.1, abs=1e-6)


def test_per_evidence_curves_match_numpy_grouping(batch):
  p, mask, ev = batch["posterior"], batch["mask"], batch["evidence"]
  logits = np.random.default_rng(0).normal(size=p.shape).astype(np.float32)
  G = 8
  curve = np.asarray(P.kl_bits_per_position(p, logits, mask, ev, G))
  # independent numpy KL in bits
  lq = logits - logits.max(-1, keepdims=True)
  lq = lq - np.log(np.exp(lq).sum(-1, keepdims=True))
  with np.errstate(divide="ignore", invalid="ignore"):
    kl = np.where(p > 0, p * (np.log(p) - lq), 0).sum(-1) / np.log(2)
  for g in range(G):
    sel = (ev == g) & (mask > 0)
    if sel.any():
      assert curve[g] == pytest.approx(kl[sel].mean(), rel=1e-5)
    else:
      assert np.isnan(curve[g])
  np.testing.assert_array_equal(
    P.group_count(mask, ev, G), [((ev == g) & (mask > 0)).sum() for g in range(G)]
  )


def test_fidelity_metrics_jits_and_ignores_masked_positions(batch):
  logits = np.random.default_rng(1).normal(size=batch["posterior"].shape).astype(np.float32)
  m = jax.jit(P.fidelity_metrics)(batch, logits)
  T = batch["mask"].shape[1]
  for k in ("kl_bits", "entropy_gap_bits", "accuracy", "ece", "posterior_entropy_bits"):
    assert m[k].shape == () and np.isfinite(m[k])
  for k in ("kl_bits", "entropy_gap_bits", "accuracy", "ece", "count"):
    assert m[f"{k}_by_position"].shape == (T,)
    assert m[f"{k}_by_evidence"].shape == (T + 1,)
  assert float(m["count_by_evidence"].sum()) == batch["mask"].sum()
  # garbage logits where the mask is 0 do not move any scalar
  junk = np.where(batch["mask"][..., None] > 0, logits, 1e3 * logits)
  junk[..., 0] = np.where(batch["mask"] > 0, junk[..., 0], np.nan)
  m2 = jax.jit(P.fidelity_metrics)(batch, junk)
  for k in ("kl_bits", "entropy_gap_bits", "accuracy", "ece"):
    assert float(m2[k]) == pytest.approx(float(m[k]), rel=1e-6)
