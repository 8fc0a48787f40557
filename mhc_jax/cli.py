"""``mhc-jax train | sweep | report | eval | coord-check | map``.

Bad input is one ``error: ...`` line and exit 2, before anything is written; the exit codes are
in :mod:`mhc_jax.errors`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from mhc_jax.errors import (
  EXIT_HALTED,
  EXIT_PREEMPTED,
  BadInput,
  Preempted,
  RunHalted,
  UsageError,
  report,
)


class _Parser(argparse.ArgumentParser):
  """argparse, but a bad flag is one ``error:`` line and exit 2 like every other bad input."""

  def error(self, message):
    sys.exit(report(f"{self.prog}: {message}"))


def _add_set_flag(p: argparse.ArgumentParser, text: str) -> None:
  p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE", help=text)


def _add_dist_flags(p: argparse.ArgumentParser) -> None:
  p.add_argument("--coordinator", help="host:port of process 0 (multi-process runs)")
  p.add_argument("--num-processes", type=int)
  p.add_argument("--process-id", type=int)


def _load(args):
  """The run's config: --config (+ --set), or the run directory's own for --resume."""
  from mhc_jax import rundir, storage
  from mhc_jax.train import config as C

  if args.resume:
    if args.out is None:
      raise UsageError("--resume needs --out RUN_DIR")
    rundir.check(args.out, resume=True)
  if args.config is not None:
    return C.load_config(args.config, args.set)
  if args.resume:
    try:
      return C.load_config(storage.path(args.out) / "config.yaml", args.set)
    except C.ConfigError as e:  # the mixer's class, say, cannot be imported any more
      raise C.ConfigError(f"{e}{rundir.mixer_note(args.out)}") from None
  raise UsageError("--config is required (e.g. --config configs/quickstart.yaml)")


def _claim(out, cfg, resume: bool):
  """Check ``out`` and lock it (process 0); every process raises process 0's verdict."""
  from mhc_jax import rundir, storage
  from mhc_jax.train import config as C, dist

  verdict, lock = "", None
  if dist.is_main():
    try:
      rundir.check(out, resume)
      if resume:
        saved = C.load_config(storage.path(out) / "config.yaml")
        if C.config_hash(saved) != C.config_hash(C.with_data_vocab(cfg, saved.model.vocab)):
          raise UsageError(f"--resume: the config differs from the one saved in {out}/config.yaml")
      lock = rundir.Lock(out).acquire()
    except BadInput as e:
      verdict = str(e)
  verdict = dist.broadcast_str(verdict)
  if verdict:
    raise UsageError(verdict)
  dist.sync("mhc-jax train: run directory checked")
  return lock


def cmd_train(args) -> int:
  from mhc_jax import rundir, storage
  from mhc_jax.train import dist
  from mhc_jax.train.config import config_hash
  from mhc_jax.train.loop import SingleProgram, prepare, train
  from mhc_jax.train.optim import peak_lr

  cfg = _load(args)
  cfg = dist.init_distributed(cfg, args)
  setup = prepare(cfg)
  if (o := cfg.optim).base_steps:  # the lr used is not optim.lr (docs/parametrization.md)
    t, b, e = cfg.train.steps, o.base_steps, o.steps_exponent
    print(f"peak lr {peak_lr(o, t):.4g} = optim.lr {o.lr:g} x ({t} / {b} steps)^-{e:g}")
  out = args.out or os.fspath(rundir.default_run_dir(setup.cfg.name, config_hash(setup.cfg)))
  out = storage.path(dist.broadcast_str(os.fspath(out)))  # process 0's default directory
  if args.dry_run:
    program = SingleProgram(setup)
    program.trace()
    p = program.params()
    rundir.check(out, args.resume)
    print(f"run directory: {out} (dry run: nothing written)")
    print(
      f"{setup.cfg.name}: {p['total']:,} parameters ({p['non_embedding']:,} non-embedding), "
      f"{setup.cfg.train.steps} steps of {setup.cfg.data.batch_size} x "
      f"{setup.cfg.data.seq_len} tokens on mesh {dict(setup.mesh.shape)}"
    )
    return 0
  lock = _claim(out, setup.cfg, args.resume)
  print(f"run directory: {out}", flush=True)
  try:
    summary = train(setup, out, resume=args.resume, progress=not args.quiet)
  except RunHalted as e:
    return report(f"run halted: {e}; checkpoint and logs in {out}", EXIT_HALTED)
  except Preempted as e:
    return report(f"{e}; resume with: mhc-jax train --out {out} --resume", EXIT_PREEMPTED)
  finally:
    if lock is not None:
      lock.release()
  if summary:
    print(
      f"done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}, "
      f"{summary['wall_s']:.1f}s"
    )
    print(f"logs: {out}/metrics.jsonl  events: {out}/events.jsonl  summary: {out}/summary.json")
  return 0


def cmd_report(args) -> int:
  from mhc_jax import storage
  from mhc_jax.sweep import report as rep

  path = storage.path(args.sweep_dir)
  if not path.is_dir():
    raise UsageError(f"report: {path} is not a directory")
  paths = rep.write_report(path, args.out)
  print(rep.screen(path, args.out))
  print(f"report: {paths['summary_md']}")
  return 0


