"""Parallel sweep vs sequential sweep: wall time of the same 4-run sweep, one run at a time
(``mhc-jax sweep FILE``) and with ``--parallel 2`` (each run a submitit LocalExecutor job), and a
check that every run logged the same numbers both ways.

    .venv/bin/python benchmarks/parallel_sweep_bench.py            # 4 runs, --parallel 2
    .venv/bin/python benchmarks/parallel_sweep_bench.py --steps 100 --repeat 2
    .venv/bin/python benchmarks/parallel_sweep_bench.py --base configs/debug.yaml --steps 3000 \
        --set train.log_every=10 train.diag_every=0 mesh.data=1     # a tinier model

The sweep: configs/quickstart.yaml (depth 2, width 32, bijection V=8) with
``model.mixer`` in residual, hc, mhc, mhc_lite, ``--steps`` steps each (default 2000), on the
CPU (1 device; ``JAX_PLATFORMS=cpu``), no persistent compilation cache. Each sweep runs in its
own fresh directory, so both pay the same compiles.

What to expect on 2 cores: a run is XLA compilation (~15 s here, which already keeps ~1.5
cores busy) and then steps (~10 ms each, one core: Python dispatch of small ops). A
sequential sweep leaves the second core idle while stepping, which two jobs fill; while
compiling there is little to gain, and every job pays its own Python + JAX start (~3 s of
CPU). So short, compile-bound runs gain little (``--steps 100``: ~0.9-1.0) and the gain grows
with the steps (2000 steps: ~0.6-0.75, depending on the load).

The 1-minute load average is printed before and after each sweep: on a machine shared with
other work the wall times move with it, so compare ratios measured at a similar load
(``--repeat N`` alternates the two; the best of each is compared). Prints the command of each
sweep, both wall times and the ratio parallel / sequential, and checks that every run's
``metrics.jsonl`` is the same in both sweeps (timings aside).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
MIXERS = ["residual", "hc", "mhc", "mhc_lite"]
TIMING = ("tokens_per_s", "step_time_s")


def load() -> str:
  return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run(cmd: list[str], env: dict) -> float:
  print("$ " + " ".join(cmd), flush=True)
  print(f"  load average before: {load()}", flush=True)
  t0 = time.perf_counter()
  r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
  wall = time.perf_counter() - t0
  print(f"  load average after:  {load()}", flush=True)
  if r.returncode != 0:
    sys.exit(
      f"error: the sweep failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    )
  print(f"  wall {wall:.1f}s", flush=True)
  return wall


def records(path: Path) -> list[dict]:
  return [
    {k: v for k, v in json.loads(line).items() if k not in TIMING}
    for line in path.read_text().splitlines()
    if line.strip()
  ]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--parallel", type=int, default=2)
  ap.add_argument("--steps", type=int, default=2000)
  ap.add_argument("--repeat", type=int, default=1, help="measure both sweeps this many times")
  ap.add_argument("--keep", help="keep the sweep directories here (default: a temp dir)")
  ap.add_argument("--base", default="configs/quickstart.yaml", help="the runs' base config")
  ap.add_argument("--set", nargs="*", default=[], help="further sweep settings KEY=VALUE")
  args = ap.parse_args()
  if args.parallel < 1 or args.steps < 1 or args.repeat < 1:
    sys.exit("error: --parallel, --steps and --repeat must be positive")
  root = Path(args.keep or tempfile.mkdtemp(prefix="parallel_sweep_bench_"))
  root.mkdir(parents=True, exist_ok=True)
  sweep = root / "bench.yaml"
  sweep.write_text(
    yaml.safe_dump(
      {
        "name": "parallel_bench",
        "base": str(REPO / args.base),
        "set": {
          "model.mixer_options": {},
          "train.steps": args.steps,
          **{k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.set)},
        },
        "axes": {"model.mixer": MIXERS},
      },
      sort_keys=False,
    )
  )
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  for k in ("JAX_COMPILATION_CACHE_DIR", "XLA_FLAGS"):
    env.pop(k, None)
  mhc = str(REPO / ".venv" / "bin" / "mhc-jax")
  if not Path(mhc).exists():
    mhc = shutil.which("mhc-jax") or mhc
  print(
    f"{os.cpu_count()} CPUs; {len(MIXERS)} runs of {args.steps} steps",
    flush=True,
  )
  seq_t, par_t, differ = [], [], set()
  for i in range(args.repeat):
    seq_dir, par_dir = root / f"sequential{i}", root / f"parallel{i}"
    for d in (seq_dir, par_dir):
      shutil.rmtree(d, ignore_errors=True)
    seq_t.append(run([mhc, "sweep", str(sweep), "--out", str(seq_dir), "--quiet"], env))
    par_t.append(
      run(
        [
          mhc,
          "sweep",
          str(sweep),
          "--out",
          str(par_dir),
          "--quiet",
          "--parallel",
          str(args.parallel),
        ],
        env,
      )
    )
    for name in (f"mixer={m}" for m in MIXERS):
      a, b = (
        records(seq_dir / "runs" / name / "metrics.jsonl"),
        records(par_dir / "runs" / name / "metrics.jsonl"),
      )
      if a != b:
        differ.add(name)
    print(f"  ratio this round: {par_t[-1] / seq_t[-1]:.2f}", flush=True)
  seq, par = min(seq_t), min(par_t)
  same = (
    "every run's metrics identical"
    if not differ
    else f"runs whose metrics differ from the sequential sweep: {', '.join(sorted(differ))}"
  )
  print(
    f"\nsequential: {seq:.1f}s   --parallel {args.parallel}: {par:.1f}s   "
    f"ratio {par / seq:.2f} (best of {args.repeat}; {same})"
  )
  if differ:
    sys.exit(1)
  if not args.keep:
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main()
