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
    logits = jnp.einsum("...htd,...hsd->...hts", q_BHTD, k_BHSD).astype(jnp.float32) / math.sqrt(d)
    t = x_BTC.shape[-2]
    causal = jnp.tril(jnp.ones((t, t), bool))
    logits = jnp.where(causal, logits, -1e30)
    logit_max = jnp.max(jnp.where(causal, logits, -jnp.inf))
    probs = jax.nn.softmax(logits, axis=-1)
    self.sow("intermediates", "attn", probs)
    y_BHTD = jnp.einsum("...hts,...hsd->...htd", probs.astype(self.dtype), v_BHSD)
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
