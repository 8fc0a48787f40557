"""benchmarks/study_cost.py (what benchmarks/gpu_check.sh runs on an accelerator), at toy size
on the CPU: it finds each study's GPU-sized variant in the header, trains the costliest run for
a few steps and projects the study's cost."""

import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import study_cost  # noqa: E402


def test_every_study_names_a_gpu_variant_that_validates():
  from mhc_jax.sweep import grid

  studies = [p for p in sorted((ROOT / "configs" / "studies").glob("*.yaml"))]
  found = {p.name: study_cost.gpu_sweep(p) for p in studies}
  for name in (
    *("bayes_depth.yaml", "lr_proxies.yaml", "hc_mhc_scale.yaml", "bayes_thesis.yaml"),
    *("lr_curves.yaml", "phase_map.yaml"),
  ):
    assert found[name] is not None, name
    path, sets, variant = found[name]
    sweep = grid.read_sweep(path, sets, variant=variant)
    assert max(r.cfg.model.width for r in sweep.runs) >= 256, name  # GPU-sized, not the CPU one


def test_toy_study_cost(tmp_path, capsys):
  sweep = tmp_path / "toy.yaml"
  sweep.write_text(
    yaml.safe_dump(
      {
        "name": "toy",
        "base": str(ROOT / "configs" / "debug.yaml"),
        "axes": {"model.width": [8, 16]},
      }
    )
  )
  study = tmp_path / "study.yaml"
  study.write_text(
    f"# toy study\n#   mhc-jax sweep {sweep} --out sweeps_out/toy_gpu --set model.depth=2 "
    "optim.lr=1e-3 --dry-run\nname: x\n"
  )
  assert study_cost.gpu_sweep(study) == (sweep, ["model.depth=2", "optim.lr=1e-3"], None)
  assert study_cost.main([str(study), "--steps", "3", "--warmup", "1"]) == 0
  out = capsys.readouterr().out
  assert "costliest run width=16" in out, out
  step = float(re.search(r"median step ([0-9.]+) s", out).group(1))
  assert step > 0 and "over 3 steps" in out
  hours = float(re.search(r"projected study: 2 runs, ([0-9.e+-]+) device-hours", out).group(1))
  assert 0 < hours < 5 * step * 2 / 3600 + 1e-3  # two runs of 5 steps, the smaller one cheaper


def _toy_study(tmp_path, sets: str) -> Path:
  sweep = tmp_path / "toy.yaml"
  sweep.write_text(
    yaml.safe_dump(
      {"name": "toy", "base": str(ROOT / "configs" / "debug.yaml"), "axes": {"model.width": [8]}}
    )
  )
  study = tmp_path / "study.yaml"
  study.write_text(
    f"# toy\n#   mhc-jax sweep {sweep} --out sweeps_out/toy_gpu --set {sets}\nname: x\n"
  )
  return study


def test_study_cost_shortens_a_study_whose_warmup_is_longer_than_the_measured_run(tmp_path):
  """A study's lr warm-up (here 100 steps) outlasts the few steps study_cost trains: the short
  run's warm-up is cut to fit (it was rejected: optim.warmup_steps exceeds train.steps)."""
  study = _toy_study(tmp_path, "train.steps=200 optim.warmup_steps=100")
  assert study_cost.main([str(study), "--steps", "2", "--warmup", "1"]) == 0
