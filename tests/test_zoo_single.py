"""Single-stream zoo mixers (value_residual, laurel, ortho, deepnorm, post_ln, peri_ln) against
float64 numpy references written from their papers' equations, plus each paper's own claims.

The references share nothing with the JAX code but the stand-in sublayers' weights: every
mixer is run on random states with every parameter perturbed (``testing.perturb``) and must
match to 1e-5. The generic contract checks are in tests/test_mixers.py (they cover every
registered mixer).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mhc_jax import mixers, testing
from mhc_jax.mixers.base import rms_norm
from mhc_jax.model import Transformer, count_params, expected_params
from mhc_jax.train.config import ModelConfig

B, T, C, H = 2, 5, 8, 2  # H heads of D = C / H: exercises V_1's flatten / reshape
LAYERS = testing.LAYERS  # mixer layers 2L the mixers are told (L = LAYERS / 2 blocks)
TOL = dict(rtol=1e-5, atol=1e-5)

_W = np.random.default_rng(0).normal(size=(3, C, C)) / np.sqrt(C)
W_V, W_O, W_M = (w.astype(np.float32) for w in _W)


# --------------------------------------------------------------------------- stand-in sublayers
def attn_jax(h, value_fn=None):
  """Attention stand-in: values ``v = norm(h) W_V`` as ``[B, T, H, D]``, ``tanh(v) W_O``."""
  v = (rms_norm(h) @ W_V).reshape(h.shape[:-1] + (H, C // H))
  if value_fn is not None:
    v = value_fn(v)
  return (jnp.tanh(v).reshape(h.shape) @ W_O).astype(h.dtype)


def mlp_jax(h, value_fn=None):
  """MLP stand-in: ignores ``value_fn`` like the model's MLP."""
  return jnp.tanh(rms_norm(h) @ W_M).astype(h.dtype)


