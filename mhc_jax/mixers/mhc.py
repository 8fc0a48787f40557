"""Manifold-constrained Hyper-Connections (Xie et al., arXiv:2512.24880).

Layer: ``x' = H_res x + H_postᵀ F(H_pre x)``. Coefficients come from the whole flattened state
of a token, ``v = RMSNorm(vec(x)) ∈ R^{nC}``:
``H̃_pre = α_pre (v φ_pre) + b_pre``, ``H̃_post = α_post (v φ_post) + b_post``,
``H̃_res = α_res mat(v φ_res) + b_res`` (one fused projection ``φ [nC, n² + 2n]``), then
``H_pre = σ(H̃_pre)``, ``H_post = 2σ(H̃_post)``, ``H_res = Sinkhorn(H̃_res)``: doubly stochastic,
so every row and column of the mixing sums to 1 and the composite gain stays bounded.

``h_res_init``: ``"identity"`` biases ``b_res`` so ``H_res`` starts near ``I`` (diagonal 0.95),
``"uniform"`` sets ``b_res = 0`` so it starts near ``J/n`` (the polytope's centre).
``φ`` starts at zero (as HC's ``W``), so at step 0 the layer is exactly its static part and the
``h_res_init`` claims hold exactly; ``φ`` gets gradient ``α vᵀ g`` from the first step.
``dynamic=False`` drops the ``v φ`` terms (static mHC). Subclasses replace ``project_res``.
"""
import math

import flax.linen as nn
import jax.numpy as jnp

from mhc_jax import sinkhorn as sk
from mhc_jax.mixers.base import Mixer, make_stats, mix, param, read, rms_norm

DIAG_INIT = 0.95  # target diagonal of H_res at initialisation for h_res_init="identity"


class ManifoldHyperConnection(Mixer):
  n: int = 4
  dynamic: bool = True
  alpha_init: float = 0.01
  sinkhorn_iters: int = 20
  sinkhorn_grad: str = "unroll"
  h_res_init: str = "identity"
  doubly_stochastic = True

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
      return math.log(DIAG_INIT / (1 - DIAG_INIT) * (n - 1)) * jnp.eye(n, dtype=jnp.float32)
    raise ValueError(f"mhc: h_res_init must be 'identity' or 'uniform', got {self.h_res_init!r}")

  def project_res(self, z_res):
    """``[..., res_size]`` logits -> (doubly stochastic ``[..., n, n]``, column error)."""
    h = sk.sinkhorn(z_res.reshape(z_res.shape[:-1] + (self.n, self.n)),
                    iters=self.sinkhorn_iters, grad=self.sinkhorn_grad)
    return h, sk.stochastic_error(h)[1]

  @nn.compact
  def __call__(self, x_BTnC, sublayer, layer=0):
    n, c = x_BTnC.shape[-2:]
    if n != self.n:
      raise ValueError(f"mhc: configured for n={self.n} streams, got state with n={n}")
    r = self.res_size()
    b_pre = param(self, "b_pre", nn.initializers.zeros, (n,), ("streams",))
    b_post = param(self, "b_post", nn.initializers.zeros, (n,), ("streams",))
    b_res = param(self, "b_res", lambda k, s, d: self.res_bias().reshape(s).astype(d), (r,),
                  (None,))
    z_pre, z_post, z_res = b_pre, b_post, b_res
    if self.dynamic:
      v = rms_norm(x_BTnC.reshape(x_BTnC.shape[:-2] + (n * c,)))          # [B,T,nC]
      phi = param(self, "phi", nn.initializers.zeros, (n * c, 2 * n + r), ("streams_embed", None))
      const = nn.initializers.constant(self.alpha_init)
      a_pre, a_post, a_res = (param(self, f"alpha_{k}", const, (), ())
                              for k in ("pre", "post", "res"))
      proj = v @ phi                                                     # [B,T,2n+r]
      z_pre = a_pre * proj[..., :n] + b_pre
      z_post = a_post * proj[..., n:2 * n] + b_post
      z_res = a_res * proj[..., 2 * n:] + b_res
    h_pre = nn.sigmoid(z_pre)
    h_post = 2.0 * nn.sigmoid(z_post)
    h_res, err = self.project_res(z_res)
    f_BTC = sublayer(read(x_BTnC, h_pre))
    out = mix(x_BTnC, f_BTC, h_res, h_post)
    return out, make_stats(x_BTnC, out, f_BTC, h_res, h_pre, h_post, err)
