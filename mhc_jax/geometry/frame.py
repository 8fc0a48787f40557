"""The wind-tunnel authors' formation statistics, rebuilt from their definitions: the entropy MAE
in bits, the Jacobian-lens frame overlap against a matched random-subspace null, and the gate
that lets the value manifold count only on a model that has learned.

docs/windtunnel_results.md ("The formation statistics") gives each definition, the authors' file
it follows (vishalmisra/bayesian-wind-tunnel, experiments/jlens) and where this one differs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mhc_jax import posterior as P
from mhc_jax.model.transformer import zero_probes

FRAME_RANK = 8  # J-space dimension (their primary r)
FRAME_LAYERS = (0, 1)  # residual before block 0 (the embedding) and before block 1: 'emb', '0'
FRAME_NULLS = 500  # random subspaces in the null (their phase 5)
FRAME_SEQUENCES = 16  # validation sequences the Jacobian sweep reads (theirs: 256)
FRAME_CHUNK = 4  # sequences per vmapped sweep
GATE_FACTOR = 10.0  # a model has learned where its KL <= the uniform guess's / GATE_FACTOR


def entropy_mae(logits, posterior, mask, hyp) -> dict:
  """Their calibration error: per supervised position |H_model - H_bayes| in bits, the model's
  entropy over the hypothesis tokens' logits `hyp` alone, the mean over the positions in `mask`
  (``mae``); ``mae_uniform``: the same for the uniform guess over `hyp`."""
  m = np.asarray(mask) > 0
  h_bayes = np.asarray(P.entropy_bits_pointwise(jnp.asarray(posterior)))[m]
  h_model = np.asarray(P.model_entropy_bits_pointwise(jnp.asarray(logits)[..., hyp]))[m]
  mae = lambda h: float(np.abs(h - h_bayes).mean())
  return {"mae": mae(h_model), "mae_uniform": mae(np.log2(len(hyp)))}


def learned(kl: float, kl_uniform: float, factor: float = GATE_FACTOR) -> bool:
  """The gate: KL at most the uniform guess's KL / `factor` on the same positions."""
  return bool(np.isfinite(kl) and kl <= kl_uniform / factor)


_GRAM_FNS: dict = {}


def _gram_fn(model, hyp: tuple, layers: tuple, first: int, last: int):
  """Jitted ``(params, tokens [B, T]) -> Gram [len(layers), T, C, C]`` (float32), cached per
  model config (an arm's seeds compile it once)."""
  key = (repr(model.cfg), hyp, layers, first, last)
  if key in _GRAM_FNS:
    return _GRAM_FNS[key]
  hyp_a = jnp.asarray(hyp)
  targets = jnp.arange(first + 1, last + 1)

  def grams(params, tokens):
    B, T = tokens.shape
    probes, _ = zero_probes(model.cfg, B, T)
    V = len(hyp)

    def logits_of(pr):
      return model.apply(params, tokens, probes=pr, stats=False)[0][..., hyp_a]

    _, vjp = jax.vjp(logits_of, probes)

    def target(acc, p):  # one backward per hypothesis logit at target position p
      cot = jnp.eye(V)[:, None, None, :] * jax.nn.one_hot(p, T)[None, None, :, None]
      (g,) = jax.vmap(vjp)(jnp.broadcast_to(cot, (V, B, T, V)))
      rows = []
      for leaf in jax.tree.leaves(g):  # [V, L, 2, B, T, ...state]
        C = leaf.shape[-1]
        x = jnp.stack([leaf[:, lyr, 0] for lyr in layers])  # [K, V, B, T, ...]
        x = jnp.moveaxis(x.reshape(len(layers), V * B, T, -1, C), 2, 1)  # streams are rows
        rows.append(x.reshape(len(layers), T, -1, C))
      x = jnp.concatenate(rows, axis=2) * (jnp.arange(T) < p)[None, :, None, None]
      return acc + jnp.einsum("ktrc,ktrd->ktcd", x, x), None

    C = model.cfg.width
    acc0 = jnp.zeros((len(layers), T, C, C), jnp.float32)
    return jax.lax.scan(target, acc0, targets)[0]

  _GRAM_FNS[key] = jax.jit(grams)
  return _GRAM_FNS[key]


def jacobian_grams(model, params, tokens, hyp, first: int, last: int, layers=FRAME_LAYERS):
  """Their stacked J-lens Gram: for each layer in `layers` (the mixer state before that block's
  attention) and source position i, sum over sequences, hypothesis tokens v in `hyp` and
  targets p' in (i, `last`] (min horizon 1; `first` < p') of g g^T, g = d logit[p', v] / d x_i.
  ``[len(layers), T, C, C]`` float64; multi-stream states give one row per stream."""
  fn = _gram_fn(model, tuple(int(h) for h in hyp), tuple(layers), int(first), int(last))
  tokens = np.asarray(tokens)
  total = 0.0
  for s in range(0, len(tokens), FRAME_CHUNK):
    total = total + np.asarray(fn(params, jnp.asarray(tokens[s : s + FRAME_CHUNK])), np.float64)
  return total


def orthonormal(directions) -> np.ndarray:
  """An orthonormal basis ``[C, k]`` of the span of the rows of `directions [k, C]`."""
  return np.linalg.qr(np.asarray(directions, np.float64).T)[0]


def frame_overlap(grams, positions, frame, *, rank=FRAME_RANK, nulls=FRAME_NULLS, seed=0) -> dict:
  """Overlap of each J-space (top-`rank` eigenvectors of ``grams [K, T, C, C]`` at `positions`)
  with the span of `frame [k, C]`, against `nulls` random `rank`-dimensional subspaces. A
  position with no Jacobian rows (no later target: a zero Gram) is left out, as theirs. ``ratio``:
  mean overlap / null mean; ``null_std``: one random subspace's overlap's s.d."""
  W = orthonormal(frame)
  g = np.asarray(grams, np.float64)[:, np.asarray(positions)]
  g = g[:, np.einsum("kpcc->p", np.abs(g)) > 0]
  _, vecs = np.linalg.eigh(g)  # ascending eigenvalues
  U = vecs[..., -rank:]
  ov = np.sum(np.einsum("kpcr,cf->kprf", U, W) ** 2, axis=(-2, -1)) / min(rank, W.shape[1])
  rng = np.random.default_rng(seed)
  R = np.linalg.qr(rng.standard_normal((nulls, W.shape[0], rank)))[0]
  null = np.sum(np.einsum("ncr,cf->nrf", R, W) ** 2, axis=(-2, -1)) / min(rank, W.shape[1])
  mu = float(null.mean())
  return {
    "ratio": float(ov.mean()) / mu,
    "overlap": float(ov.mean()),
    "null_mean": mu,
    "null_std": float(null.std()),
    "ratio_by_layer": ov.mean(axis=1) / mu,
  }
