"""The baseline: a pre-norm residual ``x + F(norm(x))`` (the norm lives inside ``sublayer``)."""

import jax.numpy as jnp

from mhc_jax.mixers.base import Mixer, make_stats
from mhc_jax.mixers.peri_ln import single_stream


class Residual(Mixer):
  """One stream, identity mixing: ``h_res = I``, ``h_pre = h_post = 1``."""

  n: int = 1
  doubly_stochastic = True  # H_res = I
  param_roles = {}

  def layer_params(self, width: int) -> int:
    return 0

  def __call__(self, x_BTnC, sublayer, layer=0):
    f_BTC = sublayer(single_stream("residual", x_BTnC))
    out = x_BTnC + f_BTC[..., None, :].astype(x_BTnC.dtype)
    one = jnp.ones((1,), jnp.float32)
    return out, make_stats(x_BTnC, out, f_BTC, jnp.eye(1), one, one)
