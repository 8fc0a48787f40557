"""Parameter counts: measured from a parameter tree, and the closed form from a config."""
from __future__ import annotations

import math

import jax
import numpy as np

MIXER_KEYS = ("attn_mix", "mlp_mix", "collapse")


def _size(tree) -> int:
  return int(sum(np.prod(np.shape(l)) for l in jax.tree.leaves(tree)))


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
  return {"total": total, "embedding": embedding, "non_embedding": total - embedding,
          "mixer": mixer}


def mixer_layer_params(mixer: str, n: int, c: int, dynamic: bool = True) -> int:
  """Parameters of one mixer layer, closed form."""
  if mixer == "residual":
    return 0
  if mixer == "hc":
    return 2 * n + n * n + ((2 * c + c * n + 2) if dynamic else 0)
  r = n * n if mixer == "mhc" else math.factorial(n)
  if mixer in ("mhc", "mhc_lite"):
    return 2 * n + r + ((n * c * (2 * n + r) + 3) if dynamic else 0)
  raise ValueError(f"no closed-form count for mixer {mixer!r}")


def expected_params(cfg) -> dict[str, int]:
  """The closed-form counts for a ModelConfig (vocab resolved); must equal ``count_params``."""
  from mhc_jax.model.transformer import streams
  c, v, L = cfg.width, cfg.vocab, cfg.depth
  hidden, d = int(c * cfg.mlp_ratio), c // cfg.heads
  n = streams(cfg)
  embedding = v * c + (0 if cfg.tied_embeddings else c * v)
  block = 4 * c * c + 2 * c * hidden + 2 * c + (2 * d if cfg.qk_norm else 0)
  dynamic = cfg.mixer_options.get("dynamic", True)
  mixer = 2 * L * mixer_layer_params(cfg.mixer, n, c, dynamic)
  mixer += n if cfg.mixer_options.get("collapse", "sum") == "learned" and n > 1 else 0
  total = embedding + L * block + c + mixer
  return {"total": total, "embedding": embedding, "non_embedding": total - embedding,
          "mixer": mixer}
