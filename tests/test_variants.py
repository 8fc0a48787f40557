"""Sweep files with variants (mhc_jax.sweep.grid): one study file, CPU- and GPU-sized."""

from pathlib import Path

import pytest
import yaml

from mhc_jax.sweep import grid
from mhc_jax.train.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "configs" / "studies" / "hc_mhc_scale.yaml"


def _file(tmp_path, **variants) -> Path:
  p = tmp_path / "s.yaml"
  body = {
    "name": "s",
    "base": str(ROOT / "configs" / "debug.yaml"),
    "set": {"train.steps": 4},
    "axes": {"model.depth": [1]},
    "variants": variants,
  }
  p.write_text(yaml.safe_dump(body, sort_keys=False))
  return p


def test_the_first_variant_is_the_default_and_others_merge_over_the_file(tmp_path):
  p = _file(
    tmp_path,
    small={},
    big={"set": {"model.width": 32}, "axes": {"model.depth": [2, 3], "optim.lr": [1e-3]}},
  )
  small = grid.read_sweep(p)
  assert (small.name, small.variant, [r.name for r in small.runs]) == ("s", "small", ["depth=1"])
  big = grid.read_sweep(p, variant="big")
  assert big.name == "s_big" and big.variant == "big"  # its own sweep directory
  assert [r.name for r in big.runs] == ["depth=2,lr=0.001", "depth=3,lr=0.001"]
  assert all(r.cfg.model.width == 32 and r.cfg.train.steps == 4 for r in big.runs)
  assert grid.read_sweep(p, variant="small").runs[0].cfg == small.runs[0].cfg


def test_bad_variants_name_what_is_wrong(tmp_path):
  p = _file(tmp_path, small={}, big={"set": {"model.width": 32}})
  with pytest.raises(ConfigError, match=r"^variant 'huge': not a variant .* small, big"):
    grid.read_sweep(p, variant="huge")
  with pytest.raises(ConfigError, match=r"^variants.big.sett: unknown sweep key"):
    grid.read_sweep(_file(tmp_path, big={"sett": {}}), variant="big")
  with pytest.raises(ConfigError, match=r"^set.model.heads: value 3"):
    grid.read_sweep(_file(tmp_path, big={"set": {"model.heads": 3}}))
  plain = tmp_path / "plain.yaml"
  plain.write_text(yaml.safe_dump({"name": "p", "axes": {"model.depth": [1]}}))
  assert grid.read_sweep(plain).variant is None
  with pytest.raises(ConfigError, match=r"^variant 'gpu': this sweep file has no variants"):
    grid.read_sweep(plain, variant="gpu")


def test_hc_mhc_scale_is_one_file_with_a_cpu_and_a_gpu_variant():
  assert not (STUDY.parent / "hc_mhc_scale_gpu.yaml").exists()
  cpu, gpu = grid.read_sweep(STUDY), grid.read_sweep(STUDY, variant="gpu")
  assert (cpu.name, gpu.name) == ("hc_mhc_scale", "hc_mhc_scale_gpu")
  assert len(cpu.runs) == len(gpu.runs) == 75
  assert max(r.cfg.model.width for r in cpu.runs) == 64
  assert {r.cfg.model.width for r in gpu.runs} == {512, 1024}
  assert {r.cfg.model.dtype for r in gpu.runs} == {"bfloat16"}  # configs/gpu.yaml's settings
  # n is written out in every multi-stream arm
  for r in cpu.runs + gpu.runs:
    if r.cfg.model.mixer != "residual":
      assert r.cfg.model.mixer_options["n"] == 4, r.name
