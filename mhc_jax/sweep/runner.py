"""``mhc-jax sweep FILE [--out DIR] [--set K=V ...] [--dry-run] [--parallel K]
[--executor process|submitit-local|slurm]``: run a sweep, resumably.

The sweep directory (default ``sweeps_out/<name>``) holds::

    manifest.json   {"name", "sweep_file", "base", "set", "axes", "population",
                     "base_config" (base + set, resolved), "seq", "updated",
                     "runs": {name: {"status": "pending" | "running" | "done" | "failed",
                                     "overrides": {axis key: value}, "dir": "runs/<name>",
                                     "error" (failed runs), "wall_s", "final_loss" (finished),
                                     "owner", "heartbeat" (while running), "attempts",
                                     "claimed_at", "resumed_from", "host", "taken_over"}}}
    manifest.lock   the lock every change to manifest.json is made under
    runs/<name>/    a normal run directory (train.loop.train or a population member)
    workers/        parallel sweeps: each worker's spec and log (<token>.json, <token>.log)
    submitit/       submitit executors: the jobs' pickles and logs
    report/         the report (mhc_jax.sweep.report.write_report): index.html, summary.md ...

Every change to ``manifest.json`` -- the plan, a claim, a heartbeat, a status, a result --
is one locked, atomic, owner-checked transaction (:mod:`mhc_jax.sweep.manifest`), so several
workers, sweep commands or hosts sharing the directory cannot corrupt it or train a run
twice. Every run's config is validated, and the manifest checked against the sweep file,
before anything is written (ConfigError: exit 2).

Re-running a sweep continues it: ``done`` and ``failed`` runs are kept as they are; any other
run is trained -- unless a live worker holds it (then the command waits for it; a worker that
died, or went silent past the lease, loses its runs to the next claimant) -- resuming from its
newest checkpoint when its directory has one (the logs past the checkpoint are dropped first,
so every step is logged once) and restarting from scratch when it has none. A failed run (an
exception, a crashed worker, or halted by policy: non-finite values, divergence) records its
error and the sweep goes on; to retry it, delete its run directory. A finished sweep prints
that all runs are done, writes nothing, and exits 0.

Without ``--parallel``/``--executor`` the runs train here, one after another (over all devices;
several processes with jax.distributed train each run together). With them, each run (or
population) trains in its own worker process on its own slice of the devices, or as its own
cluster job: :mod:`mhc_jax.sweep.executor`. ``parallel:`` and ``executor:`` in the sweep file
do the same; the flags win.

A changed sweep file: a sweep directory belongs to one base config (base file + ``set`` +
``--set``) and one set of axis keys. Changing the base config or the axis keys is an error
naming the changed key (use another ``--out``); adding values to an axis adds only the new
runs; runs whose values were removed stay in the manifest and the report.

With ``population`` in the sweep file, runs that differ only in the population axes train as
one vmapped program (mhc_jax.sweep.population); a group of one trains as a normal run.

Exit codes: 0 every run done; 1 some run failed (the report is still written); 2 bad input;
143 SIGTERM or Ctrl-C (checkpoints saved; re-run to continue).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from mhc_jax import logs
from mhc_jax.sweep import grid, posteval
from mhc_jax.sweep.manifest import Manifest, ManifestError, Worker, claim_state, lease_seconds
from mhc_jax.train.config import ConfigError

__all__ = [
  "main",
  "run_sweep",
  "plan",
  "read_manifest",
  "write_manifest",
  "print_dry_run",
]

EXIT_FAILED, EXIT_PREEMPTED = 1, 143
TABLE_COLUMNS = [
  "status",
  "steps",
  "final_loss",
  "spike_count",
  "max_grad_norm",
  "amax_fwd_composite_max",
  "amax_fwd_composite_tok_mean_max",
  "amax_bwd_composite_max",
  "amax_bwd_composite_tok_mean_max",
  "kl_bits",
  "nonfinite",
]


def _is_main() -> bool:
  import jax

  return jax.process_index() == 0


# ------------------------------------------------------------------------------------------
# The manifest (every change goes through mhc_jax.sweep.manifest: locked, atomic, owner-checked).


def read_manifest(out_dir: str | os.PathLike) -> dict | None:
  try:
    return Manifest(out_dir).read()
  except ManifestError as e:
    raise ConfigError(f"--out: {e}") from None


def write_manifest(out_dir: str | os.PathLike, manifest: dict) -> None:
  """Replace ``out_dir/manifest.json`` with `manifest` under the manifest lock (process 0
  only). The runner itself merges (:func:`merge_plan`) instead of replacing."""
  if not _is_main():
    return

  def fn(m):
    seq = m.get("seq")
    m.clear()
    m.update(manifest)
    if seq is not None:
      m["seq"] = seq

  Manifest(out_dir).transact(fn)


def merge_plan(out_dir: str | os.PathLike, planned: dict) -> None:
  """Put a plan (:func:`plan`) into the manifest without undoing what other workers wrote
  since it was read: new runs are added, the sweep's fields updated, a failed run whose
  directory was deleted is made pending again; every other run's entry is kept as it is."""
  if not _is_main():
    return

  def fn(m):
    for k, v in planned.items():
      if k != "runs":
        m[k] = v
    runs = m.setdefault("runs", {})
    for name, info in planned["runs"].items():
      cur = runs.get(name)
      if cur is None:
        runs[name] = dict(info)
      elif cur.get("status") == "failed" and info.get("status") == "pending":
        cur["status"] = "pending"
        cur.pop("error", None)

  Manifest(out_dir).transact(fn)


