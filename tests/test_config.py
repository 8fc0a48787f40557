"""Config layer: YAML + overrides, validation messages, round trips, mesh resolution."""

import dataclasses
import pathlib

import pytest

from mhc_jax.mixer_options import OPTIONS
from mhc_jax.train.config import (
  Config,
  ConfigError,
  DistConfig,
  MeshConfig,
  ModelConfig,
  apply_overrides,
  check_paths,
  config_hash,
  data_option_names,
  from_dict,
  load_config,
  parse_override,
  resolve_dist,
  save_config,
  to_dict,
  validate_mesh,
  with_data_vocab,
  with_overrides,
  yaml_load,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Run configs; sweep files (base + axes: configs/sweeps, configs/studies) are loaded by
# tests/test_sweep.py.
SWEEP_DIRS = {"sweeps", "studies"}
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if not SWEEP_DIRS & set(p.parts))


def _write(tmp_path, text, name="c.yaml"):
  p = tmp_path / name
  p.write_text(text)
  return str(p)


def _err(fn, *args, **kw) -> str:
  with pytest.raises(ConfigError) as e:
    fn(*args, **kw)
  return str(e.value)


# ---------------------------------------------------------------------------- files


def test_repo_has_the_shipped_configs():
  names = {p.name for p in CONFIGS}
  assert {"quickstart.yaml", "debug.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_config_file_loads(path):
  cfg = load_config(str(path))
  assert isinstance(cfg, Config)
  # the leading comment says how to run it
  assert path.read_text().lstrip().startswith("#")


def test_shipped_configs_content():
  q = load_config(str(ROOT / "configs/quickstart.yaml"))
  assert (q.model.depth, q.model.width, q.model.heads, q.model.mixer) == (2, 32, 2, "mhc")
  assert q.model.mixer_options == {}  # mhc's own default: n = 4 streams
  from mhc_jax import mixers

  assert mixers.get("mhc").n == 4
  assert (q.data.task, q.data.seq_len, q.data.batch_size, q.train.steps) == (
    "bijection",
    32,
    16,
    100,
  )
  d = load_config(str(ROOT / "configs/debug.yaml"))
  assert d.train.steps == 5
  validate_mesh(d.mesh, 8, d.data.batch_size)  # runs on the 8 simulated test devices


def test_defaults():
  c = load_config(None)
  assert c == Config()
  assert c.model.vocab is None and c.model.depth == 4 and c.model.mixer == "residual"
  assert c.optim.lr == 3e-3 and c.optim.clip == 1.0 and c.train.steps == 200
  assert (c.mesh.data, c.mesh.fsdp, c.mesh.tensor) == (-1, 1, 1)
  assert c.model.attention == "auto"


# ---------------------------------------------------------------------------- overrides


def test_yaml_numbers_with_exponents_are_floats():
  assert yaml_load("a: 3e-3\nb: 1e4\nc: -2E+2\nd: 10\ne: 1.5\nf: abc1e3") == {
    "a": 0.003,
    "b": 10000.0,
    "c": -200.0,
    "d": 10,
    "e": 1.5,
    "f": "abc1e3",
  }


def test_yaml_file_exponent_floats(tmp_path):
  c = load_config(_write(tmp_path, "optim:\n  lr: 3e-3\n  eps: 1e-6\n"))
  assert c.optim.lr == pytest.approx(0.003) and isinstance(c.optim.lr, float)
  assert c.optim.eps == pytest.approx(1e-6)


@pytest.mark.parametrize(
  "text,key,value",
  [
    ("optim.lr=3e-3", "optim.lr", 0.003),
    ("optim.lr=1e4", "optim.lr", 1e4),
    ("optim.lr=0.5", "optim.lr", 0.5),
    ("train.steps=10", "train.steps", 10),
    ("model.rope=false", "model.rope", False),
    ("data.options.sizes=[1, 2]", "data.options.sizes", [1, 2]),
    ("optim.clip=", "optim.clip", None),
    ("optim.clip=null", "optim.clip", None),
    ("dist.coordinator=10.0.0.1:1234", "dist.coordinator", "10.0.0.1:1234"),
  ],
)
def test_parse_override(text, key, value):
  k, v = parse_override(text)
  assert k == key and v == value and type(v) is type(value)


def test_overrides_apply(tmp_path):
  path = _write(tmp_path, "model:\n  mixer: mhc\n  mixer_options:\n    n: 2\n")
  c = load_config(
    path,
    [
      "optim.lr=3e-3",
      "optim.weight_decay=0",
      "model.qk_norm=true",
      "model.mixer_options.n=4",
      "model.mixer_options.sinkhorn_iters=7",
      "data.options.n_symbols=12",
      "name=my-run",
    ],
  )
  assert c.optim.lr == 0.003 and c.optim.weight_decay == 0.0
  assert isinstance(c.optim.weight_decay, float)  # ints accepted for floats, stored as float
  assert c.model.qk_norm is True
  assert c.model.mixer_options == {"n": 4, "sinkhorn_iters": 7}
  assert c.data.options == {"n_symbols": 12}
  assert c.name == "my-run"


def test_apply_overrides_forms_and_copy():
  base = {"model": {"depth": 2}}
  out = apply_overrides(base, {"model.width": 32, "optim.lr": 1e-3})
  assert out == {"model": {"depth": 2, "width": 32}, "optim": {"lr": 1e-3}}
  assert base == {"model": {"depth": 2}}  # input untouched
  assert apply_overrides(base, [("model.depth", 3)])["model"]["depth"] == 3
  c = with_overrides(Config(), ["model.depth=6"])
  assert c.model.depth == 6 and c.model.width == Config().model.width


def test_later_override_wins():
  assert load_config(None, ["train.steps=300", "train.steps=400"]).train.steps == 400


# ---------------------------------------------------------------------------- round trips


def test_round_trip(tmp_path):
  c = load_config(
    None,
    [
      "model.mixer=mhc",
      "model.mixer_options.n=4",
      "model.mixer_options.h_res_init=identity",
      "optim.eps=1e-8",
      "data.options.n_symbols=20",
      "model.mixer_options.stream_init=symmetric",
      "dist.coordinator=localhost:1234",
      "name=rt",
    ],
  )
  assert from_dict(to_dict(c)) == c
  p = tmp_path / "saved.yaml"
  save_config(c, str(p))
  assert load_config(str(p)) == c
  assert config_hash(load_config(str(p))) == config_hash(c)


# config_hash of these configs as the hand-built config layer gave them (before pydantic, issue
# 34): run directories and sweep resume depend on the hashes staying the same.
HASHES = {
  "6b19465d1c": {},
  "8c2be7591a": {
    "name": "quickstart",
    "model": {"depth": 2, "width": 32, "heads": 2, "mixer": "mhc"},
    "data": {"seq_len": 32, "batch_size": 16, "options": {"n_symbols": 8}},
    "optim": {"warmup_steps": 10},
    "train": {"steps": 100, "log_every": 10, "eval_every": 50},
  },
  "165c35baf9": {
    "name": "hmm",
    "model": {"depth": 3},
    "data": {
      "task": "hmm",
      "seq_len": 48,
      "target": "posterior",
      "options": {"n_states": 3, "n_symbols": 3, "n_levels": 10, "alpha": 1.0, "stickiness": 0.7},
    },
    "optim": {"weight_decay": 0},
    "train": {"steps": 5000, "log_every": 10, "diag_every": 0, "eval_every": 500, "keep_ckpts": 5},
  },
  "74995adaf4": {
    "name": "gpu",
    "model": {"depth": 8, "width": 2048, "heads": 16, "dtype": "bfloat16", "mixer": "mhc"},
    "data": {"task": "text", "seq_len": 1024, "batch_size": 8, "options": {"val_fraction": 0.05}},
    "optim": {"lr": 1e-3, "warmup_steps": 250},
    "train": {"steps": 5000, "diag_every": 100, "eval_every": 1000, "ckpt_every": 1000},
  },
  "23f5f94def": {
    "model": {
      "mixer": "mhc",
      "mixer_options": {"n": 4, "alpha_init": 1, "stream_init": "symmetric", "res_diag": 0.95},
    }
  },
  "02b638a227": {
    "model": {"mixer": "hc", "mixer_options": {"dynamic": False, "collapse": "learned"}}
  },
  "3830fee7d6": {"model": {"mixer": "deepnorm", "mixer_options": {"alpha": 2, "beta": None}}},
  "be79b1fd99": {
    "optim": {"clip": None, "lr": 1e-2, "weight_decay": 0, "warmup_steps": 10},
    "train": {"steps": 50, "seed": 3},
  },
  "a46dc3c5b7": {
    "name": "x",
    "model": {"remat": "none", "vocab": 300},
    "mesh": {"data": 2, "fsdp": -1},
    "dist": {"enabled": True, "coordinator": "localhost:1234"},
  },
}


@pytest.mark.parametrize("expected", HASHES)
def test_config_hash_as_before(expected):
  assert config_hash(from_dict(HASHES[expected])) == expected


def test_run_written_before_a_key_was_removed_still_loads():
  """A run directory's config.yaml from before a key's removal, with the key at the only value
  it could still mean, loads (eval and report read old runs) and keeps its hash."""
  old = to_dict(Config())
  old["train"].update(inject_nonfinite_at=-1, population_mode="vmap")
  assert from_dict(old) == Config()
  assert config_hash(from_dict(old)) == config_hash(Config())


def test_config_hash():
  a = Config()
  assert config_hash(a) == config_hash(Config()) and len(config_hash(a)) == 10
  assert config_hash(with_overrides(a, ["optim.lr=1e-3"])) != config_hash(a)
  # how the run is launched does not change what it computes
  assert config_hash(with_overrides(a, ["dist.enabled=true"])) == config_hash(a)


def test_hashable_for_jit_static_args():
  a = load_config(None, ["model.mixer=mhc", "model.mixer_options.n=4"])
  b = with_overrides(Config(), ["model.mixer=mhc", "model.mixer_options.n=4"])
  assert a == b and hash(a) == hash(b) and hash(a.model) == hash(b.model)
  assert hash(a.model) != hash(Config().model)


def test_frozen_and_replace_revalidates():
  c = Config()
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.model.depth = 3  # type: ignore[misc]
  with pytest.raises(ConfigError, match="model.heads"):
    dataclasses.replace(c.model, heads=5)


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
  "overrides,message",
  [
    (["model.heads=3"], "model.heads: 3 does not divide model.width=64"),
    (["optim.lr=-0.1"], "optim.lr: must be > 0, got -0.1"),
    (["optim.lr=0"], "optim.lr: must be > 0"),
    (["model.dept=3"], "model.dept: unknown key (did you mean model.depth?)"),
    (["train.inject_nonfinite_at=2"], "train.inject_nonfinite_at: removed"),  # a test hook
    (["train.population_mode=unroll"], "train.population_mode: removed"),  # CPU-only tuning
    (["modle.depth=3"], "modle: unknown key (did you mean model?)"),
    (["train.steps=ten"], "train.steps: expected int, got str 'ten'"),
    (["train.steps=true"], "train.steps: expected int, got bool True"),
    (["train.steps=10.0"], "train.steps: expected int, got float 10.0"),
    (["train.steps=0"], "train.steps: must be >= 1"),
    (["train.spike_window=2"], "train.spike_window: must be >= 3"),  # the detector's minimum
    (["model.rope=1"], "model.rope: expected bool, got int 1"),
    (["optim.lr=fast"], "optim.lr: expected float"),
    (["optim.lr=.nan"], "optim.lr: expected a finite number"),
    (["model.remat=partial"], "model.remat: expected one of 'none', 'full', 'dots'"),
    (["model.dtype=fp16"], "model.dtype: expected one of"),
    (
      ["optim.schedule=cosin"],
      "optim.schedule: expected one of 'cosine', 'linear', 'constant', got str 'cosin' (did you mean 'cosine'?)",
    ),
    (["train.nonfinite=ignore"], "train.nonfinite"),
    (["data.task=images"], "data.task"),
    (["data.task=text", "data.target=posterior", "data.options.path=/"], "data.target"),
    (["model.mixer=mch"], "model.mixer: unknown mixer 'mch' (did you mean mhc?)"),
    (
      ["model.mixer_options.nn=4"],
      "model.mixer_options.nn: unknown key (did you mean model.mixer_options.n?)",
    ),
    (["model.mixer_options.bogus=1"], "model.mixer_options.bogus: unknown key (known:"),
    (["model.mixer=mhc", "model.mixer_options.n=0"], "model.mixer_options.n: must be >= 1"),
    (["model.mixer=mhc", "model.mixer_options.n=two"], "model.mixer_options.n: expected int"),
    (
      ["model.mixer=mhc", "model.mixer_options.dynamic=yes please"],
      "model.mixer_options.dynamic: expected bool",
    ),
    (
      ["model.mixer=mhc", "model.mixer_options.alpha_init=x"],
      "model.mixer_options.alpha_init: expected float",
    ),
    (
      ["model.mixer=mhc", "model.mixer_options.sinkhorn_iters=0"],
      "model.mixer_options.sinkhorn_iters: must be >= 1",
    ),
    (
      ["model.mixer=mhc", "model.mixer_options.sinkhorn_grad=exact"],
      "model.mixer_options.sinkhorn_grad: expected one of 'unroll', 'implicit'",
    ),
    (
      ["model.mixer=mhc", "model.mixer_options.h_res_init=random"],
      "model.mixer_options.h_res_init",
    ),
    (["model.mixer=mhc", "model.mixer_options.collapse=mean"], "model.mixer_options.collapse"),
    (["model.mixer_options=4"], "model.mixer_options: expected mapping, got int 4"),
    (["model.mixer=mhc_lite", "model.mixer_options.n=7"], "model.mixer_options.n: must be <= 6"),
    (["model.mixer=deepnorm", "model.mixer_options.alpha=x"], "expected float or null, got str"),
    (["data.options.n_symbols=[1, .nan]"], "data.options.n_symbols: expected a finite number"),
    (["model.width=30", "model.heads=2"], "model.rope: needs an even head dim"),
    (["model.attention=flash"], "model.attention: expected one of 'auto', 'xla', 'cudnn'"),
    (["model.attention=cudnn"], "model.attention: 'cudnn' needs model.dtype=bfloat16"),
    (
      ["model.attention=cudnn", "model.dtype=bfloat16", "model.width=36", "model.heads=3"],
      "a head dim that is a multiple of 8, got bfloat16 and 12",
    ),
    (["optim.warmup_steps=-1"], "optim.warmup_steps: must be >= 0"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay: must be >= 0"),
    (
      ["optim.independent_wd=true", "optim.weight_decay=1.5"],
      "optim.weight_decay: with optim.independent_wd",
    ),
    (["optim.b2=1.0"], "optim.b2: must be < 1, got 1.0"),
    (["optim.b1=-0.5"], "optim.b1: must be >= 0, got -0.5"),
    (["optim.clip=-1"], "optim.clip: must be >= 0"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio"),
    (["optim.warmup_steps=300"], "optim.warmup_steps: 300 exceeds train.steps=200"),
    (["mesh.data=0"], "mesh.data: must be >= 1 or -1"),
    (["mesh.fsdp=-1"], "mesh: at most one axis may be -1"),
    (["dist.coordinator=nohostport"], "dist.coordinator: expected 'host:port'"),
    (
      ["dist.num_processes=2", "dist.process_id=2"],
      "dist.process_id: 2 is not below dist.num_processes=2",
    ),
    (["model.depth=4", "model.depth.x=1"], "model.depth: is int 4, not a section"),
    (["model.depth.x=1"], "model.depth: expected int, got dict"),
    (["name=a/b"], "name: must be"),
    (["model=3"], "model: expected a mapping, got int 3"),
    (["noequals"], "expected KEY=VALUE"),
    (["a..b=1"], "malformed dotted key"),
  ],
)
def test_bad_input_names_the_key(overrides, message):
  assert message in _err(load_config, None, overrides)


def test_mixer_options_must_suit_the_mixer():
  accepted = tuple(OPTIONS["residual"].model_fields)
  assert "n" in accepted and "collapse" in accepted
  if "sinkhorn_iters" not in accepted:  # the registry knows what each mixer takes
    assert _err(load_config, None, ["model.mixer_options.sinkhorn_iters=5"]).startswith(
      "model.mixer_options.sinkhorn_iters: not an option of mixer 'residual'"
    )
  for name in OPTIONS:
    if name == "residual":  # one stream only: n=1 is accepted, anything else named
      assert load_config(None, ["model.mixer_options.n=1"])
      assert _err(load_config, None, ["model.mixer_options.n=2"]) == (
        "model.mixer_options.n: the residual mixer has exactly one stream, got 2"
      )
      continue
    for key in OPTIONS[name].model_fields:
      if key == "n":
        assert load_config(None, [f"model.mixer={name}", "model.mixer_options.n=2"])


def test_data_options_must_suit_the_task():
  assert data_option_names("bijection") is not None
  assert (
    _err(load_config, None, ["data.options.n_symbol=4"])
    == "data.options.n_symbol: unknown key (did you mean data.options.n_symbols?)"
  )
  assert load_config(None, ["data.task=hmm", "data.options.n_states=3"]).data.options == {
    "n_states": 3
  }


def test_missing_data_path_names_the_key(tmp_path):
  assert load_config(None, ["data.task=text"]).data.options == {}  # default corpus: stdlib
  assert (
    _err(load_config, None, ["data.task=text", f"data.options.path={tmp_path}/*.zz"])
    == f"data.options.path: {tmp_path}/*.zz matches no files"
  )
  missing = str(tmp_path / "nope.txt")
  assert (
    _err(load_config, None, ["data.task=text", f"data.options.path={missing}"])
    == f"data.options.path: {missing} does not exist"
  )
  assert "data.options.data_dir" in _err(
    load_config, None, ["data.task=tfds", f"data.options.data_dir={missing}"]
  )
  (tmp_path / "ok.txt").write_text("hello")
  c = load_config(None, ["data.task=text", f"data.options.path={tmp_path / 'ok.txt'}"])
  check_paths(c)
  # the pure parts can skip the file system (e.g. reading another machine's run config)
  load_config(None, ["data.task=text", f"data.options.path={missing}"], check_files=False)


def test_missing_file_and_bad_yaml(tmp_path):
  missing = str(tmp_path / "nope.yaml")
  assert _err(load_config, missing) == f"config file {missing}: not found"
  bad = _write(tmp_path, "model:\n  depth: 2\n width: [\n", "bad.yaml")
  msg = _err(load_config, bad)
  assert msg.startswith(f"config file {bad}: invalid YAML at line ")
  dup = _write(tmp_path, "optim:\n  lr: 1.0\n  lr: 2.0\n", "dup.yaml")
  assert _err(load_config, dup) == f"config file {dup}: invalid YAML at line 3: duplicate key 'lr'"
  lst = _write(tmp_path, "- 1\n- 2\n", "list.yaml")
  assert "top level must be a mapping" in _err(load_config, lst)
  assert _err(load_config, str(tmp_path)).endswith("is a directory, expected a YAML file")


def test_bad_keys_in_file(tmp_path):
  p = _write(tmp_path, "model:\n  dept: 3\n")
  assert _err(load_config, p) == "model.dept: unknown key (did you mean model.depth?)"
  p = _write(tmp_path, "optim:\n  lr: -0.1\n", "lr.yaml")
  assert _err(load_config, p) == "optim.lr: must be > 0, got -0.1"


def test_empty_file_and_empty_section(tmp_path):
  assert load_config(_write(tmp_path, "# nothing\n")) == Config()
  assert load_config(_write(tmp_path, "model:\noptim:\n", "e.yaml")) == Config()


# ---------------------------------------------------------------------------- mesh


@pytest.mark.parametrize(
  "sizes,expected",
  [
    ((8, 1, 1), (8, 1, 1)),
    ((2, 4, 1), (2, 4, 1)),
    ((2, 2, 2), (2, 2, 2)),
    ((-1, 2, 1), (4, 2, 1)),
    ((-1, 1, 1), (8, 1, 1)),
    ((2, -1, 2), (2, 2, 2)),
  ],
)
def test_validate_mesh(sizes, expected):
  assert validate_mesh(MeshConfig(*sizes), 8) == expected


def test_validate_mesh_bad():
  assert (
    _err(validate_mesh, MeshConfig(3, 1, 1), 8)
    == "mesh: data*fsdp*tensor = 3 does not match 8 devices"
  )
  assert _err(validate_mesh, MeshConfig(-1, 3, 1), 8).startswith("mesh.data: -1 cannot fill 8")
  assert "at most one axis may be -1" in _err(MeshConfig, -1, -1, 1)
  assert (
    _err(validate_mesh, MeshConfig(4, 2, 1), 8, 12)
    == "data.batch_size: 12 is not divisible by mesh data*fsdp = 8"
  )
  assert validate_mesh(MeshConfig(2, 1, 4), 8, 2) == (2, 1, 4)  # tensor does not split batch


# ---------------------------------------------------------------------------- dist, vocab


def test_resolve_dist_from_env():
  env = {"MHC_COORDINATOR": "10.0.0.2:1234", "MHC_NUM_PROCESSES": "2", "MHC_PROCESS_ID": "1"}
  d = resolve_dist(DistConfig(), env)
  assert d == DistConfig(True, "10.0.0.2:1234", 2, 1)
  # the config wins over the environment
  assert resolve_dist(DistConfig(process_id=0), env).process_id == 0
  assert resolve_dist(DistConfig(), {}) == DistConfig()
  assert (
    _err(resolve_dist, DistConfig(), {"MHC_PROCESS_ID": "x"})
    == "MHC_PROCESS_ID: expected int, got 'x'"
  )
  assert "dist.process_id" in _err(resolve_dist, DistConfig(), {**env, "MHC_PROCESS_ID": "5"})


def test_with_data_vocab():
  c = Config()
  assert with_data_vocab(c, 24).model.vocab == 24
  assert with_data_vocab(c, None).model.vocab == 256
  big = with_overrides(c, ["model.vocab=300"])
  assert with_data_vocab(big, 24) is big
  assert "model.vocab: 300 is smaller" in _err(with_data_vocab, big, 400)


def test_model_config_direct():
  m = ModelConfig(
    depth=2, width=32, heads=2, mixer="hc", mixer_options={"n": 4, "dynamic": True, "alpha_init": 1}
  )
  assert m.mixer_options["alpha_init"] == 1.0 and isinstance(m.mixer_options["alpha_init"], float)
