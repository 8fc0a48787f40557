"""Manifold-constrained Hyper-Connections (Xie et al., arXiv:2512.24880).

Layer: ``x' = H_res x + H_postᵀ F(H_pre x)``. Coefficients come from the whole flattened state
of a token, ``v = RMSNorm(vec(x)) ∈ R^{nC}``:
``H̃_pre = α_pre (v φ_pre) + b_pre``, ``H̃_post = α_post (v φ_post) + b_post``,
``H̃_res = α_res mat(v φ_res) + b_res`` (one fused projection ``φ [nC, n² + 2n]``), then
``H_pre = σ(H̃_pre)``, ``H_post = 2σ(H̃_post)``, ``H_res = Sinkhorn(H̃_res)``: doubly stochastic,
so every row and column of the mixing sums to 1 and the composite gain stays bounded.

``h_res_init``: ``"identity"`` biases ``b_res`` so ``H_res`` starts near ``I`` (diagonal 0.95),
``"uniform"`` sets ``b_res = 0`` so it starts near ``J/n`` (the polytope's centre).

Symmetry breaking (docs/mixers.md). ``expand`` copies the embedding into every stream, so if
nothing in the parameters tells the streams apart (``φ = 0``, equal ``b_pre``/``b_post``) they
stay identical under training, ``H_res`` acts as the identity on them, and the layer is a
single-stream residual with a learned gate. The mHC paper does not say how ``φ`` and ``b`` are
initialised; its public reference implementations draw ``φ`` at random (fan-in normal or
xavier), and HC breaks the symmetry with one-hot read weights ``A_m = e_{layer mod n}``. Here:

- ``phi_init`` (default 1.0, the reference implementations' choice): ``φ ~ N(0, phi_init² / nC)``
  (fan-in normal), so each stream gets its own coefficients from the first layer; ``0`` gives
  the symmetric zero init (kept only to show what it breaks).
- ``pre_init``: ``"uniform"`` ``b_pre = 0``, ``H_pre = σ(0) = 1/2`` on every stream;
  ``"onehot"`` HC's one-hot read, ``σ(b_pre) = 0.95`` on stream ``layer mod n`` and 0.05 on the
  others; ``"auto"`` (default) is ``"uniform"`` for dynamic mHC (``φ`` already breaks the
  symmetry) and ``"onehot"`` for static mHC (``dynamic=False`` drops the ``v φ`` terms, so
  nothing else would).

Subclasses replace ``project_res``.
"""

import math
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from mhc_jax import sinkhorn as sk
from mhc_jax.mixers.base import Mixer, make_stats, mix, normed_tokdot, param, read

DIAG_INIT = 0.95  # target diagonal of H_res at initialisation for h_res_init="identity"
READ_INIT = 0.95  # sigma(b_pre) on the read stream for pre_init="onehot" (1 - READ_INIT elsewhere)


def onehot_logits(layer, n: int) -> jax.Array:
  """``b_pre`` with ``σ(b_pre) = READ_INIT`` on stream ``layer mod n``, ``1 - READ_INIT`` elsewhere."""
  z = math.log(READ_INIT / (1 - READ_INIT))
  return z * (2.0 * jax.nn.one_hot(layer % n, n, dtype=jnp.float32) - 1.0)


class ManifoldHyperConnection(Mixer):
  n: int = 4
  dynamic: bool = True
  alpha_init: float = 0.01
  sinkhorn_iters: int = 20
  sinkhorn_grad: Literal["unroll", "implicit"] = "unroll"
  h_res_init: Literal["identity", "uniform"] = "identity"
  phi_init: float = 1.0
  pre_init: Literal["auto", "uniform", "onehot"] = "auto"
  doubly_stochastic = True

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
      return math.log(DIAG_INIT / (1 - DIAG_INIT) * (n - 1)) * jnp.eye(n, dtype=jnp.float32)
    raise ValueError(f"mhc: h_res_init must be 'identity' or 'uniform', got {self.h_res_init!r}")

  def project_res(self, z_res):
    """``[..., res_size]`` logits -> (doubly stochastic ``[..., n, n]``, column error)."""
    h = sk.sinkhorn(
      z_res.reshape(z_res.shape[:-1] + (self.n, self.n)),
      iters=self.sinkhorn_iters,
      grad=self.sinkhorn_grad,
    )
    return h, sk.stochastic_error(h)[1]

  @nn.compact
  def __call__(self, x_BTnC, sublayer, layer=0):
    n, c = x_BTnC.shape[-2:]
    if n != self.n:
      raise ValueError(f"mhc: configured for n={self.n} streams, got state with n={n}")
    r = self.res_size()
    if self.pre_init not in ("auto", "uniform", "onehot"):
      raise ValueError(
        f"mhc: pre_init must be 'auto', 'uniform' or 'onehot', got {self.pre_init!r}"
      )
    onehot = self.pre_init == "onehot" or (self.pre_init == "auto" and not self.dynamic)
    pre_init = (
      (lambda k, s, d: onehot_logits(layer, n).astype(d))
      if onehot and n > 1
      else nn.initializers.zeros
    )
    b_pre = param(self, "b_pre", pre_init, (n,), ("streams",))
    b_post = param(self, "b_post", nn.initializers.zeros, (n,), ("streams",))
    b_res = param(
      self, "b_res", lambda k, s, d: self.res_bias().reshape(s).astype(d), (r,), (None,)
    )
    z_pre, z_post, z_res = b_pre, b_post, b_res
    if self.dynamic:
      x_BTK = x_BTnC.reshape(x_BTnC.shape[:-2] + (n * c,))  # [B,T,nC], normed in the dot
      phi_init = nn.initializers.normal(self.phi_init / math.sqrt(n * c))
      phi = param(self, "phi", phi_init, (n * c, 2 * n + r), ("streams_embed", None))
      const = nn.initializers.constant(self.alpha_init)
      a_pre, a_post, a_res = (
        param(self, f"alpha_{k}", const, (), ()) for k in ("pre", "post", "res")
      )
      proj = normed_tokdot(x_BTK, phi)  # [B,T,2n+r]
      z_pre = a_pre * proj[..., :n] + b_pre
      z_post = a_post * proj[..., n : 2 * n] + b_post
      z_res = a_res * proj[..., 2 * n :] + b_res
    h_pre = nn.sigmoid(z_pre)
    h_post = 2.0 * nn.sigmoid(z_post)
    h_res, err = self.project_res(z_res)
    f_BTC = sublayer(read(x_BTnC, h_pre))
    out = mix(x_BTnC, f_BTC, h_res, h_post)
    return out, make_stats(x_BTnC, out, f_BTC, h_res, h_pre, h_post, err)
