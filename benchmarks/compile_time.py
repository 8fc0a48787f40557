"""Compile time of the train step against depth, scan vs Python loop (issue: flat under scan).

    .venv/bin/python benchmarks/compile_time.py [--depths 4 32] [--mixer mhc]
    .venv/bin/python benchmarks/compile_time.py --mixer all --no-loop --repeats 1  # every mixer
    .venv/bin/python benchmarks/compile_time.py --depths 2 --no-loop --eager 200  # + tiny programs

Lowers and compiles one value_and_grad step of the Transformer (width 64, 4 heads, seq 64,
batch 8) at each depth; prints seconds per depth and the ratio deepest / shallowest. Each
measurement is the median of --repeats fresh compiles (the compilation cache is cleared), the
depths taken in turn within each repeat so that a load change on the machine hits both sides.
``--eager N`` first lowers and compiles N tiny programs (one short element-wise chain each, N
shapes): a compile's fixed cost, which the test suite pays thousands of times (tests/conftest.py).
"""

import argparse
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from mhc_jax.model import Transformer
from mhc_jax.train.config import ModelConfig


def compile_once(cfg: ModelConfig) -> tuple[float, float]:
  """(wall, CPU) seconds to lower and compile one value_and_grad step from a cleared cache."""
  model = Transformer(cfg)
  tokens = jnp.zeros((8, 64), jnp.int32)
  params = jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.PRNGKey(0), tokens)))

  def loss(p, t):
    logits, _ = model.apply(p, t)
    return jnp.mean(jax.nn.logsumexp(logits, -1))

  jax.clear_caches()
  t0, c0 = time.perf_counter(), time.process_time()
  jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile()
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


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--depths", type=int, nargs="+", default=[4, 32])
  ap.add_argument("--mixer", default="mhc", help="a registered mixer, or 'all'")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--no-loop", action="store_true", help="skip the Python-loop comparison")
  ap.add_argument("--eager", type=int, default=0, help="first compile this many tiny programs")
  args = ap.parse_args()
  from mhc_jax import mixers

  names = mixers.names() if args.mixer == "all" else [args.mixer]
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
  if args.eager:
    wall, cpu = eager_compiles(args.eager)
    each = 1e3 * cpu / args.eager
    print(f"{args.eager} tiny programs: {wall:.2f} s, {cpu:.2f} CPU s ({each:.1f} CPU ms each)")
  ratios, cpu_total = {}, 0.0
  for name in names:
    for scan in [True] if args.no_loop else [True, False]:
      times = {d: [] for d in args.depths}
      for _ in range(args.repeats):
        for d in args.depths:
          cfg = ModelConfig(vocab=256, depth=d, width=64, heads=4, mixer=name, scan=scan)
          times[d].append(compile_once(cfg))
      secs = {d: statistics.median(w for w, _ in t) for d, t in times.items()}
      cpus = {d: statistics.median(c for _, c in t) for d, t in times.items()}
      cpu_total += sum(cpus.values())
      for d in args.depths:
        print(
          f"  {name:>14} scan={scan!s:5} depth={d:3d}: compile {secs[d]:6.2f} s, "
          f"{cpus[d]:6.2f} CPU s",
          flush=True,
        )
      lo, hi = min(args.depths), max(args.depths)
      ratios[(name, scan)] = secs[hi] / secs[lo]
      print(
        f"{name} scan={scan}: compile ratio depth {hi} / depth {lo} = {ratios[(name, scan)]:.2f}",
        flush=True,
      )
  print(f"CPU seconds over all rows (medians): {cpu_total:.2f}")
  if len(names) > 1:
    worst = max((r, n) for (n, s), r in ratios.items() if s)
    print(f"worst scanned ratio: {worst[1]} {worst[0]:.2f}")


if __name__ == "__main__":
  main()
