"""``model.parametrization`` (mhc_jax/parametrization.py, docs/parametrization.md): the default
``sp`` is the optimiser chain it was and completep at its base sizes is sp bit for bit; every
parameter gets a label and the labels' multipliers are Table 1's; planted coordinate checks
(completep flat, completep without its branch multiplier or without its lr scaling growing);
sharded meshes, resume and populations; bad input."""

from __future__ import annotations

import dataclasses
import shutil
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mhc_jax import cli, coord_check as cc, logs, mixers, parametrization as mp
from mhc_jax.model import Transformer
from mhc_jax.train.config import ModelConfig, load_config
from mhc_jax.train.loop import SingleProgram, prepare, train
from mhc_jax.train.optim import decay_mask, make_optimizer, make_schedule
from mhc_jax.train.state import param_shapes

ROOT = Path(__file__).resolve().parents[1]
DEBUG = ROOT / "configs" / "debug.yaml"
# width 16 = 2 x base 8, depth 2 = 2 x base 1: every multiplier differs from 1
SCALED = ("model.parametrization=completep", "model.base_width=8", "model.base_depth=1")


def tiny(*overrides):
  return load_config(DEBUG, ["train.diag_every=0", "train.eval_every=0", *overrides])


def _grads(params, seed=0):
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(tree, [jax.random.normal(k, l.shape) for k, l in zip(keys, leaves)])


def _updates(tx, params, steps=3):
  state, out = tx.init(params), []
  for t in range(steps):
    u, state = tx.update(_grads(params, t), state, params)
    params = optax.apply_updates(params, u)
    out.append(u)
  return out, state


SMALL = {
  "params": {
    "embedding": jnp.ones((5, 4)),
    "blocks": {
      "attn": {"query": {"kernel": jnp.ones((1, 4, 2, 2))}},
      "attn_norm": {"scale": jnp.ones((1, 4))},
      "attn_mix": {
        "b_mix": jnp.ones((1, 2, 2)),
        "b_read": jnp.ones((1, 2)),
        "w_mix": jnp.ones((1, 4, 2)),
        "w_read": jnp.ones((1, 4)),
      },
    },
    "collapse": {"b_collapse": jnp.ones((2,))},
    "final_norm": {"scale": jnp.ones((4,))},
    "head": {"kernel": jnp.ones((4, 5))},
  }
}
SMALL_LABELS = {
  "params": {
    "embedding": "top/embedding",
    "blocks": {
      "attn": {"query": {"kernel": "block/hidden"}},
      "attn_norm": {"scale": "block/norm"},
      "attn_mix": {
        "b_mix": "block/res",
        "b_read": "block/scalar",
        "w_mix": "block/res_readout",
        "w_read": "block/readout",
      },
    },
    "collapse": {"b_collapse": "top/scalar"},
    "final_norm": {"scale": "top/norm"},
    "head": {"kernel": "top/output"},
  }
}


@pytest.mark.parametrize("independent_wd", [False, True])
def test_sp_is_the_previous_optimizer_chain_exactly(independent_wd):
  """Default sp (with or without a model config) gives the chain make_optimizer built before
  parametrisations existed: the same state tree and bit-identical updates."""
  optim = tiny(f"optim.independent_wd={str(independent_wd).lower()}", "optim.weight_decay=0.01")
  optim = optim.optim
  schedule = make_schedule(optim, 10)
  adam = dict(b1=optim.b1, b2=optim.b2, eps=optim.eps)
  if independent_wd:
    tail = [
      optax.scale_by_adam(**adam),
      optax.add_decayed_weights(optim.weight_decay / optim.lr, mask=decay_mask),
      optax.scale_by_learning_rate(schedule),
    ]
  else:
    tail = [optax.adamw(schedule, **adam, weight_decay=optim.weight_decay, mask=decay_mask)]
  before = optax.chain(optax.clip_by_global_norm(optim.clip), *tail)
  want, want_state = _updates(before, SMALL)
  for model in (None, ModelConfig(), ModelConfig(width=512, base_width=8)):
    got, state = _updates(make_optimizer(optim, 10, model=model)[0], SMALL)
    assert jax.tree.structure(state) == jax.tree.structure(want_state)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_completep_at_its_base_sizes_is_sp_bit_for_bit():
  """At width = base_width and depth = base_depth every multiplier is 1: three steps with an
  untied head give the same parameters as sp, bit for bit (the readout and scalar roles' unit
  multipliers: test_the_optimizer_scales_each_labelled_update_by_its_multiplier)."""
  base = ["model.tied_embeddings=false", "mesh.data=1", "train.steps=3"]
  base += ["model.base_width=16", "model.base_depth=1"]
  params = []
  for par in ("sp", "completep"):
    program = SingleProgram(prepare(tiny(*base, f"model.parametrization={par}"), jax.devices()[:1]))
    state = program.init()
    for t in range(3):
      state, _ = program.step(state, None, t, False)
    params.append(jax.device_get(state.params))
  jax.tree.map(np.testing.assert_array_equal, *params)
  assert not np.array_equal(params[0]["params"]["head"]["kernel"], 0)


