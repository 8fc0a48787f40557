"""Registry of residual mixers: ``get(name, **options)`` and ``names()``.

A mixer of the zoo is one file plus one line in ``_REGISTRY``; one from outside the package is a
``"module:Class"`` path wherever a name goes, or ``register(name, cls)``; ``mhc_jax.testing``
checks either (docs/mixers.md, "Your own mixer").
"""

from __future__ import annotations

import dataclasses
import importlib
import typing

import pydantic

from mhc_jax.mixer_options import OPTIONS, MixerOptions
from mhc_jax.mixers.attnres import AttnRes
from mhc_jax.mixers.base import STAT_KEYS, Collapse, Mixer
from mhc_jax.mixers.deepnorm import DeepNorm, PostLN
from mhc_jax.mixers.denseformer import DenseFormer
from mhc_jax.mixers.frac import FracConnection
from mhc_jax.mixers.hc import HyperConnection
from mhc_jax.mixers.kromhc import KromHC
from mhc_jax.mixers.laurel import Laurel
from mhc_jax.mixers.mhc import ManifoldHyperConnection
from mhc_jax.mixers.mhc_identity import MHCIdentity
from mhc_jax.mixers.mhc_lite import MHCLite
from mhc_jax.mixers.ortho import Ortho
from mhc_jax.mixers.peri_ln import PeriLN
from mhc_jax.mixers.residual import Residual
from mhc_jax.mixers.value_residual import ValueResidual

_REGISTRY: dict[str, type[Mixer]] = {
  "residual": Residual,
  "hc": HyperConnection,
  "mhc": ManifoldHyperConnection,
  "mhc_lite": MHCLite,
  "mhc_identity": MHCIdentity,
  "kromhc": KromHC,
  "frac": FracConnection,
  "value_residual": ValueResidual,
  "laurel": Laurel,
  "ortho": Ortho,
  "deepnorm": DeepNorm,
  "post_ln": PostLN,
  "peri_ln": PeriLN,
  "denseformer": DenseFormer,
  "attnres": AttnRes,
}


def names() -> list[str]:
  return list(_REGISTRY)


def options(name: str) -> list[str]:
  """The option names a mixer accepts (its dataclass fields, minus Flax internals)."""
  cls = resolve(name)
  return [f.name for f in dataclasses.fields(cls) if f.name not in ("parent", "name", "layers")]


def resolve(name) -> type[Mixer]:
  """The class of a registered name, of a ``"module:Class"`` path (imported) or a class."""
  if isinstance(name, type):
    return _checked(name, name)
  if name in _REGISTRY or ":" in name:
    return _REGISTRY.get(name) or load(name)
  raise ValueError(f"mixer: unknown name {name!r}; known: {', '.join(names())}")


def _checked(cls, what) -> type[Mixer]:
  if not (isinstance(cls, type) and issubclass(cls, Mixer)):
    raise ValueError(f"{what} is not a subclass of mhc_jax.mixers.Mixer (got {cls!r})")
  return cls


def load(path: str) -> type[Mixer]:
  """The Mixer subclass an importable ``"module:Class"`` path names; ValueError saying why not."""
  module, _, attr = path.partition(":")
  try:
    mod = importlib.import_module(module)
  except Exception as e:  # noqa: BLE001 - whatever the user's module raises on import
    why = f"{type(e).__name__}: {e}"
    raise ValueError(f"cannot import module {module!r} ({why}); install it or put it on PYTHONPATH")
  if not hasattr(mod, attr):
    raise ValueError(f"module {module!r} has no attribute {attr!r} ({mod.__file__})")
  return _checked(getattr(mod, attr), path)


def options_model(cls: type[Mixer]) -> type[MixerOptions]:
  """The typed options (mhc_jax.mixer_options) of a class from outside the zoo: its dataclass
  fields, typed by their annotations."""
  hints, skip = typing.get_type_hints(cls), ("parent", "name", "layers", *MixerOptions.model_fields)
  fields = {
    f.name: (hints[f.name], f.default) for f in dataclasses.fields(cls) if f.name not in skip
  }
  return pydantic.create_model(f"{cls.__name__}Options", __base__=MixerOptions, **fields)


def register(name: str, cls: type[Mixer]) -> None:
  """Make the Mixer subclass ``cls`` the mixer ``name`` in this process (configs, ``get``,
  ``mhc_jax.testing``). Other processes (a ``--parallel`` sweep's jobs) know only a path."""
  if name in _REGISTRY:
    raise ValueError(f"register: {name!r} is already a mixer ({_REGISTRY[name].__qualname__})")
  _REGISTRY[name] = _checked(cls, f"register {name!r}: {cls!r}")
  OPTIONS[name] = options_model(cls)


def get(name: str, *, module_name: str | None = None, layers: int = 0, **opts) -> Mixer:
  """A mixer module (named ``module_name`` when built inside a parent's compact method).

  ``layers`` is the model's number of mixer layers (2L), for mixers whose state depends on depth.
  Unknown options raise ``ValueError`` naming them.
  """
  cls = resolve(name)
  bad = sorted(set(opts) - set(options(name)))
  if bad:
    raise ValueError(f"mixer {name!r}: unknown option(s) {bad}; accepted: {options(name)}")
  return cls(**opts, layers=layers, name=module_name)


__all__ = ["STAT_KEYS", "Collapse", "Mixer", "get", "load", "names", "options", "register"]
__all__ += ["resolve"]
