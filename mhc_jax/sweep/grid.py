"""Sweep files and their expansion into runs, validated before anything is written: the file's
keys, run names, seeds, named variants and the FLOPs estimate are described in docs/sweeps.md."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mhc_jax.sweep import options as how
from mhc_jax.train.config import (
  Config,
  ConfigError,
  apply_overrides,
  check_paths,
  from_dict,
  parse_override,
  read_yaml,
  to_dict,
)

SWEEP_KEYS = ("name", "base", "set", "axes", "population", "seeds", "description", "parallel")
SWEEP_KEYS += ("executor", "eval", "variants")
_REPO_ROOT = Path(__file__).resolve().parents[2]
_UNSAFE = re.compile(r"[^A-Za-z0-9._+=,-]")


@dataclasses.dataclass(frozen=True)
class Run:
  name: str
  overrides: dict  # axis key -> value, in axis order
  cfg: Config  # validated (vocabulary not yet resolved: see prepare_runs)


@dataclasses.dataclass
class Sweep:
  name: str
  path: Path | None  # the sweep file
  base_path: Path | None  # the resolved base config file
  set: dict  # dotted overrides for every run (file `set`, then --set)
  axes: dict  # dotted key -> list of values (or {variant name: overrides})
  population: tuple  # population axes (subset of axes and of population.POPULATION_KEYS)
  base_config: dict  # base + set, validated, as a nested dict
  runs: list  # [Run]
  options: dict = dataclasses.field(default_factory=dict)  # parallel / executor / eval
  variant: str | None = None  # the file's variant this sweep is (None: the file has none)

  def run(self, name: str) -> Run:
    return next(r for r in self.runs if r.name == name)


# --------------------------------------------------------------------------------- Reading the file
def _flatten_set(value: Any, key: str = "set") -> dict:
  """`set` as {dotted key: value}: a mapping (nested ones flattened) or KEY=VALUE strings."""
  if value is None:
    return {}
  if isinstance(value, (str, list, tuple)):
    return dict(parse_override(v) for v in ([value] if isinstance(value, str) else value))
  if not isinstance(value, Mapping):
    raise ConfigError(f"{key}: expected a mapping of dotted keys to values, got {value!r}")
  out = {}
  for k, v in value.items():
    if not isinstance(k, str) or not k:
      raise ConfigError(f"{key}: keys must be dotted config keys, got {k!r}")
    if isinstance(v, Mapping) and v:
      out.update({f"{k}.{kk}": vv for kk, vv in _flatten_set(v, f"{key}.{k}").items()})
    else:
      out[k] = v
  return out


def _with_variant(data: Mapping, variant: str | None, name: str) -> tuple[dict, str | None]:
  """(the sweep keys with `variant` applied, its name); the first variant when None. A variant
  other than the first names its sweep ``<name>_<variant>`` unless it sets ``name``."""
  variants = data.get("variants")
  if variants is None:
    if variant is not None:
      raise ConfigError(f"variant {variant!r}: this sweep file has no variants")
    return dict(data), None
  if not isinstance(variants, Mapping) or not variants:
    raise ConfigError(f"variants: expected a mapping of names to sweep keys, got {variants!r}")
  first = next(iter(variants))
  variant = first if variant is None else variant
  if variant not in variants:
    raise ConfigError(
      f"variant {variant!r}: not a variant of this sweep file (its variants: "
      f"{', '.join(map(str, variants))})"
    )
  changes = variants[variant] or {}
  if not isinstance(changes, Mapping):
    raise ConfigError(f"variants.{variant}: expected a mapping of sweep keys, got {changes!r}")
  out = {k: v for k, v in data.items() if k != "variants"}
  for k, v in changes.items():
    if k not in SWEEP_KEYS or k == "variants":
      raise ConfigError(f"variants.{variant}.{k}: unknown sweep key")
    if k == "set":
      v = {**_flatten_set(out.get("set")), **_flatten_set(v, f"variants.{variant}.set")}
    elif k == "axes" and isinstance(out.get("axes"), Mapping) and isinstance(v, Mapping):
      v = {**out["axes"], **v}
    out[k] = v
  if variant != first and "name" not in changes:
    out["name"] = f"{data.get('name', name)}_{variant}"
  return out, variant


def _resolve_base(base: Any, sweep_path: Path | None) -> Path:
  if not isinstance(base, str) or not base:
    raise ConfigError(f"base: expected a path to a config YAML, got {base!r}")
  p = Path(base).expanduser()
  near = [sweep_path.parent / p] if sweep_path else []
  cands = [p] if p.is_absolute() else [*near, Path.cwd() / p, _REPO_ROOT / p]
  for c in cands:
    if c.is_file():
      return c
  looked = ", ".join(str(c.parent) for c in cands)
  raise ConfigError(f"base: {base} not found (looked in: {looked})")


def _axes(data: Mapping) -> dict:
  """The file's ``axes``, checked; named variants as {name: {dotted key: value}}."""
  axes = data.get("axes") or {}
  if not isinstance(axes, Mapping):
    raise ConfigError(f"axes: expected a mapping of dotted keys to lists of values, got {axes!r}")
  out, setter = {}, {}  # setter: dotted key -> the variant axis that sets it
  for k, vals in axes.items():
    if not isinstance(k, str) or not all(k.split(".")):
      raise ConfigError(f"axes: malformed dotted key {k!r}")
    if not isinstance(vals, Mapping):
      if not isinstance(vals, list) or not vals:
        raise ConfigError(f"axes.{k}: expected a non-empty list of values, got {vals!r}")
      if len({json.dumps(v, sort_keys=True) for v in vals}) != len(vals):
        raise ConfigError(f"axes.{k}: repeated values in {vals!r}")
      out[k] = vals
      continue
    if not vals or "." in k:
      raise ConfigError(f"axes.{k}: named variants need a plain label and at least one variant")
    out[k] = {}
    for a, ov in vals.items():
      if not isinstance(a, str) or not a or _UNSAFE.search(a):
        raise ConfigError(f"axes.{k}: variant names must be file-name-safe strings, got {a!r}")
      if not isinstance(ov, Mapping) or not ov:
        raise ConfigError(f"axes.{k}.{a}: expected a mapping of dotted overrides, got {ov!r}")
      out[k][a] = _flatten_set(ov, f"axes.{k}.{a}")
      for key in out[k][a]:
        if key in axes or setter.setdefault(key, k) != k:
          raise ConfigError(f"axes.{k}.{a}: sets {key}, which another axis sets too")
  return out


