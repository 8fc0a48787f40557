"""``step_bench.py --mode compile``: the train step's compile time against depth, scanned blocks
against a Python loop over them (flat under ``nn.scan``).

Lowers and compiles the train step (train_step.build) at each of ``--depths``, the rest of the
shape from the command line; prints seconds per depth and the ratio deepest / shallowest. Each
figure is the median of ``--repeats`` fresh compiles (the in-memory compilation cache cleared),
the depths taken in turn within each repeat so that a load change on the machine hits both sides.
``--eager N`` first lowers and compiles N tiny programs (one short element-wise chain each, N
shapes): a compile's fixed cost, which the test suite pays thousands of times (tests/conftest.py).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import train_step

from mhc_jax.train.config import load_config


def compile_once(cfg) -> tuple[float, float]:
  """(wall, CPU) seconds to lower and compile one train step from a cleared cache."""
  fn, state, batch = train_step.build(cfg)
  jax.clear_caches()
  t0, c0 = time.perf_counter(), time.process_time()
  fn.lower(state, batch).compile()
  return time.perf_counter() - t0, time.process_time() - c0


def eager_compiles(n: int) -> tuple[float, float]:
  """(wall, CPU) seconds to lower and compile ``n`` tiny distinct programs from a cleared cache
  (CPU time: this process's, all threads; steadier than wall time on a shared machine)."""
  jax.clear_caches()
  t0, c0 = time.perf_counter(), time.process_time()
  for i in range(n):
    x = jax.ShapeDtypeStruct((i + 1,), jnp.float32)
    jax.jit(lambda x: jnp.sin(x) * 2.0 + 1.0).lower(x).compile()
  return time.perf_counter() - t0, time.process_time() - c0


def run(args, base: list[str], mixers: list[str]) -> None:
  """Compile times per mixer, scan (and loop unless ``--no-loop``), and depth."""
  if args.eager:
    wall, cpu = eager_compiles(args.eager)
    each = 1e3 * cpu / args.eager
    print(f"{args.eager} tiny programs: {wall:.2f} s, {cpu:.2f} CPU s ({each:.1f} CPU ms each)")
  ratios, cpu_total = {}, 0.0
  lo, hi = min(args.depths), max(args.depths)
  for name in mixers:
    for scan in [True] if args.no_loop else [True, False]:
      times = {d: [] for d in args.depths}
      for _ in range(args.repeats):
        for d in args.depths:
          ov = [f"model.mixer={name}", *train_step.streams(name, args.n)]
          ov += [f"model.depth={d}", f"model.scan={str(scan).lower()}"]
          times[d].append(compile_once(load_config(None, base + ov)))
      secs = {d: statistics.median(w for w, _ in t) for d, t in times.items()}
      cpus = {d: statistics.median(c for _, c in t) for d, t in times.items()}
      cpu_total += sum(cpus.values())
      for d in args.depths:
        print(
          f"  {name:>14} scan={scan!s:5} depth={d:3d}: compile {secs[d]:6.2f} s, "
          f"{cpus[d]:6.2f} CPU s",
          flush=True,
        )
      ratios[(name, scan)] = secs[hi] / secs[lo]
      print(f"{name} scan={scan}: compile ratio depth {hi} / depth {lo} = {ratios[name, scan]:.2f}")
  print(f"CPU seconds over all rows (medians): {cpu_total:.2f}")
  if len(mixers) > 1:
    worst = max((r, n) for (n, s), r in ratios.items() if s)
    print(f"worst scanned ratio: {worst[1]} {worst[0]:.2f}")
