"""WindowMLP baseline: causal fixed window, equals the flattened-window MLP, parameter matching."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mhc_jax.baselines import WindowMLP, match_width, param_count, window_mlp_param_count

V, W, K, D, E, T = 11, 24, 4, 2, 8, 12


@pytest.fixture(scope="module")
def model_and_params():
  model = WindowMLP(vocab=V, width=W, window=K, depth=D, embed_dim=E)
  tokens = jax.random.randint(jax.random.key(0), (2, T), 0, V)
  params = jax.jit(model.init)(jax.random.key(1), tokens)
  return model, params, tokens


def test_shapes_and_param_count(model_and_params):
  model, params, tokens = model_and_params
  logits = jax.jit(model.apply)(params, tokens)
  assert logits.shape == (2, T, V) and logits.dtype == jnp.float32
  assert param_count(params) == window_mlp_param_count(V, W, K, D, E)
  for depth in (1, 3):
    p = jax.eval_shape(WindowMLP(V, W, K, depth, E).init, jax.random.key(0), tokens)
    assert param_count(p) == window_mlp_param_count(V, W, K, depth, E)


def test_sees_exactly_the_causal_window(model_and_params):
  model, params, tokens = model_and_params
  base = model.apply(params, tokens)
  t = 7
  future = tokens.at[:, t + 1 :].set((tokens[:, t + 1 :] + 1) % V)
  np.testing.assert_allclose(model.apply(params, future)[:, : t + 1], base[:, : t + 1], atol=1e-6)
  too_old = tokens.at[:, t - K].set((tokens[:, t - K] + 1) % V)
  np.testing.assert_allclose(model.apply(params, too_old)[:, t], base[:, t], atol=1e-6)
  oldest_seen = tokens.at[:, t - K + 1].set((tokens[:, t - K + 1] + 1) % V)
  assert not np.allclose(model.apply(params, oldest_seen)[:, t], base[:, t])


def test_equals_mlp_on_flattened_zero_padded_window(model_and_params):
  model, params, tokens = model_and_params
  p = params["params"]
  emb = np.asarray(p["embed"]["embedding"])[np.asarray(tokens)]  # [B,T,E]
  padded = np.concatenate([np.zeros((2, K - 1, E)), emb], axis=1)
  flat = np.stack([padded[:, t : t + K].reshape(2, K * E) for t in range(T)], axis=1)
  kernel = np.asarray(p["window"]["kernel"]).reshape(K * E, W)
  h = jax.nn.gelu(flat @ kernel + np.asarray(p["window"]["bias"]))
  h = jax.nn.gelu(h @ p["hidden_0"]["kernel"] + p["hidden_0"]["bias"])
  want = h @ p["head"]["kernel"] + p["head"]["bias"]
  np.testing.assert_allclose(model.apply(params, tokens), want, atol=1e-4, rtol=1e-4)


def test_trains_with_finite_gradients(model_and_params):
  model, params, tokens = model_and_params

  def loss(prm):
    lp = jax.nn.log_softmax(model.apply(prm, tokens))
    return -jnp.mean(jnp.take_along_axis(lp, tokens[..., None], -1))

  grads = jax.jit(jax.grad(loss))(params)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))


@pytest.mark.parametrize("target,depth", [(2_700_000, 2), (2_700_000, 1), (400_000, 3)])
def test_match_width_hits_the_target(target, depth):
  width = match_width(target, vocab=42, window=64, depth=depth, embed_dim=32)
  got = window_mlp_param_count(42, width, 64, depth, 32)
  assert abs(got - target) <= 0.05 * target
  # and it is the best integer width
  for w in (width - 1, width + 1):
    assert abs(window_mlp_param_count(42, w, 64, depth, 32) - target) >= abs(got - target)


def test_match_width_rejects_unreachable_targets():
  with pytest.raises(ValueError, match="within"):
    match_width(100, vocab=42, window=64, depth=2, embed_dim=32)