def test_labels_and_multipliers_of_a_small_tree():
  """Labels from names and the mixer's param_roles; Table 1's multipliers at m_d = 2, m_L = 4."""
  cfg = ModelConfig(mixer="hc", width=64, depth=8, base_width=32, parametrization="completep")
  assert mp.labels(SMALL, cfg) == SMALL_LABELS
  assert mp.factors(cfg) == (2.0, 4.0, 1.0)
  got = {l: (mp.multipliers(cfg, l)["lr"], mp.multipliers(cfg, l)["wd"]) for l in mp.LABELS}
  assert {l: v for l, v in got.items() if l in jax.tree.leaves(SMALL_LABELS)} == {
    "block/hidden": (0.5, 2.0),  # m_d^-1 m_L^(alpha-1), wd m_d
    "block/readout": (0.5, 2.0),
    "block/norm": (1.0, 1.0),  # m_L^(alpha-1)
    "block/scalar": (1.0, 1.0),
    "block/res": (0.25, 1.0),  # m_L^-1: on the stream path
    "block/res_readout": (0.125, 2.0),
    "top/embedding": (1.0, 1.0),
    "top/output": (1.0, 1.0),
    "top/norm": (1.0, 1.0),
    "top/scalar": (1.0, 1.0),
  }
  assert mp.multipliers(cfg, "top/output") == {"lr": 1.0, "wd": 1.0, "init": 2**0.5, "eps": 0.5}
  assert mp.branch_multiplier(cfg) == 0.25
  eps = {l: mp.multipliers(cfg, l)["eps"] for l in mp.LABELS}  # Complete(d)P Eq. 40, per role
  assert {eps[f"block/{r}"] for r in ("hidden", "readout", "norm", "scalar")} == {1 / 8}
  assert {eps[l] for l in mp.LABELS if l.startswith("top/")} == {0.5}  # emb, unemb: eps / m_d
  assert eps["block/res"] == eps["block/res_readout"] == 0.5  # on the stream, no branch
  untied = dataclasses.replace(cfg, tied_embeddings=False)  # logits h W / m_d
  assert (mp.logit_multiplier(untied), mp.logit_multiplier(cfg)) == (0.5, 2**-0.5)
  half = dataclasses.replace(cfg, depth_alpha=0.5)  # depth-muP
  assert mp.multipliers(half, "block/hidden")["lr"] == 0.25
  assert mp.multipliers(half, "block/scalar")["lr"] == 0.5 and mp.branch_multiplier(half) == 0.5
  assert mp.multipliers(half, "block/res")["lr"] == 0.25  # 1/m_L whatever alpha
  width_only = dataclasses.replace(cfg, parametrization="mup")
  assert mp.multipliers(width_only, "block/hidden")["lr"] == 0.5
  assert mp.branch_multiplier(width_only) == 1.0
  assert {mp.multipliers(width_only, l)["eps"] for l in mp.LABELS} == {0.5}  # as before: 1/m_d


