"""Run configuration: frozen, strict pydantic dataclasses, loaded from YAML plus dotted
``a.b.c=VALUE`` overrides and validated before anything runs. Every problem is one
:class:`ConfigError` naming the dotted key; the keys, types and rules are in docs/interfaces.md
("Config"). Nothing here imports jax."""

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
from collections.abc import Mapping
from typing import Any, Literal, Optional

import pydantic
import yaml
from pydantic import ConfigDict, Field, JsonValue, field_validator, model_validator

from mhc_jax import storage
from mhc_jax.errors import ConfigError
from mhc_jax.mixer_options import OPTIONS, all_option_names

DEFAULT_VOCAB = 256  # what a model uses when neither model.vocab nor the data source sets one
POSTERIOR_TASKS = ("bijection", "hmm")  # tasks with an exact posterior (data.target=posterior)


class _Loader(yaml.SafeLoader):
  """PyYAML's SafeLoader, rejecting duplicate keys (PyYAML silently keeps the last one)."""

  def construct_mapping(self, node, deep=False):
    keys = [(k.tag, k.value) for k, _ in node.value if isinstance(k, yaml.ScalarNode)]
    for i, (tag, value) in enumerate(keys):
      if tag != "tag:yaml.org,2002:merge" and (tag, value) in keys[:i]:
        mark = node.value[i][0].start_mark
        raise yaml.constructor.ConstructorError(None, None, f"duplicate key {value!r}", mark)
    return super().construct_mapping(node, deep=deep)


# YAML 1.1 wants a dot and a signed exponent in a float: 3e-3, 1e4 and 1.5e3 are floats here too
_Loader.add_implicit_resolver(
  "tag:yaml.org,2002:float",
  re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
  list("-+0123456789."),
)


def yaml_load(text: str) -> Any:
  """yaml.safe_load, except that 3e-3 and 1e4 are floats and duplicate keys are errors."""
  return yaml.load(text, Loader=_Loader)


# ------------------------- pydantic's ValidationError as one ConfigError line naming the dotted key
def _show(value: Any) -> str:
  return "null" if value is None else f"{type(value).__name__} {value!r}"


def _unknown_key(prefix: str, key: Any, known) -> ConfigError:
  full, dot = (f"{prefix}.{key}", f"{prefix}.") if prefix else (str(key), "")
  if not isinstance(key, str):
    return ConfigError(f"{full}: keys must be strings, got {_show(key)}")
  close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
  if close:
    return ConfigError(f"{full}: unknown key (did you mean {dot}{close[0]}?)")
  return ConfigError(f"{full}: unknown key (known: {', '.join(known)})")


def _fields(cls: type) -> dict[str, Any]:
  """{field: annotation} of a pydantic dataclass or model."""
  return {k: f.annotation for k, f in cls.__pydantic_fields__.items()}


def _type_name(tp: Any) -> str:
  if typing.get_origin(tp) in (typing.Union, type(int | None)):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return " or ".join(map(_type_name, args)) + " or null"
  return "mapping" if typing.get_origin(tp) is dict else getattr(tp, "__name__", str(tp))


_BOUNDS = dict(greater_than=">", greater_than_equal=">=", less_than="<", less_than_equal="<=")


def _error(e: pydantic.ValidationError, prefix: str, cls: type) -> ConfigError:
  """The first error of `e` (raised validating `cls`, at dotted key `prefix`) as a ConfigError."""
  err = e.errors(include_url=False)[0]
  ctx, value, kind = err.get("ctx", {}), err["input"], err["type"]
  if isinstance(ctx.get("error"), ConfigError):  # a check below that names its own key
    return ctx["error"]
  loc = [str(p) for p in err["loc"] if not str(p).startswith(("[", "function-"))]
  key = ".".join([prefix, *loc[:2]] if prefix else loc[:2]) or "config"
  tp = _fields(cls).get(loc[0]) if loc else None
  if kind in ("extra_forbidden", "unexpected_keyword_argument"):
    return _unknown_key(prefix, loc[0], _fields(cls))
  if kind == "literal_error":
    choices = typing.get_args(tp)
    close = difflib.get_close_matches(value, choices, n=1) if isinstance(value, str) else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    opts = ", ".join(map(repr, choices))
    return ConfigError(f"{key}: expected one of {opts}, got {_show(value)}{hint}")
  if kind.endswith("_type") or kind == "int_from_float":
    return ConfigError(f"{key}: expected {_type_name(tp)}, got {_show(value)}")
  if kind == "finite_number":
    return ConfigError(f"{key}: expected a finite number, got {value!r}")
  if kind in _BOUNDS:
    bound = next(iter(ctx.values()))
    bound = f"{bound:g}" if isinstance(bound, float) else bound
    return ConfigError(f"{key}: must be {_BOUNDS[kind]} {bound}, got {value!r}")
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


