"""``mhc-jax sweep FILE [--out DIR] [--set K=V ...] [--dry-run] [--parallel K]
[--executor local|slurm] [--variant NAME]``: run a sweep, resumably. The sweep directory's layout,
when a run counts as finished, resume, executors, a changed sweep file and the exit codes are
described in docs/sweeps.md."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
import traceback

from mhc_jax import errors, logs, rundir, storage
from mhc_jax.errors import ConfigError, Preempted, RunHalted, RunLocked
from mhc_jax.sweep import grid, options as how, posteval
from mhc_jax.train import dist
from mhc_jax.train.config import result_keys

SWEEP_STATUS = rundir.SWEEP_STATUS


def _say(msg: str) -> None:
  if dist.is_main():
    print(msg, flush=True)


# ---------- The plan: which runs are finished (their summaries), the manifest, a changed sweep file
def run_status(run_dir) -> tuple[str, str | None]:
  """(``done`` | ``failed`` | ``pending``, the failure's message) from ``summary.json``."""
  s = rundir.read_summary(run_dir)
  status = SWEEP_STATUS.get(s.get("status"), "pending")
  return status, (s.get("message") or s.get("status")) if status == "failed" else None


def read_manifest(out_dir) -> dict | None:
  p = storage.path(out_dir) / "manifest.json"
  try:
    return json.loads(p.read_text()) if p.exists() else None
  except ValueError as e:
    raise ConfigError(f"--out: {p} is not valid JSON ({e}); use another --out") from None


def write_manifest(out_dir, manifest: dict) -> None:
  """Replace ``out_dir/manifest.json`` (atomically; process 0 only)."""
  if dist.is_main():
    storage.write_json_atomic(storage.path(out_dir) / "manifest.json", manifest)


def _same(a, b) -> bool:
  return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _check_compatible(old: dict, sweep: grid.Sweep, out_dir) -> None:
  """ConfigError naming the first key where `sweep` differs from the one that made `out_dir`."""
  where = (
    f"since {out_dir} was made; its runs would mix configs. Use another --out, or undo the change"
  )
  old_axes = old.get("axes") or {}
  for k in [*sweep.axes, *old_axes]:
    if (k in sweep.axes) != (k in old_axes):
      raise ConfigError(f"axes.{k}: {'a new axis' if k in sweep.axes else 'axis removed'} {where}")
  before = logs.flatten_dict(result_keys(old.get("base_config") or {}))
  now = logs.flatten_dict(result_keys(sweep.base_config))
  for k in sorted(set(before) & set(now)):  # a key only one side has is a code change
    if not (k == "name" or _same(before[k], now[k])):
      raise ConfigError(
        f"{k}: changed from {before[k]!r} to {now[k]!r} (sweep file 'set', its "
        f"base config or --set) {where}"
      )
  for r in sweep.runs:
    info = old.get("runs", {}).get(r.name)
    if info is not None and not _same(info.get("overrides"), r.overrides):
      raise ConfigError(f"axes: run {r.name} had overrides {info.get('overrides')} {where}")


def plan(sweep: grid.Sweep, out_dir) -> tuple[dict, list[str], list[str]]:
  """(manifest, names of the runs to train in grid order, notes) for `sweep` in `out_dir`, from
  the existing manifest (checked against the sweep) and every run's summary; writes nothing."""
  out_dir = storage.path(out_dir)
  old = read_manifest(out_dir)
  runs = {r.name: {"overrides": r.overrides, "dir": f"runs/{r.name}"} for r in sweep.runs}
  notes = []
  if old is not None:
    _check_compatible(old, sweep, out_dir)
    new = [n for n in runs if n not in old.get("runs", {})]
    gone = [n for n in old.get("runs", {}) if n not in runs]
    if new:
      notes.append(f"adding {len(new)} new run(s): {', '.join(new)}")
    if gone:
      notes.append(f"{len(gone)} run(s) no longer in the sweep file are kept: {', '.join(gone)}")
    for n in gone:
      runs[n] = {k: old["runs"][n][k] for k in ("overrides", "dir") if k in old["runs"][n]}
  for name, info in runs.items():
    info["status"], error = run_status(out_dir / info.get("dir", f"runs/{name}"))
    if error:
      info["error"] = error
  manifest = {"name": sweep.name, "sweep_file": str(sweep.path) if sweep.path else None}
  manifest |= {"base": str(sweep.base_path) if sweep.base_path else None, "set": sweep.set}
  manifest |= {"axes": sweep.axes, "population": list(sweep.population)}
  manifest |= {"base_config": sweep.base_config, "runs": runs}
  return manifest, [r.name for r in sweep.runs if runs[r.name]["status"] == "pending"], notes


# ------------------------------------ One unit (a run, or a population): here, or as a submitit job
@contextlib.contextmanager
def _locked(run_dirs: list, say=print):
  """Hold every run directory's lock (process 0), waiting while another trainer has one."""
  with contextlib.ExitStack() as stack:
    if dist.is_main():
      for d in run_dirs:
        for attempt in itertools.count():
          try:
            stack.enter_context(rundir.Lock(d))
            break
          except RunLocked as e:
            if not attempt:
              say(f"waiting: {e}")
            time.sleep(5.0)
    yield


def train_unit(setups: dict, run_dirs: dict, progress: bool = False, say=print) -> None:
  """Train the unfinished runs among `setups` (``{name: train.loop.Setup}``) into `run_dirs`,
  as one population when there are several. A run directory without a checkpoint is emptied
  first; a halted run, or one whose training raised, says so in its summary.json."""
  from mhc_jax.sweep import population
  from mhc_jax.train.loop import train

  dirs = {n: storage.path(d) for n, d in run_dirs.items()}
  with _locked(list(dirs.values()), say):
    live = [n for n in setups if run_status(dirs[n])[0] == "pending"]  # another may have ended it
    fresh = [n for n in live if not rundir.checkpoint_steps(dirs[n])]
    dist.sync("sweep: run directories read")
    for n in fresh:
      if dist.is_main() and dirs[n].exists():
        for p in dirs[n].iterdir():
          if p.name != rundir.LOCK_NAME:
            p.rmtree() if p.is_dir() else p.unlink()
    dist.sync("sweep: run directories cleared")
    for n in live:  # the jobs' logs count these
      say(f"{n}: training from step {max(rundir.checkpoint_steps(dirs[n]), default=0)}")
    if len(live) == 1:
      with contextlib.suppress(RunHalted):  # summary.json says halted
        train(setups[live[0]], dirs[live[0]], resume=not fresh, progress=progress)
    elif live:
      population.train_population(
        [setups[n] for n in live], [dirs[n] for n in live], True, progress
      )


class Unit:
  """A submitit job: one unit of a sweep from its runs' configs (picklable), returning
  ``{name: sweep status}``; on SIGUSR2 it saves a checkpoint and is requeued (docs/sweeps.md)."""

  def __init__(self, configs: dict, run_dirs: dict):
    self.configs, self.run_dirs = configs, {n: os.fspath(d) for n, d in run_dirs.items()}

  def __call__(self) -> dict:
    from mhc_jax.train.config import from_dict
    from mhc_jax.train.loop import prepare

    submitit_usr2 = signal.getsignal(signal.SIGUSR2)
    asked = []  # SIGUSR2 becomes the SIGTERM on which the loop saves a checkpoint
    signal.signal(signal.SIGUSR2, lambda *_: (asked.append(1), os.kill(os.getpid(), 15)))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the sweep, which sends SIGTERM
    try:
      train_unit({n: prepare(from_dict(c)) for n, c in self.configs.items()}, self.run_dirs)
    except Preempted:
      if asked and callable(submitit_usr2):
        signal.signal(signal.SIGUSR2, submitit_usr2)
        submitit_usr2(signal.SIGUSR2, None)  # checkpoint() + requeue; does not return
      raise
    return {n: run_status(d)[0] for n, d in self.run_dirs.items()}

  def checkpoint(self, *args, **kwargs):
    """submitit's requeue hook: the next life of this job resumes from the checkpoint."""
    import submitit

    return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


# ---------------------------------------------------------------------------------- Running a sweep
def _said(unit: list, run_dir) -> str:
  """What a unit's run is about to do: start, or resume from its newest checkpoint."""
  step = max(rundir.checkpoint_steps(run_dir), default=0)
  pop = f" (population of {len(unit)})" if len(unit) > 1 else ""
  return (f"resuming from step {step}" if step else "starting") + pop


def _result(run_dir, wall: float) -> str:
  status, error = run_status(run_dir)
  loss = rundir.read_summary(run_dir).get("final_loss")
  tail = f" (final loss {loss:.4f})" if isinstance(loss, float) and status == "done" else ""
  tail += f": {error}" if error else ""
  return f"{status if status != 'pending' else 'stopped'} in {wall:.1f}s{tail}"


def _fail(run_dir, error: str) -> None:
  """A unit whose training raised or whose job died: its unfinished runs' summary.json say
  failed, and a failed summary without a message gets `error`."""
  s = rundir.read_summary(run_dir)
  if run_status(run_dir)[0] == "pending" or (s.get("status") == "failed" and not s.get("message")):
    rundir.write_summary(run_dir, {**s, "status": "failed", "message": error})


def _job_error(job, e: Exception) -> str:
  """One line: how the job failed (a dead job: its signal or exit status; a raising one: the
  exception's last line) and the end of its log."""
  if type(e).__name__ == "UncompletedJobError":  # no result: the process died (OOM, a signal)
    rc = getattr(getattr(job, "_process", None), "returncode", None)  # local jobs' process
    # submitit's local controller exits 0 whatever its task died of
    how_ = f"exit status {rc}" if rc else f"its process was killed or exited; state {job.state}"
    if rc is not None and rc < 0:
      with contextlib.suppress(ValueError):
        how_ = f"killed by {signal.Signals(-rc).name}"
    head = f"job {job.job_id} died without a result ({how_})"
  else:
    text = [line.strip() for line in str(e).splitlines() if line.strip()]
    head = f"job {job.job_id} failed: {text[-1] if text else type(e).__name__}"
  try:
    log = [line.strip() for line in job.stdout().splitlines() if line.strip()][-3:]
  except Exception:  # noqa: BLE001 - no log
    log = []
  return head + (f"; log {job.paths.stdout}: {' | '.join(log)}" if log else "")


def _gpu_ids() -> list[int]:
  raw = os.environ.get("CUDA_VISIBLE_DEVICES")
  if raw is not None:
    return [int(g) for g in raw.split(",") if g.strip().isdigit()]
  smi = shutil.which("nvidia-smi")
  if not smi:
    return []
  out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
  return list(range(sum(line.startswith("GPU ") for line in out.splitlines())))


def devices_per_job(k: int, kind: str, params: dict) -> tuple[int, list[list[int]]]:
  """(devices one job's mesh spans, the GPU ids of each of the `k` local job slots)."""
  if kind == "slurm":
    return int(params.get("gpus_per_node") or params.get("slurm_gpus_per_node") or 1), []
  gpus = _gpu_ids() if os.environ.get("JAX_PLATFORMS", "") in ("", "cuda", "gpu") else []
  if gpus:
    per = len(gpus) // k
    if per == 0:
      raise ConfigError(
        f"--parallel: {k} runs at once need at least {k} GPUs; this host has {len(gpus)}"
      )
    return per, [gpus[i * per : (i + 1) * per] for i in range(k)]
  m = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
  return (int(m.group(1)) if m else 1), [[] for _ in range(k)]


def check_runs(sweep: grid.Sweep, n_devices: int) -> None:
  """What ``train.loop.prepare`` checks, for a job with `n_devices` devices, without touching a
  device here (the jobs get them): data source options, vocabulary, the mesh."""
  from mhc_jax.train.config import validate_mesh
  from mhc_jax.train.loop import check_data

  def check(cfg):
    check_data(cfg)
    validate_mesh(cfg.mesh, n_devices, cfg.data.batch_size)

  grid.prepare_runs(sweep, check, f" (each of the parallel jobs has {n_devices} device(s))")


def _executor(out_dir, kind: str, params: dict):
  submitit = how.import_submitit()
  folder = os.fspath(out_dir / "submitit" / "%j")
  params = dict(params)
  if kind == "local":
    ex = submitit.LocalExecutor(folder=folder, max_num_timeout=100)
    params.setdefault("timeout_min", 7 * 24 * 60)
  else:
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=100)
    extra = dict(params.pop("slurm_additional_parameters", None) or {})
    params["slurm_additional_parameters"] = {"requeue": True, **extra}
    params.setdefault("name", f"mhc-sweep-{out_dir.name}")
  ex.update_parameters(**params)
  return ex


