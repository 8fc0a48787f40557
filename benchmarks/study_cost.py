"""Cost per step of the studies' GPU-sized variants on the device at hand, and the projected
cost of each whole study there (``benchmarks/gpu_check.sh`` runs it on an accelerator).

    python benchmarks/study_cost.py                 # every configs/studies/*.yaml with a GPU variant
    python benchmarks/study_cost.py --steps 10 configs/studies/lr_proxies.yaml   # one, quicker

Each study file's header names its GPU-sized variant as an ``mhc-jax sweep ... --out
sweeps_out/<name>_gpu ...`` command (the sweep file and its ``--set`` overrides); that sweep is
expanded and validated, its costliest run (most training FLOPs per step) is trained for
``--steps`` steps by the project's trainer into a scratch directory (checkpoints, evaluation
and per-layer diagnostics off, which the real study turns on), and the median ``step_time_s``
after ``--warmup`` steps is its cost per step. The projected study cost scales that step by
each run's FLOPs per step times its steps, summed over runs: an upper bound where populations
or ``--parallel`` train runs at once. The short run keeps the study's learning-rate warm-up
where it fits and cuts it to the short run's length where it does not (the step's cost does not
depend on it).

``--set KEY=VALUE ...`` overrides the measured run's config (after the study's): ``--set
model.width=16 model.depth=1 ...`` runs every study's code path at toy size on a CPU, which is how
``tests/test_study_cost.py`` and ``benchmarks/gpu_check.sh --toy`` keep this script working; the
projection then scales the toy step, so its hours mean nothing. ``--json PATH`` writes the
figures (one record per study) as well.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def gpu_command(study: Path) -> list[str] | None:
  """The header's ``mhc-jax sweep ... _gpu ...`` or ``... --variant gpu ...`` command, split;
  None without one."""
  for line in study.read_text().splitlines():
    if not line.startswith("#"):
      break
    text = line[1:].strip()
    if text.startswith("mhc-jax sweep ") and ("_gpu" in text or "--variant gpu" in text):
      return shlex.split(text.split(" #")[0])
  return None


def gpu_sweep(study: Path):
  """(sweep file, --set overrides, --variant or None) of a study's GPU-sized variant."""
  argv = gpu_command(study)
  if argv is None:
    return None
  path, sets, variant, i = None, [], None, 2
  while i < len(argv):
    a = argv[i]
    if a == "--variant":
      variant = argv[i + 1]
      i += 2
      continue
    if a == "--set":
      i += 1
      while i < len(argv) and not argv[i].startswith("--"):
        sets.append(argv[i])
        i += 1
      continue
    if a == "--out":
      i += 2
      continue
    if not a.startswith("--") and path is None:
      path = ROOT / a
    i += 1
  return path, sets, variant


def short_overrides(cfg, steps: int) -> dict:
  """Overrides that make ``cfg`` a ``steps``-step timing run: no checkpoints, evaluation or
  per-layer diagnostics, a log line every step, and the lr warm-up cut to fit (a study's warm-up
  is usually longer than the few steps timed, which the config check rejects)."""
  return {
    "train.steps": steps,
    "train.ckpt_every": 0,
    "train.eval_every": 0,
    "train.diag_every": 0,
    "train.log_every": 1,
    "optim.warmup_steps": min(cfg.optim.warmup_steps, steps),
  }


