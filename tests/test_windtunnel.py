"""Wind-tunnel tasks: exact posteriors against brute force, hand-worked cases, determinism, jit."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mhc_jax.data import make_source
from mhc_jax.data.windtunnel import (
  SPLITS,
  BijectionTask,
  HMMTask,
  bijection_posterior,
  hmm_forward,
)


def _tokens(batch, b):
  return np.concatenate([np.asarray(batch["inputs"][b]), np.asarray(batch["targets"][b, -1:])])


# ------------------------------------------------------------------------------- bijection


@pytest.mark.parametrize("V,n_pairs,replacement", [(4, 7, True), (5, 5, False), (5, 9, True)])
def test_bijection_posterior_matches_permutation_enumeration(V, n_pairs, replacement):
  src = make_source(
    "bijection",
    seq_len=2 * n_pairs + 1,
    seed=3,
    n_symbols=V,
    n_pairs=n_pairs,
    replacement=replacement,
  )
  batch = jax.device_get(src.batch(0, 6))
  perms = np.array(list(itertools.permutations(range(V))))  # [V!, V]
  post = batch["posterior"]
  assert post.shape == (6, 2 * n_pairs + 1, 2 * V + 2)
  for b in range(6):
    tok = _tokens(batch, b)
    assert tok[0] == src.bos and tok[-1] == src.pad
    keys, vals = tok[1 : 1 + 2 * n_pairs : 2], tok[2 : 2 + 2 * n_pairs : 2] - V
    assert np.all((keys >= 0) & (keys < V)) and np.all((vals >= 0) & (vals < V))
    if not replacement:
      assert len(set(keys.tolist())) == n_pairs
    for i in range(n_pairs):
      consistent = np.all(perms[:, keys[:i]] == vals[:i], axis=1)
      expect = np.bincount(perms[consistent, keys[i]], minlength=V) / consistent.sum()
      t = 1 + 2 * i
      np.testing.assert_allclose(post[b, t, V : 2 * V], expect, atol=1e-6)
      assert post[b, t, :V].sum() == 0 and post[b, t, 2 * V :].sum() == 0
      assert batch["mask"][b, t] == 1 and batch["targets"][b, t] == V + vals[i]
      assert post[b, t, batch["targets"][b, t]] > 0  # the sampled answer is possible
    # unsupervised positions: no mask, no posterior
    other = np.ones(src.seq_len, bool)
    other[1 : 1 + 2 * n_pairs : 2] = False
    assert batch["mask"][b, other].sum() == 0 and post[b, other].sum() == 0


def test_bijection_hand_worked_entropies():
  # pi(0)=3, pi(1)=1, pi(2)=0, pi(3)=4 with V = 5
  keys = jnp.array([0, 1, 0, 2, 1, 3])
  vals = jnp.array([3, 1, 3, 0, 1, 4])
  post, m = bijection_posterior(keys, vals, 5)
  h = -np.sum(np.where(post > 0, post * np.log2(np.where(post > 0, post, 1)), 0), axis=-1)
  np.testing.assert_allclose(h, [math.log2(5), 2.0, 0.0, math.log2(3), 0.0, 1.0], atol=1e-6)
  np.testing.assert_array_equal(m, [0, 1, 2, 2, 3, 3])
  np.testing.assert_allclose(post[2], np.eye(5)[3])  # repeated key: point mass on its value
  np.testing.assert_allclose(post[3], [1 / 3, 0, 1 / 3, 0, 1 / 3], atol=1e-6)


def test_bijection_entropy_follows_evidence_not_position():
  src = BijectionTask(seq_len=40, seed=0, n_symbols=8, replacement=True)
  b = jax.device_get(src.batch(1, 16))
  V, mask = 8, b["mask"] > 0
  keys = b["inputs"]
  for i in range(16):
    seen = set()
    for t in np.nonzero(mask[i])[0]:
      k = int(keys[i, t])
      want = 0.0 if k in seen else math.log2(V - b["evidence"][i, t])
      assert b["entropy"][i, t] == pytest.approx(want, abs=1e-5)
      assert b["evidence"][i, t] == len(seen)
      seen.add(k)
  # with replacement, the same position carries different entropies across sequences
  assert np.unique(np.round(b["entropy"][:, 9], 4)).size > 1


@pytest.mark.parametrize("seed", [0, 7, 2**31 + 5, 2**32 + 3])
def test_batch_key_is_the_documented_fold_in(seed):
  """Batch ``step`` of ``split`` draws from ``fold_in(fold_in(key(seed), split), step)`` (every
  run's data depends on it), for any seed ``jax.random.key`` takes (also past 32 bits)."""
  src = BijectionTask(seq_len=16, seed=seed, n_symbols=4)
  for split in ("train", "validation"):
    for step in (0, 3, 2**31 - 1):
      want = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), SPLITS[split]), step)
      got = src.key_for(step, split)
      np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))