def np_norm(x, eps=1e-6):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def attn_np(h, value_fn=None):
  v = (np_norm(h) @ W_V.astype(np.float64)).reshape(h.shape[:-1] + (H, C // H))
  if value_fn is not None:
    v = value_fn(v)
  return np.tanh(v).reshape(h.shape) @ W_O.astype(np.float64)


def mlp_np(h, value_fn=None):
  return np.tanh(np_norm(h) @ W_M.astype(np.float64))


def f64(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def run(name, seed=0, layer=0, sublayer=attn_jax, **opts):
  """(mixer, perturbed params, random state, output state) of one call."""
  mixer = mixers.get(name, layers=LAYERS, **opts)
  k_x, k_s, k_p, k_q = jax.random.split(jax.random.PRNGKey(seed), 4)
  state = mixer.expand(jax.random.normal(k_x, (B, T, C)))
  leaves, tree = jax.tree.flatten(state)
  keys = jax.random.split(k_s, len(leaves))
  state = jax.tree.unflatten(
    tree, [l + jax.random.normal(k, l.shape) for l, k in zip(leaves, keys)]
  )
  params = nn.meta.unbox(mixer.init(k_p, state, sublayer, layer))
  params = testing.perturb(params, k_q, scale=0.5)
  out, _ = mixer.apply(params, state, sublayer, layer)
  return mixer, f64(params)["params"] if params else {}, f64(state), f64(out)


# --------------------------------------------------------------------------- ortho
def test_ortho_matches_numpy_and_update_is_orthogonal_to_stream():
  _, _, x, out = run("ortho")
  x = x[..., 0, :]
  f = attn_np(x)
  eps = 1e-6
  ref = x + f - (np.sum(x * f, -1, keepdims=True) / (np.sum(x * x, -1, keepdims=True) + eps)) * x
  np.testing.assert_allclose(out[..., 0, :], ref, **TOL)
  upd = out[..., 0, :] - x  # the paper's claim: <x, f_perp> = 0 per token
  cos = np.sum(upd * x, -1) / (np.linalg.norm(upd, axis=-1) * np.linalg.norm(x, axis=-1))
  assert np.max(np.abs(cos)) < 1e-5
  assert np.min(np.linalg.norm(upd, axis=-1)) > 1e-2  # ... and not by being zero


# --------------------------------------------------------------------------- peri_ln
@pytest.mark.parametrize("embed_norm", [False, True])
def test_peri_ln_matches_numpy(embed_norm):
  mixer, p, x, out = run("peri_ln", embed_norm=embed_norm)
  x = x[..., 0, :]
  ref = x + np_norm(attn_np(x)) * p["norm_scale"]
  np.testing.assert_allclose(out[..., 0, :], ref, **TOL)
  e = np.random.default_rng(1).normal(size=(B, T, C)) * 3.0
  got = np.asarray(mixer.expand(jnp.asarray(e, jnp.float32)), np.float64)[..., 0, :]
  np.testing.assert_allclose(got, np_norm(e) if embed_norm else e, **TOL)


# --------------------------------------------------------------------------- deepnorm / post_ln
@pytest.mark.parametrize("name", ["deepnorm", "post_ln"])
def test_deepnorm_and_post_ln_match_numpy(name):
  mixer, p, x, out = run(name)
  blocks = LAYERS // 2  # DeepNet's N for a decoder: blocks, not sublayers
  alpha, beta = ((2 * blocks) ** 0.25, (8 * blocks) ** -0.25) if name == "deepnorm" else (1, 1)
  x = x[..., 0, :]
  ref = np_norm(alpha * x + mlp_np(x)) * p["norm_scale"]
  out = f64(mixer.apply({"params": p}, jnp.asarray(x[..., None, :], jnp.float32), mlp_jax, 1)[0])
  np.testing.assert_allclose(out[..., 0, :], ref, **TOL)
  np.testing.assert_allclose(mixer.sublayer_out_scale(LAYERS), beta, rtol=1e-12)
  assert not type(mixer).pre_norm
  opts = mixers.get("deepnorm", layers=LAYERS, alpha=1.5, beta=0.25)
  assert opts.residual_scale() == 1.5 and opts.sublayer_out_scale(LAYERS) == 0.25


def _model_cfg(mixer, opts=None, **kw):
  return ModelConfig(
    vocab=16, depth=2, width=16, heads=2, mixer=mixer, mixer_options=opts or {}, **kw
  )


def _init(cfg, seed=0):
  tokens = jnp.zeros((1, 4), jnp.int32)
  return jax.jit(lambda k: nn.meta.unbox(Transformer(cfg).init(k, tokens)))(
    jax.random.PRNGKey(seed)
  )["params"]


def test_deepnorm_scales_only_the_output_projections_by_beta():
  """Same seed: deepnorm's attn/out and mlp/down kernels are β times post_ln's, the rest equal."""
  deep, post = _init(_model_cfg("deepnorm")), _init(_model_cfg("post_ln"))
  beta = (8 * 2) ** -0.25
  b_d, b_p = deep["blocks"], post["blocks"]
  np.testing.assert_allclose(
    b_d["attn"]["out"]["kernel"], beta * b_p["attn"]["out"]["kernel"], rtol=1e-5
  )
  np.testing.assert_allclose(
    b_d["mlp"]["down"]["kernel"], beta * b_p["mlp"]["down"]["kernel"], rtol=1e-5
  )
  for path in (("attn", "value"), ("attn", "query"), ("mlp", "up")):
    np.testing.assert_array_equal(b_d[path[0]][path[1]]["kernel"], b_p[path[0]][path[1]]["kernel"])
  assert "attn_norm" not in b_d and "norm_scale" in b_d["attn_mix"]  # the mixer owns the norm


# --------------------------------------------------------------------------- laurel
def _softmax(z):
  e = np.exp(z - z.max())
  return e / e.sum()


def laurel_np(x, f, p, variant, rw_norm):
  g = x
  if variant in ("lr", "rw_lr"):
    g = x + (x @ p["w_down"]) @ p["w_up"]  # x + B A x, row-vector form
  if variant == "lr":
    return f + g
  z = p["b_rw"]
  a, b = {"softmax": _softmax(z), "sigmoid": 1 / (1 + np.exp(-z)), "none": z}[rw_norm]
  return a * f + b * g


@pytest.mark.parametrize(
  "variant,rw_norm",
  [
    ("rw", "softmax"),
    ("rw", "sigmoid"),
    ("rw", "none"),
    ("lr", "softmax"),
    ("rw_lr", "softmax"),
    ("rw_lr", "none"),
  ],
)
def test_laurel_matches_numpy(variant, rw_norm):
  _, p, x, out = run("laurel", variant=variant, rw_norm=rw_norm, rank=3)
  x = x[..., 0, :]
  np.testing.assert_allclose(out[..., 0, :], laurel_np(x, attn_np(x), p, variant, rw_norm), **TOL)


def test_laurel_init_follows_the_paper():
  """B = 0 (LR starts as the plain residual); A column-orthogonal with 1/sqrt(rC) entries."""
  r = 2
  mixer = mixers.get("laurel", variant="lr", rank=r, layers=LAYERS)
  x = jax.random.normal(jax.random.PRNGKey(3), (B, T, 1, C))
  params = nn.meta.unbox(mixer.init(jax.random.PRNGKey(0), x, attn_jax, 0))["params"]
  a = np.asarray(params["w_up"]).T  # the C x r factor A
  want = np.array([[1 / np.sqrt(r * C) if i % r == j else 0 for j in range(r)] for i in range(C)])
  np.testing.assert_allclose(a, want, rtol=1e-6)
  np.testing.assert_allclose(a.T @ a, np.eye(r) * (C / r) / (r * C), rtol=1e-6)  # orthogonal
  np.testing.assert_array_equal(params["w_down"], 0)
  out = mixer.apply({"params": params}, x, attn_jax, 0)[0]
  np.testing.assert_allclose(out, x + attn_jax(x[..., 0, :])[..., None, :], rtol=1e-6)
  with pytest.raises(ValueError, match="rank"):
    mixers.get("laurel", rank=C + 1).init(jax.random.PRNGKey(0), x, attn_jax, 0)


# --------------------------------------------------------------------------- value_residual
def value_residual_np(x, v1, params, lams):
  """Four layers (attention, MLP, attention, MLP) from the paper's V'_n = λ1 V_1 + λ2 V_n."""
  for layer, sub in enumerate((attn_np, mlp_np, attn_np, mlp_np)):
    lam1, lam2 = lams(params[layer])

    def value_fn(v, layer=layer, lam1=lam1, lam2=lam2):
      nonlocal v1
      if layer == 0:
        v1 = v.reshape(v.shape[:-2] + (-1,))  # the first attention layer's values
        return v
      return lam1 * v1.reshape(v.shape) + lam2 * v

    x = x + sub(x, value_fn)
  return x, v1


@pytest.mark.parametrize("opts", [{}, {"learnable": True}, {"lambda1": 2.0, "lambda2": 1.0}])
def test_value_residual_matches_numpy_over_layers(opts):
  mixer = mixers.get("value_residual", layers=LAYERS, **opts)
  k_x, k_v, k_p = jax.random.split(jax.random.PRNGKey(4), 3)
  state = mixer.expand(jax.random.normal(k_x, (B, T, C)))
  state["v1"] = jax.random.normal(k_v, (B, T, C))  # garbage before layer 0: must be overwritten
  subs = (attn_jax, mlp_jax, attn_jax, mlp_jax)
  params = [
    testing.perturb(nn.meta.unbox(mixer.init(k, state, subs[i], i)), k, 0.5)
    for i, k in enumerate(jax.random.split(k_p, 4))
  ]

  @jax.jit
  def attn_step(p, s, layer):  # layer traced, as under nn.scan
    return mixer.apply(p, s, attn_jax, layer)[0]

  s = state
  for i, sub in enumerate(subs):
    if sub is attn_jax:
      s = attn_step(params[i], s, jnp.asarray(i))
    else:
      s = mixer.apply(params[i], s, sub, i)[0]
  if opts.get("learnable"):
    lams = lambda p: (float(p["params"]["b_lambda1"]), float(p["params"]["b_lambda2"]))
  else:
    lams = lambda p: (opts.get("lambda1", 0.5), opts.get("lambda2", 0.5))
  x_ref, v1_ref = value_residual_np(
    np.asarray(state["x"], np.float64)[..., 0, :], None, params, lams
  )
  np.testing.assert_allclose(np.asarray(s["x"], np.float64)[..., 0, :], x_ref, **TOL)
  np.testing.assert_allclose(np.asarray(s["v1"], np.float64), v1_ref, **TOL)


def _forward(cfg, params, tokens):
  return jax.jit(Transformer(cfg).apply)({"params": params}, tokens)[0]


def test_value_residual_in_the_model():
  """λ1 = 0, λ2 = 1 is exactly the residual model; the default mix changes the logits."""
  tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 8), 0, 16)
  params = _init(_model_cfg("residual"))
  base = _forward(_model_cfg("residual"), params, tokens)
  same = _forward(_model_cfg("value_residual", {"lambda1": 0.0, "lambda2": 1.0}), params, tokens)
  np.testing.assert_allclose(same, base, rtol=1e-6, atol=1e-6)
  mixed = _forward(_model_cfg("value_residual"), params, tokens)
  assert float(jnp.max(jnp.abs(mixed - base))) > 1e-3


# --------------------------------------------------------------------------- parameter counts
@pytest.mark.parametrize(
  "mixer,opts",
  [
    ("value_residual", {}),
    ("value_residual", {"learnable": True}),
    ("laurel", {}),
    ("laurel", {"variant": "rw"}),
    ("laurel", {"variant": "lr", "rank": 3}),
    ("ortho", {}),
    ("deepnorm", {}),
    ("post_ln", {}),
    ("peri_ln", {}),
  ],
)
def test_param_counts_match_closed_form(mixer, opts):
  cfg = _model_cfg(mixer, opts)
  shapes = jax.eval_shape(
    lambda k: nn.meta.unbox(Transformer(cfg).init(k, jnp.zeros((1, 4), jnp.int32))),
    jax.random.PRNGKey(0),
  )
  counts = count_params(shapes)
  assert counts == expected_params(cfg)
  per_layer = {
    "value_residual": 2 * opts.get("learnable", False),
    "ortho": 0,
    "deepnorm": 16,
    "post_ln": 16,
    "peri_ln": 16,
    "laurel": {"rw": 2, "lr": 2 * 3 * 16}.get(opts.get("variant"), 2 + 2 * 4 * 16),
  }
  assert counts["mixer"] == 2 * cfg.depth * per_layer[mixer]
