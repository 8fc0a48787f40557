"""DenseFormer (DWA) and AttnRes: numpy references from the papers' equations, init claims,
scan == loop, closed-form parameter counts.

The references run a stack of 2L mixer layers in float64 with their own sublayers
``F_l(x) = tanh(rmsnorm(x) W_l)`` (the contract kit's stand-in) and every mixer parameter
perturbed, so masked-out history entries and masked weights carry noise that must be ignored.
"""

import dataclasses
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mhc_jax import mixers, testing
from mhc_jax.model import Transformer, count_params, expected_params, scan_to_loop
from mhc_jax.train.config import ModelConfig

B, T, C = 2, 3, 8
DEPTH = 3  # blocks; 2L = 6 mixer layers
LAYERS = 2 * DEPTH
EPS = 1e-6


# --------------------------------------------------------------------------- numpy references
def np_rms_norm(x):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)


def np_sublayer(w):
  return lambda x: np.tanh(np_rms_norm(x) @ w)


def dwa_reference(emb, fs, alphas, every="block", dilation=1, period=1):
  """DenseFormer (arXiv:2402.02622): X_i = B_i(Y_{i-1}), Y_i = Σ_{j≤i, k|(i-j)} α_ij X_j if p|i.

  ``fs`` are the 2L sublayers; a block is two of them (``every="block"``) or one. ``alphas[i]`` is
  the row α_i (length ≥ i + 1). Returns Y after every DWA step's block and the final output.
  """
  per = 2 if every == "block" else 1
  xs, y, outs = [emb], emb, []
  for i in range(1, len(fs) // per + 1):
    for f in fs[(i - 1) * per : i * per]:
      y = y + f(y)  # the block's own pre-norm residuals
    xs.append(y)
    if i % period == 0:
      y = sum(alphas[i][j] * xs[j] for j in range(i + 1) if (i - j) % dilation == 0)
    outs.append(y)
  return outs, y


def attnres_reference(emb, fs, queries, scales, block_size=1):
  """AttnRes (arXiv:2603.15031): h_l = Σ_{i<l} softmax_i(w_l · RMSNorm(v_i)) v_i, v_0 = emb,
  v_i = f_i(h_i); Block AttnRes sums each block's outputs (the current block partially).

  ``queries[l]`` / ``scales[l]`` are the paper's w_l and key-norm scale for the input of layer
  l (1-based, l = 1..2L), and index 2L + 1 is the final output's query. Returns the sublayer
  inputs h_1..h_{2L} and the final output.
  """
  vs, h, hs = [emb], emb, []
  for l, f in enumerate(fs, start=1):
    hs.append(h)
    vs.append(f(h))
    outs = vs[1:]
    srcs = [emb] + [sum(outs[b : b + block_size]) for b in range(0, len(outs), block_size)]
    keys = [np_rms_norm(v) * scales[l + 1] for v in srcs]
    logits = np.stack([k @ queries[l + 1] for k in keys])  # [S, B, T]
    p = np.exp(logits - logits.max(0))
    p /= p.sum(0)
    h = sum(pi[..., None] * v for pi, v in zip(p, srcs))
  return hs, h


# --------------------------------------------------------------------------- JAX side
def stack_run(name, opts, seed=0, eager=False):
  """Run 2L mixer layers with perturbed per-layer parameters; layer traced under jit."""
  mixer = mixers.get(name, layers=LAYERS, **opts)
  keys = jax.random.split(jax.random.PRNGKey(seed), 2 * LAYERS + 1)
  emb = jax.random.normal(keys[0], (B, T, C))
  ws = [jax.random.normal(k, (C, C)) / jnp.sqrt(C) for k in keys[1 : LAYERS + 1]]

  def sub(w):
    return lambda x, value_fn=None: jnp.tanh(testing.rms_norm(x) @ w).astype(x.dtype)

  state = mixer.expand(emb)
  # noise in the not-yet-written entries: a correct mask and write order never read it
  noise = jax.random.normal(jax.random.fold_in(keys[0], 1), state["hist"].shape)
  state = {"hist": state["hist"].at[1:].add(noise[1:]), "x": state["x"]}
  params = []
  for l in range(LAYERS):
    p = nn.meta.unbox(mixer.init(keys[LAYERS + 1 + l], state, sub(ws[l]), l))
    params.append(testing.perturb(p, jax.random.fold_in(keys[LAYERS + 1 + l], 7), 0.5))

  def apply(p, w, s, l):
    return mixer.apply(p, s, sub(w), l)

  step = apply if eager else jax.jit(apply)
  xs = []
  for l in range(LAYERS):
    state, _ = step(params[l], ws[l], state, l if eager else jnp.int32(l))
    xs.append(np.asarray(state["x"], np.float64))
  fs = [np_sublayer(np.asarray(w, np.float64)) for w in ws]
  params = [jax.tree.map(lambda a: np.asarray(a, np.float64), p["params"]) for p in params]
  return np.asarray(emb, np.float64), fs, params, xs, state


@pytest.mark.parametrize(
  "opts,eager",
  [
    ({}, False),
    ({}, True),
    ({"every": "layer"}, False),
    ({"dilation": 2}, False),
    ({"every": "layer", "dilation": 3, "period": 2}, False),
  ],
)
def test_denseformer_matches_numpy_reference(opts, eager):
  emb, fs, params, xs, state = stack_run("denseformer", opts, eager=eager)
  per = 2 if opts.get("every", "block") == "block" else 1
  # row α_i lives in the mixer layer that ends DWA step i (the MLP call for every="block")
  alphas = {i: params[i * per - 1]["b_dwa"] for i in range(1, LAYERS // per + 1)}
  outs, final = dwa_reference(emb, fs, alphas, **opts)
  np.testing.assert_allclose(xs[per - 1 :: per], outs, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(xs[-1], final, atol=1e-5, rtol=1e-5)
  assert state["hist"].shape == (LAYERS // per + 1, B, T, C)


@pytest.mark.parametrize("opts", [{}, {"block_size": 2}, {"block_size": 4, "key_scale": False}])
def test_attnres_matches_numpy_reference(opts):
  emb, fs, params, xs, _ = stack_run("attnres", opts)
  # mixer layer l (0-based) holds the query of the next input: the paper's w_{l+2} (1-based)
  queries = {l + 2: p["b_query"] for l, p in enumerate(params)}
  scales = {l + 2: p.get("b_key_scale", np.ones(C)) for l, p in enumerate(params)}
  assert ("b_key_scale" in params[0]) == opts.get("key_scale", True)
  hs, final = attnres_reference(emb, fs, queries, scales, opts.get("block_size", 1))
  np.testing.assert_allclose(xs[:-1], hs[1:], atol=1e-5, rtol=1e-5)  # h_2..h_{2L}
  np.testing.assert_allclose(xs[-1], final, atol=1e-5, rtol=1e-5)


def test_attnres_block_history_size():
  for block_size, entries in ((1, LAYERS + 1), (2, 4), (4, 3), (6, 2)):
    m = mixers.get("attnres", layers=LAYERS, block_size=block_size)
    assert m.expand(jnp.zeros((B, T, C)))["hist"].shape[0] == entries


# --------------------------------------------------------------------------- the model
V = 32
TOKENS = jax.random.randint(jax.random.PRNGKey(1), (2, 8), 0, V)


def cfg_for(mixer, **opts):
  return ModelConfig(vocab=V, depth=2, width=16, heads=2, mixer=mixer, mixer_options=opts)


@functools.lru_cache(maxsize=None)
def init(cfg):
  return jax.jit(lambda k: nn.meta.unbox(Transformer(cfg).init(k, TOKENS)))(jax.random.PRNGKey(0))


@functools.lru_cache(maxsize=None)
def logits(cfg):
  return jax.jit(lambda p: Transformer(cfg).apply(p, TOKENS)[0])


@pytest.mark.parametrize(
  "mixer,opts,atol",
  [
    ("denseformer", {}, 1e-6),  # α_ii = 1, others 0: exactly the residual
    ("attnres", {}, 1e-4),  # w = 0: uniform means, equal to the sum after the pre-norm
  ],
)
def test_starts_as_a_prenorm_residual(mixer, opts, atol):
  """Both papers' initialisation: the model equals the plain pre-norm residual Transformer with
  the same non-mixer parameters (the residual model ignores the mixer parameters)."""
  cfg = cfg_for(mixer, **opts)
  params = init(cfg)
  ref = logits(cfg_for("residual"))(params)
  chex.assert_trees_all_close(logits(cfg)(params), ref, atol=atol, rtol=atol)


@pytest.mark.parametrize(
  "mixer,opts", [("denseformer", {"dilation": 2}), ("attnres", {"block_size": 3})]
)
def test_scan_equals_loop_perturbed(mixer, opts):
  """Traced layer index under nn.scan == Python ints in a loop, away from the init."""
  cfg = cfg_for(mixer, **opts)
  p = testing.perturb(init(cfg), jax.random.PRNGKey(3), 0.3)
  loop_cfg = dataclasses.replace(cfg, scan=False)
  p_loop = {"params": scan_to_loop(p["params"], cfg.depth)}
  chex.assert_trees_all_close(logits(cfg)(p), logits(loop_cfg)(p_loop), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
  "mixer,opts",
  [
    ("denseformer", {}),
    ("denseformer", {"every": "layer"}),
    ("attnres", {}),
    ("attnres", {"key_scale": False, "block_size": 2}),
  ],
)
def test_param_counts_match_closed_form(mixer, opts):
  cfg = cfg_for(mixer, **opts)
  shapes = jax.eval_shape(
    lambda k: nn.meta.unbox(Transformer(cfg).init(k, TOKENS)), jax.random.PRNGKey(0)
  )
  assert count_params(shapes) == expected_params(cfg)
  per_layer = {
    "denseformer": {"block": 3, "layer": 5}[opts.get("every", "block")],
    "attnres": 16 * (2 if opts.get("key_scale", True) else 1),
  }[mixer]
  assert expected_params(cfg)["mixer"] == 4 * per_layer


def test_bad_options_raise():
  x = jnp.zeros((B, T, C))
  with pytest.raises(ValueError, match="every"):
    mixers.get("denseformer", layers=4, every="sublayer").expand(x)
  with pytest.raises(ValueError, match="block_size"):
    mixers.get("attnres", layers=4, block_size=0).expand(x)
  with pytest.raises(ValueError, match="layers"):
    mixers.get("attnres").expand(x)