def _main_of(module: str):
  """The command ``module.main(args)``, its module imported only when the command runs."""
  return lambda args: importlib.import_module(module).main(args)


def build_parser() -> argparse.ArgumentParser:
  ap = _Parser(prog="mhc-jax", description=__doc__.splitlines()[0])
  sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
  t = sub.add_parser("train", help="train one run")
  t.add_argument("--config", help="YAML config (configs/*.yaml)")
  _add_set_flag(t, "dotted overrides, e.g. model.depth=32 optim.lr=3e-3 (may be repeated)")
  _add_dist_flags(t)
  t.add_argument("--out", help="run directory (default runs/<name>/<time>-<hash>)")
  t.add_argument("--resume", action="store_true", help="continue the run in --out")
  t.add_argument(
    "--dry-run",
    action="store_true",
    help="validate, build and trace the step; print the size; write nothing",
  )
  t.add_argument("--quiet", action="store_true", help="no progress output")
  t.set_defaults(fn=cmd_train)
  r = sub.add_parser(
    "report", help="summary table, plots and Markdown page for a sweep (local or gs://)"
  )
  r.add_argument("sweep_dir")
  r.add_argument("--out", help="report directory (default SWEEP_DIR/report)")
  r.set_defaults(fn=cmd_report)
  s = sub.add_parser("sweep", help="run a grid of runs (resumable); see configs/sweeps/")
  s.add_argument("sweep_file", help="sweep YAML (configs/sweeps/*.yaml)")
  s.add_argument("--out", help="sweep directory (default sweeps_out/<name>)")
  _add_set_flag(s, "overrides applied to the base config of every run (may be repeated)")
  s.add_argument("--variant", help="which of the sweep file's variants (default: the first)")
  s.add_argument("--dry-run", action="store_true", help="list runs, parameter counts, FLOPs")
  s.add_argument("--quiet", action="store_true")
  s.add_argument(
    "--parallel",
    metavar="K",
    help="train up to K runs at once, each a submitit job on its own slice of the devices",
  )
  s.add_argument("--executor", help="where the jobs run: local (default with --parallel), slurm")
  _add_dist_flags(s)
  s.set_defaults(fn=_main_of("mhc_jax.sweep.runner"))
  e = sub.add_parser("eval", help="posterior fidelity and geometry probes on a run's checkpoint")
  e.add_argument("--run", required=True, help="run directory")
  e.add_argument("--batches", type=int, default=8, help="validation batches to average")
  e.add_argument("--series", action="store_true", help="each checkpoint -> geometry_series.csv")
  e.add_argument("--steps", help="--series: only these steps, comma-separated (0: the init)")
  e.set_defaults(fn=_main_of("mhc_jax.evaluate"))
  c = sub.add_parser("coord-check", help="activation/update RMS against width and depth")
  c.add_argument("mixer", help="a mixer name (its options: --set model.mixer_options.K=V)")
  c.add_argument("--config", help="base YAML config (default: the config defaults)")
  _add_set_flag(c, "overrides of the base config, e.g. optim.lr=1e-2 (may be repeated)")
  c.add_argument("--widths", default="32,64,128,256", help="comma-separated (at the depth)")
  c.add_argument("--depths", default="2,4,8,16", help="comma-separated (at the width)")
  c.add_argument("--steps", type=int, default=4, help="training steps at each size")
  c.add_argument(
    "--parametrization",
    help="sp, mup or completep (default: the config's); base sizes: the smallest checked",
  )
  c.add_argument("--out", required=True, help="a new directory for the CSV and the plot")
  c.add_argument("--quiet", action="store_true", help="no progress bar")
  c.set_defaults(fn=_main_of("mhc_jax.coord_check"))
  m = sub.add_parser("map", help="one design's row of the zoo's stability map (docs/sweeps.md)")
  m.add_argument("mixer", help="a mixer name or pkg.module:Class")
  _add_set_flag(m, "overrides, e.g. model.mixer_options.n=2 train.steps=300 (may be repeated)")
  m.add_argument("--parametrization", help="sp (the zoo's), mup or completep")
  m.add_argument("--depths", help="comma-separated (default 4,8,16: the zoo map's)")
  m.add_argument("--lrs", help="comma-separated (default 1e-3,3e-3,...,0.3,1: the zoo map's)")
  m.add_argument("--seeds", help="number of seeds (default 3)")
  m.add_argument("--reference", help="zoo map rows shown (default residual,mhc,hc), or all")
  m.add_argument("--out", help="sweep directory (default sweeps_out/map_<design>)")
  m.add_argument("--parallel", metavar="K", help="train up to K populations at once")
  m.add_argument("--executor", help="where the jobs run: local (default with --parallel), slurm")
  m.add_argument("--dry-run", action="store_true", help="runs, FLOPs, a time estimate")
  m.add_argument("--quiet", action="store_true")
  m.set_defaults(fn=_main_of("mhc_jax.sweep.design_map"))
  return ap


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.fn(args)
  except BadInput as e:
    return report(str(e))


if __name__ == "__main__":
  sys.exit(main())
