"""Run configuration: frozen pydantic dataclasses, loaded from YAML plus dotted overrides, and
validated before anything runs.

A config file has up to seven top-level keys: ``name`` and the sections ``model``, ``data``,
``optim``, ``train``, ``mesh``, ``dist`` (every key optional; defaults below). Overrides are
``a.b.c=VALUE`` strings whose VALUE is parsed as YAML (``3e-3``, ``true``, ``[1, 2]``, ``null``).
``model.mixer_options`` holds the options of ``model.mixer`` (its typed model in
:mod:`mhc_jax.mixer_options`: ``n`` streams and the rest), only those set.

Every problem raises :class:`ConfigError` with one message that names the dotted key::

    model.heads: 3 does not divide model.width=64
    model.dept: unknown key (did you mean model.depth?)

Types are strict (``1`` is no bool, ``10.0`` no int; ints are accepted for floats and stored as
floats) and unknown keys are errors. Constructing any section validates it, and :class:`Config`
adds the checks that span sections, so a ``Config`` in hand is a valid one;
``dataclasses.replace`` re-validates. Checks that need the outside world are separate:
:func:`check_paths` (data files, run by :func:`load_config`) and :func:`validate_mesh` (needs
the device count). Nothing here imports jax.
"""

import copy
import dataclasses
import difflib
import glob
import hashlib
import json
import math
import os
import re
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Optional

import pydantic
import yaml
from pydantic import ConfigDict, Field, JsonValue, field_validator, model_validator

from mhc_jax import storage
from mhc_jax.errors import ConfigError
from mhc_jax.mixer_options import OPTIONS, all_option_names

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
    seen = set()
    for key_node, _ in node.value:
      if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
        if (key_node.tag, key_node.value) in seen:
          raise yaml.constructor.ConstructorError(
            None, None, f"duplicate key {key_node.value!r}", key_node.start_mark
          )
        seen.add((key_node.tag, key_node.value))
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
# pydantic's ValidationError as one ConfigError line naming the dotted key.


def _show(value: Any) -> str:
  return "null" if value is None else f"{type(value).__name__} {value!r}"


def _unknown_key(prefix: str, key: Any, known: Iterable[str]) -> ConfigError:
  full = f"{prefix}.{key}" if prefix else str(key)
  if not isinstance(key, str):
    return ConfigError(f"{full}: keys must be strings, got {_show(key)}")
  known = list(known)
  close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
  if close:
    return ConfigError(
      f"{full}: unknown key (did you mean {f'{prefix}.' if prefix else ''}{close[0]}?)"
    )
  return ConfigError(f"{full}: unknown key (known: {', '.join(known)})")


def _fields(cls: type) -> dict[str, Any]:
  """{field: annotation} of a pydantic dataclass or model."""
  if hasattr(cls, "model_fields"):
    return {k: f.annotation for k, f in cls.model_fields.items()}
  return {f.name: f.type for f in dataclasses.fields(cls)}


def _type_name(tp: Any) -> str:
  args = [a for a in typing.get_args(tp) if a is not type(None)]
  if typing.get_origin(tp) in (typing.Union, type(int | None)):
    return " or ".join(_type_name(a) for a in args) + " or null"
  return "mapping" if typing.get_origin(tp) is dict else getattr(tp, "__name__", str(tp))


_TYPE_ERRORS = ("int_type", "int_from_float", "float_type", "bool_type", "string_type")


