"""The mixer contract kit (tests/test_mixers.py): checks any registered mixer is put through.

Each ``check_*`` raises ``AssertionError`` (via chex) on a violation; what they check is listed in
docs/interfaces.md, "The mixer contract". ``xla_optimizations(on)`` switches most XLA
optimisations off (the test session's default, tests/conftest.py) or on inside a block.
"""

from __future__ import annotations

import contextlib

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from mhc_jax import mixers, parametrization as mp
from mhc_jax.mixers.base import STAT_KEYS, TOKEN_SAMPLE, rms_norm, stream_spread

B, T, C = 2, 5, 8


@contextlib.contextmanager
def xla_optimizations(on: bool):
  """XLA with (``on``) or without most optimisations inside the block (off: a fraction of the
  compile time, most of a tiny run); the previous setting is restored."""
  old = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", not on)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", old)


def sublayer_fn(key, c: int = C):
  """A fixed, nonlinear stand-in for ``norm + attention/MLP``: ``tanh(v)``, ``v = norm(x) W``,
  ``v`` playing the attention values (one head, ``[B, T, 1, C]``) a ``value_fn`` maps first."""
  w = jax.random.normal(key, (c, c)) / jnp.sqrt(c)

  def f(x, value_fn=None):
    v = (rms_norm(x) @ w)[..., None, :]
    if value_fn is not None:
      v = value_fn(v)
    return jnp.tanh(v[..., 0, :]).astype(x.dtype)

  return f


LAYERS = 4  # the mixer-layer count (2L) the checks tell mixers whose state depends on depth


def setup(name: str, n: int | None = None, dtype=jnp.float32, seed: int = 0, **opts):
  """(mixer, params, state, sublayer, apply) for a small random state: ``mixer.expand`` of a
  random ``[B, T, C]`` input plus noise on every leaf (streams differ, as after training)."""
  if n is not None:
    opts = opts | {"n": n}
  mixer = mixers.get(name, layers=LAYERS, **opts)
  k_x, k_f, k_p, k_s = jax.random.split(jax.random.PRNGKey(seed), 4)
  state = mixer.expand(jax.random.normal(k_x, (B, T, C)).astype(dtype))
  leaves, tree = jax.tree.flatten(state)
  keys = jax.tree.unflatten(tree, jax.random.split(k_s, len(leaves)))
  state = jax.tree.map(lambda l, k: (l + jax.random.normal(k, l.shape)).astype(dtype), state, keys)
  f = sublayer_fn(k_f)
  params = nn.meta.unbox(mixer.init(k_p, state, f, 0))

  def apply(p, x, layer=0):
    return mixer.apply(p, x, f, layer)

  return mixer, params, state, f, apply


REQUIRED_STATS = ("rms_in", "rms_out", "branch_rms")
H_RES_STATS = ("h_res", "h_res_tok", "h_pre", "h_post", "sinkhorn_err")


def check_shapes(name: str, dtype=jnp.float32, **opts) -> None:
  """State tree, shapes and dtypes preserved; stats: the required scalars, and the full ``H_res``
  set (``h_res [n,n]``, ``h_res_tok [S,n,n]``, ``h_pre``, ``h_post [n]``, ``sinkhorn_err``) for a
  mixer that reports ``h_res`` at all."""
  mixer, params, x, _, apply = setup(name, dtype=dtype, **opts)
  out, stats = apply(params, x)
  chex.assert_trees_all_equal_shapes_and_dtypes(out, x)
  missing = set(REQUIRED_STATS) - set(stats)
  assert not missing, f"{name}: stats lack {sorted(missing)}"
  unknown = set(stats) - set(STAT_KEYS)
  assert not unknown, f"{name}: stats {sorted(unknown)} are not contract keys {STAT_KEYS}"
  if "h_res" in stats:
    assert set(H_RES_STATS) <= set(stats), f"{name}: h_res without {set(H_RES_STATS) - set(stats)}"
    n = stats["h_res"].shape[-1]
    chex.assert_shape([stats["h_res"], stats["h_pre"], stats["h_post"]], [(n, n), (n,), (n,)])
    chex.assert_shape(stats["h_res_tok"], (min(TOKEN_SAMPLE, B * T), n, n))
    chex.assert_shape(stats["sinkhorn_err"], ())
  for k in REQUIRED_STATS:
    chex.assert_shape(stats[k], ())
  chex.assert_type(list(stats.values()), jnp.float32)
  chex.assert_trees_all_equal_shapes(mixer.expand(jnp.zeros((B, T, C), dtype)), x)
  assert mixer.stream(x).ndim == 4, f"{name}: stream(state) must be [B, T, k, C']"