def test_init_logits_take_the_same_width_factor_tied_and_untied():
  """Logits ``h·W / (sqrt(base_width) m_d)``, W the tied embedding or sqrt(base_width) x the
  untied head: at init and 4x the base width, mup's logits are sp's x m_d^-1/2 = 1/2 in both
  forms (the same draws: the untied head starts 2x sp's and its logits are divided by 4)."""
  tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 16), 0, 64)

  def logits(par, tied):
    sets = [f"model.parametrization={par}", f"model.tied_embeddings={tied}", "model.vocab=64"]
    model = Transformer(tiny(*sets, "model.width=128", "model.base_width=32").model)
    return model.apply(model.init(jax.random.PRNGKey(0), tokens), tokens)[0]

  for tied in ("true", "false"):
    np.testing.assert_allclose(logits("mup", tied), 0.5 * logits("sp", tied), rtol=1e-5, atol=1e-6)


def test_mup_attention_logits_take_sqrt_base_head_dim_over_head_dim():
  """``model.base_head_dim`` set: µP's 1/head_dim attention, logits ``q·k sqrt(b) / d``: at
  head dim 32 and b = 8 every attention logit is sp's x 1/2 (the same draws); b = d, b unset and
  sp are sp's model bit for bit."""
  tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 16), 0, 64)
  base = ("model.vocab=64", "model.width=64", "model.heads=2", "model.base_width=64")

  def apply(*sets):
    model = Transformer(tiny(*base, *sets).model)
    logits, aux = model.apply(model.init(jax.random.PRNGKey(0), tokens), tokens)
    return np.asarray(logits), np.asarray(aux["attn_logit_max"])

  sp_logits, sp_max = apply()
  for same in (
    ["model.parametrization=mup"],
    ["model.parametrization=mup", "model.base_head_dim=32"],
  ):
    out = apply(*same)
    np.testing.assert_array_equal(out[0], sp_logits)
    np.testing.assert_array_equal(out[1], sp_max)
  np.testing.assert_array_equal(apply("model.base_head_dim=8")[0], sp_logits)  # sp ignores it
  mup_logits, mup_max = apply("model.parametrization=mup", "model.base_head_dim=8")
  np.testing.assert_allclose(mup_max, 0.5 * sp_max, rtol=1e-6)
  assert not np.allclose(mup_logits, sp_logits)
  assert (
    mp.query_multiplier(
      tiny(*base, "model.parametrization=completep", "model.base_head_dim=128").model
    )
    == 2.0
  )


@pytest.mark.parametrize(
  "mixer,averages",
  [("attnres", True), ("laurel", True), ("laurel:rw_norm=none", False), ("residual", False)],
)
def test_mixers_that_average_their_branches_take_no_branch_multiplier(mixer, averages):
  """At init only the branch multiplier depends on depth: completep at depth 4 over base 1
  is its base-4 model exactly for a stream that averages its branches (attnres; laurel's
  normalised residual weights), and not for one that sums them (laurel with rw_norm none)."""
  name, _, opt = mixer.partition(":")
  sets = [
    "model.vocab=64",
    "model.depth=4",
    "model.parametrization=completep",
    f"model.mixer={name}",
  ]
  sets += [f"model.mixer_options.{opt}"] if opt else []
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 64)

  def logits(base_depth):
    model = Transformer(tiny(*sets, f"model.base_depth={base_depth}").model)
    return np.asarray(model.apply(model.init(jax.random.PRNGKey(0), tokens), tokens)[0])

  assert np.array_equal(logits(1), logits(4)) == averages


def test_the_optimizer_scales_each_labelled_update_by_its_multiplier():
  """Adam's first update is ~sign(g) (eps tiny, no decay): per label, -lr x the multiplier."""
  cfg = ModelConfig(mixer="hc", width=64, depth=8, base_width=32, parametrization="completep")
  optim = tiny("optim.weight_decay=0", "optim.warmup_steps=0", "optim.clip=0", "optim.lr=0.1")
  (u,), _ = _updates(make_optimizer(optim.optim, 10, model=cfg)[0], SMALL, steps=1)
  flat = jax.tree_util.tree_leaves_with_path
  g = dict(flat(_grads(SMALL)))
  for (path, label), (_, upd) in zip(flat(SMALL_LABELS), flat(u)):
    want = -0.1 * mp.multipliers(cfg, label)["lr"] * np.sign(g[path])
    np.testing.assert_allclose(upd, want, rtol=1e-4, err_msg=label)


