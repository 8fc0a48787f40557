"""Optimiser: schedules, the weight-decay mask (boxed and unboxed trees), AdamW, clipping,
independent weight decay."""

from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mhc_jax.train.config import OptimConfig
from mhc_jax.train.optim import decay_mask, decays, make_optimizer, make_schedule, peak_lr

ROOT = Path(__file__).resolve().parents[1]


def _opt(**kw):
  base = dict(lr=1e-2, warmup_steps=10, min_lr_ratio=0.1)
  base.update(kw)
  return OptimConfig(**base)


# ---------------------------------------------------------------------------- schedules


@pytest.mark.parametrize(
  "kind,mid,end",
  [
    ("cosine", 1e-3 + (1e-2 - 1e-3) * 0.5, 1e-3),
    ("linear", 1e-3 + (1e-2 - 1e-3) * 0.5, 1e-3),
    ("constant", 1e-2, 1e-2),
  ],
)
def test_schedule_values(kind, mid, end):
  s = make_schedule(_opt(schedule=kind), total_steps=110)
  assert float(s(0)) == 0.0
  assert float(s(5)) == pytest.approx(5e-3)
  assert float(s(10)) == pytest.approx(1e-2)  # end of warm-up: the peak
  assert float(s(60)) == pytest.approx(mid)  # half-way through the decay
  assert float(s(110)) == pytest.approx(end)
  assert float(s(500)) == pytest.approx(end)  # past the end: holds
  assert float(jax.jit(s)(jnp.int32(10))) == pytest.approx(1e-2)


def test_schedule_monotone_and_no_warmup():
  s = make_schedule(_opt(warmup_steps=0), total_steps=50)
  assert float(s(0)) == pytest.approx(1e-2)
  vals = np.array([float(s(i)) for i in range(51)])
  assert np.all(np.diff(vals) <= 1e-9) and vals[-1] == pytest.approx(1e-3)


# ---------------------------------------------------------------------------- decay mask

LP = nn.with_logical_partitioning


class _Tiny(nn.Module):
  """Names as the real model uses them: Dense/Embed/norms plus mixer-style parameters."""

  @nn.compact
  def __call__(self, tok):
    emb = nn.Embed(11, 8, embedding_init=LP(nn.initializers.normal(1.0), ("vocab", "embed")))
    x = emb(tok)
    x = nn.LayerNorm(
      scale_init=LP(nn.initializers.ones, ("embed",)),
      bias_init=LP(nn.initializers.zeros, ("embed",)),
    )(x)
    x = nn.Dense(
      8,
      kernel_init=LP(nn.initializers.lecun_normal(), ("embed", "mlp")),
      bias_init=LP(nn.initializers.zeros, ("mlp",)),
      name="mlp",
    )(x)
    b_res = self.param("b_res", LP(nn.initializers.zeros, (None, None)), (4, 4))
    phi_res = self.param("phi_res", LP(nn.initializers.normal(1.0), ("embed", None)), (8, 16))
    w_beta = self.param("w_beta", LP(nn.initializers.normal(1.0), ("embed", None)), (8, 4))
    alpha = self.param("alpha_res", nn.initializers.constant(0.01), ())
    s_beta = self.param("s_beta", nn.initializers.constant(0.01), (4,))
    h = x @ phi_res
    return h.sum() * alpha + (x @ w_beta).sum() * s_beta.sum() + b_res.sum() + emb.attend(x).sum()


EXPECT = {
  "embedding": True,
  "kernel": True,
  "phi_res": True,
  "w_beta": True,
  "scale": False,
  "bias": False,
  "b_res": False,
  "alpha_res": False,
  "s_beta": False,
}


@pytest.fixture(scope="module")
def params():
  # Structure (names, boxes, shapes) from the real module; values from numpy, which spares a
  # compilation of init.
  shapes = jax.eval_shape(_Tiny().init, jax.random.key(0), jnp.zeros((2, 3), jnp.int32))
  rng = np.random.default_rng(0)
  boxed = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), s.dtype), shapes["params"])
  return boxed, nn.meta.unbox(boxed)


def _names_and_mask(tree):
  flat = jax.tree_util.tree_flatten_with_path(decay_mask(tree))[0]
  out = {}
  for path, m in flat:
    name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
    out.setdefault(name, set()).add(bool(m))
  return out


def test_decays_names():
  for name, want in EXPECT.items():
    assert decays(name) is want, name
  assert decays("phi") and decays("w_m") and not decays(None) and not decays("b_pre")


@pytest.mark.parametrize("boxed", [True, False], ids=["boxed", "unboxed"])
def test_decay_mask_real_flax_tree(params, boxed):
  tree = params[0] if boxed else params[1]
  got = _names_and_mask(tree)
  assert got == {k: {v} for k, v in EXPECT.items()}
  assert jax.tree.structure(decay_mask(tree)) == jax.tree.structure(tree)
  if boxed:
    assert any(
      isinstance(x, nn.Partitioned)
      for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    )


