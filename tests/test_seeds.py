"""Seeds as a sweep axis (mhc_jax.sweep.grid ``seeds``): expansion, populations, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mhc_jax import cli
from mhc_jax.sweep import grid
from mhc_jax.train.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "configs" / "debug.yaml")


def _sweep(tmp_path: Path, **kw) -> Path:
  data = {
    "name": "s",
    "base": DEBUG,
    "set": {"model.mixer_options": {}},
    "axes": {"model.mixer": ["residual", "mhc"], "model.depth": [1, 2]},
  }
  data.update(kw)
  path = tmp_path / "sweep.yaml"
  path.write_text(yaml.safe_dump(data, sort_keys=False))
  return path


def test_seeds_repeat_every_grid_point_as_one_population(tmp_path):
  sw = grid.read_sweep(_sweep(tmp_path, seeds=3))
  assert sw.axes["train.seed"] == [0, 1, 2] and list(sw.axes)[-1] == "train.seed"
  assert "train.seed" in sw.population
  assert len(sw.runs) == 12
  assert sw.runs[0].name == "mixer=residual,depth=1,seed=0"
  assert [r.cfg.train.seed for r in sw.runs[:3]] == [0, 1, 2]
  groups = grid.population_groups(sw)
  assert len(groups) == 4  # one per (mixer, depth): only the seed differs inside a group
  for g in groups:
    assert [r.cfg.train.seed for r in g] == [0, 1, 2]
    assert len({(r.cfg.model.mixer, r.cfg.model.depth) for r in g}) == 1


def test_seeds_start_at_the_base_seed_or_are_listed(tmp_path):
  sw = grid.read_sweep(_sweep(tmp_path, seeds=2, set={"model.mixer_options": {}, "train.seed": 7}))
  assert sw.axes["train.seed"] == [7, 8]
  sw = grid.read_sweep(_sweep(tmp_path, seeds=[3, 11]))
  assert [r.cfg.train.seed for r in sw.runs[:2]] == [3, 11]


def test_seeds_join_an_lr_population(tmp_path):
  sw = grid.read_sweep(
    _sweep(
      tmp_path,
      axes={"model.mixer": ["residual", "mhc"], "optim.lr": [1e-3, 1e-2]},
      population=["optim.lr"],
      seeds=2,
    )
  )
  assert sw.population == ("optim.lr", "train.seed")
  groups = grid.population_groups(sw)
  assert [len(g) for g in groups] == [4, 4]
  assert {(r.cfg.optim.lr, r.cfg.train.seed) for r in groups[1]} == {
    (1e-3, 0),
    (1e-3, 1),
    (1e-2, 0),
    (1e-2, 1),
  }


@pytest.mark.parametrize(
  "kw, where",
  [
    ({"seeds": 0}, "seeds: expected a positive number"),
    ({"seeds": "three"}, "seeds: expected a number of seeds or a list"),
    ({"seeds": [1, 1]}, "seeds: repeated seeds"),
    ({"seeds": [0, -1]}, "seeds: expected a number of seeds or a list"),
    ({"seeds": True}, "seeds: expected a number of seeds or a list"),
    (
      {"seeds": 2, "axes": {"model.mixer": ["mhc"], "train.seed": [0, 1]}},
      "seeds: this sweep already has",
    ),
  ],
)
def test_bad_seeds_name_the_key(tmp_path, kw, where):
  with pytest.raises(ConfigError) as e:
    grid.read_sweep(_sweep(tmp_path, **kw))
  assert where in str(e.value)


def test_bad_seeds_exit_2_and_write_nothing(tmp_path, capsys):
  out = tmp_path / "out"
  assert cli.main(["sweep", str(_sweep(tmp_path, seeds=-2)), "--out", str(out)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: seeds:")
  assert not out.exists()
