"""Compile time of the train step against depth, scan vs Python loop (issue: flat under scan).

    .venv/bin/python benchmarks/compile_time.py [--depths 4 32] [--mixer mhc]
    .venv/bin/python benchmarks/compile_time.py --mixer all --no-loop --repeats 1  # every mixer

Lowers and compiles one value_and_grad step of the Transformer (width 64, 4 heads, seq 64,
batch 8) at each depth; prints seconds per depth and the ratio deepest / shallowest. Each
measurement is the median of --repeats fresh compiles (the compilation cache is cleared), the
depths taken in turn within each repeat so that a load change on the machine hits both sides.
"""

import argparse
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from mhc_jax import hostmem
from mhc_jax.model import Transformer
from mhc_jax.train.config import ModelConfig


def compile_once(cfg: ModelConfig) -> float:
  """Seconds to lower and compile one value_and_grad step from a cleared cache."""
  model = Transformer(cfg)
  tokens = jnp.zeros((8, 64), jnp.int32)
  params = jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.PRNGKey(0), tokens)))

  def loss(p, t):
    logits, _ = model.apply(p, t)
    return jnp.mean(jax.nn.logsumexp(logits, -1))

  jax.clear_caches()
  t0 = time.perf_counter()
  jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile()
  return time.perf_counter() - t0


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--depths", type=int, nargs="+", default=[4, 32])
  ap.add_argument("--mixer", default="mhc", help="a registered mixer, or 'all'")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--no-loop", action="store_true", help="skip the Python-loop comparison")
  args = ap.parse_args()
  from mhc_jax import mixers

  names = mixers.names() if args.mixer == "all" else [args.mixer]
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
  ratios = {}
  for name in names:
    for scan in [True] if args.no_loop else [True, False]:
      times = {d: [] for d in args.depths}
      for _ in range(args.repeats):
        for d in args.depths:
          cfg = ModelConfig(vocab=256, depth=d, width=64, heads=4, mixer=name, scan=scan)
          times[d].append(compile_once(cfg))
      secs = {d: statistics.median(t) for d, t in times.items()}
      for d in args.depths:
        print(f"  {name:>14} scan={scan!s:5} depth={d:3d}: compile {secs[d]:6.2f} s", flush=True)
      lo, hi = min(args.depths), max(args.depths)
      ratios[(name, scan)] = secs[hi] / secs[lo]
      print(
        f"{name} scan={scan}: compile ratio depth {hi} / depth {lo} = {ratios[(name, scan)]:.2f}",
        flush=True,
      )
  if len(names) > 1:
    worst = max((r, n) for (n, s), r in ratios.items() if s)
    print(f"worst scanned ratio: {worst[1]} {worst[0]:.2f}")


if __name__ == "__main__":
  hostmem.ensure()  # malloc with huge pages, as mhc-jax runs (mhc_jax/hostmem.py)
  main()
