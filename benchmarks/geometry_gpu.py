"""The engine of ``benchmarks/geometry_gpu.sh`` (its header says what a researcher gets and what
it costs): the formation study (configs/studies/geometry_formation.yaml) for residual, hc and mhc
(n = 4 streams), 3 seeds each trained as one vmapped population per arm, to as many steps as a
time budget holds, then the checkpoint series (``mhc-jax eval --series``'s rows) of every run.

    python benchmarks/geometry_gpu.py --out DIR --work SCRATCH [--toy] [--budget-s S] [--steps N]

All in this one process (one compile of each arm's step, reused when it resumes):

  1. measure: each arm's sweep (its own generated sweep file: the study's ``base`` and ``set``,
     the arm's mixer, ``seeds: 3``) trains from step 0 until every seed holds the checkpoint
     at ``measure[1]`` (150), then this process sends itself SIGTERM, the trainer's own stop (a
     checkpoint at the step it is on). The step time is the wall time between the checkpoints
     at ``measure[0]`` and ``measure[1]`` over the steps between them (checkpoints included);
     then the series of three rows of the arm, timed: a run's fixed cost and one row's.
  2. size: :func:`choose_steps`, the most steps (a multiple of 50, at most 2500) whose
     training and series fit what is left of ``--budget-s``.
  3. train: each arm's sweep again, resumed from its newest checkpoint, stopped the same way at
     that step (the sweep file keeps the study's 2500 steps and its 2000-step warm-up, so a run
     stopped at step N is the study's run up to N).
  4. series: every run's rows at 0 (its initialisation) and the study's series steps it reached
     (and its last checkpoint), as far as the budget goes; each run's geometry_series.csv, the
     combined ``runs.csv`` (docs/studies/geometry_formation/analysis.py's format), that analysis's
     decision.csv and formation.png, and ``geometry_gpu.json``: what was measured, chosen and
     reached. Checkpoints stay in ``--work`` (the shell script removes it).

``--toy``: the same steps on the CPU at toy size (:data:`TOY`), for tests/test_geometry_gpu.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "configs" / "studies" / "geometry_formation.yaml"
ANALYSIS = ROOT / "docs" / "studies" / "geometry_formation" / "analysis.py"
SERIES = (100, 200, 300, 400, 500, 750, 1000, 1500, 2000, 2500)  # analysis.STEPS (a test checks)
ARMS = {
  "residual": {"model.mixer": "residual"},
  "hc": {"model.mixer": "hc", "model.mixer_options.n": 4},
  "mhc": {"model.mixer": "mhc", "model.mixer_options.n": 4},
}
SEEDS = 3
RESUME_S = 10.0  # re-entering an arm's sweep to resume it (read, prepare, restore; step compiled)
FINISH_S = 20.0  # copying the logs, runs.csv, the analysis's decision and figure
MARGIN = 0.05  # of the budget, kept free
KEPT = ("config.yaml", "metrics.jsonl", "events.jsonl", "summary.json", "geometry_series.csv")


@dataclasses.dataclass(frozen=True)
class Scale:
  every: int  # checkpoint interval (train.ckpt_every)
  cap: int  # at most this many steps (the study's train.steps)
  series: tuple  # the series steps (besides 0)
  measure: tuple  # (first, last): the step time is taken between these checkpoints
  batches: int  # validation batches of the series (the study's 2: 512 sequences)
  set: dict  # over the study's set


REAL = Scale(50, 2500, SERIES, (50, 150), 2, {})
TOY = Scale(  # the Jacobian sweep's cost grows with positions^2 x values: 4 pairs of 5 symbols
  every=5,
  cap=30,
  series=(10, 20, 30),
  measure=(5, 10),
  batches=1,
  set={
    "model.width": 16,
    "model.heads": 2,
    "model.depth": 1,
    "data.seq_len": 9,
    "data.batch_size": 8,  # 8: the tests' 8 CPU devices
    "data.eval_batches": 1,
    "data.options.n_symbols": 5,
    "data.options.n_pairs": 4,
    "optim.warmup_steps": 10,
    "train.steps": 30,
    "train.ckpt_every": 5,
  },
)


# ------------------------------------------------------------------------------------ sizing
@dataclasses.dataclass
class ArmCost:
  """What one arm's rest costs, as measured: ``step_s`` a step of its population (every seed,
  checkpoints included), ``reached`` the steps it has trained, ``eval_run_s`` opening a run for
  its series, ``eval_row_s`` one row, ``rows_done`` rows already written (over its seeds)."""

  step_s: float
  reached: int = 0
  eval_run_s: float = 0.0
  eval_row_s: float = 0.0
  rows_done: int = 0


def series_steps(n: int, series=SERIES) -> list[int]:
  """The steps a run trained to ``n`` is read at: 0, the series steps up to ``n``, and ``n``."""
  return sorted({0, *(s for s in series if s <= n), n})


def train_cost(n: int, a: ArmCost, resume_s=RESUME_S) -> float:
  """Seconds to train arm ``a`` on from the step it reached to step ``n``."""
  return resume_s + (n - a.reached) * a.step_s if n > a.reached else 0.0


def eval_cost(n: int, a: ArmCost, *, seeds: int = SEEDS, series=SERIES) -> float:
  """Seconds to read the series of arm ``a``'s runs at :func:`series_steps` of ``n``."""
  rows = max(seeds * len(series_steps(n, series)) - a.rows_done, 0)
  return seeds * a.eval_run_s + rows * a.eval_row_s