def test_adam_eps_is_scaled_per_role():
  """With gradients far below ε, Adam's first update is ~lr·g/ε: per label it reads back the ε
  that label got, ε/m_d for the embedding and ε/(m_d m_L^α) for the hidden matrices."""
  cfg = ModelConfig(mixer="hc", width=64, depth=8, base_width=32, parametrization="completep")
  optim = tiny("optim.weight_decay=0", "optim.warmup_steps=0", "optim.clip=0", "optim.lr=0.1")
  optim = dataclasses.replace(optim.optim, eps=1e-3)
  tx = make_optimizer(optim, 10, model=cfg)[0]
  g = jax.tree.map(lambda l: jnp.full(l.shape, 1e-9), SMALL)
  u, _ = tx.update(g, tx.init(SMALL), SMALL)
  flat = jax.tree_util.tree_leaves_with_path
  for (_, label), (_, upd) in zip(flat(SMALL_LABELS), flat(u)):
    m = mp.multipliers(cfg, label)
    want = -0.1 * m["lr"] * 1e-9 / (1e-3 * m["eps"])
    np.testing.assert_allclose(upd, want, rtol=1e-3, err_msg=label)
  first = {lab: float(upd.ravel()[0]) for (_, lab), (_, upd) in zip(flat(SMALL_LABELS), flat(u))}
  # same lr multiplier (1), eps / m_d against eps / (m_d m_L^alpha): m_L^alpha = 4 times smaller
  assert first["top/embedding"] * 4 == pytest.approx(first["block/scalar"], rel=1e-3)


def test_peri_ln_applies_the_branch_multiplier_after_its_output_norm():
  """Its norm would undo the model's m_L^-alpha: the mixer takes it from ``sublayer.branch``."""
  from mhc_jax import testing

  mixer, params, x, f, _ = testing.setup("peri_ln")
  scaled = lambda h, value_fn=None: 0.25 * f(h)
  out = mixer.apply(params, x, scaled)[0]
  scaled.branch = 0.25
  np.testing.assert_allclose(mixer.apply(params, x, scaled)[0] - x, 0.25 * (out - x), rtol=1e-5)


def test_every_parameter_of_every_mixer_gets_a_label():
  for name in mixers.names():
    cfg = tiny(f"model.mixer={name}", "model.parametrization=completep", "model.vocab=11").model
    shapes = param_shapes(Transformer(cfg), jax.ShapeDtypeStruct((1, 8), jnp.int32))
    labels = jax.tree.leaves(mp.labels(shapes, cfg))
    assert len(labels) == len(jax.tree.leaves(shapes)) and set(labels) <= set(mp.LABELS), name
    assert "block/hidden" in labels and "top/embedding" in labels