# ------------------------------------------------------------------------------------- The sections
def _check_mixer_options(mixer: str, opts: dict) -> dict:
  """`opts` checked against `mixer`'s typed options; the keys set, their values typed."""
  prefix, model = "model.mixer_options", _options(mixer)
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


def _options(mixer: str):
  """The typed options of a mixer name (None: unknown) or a "module:Class" path (imported)."""
  if ":" not in mixer:
    return OPTIONS.get(mixer)
  from mhc_jax import mixers

  try:
    return mixers.options_model(mixers.load(mixer))
  except ValueError as e:
    raise ConfigError(f"model.mixer: {e}") from None


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
  remat: Literal["none", "full", "dots"] = "dots"
  scan: bool = True
  scan_unroll: int = Field(1, ge=1)  # blocks per nn.scan iteration (>1: longer compile, faster)
  dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype
  attention: Literal["auto", "xla", "cudnn", "materialized"] = "auto"
  param_dtype: Literal["float32"] = "float32"  # parameters and optimiser state stay float32
  init: Literal["standard", "depth_scaled"] = "standard"
  init_scale: float = Field(1.0, gt=0)
  mixer: str = "residual"
  mixer_options: dict[str, Any] = Field(default_factory=dict)  # mhc_jax.mixer_options
  # how init, lrs, eps, wd, branches and logits scale with width and depth (docs/parametrization.md)
  parametrization: Literal["sp", "mup", "completep"] = "sp"
  base_width: int = Field(32, ge=1)  # the size the lr was tuned at: m_d = width / base_width
  base_depth: int = Field(2, ge=1)  # m_L = depth / base_depth (completep)
  depth_alpha: float = Field(1.0, ge=0)  # completep's alpha: 1 CompleteP, 0.5 depth-muP
  # muP's 1/head_dim attention: logits x sqrt(base_head_dim / head_dim); None: head dim held
  base_head_dim: int | None = Field(None, ge=1)

  @field_validator("mixer")
  @classmethod
  def _known_mixer(cls, mixer: str) -> str:
    if _options(mixer) is None:
      close = difflib.get_close_matches(mixer, OPTIONS, n=1)
      hint = f" (did you mean {close[0]}?)" if close else ""
      raise ConfigError(
        f"model.mixer: unknown mixer {mixer!r}{hint}; known: {', '.join(OPTIONS)}, or an"
        f" importable 'module:Class'"
      )
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
    if self.parametrization != "sp":
      from mhc_jax import mixers

      if mixers.resolve(self.mixer).param_roles is None:
        raise ConfigError(
          f"model.parametrization: {self.parametrization!r} needs the mixer's parameter roles;"
          f" {self.mixer} declares none (param_roles: docs/parametrization.md)"
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
  independent_wd: bool = False  # True: decay per step = weight_decay * lr(t)/lr
  clip: Optional[float] = Field(1.0, ge=0)  # global-norm clip; 0 or null turns it off
  # set: lr was tuned at base_steps; peak = lr (train.steps / base_steps)^-steps_exponent
  base_steps: int | None = Field(None, ge=1)
  steps_exponent: float = Field(0.5, ge=0)  # regret < 0.05 in every arm: docs/studies/horizon

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


SECTIONS = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "train": TrainConfig}
SECTIONS |= {"mesh": MeshConfig, "dist": DistConfig}
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


# ---------------------------------------------------------------- dict <-> Config, overrides, files
# Keys since removed from the config, with the one value they had: accepted at that value (old
# run directories load) and hashed as before, so old runs and sweeps keep their hashes.
_RETIRED = {"train": {"inject_nonfinite_at": -1, "population_mode": "vmap"}}


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
    retired = _RETIRED.get(key, {})
    if not isinstance(sub, Mapping):
      raise ConfigError(f"{key}: expected a mapping, got {_show(sub)}")
    for k, v in sub.items():
      if not isinstance(k, str):
        raise _unknown_key(key, k, _fields(cls))
      if k in retired and v != retired[k]:
        raise ConfigError(
          f"{key}.{k}: removed; only {retired[k]!r} (what every run now does) is accepted,"
          f" got {_show(v)}"
        )
    kwargs[key] = cls(**{k: v for k, v in sub.items() if k not in retired})
  return Config(**kwargs)


def parse_override(text: str) -> tuple[str, Any]:
  """'a.b.c=VALUE' -> ('a.b.c', yaml value of VALUE). An empty VALUE is null."""
  if not isinstance(text, str) or "=" not in text:
    raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. optim.lr=3e-3")
  key, raw = text.split("=", 1)
  try:
    return key.strip(), yaml_load(raw) if raw.strip() else None
  except yaml.YAMLError as e:
    raise ConfigError(
      f"{key.strip()}: cannot parse override value {raw!r} as YAML"
      f" ({getattr(e, 'problem', None) or e})"
    ) from None


