"""Registry of residual mixers: ``get(name, **options)`` and ``names()``.

A new mixer is one file plus one line in ``_REGISTRY``; ``mhc_jax.testing`` then checks it.
"""

from __future__ import annotations

import dataclasses

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
# Options that only shape the model around the mixer (handled by the model, not the mixer).
# ``collapse`` moved into the mixer (it owns its collapse); nothing is left here.
MODEL_OPTIONS: tuple[str, ...] = ()


def names() -> list[str]:
  return list(_REGISTRY)


def options(name: str) -> list[str]:
  """The option names a mixer accepts (its dataclass fields, minus Flax internals)."""
  cls = _cls(name)
  return [f.name for f in dataclasses.fields(cls) if f.name not in ("parent", "name", "layers")]


def _cls(name: str) -> type[Mixer]:
  if name not in _REGISTRY:
    raise ValueError(f"mixer: unknown name {name!r}; known: {', '.join(names())}")
  return _REGISTRY[name]


def get(name: str, *, module_name: str | None = None, layers: int = 0, **opts) -> Mixer:
  """A mixer module (named ``module_name`` when built inside a parent's compact method).

  ``layers`` is the model's number of mixer layers (2L), for mixers whose state depends on depth.
  Options the model handles (``MODEL_OPTIONS``) are ignored here; unknown options raise
  ``ValueError`` naming them.
  """
  cls = _cls(name)
  opts = {k: v for k, v in opts.items() if k not in MODEL_OPTIONS}
  bad = sorted(set(opts) - set(options(name)))
  if bad:
    raise ValueError(f"mixer {name!r}: unknown option(s) {bad}; accepted: {options(name)}")
  return cls(**opts, layers=layers, name=module_name)


__all__ = ["STAT_KEYS", "Collapse", "Mixer", "get", "names", "options"]