def _same(a, b) -> bool:
  return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _check_compatible(old: dict, sweep: grid.Sweep, out_dir: Path) -> None:
  """ConfigError naming the first key where `sweep` differs from the one that made `out_dir`."""
  where = (
    f"since {out_dir} was made; its runs would mix configs. Use another --out, or undo the change"
  )
  old_axes = old.get("axes") or {}
  for k in sweep.axes:
    if k not in old_axes:
      raise ConfigError(f"axes.{k}: a new axis {where}")
  for k in old_axes:
    if k not in sweep.axes:
      raise ConfigError(f"axes.{k}: axis removed {where}")
  before = logs.flatten_dict(old.get("base_config") or {})
  now = logs.flatten_dict(sweep.base_config)
  for k in sorted(set(before) & set(now)):  # a key only one side has is a code change
    if k.startswith("dist.") or k == "name":
      continue
    if not _same(before[k], now[k]):
      raise ConfigError(
        f"{k}: changed from {before[k]!r} to {now[k]!r} (sweep file 'set', its "
        f"base config or --set) {where}"
      )
  for r in sweep.runs:
    info = old["runs"].get(r.name)
    if info is not None and not _same(info.get("overrides"), r.overrides):
      raise ConfigError(f"axes: run {r.name} had overrides {info.get('overrides')} {where}")