@pytest.mark.slow
def test_planted_coordinate_checks(monkeypatch):
  """completep flat in width and depth; without the branch multiplier the activation changes
  grow with depth, without the hidden lr's 1/m_d with width (the standard parametrisation's
  slope ~1)."""
  tiny_cc = (*cc.FIXED, "model.heads=2", "data.seq_len=8", "data.batch_size=4", "optim.lr=1e-2")
  tiny_cc += ("model.base_width=16", "model.base_depth=1", "model.parametrization=completep")

  def run(widths, depths):
    make = lambda w, d: load_config(
      None, [*tiny_cc, f"model.width={w or 16}", f"model.depth={d or 1}"]
    )
    df = cc.run(make, widths, depths, 2, progress=False)
    return cc.verdicts(df).set_index(["axis", "quantity"])

  right = run([16, 64], [1, 4])
  for axis in ("width", "depth"):
    assert right.verdict[axis, "act_rms"] == right.verdict[axis, "act_delta_rms"] == "flat"
  assert right.verdict["width", "param_delta_rms"] == "shrinking"  # hidden updates ~1/width
  monkeypatch.setattr(mp, "branch_multiplier", lambda cfg: 1.0)
  no_branch = run([], [1, 4])
  assert no_branch.verdict["depth", "act_delta_rms"] == "growing", no_branch
  monkeypatch.undo()
  lr = mp.multipliers

  def no_width_lr(cfg, label):
    m = lr(cfg, label)
    wide = label.endswith(("hidden", "readout"))
    return {**m, "lr": m["lr"] * mp.factors(cfg)[0]} if wide else m

  monkeypatch.setattr(mp, "multipliers", no_width_lr)
  no_lr = run([16, 64], [])
  assert no_lr.verdict["width", "act_delta_rms"] == "growing", no_lr
  assert no_lr.slope["width", "act_delta_rms"] > right.slope["width", "act_delta_rms"] + 0.5