@pytest.mark.parametrize("boxed", [True, False], ids=["boxed", "unboxed"])
def test_adamw_mask_zero_grad(params, boxed):
  """With zero gradients only weight decay moves parameters: decayed ones shrink by lr*wd,
  the others stay exactly where they are. Works on the boxed tree as well."""
  tree = params[0] if boxed else params[1]
  tx, _ = make_optimizer(_opt(schedule="constant", warmup_steps=0, weight_decay=0.5), 100)
  state = tx.init(tree)
  zeros = jax.tree.map(jnp.zeros_like, tree)
  new = nn.meta.unbox(
    jax.jit(lambda z, st, tr: optax.apply_updates(tr, tx.update(z, st, tr)[0]))(zeros, state, tree)
  )
  old = params[1]
  flat_new = dict(jax.tree_util.tree_flatten_with_path(new)[0])
  for path, p in jax.tree_util.tree_flatten_with_path(old)[0]:
    name = path[-1].key
    if EXPECT[name]:
      np.testing.assert_allclose(flat_new[path], p * (1 - 1e-2 * 0.5), rtol=1e-6)
    else:
      np.testing.assert_array_equal(flat_new[path], p)


# ---------------------------------------------------------------------------- clipping


def test_clip_off_vs_on():
  params = {"kernel": jnp.ones(3)}
  grads = {"kernel": jnp.array([30.0, 40.0, 0.0])}  # global norm 50
  kw = dict(schedule="constant", warmup_steps=0, weight_decay=0.0, eps=1.0)  # eps: scale matters

  def first_update(opt, g=grads):
    tx, _ = make_optimizer(opt, 10)
    return tx.update(g, tx.init(params), params)[0]["kernel"]

  off0, offn = first_update(_opt(clip=0, **kw)), first_update(_opt(clip=None, **kw))
  plain = optax.adamw(1e-2, b1=0.9, b2=0.95, eps=1.0, weight_decay=0.0)
  ref = plain.update(grads, plain.init(params), params)[0]["kernel"]
  np.testing.assert_allclose(off0, ref, rtol=1e-6)
  np.testing.assert_allclose(offn, ref, rtol=1e-6)
  on = first_update(_opt(clip=1.0, **kw))
  clipped = {"kernel": grads["kernel"] / 50.0}
  np.testing.assert_allclose(on, first_update(_opt(clip=0, **kw), clipped), rtol=1e-5)
  assert not np.allclose(on, off0)


# ---------------------------------------------------------------------------- weight decay flavours


def test_independent_wd_numerics():
  """One parameter, zero gradient, cosine schedule with warm-up:
  standard AdamW   p <- p * (1 - lr(t) * wd)
  independent      p <- p * (1 - wd * lr(t) / lr)"""
  lr, wd, steps = 0.1, 0.01, 12
  opt_kw = dict(lr=lr, warmup_steps=3, schedule="cosine", weight_decay=wd, clip=None)
  for independent in (False, True):
    opt = OptimConfig(independent_wd=independent, **opt_kw)
    tx, sched = make_optimizer(opt, steps)
    p = {"kernel": jnp.array([2.0])}
    state = tx.init(p)
    want = 2.0
    for t in range(steps):
      upd, state = tx.update({"kernel": jnp.zeros(1)}, state, p)
      p = optax.apply_updates(p, upd)
      s = float(sched(t))
      want *= 1 - (wd * s / lr if independent else s * wd)
    assert float(p["kernel"][0]) == pytest.approx(want, rel=1e-5)


def test_independent_wd_with_gradient():
  """First step with a gradient: p1 = p0 - lr(0) * adam_dir - wd * lr(0)/lr * p0."""
  lr, wd, eps = 0.05, 0.02, 1e-8
  opt = OptimConfig(
    lr=lr,
    warmup_steps=0,
    schedule="linear",
    weight_decay=wd,
    eps=eps,
    independent_wd=True,
    clip=None,
  )
  tx, sched = make_optimizer(opt, 10)
  p0, g = 3.0, -0.7
  p = {"kernel": jnp.array([p0])}
  upd, _ = tx.update({"kernel": jnp.array([g])}, tx.init(p), p)
  s0 = float(sched(0))
  adam_dir = g / (abs(g) + eps)  # bias-corrected first Adam step
  want = p0 - s0 * adam_dir - wd * s0 / lr * p0
  assert float(optax.apply_updates(p, upd)["kernel"][0]) == pytest.approx(want, rel=1e-6)
  # a bias-like leaf gets no decay under either flavour
  q = {"bias": jnp.array([p0])}
  upd, _ = tx.update({"bias": jnp.array([0.0])}, tx.init(q), q)
  assert float(optax.apply_updates(q, upd)["bias"][0]) == p0