def plan(sweep: grid.Sweep, out_dir: str | os.PathLike) -> tuple[dict, list[str], list[str]]:
  """(manifest, names of the runs to train in grid order, notes) for `sweep` in `out_dir`.

  Reads the existing manifest (if any) and checks it against the sweep; writes nothing.
  """
  out_dir = Path(out_dir)
  old = read_manifest(out_dir)
  notes = []
  if old is not None:
    _check_compatible(old, sweep, out_dir)
  runs = {}
  for r in sweep.runs:
    prev = (old or {}).get("runs", {}).get(r.name)
    runs[r.name] = (
      dict(prev)
      if prev
      else {"status": "pending", "overrides": r.overrides, "dir": f"runs/{r.name}"}
    )
  if old is not None:
    new = [r.name for r in sweep.runs if r.name not in old["runs"]]
    if new:
      notes.append(f"adding {len(new)} new run(s): {', '.join(new)}")
    gone = [n for n in old["runs"] if n not in runs]
    if gone:
      notes.append(f"{len(gone)} run(s) no longer in the sweep file are kept: {', '.join(gone)}")
    for n in gone:
      runs[n] = old["runs"][n]
  todo = []
  for r in sweep.runs:
    info = runs[r.name]
    if info["status"] == "failed" and not (out_dir / info["dir"]).exists():
      info.update(status="pending")
      info.pop("error", None)
    if info["status"] not in ("done", "failed"):
      todo.append(r.name)
  manifest = {
    "name": sweep.name,
    "sweep_file": str(sweep.path) if sweep.path else None,
    "base": str(sweep.base_path) if sweep.base_path else None,
    "set": sweep.set,
    "axes": sweep.axes,
    "population": list(sweep.population),
    "base_config": sweep.base_config,
    "runs": runs,
  }
  return manifest, todo, notes


# ------------------------------------------------------------------------------------------
# Running.


def _say(msg: str) -> None:
  if _is_main():
    print(msg, flush=True)


def _broadcast(values: list[int]) -> list[int]:
  """Process 0's `values` on every process (multi-process sweeps decide on process 0)."""
  import jax

  if jax.process_count() == 1:
    return values
  import numpy as np
  from jax.experimental import multihost_utils

  return [int(x) for x in multihost_utils.broadcast_one_to_all(np.asarray(values, np.int64))]


def _next_unit(m: dict | None, me: Worker, units: list[list[str]]) -> tuple[int, int]:
  """(index, action) of the next unit: action 0 drop it (all finished), 1 train it; (-1, 2)
  when every remaining unit is held by another worker."""
  runs = (m or {}).get("runs", {})
  now = time.time()
  for i, unit in enumerate(units):
    states = [claim_state(runs.get(n, {}), me, now) for n in unit]
    if all(s == "finished" for s in states):
      return i, 0
    if any(s == "held" for s in states):
      continue
    return i, 1
  return -1, 2


