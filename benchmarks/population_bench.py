"""Population step vs sequential runs: median step time of one program training P learning
rates at once (vmapped) against P separate jitted steps (what P separate runs execute).

    python benchmarks/population_bench.py                      # P=4, mhc, depth 4, width 64
    python benchmarks/population_bench.py --members 8 --width 128 --seq-len 128
    python benchmarks/population_bench.py --set model.remat=none     # any config override
    python benchmarks/population_bench.py --parts      # and where each program's op time goes
    python benchmarks/population_bench.py --dots       # and the programs' dots alone

Every side runs the same train step (train.step.make_train_step, per-layer diagnostics off) on
the same batch, on whatever devices JAX sees (mesh from the config: data-parallel over all).
All programs are compiled first, then timed round-robin: each of ``--steps`` rounds (after
``--warmup`` untimed ones) runs one step of every population mode and one step of each of the
P runs, each step blocked on. A speed-up is the median over rounds of that round's P
sequential steps over its population step, so the VM's speed drifting during the run cancels
out of it. Compile times are reported separately: a population compiles once, P runs P times.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import numpy as np
import step_dots
import step_profile
from timing import round_robin, timed

from mhc_jax.sweep import population
from mhc_jax.train import sharding as sh
from mhc_jax.train.config import load_config, with_overrides
from mhc_jax.train.loop import host_batch, prepare
from mhc_jax.train.optim import make_optimizer
from mhc_jax.train.state import create_state
from mhc_jax.train.step import make_train_step


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--members", type=int, default=4)
  ap.add_argument("--mixer", default="mhc")
  ap.add_argument("--depth", type=int, default=4)
  ap.add_argument("--width", type=int, default=64)
  ap.add_argument("--seq-len", type=int, default=64)
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--modes", default="vmap", help="population modes, comma list (vmap)")
  ap.add_argument("--set", nargs="*", default=[], help="further config overrides (KEY=VALUE)")
  ap.add_argument(
    "--parts",
    action="store_true",
    help="then profile each population mode and one run's step: op time by part of the model "
    "(step_bench.py --mode profile)",
  )
  ap.add_argument(
    "--dots",
    action="store_true",
    help="then time each program's dots alone (benchmarks/step_dots.py): the speed-up the "
    "population's matrix products give by themselves",
  )
  args = ap.parse_args(argv)
  modes = [m for m in args.modes.split(",") if m]
  if modes != ["vmap"]:
    ap.error(f"--modes: the one population mode is vmap; got {args.modes!r}")

  lrs = list(np.geomspace(1e-3, 3e-2, args.members))
  base = load_config(
    "configs/quickstart.yaml",
    [
      f"model.mixer={args.mixer}",
      "model.mixer_options={}",
      f"model.depth={args.depth}",
      f"model.width={args.width}",
      f"model.heads={max(1, args.width // 32)}",
      f"data.seq_len={args.seq_len}",
      f"data.batch_size={args.batch}",
      "train.diag_every=0",
      "optim.warmup_steps=0",
      *args.set,
    ],
  )
  setups = [prepare(with_overrides(base, {"optim.lr": float(lr)})) for lr in lrs]
  cfg, mesh, source = setups[0].cfg, setups[0].mesh, setups[0].source
  batch = sh.put_batch(host_batch(source, cfg, 0), mesh)
  tokens = cfg.data.batch_size * cfg.data.seq_len
  print(
    f"{jax.device_count()} x {jax.devices()[0].device_kind}; {args.mixer} depth {args.depth} "
    f"width {args.width}, {args.batch} x {args.seq_len} tokens per step, "
    f"{args.members} learning rates"
  )

  lr_arr = jax.device_put(np.asarray(lrs, np.float32), sh.replicated(mesh))
  active = jax.device_put(np.ones(args.members, bool), sh.replicated(mesh))
  calls, compile_s, hlo = {}, {}, {}  # hlo: the compiled program's text, for --parts

  def first_call(name, fn):
    compile_s[name] = timed(fn)
    calls[name] = fn

  # the population: one program per mode
  for mode in modes:
    prog = population.programs(cfg, mesh, args.members, stacked_batch=False)
    box = {"s": prog.init_all([s.cfg for s in setups])}

    def pop_step(prog=prog, box=box):
      box["s"], m = prog.step(box["s"], lr_arr, active, batch, False)
      return m["loss"]

    first_call(f"population ({mode})", pop_step)
    hlo[f"population ({mode})"] = lambda prog=prog, box=box: (
      prog.step.lower(box["s"], lr_arr, active, batch, False).compile().as_text()
    )

  # P separate runs: each its own compiled step with its lr a constant (as train() builds it)
  model = prog.model
  for i, s in enumerate(setups):
    tx, schedule = make_optimizer(s.cfg.optim, s.cfg.train.steps)
    st, shard = create_state(model, prog.example, tx, mesh, s.cfg.train.seed)
    fn = jax.jit(
      make_train_step(model, tx, schedule, s.cfg),
      static_argnums=2,
      donate_argnums=0,
      out_shardings=(shard, sh.replicated(mesh)),
    )
    holder = {"s": st}

    def one_step(fn=fn, holder=holder):
      holder["s"], m = fn(holder["s"], batch, False)
      return m["loss"]

    first_call(f"run {i}", one_step)
    hlo[f"run {i}"] = lambda fn=fn, holder=holder: (
      fn.lower(holder["s"], batch, False).compile().as_text()
    )

  times = round_robin(calls, args.steps, args.warmup)
  runs = [k for k in calls if k.startswith("run ")]
  seq = [sum(times[k][r] for k in runs) for r in range(args.steps)]
  seq_compile = sum(compile_s[k] for k in runs)
  print(
    f"{args.members} sequential runs: median step {statistics.median(seq) / args.members * 1e3:.1f}"
    f" ms each, {statistics.median(seq) * 1e3:.1f} ms for all {args.members} "
    f"({args.members * tokens / statistics.median(seq):,.0f} tokens/s); first calls (compile) "
    f"{seq_compile:.1f} s in all"
  )
  for k in calls:
    if k in runs:
      continue
    med = statistics.median(times[k])
    speedup = statistics.median(a / b for a, b in zip(seq, times[k]))
    print(
      f"{k} of {args.members}: median step {med * 1e3:.1f} ms "
      f"({args.members * tokens / med:,.0f} tokens/s over all members), speed-up "
      f"{speedup:.2f}x per step; first call (compile) {compile_s[k]:.1f} s, "
      f"{seq_compile / compile_s[k]:.2f}x faster than the {args.members} runs'"
    )
  if args.parts:
    for k in [k for k in calls if k not in runs] + ["run 0"]:
      text = hlo[k]()
      total, _, places = step_profile.op_times(lambda k=k: jax.block_until_ready(calls[k]()), text)
      print(f"-- {k}, one step under jax.profiler")
      step_profile.print_parts(total, places, step_profile.sliced_fusions(text))
  if args.dots:
    dots_alone(cfg, setups, mesh, batch, modes, args)


def dots_alone(cfg, setups, mesh, batch, modes, args) -> None:
  """Each population mode's dots and one run's, read from the loop-form programs (every dot
  once in the HLO) and timed alone round-robin: P x one run's dots over the population's."""
  p = len(setups)
  cfg = with_overrides(cfg, {"model.scan": False})
  rep = sh.replicated(mesh)
  lr_arr = jax.device_put(np.asarray([s.cfg.optim.lr for s in setups], np.float32), rep)
  active = jax.device_put(np.ones(p, bool), rep)
  sets = {}
  for mode in modes:
    prog = population.programs(cfg, mesh, p, stacked_batch=False)
    state = prog.init_all([with_overrides(s.cfg, {"model.scan": False}) for s in setups])
    text = prog.step.lower(state, lr_arr, active, batch, False).compile().as_text()
    sets[f"population ({mode})"] = step_dots.hlo_dots(text)
  model, example = prog.model, prog.example  # the loop-form model, the same in every mode
  tx, schedule = make_optimizer(cfg.optim, cfg.train.steps)
  state, _ = create_state(model, example, tx, mesh, cfg.train.seed)
  step = jax.jit(make_train_step(model, tx, schedule, cfg), static_argnums=2)
  sets["run"] = step_dots.hlo_dots(step.lower(state, batch, False).compile().as_text())
  times = step_dots.time_dots(list(sets.values()), args.steps, args.warmup)
  for net in (False, True):  # as timed; less one dispatch of a jitted call per dot
    seq = [p * t for t in step_dots.alone_per_round(sets["run"], times, net)]
    print(
      f"-- dots alone{', less one dispatch per dot' if net else ''} (benchmarks/step_dots.py): "
      f"one run {sum(sets['run'].values())} dots, {statistics.median(seq) / p * 1e3:.1f} ms; "
      f"{p} runs {statistics.median(seq) * 1e3:.1f} ms"
    )
    for k in sets:
      if k != "run":
        pop = step_dots.alone_per_round(sets[k], times, net)
        print(
          f"{k}: {sum(sets[k].values())} dots, {statistics.median(pop) * 1e3:.1f} ms, speed-up "
          f"{statistics.median(a / b for a, b in zip(seq, pop)):.2f}x over the {p} runs' dots"
        )


if __name__ == "__main__":
  main()
