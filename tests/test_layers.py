"""The model's building blocks (mhc_jax.model.layers) against plain formulations."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import pytest

from mhc_jax.model import layers


def dense_attention(q, k, v):
  """Causal attention over the whole T x T score matrix: ``(y, max causal logit, probs)``."""
  s = jnp.einsum("...htd,...hsd->...hts", q, k) / math.sqrt(q.shape[-1])
  causal = jnp.tril(jnp.ones(s.shape[-2:], bool))
  probs = jax.nn.softmax(jnp.where(causal, s, -1e30), -1)
  return (
    jnp.einsum("...hts,...hsd->...htd", probs, v),
    jnp.max(jnp.where(causal, s, -jnp.inf)),
    probs,
  )


@pytest.mark.parametrize("t,chunk", [(12, 5), (40, 64)])  # 3 chunks (the last one short); 1
def test_chunked_causal_attention_equals_dense(t, chunk):
  """Query chunks that skip the masked keys: the same outputs, probabilities (zeros above the
  diagonal included), logit maximum and gradients as the dense form, to float32 rounding."""
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k, v = (jax.random.normal(a, (2, 3, t, 8)) for a in ks)
  y, m, p = jax.jit(lambda *a: layers.causal_attention(*a, chunk=chunk, with_probs=True))(q, k, v)
  y0, m0, p0 = jax.jit(dense_attention)(q, k, v)
  chex.assert_trees_all_close((y, m, p), (y0, m0, p0), atol=1e-6, rtol=1e-6)
  assert float(jnp.max(jnp.abs(jnp.triu(p, 1)))) == 0.0

  def loss(f):
    return lambda *a: jnp.sum(jnp.sin(f(*a)[0]))

  g = jax.jit(jax.grad(loss(lambda *a: layers.causal_attention(*a, chunk=chunk)), (0, 1, 2)))(
    q, k, v
  )
  g0 = jax.jit(jax.grad(loss(dense_attention), (0, 1, 2)))(q, k, v)
  chex.assert_trees_all_close(g, g0, atol=1e-5, rtol=1e-5)


def test_query_chunk_rule():
  """Short sequences stay one chunk; from 128 tokens on, two."""
  assert [layers.query_chunk(t) for t in (16, 127, 128, 256, 1001)] == [16, 127, 64, 128, 501]
