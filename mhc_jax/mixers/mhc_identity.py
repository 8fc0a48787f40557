"""mHC with ``H_res = I``: n streams, learned read and write only (the "does mixing help" baseline).

Layer: ``x' = x + H_postᵀ F(H_pre x)``, i.e. mHC (Xie et al., arXiv:2512.24880; see
``mhc_jax/mixers/mhc.py``) with the stream mixing fixed to the identity. The read and write
weights are mHC's, from the whole flattened state of a token ``v = RMSNorm(vec(x)) ∈ R^{nC}``:
``H_pre = σ(α_pre (v φ_pre) + b_pre)``, ``H_post = 2σ(α_post (v φ_post) + b_post)`` with one
fused projection ``φ [nC, 2n]`` (no ``H_res`` columns, no ``α_res``). Comparing it with ``mhc``,
``mhc_lite`` and ``kromhc`` at equal ``n`` isolates what the stream mixing itself contributes;
comparing it with ``residual`` isolates what n streams with learned read/write contribute.

``H_res = I`` is doubly stochastic (trivially: ``doubly_stochastic = True``); the stats report
``h_res = I`` (and ``h_res_tok = I`` per token) and ``sinkhorn_err = 0``.

Options, initialisation and state in detail: docs/mixers.md ("Mixer notes", ``mhc_identity``).
"""

import math
from typing import Literal

import flax.linen as nn
import jax.numpy as jnp

from mhc_jax.mixers.base import Mixer, make_stats, param, read, rms_norm
from mhc_jax.mixers.mhc import stream_bias_inits


class MHCIdentity(Mixer):
  n: int = 4
  dynamic: bool = True
  alpha_init: float = 0.01
  phi_init: float = 1.0
  stream_init: Literal["onehot", "hc", "symmetric"] = "onehot"
  doubly_stochastic = True  # H_res = I
  param_roles = {"b_*": "scalar", "alpha_*": "scalar", "phi": "readout"}

  def layer_params(self, width: int) -> int:
    n = self.n
    return 2 * n + ((n * width * 2 * n + 2) if self.dynamic else 0)

  @nn.compact
  def __call__(self, x_BTnC, sublayer, layer=0):
    n, c = x_BTnC.shape[-2:]
    if n != self.n:
      raise ValueError(f"mhc_identity: configured for n={self.n} streams, got state with n={n}")
    pre_init, post_init = stream_bias_inits(self.stream_init, layer, n)
    b_pre = param(self, "b_pre", pre_init, (n,), ("streams",))
    b_post = param(self, "b_post", post_init, (n,), ("streams",))
    z_pre, z_post = b_pre, b_post
    if self.dynamic:
      x_BTK = x_BTnC.reshape(x_BTnC.shape[:-2] + (n * c,))  # [B,T,nC]
      phi_init = nn.initializers.normal(self.phi_init / math.sqrt(n * c))
      phi = param(self, "phi", phi_init, (n * c, 2 * n), ("streams_embed", None))
      const = nn.initializers.constant(self.alpha_init)
      a_pre = param(self, "alpha_pre", const, (), ())
      a_post = param(self, "alpha_post", const, (), ())
      proj = rms_norm(x_BTK) @ phi  # [B,T,2n]
      z_pre = a_pre * proj[..., :n] + b_pre
      z_post = a_post * proj[..., n:] + b_post
    h_pre = nn.sigmoid(z_pre)
    h_post = 2.0 * nn.sigmoid(z_post)
    f_BTC = sublayer(read(x_BTnC, h_pre))
    out = (
      x_BTnC.astype(jnp.float32) + h_post[..., :, None] * f_BTC.astype(jnp.float32)[..., None, :]
    ).astype(x_BTnC.dtype)
    return out, make_stats(x_BTnC, out, f_BTC, jnp.eye(n, dtype=jnp.float32), h_pre, h_post)
