"""The model's building blocks (mhc_jax.model.layers) against plain formulations."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
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


@pytest.mark.parametrize("t", [12, 40])
def test_causal_attention_equals_dense(t):
  """The materialised form: the same outputs, probabilities (zeros above the diagonal
  included), logit maximum and gradients as the reference, to float32 rounding."""
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k, v = (jax.random.normal(a, (2, 3, t, 8)) for a in ks)
  y, m, p = jax.jit(lambda *a: layers.causal_attention(*a, with_probs=True))(q, k, v)
  y0, m0, p0 = jax.jit(dense_attention)(q, k, v)
  chex.assert_trees_all_close((y, m, p), (y0, m0, p0), atol=1e-6, rtol=1e-6)
  assert float(jnp.max(jnp.abs(jnp.triu(p, 1)))) == 0.0

  def loss(f):
    return lambda *a: jnp.sum(jnp.sin(f(*a)[0]))

  g = jax.jit(jax.grad(loss(layers.causal_attention), (0, 1, 2)))(q, k, v)
  g0 = jax.jit(jax.grad(loss(dense_attention), (0, 1, 2)))(q, k, v)
  chex.assert_trees_all_close(g, g0, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------- attention implementations
def _qkv(t, heads=3, d=8, batch=2, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  return tuple(jax.random.normal(a, (batch, t, heads, d)) for a in ks)


def _materialized(q, k, v):
  """Today's value path on ``[B, T, H, D]``: ``causal_attention`` over heads-first arrays."""
  sw = lambda a: jnp.swapaxes(a, -3, -2)
  return sw(layers.causal_attention(sw(q), sw(k), sw(v))[0])


def _value_and_grads(f, q, k, v):
  loss = lambda *a: jnp.sum(jnp.sin(f(*a)))
  return jax.jit(f)(q, k, v), jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("t,chunk", [(12, 256), (200, 256), (37, 8), (64, 16)])
def test_xla_attention_equals_materialized(t, chunk, monkeypatch):
  """``xla_attention`` (jax.nn.dot_product_attention, XLA) against the materialised form:
  values and gradients to 1e-5 in float32, one call (T <= 2 chunks) and the ``lax.map`` chunks (a small ``ATTN_CHUNK``; T = 37 pads its last chunk)."""
  monkeypatch.setattr(layers, "ATTN_CHUNK", chunk)
  q, k, v = _qkv(t)
  (y, g), (y0, g0) = (_value_and_grads(f, q, k, v) for f in (layers.xla_attention, _materialized))
  chex.assert_trees_all_close((y, g), (y0, g0), atol=1e-5, rtol=1e-5)


def test_causal_logit_max_is_the_materialized_one(monkeypatch):
  monkeypatch.setattr(layers, "ATTN_CHUNK", 16)
  q, k, v = _qkv(40)
  sw = lambda a: jnp.swapaxes(a, -3, -2)
  m0 = layers.causal_attention(sw(q), sw(k), sw(v))[1]
  np.testing.assert_allclose(layers.causal_logit_max(q, k), m0, rtol=1e-6)
  assert jax.grad(lambda q: layers.causal_logit_max(q, k))(q).sum() == 0  # no gradient


def _attention_outputs(impl, x, heads, logit_max=True, value_fn=None, **kw):
  m = layers.Attention(heads, implementation=impl, logit_max=logit_max, **kw)
  params = m.init(jax.random.PRNGKey(1), x)

  def loss(p, x):
    y, _ = m.apply(p, x, value_fn)
    return jnp.sum(jnp.sin(y))

  y, lm = jax.jit(lambda p, x: m.apply(p, x, value_fn))(params, x)
  return (y, lm), jax.jit(jax.grad(loss, (0, 1)))(params, x)


@pytest.mark.parametrize(
  "heads,kw", [(1, {}), (2, {"qk_norm": True}), (4, {"use_rope": False}), (2, {"value_fn": 1})]
)
def test_attention_module_xla_equals_materialized(heads, kw):
  """The module with ``model.attention: xla`` against today's materialised attention: the same
  outputs, logit maximum and gradients (parameters and input) to 1e-5 in float32, for the
  head counts, qk-norm, RoPE on and off, and a value-residual mixer's ``value_fn`` hook."""
  kw = dict(kw)
  if kw.pop("value_fn", None):
    v1 = jax.random.normal(jax.random.PRNGKey(5), (2, 24, heads, 16 // heads))
    kw["value_fn"] = lambda v: 0.5 * v + 0.5 * v1
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 24, 16))
  got, want = (_attention_outputs(i, x, heads, **kw) for i in ("xla", "materialized"))
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
  (_, lm), _ = _attention_outputs("xla", x, heads, logit_max=False, **kw)
  assert lm is None  # not a diagnostic step: no separate score product


