"""Per-layer stability diagnostics: pure, jit-safe ``jnp`` functions, computed in float32.

The function names are the metric names in the logs; what each means is in docs/interfaces.md
("Metric names", "What the gain metrics mean"). Mixer layers are indexed ``l = 0 .. 2L-1`` in
depth order (attn_0, mlp_0, attn_1, ...); ``x_l`` enters layer ``l`` and
``x_{l+1} = H_res x_l + H_postᵀ F(H_pre x_l)``.

The Amax gain is that of the all-ones signal (absolute value after summing, not the induced
inf/1 norm; the two agree for non-negative matrices such as every Sinkhorn-projected ``H_res``).
Ratios are plain divisions: a zero denominator gives inf (0/0 NaN), which the logs record.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax import lax

#: Floor used by :func:`log_colsum_max` for |column sum| before taking the log.
LOG_FLOOR = 1e-30

# Scalar stats from the model that layer_metrics passes through unchanged when present.
_PASS_THROUGH = ("sinkhorn_err", "stream_spread", "attn_logit_max", "out_logit_max")
_PASS_THROUGH += ("logsumexp_mean", "logsumexp_max")


def _f32(x) -> jax.Array:
  return jnp.asarray(x, dtype=jnp.float32)


# --------------------------------------------------------------------------- RMS gains
def gain_fwd(rms_in, rms_out) -> jax.Array:
  """Forward gain per layer: RMS(stream out) / RMS(stream in). Shapes broadcast ([2L])."""
  return _f32(rms_out) / _f32(rms_in)


def branch_ratio(branch_rms, rms_in) -> jax.Array:
  """Branch-to-stream ratio per layer: RMS(F) / RMS(stream in), per-element RMS values (for
  ``n`` streams the ratio of Frobenius norms ``||F|| / ||x||`` is this over ``sqrt(n)``)."""
  return _f32(branch_rms) / _f32(rms_in)


def growth_exponent(rms_first, rms_last, depth) -> jax.Array:
  """Depth growth exponent ``(1/depth) * ln(rms_last / rms_first)``, the two ends in the order
  the signal travels (gradients: output end first); docs/interfaces.md, "Depth growth exponent"."""
  return jnp.log(_f32(rms_last) / _f32(rms_first)) / _f32(depth)


def gain_bwd(grad_rms, grad_rms_out=None) -> jax.Array:
  """Backward gain per layer, the factor by which layer ``l`` scales the gradient passing back:
  ``grad_rms[l] / grad_rms[l + 1]``, ``grad_rms [..., 2L]`` the RMS of dLoss/d(stream entering
  layer l); the last layer's divides by ``grad_rms_out`` (leaving it: the collapse input), NaN
  without it. Like ``gain_fwd``: size after the layer's pass / size before, in its direction."""
  g = _f32(grad_rms)
  if grad_rms_out is None:
    nxt = jnp.full(g.shape[:-1] + (1,), jnp.nan, dtype=jnp.float32)
  else:
    nxt = jnp.broadcast_to(_f32(grad_rms_out)[..., None], g.shape[:-1] + (1,))
  denom = jnp.concatenate([g[..., 1:], nxt], axis=-1)
  return g / denom


# --------------------------------------------------------------------------- Amax gains
def amax_fwd(h) -> jax.Array:
  """Forward Amax gain: max_i |sum_j h_ij| over the last two axes ([..., n, n] -> [...])."""
  return jnp.max(jnp.abs(jnp.sum(_f32(h), axis=-1)), axis=-1)


def amax_bwd(h) -> jax.Array:
  """Backward Amax gain: max_j |sum_i h_ij| over the last two axes ([..., n, n] -> [...])."""
  return jnp.max(jnp.abs(jnp.sum(_f32(h), axis=-2)), axis=-1)


@jax.jit
def amin_fwd(h) -> jax.Array:
  """Forward attenuation: min_i |sum_j h_ij| over the last two axes ([..., n, n] -> [...])."""
  return jnp.min(jnp.abs(jnp.sum(_f32(h), axis=-1)), axis=-1)