def measure(study: Path, steps: int, warmup: int, sets: list[str]) -> dict | None:
  """Time one study's costliest GPU-variant run; the figures as a dict (None: no GPU variant)."""
  from mhc_jax.logs import read_jsonl
  from mhc_jax.sweep import grid
  from mhc_jax.train.config import apply_overrides, from_dict, to_dict, with_data_vocab
  from mhc_jax.train.loop import prepare, train

  found = gpu_sweep(study)
  if found is None:
    return None
  path, study_sets, variant = found
  sweep = grid.read_sweep(path, study_sets, variant=variant)
  vocab = None  # the data's, the same for every run of a study; known once one is prepared

  def flops_per_step(c):
    return grid.train_flops(with_data_vocab(c, vocab)) / c.train.steps

  big = max(sweep.runs, key=lambda r: flops_per_step(r.cfg))
  d = apply_overrides(to_dict(big.cfg), short_overrides(big.cfg, steps + warmup))
  if sets:
    d = apply_overrides(d, sets)
  setup = prepare(from_dict(d))
  cfg, vocab = setup.cfg, setup.cfg.model.vocab
  per_step = {r.name: flops_per_step(r.cfg) for r in sweep.runs}
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    train(setup, Path(tmp) / "run", progress=False)
    recs = read_jsonl(Path(tmp) / "run" / "metrics.jsonl")
  times = [r["step_time_s"] for r in recs if "step_time_s" in r and r["step"] >= warmup]
  step_s = statistics.median(times) if times else float("nan")
  total = sum(
    step_s * per_step[r.name] / per_step[big.name] * r.cfg.train.steps for r in sweep.runs
  )
  return {
    "study": study.name,
    "sweep": path.name,
    "sets": study_sets,
    "measured_with": sets,
    "costliest_run": big.name,
    "parameters": grid.param_counts(cfg.model)["total"],
    "tflop_per_step": per_step[big.name] / 1e12,
    "step_s": step_s,
    "model_tflop_per_s": per_step[big.name] / step_s / 1e12,
    "timed_steps": len(times),
    "wall_s": time.perf_counter() - t0,
    "runs": len(sweep.runs),
    "device_hours": total / 3600,
  }


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("studies", nargs="*", help="study files (default: configs/studies/*.yaml)")
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--warmup", type=int, default=5)
  ap.add_argument(
    "--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for the measured run"
  )
  ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
  args = ap.parse_args(argv)

  import jax

  files = [Path(s) for s in args.studies] or sorted((ROOT / "configs" / "studies").glob("*.yaml"))
  dev = jax.devices()[0]
  print(
    f"jax {jax.__version__} on {dev.platform} ({dev.device_kind}), {jax.device_count()} device(s)"
  )
  out = {"jax": jax.__version__, "device": dev.device_kind, "studies": []}
  failed, seen = 0, set()
  for study in files:
    found = gpu_sweep(study)
    key = None if found is None else (str(found[0]), tuple(found[1]), found[2])
    if key in seen:  # two headers naming one GPU sweep (a study and its _gpu file): once
      print(f"{study.name}: the same GPU variant as a study above", flush=True)
      continue
    seen.add(key)
    try:
      r = measure(study, args.steps, args.warmup, args.set)
    except Exception as e:  # one study that cannot run: say so, measure the others
      failed += 1
      print(f"{study.name}: failed: {type(e).__name__}: {e}", flush=True)
      out["studies"].append({"study": study.name, "error": f"{type(e).__name__}: {e}"})
      continue
    if r is None:
      continue
    out["studies"].append(r)
    print(
      f"{r['study']} -> {r['sweep']} {' '.join(r['sets'])}\n"
      f"  costliest run {r['costliest_run']}: {r['parameters']:,} parameters, "
      f"{r['tflop_per_step']:.3g} TFLOP/step, median step {r['step_s']:.3f} s "
      f"({r['model_tflop_per_s']:.1f} TFLOP/s model) over {r['timed_steps']} steps "
      f"(measured in {r['wall_s']:.0f} s with compilation)\n"
      f"  projected study: {r['runs']} runs, {r['device_hours']:.3g} device-hours "
      "(one run at a time; populations and --parallel divide it)",
      flush=True,
    )
    if args.json:  # after every study: a run stopped by a time limit keeps what it measured
      Path(args.json).write_text(json.dumps(out, indent=1))
  if args.json:
    Path(args.json).write_text(json.dumps(out, indent=1))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
