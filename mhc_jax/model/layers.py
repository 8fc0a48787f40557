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


def _kernel(scale: float, axes: tuple):
  """:func:`kernel_init` with the kernel's logical axes."""
  return nn.with_logical_partitioning(kernel_init(scale), axes)


class RMSNorm(nn.Module):
  """``x / rms(x) * scale``, computed in float32, returned in ``dtype``."""

  dtype: Dtype = jnp.float32
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    init = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
    scale = self.param("scale", init, (x.shape[-1],), jnp.float32)
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


def causal_attention(q_BHTD, k_BHSD, v_BHSD, with_probs=False, dtype=jnp.float32):
  """Causal softmax attention with the ``[T, T]`` scores materialised: ``(y_BHTD, max causal
  pre-softmax logit, probs_BHTS or None)``. Scores, softmax and the logit maximum are float32;
  ``with_probs`` returns the ``[B, H, T, T]`` probabilities (zeros above the diagonal)."""
  t, d = q_BHTD.shape[-2], q_BHTD.shape[-1]
  logits = jnp.einsum("...htd,...hsd->...hts", q_BHTD, k_BHSD).astype(jnp.float32) / math.sqrt(d)
  causal = jnp.tril(jnp.ones((t, t), bool))
  logit_max = jnp.max(jnp.where(causal, logits, -jnp.inf))
  p = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1)
  y = jnp.einsum("...hts,...hsd->...htd", p.astype(dtype), v_BHSD)
  return y, logit_max, p if with_probs else None


ATTENTION = ("auto", "xla", "cudnn", "materialized")  # model.attention's choices

# The "xla" value path: queries per chunk of ``jax.lax.map`` for sequences longer than twice this
# (see ``xla_attention``).
ATTN_CHUNK = 256


CPU_MATERIALIZED_MAX_T = 1024  # auto on a CPU: materialized up to here (docs/performance.md)


def auto_attention(dtype, head_dim: int, seq_len: int | None = None) -> str:
  """What ``model.attention: auto`` resolves to on this process's default backend: ``cudnn`` on
  an NVIDIA GPU in bfloat16/float16 with a head dim a multiple of 8 up to 128; on a CPU
  ``materialized`` up to ``CPU_MATERIALIZED_MAX_T`` tokens (``seq_len`` None: short); else ``xla``
  (docs/performance.md)."""
  dev = jax.devices()[0]
  nvidia = dev.platform in ("gpu", "cuda") and "nvidia" in dev.device_kind.lower()
  half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  if nvidia and half and head_dim % 8 == 0 and head_dim <= 128:
    return "cudnn"
  short = dev.platform == "cpu" and (seq_len or 0) <= CPU_MATERIALIZED_MAX_T
  return "materialized" if short else "xla"


def resolve_attention(name: str, dtype, head_dim: int, seq_len: int | None = None) -> str:
  """``name`` (one of ``ATTENTION``) with ``auto`` replaced by ``auto_attention``."""
  if name not in ATTENTION:
    raise ValueError(f"unknown attention {name!r}; known: {', '.join(ATTENTION)}")
  return auto_attention(dtype, head_dim, seq_len) if name == "auto" else name


def _dpa_xla(q, k, v, q0: int | jax.Array):
  """``jax.nn.dot_product_attention`` (XLA) of queries at positions ``q0 + i`` against keys
  ``0..S-1``: causal for any query offset (``is_causal`` alone aligns query 0 with key 0)."""
  tq, s = q.shape[1], k.shape[1]
  mask = (q0 + jnp.arange(tq))[:, None] >= jnp.arange(s)[None, :]
  return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None], implementation="xla")


