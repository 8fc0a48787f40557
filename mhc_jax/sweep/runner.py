"""``mhc-jax sweep FILE [--out DIR] [--set K=V ...] [--dry-run]``: run a sweep, resumably.

The sweep directory (default ``sweeps_out/<name>``) holds::

    manifest.json   {"name", "sweep_file", "base", "set", "axes", "population",
                     "base_config" (base + set, resolved), "updated",
                     "runs": {name: {"status": "pending" | "running" | "done" | "failed",
                                     "overrides": {axis key: value}, "dir": "runs/<name>",
                                     "error" (failed runs), "wall_s", "final_loss" (finished)}}}
    runs/<name>/    a normal run directory (train.loop.train or a population member)
    report/         the report (mhc_jax.sweep.report.write_report): index.html, summary.md ...

``manifest.json`` is rewritten atomically (temp file + os.replace) after every status change,
by process 0 only. Every run's config is validated, and the manifest checked against the
sweep file, before anything is written (ConfigError: exit 2).

Re-running a sweep continues it: ``done`` and ``failed`` runs are kept as they are; any other
run is trained, resuming from its newest checkpoint when its directory has one (the logs past
the checkpoint are dropped first, so every step is logged once) and restarting from scratch
when it has none. A failed run (an exception, or halted by policy: non-finite values,
divergence) records its error and the sweep goes on; to retry it, delete its run directory.
A finished sweep prints that all runs are done, writes nothing, and exits 0.

A changed sweep file: a sweep directory belongs to one base config (base file + ``set`` +
``--set``) and one set of axis keys. Changing the base config or the axis keys is an error
naming the changed key (use another ``--out``); adding values to an axis adds only the new
runs; runs whose values were removed stay in the manifest and the report.

With ``population`` in the sweep file, runs that differ only in the population axes train as
one vmapped program (mhc_jax.sweep.population); a group of one trains as a normal run.

Exit codes: 0 every run done; 1 some run failed (the report is still written); 2 bad input;
143 SIGTERM (checkpoints saved; re-run to continue).
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

from mhc_jax import logs
from mhc_jax.sweep import grid
from mhc_jax.train.config import ConfigError

__all__ = ["main", "run_sweep", "plan", "read_manifest", "write_manifest", "prepare_run_dir",
           "print_dry_run"]

EXIT_FAILED, EXIT_PREEMPTED = 1, 143
TABLE_COLUMNS = ["status", "steps", "final_loss", "spike_count", "max_grad_norm",
                 "amax_fwd_composite_max", "amax_bwd_composite_max", "kl_bits", "nonfinite"]


def _is_main() -> bool:
  import jax
  return jax.process_index() == 0


# ------------------------------------------------------------------------------------------
# The manifest.

def read_manifest(out_dir: str | os.PathLike) -> dict | None:
  path = Path(out_dir) / "manifest.json"
  if not path.exists():
    return None
  try:
    m = json.loads(path.read_text())
  except ValueError as e:
    raise ConfigError(f"--out: {path} is not valid JSON ({e})") from None
  if not isinstance(m, dict) or not isinstance(m.get("runs"), dict):
    raise ConfigError(f"--out: {path} is not a sweep manifest (no 'runs' mapping)")
  return m


def write_manifest(out_dir: str | os.PathLike, manifest: dict) -> None:
  """Atomically replace ``out_dir/manifest.json`` (process 0 only)."""
  if not _is_main():
    return
  out_dir = Path(out_dir)
  manifest["updated"] = datetime.datetime.now().isoformat(timespec="seconds")
  tmp = out_dir / f".manifest.json.tmp{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(json.dumps(manifest, indent=1, default=str))
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, out_dir / "manifest.json")


def _same(a, b) -> bool:
  return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _check_compatible(old: dict, sweep: grid.Sweep, out_dir: Path) -> None:
  """ConfigError naming the first key where `sweep` differs from the one that made `out_dir`."""
  where = (f"since {out_dir} was made; its runs would mix configs. Use another --out, or undo "
           f"the change")
  old_axes = old.get("axes") or {}
  for k in sweep.axes:
    if k not in old_axes:
      raise ConfigError(f"axes.{k}: a new axis {where}")
  for k in old_axes:
    if k not in sweep.axes:
      raise ConfigError(f"axes.{k}: axis removed {where}")
  before = logs.flatten_dict(old.get("base_config") or {})
  now = logs.flatten_dict(sweep.base_config)
  for k in sorted(set(before) & set(now)):   # a key only one side has is a code change
    if k.startswith("dist.") or k == "name":
      continue
    if not _same(before[k], now[k]):
      raise ConfigError(f"{k}: changed from {before[k]!r} to {now[k]!r} (sweep file 'set', its "
                        f"base config or --set) {where}")
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
    runs[r.name] = dict(prev) if prev else {"status": "pending", "overrides": r.overrides,
                                            "dir": f"runs/{r.name}"}
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
      "name": sweep.name, "sweep_file": str(sweep.path) if sweep.path else None,
      "base": str(sweep.base_path) if sweep.base_path else None, "set": sweep.set,
      "axes": sweep.axes, "population": list(sweep.population), "base_config": sweep.base_config,
      "runs": runs,
  }
  return manifest, todo, notes


def prepare_run_dir(run_dir: Path, cfg) -> str:
  """What to do with a run directory: ``"fresh"`` (none, or one without a checkpoint, which is
  then deleted so nothing of the earlier attempt remains), ``"resume"`` (it has a checkpoint),
  or ``"done"`` (summary.json says done and the last checkpoint is the final step)."""
  from mhc_jax.rundir import checkpoint_steps as _ckpt_steps
  if not run_dir.exists():
    return "fresh"
  steps = _ckpt_steps(run_dir)
  if not steps:
    if _is_main():
      shutil.rmtree(run_dir)
    return "fresh"
  try:
    summary = json.loads((run_dir / "summary.json").read_text())
  except (OSError, ValueError):
    summary = {}
  if summary.get("status") == "done" and max(steps) == cfg.train.steps:
    return "done"
  return "resume"


# ------------------------------------------------------------------------------------------
# Running.

def _say(msg: str) -> None:
  if _is_main():
    print(msg, flush=True)


def run_sweep(sweep: grid.Sweep, setups: dict, out_dir: str | os.PathLike, *,
              progress: bool = True) -> int:
  """Train every unfinished run of `sweep` into `out_dir`, then write the report."""
  from mhc_jax.sweep import population
  from mhc_jax.train.loop import Preempted, RunHalted, train

  out_dir = Path(out_dir)
  manifest, todo, notes = plan(sweep, out_dir)
  runs = manifest["runs"]
  n_total = len(sweep.runs)
  counts = {s: sum(1 for r in sweep.runs if runs[r.name]["status"] == s) for s in ("done", "failed")}
  for note in notes:
    _say(f"note: {note}")
  if not todo:
    _say(f"sweep {sweep.name}: all {n_total} runs are finished ({counts['done']} done, "
         f"{counts['failed']} failed); nothing to do in {out_dir}")
    index = out_dir / "report" / "index.html"
    if _is_main() and not index.exists():
      _finish(out_dir)
    elif _is_main():
      _print_table(out_dir)
      print(f"report: {index}")
    return EXIT_FAILED if counts["failed"] else 0
  if _is_main():
    out_dir.mkdir(parents=True, exist_ok=True)
  write_manifest(out_dir, manifest)
  _say(f"sweep {sweep.name}: {n_total} runs ({counts['done']} done, {counts['failed']} failed, "
       f"{len(todo)} to run) in {out_dir}")

  def record(name, status, t0, summary=None, error=None, wall=None):
    info = runs[name]
    info["status"] = status
    info["wall_s"] = round(time.perf_counter() - t0 if wall is None else wall, 2)
    info.pop("error", None)
    if error:
      info["error"] = error
    if summary and "final_loss" in summary:
      info["final_loss"] = summary["final_loss"]
    write_manifest(out_dir, manifest)
    loss = summary.get("final_loss") if summary else None
    tail = f" (final loss {loss:.4f})" if isinstance(loss, float) else ""
    tail += f": {error}" if error else ""
    _say(f"[{order[name]}/{len(todo)}] {name}: {status} in {info['wall_s']:.1f}s{tail}")

  order = {name: i + 1 for i, name in enumerate(todo)}
  for group in grid.population_groups(sweep, todo):
    # Done-but-unrecorded runs (killed between finishing and the manifest write).
    live = []
    for r in group:
      rdir = out_dir / runs[r.name]["dir"]
      how = prepare_run_dir(rdir, setups[r.name].cfg)
      if how == "done":
        summary = json.loads((rdir / "summary.json").read_text())
        record(r.name, "done", 0.0, summary, wall=float(summary.get("wall_s") or 0.0))
      else:
        live.append((r, rdir, how))
    if not live:
      continue
    _sync("sweep-dirs")
    t0 = time.perf_counter()
    for r, _, how in live:
      runs[r.name]["status"] = "running"
      step = max(population._ckpt_steps(out_dir / runs[r.name]["dir"]), default=0)
      what = f"resuming from step {step}" if how == "resume" else "starting"
      _say(f"[{order[r.name]}/{len(todo)}] {r.name}: {what}"
           + (f" (population of {len(live)})" if len(live) > 1 else ""))
    write_manifest(out_dir, manifest)
    try:
      if len(live) == 1:
        r, rdir, how = live[0]
        try:
          results = [train(setups[r.name], rdir, resume=how == "resume", progress=progress)]
        except RunHalted as e:
          results = [e]
      else:
        results = population.train_population([setups[r.name] for r, _, _ in live],
                                              [d for _, d, _ in live], resume=True,
                                              progress=progress)
    except Preempted as e:
      for r, _, _ in live:
        runs[r.name].update(status="pending", error=f"preempted: {e}")
      write_manifest(out_dir, manifest)
      _say(f"sweep {sweep.name}: {e}; re-run the same command to continue")
      return EXIT_PREEMPTED
    except Exception as e:  # noqa: BLE001 - a failed run must not stop the sweep
      if _is_main():
        traceback.print_exc()
      for r, _, _ in live:
        record(r.name, "failed", t0, error=f"{type(e).__name__}: {e}")
      continue
    for (r, _, _), res in zip(live, results):
      if isinstance(res, RunHalted):
        record(r.name, "failed", t0, error=f"halted: {res}")
      else:
        record(r.name, "done", t0, res)
  return _finish(out_dir)


def _sync(name: str) -> None:
  import jax
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def _print_table(out_dir: Path) -> None:
  from mhc_jax.sweep import report
  table = report.summary_table(out_dir)
  ids = [c for c in table.attrs.get("id_columns", ["run"]) if c in table.columns]
  cols = ids + [c for c in TABLE_COLUMNS if c in table.columns and c not in ids]
  print(report._md_table(table[cols]), end="")


def _finish(out_dir: Path) -> int:
  """Write the report, print the summary table and the page's path (process 0)."""
  if not _is_main():
    return 0
  from mhc_jax.sweep import report
  paths = report.write_report(out_dir)
  _print_table(out_dir)
  print(f"report: {paths['index_html']}", flush=True)
  m = read_manifest(out_dir) or {"runs": {}}
  failed = [n for n, i in m["runs"].items() if i.get("status") == "failed"]
  if failed:
    print(f"{len(failed)} run(s) failed: {', '.join(failed)} (errors in manifest.json)")
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
  print(f"sweep {sweep.name}: {len(table)} runs -> {out_dir}"
        + (f"; population axes: {', '.join(sweep.population)}" if sweep.population else ""))
  print(show.to_string(index=False))
  print(f"total: {int(table['params'].sum()):,} parameters over all runs, "
        f"{grid.format_flops(float(table['train_flops'].sum()))} training FLOPs "
        f"(steps * B * T * (6 N + 12 L T C), N = non-embedding params + V C)")


def main(args) -> int:
  """``mhc-jax sweep`` (args: sweep_file, out, set, dry_run, quiet, dist flags)."""
  sweep = grid.load_sweep(args.sweep_file, getattr(args, "set", None) or [])
  if not args.dry_run:
    import dataclasses

    from mhc_jax.train.dist import init_distributed
    cfg = init_distributed(sweep.runs[0].cfg, args)
    if cfg.dist != sweep.runs[0].cfg.dist:
      sweep.runs = [dataclasses.replace(r, cfg=dataclasses.replace(r.cfg, dist=cfg.dist))
                    for r in sweep.runs]
  setups = grid.prepare_runs(sweep)
  out_dir = Path(args.out) if args.out else Path("sweeps_out") / sweep.name
  if out_dir.exists() and not out_dir.is_dir():
    raise ConfigError(f"--out: {out_dir} is not a directory")
  if args.dry_run:
    print_dry_run(sweep, setups, out_dir)
    return 0
  return run_sweep(sweep, setups, out_dir, progress=not getattr(args, "quiet", False))


if __name__ == "__main__":  # pragma: no cover
  from mhc_jax.cli import main as _cli
  sys.exit(_cli(["sweep", *sys.argv[1:]]))
