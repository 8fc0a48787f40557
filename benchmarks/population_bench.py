"""Population step vs sequential runs: median step time of one vmapped program training P
learning rates at once, against P separate jitted steps (what P separate runs execute).

    python benchmarks/population_bench.py                      # P=4, mhc, depth 4, width 64
    python benchmarks/population_bench.py --members 8 --width 128 --seq-len 128
    python benchmarks/population_bench.py --set model.remat=none     # any config override
    python benchmarks/population_bench.py --set train.population_mode=unroll   # no vmap

Both sides run the same train step (train.step.make_train_step, per-layer diagnostics off)
on the same batch, on whatever devices JAX sees (mesh from the config: data-parallel over all).
Times are medians over --steps timed steps after --warmup untimed ones, each step blocked on.
Compile times are reported separately: a population compiles once, P runs compile P times.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import numpy as np
from timing import median_time

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
  ap.add_argument("--set", nargs="*", default=[], help="further config overrides (KEY=VALUE)")
  args = ap.parse_args(argv)

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

  # the population: one program
  prog = population.programs(cfg, mesh, args.members, stacked_batch=False)
  state = {"s": prog.init_all([s.cfg for s in setups])}
  lr_arr = jax.device_put(np.asarray(lrs, np.float32), sh.replicated(mesh))
  active = jax.device_put(np.ones(args.members, bool), sh.replicated(mesh))

  def pop_step():
    state["s"], m = prog.step(state["s"], lr_arr, active, batch, False)
    return m["loss"]

  pop_first, pop_med = median_time(pop_step, args.steps, args.warmup)

  # P separate runs: each its own compiled step with its lr a constant (as train() builds it)
  seq_first, seq_med = [], []
  for s in setups:
    model = prog.model
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

    f, m = median_time(one_step, args.steps, args.warmup)
    seq_first.append(f)
    seq_med.append(m)

  seq_total = sum(seq_med)
  print(
    f"population of {args.members}: median step {pop_med * 1e3:.1f} ms "
    f"({args.members * tokens / pop_med:,.0f} tokens/s over all members); "
    f"first call (compile) {pop_first:.1f} s"
  )
  print(
    f"{args.members} sequential runs: median step {statistics.mean(seq_med) * 1e3:.1f} ms each, "
    f"{seq_total * 1e3:.1f} ms for all {args.members} "
    f"({args.members * tokens / seq_total:,.0f} tokens/s); first calls (compile) "
    f"{sum(seq_first):.1f} s in all"
  )
  print(
    f"speed-up of the population: {seq_total / pop_med:.2f}x per step, "
    f"{sum(seq_first) / pop_first:.2f}x in compile time"
  )


if __name__ == "__main__":
  main()
