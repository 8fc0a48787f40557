"""A decoder-only Transformer whose residual connection is a pluggable mixer.

``embed -> mixer.expand -> L blocks (nn.scan) -> Collapse -> RMSNorm -> LM head``. Each block is
``mixer(norm + attention)`` then ``mixer(norm + MLP)``: 2L mixer layers, indexed
``2·block`` (attention) and ``2·block + 1`` (MLP).

``apply(params, tokens_BT, probes=None)`` returns ``(logits_BTV float32, aux)``; ``aux`` has the
mixer stats stacked over the 2L layers (``aux["stats"][k]`` is ``[2L, ...]``), the max
pre-softmax attention logit per block ``[L]``, and output-logit statistics
(``stats=False``: the output-logit statistics only, the per-layer ones are not computed). ``probes``
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

from mhc_jax import mixers, parametrization as mp, sinkhorn as sk
from mhc_jax.model.layers import MLP, Attention, RMSNorm, _kernel

REMAT_POLICIES = {
  "full": None,
  # matmul outputs, and the Sinkhorn projection's small per-token results (sinkhorn.REMAT_NAME),
  # so the backward does not run its iterations a second time
  "dots": jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    jax.checkpoint_policies.save_only_these_names(sk.REMAT_NAME),
  ),
}


def make_mixer(cfg, name: str | None = None) -> mixers.Mixer:
  """The config's mixer (``module_name=name``), told the model's 2L mixer layers."""
  return mixers.get(cfg.mixer, module_name=name, layers=2 * cfg.depth, **cfg.mixer_options)


def streams(cfg) -> int:
  """The mixer's stream count ``n`` (1 for single-stream mixers)."""
  return int(getattr(make_mixer(cfg), "n", 1))


@jax.custom_vjp
def sq_norm_tap(x, p):
  """``x`` unchanged; the "gradient" of the scalar ``p`` is ``Σ g²`` over the cotangent ``g``
  of ``x``: the squared norm of dLoss/dx, without the model keeping dLoss/dx itself."""
  del p
  return x


def _tap_fwd(x, p):
  return x, None


def _tap_bwd(_, g):
  return g, jnp.sum(jnp.square(g.astype(jnp.float32)))


sq_norm_tap.defvjp(_tap_fwd, _tap_bwd)


def _add(state, probe):
  """Add a zero probe (same pytree as the state) so its gradient is dLoss/d(state); a probe leaf
  that is a scalar where the state's is not (``zero_probes(squares=True)``) instead gets
  ``Σ (dLoss/d(state))²`` as its gradient (``sq_norm_tap``)."""
  return jax.tree.map(
    lambda s, p: s + p.astype(s.dtype) if p.shape == s.shape else sq_norm_tap(s, p), state, probe
  )


class Block(nn.Module):
  """One Transformer block: two mixer calls. Scanned: ``(state, (index, probe)) -> (state, ys)``."""

  cfg: object
  stats: bool = True  # False: return no per-layer stats, so XLA drops their arithmetic

  @nn.compact
  def __call__(self, state, xs):
    cfg = self.cfg
    i, probe = xs
    dt = jnp.dtype(cfg.dtype)
    attn_mix, mlp_mix = make_mixer(cfg, "attn_mix"), make_mixer(cfg, "mlp_mix")
    out_scale = 1.0 / math.sqrt(2 * cfg.depth) if cfg.init == "depth_scaled" else 1.0
    out_scale *= attn_mix.sublayer_out_scale(2 * cfg.depth)
    pre_norm = type(attn_mix).pre_norm
    attn_norm = RMSNorm(dt, name="attn_norm") if pre_norm else (lambda h: h)
    mlp_norm = RMSNorm(dt, name="mlp_norm") if pre_norm else (lambda h: h)
    attn = Attention(
      cfg.heads,
      cfg.rope,
      cfg.qk_norm,
      dt,
      out_scale,
      cfg.init_scale,
      implementation=getattr(cfg, "attention", "auto"),
      logit_max=self.stats,  # a separate score product: diagnostic steps only
      q_scale=mp.query_multiplier(cfg),
      name="attn",
    )
    mlp = MLP(int(cfg.width * cfg.mlp_ratio), dt, out_scale, cfg.init_scale, name="mlp")
    # completep: m_L^-alpha on each branch of a stream that sums them (not one that averages)
    logit_max = []
    branch = 1.0 if attn_mix.averages_branches else mp.branch_multiplier(cfg)
    scaled = (lambda y: y) if branch == 1 else (lambda y: y * branch)

    def attn_sub(h, value_fn=None):
      y, m = attn(attn_norm(h), value_fn)
      logit_max.append(m)
      return scaled(y)

    def mlp_sub(h, value_fn=None):
      return scaled(mlp(mlp_norm(h)))

    attn_sub.branch = mlp_sub.branch = branch  # for a mixer that norms F (peri_ln)

    if probe is not None:
      state = _add(state, jax.tree.map(lambda p: p[0], probe))
    state, s_attn = attn_mix(state, attn_sub, 2 * i)
    if probe is not None:
      state = _add(state, jax.tree.map(lambda p: p[1], probe))
    state, s_mlp = mlp_mix(state, mlp_sub, 2 * i + 1)
    self.sow("intermediates", "stream", attn_mix.stream(state))
    if not self.stats:
      return state, None
    stats = jax.tree.map(lambda a, b: jnp.stack([a, b]), s_attn, s_mlp)
    return state, (stats, logit_max[0])