def check_transforms(name: str, variant=jax.jit, **opts) -> None:
  """``variant(apply)`` equals plain apply; vmap over a leading batch of states and grads work."""
  _, params, x, _, apply = setup(name, **opts)
  ref = apply(params, x)
  got = variant(apply)(params, x)
  chex.assert_trees_all_close(got, ref, rtol=1e-5, atol=1e-5)
  xs = jax.tree.map(lambda a: jnp.stack([a, 2.0 * a]), x)
  out_v, _ = jax.vmap(apply, in_axes=(None, 0))(params, xs)
  chex.assert_trees_all_close(jax.tree.map(lambda a: a[0], out_v), ref[0], rtol=1e-5, atol=1e-5)
  g = variant(jax.grad(lambda p: _sumsq(apply(p, x)[0])))(params)
  chex.assert_trees_all_equal_structs(g, params)


def _sumsq(tree):
  return sum(jnp.sum(jnp.square(l.astype(jnp.float32))) for l in jax.tree.leaves(tree))


def check_finite_grads(name: str, dtype=jnp.float32, **opts) -> None:
  """The gradients of the parameters and of the state are finite; the state's is not all zero."""
  _, params, x, _, apply = setup(name, dtype=dtype, **opts)

  def loss(p, x):
    out, stats = apply(p, x)
    size = sum(l.size for l in jax.tree.leaves(out))
    return _sumsq(out) / size + stats["rms_out"]

  gp, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
  chex.assert_tree_all_finite((gp, gx))
  norms = [float(jnp.linalg.norm(l.astype(jnp.float32))) for l in jax.tree.leaves(gx)]
  assert max(norms) > 0, f"{name}: input gradient is identically zero"


