"""Run configuration: typed frozen dataclasses, loaded from YAML plus dotted overrides, and
validated before anything runs.

A config file has up to seven top-level keys: ``name`` and the sections ``model``, ``data``,
``optim``, ``train``, ``mesh``, ``dist`` (every key optional; defaults below). Overrides are
``a.b.c=VALUE`` strings whose VALUE is parsed as YAML (``3e-3``, ``true``, ``[1, 2]``, ``null``).

Every problem raises :class:`ConfigError` with one message that names the dotted key::

    model.heads: 3 does not divide model.width=64
    model.dept: unknown key (did you mean model.depth?)

Constructing any section validates it (types, then ranges), and :class:`Config` adds the checks
that span sections, so a ``Config`` object in hand is always a valid one; ``dataclasses.replace``
re-validates. Checks that need the outside world are separate: :func:`check_paths` (data files,
run by :func:`load_config`) and :func:`validate_mesh` (needs the device count).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import glob
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Literal, Optional, Union, get_args, get_origin, get_type_hints

import yaml

from mhc_jax import storage
from mhc_jax.errors import ConfigError

__all__ = [
  "ConfigError",
  "ModelConfig",
  "DataConfig",
  "OptimConfig",
  "TrainConfig",
  "MeshConfig",
  "DistConfig",
  "Config",
  "load_config",
  "from_dict",
  "to_dict",
  "save_config",
  "config_hash",
  "apply_overrides",
  "parse_override",
  "with_overrides",
  "check_paths",
  "validate_mesh",
  "resolve_dist",
  "with_data_vocab",
  "mixer_names",
  "mixer_option_names",
  "mixer_option_types",
  "data_option_names",
  "yaml_load",
  "DEFAULT_VOCAB",
]

DEFAULT_VOCAB = 256  # what a model uses when neither model.vocab nor the data source sets one

POSTERIOR_TASKS = ("bijection", "hmm")  # tasks with an exact posterior (data.target=posterior)


# ------------------------------------------------------------------------------------------
# YAML: a SafeLoader that reads 3e-3 / 1e4 as floats (YAML 1.1 wants a dot) and rejects
# duplicate keys (PyYAML silently keeps the last one).

_FLOAT_TAG = "tag:yaml.org,2002:float"
_FLOAT_RE = re.compile(
  r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
  re.X,
)


class _Loader(yaml.SafeLoader):
  def construct_mapping(self, node, deep=False):
    if isinstance(node, yaml.MappingNode):
      seen = {}
      for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
          continue
        k = (key_node.tag, key_node.value)
        if k in seen:
          raise yaml.constructor.ConstructorError(
            None, None, f"duplicate key {key_node.value!r}", key_node.start_mark
          )
        seen[k] = True
    return super().construct_mapping(node, deep=deep)


_Loader.yaml_implicit_resolvers = {
  first: [(tag, rx) for tag, rx in resolvers if tag != _FLOAT_TAG]
  for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_FLOAT_TAG, _FLOAT_RE, list("-+0123456789."))


def yaml_load(text: str) -> Any:
  """yaml.safe_load, except that 3e-3 and 1e4 are floats and duplicate keys are errors."""
  return yaml.load(text, Loader=_Loader)


# ------------------------------------------------------------------------------------------
# Type checking of field values, driven by the dataclass annotations.


def _show(value: Any) -> str:
  if value is None:
    return "null"
  return f"{type(value).__name__} {value!r}"


def _type_name(tp: Any) -> str:
  if get_origin(tp) is Union:
    names = [_type_name(a) for a in get_args(tp) if a is not type(None)]
    return " or ".join(names) + " or null"
  return {bool: "bool", int: "int", float: "float", str: "str", dict: "mapping"}.get(tp, str(tp))


def _check_plain(key: str, value: Any) -> Any:
  """A deep copy of YAML-able plain data (str keys), or ConfigError naming the bad part."""
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, Mapping):
    out = {}
    for k, v in value.items():
      if not isinstance(k, str):
        raise ConfigError(f"{key}: keys must be strings, got {_show(k)}")
      out[k] = _check_plain(f"{key}.{k}", v)
    return out
  if isinstance(value, (list, tuple)):
    return [_check_plain(f"{key}[{i}]", v) for i, v in enumerate(value)]
  raise ConfigError(f"{key}: unsupported value {_show(value)} (use YAML scalars, lists, mappings)")


def _coerce(key: str, value: Any, tp: Any) -> Any:
  """Check `value` against annotation `tp`; return it (ints become floats where float is asked)."""
  origin = get_origin(tp)
  if origin is Literal:
    choices = get_args(tp)
    if isinstance(value, str) and value in choices:
      return value
    hint = ""
    if isinstance(value, str):
      close = difflib.get_close_matches(value, choices, n=1)
      hint = f" (did you mean {close[0]!r}?)" if close else ""
    opts = ", ".join(repr(c) for c in choices)
    raise ConfigError(f"{key}: expected one of {opts}, got {_show(value)}{hint}")
  if origin is Union:
    args = [a for a in get_args(tp) if a is not type(None)]
    if value is None and len(args) < len(get_args(tp)):
      return None
    if value is None:
      raise ConfigError(f"{key}: expected {_type_name(tp)}, got null")
    try:
      return _coerce(key, value, args[0])
    except ConfigError:
      raise ConfigError(f"{key}: expected {_type_name(tp)}, got {_show(value)}") from None
  if tp is bool:
    if isinstance(value, bool):
      return value
  elif tp is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
  elif tp is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      if not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
      return float(value)
  elif tp is str:
    if isinstance(value, str):
      return value
  elif tp is dict:
    if isinstance(value, Mapping):
      return _check_plain(key, value)
  else:  # pragma: no cover - a schema bug, not a user error
    raise TypeError(f"{key}: unsupported annotation {tp!r}")
  raise ConfigError(f"{key}: expected {_type_name(tp)}, got {_show(value)}")


def _require(ok: bool, key: str, msg: str) -> None:
  if not ok:
    raise ConfigError(f"{key}: {msg}")


def _unknown_key(prefix: str, key: Any, known: Iterable[str]) -> ConfigError:
  full = f"{prefix}.{key}" if prefix else str(key)
  if not isinstance(key, str):
    return ConfigError(f"{full}: keys must be strings, got {_show(key)}")
  known = list(known)
  close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
  if close:
    sugg = f"{prefix}.{close[0]}" if prefix else close[0]
    return ConfigError(f"{full}: unknown key (did you mean {sugg}?)")
  return ConfigError(f"{full}: unknown key (known: {', '.join(known)})")


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
  if cls not in _HINTS:
    _HINTS[cls] = get_type_hints(cls)
  return _HINTS[cls]


@dataclasses.dataclass(frozen=True)
class _Section:
  """Base of the config sections: type-checks every field, then runs `_check` (ranges)."""

  section: ClassVar[str] = ""

  def __post_init__(self):
    hints = _hints(type(self))
    for f in dataclasses.fields(self):
      key = f"{self.section}.{f.name}"
      object.__setattr__(self, f.name, _coerce(key, getattr(self, f.name), hints[f.name]))
    self._check()

  def _check(self) -> None:
    pass

  def _key(self, name: str) -> str:
    return f"{self.section}.{name}"

  def _at_least(self, name: str, lo: float, strict: bool = False) -> None:
    v = getattr(self, name)
    if v is None:
      return
    ok = v > lo if strict else v >= lo
    _require(ok, self._key(name), f"must be {'>' if strict else '>='} {lo}, got {v}")


# ------------------------------------------------------------------------------------------
# Mixer options: the names and types are the mixers' own dataclass fields (mhc_jax.mixers);
# the model handles `collapse`. Ranges a type cannot say are below; anything a mixer rejects
# only when it builds its parameters (e.g. mhc_lite's n! permutations) train.loop.prepare finds
# by tracing the model's initialisation, still before anything is written.

_MODEL_OPTION_TYPES = {"collapse": Literal["sum", "learned"]}
_OPTION_MIN = {"n": 1, "sinkhorn_iters": 1}


def mixer_names() -> tuple[str, ...]:
  """Registered mixer names (``mhc_jax.mixers.names()``)."""
  from mhc_jax import mixers  # lazy: imports jax and flax

  return tuple(mixers.names())


def mixer_option_types(mixer: str) -> dict[str, Any]:
  """{option: type} of `mixer`: its dataclass fields (Flax internals left out) and the options
  the model handles around it."""
  from mhc_jax import mixers

  cls = type(mixers.get(mixer))
  hints = _hints(cls)
  return {**{k: hints[k] for k in mixers.options(mixer)}, **_MODEL_OPTION_TYPES}


def mixer_option_names(mixer: str) -> tuple[str, ...]:
  return tuple(mixer_option_types(mixer))


def _check_mixer_options(mixer: str, opts: dict) -> dict:
  prefix = "model.mixer_options"
  types = mixer_option_types(mixer)
  out = {}
  for k, v in opts.items():
    if k not in types:
      every = sorted({o for m in mixer_names() for o in mixer_option_types(m)})
      if k not in every:
        raise _unknown_key(prefix, k, every)
      raise ConfigError(
        f"{prefix}.{k}: not an option of mixer {mixer!r} (it takes: {', '.join(types)})"
      )
    v = _coerce(f"{prefix}.{k}", v, types[k])
    if k in _OPTION_MIN and v < _OPTION_MIN[k]:
      raise ConfigError(f"{prefix}.{k}: must be >= {_OPTION_MIN[k]}, got {v!r}")
    out[k] = v
  if mixer == "residual" and out.get("n", 1) != 1:
    raise ConfigError(f"{prefix}.n: the residual mixer has exactly one stream, got {out['n']}")
  return out


# ------------------------------------------------------------------------------------------
# The sections.


@dataclasses.dataclass(frozen=True)
class ModelConfig(_Section):
  """The decoder Transformer and its residual mixer."""

  section: ClassVar[str] = "model"
  vocab: Optional[int] = None  # None: take it from the data source (see with_data_vocab)
  depth: int = 4  # number of blocks L (2L mixer layers)
  width: int = 64
  heads: int = 4
  mlp_ratio: float = 4.0
  rope: bool = True
  qk_norm: bool = False
  tied_embeddings: bool = True
  # "dots" (default): the backward keeps only matmul outputs and recomputes the elementwise rest;
  # under nn.scan every kept activation is a stacked [L, ...] buffer, and on the CPU keeping
  # fewer made the step ~1.3x faster (docs/performance.md). Same numbers to rounding.
  remat: Literal["none", "full", "dots"] = "dots"
  scan: bool = True
  scan_unroll: int = 1  # blocks per nn.scan iteration (>1 trades compile time for speed)
  dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype
  # the attention's value path (mhc_jax/model/layers.py, docs/performance.md): "auto" picks
  # "cudnn" (cuDNN flash attention) on NVIDIA GPUs in bfloat16, "xla" elsewhere; both through
  # jax.nn.dot_product_attention. "materialized": the [T, T] scores, for comparison.
  attention: Literal["auto", "xla", "cudnn", "materialized"] = "auto"
  param_dtype: Literal["float32"] = "float32"  # parameters and optimiser state stay float32
  init: Literal["standard", "depth_scaled"] = "standard"
  init_scale: float = 1.0
  mixer: str = "residual"
  mixer_options: dict = dataclasses.field(default_factory=dict)

  def _check(self):
    self._at_least("vocab", 2)
    for name in ("depth", "width", "heads", "scan_unroll"):
      self._at_least(name, 1)
    self._at_least("mlp_ratio", 0, strict=True)
    self._at_least("init_scale", 0, strict=True)
    _require(
      self.width % self.heads == 0,
      "model.heads",
      f"{self.heads} does not divide model.width={self.width}",
    )
    head_dim = self.width // self.heads
    _require(
      not self.rope or head_dim % 2 == 0,
      "model.rope",
      f"needs an even head dim, got model.width/model.heads = {self.width}/{self.heads}"
      f" = {head_dim}",
    )
    _require(
      self.attention != "cudnn" or (self.dtype == "bfloat16" and head_dim % 8 == 0),
      "model.attention",
      f"'cudnn' needs model.dtype=bfloat16 and a head dim that is a multiple of 8, got"
      f" {self.dtype} and {head_dim} (model.attention: auto falls back to xla by itself)",
    )
    _require(
      int(self.width * self.mlp_ratio) >= 1,
      "model.mlp_ratio",
      f"{self.mlp_ratio} * model.width={self.width} leaves no MLP hidden units",
    )
    names = mixer_names()
    if self.mixer not in names:
      close = difflib.get_close_matches(self.mixer, names, n=1)
      hint = f" (did you mean {close[0]}?)" if close else ""
      raise ConfigError(
        f"model.mixer: unknown mixer {self.mixer!r}{hint}; known: {', '.join(names)}"
      )
    object.__setattr__(self, "mixer_options", _check_mixer_options(self.mixer, self.mixer_options))


@dataclasses.dataclass(frozen=True)
class DataConfig(_Section):
  """The data source. `options` are task-specific and free-form (the data module reads them)."""

  section: ClassVar[str] = "data"
  task: Literal["bijection", "hmm", "text", "tfds"] = "bijection"
  seq_len: int = 64
  batch_size: int = 32  # global, over all devices and processes
  target: Literal["sample", "posterior"] = "sample"
  options: dict = dataclasses.field(default_factory=dict)
  eval_batches: int = 4

  def _check(self):
    self._at_least("seq_len", 1)
    self._at_least("batch_size", 1)
    self._at_least("eval_batches", 0)
    _require(
      self.target != "posterior" or self.task in POSTERIOR_TASKS,
      "data.target",
      f"'posterior' needs a task with an exact posterior"
      f" ({', '.join(POSTERIOR_TASKS)}), got data.task={self.task!r}",
    )
    allowed = data_option_names(self.task)
    if allowed is not None:
      for k in self.options:
        if k not in allowed:
          raise _unknown_key("data.options", k, sorted(allowed))


def data_option_names(task: str) -> Optional[set[str]]:
  """Option keys data source `task` takes (from ``mhc_jax.data.SOURCES``), or None when that
  cannot be told without heavy imports (tfds) or the data module is not there."""
  if task == "tfds":
    return None
  try:
    from mhc_jax import data  # lazy: imports jax

    return set(data.SOURCES[task][1]())
  except (ImportError, AttributeError, KeyError, IndexError, TypeError):
    return None


@dataclasses.dataclass(frozen=True)
class OptimConfig(_Section):
  """AdamW with warm-up and decay, global-norm clipping, masked weight decay."""

  section: ClassVar[str] = "optim"
  lr: float = 3e-3  # peak learning rate
  schedule: Literal["cosine", "linear", "constant"] = "cosine"
  warmup_steps: int = 100
  min_lr_ratio: float = 0.1  # final lr = min_lr_ratio * lr (cosine, linear)
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  # False: decay multiplied by the scheduled lr (optax / PyTorch AdamW).
  # True: decay per step = weight_decay * lr(t)/lr, independent of the peak lr.
  independent_wd: bool = False
  clip: Optional[float] = 1.0  # global-norm clip; 0 or null turns it off

  def _check(self):
    self._at_least("lr", 0, strict=True)
    self._at_least("warmup_steps", 0)
    _require(
      0.0 <= self.min_lr_ratio <= 1.0,
      "optim.min_lr_ratio",
      f"must be in [0, 1], got {self.min_lr_ratio}",
    )
    for name in ("b1", "b2"):
      v = getattr(self, name)
      _require(0.0 <= v < 1.0, self._key(name), f"must be in [0, 1), got {v}")
    self._at_least("eps", 0)
    self._at_least("weight_decay", 0)
    _require(
      not self.independent_wd or self.weight_decay < 1.0,
      "optim.weight_decay",
      f"with optim.independent_wd the decay is applied per step (not multiplied by the"
      f" lr), so it must be < 1 (typically ~1e-4), got {self.weight_decay}",
    )
    self._at_least("clip", 0)


@dataclasses.dataclass(frozen=True)
class TrainConfig(_Section):
  """The loop: length, logging cadence, checkpoints, the non-finite and spike policies."""

  section: ClassVar[str] = "train"
  steps: int = 200
  seed: int = 0
  log_every: int = 1
  diag_every: int = 10  # per-layer diagnostics; 0 = off
  eval_every: int = 0  # 0 = off
  ckpt_every: int = 0  # 0 = off
  keep_ckpts: int = 2
  nonfinite: Literal["skip", "halt"] = "skip"
  z_loss: float = 0.0
  spike_window: int = 128
  spike_threshold: float = 6.0  # in standard deviations of the trailing window
  halt_on_divergence: bool = False
  tensorboard: bool = False  # also write TensorBoard event files to <run>/tb (extra: tb)
  # How a population's members share one program (mhc_jax.sweep.population): "vmap" batches
  # them (accelerators: bigger kernels); "unroll" writes one step per member into the program
  # (the CPU, mixers with many small ops: 4 mhc members 1.35x faster, compile 2.5x slower).
  population_mode: Literal["vmap", "unroll"] = "vmap"
  # Fault injection for testing the non-finite policy: the loss at this step is made NaN.
  inject_nonfinite_at: int = -1

  def _check(self):
    self._at_least("steps", 1)
    self._at_least("log_every", 1)
    for name in ("diag_every", "eval_every", "ckpt_every", "z_loss"):
      self._at_least(name, 0)
    self._at_least("keep_ckpts", 1)
    self._at_least("spike_window", 3)  # spikes.RollingSpikeDetector needs 3
    self._at_least("spike_threshold", 0, strict=True)


@dataclasses.dataclass(frozen=True)
class MeshConfig(_Section):
  """Device mesh sizes for the axes (data, fsdp, tensor); -1 = the remaining devices."""

  section: ClassVar[str] = "mesh"
  data: int = -1
  fsdp: int = 1
  tensor: int = 1

  def _check(self):
    for name in ("data", "fsdp", "tensor"):
      v = getattr(self, name)
      _require(v == -1 or v >= 1, self._key(name), f"must be >= 1 or -1, got {v}")
    fill = [n for n in ("data", "fsdp", "tensor") if getattr(self, n) == -1]
    _require(
      len(fill) <= 1,
      "mesh",
      "at most one axis may be -1, got " + ", ".join(f"mesh.{n}=-1" for n in fill),
    )


_COORD_RE = re.compile(r"^(?:\[[0-9a-fA-F:.]+\]|[^:\s\[\]]+):\d{1,5}$")


@dataclasses.dataclass(frozen=True)
class DistConfig(_Section):
  """Multi-process start-up (jax.distributed.initialize). Unset fields may come from the
  environment (MHC_COORDINATOR, MHC_NUM_PROCESSES, MHC_PROCESS_ID): see resolve_dist."""

  section: ClassVar[str] = "dist"
  enabled: bool = False
  coordinator: Optional[str] = None  # "host:port"
  num_processes: Optional[int] = None
  process_id: Optional[int] = None

  def _check(self):
    _require(
      self.coordinator is None or bool(_COORD_RE.match(self.coordinator)),
      "dist.coordinator",
      f"expected 'host:port', got {self.coordinator!r}",
    )
    self._at_least("num_processes", 1)
    self._at_least("process_id", 0)
    if self.num_processes is not None and self.process_id is not None:
      _require(
        self.process_id < self.num_processes,
        "dist.process_id",
        f"{self.process_id} is not below dist.num_processes={self.num_processes}",
      )


SECTIONS: dict[str, type[_Section]] = {
  "model": ModelConfig,
  "data": DataConfig,
  "optim": OptimConfig,
  "train": TrainConfig,
  "mesh": MeshConfig,
  "dist": DistConfig,
}


@dataclasses.dataclass(frozen=True)
class Config:
  """A whole run. Build with load_config / from_dict; change with dataclasses.replace or
  with_overrides (both re-validate)."""

  name: str = "run"
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  dist: DistConfig = dataclasses.field(default_factory=DistConfig)

  def __post_init__(self):
    _coerce("name", self.name, str)
    _require(
      bool(self.name.strip())
      and "/" not in self.name
      and "\\" not in self.name
      and self.name not in (".", ".."),
      "name",
      f"must be a non-empty name without path separators, got {self.name!r}",
    )
    for key, cls in SECTIONS.items():
      v = getattr(self, key)
      _require(isinstance(v, cls), key, f"expected {cls.__name__}, got {_show(v)}")
    _require(
      self.optim.warmup_steps <= self.train.steps,
      "optim.warmup_steps",
      f"{self.optim.warmup_steps} exceeds train.steps={self.train.steps}",
    )
    _require(
      not self.train.eval_every or self.data.eval_batches >= 1,
      "data.eval_batches",
      f"0 with train.eval_every={self.train.eval_every} would evaluate nothing; set "
      f"data.eval_batches >= 1, or train.eval_every=0 to turn evaluation off",
    )


_TOP_KEYS = ("name", *SECTIONS)


def _content_hash(self) -> int:
  # dataclass's generated hash fails on the dict fields; configs are used as jit static args.
  return hash(
    (type(self).__name__, json.dumps(dataclasses.asdict(self), sort_keys=True, default=repr))
  )


for _cls in (*SECTIONS.values(), Config):
  _cls.__hash__ = _content_hash  # type: ignore[method-assign]
del _cls


# ------------------------------------------------------------------------------------------
# dict <-> Config, overrides, files.


def to_dict(cfg: Config) -> dict:
  """Plain nested dict (YAML/JSON-able) of a Config."""
  return dataclasses.asdict(cfg)


def from_dict(d: Mapping | None) -> Config:
  """A validated Config from a nested dict; missing keys take defaults, unknown keys are errors."""
  if d is None:
    d = {}
  if not isinstance(d, Mapping):
    raise ConfigError(
      f"config: expected a mapping of sections ({', '.join(_TOP_KEYS)}), got {_show(d)}"
    )
  for k in d:
    if k not in _TOP_KEYS:
      raise _unknown_key("", k, _TOP_KEYS)
  kwargs: dict[str, Any] = {}
  if "name" in d:
    kwargs["name"] = d["name"]
  for key, cls in SECTIONS.items():
    sub = d.get(key)
    if sub is None:  # absent, or `model:` with nothing under it
      sub = {}
    if isinstance(sub, _Section):
      sub = dataclasses.asdict(sub)
    if not isinstance(sub, Mapping):
      raise ConfigError(f"{key}: expected a mapping, got {_show(sub)}")
    names = [f.name for f in dataclasses.fields(cls)]
    for k in sub:
      if k not in names:
        raise _unknown_key(key, k, names)
    kwargs[key] = cls(**sub)
  return Config(**kwargs)


def parse_override(text: str) -> tuple[str, Any]:
  """'a.b.c=VALUE' -> ('a.b.c', yaml value of VALUE). An empty VALUE is null."""
  if not isinstance(text, str) or "=" not in text:
    raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. optim.lr=3e-3")
  key, raw = text.split("=", 1)
  key = key.strip()
  try:
    value = yaml_load(raw) if raw.strip() else None
  except yaml.YAMLError as e:
    raise ConfigError(
      f"{key}: cannot parse override value {raw!r} as YAML ({getattr(e, 'problem', None) or e})"
    ) from None
  return key, value


def apply_overrides(cfg_dict: Mapping | None, overrides: Any = ()) -> dict:
  """A copy of a nested config dict with dotted-key overrides applied.

  `overrides` is a sequence of 'a.b=VALUE' strings or (key, value) pairs, or a mapping
  {dotted key: value} (the form sweep axes take). Missing intermediate sections are created,
  so new keys can be added to free-form dicts (model.mixer_options.n=4); whether a key is
  allowed is checked by from_dict afterwards.
  """
  out = copy.deepcopy(dict(cfg_dict or {}))
  if isinstance(overrides, str):
    overrides = [overrides]
  items = overrides.items() if isinstance(overrides, Mapping) else overrides
  for item in items:
    key, value = parse_override(item) if isinstance(item, str) else item
    if not isinstance(key, str) or not key or any(not p for p in key.split(".")):
      raise ConfigError(f"override {key!r}: malformed dotted key")
    parts = key.split(".")
    node = out
    for i, part in enumerate(parts[:-1]):
      nxt = node.get(part)
      if nxt is None:
        nxt = node[part] = {}
      elif not isinstance(nxt, dict):
        where = ".".join(parts[: i + 1])
        raise ConfigError(f"{where}: is {_show(nxt)}, not a section; cannot set {key}")
      node = nxt
    node[parts[-1]] = copy.deepcopy(value)
  return out


def with_overrides(cfg: Config, overrides: Any) -> Config:
  """`cfg` with dotted overrides applied (same forms as apply_overrides), re-validated."""
  return from_dict(apply_overrides(to_dict(cfg), overrides))


def _read_yaml(path) -> dict:
  where = f"config file {path}"
  path = storage.path(path)
  if not path.exists():
    raise ConfigError(f"{where}: not found")
  if path.is_dir():
    raise ConfigError(f"{where}: is a directory, expected a YAML file")
  try:
    d = yaml_load(path.read_text(encoding="utf-8"))
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    line = f" at line {mark.line + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or str(e)
    raise ConfigError(f"{where}: invalid YAML{line}: {problem}") from None
  except (OSError, UnicodeDecodeError) as e:
    raise ConfigError(f"{where}: cannot read ({e})") from None
  if d is None:
    return {}
  if not isinstance(d, dict):
    raise ConfigError(
      f"{where}: top level must be a mapping of sections"
      f" ({', '.join(_TOP_KEYS)}), got {type(d).__name__}"
    )
  return d


def check_paths(cfg: Config) -> None:
  """Filesystem checks: a text/tfds task's data path (file, folder or glob) must exist.

  A text task without a path reads the default corpus (the Python standard library sources).
  """
  opts = cfg.data.options
  if cfg.data.task in ("text", "tfds"):
    for name in ("path", "data_dir"):
      if name in opts:
        p = opts[name]
        key = f"data.options.{name}"
        _require(isinstance(p, str) and bool(p), key, f"expected a path, got {_show(p)}")
        p = os.path.expanduser(p)
        found = glob.glob(p) if glob.has_magic(p) else os.path.exists(p)
        _require(
          bool(found),
          key,
          f"{p} does not exist" if not glob.has_magic(p) else f"{p} matches no files",
        )


def load_config(
  path: str | os.PathLike | None = None, overrides: Any = (), *, check_files: bool = True
) -> Config:
  """Read a YAML config (or the defaults when `path` is None), apply overrides, validate.

  Raises ConfigError for any problem, before anything is created or written.
  """
  d = _read_yaml(path) if path is not None else {}
  cfg = from_dict(apply_overrides(d, overrides))
  if check_files:
    check_paths(cfg)
  return cfg


def save_config(cfg: Config, path: str | os.PathLike) -> None:
  """Write `cfg` as YAML (atomically); load_config(path) gives it back."""
  header = (
    f"# mhc_jax config {cfg.name!r} (hash {config_hash(cfg)}).\n"
    f"# Rerun: mhc-jax train --config {os.fspath(path)}\n"
  )
  body = yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)
  storage.write_text_atomic(path, header + body)


def config_hash(cfg: Config, length: int = 10) -> str:
  """Short stable hash of what determines a run's results (everything except `dist`)."""
  d = to_dict(cfg)
  d.pop("dist")
  blob = json.dumps(d, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(blob.encode()).hexdigest()[:length]


# ------------------------------------------------------------------------------------------
# Checks and fill-ins that need the outside world.


def validate_mesh(
  mesh: MeshConfig, n_devices: int, batch_size: int | None = None
) -> tuple[int, int, int]:
  """Resolve -1 against `n_devices`; check the product and (optionally) the batch split.

  Returns (data, fsdp, tensor). The global batch is split over data*fsdp.
  """
  sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}
  fixed = math.prod(v for v in sizes.values() if v != -1)
  fill = [k for k, v in sizes.items() if v == -1]
  if fill:
    (axis,) = fill
    others = "*".join(k for k in sizes if k != axis)
    _require(
      n_devices % fixed == 0,
      f"mesh.{axis}",
      f"-1 cannot fill {n_devices} devices with {others} = {fixed}",
    )
    sizes[axis] = n_devices // fixed
  total = math.prod(sizes.values())
  _require(
    total == n_devices, "mesh", f"data*fsdp*tensor = {total} does not match {n_devices} devices"
  )
  if batch_size is not None:
    split = sizes["data"] * sizes["fsdp"]
    _require(
      batch_size % split == 0,
      "data.batch_size",
      f"{batch_size} is not divisible by mesh data*fsdp = {split}",
    )
  return sizes["data"], sizes["fsdp"], sizes["tensor"]


