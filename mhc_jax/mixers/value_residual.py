"""ResFormer value residual (Zhou et al., "Value Residual Learning", arXiv:2410.17897).

Every attention layer after the first mixes the first attention layer's values into its own,
before attention (so they share its attention matrix):
``V'_n = λ1 V_1 + λ2 V_n`` (the paper's ``V_n = λ_{n,1} V_1 + λ_{n,2} H_{n-1} W^V_n``),
``U_n = A_n V'_n``. The hidden-state residual is the plain pre-norm ``x' = x + F(norm(x))``.
Only the values change; queries, keys and the stream are untouched.

It uses the contract's ``value_fn`` hook: the mixer hands attention a function applied to its
values ``[B, T, H, D]``. At mixer layer 0 (the first attention layer) ``value_fn`` stores the
values in the state and returns them unchanged; at later layers it returns the mix. MLP layers
receive ``value_fn`` as well and ignore it, so the stored ``V_1`` passes through them.

Options, initialisation and state in detail: docs/mixers.md ("Mixer notes", ``value_residual``).
"""

import flax.linen as nn
import jax.numpy as jnp

from mhc_jax.mixers.base import Mixer, param
from mhc_jax.mixers.peri_ln import single_stream, stream_stats


class ValueResidualCollapse(nn.Module):
  """The final state's stream ``x [B, T, 1, C]`` -> ``[B, T, C]`` (``v1`` is dropped)."""

  @nn.compact
  def __call__(self, state):
    return state["x"][..., 0, :]


class ValueResidual(Mixer):
  n: int = 1
  learnable: bool = False
  lambda1: float = 0.5  # weight on the first layer's values V_1
  lambda2: float = 0.5  # weight on the layer's own values V_n
  multi_stream = False
  param_roles = {"b_*": "scalar"}

  def expand(self, x_BTC):
    return {"x": x_BTC[..., None, :], "v1": jnp.zeros_like(x_BTC)}

  def stream(self, state):
    return state["x"]

  def collapse_module(self):
    return ValueResidualCollapse, {}

  def collapse_params(self, width: int) -> int:
    return 0

  def layer_params(self, width: int) -> int:
    return 2 if self.learnable else 0

  @nn.compact
  def __call__(self, state, sublayer, layer=0):
    x_BTnC, v1 = state["x"], state["v1"]
    x = single_stream("value_residual", x_BTnC)
    if self.learnable:
      lam1 = param(self, "b_lambda1", nn.initializers.constant(self.lambda1), (), ())
      lam2 = param(self, "b_lambda2", nn.initializers.constant(self.lambda2), (), ())
    else:
      lam1, lam2 = self.lambda1, self.lambda2
    first = jnp.asarray(layer) == 0
    written = [v1]

    def value_fn(v_BTHD):
      flat = v_BTHD.reshape(v_BTHD.shape[:-2] + (-1,))
      if flat.shape != v1.shape:
        raise ValueError(
          f"value_residual: values {v_BTHD.shape} flatten to {flat.shape}, but "
          f"the stored V_1 is {v1.shape} (needs heads * head_dim = width)"
        )
      written[0] = jnp.where(first, flat.astype(v1.dtype), v1)
      v1_BTHD = v1.astype(jnp.float32).reshape(v_BTHD.shape)
      mixed = lam1 * v1_BTHD + lam2 * v_BTHD.astype(jnp.float32)
      return jnp.where(first, v_BTHD, mixed.astype(v_BTHD.dtype))

    f_BTC = sublayer(x, value_fn=value_fn)
    out = x_BTnC + f_BTC[..., None, :].astype(x_BTnC.dtype)
    return {"x": out, "v1": written[0]}, stream_stats(x_BTnC, out, f_BTC)