def test_bijection_fresh_problem_per_sequence_deterministic_and_jittable():
  src = BijectionTask(seq_len=40, seed=7, n_symbols=20)
  # sample() is vmap(sample_one) over split keys; under the user's own jit it gives the batch
  one = jax.jit(jax.vmap(src.sample_one))(jax.random.split(src.key_for(0), 8))
  perms = np.asarray(one.pop("permutation"))
  assert len({p.tobytes() for p in perms}) == 8  # a different problem in every sequence
  assert all(sorted(p) == list(range(20)) for p in perms)
  b0 = src.batch(0, 8)
  again = BijectionTask(seq_len=40, seed=7, n_symbols=20).batch(0, 8)
  for k in b0:
    np.testing.assert_array_equal(b0[k], again[k])
  assert not np.array_equal(b0["inputs"], src.batch(1, 8)["inputs"])
  assert not np.array_equal(b0["inputs"], src.batch(0, 8, "validation")["inputs"])
  assert not np.array_equal(b0["inputs"], BijectionTask(seq_len=40, seed=8).batch(0, 8)["inputs"])
  for k in b0:
    np.testing.assert_array_equal(one[k], b0[k])
  b1 = np.asarray(src.batch(1, 8)["inputs"])  # and in different batches
  assert not any(
    np.array_equal(b1[i], np.asarray(b0["inputs"])[j]) for i in range(8) for j in range(8)
  )
  assert b0["inputs"].dtype == jnp.int32 and b0["mask"].dtype == jnp.float32
  assert b0["posterior"].dtype == jnp.float32
  np.testing.assert_array_equal(b0["inputs"][:, 1:], b0["targets"][:, :-1])
  big = src.batch(10**9, 2)  # infinite: any step
  assert big["inputs"].shape == (2, 40)


# ------------------------------------------------------------------------------- HMM


def _brute_force_predictive(T, E, obs, t):
  """p(o_{t+1} | o_1..t) by enumerating all state paths s_1..s_{t+1} (uniform initial)."""
  S, K = E.shape
  joint = np.zeros(K)
  for path in itertools.product(range(S), repeat=t + 1):
    p = 1.0 / S
    for i, s in enumerate(path):
      if i > 0:
        p *= T[path[i - 1], s]
      if i < t:
        p *= E[s, obs[i]]
    joint += p * E[path[-1]]
  return joint / joint.sum()


def _brute_force_filtered(T, E, obs, t):
  """p(s_t | o_1..t), t >= 1, by enumerating state paths."""
  S = T.shape[0]
  w = np.zeros(S)
  for path in itertools.product(range(S), repeat=t):
    p = 1.0 / S * E[path[0], obs[0]]
    for i in range(1, t):
      p *= T[path[i - 1], path[i]] * E[path[i], obs[i]]
    w[path[-1]] += p
  return w / w.sum()


def _brute_force_prior(T, t):
  """p(s_t | header) for t >= 1 by enumerating state paths (no observations)."""
  S = T.shape[0]
  w = np.zeros(S)
  for path in itertools.product(range(S), repeat=t):
    p = 1.0 / S
    for i in range(1, t):
      p *= T[path[i - 1], path[i]]
    w[path[-1]] += p
  return w


