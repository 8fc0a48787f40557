"""The HC family of the zoo: mhc_identity, kromhc, frac.

Each mixer is checked against a float64 numpy reference written from its paper's equations
(independent of the JAX code: explicit loops, np.kron, itertools permutations) on randomly
perturbed parameters, to 1e-5; plus what each paper claims (exact doubly stochastic Kronecker
products, Frac-Connections = residual at initialisation) and the closed-form parameter counts.
The generic contract (shapes, jit/vmap/grad, finite grads, stream separation, doubly stochastic
H_res where claimed) runs over every registered mixer in tests/test_mixers.py.
"""

import functools
import itertools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mhc_jax import mixers, testing
from mhc_jax.mixers.base import rms_norm
from mhc_jax.mixers.kromhc import parse_factors
from mhc_jax.model import Transformer, count_params, expected_params
from mhc_jax.train.config import ModelConfig

B, T, C = 2, 3, 12  # C divisible by 2, 3, 4 and 6 (fraction counts)
EPS = 1e-6  # base.rms_norm's epsilon


# ------------------------------------------------------------------------------ numpy helpers
def np_norm(x):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)


def sigmoid(z):
  return 1.0 / (1.0 + np.exp(-z))


def softmax(z):
  e = np.exp(z - z.max())
  return e / e.sum()


def np_sublayer(w):
  return lambda h: np.tanh(np_norm(h) @ w)


def perms(k):
  """The k! permutation matrices, identity first (itertools order): P[i, p[i]] = 1."""
  out = []
  for p in itertools.permutations(range(k)):
    m = np.zeros((k, k))
    m[np.arange(k), p] = 1.0
    out.append(m)
  return out


def case(name, seed=0, scale=0.5, layer=0, **opts):
  """(mixer, perturbed float32 params, float64 numpy params, state, jax f, numpy f, jitted apply).

  Random numbers come from numpy: XLA's CPU compile of threefry for every parameter leaf costs
  seconds per case, more than everything else here."""
  mixer = mixers.get(name, layers=4, **opts)
  rng = np.random.default_rng(seed)
  w = rng.normal(size=(C, C)) / math.sqrt(C)
  w32 = jnp.asarray(w, jnp.float32)

  def f(h, value_fn=None):
    return jnp.tanh(rms_norm(h) @ w32).astype(h.dtype)

  x = mixer.expand(jnp.asarray(rng.normal(size=(B, T, C)), jnp.float32))
  state = x + jnp.asarray(0.5 * rng.normal(size=x.shape), jnp.float32)  # streams differ
  params = nn.meta.unbox(
    jax.jit(lambda k, s: mixer.init(k, s, f, layer))(jax.random.PRNGKey(seed), state)
  )
  params = jax.tree.map(
    lambda a: a + jnp.asarray(scale * rng.normal(size=a.shape), a.dtype), params
  )
  np_p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)["params"]
  apply = jax.jit(lambda p, x: mixer.apply(p, x, f, layer))
  return mixer, params, np_p, state, f, np_sublayer(w), apply


def close(got, want, tol=1e-5):
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)


# ------------------------------------------------------------------------------- references
def ref_mhc_read_write(p, x, n, dynamic, extra=0):
  """mHC's H_pre = σ(α_pre v φ_pre + b_pre), H_post = 2σ(α_post v φ_post + b_post) per token,
  plus the trailing ``extra`` projection columns (for H_res) as raw ``v φ``."""
  z_pre = np.broadcast_to(p["b_pre"], x.shape[:-2] + (n,))
  z_post = np.broadcast_to(p["b_post"], x.shape[:-2] + (n,))
  proj_res = np.zeros(x.shape[:-2] + (extra,))
  if dynamic:
    v = np_norm(x.reshape(x.shape[:-2] + (-1,)))
    proj = v @ p["phi"]
    z_pre = p["alpha_pre"] * proj[..., :n] + p["b_pre"]
    z_post = p["alpha_post"] * proj[..., n : 2 * n] + p["b_post"]
    proj_res = proj[..., 2 * n :]
  return sigmoid(z_pre), 2.0 * sigmoid(z_post), proj_res