class Transformer(nn.Module):
  cfg: object  # mhc_jax.train.config.ModelConfig (vocab resolved)

  @nn.compact
  def __call__(self, tokens_BT, probes=None, out_probe=None, stats=True):
    """``stats=False`` (the train step without diagnostics): ``aux`` holds only the output-logit
    statistics; the per-layer mixer stats and attention-logit maxima are never computed (under
    ``nn.scan`` XLA would otherwise compute and stack them every step)."""
    cfg = self.cfg
    dt, L, c = jnp.dtype(cfg.dtype), cfg.depth, cfg.width
    init = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed"))
    embed = self.param("embedding", init, (cfg.vocab, c), jnp.float32)
    x_BTC = jnp.take(embed, tokens_BT, axis=0).astype(dt)
    mixer = make_mixer(cfg).clone(parent=None)  # unbound: expand/collapse specs only
    state = mixer.expand(x_BTC)
    block = Block
    if cfg.remat != "none":
      block = nn.remat(Block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan)
    idx = jnp.arange(L)
    if cfg.scan:
      scanned = nn.scan(
        block,
        variable_axes={"params": 0, "intermediates": 0},
        split_rngs={"params": True},
        in_axes=0,
        length=L,
        unroll=min(getattr(cfg, "scan_unroll", 1), L),
        metadata_params={nn.PARTITION_NAME: "layers"},
      )
      state, ys = scanned(cfg, stats, name="blocks")(state, (idx, probes))
    else:
      ys = []
      for l in range(L):
        probe = None if probes is None else jax.tree.map(lambda p: p[l], probes)
        state, y = block(cfg, stats, name=f"block_{l}")(state, (l, probe))
        ys.append(y)
      ys = None if not stats else jax.tree.map(lambda *a: jnp.stack(a), *ys)
    if out_probe is not None:
      state = _add(state, out_probe)
    collapse_cls, collapse_kw = mixer.collapse_module()
    x = collapse_cls(**collapse_kw, name="collapse")(state)
    h_BTC = RMSNorm(dt, name="final_norm")(x)
    h_NC = h_BTC.reshape(-1, c)  # tokens flattened (faster CPU backward: layers.MLP)
    if cfg.tied_embeddings:
      logits = (h_NC @ embed.astype(dt).T) / math.sqrt(c)
    else:
      init = _kernel(cfg.init_scale * mp.multipliers(cfg, "top/output")["init"], ("embed", "vocab"))
      head = nn.Dense(cfg.vocab, use_bias=False, dtype=dt, name="head", kernel_init=init)
      logits = head(h_NC)
    if (out_mult := mp.logit_multiplier(cfg)) != 1:  # mup, completep
      logits = logits * out_mult
    logits = logits.reshape(h_BTC.shape[:-1] + (cfg.vocab,)).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    aux = {}
    if stats:
      layer_stats, logit_max = ys
      aux["stats"] = jax.tree.map(lambda a: a.reshape((2 * L,) + a.shape[2:]), layer_stats)
      aux["attn_logit_max"] = logit_max
    aux |= {
      "out_logit_max": jnp.max(logits),
      "logsumexp_mean": jnp.mean(lse),
      "logsumexp_max": jnp.max(lse),
    }
    return logits, aux


def state_shapes(cfg, batch: int, length: int):
  """The mixer state's pytree of ``jax.ShapeDtypeStruct`` for ``[batch, length]`` tokens."""
  x = jax.ShapeDtypeStruct((batch, length, cfg.width), jnp.dtype(cfg.dtype))
  return jax.eval_shape(make_mixer(cfg).expand, x)


def zero_probes(cfg, batch: int, length: int, squares: bool = False):
  """``(layer_probes, out_probe)``: float32 zeros shaped like the state, with ``[L, 2]`` in front
  for the layer probes. Their gradients are dLoss/d(state) before each mixer layer and at the
  collapse input. ``squares``: one scalar per state leaf instead (``[L, 2]`` and ``[]``), whose
  gradients are the squared norms ``Σ (dLoss/d(state))²`` (``sq_norm_tap``): what per-layer
  gradient RMS needs, without a ``[L, 2, *state]`` buffer in the step."""
  st = state_shapes(cfg, batch, length)
  if squares and any(s.ndim == 0 for s in jax.tree.leaves(st)):
    raise ValueError(f"mixer {cfg.mixer!r}: a scalar state leaf cannot take a squared-norm probe")
  shape = (lambda s: ()) if squares else (lambda s: s.shape)
  layer = jax.tree.map(lambda s: jnp.zeros((cfg.depth, 2) + shape(s), jnp.float32), st)
  out = jax.tree.map(lambda s: jnp.zeros(shape(s), jnp.float32), st)
  return layer, out


def probe_shape(cfg, batch: int, length: int) -> tuple[int, ...]:
  """Layer-probe shape ``[L, 2, *state]`` for mixers whose state is one array."""
  st = state_shapes(cfg, batch, length)
  if not isinstance(st, jax.ShapeDtypeStruct):
    raise ValueError(f"mixer {cfg.mixer!r}: the state is a pytree; use zero_probes")
  return (cfg.depth, 2) + st.shape


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
