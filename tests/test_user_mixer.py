"""A mixer from outside the package: ``model.mixer: "module:Class"`` wherever a mixer name goes,
``mhc_jax.mixers.register``, the run directory's record of where the class came from, and
``mhc_jax.testing.check_mixer`` on good and planted bad mixers (docs/mixers.md, "Your own
mixer")."""

from __future__ import annotations

import json
import math
import sys
import textwrap

import pytest
import yaml

from mhc_jax import cli, mixer_options, mixers, testing
from mhc_jax.train.config import ConfigError, load_config

USERMIX = '''
import jax.numpy as jnp
import flax.linen as nn

from mhc_jax.mixers import Mixer
from mhc_jax.mixers.base import make_stats, param


class Gated(Mixer):
  """x + sigmoid(g) F(x): one stream, one learned gate per layer."""

  gate_init: float = 0.0
  param_roles = {"gate": "scalar"}

  def layer_params(self, width):
    return 1

  def setup(self):
    self.gate = param(self, "gate", nn.initializers.constant(self.gate_init), (1,), (None,))

  def __call__(self, x_BTnC, sublayer, layer=0):
    g = jax_sigmoid(self.gate)
    f_BTC = sublayer(x_BTnC[..., 0, :])
    out = x_BTnC + (g * f_BTC)[..., None, :].astype(x_BTnC.dtype)
    return out, make_stats(x_BTnC, out, f_BTC, jnp.eye(1), jnp.ones((1,)), g)


def jax_sigmoid(z):
  return 1 / (1 + jnp.exp(-z))


class WrongShape(Gated):
  """Drops a time step: the output's shape is not the state's."""

  def __call__(self, x_BTnC, sublayer, layer=0):
    out, stats = super().__call__(x_BTnC, sublayer, layer)
    return out[:, :-1], stats


class NanGrad(Gated):
  """A square root at 0 in the forward: finite output, non-finite gradient."""

  def __call__(self, x_BTnC, sublayer, layer=0):
    out, stats = super().__call__(x_BTnC, sublayer, layer)
    return out + jnp.sqrt(out - out), stats


class FakeStochastic(Gated):
  """Claims a doubly stochastic H_res and reports one whose rows sum to 2."""

  doubly_stochastic = True

  def __call__(self, x_BTnC, sublayer, layer=0):
    out, stats = super().__call__(x_BTnC, sublayer, layer)
    return out, {**stats, "h_res": 2 * stats["h_res"], "h_res_tok": 2 * stats["h_res_tok"]}


class NoRoles(Gated):
  """Declares no parameter roles (the default): fine under sp, refused under mup/completep."""

  param_roles = None


class FixedReadout(Gated):
  """Declares its gate a readout (width-like), but the gate has one entry at every width."""

  param_roles = {"gate": "readout"}


class WideScalar(Mixer):
  """A gate read from the stream by a [C, 1] projection declared scalar-like: its fan-in grows
  with the width."""

  param_roles = {"proj": "scalar"}

  def layer_params(self, width):
    return width

  @nn.compact
  def __call__(self, x_BTnC, sublayer, layer=0):
    w_C1 = param(self, "proj", nn.initializers.zeros, (x_BTnC.shape[-1], 1), (None, None))
    f_BTC = sublayer(x_BTnC[..., 0, :])
    g_BT1 = jax_sigmoid(x_BTnC[..., 0, :] @ w_C1)
    out = x_BTnC + (g_BT1 * f_BTC)[..., None, :].astype(x_BTnC.dtype)
    return out, make_stats(x_BTnC, out, f_BTC, jnp.eye(1), jnp.ones((1,)), jnp.ones((1,)))


class AllThree(FakeStochastic):
  """All three faults at once."""

  def __call__(self, x_BTnC, sublayer, layer=0):
    out, stats = super().__call__(x_BTnC, sublayer, layer)
    return (out + jnp.sqrt(out - out))[:, :-1], stats


class NotAMixer:
  pass
'''


