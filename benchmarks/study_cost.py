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
or ``--parallel`` train runs at once.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mhc_jax import hostmem

ROOT = Path(__file__).resolve().parents[1]


def gpu_command(study: Path) -> list[str] | None:
  """The header's ``mhc-jax sweep ... _gpu ...`` command, split; None without one."""
  for line in study.read_text().splitlines():
    if not line.startswith("#"):
      break
    text = line[1:].strip()
    if text.startswith("mhc-jax sweep ") and "_gpu" in text:
      return shlex.split(text.split(" #")[0])
  return None


def gpu_sweep(study: Path):
  """(sweep file, --set overrides) of a study's GPU-sized variant."""
  argv = gpu_command(study)
  if argv is None:
    return None
  path, sets, i = None, [], 2
  while i < len(argv):
    a = argv[i]
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
  return path, sets


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("studies", nargs="*", help="study files (default: configs/studies/*.yaml)")
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--warmup", type=int, default=5)
  args = ap.parse_args(argv)

  import jax

  from mhc_jax.logs import read_jsonl
  from mhc_jax.sweep import grid
  from mhc_jax.train.config import apply_overrides, from_dict, to_dict, with_data_vocab
  from mhc_jax.train.loop import prepare, train

  files = [Path(s) for s in args.studies] or sorted((ROOT / "configs" / "studies").glob("*.yaml"))
  dev = jax.devices()[0]
  print(
    f"jax {jax.__version__} on {dev.platform} ({dev.device_kind}), {jax.device_count()} device(s)"
  )
  for study in files:
    found = gpu_sweep(study)
    if found is None:
      continue
    path, sets = found
    sweep = grid.load_sweep(path, sets)
    vocab = None  # the data's, the same for every run of a study; known once one is prepared

    def flops_per_step(c):
      return grid.train_flops(with_data_vocab(c, vocab)) / c.train.steps

    big = max(sweep.runs, key=lambda r: flops_per_step(r.cfg))
    short = {
      "train.steps": args.steps + args.warmup,
      "train.ckpt_every": 0,
      "train.eval_every": 0,
      "train.diag_every": 0,
      "train.log_every": 1,
    }
    setup = prepare(from_dict(apply_overrides(to_dict(big.cfg), short)))
    cfg, vocab = setup.cfg, setup.cfg.model.vocab
    per_step = {r.name: flops_per_step(r.cfg) for r in sweep.runs}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
      train(setup, Path(tmp) / "run", progress=False)
      recs = read_jsonl(Path(tmp) / "run" / "metrics.jsonl")
    times = [r["step_time_s"] for r in recs if "step_time_s" in r and r["step"] >= args.warmup]
    step_s = statistics.median(times) if times else float("nan")
    total = sum(
      step_s * per_step[r.name] / per_step[big.name] * r.cfg.train.steps for r in sweep.runs
    )
    print(
      f"{study.name} -> {path.name} {' '.join(sets)}\n"
      f"  costliest run {big.name}: {grid.param_counts(cfg.model)['total']:,} parameters, "
      f"{per_step[big.name] / 1e12:.3g} TFLOP/step, median step {step_s:.3f} s "
      f"({per_step[big.name] / step_s / 1e12:.1f} TFLOP/s model) over {len(times)} steps "
      f"(measured in {time.perf_counter() - t0:.0f} s with compilation)\n"
      f"  projected study: {len(sweep.runs)} runs, {total / 3600:.3g} device-hours "
      "(one run at a time; populations and --parallel divide it)",
      flush=True,
    )
  return 0


if __name__ == "__main__":
  hostmem.ensure()  # malloc with huge pages, as mhc-jax runs (mhc_jax/hostmem.py)
  sys.exit(main())
