"""The baseline: a pre-norm residual ``x + F(norm(x))`` (the norm lives inside ``sublayer``)."""

import jax.numpy as jnp

from mhc_jax.mixers.base import Mixer, make_stats


class Residual(Mixer):
  """One stream, identity mixing: ``h_res = I``, ``h_pre = h_post = 1``."""

  n: int = 1
  doubly_stochastic = True  # H_res = I
  param_roles = {}

  def layer_params(self, width: int) -> int:
    return 0

  def __call__(self, x_BTnC, sublayer, layer=0):
    if x_BTnC.shape[-2] != 1:
      raise ValueError(f"residual: expects 1 stream, got state with n={x_BTnC.shape[-2]}")
    f_BTC = sublayer(x_BTnC[..., 0, :])
    out = x_BTnC + f_BTC[..., None, :].astype(x_BTnC.dtype)
    one = jnp.ones((1,), jnp.float32)
    return out, make_stats(x_BTnC, out, f_BTC, jnp.eye(1), one, one)
