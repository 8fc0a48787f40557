"""Manifold-constrained Hyper-Connections (Xie et al., arXiv:2512.24880).

Layer: ``x' = H_res x + H_postᵀ F(H_pre x)``. Coefficients come from the whole flattened state
of a token, ``v = RMSNorm(vec(x)) ∈ R^{nC}``:
``H̃_pre = α_pre (v φ_pre) + b_pre``, ``H̃_post = α_post (v φ_post) + b_post``,
``H̃_res = α_res mat(v φ_res) + b_res`` (one fused projection ``φ [nC, n² + 2n]``), then
``H_pre = σ(H̃_pre)``, ``H_post = 2σ(H̃_post)``, ``H_res = Sinkhorn(H̃_res)``: doubly stochastic,
so every row and column of the mixing sums to 1 and the composite gain stays bounded.

Options, initialisation and state in detail: docs/mixers.md ("Mixer notes", ``mhc``).

Subclasses replace ``project_res``.
"""

import math
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from mhc_jax import sinkhorn as sk
from mhc_jax.mixers.base import Mixer, make_stats, mix, param, read, rms_norm

READ_INIT = 0.95  # sigma(b_pre) on the read stream for stream_init="hc" (1 - READ_INIT elsewhere)
ONEHOT_LOGIT = 1.0  # b_pre, b_post = +/- this on stream layer mod n for stream_init="onehot"
STREAM_INITS = ("onehot", "hc", "symmetric")


def onehot_logits(layer, n: int, z: float) -> jax.Array:
  """Logits ``+z`` on stream ``layer mod n`` and ``-z`` on the others."""
  return z * (2.0 * jax.nn.one_hot(layer % n, n, dtype=jnp.float32) - 1.0)


def stream_bias_inits(stream_init: str, layer, n: int):
  """Initialisers of ``(b_pre, b_post)`` for ``stream_init`` (module docstring)."""
  if stream_init not in STREAM_INITS:
    raise ValueError(f"stream_init must be one of {STREAM_INITS}, got {stream_init!r}")
  zeros = nn.initializers.zeros
  if n == 1 or stream_init == "symmetric":
    return zeros, zeros
  onehot = lambda z: lambda k, s, d: onehot_logits(layer, n, z).astype(d)
  if stream_init == "hc":
    return onehot(math.log(READ_INIT / (1 - READ_INIT))), zeros
  return onehot(ONEHOT_LOGIT), onehot(ONEHOT_LOGIT)


class ManifoldHyperConnection(Mixer):
  n: int = 4
  dynamic: bool = True
  alpha_init: float = 0.01
  sinkhorn_iters: int = 20
  sinkhorn_grad: Literal["unroll", "implicit"] = "unroll"
  h_res_init: Literal["identity", "uniform"] = "identity"
  res_diag: float = 0.999
  phi_init: float = 1.0
  stream_init: Literal["onehot", "hc", "symmetric"] = "onehot"
  doubly_stochastic = True
  param_roles = {"*_res": "res", "b_*": "scalar", "alpha_*": "scalar", "phi": "readout"}

  def layer_params(self, width: int) -> int:
    n, r = self.n, self.res_size()
    return 2 * n + r + ((n * width * (2 * n + r) + 3) if self.dynamic else 0)

  def res_size(self) -> int:
    """Number of logits the ``H_res`` projection needs."""
    return self.n * self.n

  def res_bias(self):
    n = self.n
    if self.h_res_init == "uniform":
      return jnp.zeros((n, n), jnp.float32)
    if self.h_res_init == "identity":
      if n == 1:
        return jnp.zeros((1, 1), jnp.float32)
      return math.log(self.res_diag / (1 - self.res_diag) * (n - 1)) * jnp.eye(n, dtype=jnp.float32)
    raise ValueError(f"mhc: h_res_init must be 'identity' or 'uniform', got {self.h_res_init!r}")

  def project_res(self, z_res):
    """``[..., res_size]`` logits -> (doubly stochastic ``[..., n, n]``, column error)."""
    z = z_res.reshape(z_res.shape[:-1] + (self.n, self.n))
    h = sk.sinkhorn(z, iters=self.sinkhorn_iters, grad=self.sinkhorn_grad)
    return h, sk.stochastic_error(h)[1]

  @nn.compact
  def __call__(self, x_BTnC, sublayer, layer=0):
    n, c = x_BTnC.shape[-2:]
    if n != self.n:
      raise ValueError(f"mhc: configured for n={self.n} streams, got state with n={n}")
    r = self.res_size()
    pre_init, post_init = stream_bias_inits(self.stream_init, layer, n)
    b_pre = param(self, "b_pre", pre_init, (n,), ("streams",))
    b_post = param(self, "b_post", post_init, (n,), ("streams",))
    res_init = lambda k, s, d: self.res_bias().reshape(s).astype(d)
    b_res = param(self, "b_res", res_init, (r,), (None,))
    z_pre, z_post, z_res = b_pre, b_post, b_res
    if self.dynamic:
      x_BTK = x_BTnC.reshape(x_BTnC.shape[:-2] + (n * c,))  # [B,T,nC]
      phi_init = nn.initializers.normal(self.phi_init / math.sqrt(n * c))
      phi = param(self, "phi", phi_init, (n * c, 2 * n + r), ("streams_embed", None))
      const = nn.initializers.constant(self.alpha_init)
      a_pre, a_post, a_res = (
        param(self, f"alpha_{k}", const, (), ()) for k in ("pre", "post", "res")
      )
      proj = rms_norm(x_BTK) @ phi  # [B,T,2n+r]
      z_pre = a_pre * proj[..., :n] + b_pre
      z_post = a_post * proj[..., n : 2 * n] + b_post
      z_res = a_res * proj[..., 2 * n :] + b_res
    h_pre = nn.sigmoid(z_pre)
    h_post = 2.0 * nn.sigmoid(z_post)
    h_res, err = self.project_res(z_res)
    f_BTC = sublayer(read(x_BTnC, h_pre))
    out = mix(x_BTnC, f_BTC, h_res, h_post)
    return out, make_stats(x_BTnC, out, f_BTC, h_res, h_pre, h_post, err)