def cost(n: int, arms: dict, *, seeds: int = SEEDS, series=SERIES, resume_s=RESUME_S) -> float:
  """Seconds to train every arm on to step ``n`` and read every run's series (``arms``: name
  -> :class:`ArmCost`)."""
  return sum(
    train_cost(n, a, resume_s) + eval_cost(n, a, seeds=seeds, series=series) for a in arms.values()
  )


def choose_steps(
  arms: dict, budget_s: float, *, seeds=SEEDS, every=50, cap=2500, series=SERIES, resume_s=RESUME_S
) -> int:
  """The most steps, a multiple of ``every`` from the first series step up to ``cap``, whose
  :func:`cost` fits ``budget_s``; ValueError where not even the first series step fits."""
  first = math.ceil(series[0] / every) * every
  cands = range(first, cap + 1, every)
  fit = [
    n for n in cands if cost(n, arms, seeds=seeds, series=series, resume_s=resume_s) <= budget_s
  ]
  if not fit:
    need = cost(first, arms, seeds=seeds, series=series, resume_s=resume_s)
    raise ValueError(
      f"a budget of {budget_s:.0f} s cannot fit the first checkpoint of the series (step {first}):"
      f" it needs {need:.0f} s"
    )
  return max(fit)


# ------------------------------------------------------------------------------------ training
def sweep_spec(arm: str, scale: Scale) -> dict:
  """The arm's sweep file: the study's base and set, the arm's mixer, the seeds as a population."""
  import yaml

  study = yaml.safe_load(STUDY.read_text())
  return {
    "name": f"geometry_gpu_{arm}",
    "base": study["base"],
    "set": {**study["set"], **ARMS[arm], **scale.set},
    "seeds": SEEDS,
  }


class Stopper(threading.Thread):
  """Sends this process SIGTERM (on which the trainer saves a checkpoint at its step and stops)
  once every run in ``dirs`` holds a checkpoint at ``step`` or later (None: never), or at
  ``deadline`` (time.monotonic), again each second until :meth:`finish`; notes when each
  checkpoint step was first held by every run (``seen``)."""

  def __init__(self, dirs, step, deadline):
    super().__init__(daemon=True)
    self.dirs, self.step, self.deadline = dirs, step, deadline
    self.seen: dict[int, float] = {}
    self.fired = ""
    self._done = threading.Event()

  def run(self):
    from mhc_jax import rundir

    last = 0.0
    while not self._done.wait(0.05):
      now = time.monotonic()
      held = set.intersection(*(rundir.checkpoint_steps(d) for d in self.dirs))
      for s in held - set(self.seen):
        self.seen[s] = now
      if not self.fired and self.step is not None and held and max(held) >= self.step:
        self.fired = "step"
      elif not self.fired and now >= self.deadline:
        self.fired = "deadline"
      if self.fired and now - last >= 1.0:
        last = _SENT[0] = now
        os.kill(os.getpid(), signal.SIGTERM)

  def finish(self):
    self._done.set()
    self.join()


_SENT = [-math.inf]  # when this process last sent itself SIGTERM (time.monotonic)


def _on_sigterm(signum, frame):
  """Outside the training loop: a SIGTERM of ours is late (ignored); anyone else's stops us."""
  if time.monotonic() - _SENT[0] > 5.0:
    raise SystemExit(143)