def ref_hc_layer(x, f, h_pre, h_post, h_res):
  """x'_i = Σ_j H_res[i,j] x_j + H_post_i F(Σ_j H_pre_j x_j), token by token."""
  out = np.empty_like(x)
  for b, t in itertools.product(range(x.shape[0]), range(x.shape[1])):
    xs = x[b, t]
    fo = f((h_pre[b, t][:, None] * xs).sum(0))
    out[b, t] = h_res[b, t] @ xs + h_post[b, t][:, None] * fo[None, :]
  return out


def ref_mhc_identity(p, x, f, n, dynamic=True):
  h_pre, h_post, _ = ref_mhc_read_write(p, x, n, dynamic)
  eye = np.broadcast_to(np.eye(n), x.shape[:2] + (n, n))
  return ref_hc_layer(x, f, h_pre, h_post, eye), h_pre, h_post


def ref_kromhc(p, x, f, n, factors, dynamic=True):
  r = sum(math.factorial(k) for k in factors)
  h_pre, h_post, proj_res = ref_mhc_read_write(p, x, n, dynamic, extra=r)
  z = (p["alpha_res"] * proj_res if dynamic else 0.0) + p["b_res"]
  z = np.broadcast_to(z, x.shape[:2] + (r,))
  h_res = np.empty(x.shape[:2] + (n, n))
  for b, t in itertools.product(range(x.shape[0]), range(x.shape[1])):
    mats, start = [], 0
    for k in factors:
      a = softmax(z[b, t, start : start + math.factorial(k)])
      start += math.factorial(k)
      mats.append(sum(ai * P for ai, P in zip(a, perms(k))))
    h_res[b, t] = functools.reduce(np.kron, mats)
  return ref_hc_layer(x, f, h_pre, h_post, h_res), h_res


def ref_frac(p, x, f, m, dynamic=True):
  """Frac-Connections: u_i = Σ_j Γ_ji h_j; h'_i = Σ_j A_ji h_j + B_i F(concat u)_i."""
  out = np.empty_like(x)
  gam = np.broadcast_to(p["b_read"], x.shape[:2] + (m, m)).copy()
  a = np.broadcast_to(p["b_mix"], x.shape[:2] + (m, m)).copy()
  beta = np.broadcast_to(p["b_write"], x.shape[:2] + (m,)).copy()
  if dynamic:
    xn = np_norm(x)  # per fraction
    gam += p["s_alpha"] * np.tanh(xn @ p["w_read"])
    a += p["s_alpha"] * np.tanh(xn @ p["w_mix"])
    beta += p["s_beta"] * np.tanh(xn @ p["w_write"])
  d = x.shape[-1]
  for b, t in itertools.product(range(x.shape[0]), range(x.shape[1])):
    h = x[b, t]
    u = [sum(gam[b, t, j, i] * h[j] for j in range(m)) for i in range(m)]
    fo = f(np.concatenate(u))
    for i in range(m):
      out[b, t, i] = (
        sum(a[b, t, j, i] * h[j] for j in range(m)) + beta[b, t, i] * fo[i * d : (i + 1) * d]
      )
  return out, gam, a, beta


# --------------------------------------------------------------------------------- mhc_identity
@pytest.mark.parametrize("opts", [{"n": 4}, {"n": 3, "dynamic": False}])
def test_mhc_identity_matches_numpy_reference(opts):
  _, params, p, x, _, f_np, apply = case("mhc_identity", **opts)
  out, stats = apply(params, x)
  want, h_pre, h_post = ref_mhc_identity(
    p, np.asarray(x, np.float64), f_np, opts["n"], opts.get("dynamic", True)
  )
  close(out, want)
  close(stats["h_pre"], h_pre.mean((0, 1)))
  close(stats["h_post"], h_post.mean((0, 1)))
  n = opts["n"]
  np.testing.assert_array_equal(stats["h_res"], np.eye(n))
  np.testing.assert_array_equal(stats["h_res_tok"], np.broadcast_to(np.eye(n), (B * T, n, n)))
  assert float(stats["sinkhorn_err"]) == 0.0


def test_mhc_identity_static_streams_separate():
  """Static (one-hot read, no φ): only the downstream reads tell the streams apart."""
  testing.check_stream_separation("mhc_identity", dynamic=False)


