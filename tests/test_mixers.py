"""Mixer contract (mhc_jax.testing) over every registered mixer, plus each family's own claims."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from mhc_jax import mixers, testing
from mhc_jax.mixers.base import Collapse

NAMES = mixers.names()


class ContractTest(parameterized.TestCase):
  """chex.variants: jit and no-jit must agree for every mixer."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(*NAMES)
  def test_transforms(self, name):
    testing.check_transforms(name, variant=self.variant)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_shapes_and_finite_grads(name, dtype):
  testing.check_shapes(name, dtype=dtype)
  testing.check_finite_grads(name, dtype=dtype)


@pytest.mark.parametrize("name", NAMES)
def test_invariants_under_perturbation(name):
  testing.check_invariants(name)


@pytest.mark.parametrize("name", NAMES)
def test_default_init_keeps_streams_apart(name):
  """The contract's stream-separation check passes for every mixer's default initialisation."""
  testing.check_stream_separation(name)


@pytest.mark.parametrize(
  "name,opts",
  [
    ("hc", {"dynamic": False}),
    ("mhc", {"dynamic": False}),
    ("mhc_identity", {"dynamic": False}),
  ],
)
def test_static_default_init_keeps_streams_apart(name, opts):
  """Static variants have no φ: the one-hot read and write alone keep the streams apart."""
  testing.check_stream_separation(name, **opts)


@pytest.mark.parametrize(
  "opts",
  [
    {"stream_init": "symmetric"},  # MaxText's / Megatron-LM's b_pre = b_post = 0
    {"stream_init": "symmetric", "dynamic": False},  # nothing at all tells the streams apart
  ],
)
def test_stream_separation_check_fails_on_symmetric_init(opts):
  """The symmetric mHC initialisation collapses the streams, and the check says so."""
  with pytest.raises(AssertionError, match="streams collapse"):
    testing.check_stream_separation("mhc", **opts)


def test_stream_spread_matches_numpy():
  """``stream_spread`` = RMS(x - mean over streams) / RMS(x), against a float64 reference, and
  the stats report it for the state leaving the layer, on the fixed token sample."""
  from mhc_jax.mixers.base import sample_index, stream_spread

  x = np.random.default_rng(0).normal(size=(3, 7, 4, 8)).astype(np.float32)
  x[..., 1, :] += 2.0  # streams with different means
  ref = lambda a: np.sqrt(
    np.mean((a - a.mean(-2, keepdims=True)) ** 2, dtype=np.float64)
    / np.mean(a**2, dtype=np.float64)
  )
  np.testing.assert_allclose(stream_spread(x), ref(x.astype(np.float64)), rtol=1e-6)
  same = np.broadcast_to(x[..., :1, :], x.shape)
  assert float(stream_spread(same)) == 0.0
  _, params, state, _, apply = testing.setup("mhc")
  out, stats = apply(params, state)
  flat = np.asarray(out, np.float64).reshape((-1,) + out.shape[-2:])
  np.testing.assert_allclose(
    stats["stream_spread"], ref(flat[sample_index(out.shape[:-2])]), rtol=1e-5
  )


@pytest.mark.parametrize("name", ["mhc", "mhc_identity"])
@pytest.mark.parametrize("stream_init", ["onehot", "hc", "symmetric"])
def test_stream_init_biases(name, stream_init):
  """The read and write each ``stream_init`` starts from, on stream ``layer mod n``."""
  from mhc_jax.mixers.mhc import ONEHOT_LOGIT, READ_INIT

  sig = lambda z: 1 / (1 + np.exp(-z))
  for layer in (0, 1, 6):
    mixer = mixers.get(name, n=4, stream_init=stream_init, dynamic=False)
    x = jnp.ones((1, 2, 4, testing.C))
    params = mixer.init(jax.random.PRNGKey(0), x, lambda h: h, layer)
    stats = mixer.apply(params, x, lambda h: h, layer)[1]
    own = np.eye(4)[layer % 4] > 0
    pre, post = {
      "onehot": (sig(np.where(own, ONEHOT_LOGIT, -ONEHOT_LOGIT)),) * 2,
      "hc": (np.where(own, READ_INIT, 1 - READ_INIT), np.full(4, 0.5)),
      "symmetric": (np.full(4, 0.5), np.full(4, 0.5)),
    }[stream_init]
    np.testing.assert_allclose(stats["h_pre"], pre, rtol=1e-5)
    np.testing.assert_allclose(stats["h_post"], 2 * post, rtol=1e-5)


def test_stream_init_is_checked():
  with pytest.raises(ValueError, match="stream_init"):
    testing.setup("mhc", stream_init="bogus")


def test_static_variants_pass_contract():
  for name in ("hc", "mhc", "mhc_lite"):
    testing.check_shapes(name, dynamic=False)
    testing.check_invariants(name, dynamic=False, seeds=(1,))