def train_arm(sweep_file: Path, sweep_dir: Path, names, step, deadline) -> Stopper:
  """``mhc-jax sweep`` of one arm, here, stopped at ``step`` (or ``deadline``)."""
  from mhc_jax import cli

  stopper = Stopper([sweep_dir / "runs" / n for n in names], step, deadline)
  stopper.start()
  try:
    rc = cli.main(["sweep", str(sweep_file), "--out", str(sweep_dir), "--quiet"])
  except Exception as e:  # noqa: BLE001 - the report after a finished sweep is optional here
    rc = f"{type(e).__name__}: {e}"
  finally:
    stopper.finish()
  stopper.rc = rc
  return stopper


def step_time(stopper: Stopper, first: int, last: int, run_dirs) -> float:
  """A population step's seconds: between the checkpoints at ``first`` and ``last`` when both
  were seen, else the median logged step time (checkpoints not included), else inf."""
  if first in stopper.seen and last in stopper.seen:
    return (stopper.seen[last] - stopper.seen[first]) / (last - first)
  import statistics

  from mhc_jax import logs

  times = []
  for d in run_dirs:
    p = d / "metrics.jsonl"
    recs = logs.read_jsonl(p) if p.exists() else []
    times += [r["step_time_s"] for r in recs[2:] if "step_time_s" in r]
  return statistics.median(times) if times else math.inf


# ------------------------------------------------------------------------------------ the series
def series_rows(run: Path, steps, batches: int) -> tuple[list, float]:
  """(``mhc-jax eval --run RUN --series --steps ...``'s rows, seconds)."""
  from mhc_jax import evaluate

  t = time.monotonic()
  rows = evaluate.evaluate_series(run, batches, list(steps))
  return [{k: v for k, v in r.items() if k != "frame_dist"} for r in rows], time.monotonic() - t


def write_series(run: Path, rows: dict) -> None:
  """The run's geometry_series.csv, one row per step read so far (``frame_dist`` left out: it
  is measured against the last row of each call)."""
  import pandas as pd

  from mhc_jax import evaluate

  pd.DataFrame([rows[s] for s in sorted(rows)]).to_csv(run / evaluate.SERIES_CSV, index=False)