def _config(sweep: grid.Sweep, name: str) -> dict:
  from mhc_jax.train.config import to_dict

  return {k: v for k, v in to_dict(sweep.run(name).cfg).items() if k != "dist"}  # one process


def _run_jobs(sweep, out_dir, units, k, kind, params, say, progress) -> bool:
  """Submit `units` as submitit jobs, at most `k` at a time (all at once without it), the
  finished ones counted under tqdm; False when a signal stopped the sweep."""
  from tqdm.auto import tqdm

  ex = _executor(out_dir, kind, params)
  k = k or len(units)
  _, slots = devices_per_job(k, kind, params)
  queue, active, free, stop = list(units), {}, list(range(k)), []
  handlers = {s: signal.signal(s, lambda n, f: stop.append(n)) for s in (2, 15)}
  total, desc = sum(map(len, units)), f"sweep {sweep.name}"
  bar = tqdm(total=total, unit="run", desc=desc, disable=not progress)
  told = False
  try:
    while queue or active:
      while queue and free and not stop:
        unit, slot = queue.pop(0), free.pop(0)
        dirs = {n: out_dir / "runs" / n for n in unit}
        for n in unit:
          say(n, _said(unit, dirs[n]))
        if slots and slots[slot]:
          ex.update_parameters(visible_gpus=slots[slot], gpus_per_node=len(slots[slot]))
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited: Ctrl-C reaches only us
        try:
          job = ex.submit(Unit({n: _config(sweep, n) for n in unit}, dirs))
        finally:
          signal.signal(signal.SIGINT, old)
        active[job] = (unit, slot, time.time())
      if stop and kind == "slurm":
        say(None, "stopping; the SLURM jobs keep running: run the same command to watch them")
        return False
      if stop and not told:  # LocalExecutor's controller passes SIGTERM on: checkpoint, stop
        told = True
        for job in active:
          with contextlib.suppress(OSError, AttributeError):
            job._process.send_signal(signal.SIGTERM)
      for job in [j for j in active if j.done()]:
        unit, slot, t0 = active.pop(job)
        free.append(slot)
        try:
          job.result()
        except Exception as e:  # noqa: BLE001 - a crashed or killed job fails its runs only
          if not stop:  # a signal stopped it: its runs resume on the next command
            for n in unit:
              _fail(out_dir / "runs" / n, _job_error(job, e))
        for n in unit:
          say(n, _result(out_dir / "runs" / n, time.time() - t0), bar.write)
        bar.update(len(unit))
      time.sleep(0.5)
  finally:
    for s, h in handlers.items():
      signal.signal(s, h)
    bar.close()
  return not stop


