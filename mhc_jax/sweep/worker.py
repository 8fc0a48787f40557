"""One sweep worker: claim a unit of runs (one run, or a population) in the manifest, train the
claimed runs, record their results. Used in-process by the sequential runner and as its own
process by the parallel runner and the cluster executors.

As a process (``python -m mhc_jax.sweep.worker SWEEP_DIR SPEC_JSON``; the parallel runner
starts it, it is not a user command): SPEC_JSON holds ``token`` (the claim's owner token),
``runs`` (``{name: {"config": resolved config dict, "dir": "runs/<name>"}}``, one population
or one run) and optionally ``cpus`` (the cores to pin to). Exit codes: 0 every claimed run
done, 1 some run failed (recorded in the manifest), 143 SIGTERM (checkpoints saved, runs given
back as ``pending``), 75 nothing to claim (other workers hold the runs, or they are finished).

Fault injection for tests: ``MHC_SWEEP_PLANT=RUN@STEP:KIND`` makes run RUN crash when it asks
for training batch STEP, with KIND ``abort`` (SIGABRT, like a crash inside XLA), ``kill``
(SIGKILL, like the out-of-memory killer) or ``raise`` (a Python exception).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

from mhc_jax.sweep.manifest import EXIT_LOST_CLAIM, Heartbeat, Manifest, Worker

EXIT_FAILED, EXIT_NOT_CLAIMED, EXIT_PREEMPTED = 1, EXIT_LOST_CLAIM, 143
PLANT_ENV = "MHC_SWEEP_PLANT"

__all__ = ["train_claimed", "run_unit", "main", "pin_cpus", "EXIT_NOT_CLAIMED"]


# ------------------------------------------------------------------------------------------
# Placement (before jax is imported).


def pin_cpus(cpus: list[int] | None) -> None:
  """Restrict every thread of this process to `cpus` -- after XLA's CPU client exists, so its
  intra-op thread pool keeps the size it has in a sequential sweep (the pool's size decides
  how multi-threaded ops split their work, and so their rounding); threads started later
  inherit the mask."""
  if not cpus or not hasattr(os, "sched_setaffinity"):
    return
  import jax

  jax.devices()  # the backend and its thread pools, sized to all the cores
  try:
    tids = [int(t) for t in os.listdir("/proc/self/task")]
  except OSError:
    tids = [0]
  for tid in tids:
    try:
      os.sched_setaffinity(tid, set(cpus))
    except OSError as e:
      print(f"warning: could not pin thread {tid} to cpus {cpus}: {e}", flush=True)


# ------------------------------------------------------------------------------------------
# Fault injection.


class _PlantedSource:
  """A data source that crashes the process at one training batch."""

  def __init__(self, source, step: int, kind: str):
    self._source, self._step, self._kind = source, step, kind

  def __getattr__(self, name):
    return getattr(self._source, name)

  def batch(self, step, batch_size, split="train"):
    if split == "train" and step == self._step:
      print(f"planted crash ({self._kind}) at step {step}", flush=True)
      if self._kind == "abort":
        os.abort()
      if self._kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
      raise RuntimeError(f"planted crash at step {step}")
    return self._source.batch(step, batch_size, split)


def _plant(name: str, setup):
  raw = os.environ.get(PLANT_ENV, "")
  for item in filter(None, raw.split(";")):
    where, _, kind = item.partition(":")
    run, _, step = where.partition("@")
    if run == name and kind in ("abort", "kill", "raise") and step.isdigit():
      import dataclasses

      return dataclasses.replace(setup, source=_PlantedSource(setup.source, int(step), kind))
  return setup


# ------------------------------------------------------------------------------------------
# Training claimed runs.


def _is_main() -> bool:
  import jax

  return jax.process_index() == 0


def train_claimed(
  manifest: Manifest,
  me: Worker,
  sweep_dir: Path,
  names: list[str],
  setups: dict,
  *,
  progress: bool = False,
  say: Callable[[str, str], None] | None = None,
) -> dict:
  """Train runs `names`, already claimed by `me` (all processes of a multi-process run call
  this; only process 0 writes), as one population when there are several; record each result.

  Returns ``{"results": {name: status}, "preempted": bool}``.
  """
  from mhc_jax.errors import RunLocked
  from mhc_jax.rundir import checkpoint_steps, prepare_run_dir
  from mhc_jax.train.loop import Preempted, RunHalted, train

  say = say or (lambda n, msg: print(f"{n}: {msg}", flush=True))
  main = _is_main()
  m = manifest.read() or {"runs": {}}
  results: dict = {}

  def record(name, status, t0=None, summary=None, error=None, wall=None):
    wall = round(time.perf_counter() - t0 if wall is None else wall, 2)
    fields = {"wall_s": wall}
    if summary and "final_loss" in summary:
      fields["final_loss"] = summary["final_loss"]
    if main:
      manifest.finish(name, me.token, status, error=error, **fields)
    results[name] = status
    loss = summary.get("final_loss") if summary else None
    tail = f" (final loss {loss:.4f})" if isinstance(loss, float) else ""
    tail += f": {error}" if error else ""
    say(name, f"{status} in {wall:.1f}s{tail}")

  live = []
  for n in names:
    rdir = sweep_dir / m["runs"][n]["dir"]
    how = prepare_run_dir(rdir, setups[n].cfg)
    if how == "done":  # finished, but killed before the manifest said so
      summary = json.loads((rdir / "summary.json").read_text())
      record(n, "done", summary=summary, wall=float(summary.get("wall_s") or 0.0))
    else:
      live.append((n, rdir, how))
  if not live:
    return {"results": results, "preempted": False}
  _sync("sweep-dirs")
  for n, rdir, how in live:
    step = max(checkpoint_steps(rdir), default=0) if how == "resume" else 0
    if main:
      manifest.update_run(n, me.token, resumed_from=step)
    say(
      n,
      (f"resuming from step {step}" if how == "resume" else "starting")
      + (f" (population of {len(live)})" if len(live) > 1 else ""),
    )
  run_setups = {n: _plant(n, setups[n]) for n, _, _ in live}
  t0 = time.perf_counter()
  beat = Heartbeat(manifest, me, [n for n, _, _ in live]) if main else None
  try:
    if beat is not None:
      beat.__enter__()
    try:
      if len(live) == 1:
        n, rdir, how = live[0]
        try:
          out = [train(run_setups[n], rdir, resume=how == "resume", progress=progress)]
        except RunHalted as e:
          out = [e]
      else:
        from mhc_jax.sweep import population

        out = population.train_population(
          [run_setups[n] for n, _, _ in live],
          [d for _, d, _ in live],
          resume=True,
          progress=progress,
        )
    finally:
      if beat is not None:
        beat.__exit__(None, None, None)
  except Preempted as e:
    for n, _, _ in live:
      if main:
        manifest.finish(n, me.token, "pending", error=f"preempted: {e}")
      results[n] = "pending"
    return {"results": results, "preempted": True, "message": str(e)}
  except RunLocked as e:  # a trainer outside the manifest (or one that lost its claim) has it
    for n, _, _ in live:
      if main:
        manifest.finish(n, me.token, "pending", error=f"run directory in use: {e}")
      results[n] = "pending"
      say(n, f"given back: {e}")
    return {"results": results, "preempted": False}
  except Exception as e:  # noqa: BLE001 - a failed run must not stop the sweep
    if main:
      traceback.print_exc()
    for n, _, _ in live:
      record(n, "failed", t0, error=f"{type(e).__name__}: {e}")
    return {"results": results, "preempted": False}
  for (n, _, _), res in zip(live, out):
    if isinstance(res, RunHalted):
      record(n, "failed", t0, error=f"halted: {res}")
    else:
      record(n, "done", t0, res)
  return {"results": results, "preempted": False}


def _sync(name: str) -> None:
  import jax

  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


# ------------------------------------------------------------------------------------------
# A worker process.


def run_unit(sweep_dir: str | os.PathLike, spec: dict) -> int:
  """Claim and train one unit in this process (see the module docstring); the exit code."""
  sweep_dir = Path(sweep_dir)
  for k, v in (spec.get("env") or {}).items():
    os.environ[k] = str(v)
  manifest = Manifest(sweep_dir)
  me = Worker.current(spec.get("token"))
  names = list(spec["runs"])
  claimed, why = manifest.claim(names, me)
  for n, reason in why.items():
    print(f"{n}: not claimed ({reason})", flush=True)
  if not claimed:
    return EXIT_NOT_CLAIMED
  print(f"worker {me.describe()} token {me.token}: claimed {', '.join(claimed)}", flush=True)
  pin_cpus(spec.get("cpus"))
  try:
    from mhc_jax.train.config import from_dict
    from mhc_jax.train.loop import prepare

    setups = {n: prepare(from_dict(spec["runs"][n]["config"])) for n in claimed}
  except Exception as e:  # noqa: BLE001 - e.g. a data file gone since the sweep was checked
    traceback.print_exc()
    for n in claimed:
      manifest.finish(n, me.token, "failed", error=f"{type(e).__name__}: {e}")
    return EXIT_FAILED
  out = train_claimed(manifest, me, sweep_dir, claimed, setups, progress=False)
  if out["preempted"]:
    return EXIT_PREEMPTED
  return EXIT_FAILED if any(s == "failed" for s in out["results"].values()) else 0


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 2:
    print("error: usage: python -m mhc_jax.sweep.worker SWEEP_DIR SPEC_JSON", file=sys.stderr)
    return 2
  spec = json.loads(Path(argv[1]).read_text())
  return run_unit(argv[0], spec)


if __name__ == "__main__":
  sys.exit(main())
