"""Peri-LN (Kim et al., arXiv:2502.02732): a norm on the sublayer's input and on its output.

Layer: ``x' = x + N_out(F(N_in(x)))``. ``N_in`` is the model's pre-norm (``pre_norm = True``: the
model's learnable RMSNorm in front of attention / MLP); ``N_out`` is a learnable RMSNorm owned
by this mixer (scale ``norm_scale [C]``, initialised to ones). The paper is written for
LayerNorm and RMSNorm alike; this codebase uses RMSNorm everywhere, so both norms are RMSNorm.
The paper finds a learnable output-norm scale matters (freezing it hurts), so it is learned.
Every sublayer output enters the stream at unit RMS (times the learned scale): the stream's
variance grows about linearly in depth instead of with the size of the sublayer outputs.

Options:

- ``embed_norm`` (default False): the paper's optional normalisation of the embedding output,
  ``x_0 = N(embed)``. ``expand`` has no parameters, so here it is the parameter-free RMS norm
  (the embedding table is initialised at unit RMS already, so this matters only in training).
- ``eps`` (1e-6, the model's RMSNorm eps).

State: one stream ``[B, T, 1, C]`` (the residual's). ``branch_rms`` is the RMS of the raw
sublayer output ``F`` (before ``N_out``), where Pre-LN's "massive activations" would show.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from mhc_jax.mixers.base import Mixer, param, rms, rms_norm


def learned_rms_norm(
  mod: nn.Module, x: jax.Array, name: str = "norm_scale", eps: float = 1e-6
) -> jax.Array:
  """``x / rms(x) * scale`` over the last axis in float32, with a learnable ``scale [C]`` of
  ``mod`` initialised to ones (the model's RMSNorm, as a mixer parameter; not weight-decayed)."""
  scale = param(mod, name, nn.initializers.ones, (x.shape[-1],), ("embed",))
  return rms_norm(x, eps) * scale


def single_stream(name: str, x_BTnC) -> jax.Array:
  """The one stream ``[B, T, C]`` of a ``[B, T, 1, C]`` state (error naming the mixer otherwise)."""
  if x_BTnC.shape[-2] != 1:
    raise ValueError(f"{name}: expects 1 stream, got state with n={x_BTnC.shape[-2]}")
  return x_BTnC[..., 0, :]


def stream_stats(x_in, x_out, f) -> dict:
  """The three required stats of a mixer without a stream-mixing matrix."""
  return {"rms_in": rms(x_in), "rms_out": rms(x_out), "branch_rms": rms(f)}


class PeriLN(Mixer):
  n: int = 1
  embed_norm: bool = False
  eps: float = 1e-6
  multi_stream = False
  param_roles = {"norm_scale": "norm"}

  def layer_params(self, width: int) -> int:
    return width  # the output norm's scale

  def expand(self, x_BTC):
    if self.embed_norm:
      x_BTC = rms_norm(x_BTC, self.eps).astype(x_BTC.dtype)
    return x_BTC[..., None, :]

  @nn.compact
  def __call__(self, x_BTnC, sublayer, layer=0):
    x = single_stream("peri_ln", x_BTnC)
    f_BTC = sublayer(x)
    branch = getattr(sublayer, "branch", 1.0)  # its norm undoes the model's m_L^-alpha: again
    out = x.astype(jnp.float32) + learned_rms_norm(self, f_BTC, eps=self.eps) * branch
    out = out[..., None, :].astype(x_BTnC.dtype)
    return out, stream_stats(x_BTnC, out, f_BTC)