def run_sweep(
  sweep: grid.Sweep,
  setups: dict | None,
  out_dir,
  *,
  progress: bool = True,
  parallel: int | None = None,
  executor: str | None = None,
  executor_params: dict | None = None,
) -> int:
  """Train every unfinished run of `sweep` into `out_dir`, then write the report. With
  `executor` (``local`` | ``slurm``) units are submitit jobs, up to `parallel` at once, and
  `setups` is not needed; otherwise they train here, one after another."""
  out_dir = storage.path(out_dir)
  manifest, todo, notes = plan(sweep, out_dir)
  runs, evals = manifest["runs"], sweep.options.get("eval")
  counts = {s: sum(runs[r.name]["status"] == s for r in sweep.runs) for s in ("done", "failed")}
  counted = f"{counts['done']} done, {counts['failed']} failed"
  for note in notes:
    _say(f"note: {note}")
  if not todo:
    _say(
      f"sweep {sweep.name}: all {len(sweep.runs)} runs are finished ({counted}); nothing to do"
      f" in {out_dir}"
    )
    index = out_dir / "report" / "summary.md"
    if dist.is_main() and (not index.exists() or (evals and posteval.pending(out_dir, manifest))):
      return _finish(out_dir, manifest, evals)
    if dist.is_main():
      from mhc_jax.sweep import report

      print(report.screen(out_dir))
      print(f"report: {index}")
    return errors.EXIT_FAILED if counts["failed"] else errors.EXIT_OK
  how_ = f" as {executor} jobs, " + (f"up to {parallel} at once" if parallel else "all at once")
  _say(
    f"sweep {sweep.name}: {len(sweep.runs)} runs ({counted}, {len(todo)} to run) in"
    f" {out_dir}{how_ if executor else ''}"
  )
  units = [[r.name for r in g] for g in grid.population_groups(sweep, todo)]
  order = {n: i + 1 for i, n in enumerate(todo)}

  def say(name, msg, write=_say):
    write(f"[{order[name]}/{len(todo)}] {name}: {msg}" if name else f"sweep {sweep.name}: {msg}")

  for n in todo:
    runs[n]["status"] = "running" if executor else "pending"
  write_manifest(out_dir, manifest)
  if executor:
    out_dir = storage.path(os.path.abspath(out_dir)) if storage.is_local(out_dir) else out_dir
    if not _run_jobs(
      sweep, out_dir, units, parallel, executor, executor_params or {}, say, progress
    ):
      _say(f"sweep {sweep.name}: stopped; re-run the same command to continue")
      return errors.EXIT_PREEMPTED
    return _finish(out_dir, plan(sweep, out_dir)[0], evals)
  for unit in units:
    dirs = {n: out_dir / runs[n]["dir"] for n in unit}
    for n in unit:
      runs[n]["status"] = "running"
      say(n, _said(unit, dirs[n]))
    write_manifest(out_dir, manifest)
    t0 = time.time()
    try:
      train_unit({n: setups[n] for n in unit}, dirs, progress, lambda m: None)
    except Preempted as e:
      _say(f"sweep {sweep.name}: {e}; re-run the same command to continue")
      return errors.EXIT_PREEMPTED
    except Exception as e:  # noqa: BLE001 - a failed run must not stop the sweep
      if dist.is_main():
        traceback.print_exc()
        for n in unit:
          _fail(dirs[n], f"{type(e).__name__}: {e}")
    for n in unit:
      runs[n]["status"], error = run_status(dirs[n])
      if error:
        runs[n]["error"] = error
      say(n, _result(dirs[n], time.time() - t0))
    write_manifest(out_dir, manifest)
  return _finish(out_dir, manifest, evals)


