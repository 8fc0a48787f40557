"""LAuReL, the Learned Augmented Residual Layer (Menghani et al., arXiv:2411.07501).

General form ``x' = α F(x) + g(x, ...)``, ``F`` the pre-norm sublayer. Variants (``variant``):

- ``"rw"`` (LAuReL-RW, residual weights): ``x' = α F(x) + β x``, two learned scalars;
- ``"lr"`` (LAuReL-LR, low rank): ``x' = F(x) + x + B A x`` (``W = I + BA`` of rank ``r``);
- ``"rw_lr"`` (LAuReL-RW+LR, the paper's eq. 5, default): ``x' = α F(x) + β (x + B A x)``.
  Default because it is the variant the paper trained in both of its LLMs (1B: r = 4;
  4B: r = 64).

The previous-activations variant (LAuReL-PA) is not implemented.

Options, initialisation and state in detail: docs/mixers.md ("Mixer notes", ``laurel``).
"""

from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mhc_jax.mixers.base import Mixer, param
from mhc_jax.mixers.peri_ln import single_stream, stream_stats


def column_orthogonal(width: int, rank: int) -> np.ndarray:
  """The paper's LLM init of the ``C × r`` factor: ``1/sqrt(rC)`` where ``i mod r == j``."""
  i = np.arange(width)[:, None]
  j = np.arange(rank)[None, :]
  return np.where(i % rank == j, 1.0 / np.sqrt(rank * width), 0.0).astype(np.float32)


class Laurel(Mixer):
  n: int = 1
  variant: Literal["rw", "lr", "rw_lr"] = "rw_lr"
  rank: int = 4
  rw_norm: Literal["softmax", "sigmoid", "none"] = "softmax"
  multi_stream = False
  param_roles = {"w_down": "res_readout", "w_up": "res", "b_rw": "res"}  # x + B A x: on the stream

  @property
  def averages_branches(self) -> bool:
    """``x' = α F + β x`` with normalised weights (softmax, sigmoid) is an exponential average."""
    return self._has()[0] and self.rw_norm != "none"

  def _has(self) -> tuple[bool, bool]:
    if self.variant not in ("rw", "lr", "rw_lr"):
      raise ValueError(f"laurel: variant must be 'rw', 'lr' or 'rw_lr', got {self.variant!r}")
    return self.variant in ("rw", "rw_lr"), self.variant in ("lr", "rw_lr")

  def layer_params(self, width: int) -> int:
    rw, lr = self._has()
    return (2 if rw else 0) + (2 * self.rank * width if lr else 0)

  def weights(self, logits):
    """``(α, β)`` from the learned logits ``b_rw``."""
    if self.rw_norm == "softmax":
      w = jax.nn.softmax(logits)
    elif self.rw_norm == "sigmoid":
      w = jax.nn.sigmoid(logits)
    elif self.rw_norm == "none":
      w = logits
    else:
      raise ValueError(
        f"laurel: rw_norm must be 'softmax', 'sigmoid' or 'none', got {self.rw_norm!r}"
      )
    return w[0], w[1]

  @nn.compact
  def __call__(self, x_BTnC, sublayer, layer=0):
    rw, lr = self._has()
    x = single_stream("laurel", x_BTnC)
    c = x.shape[-1]
    f_BTC = sublayer(x)
    f32, g = f_BTC.astype(jnp.float32), x.astype(jnp.float32)
    if lr:
      if not 1 <= self.rank <= c:
        raise ValueError(f"laurel: rank must be in [1, width={c}], got {self.rank}")
      w_down = param(self, "w_down", nn.initializers.zeros, (c, self.rank), ("embed", None))
      up_init = lambda k, s, d: jnp.asarray(column_orthogonal(c, self.rank).T, d)
      w_up = param(self, "w_up", up_init, (self.rank, c), (None, "embed"))
      g = g + g @ w_down @ w_up
    if rw:
      init = nn.initializers.ones if self.rw_norm == "none" else nn.initializers.zeros
      alpha, beta = self.weights(param(self, "b_rw", init, (2,), (None,)))
      out = alpha * f32 + beta * g
    else:
      out = f32 + g
    out = out[..., None, :].astype(x_BTnC.dtype)
    return out, stream_stats(x_BTnC, out, f_BTC)
