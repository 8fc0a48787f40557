"""Transformer building blocks with logical axis names (no mesh axis is named here).

Logical axes: ``embed`` (C), ``mlp`` (hidden), ``heads``, ``kv`` (head dim), ``vocab``,
``layers`` (added by the scan), ``streams`` (mixers). A rules table in ``train/sharding.py``
maps them to mesh axes.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

Dtype = jnp.dtype


def kernel_init(scale: float = 1.0):
  """LeCun-normal (std = scale / sqrt(fan_in)) over the input axes of a DenseGeneral kernel."""
  return nn.initializers.variance_scaling(scale**2, "fan_in", "normal")


class RMSNorm(nn.Module):
  """``x / rms(x) * scale``, computed in float32, returned in ``dtype``."""

  dtype: Dtype = jnp.float32
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    scale = self.param(
      "scale",
      nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
      (x.shape[-1],),
      jnp.float32,
    )
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + self.eps)
    return (y * scale).astype(self.dtype)


def rope(x_BTHD: jax.Array, base: float = 10000.0) -> jax.Array:
  """Rotary position embedding over the last axis (rotate-half convention)."""
  t, d = x_BTHD.shape[-3], x_BTHD.shape[-1]
  inv = 1.0 / base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]  # [T, D/2]
  cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]  # [T, 1, D/2]
  x1, x2 = jnp.split(x_BTHD.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x_BTHD.dtype)


def query_chunk(t: int) -> int:
  """Queries per chunk in ``causal_attention`` for a sequence of ``t``: two chunks from 128 on.

  In the whole train step (benchmarks/step_bench.py, T = 256) two chunks made the residual
  step about 3% faster; more, smaller chunks made it slower (more ops, and the key and value
  gradients of overlapping slices summed), although attention alone ran faster with them.
  """
  return t if t < 128 else -(-t // 2)


def causal_attention(q_BHTD, k_BHSD, v_BHSD, chunk=None, with_probs=False, dtype=jnp.float32):
  """Causal softmax attention, ``(y_BHTD, max causal pre-softmax logit, probs_BHTS or None)``.

  Queries go in chunks of ``chunk`` (None: one chunk); each chunk scores only the keys up to its
  last query, so the masked upper triangle is mostly never computed. Scores, softmax and the
  logit maximum are float32. The dropped keys would get probability exactly 0, so the outputs
  are those of the dense form; the chunked reductions may round differently in the last digits.
  ``with_probs`` assembles the full ``[B, H, T, T]`` probabilities (zeros above the diagonal).
  """
  t, d = q_BHTD.shape[-2], q_BHTD.shape[-1]
  chunk = t if chunk is None else chunk
  ys, maxes, probs = [], [], []
  for s0 in range(0, t, chunk):
    e = min(s0 + chunk, t)
    logits = jnp.einsum("...htd,...hsd->...hts", q_BHTD[..., s0:e, :], k_BHSD[..., :e, :])
    logits = logits.astype(jnp.float32) / math.sqrt(d)
    causal = jnp.arange(s0, e)[:, None] >= jnp.arange(e)[None, :]
    maxes.append(jnp.max(jnp.where(causal, logits, -jnp.inf)))
    p = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1)
    ys.append(jnp.einsum("...hts,...hsd->...htd", p.astype(dtype), v_BHSD[..., :e, :]))
    if with_probs:
      probs.append(jnp.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, t - e)]))
  cat = lambda a: a[0] if len(a) == 1 else jnp.concatenate(a, axis=-2)
  return cat(ys), jnp.max(jnp.stack(maxes)), cat(probs) if with_probs else None


class Attention(nn.Module):
  """Causal multi-head self-attention. Returns ``(y_BTC, max pre-softmax logit)``."""

  heads: int
  use_rope: bool = True
  qk_norm: bool = False
  dtype: Dtype = jnp.float32
  out_scale: float = 1.0
  init_scale: float = 1.0

  @nn.compact
  def __call__(self, x_BTC, value_fn=None):
    """``value_fn`` (from a value-residual mixer) maps the values ``[B, T, H, D]`` before use."""
    *lead, c = x_BTC.shape
    d = c // self.heads
    x_NC = x_BTC.reshape(-1, c)  # tokens flattened: see MLP

    def proj(name):
      return nn.DenseGeneral(
        (self.heads, d),
        use_bias=False,
        dtype=self.dtype,
        name=name,
        kernel_init=nn.with_logical_partitioning(
          kernel_init(self.init_scale), ("embed", "heads", "kv")
        ),
      )(x_NC).reshape(*lead, self.heads, d)

    q, k, v = proj("query"), proj("key"), proj("value")  # [B,T,H,D]
    if value_fn is not None:
      v = value_fn(v)
    if self.qk_norm:
      q = RMSNorm(self.dtype, name="q_norm")(q)
      k = RMSNorm(self.dtype, name="k_norm")(k)
    # probes read q and k before RoPE too (the rotation is a function of position, not content)
    self.sow("intermediates", "q_pre_rope", q)
    self.sow("intermediates", "k_pre_rope", k)
    if self.use_rope:
      q, k = rope(q), rope(k)
    self.sow("intermediates", "q", q)
    self.sow("intermediates", "k", k)
    # Heads before time ([B, H, T, D]) for the two score products: batched matmuls whose batch
    # axes lead, which XLA's CPU dots ran 1.38x faster (fwd + bwd) than the same einsums over
    # [B, T, H, D] (benchmarks/layer_bench.py); the same forward, gradients equal to rounding.
    q_BHTD, k_BHSD, v_BHSD = (jnp.swapaxes(a, -3, -2) for a in (q, k, v))
    keep_probs = self.is_mutable_collection("intermediates")  # the full T x T only when sown
    y_BHTD, logit_max, probs = causal_attention(
      q_BHTD, k_BHSD, v_BHSD, query_chunk(q.shape[-3]), keep_probs, self.dtype
    )
    if keep_probs:
      self.sow("intermediates", "attn", probs)
    y_BTHD = jnp.swapaxes(y_BHTD, -3, -2)
    y_NHD = y_BTHD.reshape((-1,) + y_BTHD.shape[-2:])
    out = nn.DenseGeneral(
      c,
      axis=(-2, -1),
      use_bias=False,
      dtype=self.dtype,
      name="out",
      kernel_init=nn.with_logical_partitioning(
        kernel_init(self.init_scale * self.out_scale), ("heads", "kv", "embed")
      ),
    )(y_NHD)
    return out.reshape(x_BTC.shape), logit_max


class MLP(nn.Module):
  """Two-layer GELU MLP ``C -> hidden -> C``."""

  hidden: int
  dtype: Dtype = jnp.float32
  out_scale: float = 1.0
  init_scale: float = 1.0

  @nn.compact
  def __call__(self, x_BTC):
    c = x_BTC.shape[-1]
    # Tokens flattened to one axis: XLA's CPU backward of a dense layer over [B, T, C] (weight
    # gradient contracting two axes) ran 2.4x slower than over [B*T, C] (benchmarks/layer_bench.py).
    x_NC = x_BTC.reshape(-1, c)
    h = nn.Dense(
      self.hidden,
      use_bias=False,
      dtype=self.dtype,
      name="up",
      kernel_init=nn.with_logical_partitioning(kernel_init(self.init_scale), ("embed", "mlp")),
    )(x_NC)
    h = nn.gelu(h)
    return nn.Dense(
      c,
      use_bias=False,
      dtype=self.dtype,
      name="down",
      kernel_init=nn.with_logical_partitioning(
        kernel_init(self.init_scale * self.out_scale), ("mlp", "embed")
      ),
    )(h).reshape(x_BTC.shape)
