"""Hyper-Connections (Zhu et al., arXiv:2409.19606): n streams, unconstrained mixing.

Layer: ``x' = A_rᵀ x + Bᵀ F(A_mᵀ x)`` with read weights ``A_m [n]``, stream mixing
``A_r [n, n]`` and write weights ``B [n]``. Static HC learns the three directly; dynamic HC adds
per-stream, input-dependent terms from ``x̄ = norm(x)``:
``A_m(x) = s_α tanh(x̄ w_m) + A_m``, ``A_r(x) = s_α tanh(x̄ W_r) + A_r``,
``B(x) = s_β tanh(x̄ w_b) + B``.
Initialisation (``W = 0``, ``B = 1``, ``A_m = e_{layer mod n}``, ``A_r = I``, ``s = 0.01``)
makes every stream equal a pre-norm residual at step 0, and the one-hot read is what tells the
streams (copies of the embedding) apart: ``stream_init="hc"`` (default). ``stream_init="symmetric"``
reads every stream equally (``A_m = 1/n``), the symmetric start MaxText and Megatron-LM give mHC,
so the two mixers can be compared under either. In the contract's terms
``h_pre = A_m``, ``h_post = B``, ``h_res = A_rᵀ``. Static parts are named ``b_*`` (no decay).
"""

from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from mhc_jax.mixers.base import Mixer, make_stats, mix, param, read, rms_norm


class HyperConnection(Mixer):
  n: int = 4
  dynamic: bool = True
  alpha_init: float = 0.01
  stream_init: Literal["hc", "symmetric"] = "hc"
  param_roles = {
    "b_mix": "res",
    "w_mix": "res_readout",
    "b_*": "scalar",
    "s_*": "scalar",
    "w_*": "readout",
  }

  def layer_params(self, width: int) -> int:
    n, c = self.n, width
    return 2 * n + n * n + ((2 * c + c * n + 2) if self.dynamic else 0)

  @nn.compact
  def __call__(self, x_BTnC, sublayer, layer=0):
    n, c = x_BTnC.shape[-2:]
    if n != self.n:
      raise ValueError(f"hc: configured for n={self.n} streams, got state with n={n}")
    if self.stream_init not in ("hc", "symmetric"):
      raise ValueError(f"stream_init must be 'hc' or 'symmetric', got {self.stream_init!r}")
    if self.stream_init == "hc":
      read_init = lambda k, s, d: jax.nn.one_hot(layer % n, n, dtype=d)
    else:
      read_init = nn.initializers.constant(1.0 / n)
    a_m = param(self, "b_read", read_init, (n,), ("streams",))
    a_r = param(self, "b_mix", lambda k, s, d: jnp.eye(n, dtype=d), (n, n), ("streams", None))
    b = param(self, "b_write", nn.initializers.ones, (n,), ("streams",))
    if self.dynamic:
      zeros = nn.initializers.zeros
      w_m = param(self, "w_read", zeros, (c,), ("embed",))
      w_r = param(self, "w_mix", zeros, (c, n), ("embed", "streams"))
      w_b = param(self, "w_write", zeros, (c,), ("embed",))
      const = nn.initializers.constant(self.alpha_init)
      s_a = param(self, "s_alpha", const, (), ())
      s_b = param(self, "s_beta", const, (), ())
      # the three projections of the normed state as one dot
      w = jnp.concatenate([w_m[:, None], w_r, w_b[:, None]], axis=1)  # [C, n+2]
      z = jnp.tanh(rms_norm(x_BTnC) @ w)  # [B,T,n,n+2]
      a_m = s_a * z[..., 0] + a_m  # [B,T,n]
      a_r = s_a * z[..., 1 : n + 1] + a_r  # [B,T,n,n]
      b = s_b * z[..., n + 1] + b  # [B,T,n]
    h_res = jnp.swapaxes(a_r, -1, -2)
    f_BTC = sublayer(read(x_BTnC, a_m))
    out = mix(x_BTnC, f_BTC, h_res, b)
    return out, make_stats(x_BTnC, out, f_BTC, h_res, a_m, b)
