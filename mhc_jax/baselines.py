"""A parameter-matched MLP baseline that sees the context through a fixed causal window.

`WindowMLP` embeds tokens and applies an MLP to the embeddings of tokens `t - window + 1 .. t`
(zeros before the start): its first layer is a causal 1-D convolution with kernel `window`, then
`depth - 1` hidden GELU layers; `match_width` picks the width for a target parameter count.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


class WindowMLP(nn.Module):
  vocab: int
  width: int
  window: int
  depth: int = 2
  embed_dim: int = 64

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    """tokens [B,T] int -> logits [B,T,vocab] float32."""
    if self.window < 1 or self.depth < 1:
      raise ValueError(f"window and depth must be >= 1, got {self.window}, {self.depth}")
    x = nn.Embed(self.vocab, self.embed_dim, name="embed")(tokens)
    h = nn.Conv(
      self.width, kernel_size=(self.window,), padding=[(self.window - 1, 0)], name="window"
    )(x)
    h = nn.gelu(h)
    for i in range(self.depth - 1):
      h = nn.gelu(nn.Dense(self.width, name=f"hidden_{i}")(h))
    return nn.Dense(self.vocab, name="head")(h).astype(jnp.float32)


def param_count(params) -> int:
  """Total number of scalars in a parameter pytree."""
  return int(sum(np.prod(np.shape(x)) for x in jax.tree_util.tree_leaves(params)))


def window_mlp_param_count(
  vocab: int, width: int, window: int, depth: int, embed_dim: int = 64
) -> int:
  """Closed-form parameter count of `WindowMLP` (equals `param_count` of its init)."""
  E, W, K, L, V = embed_dim, width, window, depth, vocab
  return V * E + (K * E * W + W) + (L - 1) * (W * W + W) + (W * V + V)


def match_width(
  target_params: int, vocab: int, window: int, depth: int, embed_dim: int = 64, rtol: float = 0.05
) -> int:
  """The width whose `WindowMLP` parameter count is closest to `target_params`.

  Raises ValueError if even the best width is more than `rtol` away (e.g. a target smaller than
  the embedding and head alone).
  """
  E, K, L, V = embed_dim, window, depth, vocab
  # count(W) = a W^2 + b W + c
  a, b, c = L - 1, K * E + 1 + (L - 1) + V, V * E + V
  rest = target_params - c
  w0 = rest / b if a == 0 else (-b + math.sqrt(max(b * b + 4 * a * rest, 0.0))) / (2 * a)
  cands = {max(1, int(math.floor(w0)) + d) for d in (-1, 0, 1, 2)}
  best = min(cands, key=lambda w: abs(window_mlp_param_count(V, w, K, L, E) - target_params))
  got = window_mlp_param_count(V, best, K, L, E)
  if abs(got - target_params) > rtol * target_params:
    raise ValueError(
      f"no WindowMLP width matches {target_params} parameters within {rtol:.0%} "
      f"(best width {best} has {got}); lower embed_dim/window/depth"
    )
  return best
