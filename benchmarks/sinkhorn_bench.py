"""Time and compiled memory of Sinkhorn forward+backward, unrolled vs implicit gradient.

Shapes follow mHC's use: one n x n H_res per token. Usage:
  python benchmarks/sinkhorn_bench.py [--tokens 4096] [--n 4] [--iters 20 100] [--reps 20]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from mhc_jax.sinkhorn import sinkhorn, stochastic_error


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--n", type=int, default=4)
  ap.add_argument("--iters", type=int, nargs="+", default=[20, 100])
  ap.add_argument("--reps", type=int, default=20)
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  z = jnp.asarray(rng.standard_normal((args.tokens, args.n, args.n)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((args.tokens, args.n, args.n)), jnp.float32)
  print(f"device={jax.devices()[0].platform} tokens={args.tokens} n={args.n}")
  print(f"{'mode':>8} {'iters':>5} {'ms/step':>8} {'temp MiB':>9} {'col_err':>9}")
  for iters in args.iters:
    for mode in ("unroll", "implicit"):
      step = jax.jit(jax.value_and_grad(lambda z: jnp.sum(w * sinkhorn(z, iters, mode))))
      compiled = step.lower(z).compile()
      mem = compiled.memory_analysis()
      temp = mem.temp_size_in_bytes / 2**20 if mem is not None else float("nan")
      jax.block_until_ready(compiled(z))
      t0 = time.perf_counter()
      for _ in range(args.reps):
        out = compiled(z)
      jax.block_until_ready(out)
      ms = (time.perf_counter() - t0) / args.reps * 1e3
      col_err = float(stochastic_error(sinkhorn(z, iters))[1])
      print(f"{mode:>8} {iters:5d} {ms:8.3f} {temp:9.3f} {col_err:9.2e}")


if __name__ == "__main__":
  main()
