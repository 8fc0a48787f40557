"""A decoder-only Transformer whose residual connection is a pluggable mixer.

``embed -> mixer.expand -> L blocks (nn.scan) -> Collapse -> RMSNorm -> LM head``. Each block is
``mixer(norm + attention)`` then ``mixer(norm + MLP)``: 2L mixer layers, indexed
``2·block`` (attention) and ``2·block + 1`` (MLP).

``apply(params, tokens_BT, probes=None)`` returns ``(logits_BTV float32, aux)``; ``aux`` has the
mixer stats stacked over the 2L layers (``aux["stats"][k]`` is ``[2L, ...]``), the max
pre-softmax attention logit per block ``[L]``, and output-logit statistics. ``probes``
(``[L, 2, B, T, n, C]``, zeros) are added to the stream state before each mixer call, so the
gradient with respect to them is dLoss/d(stream state) at every mixer layer; ``out_probe``
(``[B, T, n, C]``) does the same at the collapse input (after the last mixer layer).
Residual states, queries, keys and attention weights are sown into ``intermediates``.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from mhc_jax import mixers
from mhc_jax.mixers.base import Collapse
from mhc_jax.model.layers import MLP, Attention, RMSNorm, kernel_init

REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def _dtype(name: str):
  return jnp.dtype(name)


def streams(cfg) -> int:
  return int(cfg.mixer_options.get("n", 1 if cfg.mixer == "residual" else 4))


def mixer_kwargs(cfg) -> dict:
  """Mixer options with the stream count filled in."""
  return dict(cfg.mixer_options) | {"n": streams(cfg)}


class Block(nn.Module):
  """One Transformer block: two mixer calls. Scanned: ``(x, (index, probe)) -> (x, ys)``."""

  cfg: object

  @nn.compact
  def __call__(self, x_BTnC, xs):
    cfg = self.cfg
    i, probe = xs
    dt = _dtype(cfg.dtype)
    out_scale = 1.0 / math.sqrt(2 * cfg.depth) if cfg.init == "depth_scaled" else 1.0
    opts = mixer_kwargs(cfg)
    attn_norm, mlp_norm = RMSNorm(dt, name="attn_norm"), RMSNorm(dt, name="mlp_norm")
    attn = Attention(cfg.heads, cfg.rope, cfg.qk_norm, dt, out_scale, cfg.init_scale, name="attn")
    mlp = MLP(int(cfg.width * cfg.mlp_ratio), dt, out_scale, cfg.init_scale, name="mlp")
    logit_max = []

    def attn_sub(h):
      y, m = attn(attn_norm(h))
      logit_max.append(m)
      return y

    def mlp_sub(h):
      return mlp(mlp_norm(h))

    if probe is not None:
      x_BTnC = x_BTnC + probe[0].astype(x_BTnC.dtype)
    x_BTnC, s_attn = mixers.get(cfg.mixer, module_name="attn_mix", **opts)(x_BTnC, attn_sub, 2 * i)
    if probe is not None:
      x_BTnC = x_BTnC + probe[1].astype(x_BTnC.dtype)
    x_BTnC, s_mlp = mixers.get(cfg.mixer, module_name="mlp_mix", **opts)(x_BTnC, mlp_sub, 2 * i + 1)
    self.sow("intermediates", "stream", x_BTnC)
    stats = jax.tree.map(lambda a, b: jnp.stack([a, b]), s_attn, s_mlp)
    return x_BTnC, (stats, logit_max[0])


def _block_cls(cfg):
  cls = Block
  if cfg.remat != "none":
    cls = nn.remat(Block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan)
  return cls


class Transformer(nn.Module):
  cfg: object  # mhc_jax.train.config.ModelConfig (vocab resolved)

  @nn.compact
  def __call__(self, tokens_BT, probes=None, out_probe=None):
    cfg = self.cfg
    dt, L, c = _dtype(cfg.dtype), cfg.depth, cfg.width
    embed = self.param("embedding", nn.with_logical_partitioning(
        nn.initializers.normal(1.0), ("vocab", "embed")), (cfg.vocab, c), jnp.float32)
    x_BTC = jnp.take(embed, tokens_BT, axis=0).astype(dt)
    x = mixers.get(cfg.mixer, **mixer_kwargs(cfg)).expand(x_BTC)
    block = _block_cls(cfg)
    idx = jnp.arange(L)
    if cfg.scan:
      scanned = nn.scan(block, variable_axes={"params": 0, "intermediates": 0},
                        split_rngs={"params": True}, in_axes=0, length=L,
                        metadata_params={nn.PARTITION_NAME: "layers"})
      x, (stats, logit_max) = scanned(cfg, name="blocks")(x, (idx, probes))
    else:
      ys = []
      for l in range(L):
        x, y = block(cfg, name=f"block_{l}")(x, (l, None if probes is None else probes[l]))
        ys.append(y)
      stats, logit_max = jax.tree.map(lambda *a: jnp.stack(a), *ys)
    stats = jax.tree.map(lambda a: a.reshape((2 * L,) + a.shape[2:]), stats)
    if out_probe is not None:
      x = x + out_probe.astype(x.dtype)
    x = Collapse(streams(cfg), cfg.mixer_options.get("collapse", "sum"), name="collapse")(x)
    h_BTC = RMSNorm(dt, name="final_norm")(x)
    if cfg.tied_embeddings:
      logits = jnp.einsum("btc,vc->btv", h_BTC, embed.astype(dt)) / math.sqrt(c)
    else:
      logits = nn.Dense(cfg.vocab, use_bias=False, dtype=dt, name="head",
                        kernel_init=nn.with_logical_partitioning(kernel_init(cfg.init_scale),
                                                                 ("embed", "vocab")))(h_BTC)
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    aux = {"stats": stats, "attn_logit_max": logit_max, "out_logit_max": jnp.max(logits),
           "logsumexp_mean": jnp.mean(lse), "logsumexp_max": jnp.max(lse)}
    return logits, aux


def probe_shape(cfg, batch: int, length: int) -> tuple[int, ...]:
  return (cfg.depth, 2, batch, length, streams(cfg), cfg.width)


def scan_to_loop(params: dict, depth: int) -> dict:
  """Scanned parameters (``blocks`` with a leading L axis) -> per-block ``block_{l}`` trees."""
  params = dict(params)
  blocks = params.pop("blocks")
  for l in range(depth):
    params[f"block_{l}"] = jax.tree.map(lambda a: a[l], blocks)
  return params


def loop_to_scan(params: dict, depth: int) -> dict:
  params = dict(params)
  per = [params.pop(f"block_{l}") for l in range(depth)]
  params["blocks"] = jax.tree.map(lambda *a: jnp.stack(a), *per)
  return params