# ------------------------------------------------------------------------------------- kromhc
@pytest.mark.parametrize(
  "opts,factors",
  [
    ({"n": 4}, (2, 2)),  # default: 2s
    ({"n": 6, "factors": "3x2"}, (3, 2)),  # unequal factors: Kronecker order
    ({"n": 4, "dynamic": False, "h_res_init": "uniform"}, (2, 2)),
  ],
)
def test_kromhc_matches_numpy_reference(opts, factors):
  _, params, p, x, _, f_np, apply = case("kromhc", **opts)
  out, stats = apply(params, x)
  want, h_res = ref_kromhc(
    p, np.asarray(x, np.float64), f_np, opts["n"], factors, opts.get("dynamic", True)
  )
  close(out, want)
  close(stats["h_res"], h_res.mean((0, 1)))


@pytest.mark.parametrize("n,factors", [(4, ""), (6, "2x3"), (8, ""), (8, "4x2"), (4, "4")])
def test_kromhc_h_res_exactly_doubly_stochastic(n, factors):
  """A Kronecker product of doubly stochastic factors is doubly stochastic: exact to float32
  rounding per token, under large random parameters (no Sinkhorn truncation)."""
  _, params, _, x, _, _, apply = case("kromhc", n=n, factors=factors, scale=2.0)
  stats = apply(params, x)[1]
  assert float(stats["sinkhorn_err"]) == 0.0
  for h in (np.asarray(stats["h_res_tok"], np.float64), np.asarray(stats["h_res"], np.float64)):
    assert h.min() >= 0.0
    np.testing.assert_allclose(h.sum(-1), 1.0, atol=1e-6)
    np.testing.assert_allclose(h.sum(-2), 1.0, atol=1e-6)
  # Kronecker structure: H = U_1 ⊗ R (R the product of the other factors) makes Van Loan's
  # rearrangement of H (blocks H[a-block i, a-block j] as rows) a rank-1 matrix.
  fs = parse_factors(factors, n)
  if len(fs) > 1:
    a, b = fs[0], n // fs[0]
    for h in np.asarray(stats["h_res_tok"][:3], np.float64):
      s = np.linalg.svd(
        h.reshape(a, b, a, b).transpose(0, 2, 1, 3).reshape(a * a, b * b), compute_uv=False
      )
      assert s[1] < 1e-5 * s[0], f"H_res is not U_1 ({a}x{a}) ⊗ R: singular values {s}"


def test_kromhc_init():
  """identity: the product's identity permutation has weight res_diag (diag = q² = res_diag for
  2⊗2, as mhc_lite); uniform: exactly J/n."""
  for diag in (0.95, 0.999):
    _, params, _, x, _, _, apply = case("kromhc", n=4, dynamic=False, scale=0.0, res_diag=diag)
    h = np.asarray(apply(params, x)[1]["h_res"], np.float64)
    q = math.sqrt(diag)
    u = np.array([[q, 1 - q], [1 - q, q]])
    np.testing.assert_allclose(h, np.kron(u, u), atol=1e-6)
    np.testing.assert_allclose(np.diag(h), diag, atol=1e-6)
  _, params, _, x, _, _, apply = case("kromhc", n=8, dynamic=False, scale=0.0, h_res_init="uniform")
  np.testing.assert_allclose(apply(params, x)[1]["h_res"], np.full((8, 8), 1 / 8), atol=1e-7)


def test_kromhc_one_factor_is_mhc_lite():
  """factors='4' (one 4x4 factor over all 24 permutations) is mHC-lite, parameter for parameter."""
  _, params, _, x, f, _, apply = case("kromhc", n=4, factors="4")
  lite = mixers.get("mhc_lite", n=4, layers=4)
  assert jax.tree.map(jnp.shape, params) == jax.tree.map(
    jnp.shape, nn.meta.unbox(jax.eval_shape(lambda k: lite.init(k, x, f, 0), jax.random.PRNGKey(0)))
  )
  got, want = apply(params, x), lite.apply(params, x, f, 0)
  close(got[0], np.asarray(want[0], np.float64), tol=1e-6)
  close(got[1]["h_res"], np.asarray(want[1]["h_res"], np.float64), tol=1e-6)