def test_mhc_implicit_grad_mode_passes_contract():
  testing.check_finite_grads("mhc", sinkhorn_grad="implicit")


def test_residual_is_x_plus_f():
  _, params, x, f, apply = testing.setup("residual")
  out, stats = apply(params, x)
  chex.assert_trees_all_close(out[..., 0, :], x[..., 0, :] + f(x[..., 0, :]), atol=0, rtol=0)
  np.testing.assert_array_equal(stats["h_res"], np.eye(1))


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("layer", [0, 1, 6])
def test_hc_at_init_equals_residual_in_every_stream(dynamic, layer):
  """HC paper: with A_r = I, B = 1, A_m one-hot and W = 0, each stream is a pre-norm residual."""
  hc = mixers.get("hc", n=4, dynamic=dynamic)
  k_h, k_f = jax.random.split(jax.random.PRNGKey(3))
  h_BTC = jax.random.normal(k_h, (2, 5, testing.C))
  f = testing.sublayer_fn(k_f)
  state = hc.expand(h_BTC)
  params = hc.init(jax.random.PRNGKey(0), state, f, layer)
  out, stats = hc.apply(params, state, f, layer)
  want = h_BTC + f(h_BTC)
  for i in range(4):
    chex.assert_trees_all_close(out[..., i, :], want, atol=1e-6)
  np.testing.assert_allclose(stats["h_pre"], np.eye(4)[layer % 4], atol=1e-6)


def _h_res_at_init(name, init, n=4, **opts):
  _, params, x, _, apply = testing.setup(name, n=n, h_res_init=init, **opts)
  return np.asarray(apply(params, x)[1]["h_res"])


@pytest.mark.parametrize("name", ["mhc", "mhc_lite"])
@pytest.mark.parametrize("n", [2, 4])
def test_h_res_init(name, n):
  """The static part is exactly the claimed start; the random φ (α = 0.01) moves it slightly."""
  # mhc: the diagonal is res_diag; mhc_lite: the identity permutation's weight is (permutations
  # that fix a stream add to its diagonal entry)
  for diag in (0.999, 0.95):  # res_diag's default, and the earlier default
    h = _h_res_at_init(name, "identity", n, phi_init=0.0, res_diag=diag)
    assert np.all(np.diag(h) >= diag - 1e-5), np.diag(h)
    if name == "mhc" or n == 2:
      np.testing.assert_allclose(np.diag(h), diag, atol=1e-5)
  ident = _h_res_at_init(name, "identity", n, phi_init=0.0)
  unif = _h_res_at_init(name, "uniform", n, phi_init=0.0)
  np.testing.assert_allclose(unif, np.full((n, n), 1.0 / n), atol=1e-6)
  for init, static in (("identity", ident), ("uniform", unif)):
    np.testing.assert_allclose(_h_res_at_init(name, init, n), static, atol=1e-2)


def test_mhc_coefficient_ranges():
  """H_pre = σ(·) in (0, 1), H_post = 2σ(·) in (0, 2), with the symmetric init σ(0): 0.5 and 1
  (the random φ, α = 0.01, moves them slightly)."""
  _, params, x, _, apply = testing.setup("mhc", seed=1, stream_init="symmetric")
  stats = apply(testing.perturb(params, jax.random.PRNGKey(9), 3.0), x)[1]
  assert np.all((stats["h_pre"] > 0) & (stats["h_pre"] < 1))
  assert np.all((stats["h_post"] > 0) & (stats["h_post"] < 2))
  stats0 = apply(params, x)[1]
  np.testing.assert_allclose(stats0["h_pre"], 0.5, atol=0.02)
  np.testing.assert_allclose(stats0["h_post"], 1.0, atol=0.04)


def test_mhc_lite_permutations_and_limit():
  from mhc_jax.mixers.mhc_lite import permutation_matrices

  p = permutation_matrices(4)
  assert p.shape == (24, 4, 4)
  np.testing.assert_array_equal(p[0], np.eye(4))
  assert len({m.tobytes() for m in p}) == 24
  with pytest.raises(ValueError, match="n <= 6"):
    testing.setup("mhc_lite", n=7)


def test_collapse():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 4, 8))
  summed = x.sum(-2)
  for kind in ("sum", "learned"):
    mod = Collapse(n=4, kind=kind)
    params = mod.init(jax.random.PRNGKey(1), x)
    chex.assert_trees_all_close(mod.apply(params, x), summed, atol=1e-6)
  assert "b_collapse" in Collapse(n=4, kind="learned").init(jax.random.PRNGKey(1), x)["params"]
  with pytest.raises(ValueError, match="collapse"):
    Collapse(n=4, kind="max").init(jax.random.PRNGKey(1), x)


