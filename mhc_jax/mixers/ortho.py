"""Orthogonal residual update (Oh et al., arXiv:2505.11881): only the new direction is added.

Layer: ``x' = x + f_⊥``, ``f_⊥ = f - (<x, f> / (‖x‖² + eps)) x`` with ``f = F(norm(x))`` the
pre-norm sublayer output: the component of the update along the current stream is removed, so
a layer can rotate the stream and add new directions but cannot rescale it.

The paper has two projections: per token over the channels ("Orthogonal-F", feature-wise, what
it uses for Transformers, and the default of its reference LLaMA code) and over a whole sample's
flattened features ("Orthogonal-G", for convolutions). Here only the per-token, over-channels
form is offered: the global form would sum over the time axis and leak future tokens into
earlier positions of a causal language model.

Options: ``eps`` (default 1e-6, the reference code's value, added to ‖x‖²; the reference adds it
rather than clamping for this "feature" form). The inner products are taken in float32.
State: one stream ``[B, T, 1, C]``; ``branch_rms`` is the RMS of the full sublayer output ``f``.
"""

import flax.linen as nn
import jax.numpy as jnp

from mhc_jax.mixers.base import Mixer
from mhc_jax.mixers.peri_ln import single_stream, stream_stats


def orthogonal_part(x, f, eps: float):
  """``f - (<x, f> / (‖x‖² + eps)) x`` per token (last axis), in float32."""
  x, f = x.astype(jnp.float32), f.astype(jnp.float32)
  dot = jnp.sum(x * f, axis=-1, keepdims=True)
  return f - dot / (jnp.sum(x * x, axis=-1, keepdims=True) + eps) * x


class Ortho(Mixer):
  n: int = 1
  eps: float = 1e-6
  multi_stream = False
  param_roles = {}

  def layer_params(self, width: int) -> int:
    return 0

  @nn.compact
  def __call__(self, x_BTnC, sublayer, layer=0):
    x = single_stream("ortho", x_BTnC)
    f_BTC = sublayer(x)
    out = x.astype(jnp.float32) + orthogonal_part(x, f_BTC, self.eps)
    out = out[..., None, :].astype(x_BTnC.dtype)
    return out, stream_stats(x_BTnC, out, f_BTC)