def amin_bwd(h) -> jax.Array:
  """Backward attenuation: min_j |sum_i h_ij| over the last two axes ([..., n, n] -> [...])."""
  return jnp.min(jnp.abs(jnp.sum(_f32(h), axis=-2)), axis=-1)


def composite(h_L) -> jax.Array:
  """Running products ``P_l = H_l @ ... @ H_0`` of ``h_L [..., 2L, n, n]`` (same shape), by a
  parallel associative scan (equal to a left-to-right loop up to rounding)."""
  h = _f32(h_L)
  # associative_scan combines (earlier, later); the later layer multiplies on the left.
  return lax.associative_scan(lambda a, b: jnp.matmul(b, a), h, axis=-3)


@jax.jit
def suffix(h_L) -> jax.Array:
  """Suffix products ``S_l = H_{2L-1} @ ... @ H_l`` ([..., 2L, n, n]): layer ``l`` to the output
  (the mHC paper's Eq. 4); ``S_0`` is the whole-depth prefix product ``P_{2L-1}``."""
  h = jnp.flip(_f32(h_L), axis=-3)
  # Reversed, the earlier element is the later layer, which multiplies on the left.
  return jnp.flip(lax.associative_scan(jnp.matmul, h, axis=-3), axis=-3)


def token_composite_gains(h_tok) -> dict[str, jax.Array]:
  """``amax_{fwd,bwd}_composite_tok_{mean,max}`` ([..., 2L] each): the Amax gains of each sampled
  token's own prefix product, averaged and maxed over the tokens (``h_tok [..., 2L, S, n, n]``)."""
  p = composite(jnp.swapaxes(_f32(h_tok), -3, -4))  # [..., S, 2L, n, n]
  out = {}
  for d, fn in (("fwd", amax_fwd), ("bwd", amax_bwd)):
    g = fn(p)  # [..., S, 2L]
    out[f"amax_{d}_composite_tok_mean"] = jnp.mean(g, axis=-2)
    out[f"amax_{d}_composite_tok_max"] = jnp.max(g, axis=-2)
  return out


def amax_fwd_composite(h_L) -> jax.Array:
  """Forward Amax gain of each running product ``P_l`` ([..., 2L, n, n] -> [..., 2L])."""
  return amax_fwd(composite(h_L))


def amax_bwd_composite(h_L) -> jax.Array:
  """Backward Amax gain of each running product ``P_l`` ([..., 2L, n, n] -> [..., 2L])."""
  return amax_bwd(composite(h_L))


def _log_colsum_max_of(p, floor: float = LOG_FLOOR) -> jax.Array:
  colsum = jnp.sum(p, axis=-2)
  return jnp.max(jnp.abs(jnp.log(jnp.maximum(jnp.abs(colsum), floor))), axis=-1)


def log_colsum_max(h_L, floor: float = LOG_FLOOR) -> jax.Array:
  """``max_j |log(column sum j of P_l)|`` per depth ([..., 2L, n, n] -> [..., 2L]), 0 for a
  column-stochastic composite; a sum ``s`` is read as ``max(|s|, floor)`` (unconstrained HC can
  give s <= 0: a zero sum reads as ~69, "very far off"); NaN stays NaN."""
  return _log_colsum_max_of(composite(h_L), floor)


# --------------------------------------------------------------------------- is H_res used
def h_res_diag(h_L) -> jax.Array:
  """Mean diagonal of each layer's ``H_res`` ([..., 2L, n, n] -> [..., 2L]): 1 at ``I``, ``1/n``
  at ``J/n``."""
  return jnp.mean(jnp.diagonal(_f32(h_L), axis1=-2, axis2=-1), axis=-1)


def h_res_dynamic_share(h_tok) -> jax.Array:
  """``Σ_s ||H_s - H̄||² / Σ_s ||H_s - J/n||²`` over the token sample ([..., 2L, S, n, n] ->
  [..., 2L]), in [0, 1], 0 for a static ``H_res``; docs/interfaces.md."""
  h = _f32(h_tok)
  n = h.shape[-1]
  var = jnp.sum(jnp.square(h - jnp.mean(h, axis=-3, keepdims=True)), axis=(-3, -2, -1))
  tot = jnp.sum(jnp.square(h - 1.0 / n), axis=(-3, -2, -1))
  return jnp.where(tot > 0, var / jnp.where(tot > 0, tot, 1.0), 0.0)