@pytest.mark.slow
def test_completep_sharded_matches_one_device_and_resumes_exactly(tmp_path):
  base = [*SCALED, "model.mixer=hc", "model.mixer_options={n: 2}", "model.depth=2"]
  base += ["train.steps=4", "train.ckpt_every=2", "optim.independent_wd=true"]
  base += ["optim.weight_decay=1e-3"]
  train(prepare(tiny(*base, "mesh.data=1"), jax.devices()[:1]), tmp_path / "one", progress=False)
  mesh = prepare(tiny(*base, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"))
  train(mesh, tmp_path / "mesh", progress=False)
  loss = lambda run: [r["loss"] for r in logs.read_jsonl(run / "metrics.jsonl")]
  np.testing.assert_allclose(loss(tmp_path / "mesh"), loss(tmp_path / "one"), rtol=1e-5)
  shutil.copytree(tmp_path / "mesh", tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
  train(mesh, tmp_path / "resumed", resume=True, progress=False)
  assert loss(tmp_path / "resumed") == loss(tmp_path / "mesh")
  import orbax.checkpoint as ocp

  read = lambda run: ocp.StandardCheckpointer().restore(run / "checkpoints" / "4" / "state")
  jax.tree.map(np.testing.assert_array_equal, read(tmp_path / "resumed"), read(tmp_path / "mesh"))


@pytest.mark.slow
def test_a_population_over_lr_under_completep_matches_its_separate_runs():
  """A member's lr is a traced array in the vmapped population: the per-role multipliers still
  apply, so each member's losses and hidden matrices are its separate run's (to rounding:
  hc's near-zero-gradient read weights differ by O(lr) between the two programs under sp too,
  Adam turning last-bit differences into sign flips; tests/test_population.py)."""
  from mhc_jax.sweep import population
  from mhc_jax.train.loop import host_batch

  base = [*SCALED, "model.mixer=hc", "model.mixer_options={n: 2}", "model.depth=2"]
  base += ["mesh.data=1", "optim.warmup_steps=0"]
  lrs = np.asarray([3e-2, 3e-3], np.float32)
  setup = prepare(tiny(*base), jax.devices()[:1])
  prog = population.programs(setup.cfg, setup.mesh, len(lrs), stacked_batch=False)
  state, losses = prog.init_all([setup.cfg] * len(lrs)), []
  active = jax.device_put(np.ones(len(lrs), bool))
  for t in range(3):
    batch = population.put_batches([host_batch(setup.source, setup.cfg, t)], setup.mesh, False)
    state, metrics = prog.step(state, jax.device_put(lrs), active, batch, False)
    losses.append(np.asarray(metrics["loss"]))
  kernel = lambda p: np.asarray(p["params"]["blocks"]["mlp"]["down"]["kernel"])
  single = SingleProgram(prepare(tiny(*base, f"optim.lr={lrs[0]}"), jax.devices()[:1]))
  one, want = single.init(), []
  for t in range(3):
    one, metrics = single.step(one, None, t, False)
    want.append(float(metrics["loss"]))
  np.testing.assert_allclose(np.asarray(losses)[:, 0], want, rtol=1e-5)
  got = jax.device_get(kernel(state.params))[0]
  np.testing.assert_allclose(got, kernel(jax.device_get(one.params)), atol=1e-4)
  assert not np.allclose(losses[-1][0], losses[-1][1])  # the other lr did differ


NO_ROLES = """
import jax.numpy as jnp
import flax.linen as nn
from mhc_jax.mixers import Mixer
from mhc_jax.mixers.base import make_stats, param


class Gate(Mixer):
  def layer_params(self, width):
    return 1

  @nn.compact
  def __call__(self, x, sublayer, layer=0):
    g = param(self, "gate", nn.initializers.ones, (1,), (None,))
    f = sublayer(x[..., 0, :])
    out = x + (g * f)[..., None, :]
    return out, make_stats(x, out, f, jnp.eye(1), jnp.ones((1,)), g)


class Partial(Gate):
  param_roles = {"other": "scalar"}
"""


@pytest.fixture
def user_mixers(tmp_path, monkeypatch):
  (tmp_path / "norolemix.py").write_text(textwrap.dedent(NO_ROLES))
  monkeypatch.syspath_prepend(str(tmp_path))
  yield
  import sys

  sys.modules.pop("norolemix", None)


@pytest.mark.parametrize(
  "sets,message",
  [
    (
      ["model.parametrization=mUP"],
      "model.parametrization: expected one of 'sp', 'mup', 'complete",
    ),
    (["model.parametrization=mup", "model.base_width=0"], "model.base_width: must be >= 1, got 0"),
    (["model.base_depth=0"], "model.base_depth: must be >= 1, got 0"),
    (
      ["model.parametrization=mup", "model.base_head_dim=0"],
      "model.base_head_dim: must be >= 1, got 0",
    ),
    (
      ["model.parametrization=completep", "model.mixer=norolemix:Gate"],
      "model.parametrization: 'completep' needs the mixer's parameter roles; norolemix:Gate",
    ),
    (
      ["model.parametrization=mup", "model.mixer=norolemix:Partial"],
      "model.parametrization: mup needs a role for every parameter; params/blocks/attn_mix/gate of mixer 'norolemix:Partial' has none",
    ),
  ],
)
def test_bad_input_is_one_error_line_naming_the_key(sets, message, user_mixers, tmp_path, capsys):
  out = tmp_path / "run"
  assert cli.main(["train", "--config", str(DEBUG), "--set", *sets, "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert err.count("error:") == 1 and message in err, err
  assert not out.exists()
  # sp ignores the roles: the same mixers train under it
  load_config(DEBUG, ["model.mixer=norolemix:Gate"])


def test_coord_check_names_a_bad_parametrization(tmp_path, capsys):
  args = ["coord-check", "residual", "--parametrization", "cp", "--out", str(tmp_path / "cc")]
  assert cli.main(args) == 2
  assert "error: model.parametrization: expected one of" in capsys.readouterr().err
  assert not (tmp_path / "cc").exists()


def test_sp_configs_hash_as_before_the_keys_existed():
  """The run directories and sweep resume of every earlier run keep their hashes."""
  from mhc_jax.train.config import Config, config_hash

  assert config_hash(Config()) == "6b19465d1c"  # tests/test_config.py HASHES
  assert config_hash(tiny("model.base_width=64")) == config_hash(tiny())  # sp ignores it
  assert config_hash(tiny("model.base_head_dim=8")) == config_hash(tiny())
  assert config_hash(tiny(*SCALED)) != config_hash(tiny(*SCALED, "model.depth_alpha=0.5"))
  assert config_hash(tiny(*SCALED)) != config_hash(tiny())
  # base_head_dim unset: completep and mup runs keep the hashes they had before it existed
  assert config_hash(tiny(*SCALED)) == "7b92f8f64e"
  assert config_hash(tiny("model.parametrization=mup", "model.width=64")) == "02fc76bdb3"
  assert config_hash(tiny(*SCALED, "model.base_head_dim=8")) != "7b92f8f64e"