def _seed_values(value: Any, first: int) -> list:
  """The ``seeds`` setting as a list of seeds: N -> first .. first + N - 1, or a list as given."""
  if isinstance(value, int) and not isinstance(value, bool):
    if value < 1:
      raise ConfigError(f"seeds: expected a positive number of seeds, got {value}")
    return [first + i for i in range(value)]
  if isinstance(value, list) and value and all(_count(v, 0) for v in value):
    if len(set(value)) != len(value):
      raise ConfigError(f"seeds: repeated seeds in {value!r}")
    return value
  raise ConfigError(
    f"seeds: expected a number of seeds or a list of distinct non-negative integer "
    f"seeds, got {value!r}"
  )


def _count(v: Any, least: int = 1) -> bool:
  return isinstance(v, int) and not isinstance(v, bool) and v >= least


def read_sweep(
  path: str | os.PathLike | None = None,
  cli_set: Any = (),
  *,
  data: Mapping | None = None,
  variant: str | None = None,
) -> Sweep:
  """Read, expand and validate a sweep (from `path`, or from the mapping `data`): `cli_set`
  (``--set`` strings) applies after the file's ``set``, `variant` picks one of the file's
  ``variants`` (default: the first). Raises ConfigError."""
  sweep_path = Path(path).resolve() if path is not None else None
  if data is None:
    data = read_yaml(sweep_path or "-", f"sweep file {path}")
    if not data:
      raise ConfigError(f"sweep file {path}: empty (expected keys from {', '.join(SWEEP_KEYS)})")
  if not isinstance(data, Mapping):
    raise ConfigError(f"sweep file {path}: expected a mapping with keys {', '.join(SWEEP_KEYS)}")
  for k in data:
    if k not in SWEEP_KEYS:
      raise ConfigError(f"{k}: unknown sweep key (known: {', '.join(SWEEP_KEYS)})")
  default_name = sweep_path.stem if sweep_path else "sweep"
  data, variant = _with_variant(data, variant, default_name)
  name = data.get("name", default_name)
  if not isinstance(name, str) or not name or _UNSAFE.search(name):
    raise ConfigError(f"name: expected a file-name-safe string, got {name!r}")

  base_path = _resolve_base(data["base"], sweep_path) if data.get("base") is not None else None
  base = {**(read_yaml(base_path, f"base {base_path}") if base_path else {}), "name": name}
  overrides = {**_flatten_set(data.get("set")), **_flatten_set(list(cli_set), "--set")}
  base_config = to_dict(_validated(base, overrides, "set", "", f"base {base_path}"))
  base = apply_overrides(base, overrides)

  axes = _axes(data)
  pop = data.get("population") or []
  pop = [pop] if isinstance(pop, str) else pop
  if not isinstance(pop, list):
    raise ConfigError(f"population: expected a list of axis keys, got {pop!r}")
  if data.get("seeds") is not None:
    if "train.seed" in axes:
      raise ConfigError("seeds: this sweep already has a train.seed axis; give one or the other")
    axes["train.seed"] = _seed_values(data["seeds"], base_config["train"]["seed"])
    pop = pop if "train.seed" in pop else [*pop, "train.seed"]
  from mhc_jax.sweep.population import POPULATION_KEYS

  for k in pop:
    if k not in POPULATION_KEYS:
      raise ConfigError(
        f"population.{k}: cannot be trained as a population (only axes that "
        f"change no shape can: {', '.join(POPULATION_KEYS)})"
      )
    if k not in axes:
      raise ConfigError(f"population.{k}: not an axis of this sweep (axes: {', '.join(axes)})")

  runs = [Run(n, ov, _validated(base, ov, "axes", f" (run {n})")) for n, ov in expand(axes)]
  options = {k: data[k] for k in ("parallel", "executor", "eval") if data.get(k) is not None}
  if "eval" in options and not _count(options["eval"]):  # sweep.posteval after each run
    raise ConfigError(
      f"eval: expected a positive number of validation batches, got {options['eval']!r}"
    )
  if "parallel" in options:  # how to run, not what: checked here, applied by the runner
    options["parallel"] = how.parse_parallel(options["parallel"], "parallel")
  if "executor" in options:
    how.executor_options(options["executor"], None)
  return Sweep(
    name, sweep_path, base_path, overrides, axes, tuple(pop), base_config, runs, options, variant
  )