def xla_attention(q_BTHD, k_BTHD, v_BTHD):
  """Causal attention through ``jax.nn.dot_product_attention(implementation="xla")``, ``[..., T,
  H, D]`` in and out, the heads folded into the batch (``[B*H, T, 1, D]``: 1.4x faster on XLA's
  CPU, ``benchmarks/layer_bench.py``). Beyond ``2 * ATTN_CHUNK`` tokens, chunks of
  ``ATTN_CHUNK`` queries through ``jax.lax.map``, each rematerialised in the backward, so memory
  grows linearly in T (docs/performance.md); the outputs are those of the dense form."""
  *lead, t, h, d = q_BTHD.shape

  def fold(a):  # [..., T, H, D] -> [N*H, T, 1, D]
    a = jnp.swapaxes(a.reshape(-1, t, h, d), 1, 2)
    return a.reshape(-1, t, 1, d)

  q, k, v = fold(q_BTHD), fold(k_BTHD), fold(v_BTHD)
  if t <= 2 * ATTN_CHUNK:
    y = _dpa_xla(q, k, v, 0)
  else:
    c = ATTN_CHUNK
    n = -(-t // c)
    q = jnp.pad(q, [(0, 0), (0, n * c - t), (0, 0), (0, 0)])  # padded queries: sliced off below
    q_nXc = jnp.swapaxes(q.reshape(q.shape[0], n, c, 1, d), 0, 1)

    @jax.checkpoint
    def one(args):
      i, q_c = args
      return _dpa_xla(q_c, k, v, i * c)

    y = jax.lax.map(one, (jnp.arange(n), q_nXc))
    y = jnp.swapaxes(y, 0, 1).reshape(-1, n * c, 1, d)[:, :t]
  y = jnp.swapaxes(y.reshape(-1, h, t, d), 1, 2)
  return y.reshape(*lead, t, h, d)


def causal_logit_max(q_BTHD, k_BTHD) -> jax.Array:
  """The largest causal pre-softmax logit ``q·k / sqrt(D)`` (float32, no gradient), computed in
  query chunks of ``ATTN_CHUNK`` that each score only the keys up to their last query; under
  ``jit`` XLA frees each chunk's scores once reduced. Only diagnostic steps compute it."""
  q, k = (jax.lax.stop_gradient(jnp.swapaxes(a, -3, -2)) for a in (q_BTHD, k_BTHD))
  t, d = q.shape[-2], q.shape[-1]
  maxes = []
  for s0 in range(0, t, ATTN_CHUNK):
    e = min(s0 + ATTN_CHUNK, t)
    s = jnp.einsum(
      "...htd,...hsd->...hts", q[..., s0:e, :], k[..., :e, :], preferred_element_type=jnp.float32
    )
    causal = jnp.arange(s0, e)[:, None] >= jnp.arange(e)[None, :]
    maxes.append(jnp.max(jnp.where(causal, s, -jnp.inf)))
  return jnp.max(jnp.stack(maxes)) / math.sqrt(d)


class Attention(nn.Module):
  """Causal multi-head self-attention. Returns ``(y_BTC, max pre-softmax logit or None)``.

  ``implementation`` (``model.attention``): ``xla`` (:func:`xla_attention`), ``cudnn`` (cuDNN's
  fused flash attention), ``materialized`` (:func:`causal_attention`, the ``[T, T]`` scores) or
  ``auto`` (:func:`auto_attention`); docs/performance.md. ``logit_max``: also return
  :func:`causal_logit_max` (diagnostic steps only). When ``intermediates`` is mutable (probes,
  evaluation) the ``[B, H, T, T]`` probabilities are sown as ``attn``, apart from the value path.
  """

  heads: int
  use_rope: bool = True
  qk_norm: bool = False
  dtype: Dtype = jnp.float32
  out_scale: float = 1.0
  init_scale: float = 1.0
  implementation: str = "auto"
  logit_max: bool = True
  q_scale: float = 1.0  # on the queries after the probes read them (µP's 1/head_dim attention)

  @nn.compact
  def __call__(self, x_BTC, value_fn=None):
    """``value_fn`` (from a value-residual mixer) maps the values ``[B, T, H, D]`` before use."""
    *lead, c = x_BTC.shape
    d = c // self.heads
    x_NC = x_BTC.reshape(-1, c)  # tokens flattened: see MLP

    def proj(name):
      init = _kernel(self.init_scale, ("embed", "heads", "kv"))
      dense = nn.DenseGeneral(
        (self.heads, d), use_bias=False, dtype=self.dtype, name=name, kernel_init=init
      )
      return dense(x_NC).reshape(*lead, self.heads, d)

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
    if self.q_scale != 1.0:
      q = q * jnp.asarray(self.q_scale, q.dtype)
    impl = resolve_attention(self.implementation, self.dtype, d, q.shape[-3])
    swap = lambda a: jnp.swapaxes(a, -3, -2)  # [B, T, H, D] <-> [B, H, T, D]
    if impl == "materialized":
      y_BTHD = swap(causal_attention(swap(q), swap(k), swap(v), False, self.dtype)[0])
    elif impl == "xla":
      y_BTHD = xla_attention(q, k, v)
    else:  # cudnn: [B, T, H, D] is its layout; leading axes beyond B folded into B
      t = q.shape[-3]
      q4, k4, v4 = (a.reshape((-1, t, self.heads, d)) for a in (q, k, v))
      y_BTHD = jax.nn.dot_product_attention(q4, k4, v4, is_causal=True, implementation="cudnn")
      y_BTHD = y_BTHD.reshape(q.shape)
    if self.is_mutable_collection("intermediates"):  # probes: the full T x T, apart
      q_, k_, v_ = (swap(jax.lax.stop_gradient(a)) for a in (q, k, v))
      _, _, probs = causal_attention(q_, k_, v_, True, self.dtype)
      self.sow("intermediates", "attn", probs)
    y_NHD = y_BTHD.reshape((-1,) + y_BTHD.shape[-2:])
    init = _kernel(self.init_scale * self.out_scale, ("heads", "kv", "embed"))
    out = nn.DenseGeneral(
      c, axis=(-2, -1), use_bias=False, dtype=self.dtype, name="out", kernel_init=init
    )(y_NHD)
    logit_max = causal_logit_max(q, k) if self.logit_max else None
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

    def dense(features, name, scale, axes):
      init = _kernel(scale, axes)
      return nn.Dense(features, use_bias=False, dtype=self.dtype, name=name, kernel_init=init)

    h = nn.gelu(dense(self.hidden, "up", self.init_scale, ("embed", "mlp"))(x_NC))
    down = dense(c, "down", self.init_scale * self.out_scale, ("mlp", "embed"))
    return down(h).reshape(x_BTC.shape)