@pytest.fixture
def usermix(tmp_path, monkeypatch):
  """The module ``usermix`` (outside the package) importable, for this test only."""
  pkg = tmp_path / "userpkg"
  pkg.mkdir()
  (pkg / "usermix.py").write_text(textwrap.dedent(USERMIX))
  monkeypatch.syspath_prepend(str(pkg))
  yield pkg / "usermix.py"
  sys.modules.pop("usermix", None)


@pytest.fixture
def registered():
  """Names registered by a test are removed after it (the registry is process-wide)."""
  names = []
  yield names
  for n in names:
    mixers._REGISTRY.pop(n, None)
    mixer_options.OPTIONS.pop(n, None)


# =========================================================================== config
def test_a_module_class_path_is_a_mixer_name(usermix):
  cfg = load_config(None, ["model.mixer=usermix:Gated", "model.mixer_options={gate_init: 0.5}"])
  assert cfg.model.mixer == "usermix:Gated" and cfg.model.mixer_options == {"gate_init": 0.5}
  assert type(mixers.get("usermix:Gated")).__name__ == "Gated"
  # the public lookup others (the run directory's mixer_source.json) use: a name, a path, a class
  assert mixers.resolve("usermix:Gated").__name__ == "Gated"
  assert mixers.resolve("hc") is mixers.resolve(mixers.resolve("hc"))
  assert mixers.options("usermix:Gated") == ["n", "collapse", "gate_init"]
  with pytest.raises(ConfigError, match=r"model.mixer_options.gate_init: expected float"):
    load_config(None, ["model.mixer=usermix:Gated", "model.mixer_options.gate_init=high"])
  with pytest.raises(ConfigError, match=r"model.mixer_options.sinkhorn_iters: not an option of"):
    load_config(None, ["model.mixer=usermix:Gated", "model.mixer_options.sinkhorn_iters=3"])


@pytest.mark.parametrize(
  "path,message",
  [
    ("no_such_module_xyz:Mixer", "cannot import module 'no_such_module_xyz'"),
    ("usermix:Missing", "module 'usermix' has no attribute 'Missing'"),
    ("usermix:NotAMixer", "usermix:NotAMixer is not a subclass of mhc_jax.mixers.Mixer"),
    (":Gated", "cannot import module ''"),
  ],
)
def test_bad_paths_are_one_config_error(usermix, path, message):
  with pytest.raises(ConfigError, match=f"^model.mixer: .*{message}"):
    load_config(None, [f"model.mixer={path}"])


def test_bad_path_on_the_command_line_writes_nothing(usermix, tmp_path, capsys):
  out = tmp_path / "run"
  code = cli.main(["train", "--config", "configs/debug.yaml", "--set", "model.mixer=usermix:Nope"])
  code2 = cli.main(
    ["train", "--config", "configs/debug.yaml", "--out", str(out), "--set", "model.mixer=x.y:Z"]
  )
  err = capsys.readouterr().err.strip().splitlines()
  assert (code, code2) == (2, 2) and len(err) == 2 and not out.exists()
  assert err[0].startswith("error: model.mixer: module 'usermix' has no attribute 'Nope'")
  assert err[1].startswith("error: model.mixer: cannot import module 'x.y'")


def test_register(usermix, registered):
  import usermix as um

  mixers.register("gated_t", um.Gated)
  registered.append("gated_t")
  assert "gated_t" in mixers.names() and type(mixers.get("gated_t", gate_init=1.0)) is um.Gated
  assert load_config(None, ["model.mixer=gated_t"]).model.mixer == "gated_t"
  with pytest.raises(ValueError, match="'mhc' is already a mixer"):
    mixers.register("mhc", um.Gated)
  with pytest.raises(ValueError, match="'gated_t' is already a mixer"):
    mixers.register("gated_t", um.WrongShape)
  with pytest.raises(ValueError, match="not a subclass of mhc_jax.mixers.Mixer"):
    mixers.register("nothing", um.NotAMixer)


