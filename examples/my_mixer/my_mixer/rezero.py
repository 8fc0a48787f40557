"""ReZero (Bachlechner et al., "ReZero is All You Need", arXiv:2003.04887): ``x' = x + α F(x)``
with one learned scalar ``α`` per layer, initialised to 0, so every layer starts as the identity.

The paper drops the sublayer's norm; here the model's pre-norm stays (``pre_norm`` is inherited).
One stream, ``H_res = I`` (so it may claim ``doubly_stochastic``), ``H_post = α``.
"""

import flax.linen as nn
import jax.numpy as jnp

from mhc_jax.mixers import Mixer
from mhc_jax.mixers.base import make_stats, param


class ReZero(Mixer):
  n: int = 1
  alpha_init: float = 0.0
  doubly_stochastic = True  # H_res = I
  param_roles = {"alpha": "scalar"}  # a gate: its lr does not scale with width (mup, completep)

  def layer_params(self, width: int) -> int:
    return 1  # α

  @nn.compact
  def __call__(self, x_BTnC, sublayer, layer=0):
    alpha = param(self, "alpha", nn.initializers.constant(self.alpha_init), (), ())
    f_BTC = sublayer(x_BTnC[..., 0, :])
    out = x_BTnC + (alpha * f_BTC)[..., None, :].astype(x_BTnC.dtype)
    one = jnp.ones((1,), jnp.float32)
    return out, make_stats(x_BTnC, out, f_BTC, jnp.eye(1), one, alpha[None])
