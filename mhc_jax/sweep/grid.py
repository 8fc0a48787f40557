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

from mhc_jax.train.config import (
  Config,
  ConfigError,
  apply_overrides,
  check_paths,
  from_dict,
  parse_override,
  to_dict,
  yaml_load,
)

__all__ = [
  "Run",
  "Sweep",
  "SWEEP_KEYS",
  "load_sweep",
  "expand",
  "run_names",
  "prepare_runs",
  "population_groups",
  "dry_run_table",
  "train_flops",
  "param_counts",
]

SWEEP_KEYS = (
  "name",
  "base",
  "set",
  "axes",
  "population",
  "seeds",
  "description",
  "parallel",
  "executor",
  "eval",
  "variants",
)
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
  axes: dict  # dotted key -> list of values
  population: tuple  # population axes (subset of axes and of population.POPULATION_KEYS)
  base_config: dict  # base + set, validated, as a nested dict
  runs: list  # [Run]
  options: dict = dataclasses.field(default_factory=dict)  # parallel / executor (how to run)
  variant: str | None = None  # the file's variant this sweep is (None: the file has none)

  def run(self, name: str) -> Run:
    return next(r for r in self.runs if r.name == name)


# ------------------------------------------------------------------------------------------
# Reading the file.


def _flatten_set(value: Any, key: str = "set") -> dict:
  """`set` as {dotted key: value}: a mapping (nested ones flattened) or KEY=VALUE strings."""
  if value is None:
    return {}
  if isinstance(value, str):
    value = [value]
  if isinstance(value, (list, tuple)):
    out = {}
    for item in value:
      k, v = parse_override(item)
      out[k] = v
    return out
  if not isinstance(value, Mapping):
    raise ConfigError(f"{key}: expected a mapping of dotted keys to values, got {value!r}")
  out = {}
  for k, v in value.items():
    if not isinstance(k, str) or not k:
      raise ConfigError(f"{key}: keys must be dotted config keys, got {k!r}")
    if isinstance(v, Mapping) and v:
      for kk, vv in _flatten_set(v, f"{key}.{k}").items():
        out[f"{k}.{kk}"] = vv
    else:
      out[k] = v
  return out


def _resolve_base(base: Any, sweep_path: Path | None) -> Path:
  if not isinstance(base, str) or not base:
    raise ConfigError(f"base: expected a path to a config YAML, got {base!r}")
  p = Path(base).expanduser()
  if p.is_absolute():
    cands = [p]
  else:
    cands = ([sweep_path.parent / p] if sweep_path else []) + [Path.cwd() / p, _REPO_ROOT / p]
  for c in cands:
    if c.is_file():
      return c
  raise ConfigError(
    f"base: {base} not found (looked in: {', '.join(str(c.parent) for c in cands)})"
  )


def _read_base(path: Path) -> dict:
  try:
    d = yaml_load(path.read_text(encoding="utf-8"))
  except Exception as e:  # noqa: BLE001 - any YAML/IO problem is bad input
    raise ConfigError(f"base: cannot read {path}: {e}") from None
  if d is None:
    return {}
  if not isinstance(d, dict):
    raise ConfigError(f"base: {path} must hold a mapping of config sections")
  return d


def _err_key(e: ConfigError) -> str:
  return str(e).split(":", 1)[0].strip()


def _validate(d: Mapping) -> Config:
  cfg = from_dict(d)
  check_paths(cfg)
  return cfg


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
  variant = next(iter(variants)) if variant is None else variant
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
  if variant != next(iter(variants)) and "name" not in changes:
    out["name"] = f"{data.get('name', name)}_{variant}"
  return out, variant