def perturb(params, key, scale: float = 1.0):
  """Every parameter plus N(0, scale²) noise: a state far from initialisation."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.tree.unflatten(tree, jax.random.split(key, len(leaves)))
  return jax.tree.map(lambda l, k: l + scale * jax.random.normal(k, l.shape, l.dtype), params, keys)


def per_token_h_res(mixer, params, x, f):
  """Per-token H_res of one call: each token applied as its own batch of one."""
  tokens = x.reshape((-1, 1, 1) + x.shape[-2:])
  return jax.vmap(lambda t: mixer.apply(params, t, f, 0)[1]["h_res"])(tokens)


def check_invariants(name: str, seeds=(1, 2, 3), scale: float = 0.5, **opts) -> None:
  """Doubly stochastic H_res (per token and averaged) under random parameter perturbations.

  Rows exact; column error at most the reported ``sinkhorn_err``, and below 1e-3 given enough
  Sinkhorn iterations (docs/interfaces.md, "The mixer contract")."""
  probe = mixers.get(name, **opts)
  if not type(probe).doubly_stochastic:
    return
  iter_opts = [opts]
  if "sinkhorn_iters" in mixers.options(name):
    iter_opts.append(opts | {"sinkhorn_iters": 1000})
  for o in iter_opts:
    mixer, params, x, f, _ = setup(name, **o)

    @jax.jit
    def run(p, x):
      return per_token_h_res(mixer, p, x, f), mixer.apply(p, x, f, 0)[1]

    for seed in seeds:
      k_x, k_p = jax.random.split(jax.random.PRNGKey(100 + seed))
      p = perturb(params, k_p, scale=scale)
      h_tok, stats = run(p, jax.random.normal(k_x, x.shape, x.dtype))
      err = float(stats["sinkhorn_err"])
      for h in (h_tok, stats["h_res"]):
        assert bool(jnp.all(h >= -1e-7)), f"{name}: H_res has negative entries"
        row = float(jnp.max(jnp.abs(h.sum(-1) - 1)))
        col = float(jnp.max(jnp.abs(h.sum(-2) - 1)))
        assert row < 1e-5, f"{name}: row sums off by {row:.2e}"
        assert col <= err + 1e-5, f"{name}: column error {col:.2e} > reported {err:.2e}"
        if o.get("sinkhorn_iters", 0) >= 1000 or "sinkhorn_iters" not in mixers.options(name):
          assert col < 1e-3, f"{name}: column error {col:.2e} with {o}"


# --------------------------------------------------------------------------- stream separation
SEP_DEPTH = 32  # mixer layers of the separation check's stack
SEP_STEPS = 300  # Adam steps (lr 1e-2) before its spread is read
SEP_THRESHOLD = 0.15  # the lower quartile of the spread over layers must exceed this


class _Layer(nn.Module):
  """One mixer layer around a sublayer ``tanh(Dense(norm(h)))``: (state, its stream spread)."""

  name_: str
  opts: dict
  depth: int

  @nn.compact
  def __call__(self, x, i):
    dense = nn.Dense(C, use_bias=False, name="f")
    mixer = mixers.get(self.name_, module_name="mix", layers=self.depth, **self.opts)
    x, _ = mixer(x, lambda h, value_fn=None: jnp.tanh(dense(rms_norm(h))).astype(h.dtype), i)
    spec = mixers.get(self.name_, layers=self.depth, **self.opts).clone(parent=None)
    return x, stream_spread(spec.stream(x))


class _Stack(nn.Module):
  """A tiny language model around a mixer: embed, expand, ``depth`` mixer layers (scanned, so the
  compile does not grow with depth), collapse, head. Returns the logits and the spread per layer."""

  name_: str
  opts: dict
  vocab: int = 16
  depth: int = SEP_DEPTH

  @nn.compact
  def __call__(self, tokens_BT):
    emb = self.param("embedding", nn.initializers.normal(1.0), (self.vocab, C))
    spec = mixers.get(self.name_, layers=self.depth, **self.opts).clone(parent=None)
    layers = nn.scan(
      _Layer,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      in_axes=0,
      length=self.depth,
      metadata_params={nn.PARTITION_NAME: "layers"},
    )(self.name_, self.opts, self.depth, name="layers")
    x, spreads = layers(spec.expand(emb[tokens_BT]), jnp.arange(self.depth))
    collapse_cls, kw = spec.collapse_module()
    head = nn.Dense(self.vocab, use_bias=False, name="head")
    return head(rms_norm(collapse_cls(**kw, name="collapse")(x))), spreads


def stream_separation(
  name: str, steps: int = SEP_STEPS, depth: int = SEP_DEPTH, lr: float = 1e-2, seed: int = 0, **opts
) -> np.ndarray:
  """Stream spread after each of ``depth`` mixer layers, ``[steps + 1, depth]``: row ``k`` after
  ``k`` Adam steps of a tiny stack (:class:`_Stack`) learning a fixed random token map
  (``target = perm[token]``, a fresh batch of 8 x 8 tokens every step)."""
  model = _Stack(name, opts, depth=depth)
  k_perm, k_data, k_p = jax.random.split(jax.random.PRNGKey(seed), 3)
  perm = jax.random.permutation(k_perm, model.vocab)
  params = nn.meta.unbox(model.init(k_p, jnp.zeros((8, 8), jnp.int32)))
  tx = optax.adam(lr)

  def spreads(p, tokens):
    return model.apply(p, tokens)[1]

  def loss(p, tokens):
    logits = model.apply(p, tokens)[0]
    return optax.softmax_cross_entropy_with_integer_labels(logits, perm[tokens]).mean()

  def step(carry, key):
    p, o = carry
    tokens = jax.random.randint(key, (8, 8), 0, model.vocab)
    u, o = tx.update(jax.grad(loss)(p, tokens), o, p)
    return (optax.apply_updates(p, u), o), spreads(p, tokens)

  @jax.jit
  def run(p):
    keys = jax.random.split(k_data, steps + 1)
    (p, _), hist = jax.lax.scan(step, (p, tx.init(p)), keys[:-1])
    last = spreads(p, jax.random.randint(keys[-1], (8, 8), 0, model.vocab))
    return jnp.concatenate([hist, last[None]])

  with xla_optimizations(True):  # 300 steps: the optimised program runs them ~3x faster
    return np.asarray(run(params))


def check_stream_separation(name: str, threshold: float = SEP_THRESHOLD, **opts) -> float:
  """The streams stay apart under training: after :data:`SEP_STEPS` Adam steps of a
  :data:`SEP_DEPTH`-layer stack, the lower quartile of the stream spread over its layers exceeds
  ``threshold`` (why a quartile, and the measured values: docs/mixers.md, "Symmetry").
  Single-stream mixers (``n = 1``) pass trivially. Returns the quartile."""
  n = opts.get("n", int(getattr(mixers.resolve(name), "n", 1)))  # the mixer's default n
  if n == 1 or not type(mixers.get(name, **opts)).multi_stream:
    return 0.0
  per_layer = stream_separation(name, **opts)[-1]
  spread = float(np.quantile(per_layer, 0.25))
  assert spread > threshold, (
    f"{name} {opts}: streams collapse under training (lower quartile of the relative spread over "
    f"{SEP_DEPTH} layers {spread:.2e} <= {threshold:.2g} after {SEP_STEPS} steps; per layer "
    f"{np.round(per_layer, 3).tolist()}): the n-stream model is a single-stream residual"
  )
  return spread


WIDE_ROLES = ("hidden", "readout", "res_readout")  # fan-in grows with the width


def _param_shapes(name: str, c: int, **opts) -> dict[str, tuple]:
  """{'/'.join(keys): shape} of the mixer's and its collapse's parameters at width ``c``
  (abstract: ``jax.eval_shape``, nothing is computed)."""
  mixer = mixers.get(name, layers=LAYERS, **opts)
  x = jax.ShapeDtypeStruct((B, T, c), jnp.float32)
  f = sublayer_fn(jax.random.PRNGKey(0), c)
  state = jax.eval_shape(mixer.expand, x)
  cls, fields = mixer.collapse_module()
  trees = [
    jax.eval_shape(lambda s: mixer.init(jax.random.PRNGKey(0), s, f, 0), state),
    jax.eval_shape(lambda s: cls(**fields).init(jax.random.PRNGKey(0), s), state),
  ]
  leaves = jax.tree_util.tree_leaves_with_path(nn.meta.unbox(trees))
  keys = [[str(k.key) for k in p if isinstance(k, jax.tree_util.DictKey)] for p, _ in leaves]
  return {"/".join(k[1:]): tuple(v.shape) for k, (_, v) in zip(keys, leaves)}  # k[0]: "params"


def _fan_in(shape: tuple) -> int:
  return int(np.prod(shape[:-1])) if len(shape) >= 2 else 1


def check_param_roles(name: str, **opts) -> None:
  """Every parameter of the mixer and of its collapse has a role (mup, completep) that fits its
  shape.

  ``param_roles`` maps leaf names to roles (docs/parametrization.md), checked at widths C and 2C
  as microsoft/mup's ``assert_hidden_size_inf``: a width-like role's fan-in (all axes but the
  last; a vector: its size) grows with the width, a scalar-like one's does not."""
  roles = type(mixers.get(name, layers=LAYERS, **opts)).param_roles
  small, big = _param_shapes(name, C, **opts), _param_shapes(name, 2 * C, **opts)
  for path, shape in small.items():
    got = mp.role(["attn_mix", *path.split("/")], roles)
    assert got in mp.MIXER_ROLES, (
      f"{name}: parameter {path} has role {got!r} (param_roles = {roles})"
    )
    grows = [a != b for a, b in zip(shape, big[path])]
    fan_grows = _fan_in(big[path]) > _fan_in(shape)
    declared = f"{name}: parameter {path} is declared {got!r}"
    shapes = f"(shape {shape} at width {C}, {big[path]} at {2 * C})"
    if got in WIDE_ROLES:
      ok = fan_grows if len(shape) >= 2 else any(grows)
      assert ok, f"{declared} (width-like) but its fan-in does not grow with the width {shapes}"
    else:
      assert not fan_grows, (
        f"{declared} (scalar-like) but its fan-in grows with the width {shapes}: hidden or readout?"
      )