def test_attention_sows_probabilities_apart_from_the_value_path():
  m = layers.Attention(2, implementation="xla")
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 10, 8))
  params = m.init(jax.random.PRNGKey(1), x)
  (y, _), st = m.apply(params, x, mutable=["intermediates"])
  p = st["intermediates"]["attn"][0]
  assert p.shape == (2, 2, 10, 10)
  np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)
  assert float(jnp.max(jnp.abs(jnp.triu(p, 1)))) == 0.0
  np.testing.assert_allclose(y, m.apply(params, x)[0], rtol=1e-6, atol=1e-6)


def test_forced_and_unknown_attention():
  assert layers.resolve_attention("cudnn", jnp.float32, 64) == "cudnn"
  with pytest.raises(ValueError, match="unknown attention"):
    layers.resolve_attention("flash", jnp.float32, 64)


class _Dev:
  def __init__(self, platform, kind):
    self.platform, self.device_kind = platform, kind


@pytest.mark.parametrize(
  "platform, kind, dtype, seq_len, want",
  [  # docs/performance.md: measured on the 2-core CPU, and cuDNN on NVIDIA GPUs
    ("cpu", "cpu", jnp.float32, 256, "materialized"),
    ("cpu", "cpu", jnp.bfloat16, 1024, "materialized"),
    ("cpu", "cpu", jnp.float32, 1025, "xla"),
    ("cpu", "cpu", jnp.float32, None, "materialized"),
    ("gpu", "NVIDIA H200", jnp.bfloat16, 4096, "cudnn"),
    ("gpu", "NVIDIA H200", jnp.float32, 256, "xla"),
    ("tpu", "TPU v5 lite", jnp.bfloat16, 256, "xla"),
  ],
)
def test_auto_attention_per_backend_and_length(monkeypatch, platform, kind, dtype, seq_len, want):
  monkeypatch.setattr(jax, "devices", lambda *a: [_Dev(platform, kind)])
  assert layers.resolve_attention("auto", dtype, 64, seq_len) == want
  assert layers.CPU_MATERIALIZED_MAX_T == 1024


def test_auto_attention_in_the_model_follows_the_length(monkeypatch):
  seen = []
  real = layers.resolve_attention
  monkeypatch.setattr(layers, "resolve_attention", lambda *a: seen.append(real(*a)) or seen[-1])
  monkeypatch.setattr(layers, "CPU_MATERIALIZED_MAX_T", 8)
  m = layers.Attention(heads=2)
  for t in (8, 9):
    x = jnp.ones((1, t, 8))
    m.apply(m.init(jax.random.PRNGKey(0), x), x)
  assert seen == ["materialized"] * 2 + ["xla"] * 2  # init and apply at 8, then at 9 tokens


def _attention_temp_bytes(f, t, batch=2, heads=4, d=32) -> int:
  x = jax.ShapeDtypeStruct((batch, t, heads, d), jnp.float32)
  fb = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))), (0, 1, 2))
  return jax.jit(fb).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes


def test_xla_attention_memory_grows_linearly_not_as_t_squared():
  """The compiled forward + backward's temporary memory (XLA's memory analysis) at four times
  the tokens. Measured (2 x 4 heads x 32, float32): the materialised form 4.8 -> 75 MiB from
  T = 256 to 1024 (15.7x) and 75 -> 1,164 MiB to 4096 (15.5x): T^2; ``xla_attention`` 5.5 ->
  37 MiB (6.8x: up to 512 tokens it takes the unrolled chunks) and 37 -> 148 MiB (4.0x:
  linear)."""
  xla = {t: _attention_temp_bytes(layers.xla_attention, t) for t in (256, 1024, 4096)}
  mat = {t: _attention_temp_bytes(_materialized, t) for t in (256, 1024)}
  assert mat[1024] / mat[256] > 12  # the reference does grow as T^2 here
  assert xla[1024] / xla[256] < 8
  assert xla[4096] / xla[1024] < 4.5
  assert xla[4096] < 0.2 * 16 * mat[1024]


@pytest.mark.parametrize("mixer,opts", [("mhc", {"n": 2}), ("value_residual", {})])
def test_model_attention_choice_keeps_values_gradients_and_logit_max(mixer, opts):
  """The whole model with ``model.attention: xla`` (the CPU's ``auto``) against
  ``materialized``: logits, ``attn_logit_max`` and parameter gradients to 1e-5 (float32)."""
  from mhc_jax.model import Transformer
  from mhc_jax.train.config import ModelConfig

  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 20), 0, 13)

  def run(attention):
    cfg = ModelConfig(
      vocab=13, depth=2, width=16, heads=2, mixer=mixer, mixer_options=opts, attention=attention
    )
    model = Transformer(cfg)
    params = model.init(jax.random.PRNGKey(1), tokens)
    logits, aux = jax.jit(model.apply)(params, tokens)
    loss = lambda p: jnp.mean(jax.nn.logsumexp(model.apply(p, tokens, stats=False)[0], -1))
    return logits, aux["attn_logit_max"], jax.jit(jax.grad(loss))(params)

  chex.assert_trees_all_close(run("xla"), run("materialized"), atol=1e-5, rtol=1e-5)