def test_registry_errors():
  assert set(NAMES) >= {"residual", "hc", "mhc", "mhc_lite"}
  with pytest.raises(ValueError, match="unknown name 'hcc'"):
    mixers.get("hcc")
  with pytest.raises(ValueError, match="streams_n"):
    mixers.get("mhc", streams_n=4)
  with pytest.raises(ValueError, match="n=4"):
    testing.setup("mhc", n=2)[0].apply({}, jnp.zeros((1, 1, 4, 8)), lambda x: x)


@pytest.mark.parametrize("n", [1, 2, 4, 8, 9])
@pytest.mark.parametrize("per_token", [True, False])
def test_mix_and_read_match_einsum(n, per_token):
  """The CPU kernel (written-out stream sums, hand-written gradients) equals the einsum
  definitions and their autodiff (to float32 rounding), for per-token and static coefficients."""
  from mhc_jax.mixers.cpu_mix import mix, read

  k = jax.random.split(jax.random.PRNGKey(3), 6)
  x = jax.random.normal(k[0], (2, 3, n, 8))
  f = jax.random.normal(k[1], (2, 3, 8))
  lead = (2, 3) if per_token else ()
  h_res = jax.random.normal(k[2], lead + (n, n))
  h_post = jax.random.normal(k[3], lead + (n,))
  h_pre = jax.random.normal(k[4], lead + (n,))
  w = jax.random.normal(k[5], (2, 3, n, 8))  # a random cotangent direction

  def mix_ref(x, f, h, p):
    return jnp.einsum("...ij,...jc->...ic", h, x) + p[..., :, None] * f[..., None, :]

  def read_ref(x, p):
    return jnp.einsum("...i,...ic->...c", p, x)

  close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)
  close(mix(x, f, h_res, h_post), mix_ref(x, f, h_res, h_post))
  close(read(x, h_pre), read_ref(x, h_pre))
  loss_m = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)) * w)
  loss_r = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)) * w[..., 0, :])
  args = (x, f, h_res, h_post)
  for got, want in zip(
    jax.grad(loss_m(mix), argnums=(0, 1, 2, 3))(*args),
    jax.grad(loss_m(mix_ref), argnums=(0, 1, 2, 3))(*args),
  ):
    assert got.shape == want.shape
    close(got, want)
  for got, want in zip(
    jax.grad(loss_r(read), argnums=(0, 1))(x, h_pre),
    jax.grad(loss_r(read_ref), argnums=(0, 1))(x, h_pre),
  ):
    assert got.shape == want.shape
    close(got, want)


def test_mix_kernel_switch(monkeypatch):
  """``MIX_KERNEL`` is the one switch between the plain einsums and the CPU kernel: "einsum"
  traces the einsums' dots, "cpu" the written-out sums (no dot for n = 4), "auto" picks the
  kernel on this (CPU) backend, and a bad value is an error naming the switch."""
  from mhc_jax.mixers import base

  x, f = jnp.ones((2, 3, 4, 8)), jnp.ones((2, 3, 8))
  h, p = jnp.eye(4), jnp.ones((4,))

  def traced(kind):
    monkeypatch.setattr(base, "MIX_KERNEL", kind)
    # fresh callables: jax caches traces by function, not by the switch's value
    mix_jaxpr = jax.make_jaxpr(lambda *a: base.mix(*a))(x, f, h, p)
    return str(mix_jaxpr) + str(jax.make_jaxpr(lambda *a: base.read(*a))(x, p))

  assert "dot_general" in traced("einsum")
  assert "dot_general" not in traced("cpu")
  assert "dot_general" not in traced("auto")
  with pytest.raises(ValueError, match="MIX_KERNEL"):
    traced("fast")


@pytest.mark.parametrize("mixer", ["hc", "mhc"])
def test_model_same_under_both_mix_kernels(monkeypatch, mixer):
  """A whole model's loss and gradients are the same (to float32 rounding) whether its streams
  are mixed by the einsums or by the CPU kernel."""
  from mhc_jax.mixers import base
  from mhc_jax.model import Transformer
  from mhc_jax.train.config import ModelConfig

  model = Transformer(ModelConfig(vocab=32, width=16, depth=2, heads=2, mixer=mixer))
  tok = jax.random.randint(jax.random.PRNGKey(0), (2, 8), 0, 32)
  params = model.init(jax.random.PRNGKey(1), tok)["params"]
  out = {}
  for kind in ("einsum", "cpu"):
    monkeypatch.setattr(base, "MIX_KERNEL", kind)

    def loss(p):  # a new function per kind: jit caches traces by function
      return jnp.mean(jax.nn.log_softmax(model.apply({"params": p}, tok)[0])[..., 0])

    out[kind] = jax.jit(jax.value_and_grad(loss))(params)
  chex.assert_trees_all_close(out["einsum"], out["cpu"], rtol=1e-5, atol=1e-6)
