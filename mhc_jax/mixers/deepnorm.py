"""DeepNorm (Wang et al., DeepNet, arXiv:2203.00555) and plain Post-LN: the norm after the add.

Layer: ``x' = N(α x + G(x))`` with ``G`` the attention or MLP sublayer on the *un-normed*
stream (``pre_norm = False``: the model puts no norm in front of the sublayer) and ``N`` a
learnable RMSNorm owned by this mixer (scale ``norm_scale [C]``, ones at init; DeepNet uses
LayerNorm, this codebase uses RMSNorm everywhere). The model's final norm still follows the
collapse (a second norm on an already normed stream: harmless, one more learned scale).

Constants for a decoder-only model (DeepNet, Table 1 / its torchscale reference): with ``N`` the
number of *blocks* (attention + FFN, the paper's "layers"; the 2 in ``2N`` counts the two
sublayers per block) ``α = (2N)^{1/4}`` and ``β = (8N)^{-1/4}``. The model calls its blocks
``L`` and has ``2L`` mixer layers (``self.layers``), so here ``α = (2L)^{1/4} = layers^{1/4}``
and ``β = (8L)^{-1/4} = (4·layers)^{-1/4}``.

Options, initialisation and state in detail: docs/mixers.md ("Mixer notes", ``deepnorm``).
"""

from typing import Optional

import flax.linen as nn
import jax.numpy as jnp

from mhc_jax.mixers.base import Mixer
from mhc_jax.mixers.peri_ln import learned_rms_norm, single_stream, stream_stats


class DeepNorm(Mixer):
  n: int = 1
  alpha: Optional[float] = None  # None: (2L)^{1/4}
  beta: Optional[float] = None  # None: (8L)^{-1/4}
  eps: float = 1e-6
  multi_stream = False
  pre_norm = False
  param_roles = {"norm_scale": "res"}  # a post-norm gain scales the stream

  def layer_params(self, width: int) -> int:
    return width  # the post-norm's scale

  def residual_scale(self) -> float:
    """``α``: DeepNet's ``(2L)^{1/4}`` from the model's ``2L`` mixer layers, unless given."""
    if self.alpha is not None:
      return float(self.alpha)
    if self.layers <= 0:
      raise ValueError(
        f"{type(self).__name__}: alpha=None needs the model's mixer-layer count "
        f"(layers), got layers={self.layers}"
      )
    return float(self.layers) ** 0.25

  def sublayer_out_scale(self, layers: int) -> float:
    """``β``: DeepNet's ``(8L)^{-1/4}`` for ``layers = 2L`` mixer layers, unless given."""
    return float(4 * layers) ** -0.25 if self.beta is None else float(self.beta)

  @nn.compact
  def __call__(self, x_BTnC, sublayer, layer=0):
    x = single_stream("deepnorm", x_BTnC)
    g_BTC = sublayer(x)
    h = self.residual_scale() * x.astype(jnp.float32) + g_BTC.astype(jnp.float32)
    out = learned_rms_norm(self, h, eps=self.eps)[..., None, :].astype(x_BTnC.dtype)
    return out, stream_stats(x_BTnC, out, g_BTC)


class PostLN(DeepNorm):
  """Plain Post-LN: DeepNorm with ``alpha = beta = 1``."""

  alpha: Optional[float] = 1.0
  beta: Optional[float] = 1.0
