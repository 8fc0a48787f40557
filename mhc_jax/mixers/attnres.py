"""Attention Residuals, AttnRes (Kimi Team, arXiv:2603.15031).

The residual sum is replaced by softmax attention over depth. With ``v_0`` the embedding and
``v_i = f_i(h_i)`` the output of sublayer ``i`` (attention and MLP are separate layers, as in
the paper), the input of layer ``l`` is::

    h_l = Σ_{i<l} softmax_i(w_l · RMSNorm(v_i)) v_i

with one learned pseudo-query ``w_l ∈ R^C`` and one RMSNorm (learned scale) on the keys per
layer; keys equal values. ``h_l`` is the sublayer input (the model's pre-norm is applied on top:
``v_l = f_l(norm(h_l))``); there is no additive residual. The output fed to the final norm is
one more aggregation over all ``v_i`` with its own query (the public reproductions' final
query; the paper's pseudocode shows only the per-layer step). ``w = 0`` at initialisation (the
paper: critical for stability) makes every ``h_l`` the uniform mean of its sources, whose
pre-norm equals that of the plain residual sum: at step 0 the model is a pre-norm residual
Transformer (up to the norm's eps).

Options, initialisation and state in detail: docs/mixers.md ("Mixer notes", ``attnres``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mhc_jax.mixers.base import Mixer, param, rms
from mhc_jax.mixers.denseformer import Current, check_state, history_state

EPS = 1e-6  # RMSNorm epsilon of the keys


def depth_attention(hist, query, valid, eps: float = EPS):
  """``Σ_j softmax_j(q · v_j / RMS(v_j)) v_j`` over the entries ``j`` where ``valid``.

  ``hist [H, ..., C]``, ``query [C]`` (the pseudo-query times the key scale), ``valid [H]``.
  Returns the float32 mix and the weights ``[H, ...]``.
  """
  v = hist.astype(jnp.float32)
  inv_rms = jax.lax.rsqrt(jnp.mean(jnp.square(v), axis=-1) + eps)  # [H, ...]
  logits = jnp.einsum("c,j...c->j...", query, v) * inv_rms
  valid = valid.reshape(valid.shape + (1,) * (logits.ndim - 1))
  logits = jnp.where(valid, logits, -1e30)
  p = jax.nn.softmax(logits, axis=0)
  return jnp.einsum("j...,j...c->...c", p, v), p


class AttnRes(Mixer):
  block_size: int = 1
  key_scale: bool = True
  multi_stream = False
  param_roles = {"b_query": "readout", "b_key_scale": "norm"}

  averages_branches = True  # a softmax average over the history, not a sum

  def hist_size(self) -> int:
    """The embedding plus one entry per block of ``block_size`` mixer layers."""
    if self.block_size < 1:
      raise ValueError(f"attnres: block_size must be >= 1, got {self.block_size}")
    return -(-self.layers // self.block_size) + 1

  def expand(self, x_BTC):
    return history_state(x_BTC, self.hist_size(), "attnres")  # h_0 = v_0: one source

  def stream(self, state):
    return state["x"][..., None, :]

  def collapse_module(self):
    return Current, {}

  def layer_params(self, width: int) -> int:
    return width * (2 if self.key_scale else 1)

  def collapse_params(self, width: int) -> int:
    return 0

  @nn.compact
  def __call__(self, state, sublayer, layer=0):
    size, s = self.hist_size(), self.block_size
    check_state(state, size, self.n, "attnres")
    if isinstance(layer, (int, np.integer)) and not 0 <= layer < self.layers:
      raise ValueError(f"attnres: layer {layer} outside 0..{self.layers - 1}")
    hist, x = state["hist"], state["x"]
    c = x.shape[-1]
    query = param(self, "b_query", nn.initializers.zeros, (c,), ("embed",))
    if self.key_scale:
      query = query * param(self, "b_key_scale", nn.initializers.ones, (c,), ("embed",))
    f_BTC = sublayer(x)
    entry = layer // s + 1  # the block v_{layer+1} belongs to (entry 0 is the embedding)
    if s == 1:
      v = f_BTC.astype(hist.dtype)
    else:  # the first layer of a block starts its sum, the others add to it
      part = jax.lax.dynamic_index_in_dim(hist, entry, 0, keepdims=False)
      f32 = f_BTC.astype(jnp.float32)
      v = jnp.where(layer % s == 0, f32, part.astype(jnp.float32) + f32).astype(hist.dtype)
    hist = jax.lax.dynamic_update_index_in_dim(hist, v, entry, 0)
    h, _ = jax.checkpoint(depth_attention)(hist, query, jnp.arange(size) <= entry)
    h = h.astype(x.dtype)
    stats = {"rms_in": rms(x), "rms_out": rms(h), "branch_rms": rms(f_BTC)}
    return {"hist": hist, "x": h}, stats