# =========================================================================== training
def test_train_records_the_source_and_a_resume_without_it_is_one_error(
  usermix, tmp_path, capsys, monkeypatch
):
  run = tmp_path / "run"
  argv = ["train", "--config", "configs/debug.yaml", "--out", str(run), "--quiet"]
  assert cli.main(argv + ["--set", "model.mixer=usermix:Gated", "train.ckpt_every=5"]) == 0
  summary = json.loads((run / "summary.json").read_text())
  assert summary["status"] == "done" and math.isfinite(summary["final_loss"])
  source = json.loads((run / "mixer_source.json").read_text())
  assert source == {"mixer": "usermix:Gated", "file": str(usermix), "version": None}
  capsys.readouterr()
  monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(usermix.parent)])
  sys.modules.pop("usermix")
  assert cli.main(["train", "--out", str(run), "--resume", "--quiet"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: model.mixer: cannot import module 'usermix'")
  assert f"this run was trained with usermix:Gated from {usermix}" in err[0]


def test_sweep_population_of_a_user_mixer(usermix, tmp_path):
  sweep = tmp_path / "sweep.yaml"
  arms = {"gated": {"model.mixer": "usermix:Gated", "model.mixer_options": {"gate_init": 1.0}}}
  data = {"name": "u", "base": "configs/debug.yaml", "seeds": 2}
  sweep.write_text(
    yaml.safe_dump({**data, "axes": {"arm": {"res": {"model.mixer": "residual"}, **arms}}})
  )
  out = tmp_path / "out"
  assert cli.main(["sweep", str(sweep), "--out", str(out), "--quiet"]) == 0
  manifest = json.loads((out / "manifest.json").read_text())
  assert {i["status"] for i in manifest["runs"].values()} == {"done"}
  assert (out / "runs" / "arm=gated,seed=1" / "mixer_source.json").exists()
  assert not (out / "runs" / "arm=res,seed=1" / "mixer_source.json").exists()
  assert "usermix:Gated" in (out / "report" / "summary.csv").read_text()


# =========================================================================== check_mixer
def test_check_mixer_passes_a_good_mixer(usermix, registered):
  import usermix as um

  testing.check_mixer(um.Gated, gate_init=0.5)
  testing.check_shapes("usermix:Gated")  # a path goes wherever a name does


@pytest.mark.parametrize(
  "cls,broken",
  [
    ("WrongShape", ["check_shapes"]),
    ("NanGrad", ["check_finite_grads"]),
    ("FakeStochastic", ["check_invariants"]),
    ("NoRoles", ["check_param_roles"]),
    ("FixedReadout", ["check_param_roles"]),
    ("WideScalar", ["check_param_roles"]),
    ("AllThree", ["check_shapes", "check_finite_grads", "check_invariants"]),
  ],
)
def test_check_mixer_names_every_broken_check(usermix, cls, broken):
  import usermix as um

  with pytest.raises(AssertionError) as e:
    testing.check_mixer(getattr(um, cls))
  msg = str(e.value)
  failed = [c.__name__ for c in testing.CHECKS if f"\n- {c.__name__}: " in msg]
  assert failed == broken, msg
  assert msg.startswith(f"{cls}: {len(broken)} of {len(testing.CHECKS)} contract checks failed")
  assert len(msg.splitlines()) == 1 + len(broken)  # one line per failed check
  meanings = {  # each check's docstring says what it means
    "check_shapes": "State tree, shapes and dtypes preserved",
    "check_finite_grads": "The gradients of the parameters and of the state are finite",
    "check_invariants": "Doubly stochastic H_res (per token and averaged)",
    "check_param_roles": "Every parameter of the mixer and of its collapse has a role",
  }
  for name in broken:
    assert f"- {name}: {meanings[name]}" in msg
  if cls in ("FixedReadout", "WideScalar"):  # the failure names the parameter and its shapes
    param = {"FixedReadout": "gate", "WideScalar": "proj"}[cls]
    assert f"parameter {param} is declared" in msg and "at width 8" in msg, msg


def test_check_mixer_rejects_what_is_not_a_mixer(usermix):
  import usermix as um

  with pytest.raises(ValueError, match="not a subclass of mhc_jax.mixers.Mixer"):
    testing.check_mixer(um.NotAMixer)