def run_sweep(
  sweep: grid.Sweep,
  setups: dict | None,
  out_dir: str | os.PathLike,
  *,
  progress: bool = True,
  parallel: int | None = None,
  executor: str | None = None,
  executor_params: dict | None = None,
) -> int:
  """Train every unfinished run of `sweep` into `out_dir`, then write the report.

  With `parallel` or `executor`, runs train in worker processes (mhc_jax.sweep.executor) and
  `setups` is not needed; otherwise they train here, one unit after another.
  """
  from mhc_jax.sweep.progress import SweepProgress
  from mhc_jax.sweep.worker import train_claimed

  out_dir = Path(out_dir)
  manifest, todo, notes = plan(sweep, out_dir)
  runs = manifest["runs"]
  n_total = len(sweep.runs)
  counts = {
    s: sum(1 for r in sweep.runs if runs[r.name]["status"] == s) for s in ("done", "failed")
  }
  for note in notes:
    _say(f"note: {note}")
  if not todo:
    _say(
      f"sweep {sweep.name}: all {n_total} runs are finished ({counts['done']} done, "
      f"{counts['failed']} failed); nothing to do in {out_dir}"
    )
    index = out_dir / "report" / "index.html"
    evals = sweep.options.get("eval")
    if _is_main() and (not index.exists() or (evals and posteval.pending(out_dir, manifest))):
      _finish(out_dir, evals)
    elif _is_main():
      _print_table(out_dir)
      print(f"report: {index}")
    return EXIT_FAILED if counts["failed"] else 0
  if _is_main():
    out_dir.mkdir(parents=True, exist_ok=True)
  merge_plan(out_dir, manifest)
  parallel_mode = parallel is not None or executor not in (None, "process")
  how = ""
  if parallel_mode:
    how = f" with {executor or 'process'} workers, " + (
      f"up to {parallel} at once" if parallel else "all submitted at once"
    )
  _say(
    f"sweep {sweep.name}: {n_total} runs ({counts['done']} done, {counts['failed']} failed, "
    f"{len(todo)} to run) in {out_dir}{how}"
  )
  if parallel_mode:
    from mhc_jax.sweep import executor as ex

    rc = ex.run_parallel(
      sweep,
      out_dir,
      [[r.name for r in g] for g in grid.population_groups(sweep, todo)],
      parallel,
      executor or "process",
      executor_params or {},
      progress=progress,
    )
    if rc == EXIT_PREEMPTED:
      _say(f"sweep {sweep.name}: stopped; re-run the same command to continue")
      return EXIT_PREEMPTED
    return _finish(out_dir, sweep.options.get("eval"))

  mfst = Manifest(out_dir)
  me = Worker.current()
  order = {name: i + 1 for i, name in enumerate(todo)}
  bar = SweepProgress(
    sweep.name,
    out_dir,
    {r.name: r.cfg.train.steps for r in sweep.runs},
    1,
    enabled=progress and _is_main(),
    tty=False,
  )
  units = [[r.name for r in g] for g in grid.population_groups(sweep, todo)]
  waiting = False

  def say(name, msg):
    _say(f"[{order[name]}/{len(todo)}] {name}: {msg}")

  while units:
    i, action = _broadcast(list(_next_unit(mfst.read() if _is_main() else None, me, units)))
    if action == 2:
      if not waiting:
        held = [n for u in units for n in u]
        _say(
          f"sweep {sweep.name}: waiting for {len(held)} run(s) that other workers hold: "
          f"{', '.join(held)}"
        )
        waiting = True
      time.sleep(min(5.0, lease_seconds() / 6))
      continue
    waiting = False
    unit = units.pop(i)
    if action == 0:
      continue
    claimed = mfst.claim(unit, me)[0] if _is_main() else []
    mask = _broadcast([int(n in claimed) for n in unit])
    claimed = [n for n, c in zip(unit, mask) if c]
    if not claimed:  # taken by another worker between the look and the claim
      units.insert(i, unit)
      continue
    out = train_claimed(mfst, me, out_dir, claimed, setups, progress=progress, say=say)
    if out["preempted"]:
      _say(f"sweep {sweep.name}: {out.get('message')}; re-run the same command to continue")
      return EXIT_PREEMPTED
    if _is_main():
      bar.update(mfst.read(), force=True)
  return _finish(out_dir, sweep.options.get("eval"))


def _print_table(out_dir: Path) -> None:
  from mhc_jax.sweep import report

  table = report.summary_table(out_dir)
  ids = [c for c in table.attrs.get("id_columns", ["run"]) if c in table.columns]
  cols = ids + [c for c in TABLE_COLUMNS if c in table.columns and c not in ids]
  print(report.md_table(table[cols]), end="")
  print(report.finding(table))


def _finish(out_dir: Path, evals: int | None = None) -> int:
  """Evaluate the finished runs (the sweep's ``eval: N``), write the report, print the summary
  table and the page's path (process 0)."""
  if not _is_main():
    return 0
  from mhc_jax.sweep import report

  if evals:
    posteval.evaluate_runs(out_dir, read_manifest(out_dir) or {"runs": {}}, evals, _say)

  with Manifest(out_dir).report_lock():  # other sweep commands on this directory may finish now
    paths = report.write_report(out_dir)
  _print_table(out_dir)
  print(f"report: {paths['index_html']}", flush=True)
  m = read_manifest(out_dir) or {"runs": {}}
  failed = [n for n, i in m["runs"].items() if i.get("status") == "failed"]
  if failed:
    print(f"{len(failed)} run(s) failed: {', '.join(failed)} (errors in manifest.json)")
  open_runs = [n for n, i in m["runs"].items() if i.get("status") not in ("done", "failed")]
  if open_runs:
    print(
      f"{len(open_runs)} run(s) not finished: {', '.join(open_runs)} (other workers hold "
      f"them or gave them back; run the same command again to finish them)"
    )
  return EXIT_FAILED if failed else 0