def test_lr_population_vmap():
  """lr may be a traced array: one program updates a population of learning rates."""
  opt = _opt(schedule="constant", warmup_steps=0, clip=1.0)
  p = {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}
  g = {"kernel": jnp.full((2, 2), 0.5), "bias": jnp.full(2, -0.5)}
  lrs = jnp.array([1e-3, 1e-2])

  def one(lr):
    tx, _ = make_optimizer(opt, 10, lr=lr)
    return optax.apply_updates(p, tx.update(g, tx.init(p), p)[0])

  pop = jax.jit(jax.vmap(one))(lrs)
  for i, lr in enumerate([1e-3, 1e-2]):
    single = jax.jit(one)(lr)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a[i], b, rtol=1e-6), pop, single)


# ---------------------------------------------------------------------------- training length


def _jaxpr(opt, steps=2400):
  """The step -> lr program of a population member (traced lr)."""
  return jax.make_jaxpr(lambda lr, t: make_optimizer(opt, steps, lr=lr)[1](t))(0.01, 5).jaxpr


def test_base_steps_unset_changes_nothing():
  """optim.base_steps unset: the lr as set, the same traced program, the hash of before the key
  existed (every earlier run directory and sweep resume); steps_exponent then is ignored."""
  from mhc_jax.train.config import Config, config_hash, load_config

  assert config_hash(Config()) == "6b19465d1c"  # tests/test_config.py HASHES
  quick = load_config(ROOT / "configs" / "quickstart.yaml")
  bent = load_config(ROOT / "configs" / "quickstart.yaml", ["optim.steps_exponent=0.25"])
  assert config_hash(bent) == config_hash(quick)
  assert config_hash(Config()) != config_hash(load_config(None, ["optim.base_steps=200"]))
  plain, ignored = _opt(), _opt(steps_exponent=0.25)
  assert str(_jaxpr(ignored)) == str(_jaxpr(plain)) != str(_jaxpr(_opt(base_steps=150)))
  assert len(_jaxpr(_opt(base_steps=150)).eqns) == len(_jaxpr(plain).eqns) + 1  # one multiply
  a, b = make_schedule(plain, 2400), make_optimizer(ignored, 2400)[1]
  np.testing.assert_array_equal(
    [a(t) for t in range(0, 2500, 50)], [b(t) for t in range(0, 2500, 50)]
  )
  assert float(a(10)) == pytest.approx(1e-2) == float(b(10))


@pytest.mark.parametrize("exponent,peak", [(0.25, 0.016), (0.5, 0.008), (0.0, 0.032)])
def test_base_steps_set_peak_is_the_formula(exponent, peak):
  """lr tuned at base_steps 150, trained 2400 steps: the peak (end of warm-up) is
  lr (2400 / 150)^-exponent, for the single run's schedule and a population's traced lr; the
  decay ends at min_lr_ratio of that peak; the CLI prints it."""
  opt = _opt(lr=0.032, warmup_steps=240, base_steps=150, steps_exponent=exponent)
  assert peak_lr(opt, 2400) == pytest.approx(0.032 * 16**-exponent) == pytest.approx(peak)
  tx, schedule = make_optimizer(opt, 2400)
  assert float(schedule(240)) == pytest.approx(peak, rel=1e-6)
  assert float(schedule(2400)) == pytest.approx(0.1 * peak, rel=1e-6)
  member = jax.jit(lambda lr: make_optimizer(opt, 2400, lr=lr)[1](240))
  assert float(member(jnp.float32(0.064))) == pytest.approx(2 * peak, rel=1e-6)
  assert peak_lr(opt, 150) == 0.032  # at the length it was tuned at: unchanged


def test_base_steps_cli_prints_the_peak_and_names_bad_input(tmp_path, capsys):
  from mhc_jax import cli

  debug = str(ROOT / "configs" / "debug.yaml")
  args = ["train", "--config", debug, "--dry-run", "--out", str(tmp_path / "ok"), "--set"]
  assert cli.main([*args, "optim.lr=0.032", "optim.base_steps=150", "train.steps=2400"]) == 0
  assert "peak lr 0.008 = optim.lr 0.032 x (2400 / 150 steps)^-0.5" in capsys.readouterr().out
  bad = {
    "optim.base_steps=0": "optim.base_steps: must be >= 1, got 0",
    "optim.base_steps=-150": "optim.base_steps: must be >= 1, got -150",
    "optim.base_steps=150.5": "optim.base_steps: expected int or null, got float 150.5",
    "optim.steps_exponent=-0.25": "optim.steps_exponent: must be >= 0, got -0.25",
    "optim.steps_exponent=.inf": "optim.steps_exponent: expected a finite number, got inf",
    "optim.steps_exponent=.nan": "optim.steps_exponent: expected a finite number, got nan",
  }
  for setting, message in bad.items():
    out = tmp_path / "bad"
    assert cli.main(["train", "--config", debug, "--out", str(out), "--set", setting]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and message in err, (setting, err)
    assert not out.exists()