# --------------------------------------------------------------------------- parameter trees
def _sq_leaves(tree):
  return [jnp.square(_f32(x)) for x in jax.tree_util.tree_leaves(tree)]


def tree_layer_norms(tree) -> jax.Array:
  """L2 norm per layer across all leaves of a pytree whose leaves are [L, ...] (the scanned
  parameters or their gradients) -> [L]; ValueError for an empty tree or mismatched axes."""
  leaves = _sq_leaves(tree)
  if not leaves:
    raise ValueError("tree_layer_norms: empty pytree (no leaves, so no layer axis)")
  n_layers = {x.shape[0] if x.ndim else None for x in leaves}
  if len(n_layers) != 1 or None in n_layers:
    raise ValueError(
      f"tree_layer_norms: leaves must share a leading layer axis, got sizes {n_layers}"
    )
  total = sum(x.reshape(x.shape[0], -1).sum(axis=1) for x in leaves)
  return jnp.sqrt(total)


def tree_norm(tree) -> jax.Array:
  """Global L2 norm of all leaves (0 for an empty tree)."""
  leaves = _sq_leaves(tree)
  return jnp.sqrt(sum((x.sum() for x in leaves), jnp.zeros((), jnp.float32)))


def tree_rms(tree) -> jax.Array:
  """Root mean square over every element of every leaf (NaN for an empty tree)."""
  leaves = _sq_leaves(tree)
  count = sum(x.size for x in leaves)
  if count == 0:
    return jnp.full((), jnp.nan, jnp.float32)
  return jnp.sqrt(sum(x.sum() for x in leaves) / count)


# --------------------------------------------------------------------------- all at once
def layer_metrics(
  stats: Mapping[str, Any], grad_rms=None, grad_rms_out=None
) -> dict[str, jax.Array]:
  """The per-layer metrics (docs/interfaces.md) of the stacked mixer stats (``h_res [2L, n, n]``,
  ``h_res_tok [2L, S, n, n]``, ``rms_in``, ``rms_out``, ``branch_rms [2L]``; the metrics of a
  missing one are skipped) and ``grad_rms`` / ``grad_rms_out`` (:func:`gain_bwd`); the
  token-averaged ``h_res`` is passed on as ``h_res_avg``, the :data:`_PASS_THROUGH` stats as
  float32."""
  out: dict[str, jax.Array] = {}
  if "rms_in" in stats and "rms_out" in stats:
    out["gain_fwd"] = gain_fwd(stats["rms_in"], stats["rms_out"])
  if "rms_in" in stats and "branch_rms" in stats:
    out["branch_ratio"] = branch_ratio(stats["branch_rms"], stats["rms_in"])
  if "h_res" in stats:
    h = _f32(stats["h_res"])
    p, sfx = composite(h), suffix(h)
    for d, amax, amin in (("fwd", amax_fwd, amin_fwd), ("bwd", amax_bwd, amin_bwd)):
      out[f"amax_{d}"] = amax(h)
      out[f"amax_{d}_composite"] = amax(p)
      out[f"amin_{d}_composite"] = amin(p)
      out[f"amax_{d}_suffix"] = amax(sfx)
    out["log_colsum_max"] = _log_colsum_max_of(p)
    out["h_res_diag"] = h_res_diag(h)
    out["h_res_avg"] = h  # for h_res_shift, which the run's Recorder forms (not logged)
  if "h_res_tok" in stats:
    out.update(token_composite_gains(stats["h_res_tok"]))
    out["h_res_dynamic_share"] = h_res_dynamic_share(stats["h_res_tok"])
  if grad_rms is not None:
    out["grad_rms"] = _f32(grad_rms)
    out["gain_bwd"] = gain_bwd(grad_rms, grad_rms_out)
  for key in _PASS_THROUGH:
    if key in stats:
      out[key] = _f32(stats[key])
  return out
