"""Posterior-fidelity metrics: how close a model's predictive distribution is to the exact one.

Pure jnp, jit-safe, in **bits**. Shapes: `posterior [B,T,V]` (the exact posterior over the whole
vocabulary, as in wind-tunnel batches), `logits [B,T,V]`, `mask [B,T]` (1 where a position
counts). Scalars are means over masked positions; `*_per_position` curves are means per position
index, or per value of an integer `groups [B,T]` such as `evidence`, NaN where a group is empty.
docs/windtunnel_results.md ("What eval.json holds") defines each metric.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

LN2 = math.log(2.0)


def log_probs(logits: jax.Array) -> jax.Array:
  return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def entropy_bits_pointwise(p: jax.Array) -> jax.Array:
  p = p.astype(jnp.float32)
  return jnp.maximum(-jnp.sum(jax.scipy.special.xlogy(p, p), axis=-1) / LN2, 0.0)


def model_entropy_bits_pointwise(logits: jax.Array) -> jax.Array:
  lq = log_probs(logits)
  plogp = jnp.where(jnp.isfinite(lq), jnp.exp(lq) * lq, 0.0)  # logits may hold -inf
  return jnp.maximum(-jnp.sum(plogp, axis=-1) / LN2, 0.0)


def kl_bits_pointwise(posterior: jax.Array, logits: jax.Array) -> jax.Array:
  """KL(posterior || softmax(logits)) in bits, [B,T]; 0 log 0 = 0."""
  p = posterior.astype(jnp.float32)
  lq = log_probs(logits)
  cross = jnp.sum(jnp.where(p > 0, p * lq, 0.0), axis=-1)
  kl = (jnp.sum(jax.scipy.special.xlogy(p, p), axis=-1) - cross) / LN2
  return jnp.maximum(kl, 0.0)


def entropy_gap_bits_pointwise(posterior: jax.Array, logits: jax.Array) -> jax.Array:
  return jnp.abs(entropy_bits_pointwise(posterior) - model_entropy_bits_pointwise(logits))


def correct_pointwise(posterior: jax.Array, logits: jax.Array, targets: jax.Array | None = None):
  pred = jnp.argmax(logits, axis=-1)
  if targets is not None:
    return (pred == targets).astype(jnp.float32)
  return jnp.take_along_axis(posterior.astype(jnp.float32), pred[..., None], axis=-1)[..., 0]


def confidence_pointwise(logits: jax.Array) -> jax.Array:
  return jnp.exp(jnp.max(log_probs(logits), axis=-1))


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  mask = mask.astype(jnp.float32)
  # where, not a product: a NaN at a masked-out position must not leak into the mean
  return jnp.sum(jnp.where(mask > 0, values * mask, 0.0)) / jnp.maximum(jnp.sum(mask), 1.0)


def _group_ids(mask: jax.Array, groups: jax.Array | None, num_groups: int | None):
  B, T = mask.shape
  if groups is None:
    return jnp.broadcast_to(jnp.arange(T), (B, T)), T
  return groups.astype(jnp.int32), int(T + 1 if num_groups is None else num_groups)


@functools.partial(jax.jit, static_argnames="num_groups")
def group_count(mask: jax.Array, groups: jax.Array | None = None, num_groups: int | None = None):
  """Number of masked positions in each group (position index, or value of `groups`)."""
  ids, G = _group_ids(mask, groups, num_groups)
  return jax.ops.segment_sum(mask.astype(jnp.float32).reshape(-1), ids.reshape(-1), G)


@functools.partial(jax.jit, static_argnames="num_groups")
def group_mean(
  values: jax.Array, mask: jax.Array, groups: jax.Array | None = None, num_groups: int | None = None
) -> jax.Array:
  """Masked mean of `values [B,T]` per group; NaN for empty groups. Ids >= num_groups drop."""
  ids, G = _group_ids(mask, groups, num_groups)
  m = mask.astype(jnp.float32).reshape(-1)
  s = jax.ops.segment_sum(jnp.where(m > 0, values.reshape(-1) * m, 0.0), ids.reshape(-1), G)
  n = jax.ops.segment_sum(m, ids.reshape(-1), G)
  return jnp.where(n > 0, s / jnp.maximum(n, 1.0), jnp.nan)


def _ece_sums(posterior, logits, mask, ids, G, n_bins):
  m = mask.astype(jnp.float32).reshape(-1)
  correct = correct_pointwise(posterior, logits)
  conf = jnp.where(mask > 0, confidence_pointwise(logits), 0.0)
  bins = jnp.clip(jnp.floor(conf * n_bins).astype(jnp.int32), 0, n_bins - 1)
  seg = (ids * n_bins + bins).reshape(-1)
  gap = jnp.where(m > 0, (conf - correct).reshape(-1) * m, 0.0)
  gap = jax.ops.segment_sum(gap, seg, G * n_bins)
  per_group = jnp.sum(jnp.abs(gap.reshape(G, n_bins)), axis=-1)
  n = jax.ops.segment_sum(m, ids.reshape(-1), G)
  return per_group, n


@jax.jit
def kl_bits(posterior, logits, mask) -> jax.Array:
  """Mean KL(posterior || model) in bits over masked positions."""
  return masked_mean(kl_bits_pointwise(posterior, logits), mask)


@jax.jit
def entropy_gap_bits(posterior, logits, mask) -> jax.Array:
  """Mean |H(posterior) - H(model)| in bits over masked positions."""
  return masked_mean(entropy_gap_bits_pointwise(posterior, logits), mask)


@jax.jit
def accuracy(posterior, logits, mask, targets=None) -> jax.Array:
  """Mean expected top-1 accuracy under the posterior (or against `targets` when given)."""
  return masked_mean(correct_pointwise(posterior, logits, targets), mask)


@functools.partial(jax.jit, static_argnames="n_bins")
def ece(posterior, logits, mask, n_bins: int = 10) -> jax.Array:
  """Expected calibration error over masked positions (equal-width confidence bins)."""
  ids = jnp.zeros(mask.shape, jnp.int32)
  s, n = _ece_sums(posterior, logits, mask, ids, 1, n_bins)
  return (s / jnp.maximum(n, 1.0))[0]


@functools.partial(jax.jit, static_argnames="num_groups")
def kl_bits_per_position(posterior, logits, mask, groups=None, num_groups=None) -> jax.Array:
  return group_mean(kl_bits_pointwise(posterior, logits), mask, groups, num_groups)


@functools.partial(jax.jit, static_argnames=("num_groups", "n_bins"))
def ece_per_position(posterior, logits, mask, groups=None, num_groups=None, n_bins: int = 10):
  ids, G = _group_ids(mask, groups, num_groups)
  s, n = _ece_sums(posterior, logits, mask, ids, G, n_bins)
  return jnp.where(n > 0, s / jnp.maximum(n, 1.0), jnp.nan)


@jax.jit
def soft_cross_entropy(posterior, logits, mask) -> jax.Array:
  """Cross-entropy against the posterior as a soft target, in nats (a training loss;
  equals KL(posterior || model) plus the posterior entropy, so its gradient is KL's)."""
  ce = -jnp.sum(posterior.astype(jnp.float32) * log_probs(logits), axis=-1)
  return masked_mean(ce, mask)


@functools.partial(jax.jit, static_argnames=("n_bins", "num_groups"))
def fidelity_metrics(batch: dict, logits: jax.Array, *, n_bins: int = 10, num_groups=None) -> dict:
  """All fidelity metrics for a wind-tunnel batch (needs `posterior` and `mask`): the scalars,
  `<metric>_by_position [T]` and, where the batch has `evidence`, `<metric>_by_evidence
  [num_groups]` (default T + 1), with `count_by_*`; empty groups are NaN."""
  p, mask = batch["posterior"], batch["mask"]
  T = mask.shape[1]
  point = {
    "kl_bits": kl_bits_pointwise(p, logits),
    "entropy_gap_bits": entropy_gap_bits_pointwise(p, logits),
    "accuracy": correct_pointwise(p, logits),
    "posterior_entropy_bits": entropy_bits_pointwise(p),
    "model_entropy_bits": model_entropy_bits_pointwise(logits),
  }
  out = {k: masked_mean(v, mask) for k, v in point.items()}
  out["ece"] = ece(p, logits, mask, n_bins)
  groupings = {"position": (None, None)}
  if "evidence" in batch:
    groupings["evidence"] = (batch["evidence"], num_groups or T + 1)
  for gname, (g, G) in groupings.items():
    for k in ("kl_bits", "entropy_gap_bits", "accuracy"):
      out[f"{k}_by_{gname}"] = group_mean(point[k], mask, g, G)
    out[f"ece_by_{gname}"] = ece_per_position(p, logits, mask, g, G, n_bins)
    out[f"count_by_{gname}"] = group_count(mask, g, G)
  return out