@pytest.mark.parametrize("S,K,L", [(2, 3, 6), (3, 2, 5)])
def test_hmm_predictive_matches_state_path_enumeration(S, K, L):
  src = make_source(
    "hmm", seq_len=40, seed=11, n_states=S, n_symbols=K, length=L, n_levels=6, predict="observation"
  )
  batch = jax.device_get(src.batch(0, 4))
  h = src.header_len
  for b in range(4):
    tok = _tokens(batch, b)
    T, E = src.parse_header(tok)  # the discretised parameters written into the header
    assert np.all(T > 0) and np.all(E > 0)
    obs = tok[h : h + L]
    assert np.all((obs >= 0) & (obs < K)) and np.all(tok[h + L :] == src.pad)
    for t in range(L):
      pos = h - 1 + t
      row = batch["posterior"][b, pos]
      np.testing.assert_allclose(row[:K], _brute_force_predictive(T, E, obs, t), atol=1e-5)
      assert row.sum() == pytest.approx(1.0, abs=1e-5) and row[K:].sum() == 0
      assert batch["mask"][b, pos] == 1 and batch["evidence"][b, pos] == t
      assert batch["targets"][b, pos] == obs[t]
      if t >= 1:
        np.testing.assert_allclose(
          batch["state_posterior"][b, pos], _brute_force_filtered(T, E, obs, t), atol=1e-5
        )
    assert batch["mask"][b].sum() == L


def test_hmm_hand_worked_forward():
  T = jnp.array([[0.9, 0.1], [0.2, 0.8]])
  E = jnp.array([[0.7, 0.3], [0.1, 0.9]])
  log_pred, log_filt = hmm_forward(
    jnp.log(jnp.array([0.5, 0.5])), jnp.log(T), jnp.log(E), jnp.array([0])
  )
  # before any observation: mean of the emission rows
  np.testing.assert_allclose(np.exp(log_pred[0]), [0.4, 0.6], atol=1e-6)
  # after o1 = 0: filtered [0.35, 0.05] / 0.4 = [0.875, 0.125]; next state [0.8125, 0.1875]
  np.testing.assert_allclose(np.exp(log_filt[0]), [0.875, 0.125], atol=1e-6)
  np.testing.assert_allclose(np.exp(log_pred[1]), [0.5875, 0.4125], atol=1e-6)


@pytest.mark.parametrize("S,K,L,rho", [(2, 3, 6, 0.0), (3, 2, 5, 0.6)])
def test_hmm_filtered_state_posterior_matches_state_path_enumeration(S, K, L, rho):
  src = make_source(
    "hmm", seq_len=40, seed=11, n_states=S, n_symbols=K, length=L, n_levels=6, stickiness=rho
  )
  assert src.predict == "state" and src.vocab_size == K + 6 + 3 + S
  batch = jax.device_get(src.batch(0, 4))
  h, off = src.header_len, src.state_offset
  for b in range(4):
    tok = _tokens(batch, b)
    T, E = src.parse_header(tok)
    obs = tok[h : h + L]
    assert np.all((obs >= 0) & (obs < K)) and np.all(tok[h + L :] == src.pad)
    for t in range(1, L + 1):
      pos = h - 1 + t  # the input position holding o_t
      assert batch["inputs"][b, pos] == obs[t - 1]
      row = batch["posterior"][b, pos]
      want = _brute_force_filtered(T, E, obs, t)
      np.testing.assert_allclose(row[off : off + S], want, atol=1e-5)
      assert row[:off].sum() == 0 and row.sum() == pytest.approx(1.0, abs=1e-5)
      assert batch["mask"][b, pos] == 1 and batch["evidence"][b, pos] == t
      s_t = batch["targets"][b, pos] - off  # the true hidden state, a state label
      assert 0 <= s_t < S and row[off + s_t] > 0
      np.testing.assert_allclose(batch["state_posterior"][b, pos], want, atol=1e-5)
    assert batch["mask"][b].sum() == L and batch["mask"][b, :h].sum() == 0


def test_hmm_stickiness_makes_transition_rows_sticky():
  # the same shapes as the other tests in this module: the samplers compile once
  loose = HMMTask(seq_len=48, seed=0, n_states=3, n_symbols=3)
  sticky = HMMTask(seq_len=48, seed=0, n_states=3, n_symbols=3, stickiness=0.7)
  diag = {}
  for name, src in (("loose", loose), ("sticky", sticky)):
    b = jax.device_get(src.batch(0, 64))
    diag[name] = np.mean([np.trace(src.parse_header(_tokens(b, i))[0]) / 3 for i in range(64)])
  assert diag["loose"] < 0.5 < 0.7 < diag["sticky"]