_DIST_ENV = {
  "coordinator": ("MHC_COORDINATOR", str),
  "num_processes": ("MHC_NUM_PROCESSES", int),
  "process_id": ("MHC_PROCESS_ID", int),
}


def resolve_dist(dist: DistConfig, environ: Mapping[str, str] | None = None) -> DistConfig:
  """Fill unset dist fields from MHC_COORDINATOR / MHC_NUM_PROCESSES / MHC_PROCESS_ID.

  Values in the config win over the environment. Setting MHC_COORDINATOR enables dist.
  Call this at start-up (not in load_config), so a saved config does not pin one process's id.
  """
  env = os.environ if environ is None else environ
  updates: dict[str, Any] = {}
  for field, (var, tp) in _DIST_ENV.items():
    raw = env.get(var)
    if raw is None or raw == "" or getattr(dist, field) is not None:
      continue
    if tp is int:
      try:
        updates[field] = int(raw.strip())
      except ValueError:
        raise ConfigError(f"{var}: expected int, got {raw!r}") from None
    else:
      updates[field] = raw.strip()
  if env.get("MHC_COORDINATOR"):
    updates["enabled"] = True
  return dataclasses.replace(dist, **updates) if updates else dist


def with_data_vocab(cfg: Config, vocab: int | None) -> Config:
  """Fill model.vocab from the data source's vocabulary (DEFAULT_VOCAB when neither says).

  An explicit model.vocab must be at least the data's vocabulary.
  """
  if cfg.model.vocab is None:
    v = vocab if vocab is not None else DEFAULT_VOCAB
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab=v))
  if vocab is not None:
    _require(
      cfg.model.vocab >= vocab,
      "model.vocab",
      f"{cfg.model.vocab} is smaller than the data's vocabulary {vocab}",
    )
  return cfg
