"""DenseFormer: depth-weighted averaging, DWA (Pagliardini et al., arXiv:2402.02622).

After block ``i`` (blocks keep their own residuals, ``X_i = B_i(Y_{i-1})``) the next block's
input is a learned weighted average of the embedding ``X_0`` and every block output so far::

    Y_i = Σ_{j ≤ i, (i - j) mod k = 0} α_ij X_j     if i mod p = 0,    Y_i = X_i otherwise

with dilation ``k`` and period ``p`` (a "k×p-DenseFormer"; the paper's default is 1×1). The
weights are initialised to ``α_ii = 1``, all others 0, so the model starts as a plain pre-norm
residual Transformer. The final norm and head read ``Y_L``.

Options, initialisation and state in detail: docs/mixers.md ("Mixer notes", ``denseformer``).
"""

from __future__ import annotations

from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mhc_jax.mixers.base import Mixer, param, rms


class Current(nn.Module):
  """Collapse for history mixers: the current hidden ``state["x"]`` (no parameters)."""

  @nn.compact
  def __call__(self, state):
    return state["x"]


def cond(pred, true_fn, false_fn, operand):
  """``lax.cond``, or a plain Python branch when ``pred`` is concrete (an untraced layer)."""
  if isinstance(pred, (bool, np.bool_)):
    return true_fn(operand) if pred else false_fn(operand)
  return jax.lax.cond(pred, true_fn, false_fn, operand)


def history_state(x_BTC, size: int, name: str) -> dict:
  """``{"hist": [size, B, T, C] zeros with hist[0] = x, "x": x}``."""
  if size < 2:
    raise ValueError(
      f"{name}: needs the model's mixer-layer count (layers >= 1), got a history of {size} entries"
    )
  hist = jnp.zeros((size,) + x_BTC.shape, x_BTC.dtype)
  return {"hist": jax.lax.dynamic_update_index_in_dim(hist, x_BTC, 0, 0), "x": x_BTC}


def check_state(state, size: int, n: int, name: str) -> None:
  if n != 1:
    raise ValueError(f"{name}: single-stream mixer, got n={n}")
  if not isinstance(state, dict) or set(state) != {"hist", "x"}:
    raise ValueError(
      f"{name}: expects the state from its expand ({{'hist', 'x'}}), got {type(state).__name__}"
    )
  if state["hist"].shape[0] != size:
    raise ValueError(
      f"{name}: history has {state['hist'].shape[0]} entries, expected {size} "
      f"(layers={size - 1} steps + the embedding)"
    )


class DenseFormer(Mixer):
  every: Literal["block", "layer"] = "block"
  dilation: int = 1
  period: int = 1
  multi_stream = False
  param_roles = {"b_*": "res"}  # DWA weights mix the stream history

  def _per_step(self) -> int:
    if self.every not in ("block", "layer"):
      raise ValueError(f"denseformer: every must be 'block' or 'layer', got {self.every!r}")
    if self.dilation < 1 or self.period < 1:
      raise ValueError(
        f"denseformer: dilation and period must be >= 1, got {self.dilation}, {self.period}"
      )
    return 2 if self.every == "block" else 1

  def hist_size(self) -> int:
    """``X_0`` plus one entry per DWA step: L + 1 (``every="block"``) or 2L + 1."""
    return self.layers // self._per_step() + 1

  def expand(self, x_BTC):
    return history_state(x_BTC, self.hist_size(), "denseformer")

  def stream(self, state):
    return state["x"][..., None, :]

  def collapse_module(self):
    return Current, {}

  def layer_params(self, width: int) -> int:
    return self.hist_size()

  def collapse_params(self, width: int) -> int:
    return 0

  def weights(self, alpha, step):
    """Row ``step`` of the DWA matrix: ``α`` masked to ``j ≤ step``, ``(step - j) mod k = 0``."""
    j = jnp.arange(alpha.shape[-1])
    keep = (j <= step) & ((step - j) % self.dilation == 0)
    return jnp.where(keep, alpha, 0.0)

  @nn.compact
  def __call__(self, state, sublayer, layer=0):
    m, size = self._per_step(), self.hist_size()
    check_state(state, size, self.n, "denseformer")
    if isinstance(layer, (int, np.integer)) and not 0 <= layer < self.layers:
      raise ValueError(f"denseformer: layer {layer} outside 0..{self.layers - 1}")
    hist, x = state["hist"], state["x"]
    step = (layer + 1) // m  # the DWA step this layer ends (when it ends one)
    dwa_init = lambda k, s, d: jax.nn.one_hot(step, size, dtype=d)
    alpha = param(self, "b_dwa", dwa_init, (size,), (None,))
    f_BTC = sublayer(x)
    y = x + f_BTC.astype(x.dtype)

    def average(ops):
      h, y = ops
      w = self.weights(alpha, step)
      return h, jnp.einsum("j,j...->...", w, h.astype(jnp.float32)).astype(y.dtype)

    def write(ops):
      h, y = ops
      h = jax.lax.dynamic_update_index_in_dim(h, y, step, 0)
      return cond(step % self.period == 0, average, lambda o: o, (h, y))

    hist, y = cond((layer + 1) % m == 0, write, lambda o: o, (hist, y))
    stats = {"rms_in": rms(x), "rms_out": rms(y), "branch_rms": rms(f_BTC)}
    return {"hist": hist, "x": y}, stats