def _finish(out_dir, manifest: dict, evals: int | None = None) -> int:
  """Write the manifest, evaluate the finished runs (the sweep's ``eval: N``), write the report,
  print the screen-sized summary and the page's path (process 0)."""
  if not dist.is_main():
    return errors.EXIT_OK
  from mhc_jax.sweep import report

  write_manifest(out_dir, manifest)
  if evals:
    posteval.evaluate_runs(out_dir, manifest, evals, _say)
  paths = report.write_report(out_dir)
  print(report.screen(out_dir))  # the screen-sized summary; the full table is in the report
  print(f"report: {paths['summary_md']}", flush=True)
  failed = [n for n, i in manifest["runs"].items() if i["status"] == "failed"]
  if failed:
    print(f"{len(failed)} run(s) failed: {', '.join(failed)} (errors in manifest.json)")
  open_runs = [n for n, i in manifest["runs"].items() if i["status"] not in ("done", "failed")]
  if open_runs:
    print(f"{len(open_runs)} run(s) not finished: {', '.join(open_runs)} (run the command again)")
  return errors.EXIT_FAILED if failed else errors.EXIT_OK


# -------------------------------------------------------------------------------------- The command
def print_dry_run(sweep: grid.Sweep, setups: dict, out_dir) -> None:
  table = grid.dry_run_table(sweep, setups)
  if read_manifest(out_dir) is not None:
    runs = plan(sweep, out_dir)[0]["runs"]
    table.insert(1, "status", [runs.get(n, {}).get("status", "new") for n in table["run"]])
  show = table.assign(train_flops=[grid.format_flops(x) for x in table["train_flops"]])
  pop = f"; population axes: {', '.join(sweep.population)}" if sweep.population else ""
  print(f"sweep {sweep.name}: {len(table)} runs -> {out_dir}{pop}")
  print(show.to_string(index=False))
  print(
    f"total: {int(table['params'].sum()):,} parameters over all runs, "
    f"{grid.format_flops(float(table['train_flops'].sum()))} training FLOPs "
    f"(steps * B * T * (6 N + 12 L T C), N = non-embedding params + V C)"
  )


