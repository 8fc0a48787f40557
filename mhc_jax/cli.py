"""``mhc-jax train | sweep | report | eval | bench``.

Bad input (config, flags, paths) prints one ``error: ...`` line naming what is wrong and exits
with code 2, before anything is written. A run halted by policy exits 3; SIGTERM exits 143
after saving a checkpoint (resume with ``--resume``).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

EXIT_BAD_INPUT, EXIT_HALTED, EXIT_PREEMPTED = 2, 3, 143


class UsageError(Exception):
  """Bad input that is not a config key (paths, flags): exit 2."""


def _fail(msg: str, code: int = EXIT_BAD_INPUT) -> int:
  print(f"error: {msg}", file=sys.stderr)
  return code


def _add_run_flags(p: argparse.ArgumentParser) -> None:
  p.add_argument("--config", help="YAML config (configs/*.yaml)")
  p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                 help="dotted overrides, e.g. model.depth=32 optim.lr=3e-3")


def _add_dist_flags(p: argparse.ArgumentParser) -> None:
  p.add_argument("--coordinator", help="host:port of process 0 (multi-process runs)")
  p.add_argument("--num-processes", type=int)
  p.add_argument("--process-id", type=int)


def init_distributed(cfg, args) -> object:
  """``jax.distributed.initialize`` when the config, flags or MHC_* environment ask for it."""
  import dataclasses

  from mhc_jax.train.config import ConfigError, resolve_dist
  dist = cfg.dist
  flags = {"coordinator": args.coordinator, "num_processes": args.num_processes,
           "process_id": args.process_id}
  flags = {k: v for k, v in flags.items() if v is not None}
  if flags:
    dist = dataclasses.replace(dist, enabled=True, **flags)
  dist = resolve_dist(dist)
  if not dist.enabled:
    return cfg
  missing = [k for k in ("coordinator", "num_processes", "process_id") if getattr(dist, k) is None]
  if missing:
    raise ConfigError(f"dist.{missing[0]}: required for a multi-process run")
  import jax
  if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(dist.coordinator, dist.num_processes, dist.process_id)
  return dataclasses.replace(cfg, dist=dist)


def default_run_dir(cfg) -> Path:
  """runs/<name>/<timestamp>-<config hash>: never an existing directory."""
  from mhc_jax.train.config import config_hash
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  base = Path("runs") / cfg.name / f"{stamp}-{config_hash(cfg)}"
  path, i = base, 1
  while path.exists():
    path, i = base.with_name(f"{base.name}-{i}"), i + 1
  return path


def check_run_dir(path: Path, resume: bool) -> None:
  if path.exists() and not path.is_dir():
    raise UsageError(f"--out: {path} exists and is not a directory")
  if resume:
    if not (path / "config.yaml").exists():
      raise UsageError(f"--resume: {path} is not a run directory (no config.yaml)")
  elif path.exists() and any(path.iterdir()):
    raise UsageError(f"--out: {path} already holds a run; pass --resume to continue it or "
                     f"choose another directory (runs are never overwritten)")


def same_on_all_processes(path: Path) -> Path:
  """Process 0's ``path`` on every process of a multi-process run (a default run directory
  holds the time of day, which processes need not agree on)."""
  import jax
  if jax.process_count() == 1:
    return path
  import numpy as np
  from jax.experimental import multihost_utils
  raw = np.zeros(4096, np.uint8)
  name = os.fsencode(path)
  if len(name) > raw.size:
    raise UsageError(f"--out: path longer than {raw.size} bytes")
  raw[:len(name)] = np.frombuffer(name, np.uint8)
  raw = np.asarray(multihost_utils.broadcast_one_to_all(raw))
  return Path(os.fsdecode(raw.tobytes().rstrip(b"\0")))


def cmd_train(args) -> int:
  from mhc_jax.train import config as C
  from mhc_jax.train.loop import Preempted, RunHalted, prepare, train
  out = Path(args.out) if args.out else None
  if args.resume and out is None:
    raise UsageError("--resume needs --out RUN_DIR")
  if args.resume and args.config is None:
    cfg = C.load_config(out / "config.yaml", args.set)
  elif args.config is None:
    raise UsageError("--config is required (e.g. --config configs/quickstart.yaml)")
  else:
    cfg = C.load_config(args.config, args.set)
  cfg = init_distributed(cfg, args)
  out = same_on_all_processes(out or default_run_dir(cfg))
  check_run_dir(out, args.resume)
  if args.resume:
    saved = C.load_config(out / "config.yaml")
    if C.config_hash(saved) != C.config_hash(C.with_data_vocab(cfg, saved.model.vocab)):
      raise UsageError(f"--resume: the config differs from the one saved in {out}/config.yaml")
  import jax
  if jax.process_count() > 1:  # every process checks the directory before any writes to it
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("mhc-jax train: run directory checked")
  setup = prepare(cfg)
  print(f"run directory: {out}", flush=True)
  try:
    summary = train(setup, out, resume=args.resume, progress=not args.quiet)
  except RunHalted as e:
    return _fail(f"run halted: {e}; checkpoint and logs in {out}", EXIT_HALTED)
  except Preempted as e:
    return _fail(f"{e}; resume with: mhc-jax train --out {out} --resume", EXIT_PREEMPTED)
  if summary:
    print(f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
          f"{summary['wall_s']:.1f}s")
    print(f"logs: {out}/metrics.jsonl  events: {out}/events.jsonl  summary: {out}/summary.json")
  return 0


def cmd_report(args) -> int:
  from mhc_jax.sweep import report
  path = Path(args.sweep_dir)
  if not path.is_dir():
    raise UsageError(f"report: {path} is not a directory")
  paths = report.write_report(path, args.out)
  table = report.summary_table(path)
  print(table.to_string(index=False))
  print(f"report: {paths['index_html']}")
  return 0


def cmd_sweep(args) -> int:
  from mhc_jax.sweep import runner
  return runner.main(args)


def cmd_eval(args) -> int:
  from mhc_jax import evaluate
  return evaluate.main(args)


def build_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="mhc-jax", description=__doc__.splitlines()[0])
  sub = ap.add_subparsers(dest="cmd", required=True)
  t = sub.add_parser("train", help="train one run")
  _add_run_flags(t)
  _add_dist_flags(t)
  t.add_argument("--out", help="run directory (default runs/<name>/<time>-<hash>)")
  t.add_argument("--resume", action="store_true", help="continue the run in --out")
  t.add_argument("--quiet", action="store_true", help="no progress output")
  t.set_defaults(fn=cmd_train)
  r = sub.add_parser("report", help="summary table, plots and HTML page for a sweep")
  r.add_argument("sweep_dir")
  r.add_argument("--out", help="report directory (default SWEEP_DIR/report)")
  r.set_defaults(fn=cmd_report)
  s = sub.add_parser("sweep", help="run a grid of runs (resumable); see configs/sweeps/")
  s.add_argument("sweep_file", help="sweep YAML (configs/sweeps/*.yaml)")
  s.add_argument("--out", help="sweep directory (default sweeps_out/<name>)")
  s.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                 help="overrides applied to the base config of every run")
  s.add_argument("--dry-run", action="store_true", help="list runs, parameter counts, FLOPs")
  s.add_argument("--quiet", action="store_true")
  _add_dist_flags(s)
  s.set_defaults(fn=cmd_sweep)
  e = sub.add_parser("eval", help="posterior fidelity and geometry probes on a run's checkpoint")
  e.add_argument("--run", required=True, help="run directory")
  e.add_argument("--batches", type=int, default=8, help="validation batches to average")
  e.set_defaults(fn=cmd_eval)
  return ap


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  from mhc_jax.train.config import ConfigError
  try:
    return args.fn(args)
  except (ConfigError, UsageError) as e:
    return _fail(str(e))


if __name__ == "__main__":
  sys.exit(main())
