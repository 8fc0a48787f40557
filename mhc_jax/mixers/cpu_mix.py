"""The CPU kernel of the stream mix and read, selected by ``mixers.base.MIX_KERNEL``.

The same functions as ``mixers.base``'s einsums, ``x' = H_res x + H_postᵀ F`` and ``H_pre x``,
with the stream sums written out term by term and the gradients written by hand. Autodiff of the
einsums gives XLA's CPU backend tiny batched dots per token, and of the written-out sums one
reduction per (i, j) pair; this form ran the mix 2-3x faster on the CPU
(``benchmarks/layer_bench.py``). On accelerators the einsums are used. ``tests/test_mixers.py``
holds both forms equal, values and gradients, to float32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

UNROLL_STREAMS = 8  # up to this many streams, stream sums are written out


def stream_sum(w, x):
  """``Σ_j w[..., j] x[..., j, :]``: ``w [..., n]`` (may lack the token axes), ``x [..., n, C]``.

  For small ``n`` the sum is written out, which XLA fuses into one elementwise pass.
  """
  n = x.shape[-2]
  if n > UNROLL_STREAMS:
    return jnp.einsum("...j,...jc->...c", w, x)
  out = w[..., 0, None] * x[..., 0, :]
  for j in range(1, n):
    out = out + w[..., j, None] * x[..., j, :]
  return out


def _unbroadcast(d, shape):
  """Sum the cotangent ``d`` down to ``shape`` (the leading axes a coefficient broadcast over)."""
  extra = d.ndim - len(shape)
  d = d.sum(axis=tuple(range(extra))) if extra else d
  keep = tuple(i for i, s in enumerate(shape) if s == 1 and d.shape[i] != 1)
  return d.sum(axis=keep, keepdims=True) if keep else d


@jax.custom_vjp
def mix(x, f, h, hp):
  """``H_res x + H_postᵀ f`` (float32 inputs; coefficients may carry token axes)."""
  return stream_sum(h, x[..., None, :, :]) + hp[..., :, None] * f[..., None, :]


def _mix_fwd(x, f, h, hp):
  return mix(x, f, h, hp), (x, f, h, hp)


def _mix_bwd(res, g):
  x, f, h, hp = res
  dx = stream_sum(jnp.swapaxes(h, -1, -2), g[..., None, :, :])  # Hᵀ g
  dh = jnp.einsum("...ic,...jc->...ij", g, x)
  dhp = jnp.einsum("...ic,...c->...i", g, f)
  df = stream_sum(hp, g)
  shapes = (x.shape, f.shape, h.shape, hp.shape)
  return tuple(_unbroadcast(d, s) for d, s in zip((dx, df, dh, dhp), shapes))


mix.defvjp(_mix_fwd, _mix_bwd)


@jax.custom_vjp
def read(x, hp):
  """``H_pre x``: the streams' weighted sum (float32 inputs)."""
  return stream_sum(hp, x)


def _read_fwd(x, hp):
  return read(x, hp), (x, hp)


def _read_bwd(res, g):
  x, hp = res
  dx = hp[..., :, None] * g[..., None, :]
  dhp = jnp.einsum("...ic,...c->...i", x, g)
  return _unbroadcast(dx, x.shape), _unbroadcast(dhp, hp.shape)


read.defvjp(_read_fwd, _read_bwd)