# --------------------------------------------------------------------------- all at once
#: Every contract check, with the settings :func:`check_mixer` runs it under; its docstring's
#: first paragraph says what it means.
CHECKS = {
  check_shapes: [{"dtype": jnp.float32}, {"dtype": jnp.bfloat16}],
  check_transforms: [{"variant": jax.jit}, {"variant": lambda f: f}],
  check_finite_grads: [{"dtype": jnp.float32}, {"dtype": jnp.bfloat16}],
  check_invariants: [{}],
  check_stream_separation: [{}],
  check_param_roles: [{}],
}


def check_mixer(mixer, **options) -> None:
  """Every check of :data:`CHECKS` on ``mixer`` (a Mixer subclass, a registered name or a
  ``"module:Class"`` path) with ``options``; one AssertionError lists each failed check, what
  it means and how it failed (a user's test file: docs/mixers.md, "Your own mixer")."""
  mixers.options(mixer)  # ValueError for what is not a mixer
  failed = []
  for check, settings in CHECKS.items():
    try:
      for s in settings:
        check(mixer, **s, **options)
    except Exception as e:  # noqa: BLE001 - a check that raises has failed
      meaning = " ".join(check.__doc__.split("\n\n")[0].split())
      how = " ".join(f"{type(e).__name__}: {e}".split())[:300]
      failed.append(f"- {check.__name__}: {meaning} Failed: {how}")
  if failed:
    label = f"{getattr(mixer, '__name__', mixer)}: {len(failed)} of {len(CHECKS)} contract checks"
    raise AssertionError("\n".join([f"{label} failed", *failed]))