def _blame(e: ConfigError, overrides: Mapping) -> str | None:
  """The override a ConfigError names (its key, or a section or part of it), if any."""
  key = str(e).split(":", 1)[0].strip()
  return next(
    (k for k in overrides if key == k or key.startswith(k + ".") or k.startswith(key + ".")), None
  )


def _validated(
  base: Mapping, overrides: Mapping, label: str, where: str, base_label: str | None = None
) -> Config:
  """`base` + `overrides` validated, or ConfigError naming ``<label>.<key>``: the override at
  fault (the one the error names, else the one without which the config is valid); where no
  override is at fault, `base_label` (if given) is named instead."""

  def check(ov: Mapping) -> Config:
    cfg = from_dict(apply_overrides(base, ov))
    check_paths(cfg)
    return cfg

  def valid_without(k: str) -> bool:
    try:
      check({kk: v for kk, v in overrides.items() if kk != k})
      return True
    except ConfigError:
      return False

  try:
    return check(overrides)
  except ConfigError as e:
    err = e
  k = _blame(err, overrides)
  if k is None:
    k = next((kk for kk in overrides if valid_without(kk)), None)
  if k is None and base_label is not None:
    raise ConfigError(f"{base_label}: {err}") from None
  k = next(iter(overrides), None) if k is None else k
  if k is None:
    raise err
  raise ConfigError(f"{label}.{k}: value {overrides[k]!r}{where}: {err}") from None


# ------------------------------------------------------------------------------- Names and the grid
def _fmt_value(v: Any) -> str:
  if isinstance(v, bool) or v is None:
    return json.dumps(v)
  if isinstance(v, float):
    return format(v, "g")
  if isinstance(v, dict):
    return "_".join(f"{k}-{_fmt_value(x)}" for k, x in sorted(v.items())) or "none"
  if isinstance(v, list):
    return "-".join(_fmt_value(x) for x in v) or "none"
  return str(v)


def run_names(axes: Mapping[str, list]) -> list[str]:
  """The run names of the grid of `axes`, in product order."""
  return [n for n, _ in expand(axes)]