def test_hmm_true_states_are_drawn_from_the_filtered_posterior():
  """Calibration: state labels given probability p by p(s_t | o_1..t) are the true state with
  frequency p, so sampled targets (data.target=sample) train towards the posterior."""
  src = HMMTask(seq_len=48, seed=5, n_states=3, n_symbols=3)
  b = jax.device_get(src.batch(0, 64))
  m = b["mask"] > 0
  p = b["posterior"][m][:, src.answer_slice]  # [N, S]
  y = np.eye(3)[b["targets"][m] - src.state_offset]
  bins = np.minimum((p * 5).astype(int), 4)
  for k in range(5):
    sel = bins == k
    if sel.sum() > 400:
      assert abs(y[sel].mean() - p[sel].mean()) < 0.03, k
  # label symmetry: averaged over HMMs the filtered posterior is uniform at every step
  np.testing.assert_allclose(p.mean(0), 1 / 3, atol=0.03)


def test_hmm_observations_are_drawn_from_the_header_hmm():
  """Calibration: symbols predicted with probability p occur with frequency p."""
  src = HMMTask(seq_len=60, seed=5, n_states=3, n_symbols=3, predict="observation")
  b = jax.device_get(src.batch(0, 128))
  m = b["mask"] > 0
  p = b["posterior"][m][:, :3]  # [N, K]
  y = np.eye(3)[b["targets"][m]]
  bins = np.minimum((p * 5).astype(int), 4)
  for k in range(5):
    sel = bins == k
    if sel.sum() > 400:
      assert abs(y[sel].mean() - p[sel].mean()) < 0.03, k


def test_hmm_layout_and_options():
  src = HMMTask(seq_len=64, seed=0)  # filtering: o_L must be an input
  assert src.header_len == 52 and src.length == 64 - 52 and src.vocab_size == 5 + 10 + 3 + 5
  assert src.state_offset == 18 and src.answer_slice == slice(18, 23)
  b = jax.device_get(src.batch(0, 2))
  assert b["posterior"].shape == (2, 64, 23) and np.all(b["inputs"] < 18)  # no label in inputs
  np.testing.assert_allclose(b["posterior"].sum(-1), b["mask"], atol=1e-5)
  src = HMMTask(seq_len=64, seed=0, predict="observation")
  assert src.header_len == 52 and src.length == 64 + 1 - 52
  assert src.vocab_size == 5 + 10 + 3
  b = jax.device_get(src.batch(0, 2))
  hdr = b["inputs"][:, 1 : src.header_len - 1]
  assert np.all((hdr >= 5) & (hdr < 15))
  np.testing.assert_allclose(b["posterior"].sum(-1), b["mask"], atol=1e-5)
  np.testing.assert_allclose(b["state_posterior"][:, src.header_len - 1], 1 / 5, atol=1e-6)


def test_make_source_rejects_bad_names_and_options():
  with pytest.raises(ValueError, match="nope"):
    make_source("nope", seq_len=8, seed=0)
  with pytest.raises(ValueError, match="n_simbols"):
    make_source("bijection", seq_len=8, seed=0, n_simbols=4)
  with pytest.raises(ValueError, match="n_pairs"):
    make_source("bijection", seq_len=64, seed=0, n_symbols=5, n_pairs=6, replacement=False)
  with pytest.raises(ValueError, match="n_pairs"):
    make_source("bijection", seq_len=8, seed=0, n_pairs=5)
  with pytest.raises(ValueError, match="replacement"):
    make_source("bijection", seq_len=8, seed=0, replacement="yes")
  with pytest.raises(ValueError, match="seq_len"):
    make_source("hmm", seq_len=20, seed=0)
  with pytest.raises(ValueError, match="alpha"):
    make_source("hmm", seq_len=80, seed=0, alpha=0)
  with pytest.raises(ValueError, match="predict"):
    make_source("hmm", seq_len=80, seed=0, predict="states")
  for rho in (1.0, -0.1, "high", True):
    with pytest.raises(ValueError, match="stickiness"):
      make_source("hmm", seq_len=80, seed=0, stickiness=rho)
  with pytest.raises(ValueError, match="seq_len"):
    make_source("hmm", seq_len=52, seed=0)  # filtering: header and no observation input
  assert make_source("hmm", seq_len=52, seed=0, predict="observation").length == 1
  with pytest.raises(ValueError, match="split"):
    make_source("bijection", seq_len=8, seed=0).batch(0, 2, "dev")


