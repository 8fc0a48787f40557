"""mhc_jax.mixer_options: each mixer's typed options agree with its dataclass, and the config
layer checks them without importing jax."""

import dataclasses
import subprocess
import sys
import typing

import pytest

from mhc_jax import mixer_options, mixers
from mhc_jax.mixers import mhc_lite

_FLAX_FIELDS = ("parent", "name", "layers")


def _dataclass_fields(name: str) -> dict[str, dataclasses.Field]:
  cls = type(mixers.get(name))
  return {f.name: f for f in dataclasses.fields(cls) if f.name not in _FLAX_FIELDS}


def _compatible(declared, actual) -> bool:
  """The options' type is the dataclass's, or a Literal narrowing the dataclass's str."""
  if declared == actual:
    return True
  args = typing.get_args(declared)
  return (
    typing.get_origin(declared) is typing.Literal
    and actual is str
    and all(isinstance(a, str) for a in args)
  )


def test_one_options_model_per_registered_mixer():
  assert mixer_options.names() == tuple(mixers.names())


@pytest.mark.parametrize("name", mixers.names())
def test_options_agree_with_the_mixer_dataclass(name):
  model = mixer_options.OPTIONS[name]
  fields = _dataclass_fields(name)
  hints = typing.get_type_hints(type(mixers.get(name)))
  assert list(model.model_fields) == mixers.options(name)
  for key, f in model.model_fields.items():
    assert f.default == fields[key].default, (name, key, f.default, fields[key].default)
    assert _compatible(f.annotation, hints[key]), (name, key, f.annotation, hints[key])
    # the option's type admits the dataclass's default (e.g. a Literal holds it)
    assert model.model_validate({key: fields[key].default}).model_dump()[key] == f.default


def test_ranges_a_type_cannot_say():
  import pydantic

  assert mixer_options.OPTIONS["mhc_lite"].model_fields["n"].metadata[-1].le == mhc_lite.MAX_N
  for name, bad in [("mhc", {"n": 0}), ("mhc", {"sinkhorn_iters": 0}), ("residual", {"n": 2})]:
    with pytest.raises(pydantic.ValidationError):
      mixer_options.OPTIONS[name].model_validate(bad)
  assert mixer_options.OPTIONS["hc"]().n == 4 and mixer_options.OPTIONS["residual"]().n == 1


def test_config_layer_imports_no_jax():
  code = (
    "import sys\n"
    "from mhc_jax.train.config import load_config\n"
    "c = load_config(None, ['model.mixer=mhc', 'model.mixer_options.n=4'])\n"
    "assert c.model.mixer_options == {'n': 4}\n"
    "bad = [m for m in ('jax', 'flax', 'mhc_jax.mixers') if m in sys.modules]\n"
    "assert not bad, bad\n"
  )
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert r.returncode == 0, r.stderr