def expand(axes: Mapping[str, list]) -> list[tuple[str, dict]]:
  """[(name, {axis key: value})] for the product of the axes (last axis fastest)."""
  if not axes:
    return [("base", {})]
  lasts = [k.rsplit(".", 1)[-1] for k in axes]
  short = [last if lasts.count(last) == 1 else k for k, last in zip(axes, lasts)]
  out, seen = [], {}
  for combo in itertools.product(*(list(v) for v in axes.values())):
    name = _UNSAFE.sub("_", ",".join(f"{s}={_fmt_value(v)}" for s, v in zip(short, combo)))
    if len(name) > 200:
      name = name[:180] + "_" + hashlib.sha256(name.encode()).hexdigest()[:10]
    ov = {}
    for (k, vals), v in zip(axes.items(), combo):
      ov.update(vals[v] if isinstance(vals, Mapping) else {k: v})
    if name in seen:
      raise ConfigError(
        f"axes: runs {seen[name]} and {ov} get the same name {name!r}; make the values distinct"
      )
    seen[name] = ov
    out.append((name, ov))
  return out


def population_groups(sweep: Sweep, names: list[str] | None = None) -> list[list[Run]]:
  """Runs grouped into populations: same values on every non-population axis. Without
  ``population`` every run is its own group. `names` restricts to those runs (order kept)."""
  groups: dict[str, list[Run]] = {}
  for r in sweep.runs:
    if names is None or r.name in names:
      rest = {k: v for k, v in r.overrides.items() if k not in sweep.population}
      key = json.dumps(rest, sort_keys=True) if sweep.population else r.name
      groups.setdefault(key, []).append(r)
  return list(groups.values())


# ---------------------------- Preparation (data sources, vocabulary, mesh) and the dry-run estimate
def prepare_runs(sweep: Sweep, prepare=None, note: str = "") -> dict:
  """{run name: prepare(its config)} (default train.loop.prepare: a Setup); ConfigError naming
  the run and the axis at fault (then `note`) on the first bad one."""
  if prepare is None:
    from mhc_jax.train.loop import prepare
  setups, cache = {}, {}
  for r in sweep.runs:  # runs that differ only in optim.lr share one preparation (and source)
    d = to_dict(r.cfg)
    lr = d["optim"].pop("lr")
    key = json.dumps(d, sort_keys=True, default=str)
    try:
      if key not in cache:
        cache[key] = prepare(r.cfg)
    except ConfigError as e:
      a = _blame(e, r.overrides)
      where = f"axes.{a}: value {r.overrides[a]!r} (run {r.name})" if a else f"run {r.name}"
      raise ConfigError(f"{where}: {e}{note}") from None
    s = cache[key]
    if dataclasses.is_dataclass(s) and s.cfg.optim.lr != lr:  # a Setup: this run's own lr
      s = dataclasses.replace(s, cfg=_with_lr(s.cfg, lr))
    setups[r.name] = s
  return setups


def _with_lr(cfg: Config, lr: float) -> Config:
  return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=lr))


def param_counts(model_cfg) -> dict:
  """Closed-form parameter counts of a ModelConfig (vocab resolved)."""
  from mhc_jax.model.params import expected_params

  return expected_params(model_cfg)


def train_flops(cfg: Config, params: Mapping | None = None) -> float:
  """Estimated training FLOPs of a run (the formula: docs/sweeps.md)."""
  m = cfg.model
  params = params or param_counts(m)
  n = params["non_embedding"] + m.vocab * m.width
  t = cfg.data.seq_len
  per_token = 6 * n + 12 * m.depth * t * m.width
  return float(cfg.train.steps) * cfg.data.batch_size * t * per_token


def dry_run_table(sweep: Sweep, setups: Mapping):
  """A DataFrame: run, population group, params, non-embedding params, tokens, train FLOPs."""
  import pandas as pd

  group_of = {}
  for i, g in enumerate(population_groups(sweep)):
    group_of.update({r.name: i if len(g) > 1 else None for r in g})
  rows = []
  for r in sweep.runs:
    cfg = setups[r.name].cfg
    p = param_counts(cfg.model)
    row = {"run": r.name, "population": group_of[r.name], "params": p["total"]}
    row |= {"non_embedding": p["non_embedding"]}
    row |= {"tokens": cfg.train.steps * cfg.data.batch_size * cfg.data.seq_len}
    rows.append(row | {"train_flops": train_flops(cfg, p)})
  df = pd.DataFrame(rows)
  return df if sweep.population else df.drop(columns=["population"])


def format_flops(x: float) -> str:
  if not math.isfinite(x) or x <= 0:
    return str(x)
  exp = max(0, min(int(math.floor(math.log10(x) / 3)), 5))
  return f"{x / 10 ** (3 * exp):.3g}{['', 'k', 'M', 'G', 'T', 'P'][exp]}"