# ------------------------------------------------------------------------------- baselines


def _kl(p, q):
  m = p > 0
  return float(np.sum(np.where(m, p * np.log2(np.where(m, p, 1) / np.where(m, q, 1)), 0)))


@pytest.mark.parametrize("predict", ["state", "observation"])
def test_hmm_baselines_match_enumeration(predict):
  S, K, L = 3, 2, 5
  src = make_source(
    "hmm",
    seq_len=40,
    seed=4,
    n_states=S,
    n_symbols=K,
    length=L,
    n_levels=6,
    predict=predict,
    stickiness=0.5,
  )
  batch = jax.device_get(src.batch(0, 3))
  base = src.baselines(batch["inputs"])
  assert set(base) == {"uniform", "header_only", "header_blind", "last_obs"}
  h, ans = src.header_len, src.answer_slice
  for name, d in base.items():
    assert d.shape == batch["posterior"].shape, name
    np.testing.assert_allclose(d.sum(-1), batch["mask"], atol=1e-12, err_msg=name)
  for b in range(3):
    tok = _tokens(batch, b)
    T, E = src.parse_header(tok)
    obs = tok[h : h + L]
    for t in range(1, L + 1) if predict == "state" else range(L):
      pos = h - 1 + t
      got = {k: v[b, pos, ans] for k, v in base.items()}
      if predict == "state":
        prior = _brute_force_prior(T, t)
        last = prior * E[:, obs[t - 1]]
        want = {
          "uniform": np.full(S, 1 / S),
          "header_only": prior,
          "header_blind": np.full(S, 1 / S),
          "last_obs": last / last.sum(),
        }
      else:
        prior = _brute_force_prior(T, t + 1)  # p(s_{t+1} | header)
        if t == 0:
          last = prior @ E
        else:
          f = _brute_force_prior(T, t) * E[:, obs[t - 1]]
          last = (f / f.sum()) @ T @ E
        counts = np.bincount(obs[:t], minlength=K)
        want = {
          "uniform": np.full(K, 1 / K),
          "header_only": prior @ E,
          "header_blind": (counts + 1) / (t + K),
          "last_obs": last,
        }
      for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-9, err_msg=f"{k} t={t}")


def test_hmm_filtering_baselines_leave_headroom():
  """On filtering, the header-only guess is far from the exact posterior (unlike prediction),
  and with sticky chains the last-observation guess is too: the history matters."""
  kls = {}
  for predict, rho in (("observation", 0.0), ("state", 0.0), ("state", 0.7)):
    src = HMMTask(seq_len=48, seed=1, n_states=3, n_symbols=3, predict=predict, stickiness=rho)
    b = jax.device_get(src.batch(0, 64))
    base = src.baselines(b["inputs"])
    n = b["mask"].sum()
    kls[predict, rho] = {k: _kl(b["posterior"].astype(np.float64), v) / n for k, v in base.items()}
  pred, filt, sticky = kls["observation", 0.0], kls["state", 0.0], kls["state", 0.7]
  assert pred["header_only"] < 0.1 * pred["uniform"]  # prediction: the header alone nearly does it
  assert filt["header_only"] > 0.15 and sticky["header_only"] > 0.15
  assert filt["header_blind"] == pytest.approx(filt["uniform"])
  assert sticky["last_obs"] > 2 * 0.1 * sticky["header_only"]  # 1/10 needs the history
  assert all(v >= 0 for d in kls.values() for v in d.values())


def test_bijection_uniform_baseline():
  src = BijectionTask(seq_len=24, seed=0, n_symbols=6)
  b = jax.device_get(src.batch(0, 4))
  u = src.baselines(b["inputs"])["uniform"]
  assert u.shape == b["posterior"].shape
  np.testing.assert_allclose(u.sum(-1), b["mask"])
  np.testing.assert_allclose(u[b["mask"] > 0][:, 6:12], 1 / 6)