def main(args, sweep: grid.Sweep | None = None) -> int:
  """``mhc-jax sweep`` (args: sweep_file, out, set, variant, dry_run, quiet, parallel, executor,
  the dist flags); ``sweep``, when given, instead of reading ``args.sweep_file`` (mhc-jax map)."""
  sweep = sweep or grid.read_sweep(args.sweep_file, args.set or [], variant=args.variant)
  parallel = how.parse_parallel(args.parallel) if args.parallel else sweep.options.get("parallel")
  raw = sweep.options.get("executor")
  kind, params = how.executor_options(raw, args.executor)
  out_dir = storage.path(args.out or os.path.join("sweeps_out", sweep.name))
  if out_dir.exists() and not out_dir.is_dir():
    raise ConfigError(f"--out: {out_dir} is not a directory")
  if any(x is not None for x in (parallel, raw, args.executor)) and not args.dry_run:
    for flag in ("coordinator", "num_processes", "process_id"):
      if getattr(args, flag) is not None:
        raise ConfigError(
          f"--{flag.replace('_', '-')}: a parallel sweep trains each run in its own"
          f" single-process job; multi-process flags are for a sequential sweep (leave out"
          f" --parallel / --executor)"
        )
    if kind == "slurm" and shutil.which("sbatch") is None:
      raise ConfigError("--executor slurm: sbatch not found; run the sweep on a SLURM login node")
    check_runs(sweep, devices_per_job(parallel or 1, kind, params)[0])  # no device touched here
    k, quiet = parallel or (None if kind == "slurm" else 1), args.quiet
    return run_sweep(
      sweep, None, out_dir, progress=not quiet, parallel=k, executor=kind, executor_params=params
    )
  if not args.dry_run:
    d = dist.init_distributed(sweep.runs[0].cfg, args).dist
    if d != sweep.runs[0].cfg.dist:
      sweep.runs = [
        dataclasses.replace(r, cfg=dataclasses.replace(r.cfg, dist=d)) for r in sweep.runs
      ]
  setups = grid.prepare_runs(sweep)
  if args.dry_run:
    print_dry_run(sweep, setups, out_dir)
    return errors.EXIT_OK
  return run_sweep(sweep, setups, out_dir, progress=not args.quiet)