@pytest.mark.parametrize(
  "opts,match",
  [
    ({"n": 4, "factors": "3x2"}, "multiply to 6"),
    ({"n": 8, "factors": "8"}, "permutations"),
    ({"n": 4, "factors": "2*2"}, "look like"),
    ({"n": 4, "h_res_init": "eye"}, "h_res_init"),
  ],
)
def test_kromhc_bad_options(opts, match):
  mixer = mixers.get("kromhc", **opts)
  with pytest.raises(ValueError, match=match):
    mixer.init(jax.random.PRNGKey(0), jnp.zeros((1, 2, opts["n"], 4)), lambda h: h, 0)


# --------------------------------------------------------------------------------------- frac
@pytest.mark.parametrize("opts", [{"n": 4}, {"n": 3, "dynamic": False}, {"n": 6}])
def test_frac_matches_numpy_reference(opts):
  _, params, p, x, _, f_np, apply = case("frac", **opts)
  out, stats = apply(params, x)
  want, gam, a, beta = ref_frac(
    p, np.asarray(x, np.float64), f_np, opts["n"], opts.get("dynamic", True)
  )
  close(out, want)
  close(stats["h_res"], np.swapaxes(a, -1, -2).mean((0, 1)))
  close(stats["h_pre"], gam.sum(-1).mean((0, 1)))
  close(stats["h_post"], beta.mean((0, 1)))


@pytest.mark.parametrize("dynamic", [True, False])
def test_frac_is_residual_at_init(dynamic):
  """Γ = A = I, B = 1, W = 0: the sublayer reads h itself and h' = h + F(h), fraction by fraction."""
  mixer, params, _, x, f, _, apply = case("frac", n=4, dynamic=dynamic, scale=0.0)
  h = x.reshape(B, T, C)
  out = apply(params, x)[0]
  np.testing.assert_allclose(out.reshape(B, T, C), h + f(h), atol=1e-6, rtol=0)
  # expand is the reshape, and the collapse module undoes it
  np.testing.assert_array_equal(mixer.expand(h), x)
  np.testing.assert_array_equal(mixer.collapse_module()[0]().apply({}, x), h)


def test_frac_model_at_init_equals_residual_model():
  """The whole Transformer: frac at init gives the residual model's logits (its own params minus
  the mixer's)."""
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 8), 0, 32)
  cfg = dict(vocab=32, depth=2, width=16, heads=2)
  frac = Transformer(ModelConfig(mixer="frac", mixer_options={"n": 4}, **cfg))
  res = Transformer(ModelConfig(mixer="residual", **cfg))
  params = nn.meta.unbox(jax.jit(frac.init)(jax.random.PRNGKey(0), tokens))
  blocks = {k: v for k, v in params["params"]["blocks"].items() if not k.endswith("_mix")}
  res_params = {"params": {**params["params"], "blocks": blocks}}
  got = jax.jit(frac.apply)(params, tokens)[0]
  want = jax.jit(res.apply)(res_params, tokens)[0]
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_frac_width_must_divide():
  with pytest.raises(ValueError, match="not divisible by n=5"):
    mixers.get("frac", n=5).expand(jnp.zeros((1, 2, 12)))
  with pytest.raises(ValueError, match="concat"):
    mixers.get("frac", collapse="sum").collapse_module()


# ------------------------------------------------------------------------- closed-form counts
@pytest.mark.parametrize(
  "mixer,opts",
  [
    ("mhc_identity", {"n": 4}),
    ("mhc_identity", {"n": 3, "dynamic": False, "collapse": "learned"}),
    ("kromhc", {"n": 4}),
    ("kromhc", {"n": 6, "factors": "2x3", "dynamic": False}),
    ("kromhc", {"n": 8}),
    ("frac", {"n": 4}),
    ("frac", {"n": 2, "dynamic": False}),
  ],
)
def test_param_counts_match_closed_form(mixer, opts):
  cfg = ModelConfig(vocab=32, depth=2, width=24, heads=2, mixer=mixer, mixer_options=opts)
  shapes = jax.eval_shape(
    Transformer(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)
  )
  assert count_params(nn.meta.unbox(shapes)) == expected_params(cfg)


def test_frac_count_matches_paper_table():
  """Frac-Connections Table 1: DFC×4 on OLMo-1B2 (C = 2048, 16 blocks = 32 FC layers) adds
  0.000165B parameters; our count plus a 512-gain LayerNorm per layer gives exactly that."""
  per_layer = mixers.get("frac", n=4).layer_params(2048) + 2048 // 4
  assert round(32 * per_layer / 1e9, 6) == 0.000165