def _error(e: pydantic.ValidationError, prefix: str, cls: type) -> ConfigError:
  """The first error of `e` (raised validating `cls`, at dotted key `prefix`) as a ConfigError."""
  err = e.errors(include_url=False)[0]
  ctx, value = err.get("ctx", {}), err["input"]
  if isinstance(ctx.get("error"), ConfigError):  # a check below that names its own key
    return ctx["error"]
  loc = [str(p) for p in err["loc"] if not str(p).startswith(("[", "function-"))]
  key = ".".join([prefix, *loc[:2]] if prefix else loc[:2]) or "config"
  tp = _fields(cls).get(loc[0]) if loc else None
  kind = err["type"]
  if kind in ("extra_forbidden", "unexpected_keyword_argument"):
    return _unknown_key(prefix, loc[0], _fields(cls))
  if kind == "literal_error":
    choices = typing.get_args(tp)
    close = difflib.get_close_matches(value, choices, n=1) if isinstance(value, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    opts = ", ".join(repr(c) for c in choices)
    return ConfigError(f"{key}: expected one of {opts}, got {_show(value)}{hint}")
  if kind in _TYPE_ERRORS or kind == "dict_type":
    return ConfigError(f"{key}: expected {_type_name(tp)}, got {_show(value)}")
  if kind in ("dataclass_type", "dataclass_exact_type"):
    return ConfigError(f"{key}: expected {tp.__name__}, got {_show(value)}")
  if kind == "finite_number":
    return ConfigError(f"{key}: expected a finite number, got {value!r}")
  ops = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<"}
  ops["less_than_equal"] = "<="
  if kind in ops:
    bound = next(iter(ctx.values()))
    bound = f"{bound:g}" if isinstance(bound, float) else bound
    return ConfigError(f"{key}: must be {ops[kind]} {bound}, got {value!r}")
  if kind == "value_error":
    return ConfigError(f"{key}: {ctx['error']}")
  if kind.startswith("invalid-json"):
    return ConfigError(
      f"{key}: unsupported value {_show(value)} (use YAML scalars, lists, mappings)"
    )
  return ConfigError(f"{key}: {err['msg']}, got {_show(value)}")


def _section(name: str):
  """A frozen, strict pydantic dataclass whose errors are ConfigErrors naming ``name.<key>``,
  hashable by content (configs are jit static arguments)."""

  def wrap(cls):
    cls = pydantic.dataclasses.dataclass(
      frozen=True, config=ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    )(cls)
    init = cls.__init__

    def __init__(self, *args, **kwargs):
      try:
        init(self, *args, **kwargs)
      except pydantic.ValidationError as e:
        raise _error(e, name, cls) from None

    cls.__init__ = __init__
    cls.__hash__ = lambda self: hash((name, json.dumps(dataclasses.asdict(self), sort_keys=True)))
    return cls

  return wrap


# ------------------------------------------------------------------------------------------
# The sections.


def _check_mixer_options(mixer: str, opts: dict) -> dict:
  """`opts` checked against `mixer`'s typed options; the keys set, their values typed."""
  prefix, model = "model.mixer_options", OPTIONS[mixer]
  for k in opts:
    if k not in model.model_fields:
      every = all_option_names()
      if k not in every:
        raise _unknown_key(prefix, k, every)
      raise ConfigError(
        f"{prefix}.{k}: not an option of mixer {mixer!r} (it takes: {', '.join(model.model_fields)})"
      )
  try:
    typed = model.model_validate(opts)
  except pydantic.ValidationError as e:
    raise _error(e, prefix, model) from None
  return {k: getattr(typed, k) for k in opts}


@_section("model")
class ModelConfig:
  """The decoder Transformer and its residual mixer."""

  vocab: Optional[int] = Field(None, ge=2)  # None: from the data source (see with_data_vocab)
  depth: int = Field(4, ge=1)  # number of blocks L (2L mixer layers)
  width: int = Field(64, ge=1)
  heads: int = Field(4, ge=1)
  mlp_ratio: float = Field(4.0, gt=0)
  rope: bool = True
  qk_norm: bool = False
  tied_embeddings: bool = True
  # "dots" (default): the backward keeps only matmul outputs and recomputes the elementwise rest;
  # under nn.scan every kept activation is a stacked [L, ...] buffer, and on the CPU keeping
  # fewer made the step ~1.3x faster (docs/performance.md). Same numbers to rounding.
  remat: Literal["none", "full", "dots"] = "dots"
  scan: bool = True
  scan_unroll: int = Field(1, ge=1)  # blocks per nn.scan iteration (>1: longer compile, faster)
  dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype
  # the attention's value path (mhc_jax/model/layers.py, docs/performance.md): "auto" picks
  # "cudnn" (cuDNN flash attention) on NVIDIA GPUs in bfloat16, "xla" elsewhere; both through
  # jax.nn.dot_product_attention. "materialized": the [T, T] scores, for comparison.
  attention: Literal["auto", "xla", "cudnn", "materialized"] = "auto"
  param_dtype: Literal["float32"] = "float32"  # parameters and optimiser state stay float32
  init: Literal["standard", "depth_scaled"] = "standard"
  init_scale: float = Field(1.0, gt=0)
  mixer: str = "residual"
  mixer_options: dict[str, Any] = Field(default_factory=dict)  # mhc_jax.mixer_options

  @field_validator("mixer")
  @classmethod
  def _known_mixer(cls, mixer: str) -> str:
    if mixer not in OPTIONS:
      close = difflib.get_close_matches(mixer, OPTIONS, n=1)
      hint = f" (did you mean {close[0]}?)" if close else ""
      raise ConfigError(f"model.mixer: unknown mixer {mixer!r}{hint}; known: {', '.join(OPTIONS)}")
    return mixer

  @field_validator("mixer_options")
  @classmethod
  def _mixer_options(cls, opts: dict, info: pydantic.ValidationInfo) -> dict:
    mixer = info.data.get("mixer")
    return opts if mixer is None else _check_mixer_options(mixer, opts)

  @model_validator(mode="after")
  def _shapes(self):
    if self.width % self.heads:
      raise ConfigError(f"model.heads: {self.heads} does not divide model.width={self.width}")
    head_dim = self.width // self.heads
    if self.rope and head_dim % 2:
      raise ConfigError(
        f"model.rope: needs an even head dim, got model.width/model.heads ="
        f" {self.width}/{self.heads} = {head_dim}"
      )
    if self.attention == "cudnn" and (self.dtype != "bfloat16" or head_dim % 8):
      raise ConfigError(
        f"model.attention: 'cudnn' needs model.dtype=bfloat16 and a head dim that is a multiple"
        f" of 8, got {self.dtype} and {head_dim} (model.attention: auto falls back to xla)"
      )
    if int(self.width * self.mlp_ratio) < 1:
      raise ConfigError(
        f"model.mlp_ratio: {self.mlp_ratio} * model.width={self.width} leaves no MLP hidden units"
      )
    return self


def data_option_names(task: str) -> Optional[set[str]]:
  """Option keys data source `task` takes (from ``mhc_jax.data.SOURCES``, which imports jax), or
  None when that cannot be told without heavy imports (tfds)."""
  if task == "tfds":
    return None
  from mhc_jax import data

  return set(data.SOURCES[task][1]())


@_section("data")
class DataConfig:
  """The data source. `options` are the source's own (checked against it when set)."""

  task: Literal["bijection", "hmm", "text", "tfds"] = "bijection"
  seq_len: int = Field(64, ge=1)
  batch_size: int = Field(32, ge=1)  # global, over all devices and processes
  target: Literal["sample", "posterior"] = "sample"
  options: dict[str, JsonValue] = Field(default_factory=dict)
  eval_batches: int = Field(4, ge=0)

  @model_validator(mode="after")
  def _task(self):
    if self.target == "posterior" and self.task not in POSTERIOR_TASKS:
      raise ConfigError(
        f"data.target: 'posterior' needs a task with an exact posterior"
        f" ({', '.join(POSTERIOR_TASKS)}), got data.task={self.task!r}"
      )
    allowed = data_option_names(self.task) if self.options else None
    for k in sorted(set(self.options) - allowed) if allowed is not None else ():
      raise _unknown_key("data.options", k, sorted(allowed))
    return self


@_section("optim")
class OptimConfig:
  """AdamW with warm-up and decay, global-norm clipping, masked weight decay."""

  lr: float = Field(3e-3, gt=0)  # peak learning rate
  schedule: Literal["cosine", "linear", "constant"] = "cosine"
  warmup_steps: int = Field(100, ge=0)
  min_lr_ratio: float = Field(0.1, ge=0, le=1)  # final lr = min_lr_ratio * lr (cosine, linear)
  b1: float = Field(0.9, ge=0, lt=1)
  b2: float = Field(0.95, ge=0, lt=1)
  eps: float = Field(1e-8, ge=0)
  weight_decay: float = Field(0.1, ge=0)
  # False: decay multiplied by the scheduled lr (optax / PyTorch AdamW).
  # True: decay per step = weight_decay * lr(t)/lr, independent of the peak lr.
  independent_wd: bool = False
  clip: Optional[float] = Field(1.0, ge=0)  # global-norm clip; 0 or null turns it off

  @model_validator(mode="after")
  def _decay(self):
    if self.independent_wd and self.weight_decay >= 1:
      raise ConfigError(
        f"optim.weight_decay: with optim.independent_wd the decay is applied per step (not"
        f" multiplied by the lr), so it must be < 1 (typically ~1e-4), got {self.weight_decay}"
      )
    return self


@_section("train")
class TrainConfig:
  """The loop: length, logging cadence, checkpoints, the non-finite and spike policies."""

  steps: int = Field(200, ge=1)
  seed: int = 0
  log_every: int = Field(1, ge=1)
  diag_every: int = Field(10, ge=0)  # per-layer diagnostics; 0 = off
  eval_every: int = Field(0, ge=0)  # 0 = off
  ckpt_every: int = Field(0, ge=0)  # 0 = off
  keep_ckpts: int = Field(2, ge=1)
  nonfinite: Literal["skip", "halt"] = "skip"
  z_loss: float = Field(0.0, ge=0)
  spike_window: int = Field(128, ge=3)  # spikes.RollingSpikeDetector needs 3
  spike_threshold: float = Field(6.0, gt=0)  # in standard deviations of the trailing window
  halt_on_divergence: bool = False
  tensorboard: bool = False  # also write TensorBoard event files to <run>/tb (extra: tb)


@_section("mesh")
class MeshConfig:
  """Device mesh sizes for the axes (data, fsdp, tensor); -1 = the remaining devices."""

  data: int = -1
  fsdp: int = 1
  tensor: int = 1

  @model_validator(mode="after")
  def _sizes(self):
    sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
    for k, v in sizes.items():
      if v != -1 and v < 1:
        raise ConfigError(f"mesh.{k}: must be >= 1 or -1, got {v}")
    fill = [f"mesh.{k}=-1" for k, v in sizes.items() if v == -1]
    if len(fill) > 1:
      raise ConfigError("mesh: at most one axis may be -1, got " + ", ".join(fill))
    return self


@_section("dist")
class DistConfig:
  """Multi-process start-up (jax.distributed.initialize). Unset fields may come from the
  environment (MHC_COORDINATOR, MHC_NUM_PROCESSES, MHC_PROCESS_ID): see resolve_dist."""

  enabled: bool = False
  coordinator: Optional[str] = None  # "host:port"
  num_processes: Optional[int] = Field(None, ge=1)
  process_id: Optional[int] = Field(None, ge=0)

  @field_validator("coordinator")
  @classmethod
  def _host_port(cls, v: Optional[str]) -> Optional[str]:
    if v is not None and not re.match(r"^(?:\[[0-9a-fA-F:.]+\]|[^:\s\[\]]+):\d{1,5}$", v):
      raise ValueError(f"expected 'host:port', got {v!r}")
    return v

  @model_validator(mode="after")
  def _id(self):
    if None not in (self.process_id, self.num_processes) and self.process_id >= self.num_processes:
      raise ConfigError(
        f"dist.process_id: {self.process_id} is not below dist.num_processes={self.num_processes}"
      )
    return self


SECTIONS = {
  "model": ModelConfig,
  "data": DataConfig,
  "optim": OptimConfig,
  "train": TrainConfig,
  "mesh": MeshConfig,
  "dist": DistConfig,
}
_TOP_KEYS = ("name", *SECTIONS)


@_section("")
class Config:
  """A whole run. Build with load_config / from_dict; change with dataclasses.replace or
  with_overrides (both re-validate)."""

  name: str = "run"
  model: ModelConfig = Field(default_factory=ModelConfig)
  data: DataConfig = Field(default_factory=DataConfig)
  optim: OptimConfig = Field(default_factory=OptimConfig)
  train: TrainConfig = Field(default_factory=TrainConfig)
  mesh: MeshConfig = Field(default_factory=MeshConfig)
  dist: DistConfig = Field(default_factory=DistConfig)

  @model_validator(mode="after")
  def _across(self):
    if not self.name.strip() or re.search(r"[/\\]", self.name) or self.name in (".", ".."):
      raise ConfigError(
        f"name: must be a non-empty name without path separators, got {self.name!r}"
      )
    if self.optim.warmup_steps > self.train.steps:
      raise ConfigError(
        f"optim.warmup_steps: {self.optim.warmup_steps} exceeds train.steps={self.train.steps}"
      )
    if self.train.eval_every and not self.data.eval_batches:
      raise ConfigError(
        f"data.eval_batches: 0 with train.eval_every={self.train.eval_every} would evaluate"
        f" nothing; set data.eval_batches >= 1, or train.eval_every=0 to turn evaluation off"
      )
    return self


# ------------------------------------------------------------------------------------------
# dict <-> Config, overrides, files.


def to_dict(cfg: Config) -> dict:
  """Plain nested dict (YAML/JSON-able) of a Config."""
  return dataclasses.asdict(cfg)


def from_dict(d: Mapping | None) -> Config:
  """A validated Config from a nested dict; missing keys take defaults, unknown keys are errors."""
  d = {} if d is None else d
  if not isinstance(d, Mapping):
    raise ConfigError(
      f"config: expected a mapping of sections ({', '.join(_TOP_KEYS)}), got {_show(d)}"
    )
  for k in d:
    if k not in _TOP_KEYS:
      raise _unknown_key("", k, _TOP_KEYS)
  kwargs: dict[str, Any] = {k: d[k] for k in d if k == "name"}
  for key, cls in SECTIONS.items():
    sub = d.get(key) or {}  # absent, or `model:` with nothing under it
    if not isinstance(sub, Mapping):
      raise ConfigError(f"{key}: expected a mapping, got {_show(sub)}")
    sub = _drop_retired(key, sub)
    for k in sub:
      if not isinstance(k, str) or k not in _fields(cls):
        raise _unknown_key(key, k, _fields(cls))
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
  {dotted key: value} (the form sweep axes take). Missing intermediate sections are created
  (model.mixer_options.n=4); whether a key is allowed is checked by from_dict afterwards.
  """
  out = copy.deepcopy(dict(cfg_dict or {}))
  if isinstance(overrides, str):
    overrides = [overrides]
  for item in overrides.items() if isinstance(overrides, Mapping) else overrides:
    key, value = parse_override(item) if isinstance(item, str) else item
    if not isinstance(key, str) or not key or any(not p for p in key.split(".")):
      raise ConfigError(f"override {key!r}: malformed dotted key")
    parts = key.split(".")
    node = out
    for i, part in enumerate(parts[:-1]):
      if node.get(part) is None:
        node[part] = {}
      elif not isinstance(node[part], dict):
        where = ".".join(parts[: i + 1])
        raise ConfigError(f"{where}: is {_show(node[part])}, not a section; cannot set {key}")
      node = node[part]
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
    raise ConfigError(f"{where}: invalid YAML{line}: {getattr(e, 'problem', None) or e}") from None
  except (OSError, UnicodeDecodeError) as e:
    raise ConfigError(f"{where}: cannot read ({e})") from None
  if d is not None and not isinstance(d, dict):
    raise ConfigError(
      f"{where}: top level must be a mapping of sections"
      f" ({', '.join(_TOP_KEYS)}), got {type(d).__name__}"
    )
  return d or {}


def check_paths(cfg: Config) -> None:
  """Filesystem checks: a text/tfds task's data path (file, folder or glob) must exist.

  A text task without a path reads the default corpus (the Python standard library sources).
  """
  if cfg.data.task not in ("text", "tfds"):
    return
  for name in ("path", "data_dir"):
    if name in cfg.data.options:
      p, key = cfg.data.options[name], f"data.options.{name}"
      if not isinstance(p, str) or not p:
        raise ConfigError(f"{key}: expected a path, got {_show(p)}")
      p = os.path.expanduser(p)
      if glob.has_magic(p) and not glob.glob(p):
        raise ConfigError(f"{key}: {p} matches no files")
      if not glob.has_magic(p) and not os.path.exists(p):
        raise ConfigError(f"{key}: {p} does not exist")


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


# Keys since removed from the config, with the one value they had: hashed as before, so run
# directories and sweeps made before the removal keep their hashes.
_RETIRED = {
  "train": {
    "inject_nonfinite_at": -1,  # a test hook, gone from the step
    "population_mode": "vmap",  # "unroll" was CPU-only tuning; populations are vmapped
  }
}


def _drop_retired(section: str, sub: Mapping) -> Mapping:
  """`sub` without retired keys that hold their one remaining value (old run directories load);
  a retired key set to anything else is an error, since that setting no longer exists."""
  retired = _RETIRED.get(section, {})
  for k in [k for k in sub if k in retired]:
    if sub[k] != retired[k]:
      raise ConfigError(
        f"{section}.{k}: removed; only {retired[k]!r} (what every run now does) is accepted,"
        f" got {_show(sub[k])}"
      )
  return {k: v for k, v in sub.items() if k not in retired}


def config_hash(cfg: Config, length: int = 10) -> str:
  """Short stable hash of what determines a run's results (everything except `dist`)."""
  d = to_dict(cfg)
  d.pop("dist")
  for section, keys in _RETIRED.items():
    d[section].update(keys)
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
  for axis in [k for k, v in sizes.items() if v == -1]:
    others = "*".join(k for k in sizes if k != axis)
    if n_devices % fixed:
      raise ConfigError(f"mesh.{axis}: -1 cannot fill {n_devices} devices with {others} = {fixed}")
    sizes[axis] = n_devices // fixed
  total = math.prod(sizes.values())
  if total != n_devices:
    raise ConfigError(f"mesh: data*fsdp*tensor = {total} does not match {n_devices} devices")
  split = sizes["data"] * sizes["fsdp"]
  if batch_size is not None and batch_size % split:
    raise ConfigError(f"data.batch_size: {batch_size} is not divisible by mesh data*fsdp = {split}")
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
    if not raw or getattr(dist, field) is not None:
      continue
    try:
      updates[field] = tp(raw.strip())
    except ValueError:
      raise ConfigError(f"{var}: expected int, got {raw!r}") from None
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
  if vocab is not None and cfg.model.vocab < vocab:
    raise ConfigError(
      f"model.vocab: {cfg.model.vocab} is smaller than the data's vocabulary {vocab}"
    )
  return cfg