# ------------------------------------------------------------------------------------------
# The command.


def print_dry_run(sweep: grid.Sweep, setups: dict, out_dir: Path) -> None:
  table = grid.dry_run_table(sweep, setups)
  old = read_manifest(out_dir) if (out_dir / "manifest.json").exists() else None
  if old is not None:
    table.insert(1, "status", [old["runs"].get(n, {}).get("status", "new") for n in table["run"]])
  show = table.copy()
  show["train_flops"] = [grid.format_flops(x) for x in table["train_flops"]]
  print(
    f"sweep {sweep.name}: {len(table)} runs -> {out_dir}"
    + (f"; population axes: {', '.join(sweep.population)}" if sweep.population else "")
  )
  print(show.to_string(index=False))
  print(
    f"total: {int(table['params'].sum()):,} parameters over all runs, "
    f"{grid.format_flops(float(table['train_flops'].sum()))} training FLOPs "
    f"(steps * B * T * (6 N + 12 L T C), N = non-embedding params + V C)"
  )


def main(args) -> int:
  """``mhc-jax sweep`` (args: sweep_file, out, set, dry_run, quiet, parallel, executor, dist
  flags)."""
  from mhc_jax.sweep import executor as ex, options as how

  raw_parallel = getattr(args, "parallel", None)
  parallel = how.parse_parallel(raw_parallel) if raw_parallel is not None else None
  sweep = grid.load_sweep(args.sweep_file, getattr(args, "set", None) or [])
  if parallel is None:
    parallel = sweep.options.get("parallel")
  kind, params = how.executor_options(
    sweep.options.get("executor"), getattr(args, "executor", None)
  )
  parallel_mode = parallel is not None or kind != "process"
  out_dir = Path(args.out) if args.out else Path("sweeps_out") / sweep.name
  if out_dir.exists() and not out_dir.is_dir():
    raise ConfigError(f"--out: {out_dir} is not a directory")
  if parallel_mode and not args.dry_run:
    flags = [
      f
      for f in ("coordinator", "num_processes", "process_id")
      if getattr(args, f, None) is not None
    ]
    if flags:
      raise ConfigError(
        f"--{flags[0].replace('_', '-')}: a parallel sweep trains each run in "
        f"its own single-process worker; multi-process flags are for a "
        f"sequential sweep (leave out --parallel / --executor)"
      )
    if kind == "slurm" and shutil.which("sbatch") is None:
      raise ConfigError("--executor slurm: sbatch not found; run the sweep on a SLURM login node")
    if kind == "slurm":
      n_devices = int(params.get("gpus_per_node") or params.get("slurm_gpus_per_node") or 1)
    else:
      n_devices = ex.make_slots(parallel or 1)[0].n_devices
    ex.check_runs(sweep, n_devices)  # the parent touches no device: workers get them
    return run_sweep(
      sweep,
      None,
      out_dir,
      progress=not getattr(args, "quiet", False),
      parallel=parallel or (None if kind == "slurm" else 1),
      executor=kind,
      executor_params=params,
    )
  if not args.dry_run:
    import dataclasses

    from mhc_jax.train.dist import init_distributed

    cfg = init_distributed(sweep.runs[0].cfg, args)
    if cfg.dist != sweep.runs[0].cfg.dist:
      sweep.runs = [
        dataclasses.replace(r, cfg=dataclasses.replace(r.cfg, dist=cfg.dist)) for r in sweep.runs
      ]
  setups = grid.prepare_runs(sweep)
  if args.dry_run:
    print_dry_run(sweep, setups, out_dir)
    return 0
  return run_sweep(sweep, setups, out_dir, progress=not getattr(args, "quiet", False))
