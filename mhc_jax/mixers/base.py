"""The residual-mixer contract, shared helpers and the stream collapse.

A mixer owns the residual stream between sublayers; its default state is ``n`` parallel streams
``x_BTnC`` and one layer is ``x' = H_res x + H_postᵀ F(H_pre x)``, ``F = sublayer``. The contract
and the ``stats`` it returns: docs/interfaces.md ("The mixer contract", "Mixer stats").
"""

from __future__ import annotations

import math
from typing import Callable, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mhc_jax.mixers import cpu_mix

Sublayer = Callable[[jax.Array], jax.Array]
STAT_KEYS = ("h_res", "h_res_tok", "h_pre", "h_post", "rms_in", "rms_out", "branch_rms")
STAT_KEYS += ("sinkhorn_err", "stream_spread")
TOKEN_SAMPLE = 16  # tokens whose own H_res products are tracked (h_res_tok)


def rms(x: jax.Array) -> jax.Array:
  """Root mean square over all elements, in float32."""
  x = x.astype(jnp.float32)
  return jnp.sqrt(jnp.mean(jnp.square(x)))


def rms_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """Parameter-free RMS normalisation over the last axis, in float32."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def param(mod: nn.Module, name: str, init, shape, axes) -> jax.Array:
  """A float32 parameter of ``mod`` with logical axis names (mixer coefficients stay fp32)."""
  return mod.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


def token_mean(a: jax.Array, lead: int) -> jax.Array:
  """Average the first ``lead`` (token) axes of a coefficient array."""
  return jnp.mean(a.astype(jnp.float32), axis=tuple(range(lead))) if lead else a.astype(jnp.float32)


def sample_index(tok_shape) -> np.ndarray:
  """Flat indices of the fixed token sample: ``min(TOKEN_SAMPLE, tokens)`` evenly spaced."""
  n_tok = math.prod(tok_shape)
  return np.linspace(0, n_tok - 1, min(TOKEN_SAMPLE, n_tok)).round().astype(np.int32)


def sample_tokens(h_res, tok_shape) -> jax.Array:
  """Per-token ``H_res`` of the fixed token sample: ``[S, n, n]``.

  ``h_res`` is ``[n, n]`` (static: the same for every token) or ``[*tok_shape, n, n]``.
  """
  h = jnp.broadcast_to(h_res.astype(jnp.float32), tuple(tok_shape) + h_res.shape[-2:])
  return h.reshape((-1,) + h.shape[-2:])[sample_index(tok_shape)]


def stream_spread(x_NnC: jax.Array) -> jax.Array:
  """Relative spread of the streams, ``RMS(x - mean over streams) / RMS(x)``, in float32.

  ``x_NnC [..., n, C]``: 0 when every stream is the same vector (the streams have collapsed
  into one), about 1 when they are unrelated. One scalar over all leading (token) axes.
  """
  x = x_NnC.astype(jnp.float32)
  dev = x - jnp.mean(x, axis=-2, keepdims=True)
  return jnp.sqrt(jnp.mean(jnp.square(dev)) / jnp.mean(jnp.square(x)))


def sample_state(x_BTnC: jax.Array) -> jax.Array:
  """The state ``[..., n, C]`` of the fixed token sample (:func:`sample_tokens`'s): ``[S, n, C]``."""
  return x_BTnC.reshape((-1,) + x_BTnC.shape[-2:])[sample_index(x_BTnC.shape[:-2])]


def make_stats(x_in, x_out, f_out, h_res, h_pre, h_post, sinkhorn_err=None) -> dict:
  """The per-call stats dict; coefficients may carry leading token axes (averaged here)."""
  n, err = x_in.shape[-2], jnp.zeros(()) if sinkhorn_err is None else sinkhorn_err
  lead_res, lead_vec = h_res.ndim - 2, h_pre.ndim - 1
  return {
    "h_res": token_mean(jnp.broadcast_to(h_res, h_res.shape[:lead_res] + (n, n)), lead_res),
    "h_res_tok": sample_tokens(h_res, x_in.shape[:-2]),
    "h_pre": token_mean(h_pre, lead_vec),
    "h_post": token_mean(h_post, h_post.ndim - 1),
    "rms_in": rms(x_in),
    "rms_out": rms(x_out),
    "branch_rms": rms(f_out),
    "sinkhorn_err": jnp.asarray(err, jnp.float32),
    "stream_spread": stream_spread(sample_state(x_out)),
  }


#: How ``mix`` and ``read`` are computed: ``"einsum"`` (the definitions below), ``"cpu"`` (the
#: hand-written CPU kernel of ``mixers/cpu_mix.py``, 2-3x faster there), or ``"auto"``: the CPU
#: kernel on a CPU backend, the einsums elsewhere. The one switch (set it before anything is
#: traced: jax caches traces); tests/test_mixers.py holds the two forms equal.
MIX_KERNEL = "auto"


def _cpu_kernel() -> bool:
  if MIX_KERNEL not in ("auto", "einsum", "cpu"):
    raise ValueError(f"MIX_KERNEL: expected auto, einsum or cpu, got {MIX_KERNEL!r}")
  return MIX_KERNEL == "cpu" or (MIX_KERNEL == "auto" and jax.default_backend() == "cpu")


def mix(x_BTnC, f_BTC, h_res, h_post):
  """``x' = H_res x + H_postᵀ F`` in float32; ``h_res [..., n, n]`` and ``h_post [..., n]`` may
  carry the token axes (per-token coefficients)."""
  x, f, h, p = (a.astype(jnp.float32) for a in (x_BTnC, f_BTC, h_res, h_post))
  if _cpu_kernel():
    out = cpu_mix.mix(x, f, h, p)
  else:
    out = jnp.einsum("...ij,...jc->...ic", h, x) + p[..., :, None] * f[..., None, :]
  return out.astype(x_BTnC.dtype)


def read(x_BTnC, h_pre):
  """The sublayer input ``H_pre x``: a weighted sum of the streams, ``h_pre [..., n]``."""
  x, p = x_BTnC.astype(jnp.float32), h_pre.astype(jnp.float32)
  out = cpu_mix.read(x, p) if _cpu_kernel() else jnp.einsum("...i,...ic->...c", p, x)
  return out.astype(x_BTnC.dtype)


class Mixer(nn.Module):
  """The contract (docs/interfaces.md, "The mixer contract": ``expand``, ``__call__``,
  ``collapse_module``, ``stream``, ``layers``, the class attributes). A mixer owns its carried
  state (any pytree), how it begins and ends, and the stats it reports; the defaults describe
  ``n`` identical-width streams."""

  n: int = 1
  layers: int = 0
  collapse: str = "sum"
  # Invariant a mixer claims for its H_res; mhc_jax.testing checks it under random parameters.
  doubly_stochastic: ClassVar[bool] = False
  pre_norm: ClassVar[bool] = True
  # Whether the state holds n > 1 parallel streams that must separate (mhc_jax.testing checks).
  multi_stream: ClassVar[bool] = True
  # Each parameter's role under mup/completep: leaf-name pattern (fnmatch, first match) -> "hidden",
  # "readout", "scalar", "norm", "res" or "res_readout" (docs/parametrization.md); None declares
  # nothing (such a mixer runs under sp only).
  param_roles: ClassVar[dict[str, str] | None] = None

  @property
  def averages_branches(self) -> bool:
    return False

  def expand(self, x_BTC: jax.Array):
    return jnp.broadcast_to(x_BTC[..., None, :], x_BTC.shape[:-1] + (self.n, x_BTC.shape[-1]))

  def stream(self, state) -> jax.Array:
    return state

  def collapse_module(self) -> tuple[type[nn.Module], dict]:
    """``(module class, its fields)`` mapping the final state to ``x_BTC``; the model builds it
    (named ``collapse``) in its own scope."""
    return Collapse, {"n": self.n, "kind": self.collapse}

  def layer_params(self, width: int) -> int:
    """Parameters of one mixer layer at model width ``width`` (closed form)."""
    raise NotImplementedError(f"{type(self).__name__}: no closed-form parameter count")

  def collapse_params(self, width: int) -> int:
    return self.n if self.collapse == "learned" and self.n > 1 else 0

  def sublayer_out_scale(self, layers: int) -> float:
    """Multiplier on the init scale of each sublayer's output projection (1: unchanged)."""
    return 1.0


class Collapse(nn.Module):
  """Streams -> one: ``sum`` (HC/mHC papers) or ``learned`` weights (initialised to ones)."""

  n: int = 1
  kind: str = "sum"

  @nn.compact
  def __call__(self, x_BTnC: jax.Array) -> jax.Array:
    if self.kind == "sum" or self.n == 1:
      return x_BTnC.sum(axis=-2)
    if self.kind != "learned":
      raise ValueError(f"collapse: expected 'sum' or 'learned', got {self.kind!r}")
    w = param(self, "b_collapse", nn.initializers.ones, (self.n,), ("streams",))
    return jnp.einsum("i,...ic->...c", w, x_BTnC.astype(jnp.float32)).astype(x_BTnC.dtype)
