"""Each mixer's options, typed: what ``model.mixer_options`` may hold for it (docs/interfaces.md,
"Config"). The fields and defaults are those of the mixer's dataclass in
``mhc_jax/mixers/<name>.py`` (tests/test_mixer_options.py checks), read here without importing
jax. ``n`` is the number of residual streams (fractions for frac); single-stream mixers take 1."""

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator


class MixerOptions(BaseModel):
  """What every mixer takes: ``n`` streams, and how the final state collapses to one vector."""

  model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

  n: int = Field(1, ge=1)
  collapse: Literal["sum", "learned"] = "sum"


class ResidualOptions(MixerOptions):
  @field_validator("n")
  @classmethod
  def _one_stream(cls, n: int) -> int:
    if n != 1:
      raise ValueError(f"the residual mixer has exactly one stream, got {n}")
    return n


class _StreamOptions(MixerOptions):
  """The hyper-connection family: ``n`` streams, input-dependent weights when ``dynamic``."""

  n: int = Field(4, ge=1)
  dynamic: bool = True
  alpha_init: float = 0.01


class HCOptions(_StreamOptions):
  stream_init: Literal["hc", "symmetric"] = "hc"


class MHCOptions(_StreamOptions):
  sinkhorn_iters: int = Field(20, ge=1)
  sinkhorn_grad: Literal["unroll", "implicit"] = "unroll"
  h_res_init: Literal["identity", "uniform"] = "identity"
  res_diag: float = 0.999
  phi_init: float = 1.0
  stream_init: Literal["onehot", "hc", "symmetric"] = "onehot"


class MHCLiteOptions(MHCOptions):
  n: int = Field(4, ge=1, le=6)  # n! permutation matrices: 720 at n = 6 (mixers/mhc_lite.py)


class KromHCOptions(MHCOptions):
  factors: str = ""  # "2x2": the Kronecker factor sizes, their product n; "": 2s and the rest


class MHCIdentityOptions(_StreamOptions):
  phi_init: float = 1.0
  stream_init: Literal["onehot", "hc", "symmetric"] = "onehot"


class FracOptions(_StreamOptions):
  collapse: Literal["concat"] = "concat"  # the fractions concatenated back


class ValueResidualOptions(MixerOptions):
  learnable: bool = False
  lambda1: float = 0.5
  lambda2: float = 0.5


class LaurelOptions(MixerOptions):
  variant: Literal["rw", "lr", "rw_lr"] = "rw_lr"
  rank: int = Field(4, ge=1)
  rw_norm: Literal["softmax", "sigmoid", "none"] = "softmax"


class OrthoOptions(MixerOptions):
  eps: float = Field(1e-6, gt=0)


class DeepNormOptions(MixerOptions):
  alpha: Optional[float] = None  # None: DeepNet's (2L)^(1/4)
  beta: Optional[float] = None  # None: DeepNet's (8L)^(-1/4)
  eps: float = Field(1e-6, gt=0)


class PostLNOptions(DeepNormOptions):
  alpha: Optional[float] = 1.0
  beta: Optional[float] = 1.0


class PeriLNOptions(MixerOptions):
  embed_norm: bool = False
  eps: float = Field(1e-6, gt=0)


class DenseFormerOptions(MixerOptions):
  every: Literal["block", "layer"] = "block"
  dilation: int = Field(1, ge=1)
  period: int = Field(1, ge=1)


class AttnResOptions(MixerOptions):
  block_size: int = Field(1, ge=1)
  key_scale: bool = True


OPTIONS: dict[str, type[MixerOptions]] = {
  "residual": ResidualOptions,
  "hc": HCOptions,
  "mhc": MHCOptions,
  "mhc_lite": MHCLiteOptions,
  "mhc_identity": MHCIdentityOptions,
  "kromhc": KromHCOptions,
  "frac": FracOptions,
  "value_residual": ValueResidualOptions,
  "laurel": LaurelOptions,
  "ortho": OrthoOptions,
  "deepnorm": DeepNormOptions,
  "post_ln": PostLNOptions,
  "peri_ln": PeriLNOptions,
  "denseformer": DenseFormerOptions,
  "attnres": AttnResOptions,
}


def names() -> tuple[str, ...]:
  """The mixer names, as ``mhc_jax.mixers.names()`` (the agreement test checks)."""
  return tuple(OPTIONS)


def all_option_names() -> list[str]:
  """Every option any mixer takes, sorted."""
  return sorted({k for model in OPTIONS.values() for k in model.model_fields})