def apply_overrides(cfg_dict: Mapping | None, overrides: Any = ()) -> dict:
  """A copy of a nested config dict with dotted-key overrides applied: 'a.b=VALUE' strings,
  (key, value) pairs or a mapping {dotted key: value}. Missing sections are created; from_dict
  checks the keys afterwards."""
  out = copy.deepcopy(dict(cfg_dict or {}))
  if isinstance(overrides, str):
    overrides = [overrides]
  for item in overrides.items() if isinstance(overrides, Mapping) else overrides:
    key, value = parse_override(item) if isinstance(item, str) else item
    if not isinstance(key, str) or not all(key.split(".")):
      raise ConfigError(f"override {key!r}: malformed dotted key")
    *parents, last = key.split(".")
    node = out
    for i, part in enumerate(parents):
      if node.get(part) is None:
        node[part] = {}
      elif not isinstance(node[part], dict):
        where = ".".join(parents[: i + 1])
        raise ConfigError(f"{where}: is {_show(node[part])}, not a section; cannot set {key}")
      node = node[part]
    node[last] = copy.deepcopy(value)
  return out


def with_overrides(cfg: Config, overrides: Any) -> Config:
  """`cfg` with dotted overrides applied (same forms as apply_overrides), re-validated."""
  return from_dict(apply_overrides(to_dict(cfg), overrides))


def read_yaml(path, where: str = "") -> dict:
  """A YAML file holding a mapping ({} when empty); ConfigError naming `where` (the file)."""
  where = where or f"config file {path}"
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
    raise ConfigError(f"{where}: top level must be a mapping, got {type(d).__name__}")
  return d or {}


def check_paths(cfg: Config) -> None:
  """A text/tfds task's data path (file, folder or glob) must exist (none: the default corpus)."""
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
  """Read a YAML config (the defaults when `path` is None), apply overrides, validate;
  ConfigError before anything is written."""
  cfg = from_dict(apply_overrides(read_yaml(path) if path is not None else {}, overrides))
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


def result_keys(d: dict) -> dict:
  """The part of a config dict (as `to_dict` gives) that determines a run's results: no `dist`,
  and no key its other values make unread (the form `config_hash` hashes and a resumed sweep
  compares). Tolerates a dict written before some key existed."""
  d = copy.deepcopy(d)
  d.pop("dist", None)
  model, optim = d.get("model", {}), d.get("optim", {})
  if model.get("parametrization", "sp") == "sp":  # sp ignores them: hashes as before they existed
    for k in ("parametrization", "base_width", "base_depth", "depth_alpha", "base_head_dim"):
      model.pop(k, None)
  elif model.get("base_head_dim") is None:  # unset: hashes as before the key existed
    model.pop("base_head_dim", None)
  if optim.get("base_steps") is None:  # unset: the lr as set, hashed as before the keys existed
    for k in ("base_steps", "steps_exponent"):
      optim.pop(k, None)
  for section, keys in _RETIRED.items():
    d.setdefault(section, {}).update(keys)
  return d


def config_hash(cfg: Config, length: int = 10) -> str:
  """Short stable hash of what determines a run's results (`result_keys`)."""
  blob = json.dumps(result_keys(to_dict(cfg)), sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(blob.encode()).hexdigest()[:length]


# -------------------------------------------------- Checks and fill-ins that need the outside world
def validate_mesh(
  mesh: MeshConfig, n_devices: int, batch_size: int | None = None
) -> tuple[int, int, int]:
  """(data, fsdp, tensor) with -1 resolved against `n_devices`; the product and (optionally)
  the global batch's split over data*fsdp checked."""
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


def resolve_dist(dist: DistConfig, environ: Mapping[str, str] | None = None) -> DistConfig:
  """Unset dist fields from MHC_COORDINATOR (which also enables dist), MHC_NUM_PROCESSES and
  MHC_PROCESS_ID; the config wins. Called at start-up, so a saved config pins no process id."""
  env = os.environ if environ is None else environ
  updates: dict[str, Any] = {"enabled": True} if env.get("MHC_COORDINATOR") else {}
  for field in ("coordinator", "num_processes", "process_id"):
    var, raw = f"MHC_{field.upper()}", env.get(f"MHC_{field.upper()}")
    if raw and getattr(dist, field) is None:
      try:
        updates[field] = raw.strip() if field == "coordinator" else int(raw)
      except ValueError:
        raise ConfigError(f"{var}: expected int, got {raw!r}") from None
  return dataclasses.replace(dist, **updates) if updates else dist


def with_data_vocab(cfg: Config, vocab: int | None) -> Config:
  """model.vocab filled from the data source's vocabulary (DEFAULT_VOCAB when neither says);
  an explicit model.vocab must be at least the data's."""
  if cfg.model.vocab is None:
    v = vocab if vocab is not None else DEFAULT_VOCAB
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab=v))
  if vocab is not None and cfg.model.vocab < vocab:
    raise ConfigError(
      f"model.vocab: {cfg.model.vocab} is smaller than the data's vocabulary {vocab}"
    )
  return cfg
