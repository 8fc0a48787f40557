"""Parameter counts: measured from a parameter tree, and the closed form from a config."""

from __future__ import annotations

import jax
import numpy as np

MIXER_KEYS = ("attn_mix", "mlp_mix", "collapse")


def _size(tree) -> int:
  return int(sum(np.prod(np.shape(l)) for l in jax.tree.leaves(tree)))


def _counts(total: int, embedding: int, mixer: int) -> dict[str, int]:
  return dict(total=total, embedding=embedding, non_embedding=total - embedding, mixer=mixer)


def count_params(params) -> dict[str, int]:
  """``total``, ``embedding`` (token table, plus an untied head), ``non_embedding``, ``mixer``."""
  params = params.get("params", params)
  total = _size(params)
  embedding = _size(params.get("embedding", {})) + _size(params.get("head", {}))
  mixer = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    keys = [getattr(k, "key", None) for k in path]
    if any(k in MIXER_KEYS for k in keys):
      mixer += int(np.prod(np.shape(leaf)))
  return _counts(total, embedding, mixer)


def expected_params(cfg) -> dict[str, int]:
  """The closed-form counts for a ModelConfig (vocab resolved); must equal ``count_params``.

  The mixer's share comes from the mixer itself (``layer_params``, ``collapse_params``).
  """
  from mhc_jax.model.transformer import make_mixer

  c, v, L = cfg.width, cfg.vocab, cfg.depth
  hidden, d = int(c * cfg.mlp_ratio), c // cfg.heads
  mix = make_mixer(cfg)
  embedding = v * c + (0 if cfg.tied_embeddings else c * v)
  norms = 2 * c if type(mix).pre_norm else 0
  block = 4 * c * c + 2 * c * hidden + norms + (2 * d if cfg.qk_norm else 0)
  mixer = 2 * L * mix.layer_params(c) + mix.collapse_params(c)
  return _counts(embedding + L * block + c + mixer, embedding, mixer)
