"""The loss in the train step: sampled targets, soft posterior targets, a wider model vocab."""

import jax
import jax.numpy as jnp
import numpy as np

from mhc_jax.train.step import fit_posterior, token_loss


def test_posterior_loss_with_model_vocab_wider_than_data():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  post = jax.nn.softmax(jax.random.normal(k1, (2, 3, 10)))
  logits = jax.random.normal(k2, (2, 3, 16))
  batch = {"posterior": post, "mask": jnp.ones((2, 3)), "targets": jnp.zeros((2, 3), jnp.int32)}
  loss, _ = token_loss(logits, batch, "posterior")
  want = -np.mean(np.sum(np.asarray(post) * np.asarray(jax.nn.log_softmax(logits))[..., :10], -1))
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  assert fit_posterior(batch, 16)["posterior"].shape == (2, 3, 16)
  assert fit_posterior(batch, 10) is batch