# ------------------------------------------------------------------------------------ the run
class Driver:
  def __init__(self, args, scale: Scale):
    self.args, self.scale = args, scale
    self.out, self.work = Path(args.out), Path(args.work)
    self.t0 = time.monotonic()
    self.end = self.t0 + args.budget_s
    self.rows: dict = {}  # (arm, seed) -> {step: row}
    self.names: dict = {}  # arm -> its run names
    self.report: dict = {"budget_s": args.budget_s, "toy": args.toy, "arms": {}, "runs": []}

  def elapsed(self) -> float:
    return time.monotonic() - self.t0

  def save(self, phase: str) -> None:
    self.report |= {"phase": phase, "wall_s": round(self.elapsed(), 2)}
    (self.out / "geometry_gpu.json").write_text(json.dumps(self.report, indent=1, default=str))
    print(f"== {phase} ({self.elapsed():.0f} s)", flush=True)

  def sweep_dir(self, arm: str) -> Path:
    return self.work / arm

  def run_dir(self, arm: str, seed: int) -> Path:
    return self.sweep_dir(arm) / "runs" / f"seed={seed}"

  def prepare(self, arm: str) -> Path:
    import yaml

    from mhc_jax.sweep import grid

    path = self.out / "sweeps" / f"{arm}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(sweep_spec(arm, self.scale), sort_keys=False))
    self.names[arm] = [r.name for r in grid.read_sweep(path).runs]
    assert self.names[arm] == [f"seed={s}" for s in range(SEEDS)], self.names[arm]
    return path

  def evaluate(self, arm: str, seed: int, steps) -> float:
    run = self.run_dir(arm, seed)
    got, dt = series_rows(run, steps, self.scale.batches)
    self.rows.setdefault((arm, seed), {}).update({r["step"]: r for r in got})
    write_series(run, self.rows[(arm, seed)])
    return dt

  def measure(self, arm: str) -> ArmCost:
    """Train the arm to ``measure[1]``, time its step; read three rows of its series, timed."""
    sc, path = self.scale, self.prepare(arm)
    dirs = [self.run_dir(arm, s) for s in range(SEEDS)]
    deadline = time.monotonic() + 0.2 * self.args.budget_s
    t = time.monotonic()
    st = train_arm(path, self.sweep_dir(arm), self.names[arm], sc.measure[1], deadline)
    step_s = step_time(st, *sc.measure, dirs)
    info = {"step_s": step_s, "member_step_s": step_s / SEEDS, "measured_between": sc.measure}
    info |= {"stopped_by": st.fired or "end", "sweep_rc": st.rc}
    info["measure_train_s"] = time.monotonic() - t
    first = [sc.series[0]] if self.reached(arm) >= sc.series[0] else []
    a = self.evaluate(arm, 0, [0, *first])  # compiles the series' functions for this arm
    b = self.evaluate(arm, 1, [0, *first])  # a run's fixed cost and two rows (or one)
    c = self.evaluate(arm, 2, [0])  # the fixed cost and one row
    row = (max(b - c, 0.0) or b / 2) if first else c
    info |= {"eval_first_s": a, "eval_run_s": max(c - row, 0.0), "eval_row_s": row}
    self.report["arms"][arm] = info
    return ArmCost(step_s, self.reached(arm), info["eval_run_s"], row, 3 + 2 * len(first))

  def reached(self, arm: str) -> int:
    """The step every seed of the arm holds a checkpoint at, or beyond."""
    from mhc_jax import rundir

    return min(max(rundir.checkpoint_steps(self.run_dir(arm, s)), default=0) for s in range(SEEDS))

  def collect(self, analysis: bool = False) -> None:
    """The small files of every run and runs.csv into --out; the analysis's decision.csv and
    formation.png (``analysis``)."""
    import pandas as pd

    frames = []
    for arm, names in self.names.items():
      for seed, name in enumerate(names):
        src, dst = self.run_dir(arm, seed), self.out / "runs" / arm / name
        dst.mkdir(parents=True, exist_ok=True)
        for f in KEPT:
          if (src / f).exists():
            shutil.copy2(src / f, dst / f)
        if rows := self.rows.get((arm, seed)):
          frames.append(pd.DataFrame([rows[s] for s in sorted(rows)]).assign(arm=arm, seed=seed))
    if not frames:
      return
    first = ["arm", "seed", "step"]
    runs = pd.concat(frames, ignore_index=True)
    runs = runs[first + [c for c in runs.columns if c not in first]]
    runs.to_csv(self.out / "runs.csv", index=False)
    if not analysis:
      return
    spec = importlib.util.spec_from_file_location("formation_analysis", ANALYSIS)
    an = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(an)
    an.decision(runs, **an.RULE).to_csv(self.out / "decision.csv", index=False)
    try:
      an.figure(runs, self.out / "formation.png")
    except ImportError as e:  # an image without matplotlib
      self.report["figure"] = f"not drawn: {e}"

  def size(self, costs: dict) -> int | None:
    """The steps :func:`choose_steps` fits into what is left of the budget (None: none)."""
    sc = self.scale
    left = self.end - time.monotonic() - FINISH_S - MARGIN * self.args.budget_s
    sized = None
    try:
      sized = choose_steps(costs, left, every=sc.every, cap=sc.cap, series=sc.series)
    except ValueError as e:
      self.report["error"] = str(e)
    planned = None if sized is None else cost(sized, costs, series=sc.series)
    self.report["sizing"] = {"left_s": left, "steps": sized, "planned_s": planned}
    self.report["sizing"] |= {"resume_s": RESUME_S, "finish_s": FINISH_S, "margin": MARGIN}
    return sized

  def train(self, steps: int, costs: dict) -> None:
    """Each arm on to ``steps``, each stopped by the time the rest of the plan needs."""
    sc, arms = self.scale, list(costs)
    evals = sum(eval_cost(steps, c, series=sc.series) for c in costs.values())
    for i, arm in enumerate(arms):
      info = self.report["arms"][arm]
      if self.reached(arm) >= steps:
        info |= {"train_s": 0.0, "steps_reached": self.reached(arm)}
        continue
      plan = train_cost(steps, costs[arm])
      later = evals + FINISH_S + sum(train_cost(steps, costs[a]) for a in arms[i + 1 :])
      deadline = min(time.monotonic() + 1.5 * plan + 10, self.end - later)
      t = time.monotonic()
      stop = steps if steps < sc.cap else None  # at the cap the runs end by themselves
      st = train_arm(
        self.out / "sweeps" / f"{arm}.yaml", self.sweep_dir(arm), self.names[arm], stop, deadline
      )
      info |= {"train_s": time.monotonic() - t, "train_planned_s": plan, "sweep_rc_train": st.rc}
      info |= {"train_stopped_by": st.fired or "end", "steps_reached": self.reached(arm)}
      self.save(f"trained {arm} to step {self.reached(arm)}")

  def series(self, steps: int, arms) -> None:
    """Every run's rows at :func:`series_steps` of ``steps`` that it holds, while time is left."""
    from mhc_jax import rundir

    for arm in arms:
      c = self.report["arms"][arm]
      for seed in range(SEEDS):
        kept = rundir.checkpoint_steps(self.run_dir(arm, seed))
        last = max(kept, default=0)
        want = [s for s in series_steps(min(steps, last), self.scale.series) if s in kept | {0}]
        todo = [s for s in want if s not in self.rows.get((arm, seed), {})]
        room = self.end - time.monotonic() - FINISH_S - c["eval_run_s"]
        todo = todo[: max(int(room // max(c["eval_row_s"], 1e-9)), 0)]
        rec = {"arm": arm, "seed": seed, "steps_reached": last, "series_steps": want}
        try:
          rec["series_s"] = self.evaluate(arm, seed, todo) if todo else 0.0
        except Exception as e:  # noqa: BLE001 - the other runs' rows are still worth having
          rec["error"] = f"{type(e).__name__}: {e}"
        rec["rows"] = sorted(self.rows.get((arm, seed), {}))
        self.report["runs"].append(rec)
        self.collect()
        self.save(f"series of {arm} seed {seed}: steps {rec['rows']}")

  def go(self) -> int:
    """Measure, size, train, read the series; an arm that fails is reported, the rest go on."""
    costs = {}
    for arm in ARMS:
      try:
        costs[arm] = self.measure(arm)
        self.save(f"measured {arm}: {costs[arm].step_s * 1e3:.1f} ms a step of {SEEDS} seeds")
      except Exception as e:  # noqa: BLE001
        self.report["arms"].setdefault(arm, {})["error"] = f"{type(e).__name__}: {e}"
        self.save(f"measuring {arm} failed: {e}")
    sized = self.size(costs) if costs else None
    steps = self.args.steps or sized
    if steps is None:
      self.collect(analysis=bool(costs))
      self.save("stopped: nothing to train")
      print(f"error: {self.report.get('error', 'every arm failed')}", file=sys.stderr)
      return 1
    self.report |= {"steps": steps, "steps_from": "--steps" if self.args.steps else "sizing"}
    self.save(f"sized: {sized} steps per arm; training to {steps}")
    self.train(steps, costs)
    self.series(steps, list(costs))
    self.collect(analysis=True)
    self.save("done")
    for arm, i in self.report["arms"].items():
      rows = [r["rows"] for r in self.report["runs"] if r["arm"] == arm]
      ms = i.get("step_s", math.nan) * 1e3
      print(
        f"{arm}: {ms:.1f} ms a step of {SEEDS} seeds; reached {i.get('steps_reached')}; rows {rows}"
      )
    failed = [a for a, i in self.report["arms"].items() if "error" in i]
    failed += [f"{r['arm']} seed {r['seed']}" for r in self.report["runs"] if "error" in r]
    if failed:
      print(f"error: failed: {', '.join(failed)} (geometry_gpu.json says why)", file=sys.stderr)
    return 1 if failed else 0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True, help="where the series, logs and JSON go")
  ap.add_argument("--work", required=True, help="scratch: the sweeps and their checkpoints")
  ap.add_argument("--toy", action="store_true", help="toy size, on any device (the tests)")
  ap.add_argument("--budget-s", type=float, default=480.0, help="the whole run's wall time")
  ap.add_argument("--steps", type=int, help="train to this step instead of the sized one")
  args = ap.parse_args(argv)
  scale = TOY if args.toy else REAL
  if args.steps is not None and not (
    args.steps % scale.every == 0 and scale.series[0] <= args.steps <= scale.cap
  ):
    print(
      f"error: --steps {args.steps}: a multiple of {scale.every} from {scale.series[0]} to"
      f" {scale.cap}",
      file=sys.stderr,
    )
    return 2
  import jax

  dev = jax.devices()[0]
  if dev.platform == "cpu" and not args.toy:
    print(
      f"error: no accelerator visible to jax (devices: {jax.devices()}); this study would take"
      " hours on the CPU (--toy runs its commands at toy size)",
      file=sys.stderr,
    )
    return 2
  Path(args.out).mkdir(parents=True, exist_ok=True)
  Path(args.work).mkdir(parents=True, exist_ok=True)
  signal.signal(signal.SIGTERM, _on_sigterm)
  d = Driver(args, scale)
  d.report |= {"device": f"{dev.device_kind} x {jax.device_count()}", "jax": jax.__version__}
  print(f"device: {d.report['device']}, jax {jax.__version__}; budget {args.budget_s:.0f} s")
  return d.go()


if __name__ == "__main__":
  sys.exit(main())
