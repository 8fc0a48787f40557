"""Frac-Connections (Zhu et al., arXiv:2503.14125): Hyper-Connections on fractions of the width.

Instead of widening the residual to n copies of ``h ∈ R^C`` (HC, expansion rate n >= 1), split it
into ``m`` fractions (expansion rate 1/m): ``H = Reshape(h, (m, C/m))``, rows ``h_1..h_m``. The
state is ``[B, T, m, C/m]`` (the same memory as a plain residual); ``expand`` and the collapse
are that reshape and its inverse (concatenation of the fractions), with no parameters. The
connection matrix is HC's with the read widened from a vector to a matrix,

    FC = [[0_{1×m}, B], [Γ, A]] ∈ R^{(m+1)×2m},   B ∈ R^{1×m},  Γ, A ∈ R^{m×m},

and the layer is HC's rule applied to fractions, ``H' = Bᵀ ∘ F(Γᵀ H) + Aᵀ H``:

    u_i  = Σ_j Γ_{j,i} h_j                      (sublayer input, fraction i; input = concat u)
    h'_i = Σ_j A_{j,i} h_j + B_i · F(concat u)_i   (F's output split into the same m fractions)

Options, initialisation and state in detail: docs/mixers.md ("Mixer notes", ``frac``).
"""

import flax.linen as nn
import jax.numpy as jnp

from mhc_jax.mixers.base import Mixer, make_stats, param, rms_norm
from mhc_jax.mixers.hc import HyperConnection


def split_fracs(x_BTC, m: int):
  c = x_BTC.shape[-1]
  if c % m:
    raise ValueError(f"frac: width C={c} is not divisible by n={m} fractions")
  return x_BTC.reshape(x_BTC.shape[:-1] + (m, c // m))


def merge_fracs(x_BTmD):
  return x_BTmD.reshape(x_BTmD.shape[:-2] + (x_BTmD.shape[-2] * x_BTmD.shape[-1],))


class Concat(nn.Module):
  """The frac collapse: the fractions back into one ``[B, T, C]`` vector (no parameters)."""

  @nn.compact
  def __call__(self, x_BTmD):
    return merge_fracs(x_BTmD)


class FracConnection(Mixer):
  n: int = 4
  collapse: str = "concat"
  dynamic: bool = True
  alpha_init: float = 0.01
  param_roles = HyperConnection.param_roles  # HC's parameters, on fractions of the width

  def expand(self, x_BTC):
    return split_fracs(x_BTC, self.n)

  def collapse_module(self):
    if self.collapse != "concat":
      raise ValueError(
        f"frac: collapse must be 'concat' (the inverse of the split), got {self.collapse!r}"
      )
    return Concat, {}

  def collapse_params(self, width: int) -> int:
    return 0

  def layer_params(self, width: int) -> int:
    m = self.n
    return m + 2 * m * m + (((width // m) * (2 * m + 1) + 2) if self.dynamic else 0)

  @nn.compact
  def __call__(self, x_BTmD, sublayer, layer=0):
    m, d = x_BTmD.shape[-2:]
    if m != self.n:
      raise ValueError(f"frac: configured for n={self.n} fractions, got state with {m}")
    eye = lambda k, s, dt: jnp.eye(m, dtype=dt)
    gamma = param(self, "b_read", eye, (m, m), ("streams", None))
    a = param(self, "b_mix", eye, (m, m), ("streams", None))
    beta = param(self, "b_write", nn.initializers.ones, (m,), ("streams",))
    if self.dynamic:
      xn = rms_norm(x_BTmD)  # [B,T,m,D]
      zeros = nn.initializers.zeros
      w_read = param(self, "w_read", zeros, (d, m), (None, "streams"))
      w_mix = param(self, "w_mix", zeros, (d, m), (None, "streams"))
      w_write = param(self, "w_write", zeros, (d,), (None,))
      const = nn.initializers.constant(self.alpha_init)
      s_a = param(self, "s_alpha", const, (), ())
      s_b = param(self, "s_beta", const, (), ())
      gamma = s_a * jnp.tanh(xn @ w_read) + gamma  # [B,T,m,m]
      a = s_a * jnp.tanh(xn @ w_mix) + a  # [B,T,m,m]
      beta = s_b * jnp.tanh(xn @ w_write) + beta  # [B,T,m]
    x = x_BTmD.astype(jnp.float32)
    u = jnp.einsum("...ji,...jd->...id", gamma, x)  # Γᵀ H
    f_BTC = sublayer(merge_fracs(u).astype(x_BTmD.dtype))
    f = split_fracs(f_BTC.astype(jnp.float32), m)
    h_res = jnp.swapaxes(a, -1, -2)  # Aᵀ
    out = jnp.einsum("...ij,...jd->...id", h_res, x) + beta[..., None] * f
    out = out.astype(x_BTmD.dtype)
    return out, make_stats(x_BTmD, out, f_BTC, h_res, gamma.sum(-1), beta)