def load_sweep(
  path: str | os.PathLike | None = None,
  cli_set: Any = (),
  *,
  data: Mapping | None = None,
  variant: str | None = None,
) -> Sweep:
  """Read, expand and validate a sweep (from `path`, or from the mapping `data`).

  `cli_set` (``--set`` strings) is applied after the file's ``set``. `variant` picks one of
  the file's ``variants`` (default: the first). Raises ConfigError.
  """
  sweep_path = Path(path).resolve() if path is not None else None
  if data is None:
    if sweep_path is None or not sweep_path.is_file():
      raise ConfigError(f"sweep file {path}: not found")
    try:
      data = yaml_load(sweep_path.read_text(encoding="utf-8"))
    except Exception as e:  # noqa: BLE001
      raise ConfigError(f"sweep file {path}: invalid YAML: {e}") from None
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
  base = _read_base(base_path) if base_path else {}
  base = apply_overrides(base, {"name": name})
  overrides = _flatten_set(data.get("set"))
  for k, v in _flatten_set(list(cli_set), "--set").items():
    overrides[k] = v
  base_cfg_dict = apply_overrides(base, overrides)
  base_config = to_dict(_validate_with(base, overrides, "set", "", f"base {base_path}"))

  axes = data.get("axes") or {}
  if not isinstance(axes, Mapping):
    raise ConfigError(f"axes: expected a mapping of dotted keys to lists of values, got {axes!r}")
  axes = dict(axes)
  for k, vals in axes.items():
    if not isinstance(k, str) or not k or any(not p for p in k.split(".")):
      raise ConfigError(f"axes: malformed dotted key {k!r}")
    if isinstance(vals, Mapping):  # named variants
      if not vals or "." in k:
        raise ConfigError(f"axes.{k}: named variants need a plain label and at least one variant")
      for a, ov in vals.items():
        if not isinstance(a, str) or not a or _UNSAFE.search(a):
          raise ConfigError(f"axes.{k}: variant names must be file-name-safe strings, got {a!r}")
        if not isinstance(ov, Mapping) or not ov:
          raise ConfigError(f"axes.{k}.{a}: expected a mapping of dotted overrides, got {ov!r}")
      axes[k] = {a: _flatten_set(ov, f"axes.{k}.{a}") for a, ov in vals.items()}
      continue
    if not isinstance(vals, list) or not vals:
      raise ConfigError(f"axes.{k}: expected a non-empty list of values, got {vals!r}")
    if len({json.dumps(v, sort_keys=True) for v in vals}) != len(vals):
      raise ConfigError(f"axes.{k}: repeated values in {vals!r}")
  variant_keys = {}  # dotted key -> the variant axis that sets it
  for k, vals in axes.items():
    for a, ov in vals.items() if isinstance(vals, Mapping) else ():
      for key in ov:
        if key in axes or variant_keys.get(key, k) != k:
          raise ConfigError(f"axes.{k}.{a}: sets {key}, which another axis sets too")
        variant_keys[key] = k
  pop = data.get("population") or []
  if isinstance(pop, str):
    pop = [pop]
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

  runs = [Run(n, ov, _validate_run(base_cfg_dict, ov, n)) for n, ov in expand(axes)]
  options = {k: data[k] for k in ("parallel", "executor") if data.get(k) is not None}
  if data.get("eval") is not None:  # mhc_jax.sweep.posteval: probes after each finished run
    n = data["eval"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ConfigError(f"eval: expected a positive number of validation batches, got {n!r}")
    options["eval"] = n
  if set(options) & {"parallel", "executor"}:  # how to run, not what: applied by the runner
    from mhc_jax.sweep import options as how

    if "parallel" in options:
      options["parallel"] = how.parse_parallel(options["parallel"], "parallel")
    how.executor_options(options.get("executor"), None)
  return Sweep(
    name, sweep_path, base_path, overrides, axes, tuple(pop), base_config, runs, options, variant
  )


def _seed_values(value: Any, first: int) -> list:
  """The ``seeds`` setting as a list of seeds: N -> first .. first + N - 1, or a list as given."""
  if isinstance(value, int) and not isinstance(value, bool):
    if value < 1:
      raise ConfigError(f"seeds: expected a positive number of seeds, got {value}")
    return [first + i for i in range(value)]
  if (
    isinstance(value, list)
    and value
    and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
  ):
    if len(set(value)) != len(value):
      raise ConfigError(f"seeds: repeated seeds in {value!r}")
    return list(value)
  raise ConfigError(
    f"seeds: expected a number of seeds or a list of distinct non-negative integer "
    f"seeds, got {value!r}"
  )


def _validate_run(base: Mapping, overrides: Mapping, name: str) -> Config:
  return _validate_with(base, overrides, "axes", f" (run {name})")


def _validate_with(
  base: Mapping, overrides: Mapping, label: str, where: str, base_label: str | None = None
) -> Config:
  """`base` + `overrides` validated, or ConfigError naming ``<label>.<key>``: the override at
  fault (the one the error names, else the one without which the config is valid); where no
  override is at fault, `base_label` (if given) is named instead."""
  try:
    return _validate(apply_overrides(base, overrides))
  except ConfigError as e:
    err = e
  key = _err_key(err)
  culprits = [
    k for k in overrides if key == k or key.startswith(k + ".") or k.startswith(key + ".")
  ]
  if not culprits:
    for k in overrides:
      rest = {kk: vv for kk, vv in overrides.items() if kk != k}
      try:
        _validate(apply_overrides(base, rest))
        culprits.append(k)
        break
      except ConfigError:
        continue
  if not culprits and base_label is not None:
    raise ConfigError(f"{base_label}: {err}") from None
  k = culprits[0] if culprits else next(iter(overrides), None)
  if k is None:
    raise err
  raise ConfigError(f"{label}.{k}: value {overrides[k]!r}{where}: {err}") from None


# ------------------------------------------------------------------------------------------
# Names and the grid.


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


def _short_keys(keys: list[str]) -> dict[str, str]:
  lasts = [k.rsplit(".", 1)[-1] for k in keys]
  return {k: (last if lasts.count(last) == 1 else k) for k, last in zip(keys, lasts)}


def run_names(axes: Mapping[str, list]) -> list[str]:
  """The run names of the grid of `axes`, in product order."""
  return [n for n, _ in expand(axes)]


def expand(axes: Mapping[str, list]) -> list[tuple[str, dict]]:
  """[(name, {axis key: value})] for the product of the axes (last axis fastest)."""
  keys = list(axes)
  if not keys:
    return [("base", {})]
  short = _short_keys(keys)
  out, seen = [], {}
  for combo in itertools.product(*(list(axes[k]) for k in keys)):
    name = ",".join(f"{short[k]}={_fmt_value(v)}" for k, v in zip(keys, combo))
    ov = {}
    for k, v in zip(keys, combo):
      ov.update(axes[k][v] if isinstance(axes[k], Mapping) else {k: v})
    name = _UNSAFE.sub("_", name)
    if len(name) > 200:
      name = name[:180] + "_" + hashlib.sha256(name.encode()).hexdigest()[:10]
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
  runs = [r for r in sweep.runs if names is None or r.name in names]
  if not sweep.population:
    return [[r] for r in runs]
  groups: dict[str, list[Run]] = {}
  for r in runs:
    key = json.dumps(
      {k: v for k, v in r.overrides.items() if k not in sweep.population}, sort_keys=True
    )
    groups.setdefault(key, []).append(r)
  return list(groups.values())


# ------------------------------------------------------------------------------------------
# Preparation (data sources, vocabulary, mesh) and the dry-run estimate.


def prepare_runs(sweep: Sweep) -> dict:
  """{run name: train.loop.Setup}; ConfigError (naming the run) on the first bad one."""
  from mhc_jax.train.loop import prepare

  setups, cache = {}, {}
  for r in sweep.runs:
    key = json.dumps(to_dict(r.cfg), sort_keys=True, default=str)
    try:
      setups[r.name] = cache[key] if key in cache else prepare(r.cfg)
    except ConfigError as e:
      k = _err_key(e)
      axis = next((a for a in r.overrides if k == a or k.startswith(a + ".")), None)
      where = (
        f"axes.{axis}: value {r.overrides[axis]!r} (run {r.name})" if axis else f"run {r.name}"
      )
      raise ConfigError(f"{where}: {e}") from None
    cache[key] = setups[r.name]
  return setups


def param_counts(model_cfg) -> dict:
  """Closed-form parameter counts (vocab resolved); jax.eval_shape of the init where a mixer
  has no closed form."""
  from mhc_jax.model.params import expected_params

  try:
    return expected_params(model_cfg)
  except ValueError:
    import jax
    import jax.numpy as jnp

    from mhc_jax.model import Transformer, count_params

    shapes = jax.eval_shape(
      lambda: Transformer(model_cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    )
    import flax.linen as nn

    return count_params(nn.meta.unbox(shapes))


def train_flops(cfg: Config, params: Mapping | None = None) -> float:
  """Estimated training FLOPs of a run (formula in the module docstring)."""
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
    for r in g:
      group_of[r.name] = i if len(g) > 1 else None
  rows = []
  for r in sweep.runs:
    cfg = setups[r.name].cfg
    p = param_counts(cfg.model)
    rows.append(
      {
        "run": r.name,
        "population": group_of[r.name],
        "params": p["total"],
        "non_embedding": p["non_embedding"],
        "tokens": cfg.train.steps * cfg.data.batch_size * cfg.data.seq_len,
        "train_flops": train_flops(cfg, p),
      }
    )
  df = pd.DataFrame(rows)
  if not sweep.population:
    df = df.drop(columns=["population"])
  return df


def format_flops(x: float) -> str:
  if not math.isfinite(x) or x <= 0:
    return str(x)
  exp = int(math.floor(math.log10(x) / 3))
  exp = max(0, min(exp, 5))
  return f"{x / 10 ** (3 * exp):.3g}{['', 'k', 'M', 'G', 'T', 'P'][exp]}"
