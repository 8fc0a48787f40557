"""The one train step every step benchmark measures, and its shape options.

``build`` makes the project's own train step (``mhc_jax.train.step.make_train_step``) for a config,
jitted with the state donated, on one device, with a random batch; ``add_shape_args`` /
``shape_overrides`` turn the command line's shape into config overrides (default: the issue-14
shape, width 256, 8 blocks, 8 sequences x 256 tokens, vocabulary 256, AdamW). ``matmul_fn`` is the
reference dense matmul the step's rate is compared with, in the same process.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import flax.linen as nn
import jax
import jax.numpy as jnp
from timing import median_time

from mhc_jax.model import Transformer
from mhc_jax.train.optim import make_optimizer
from mhc_jax.train.state import State
from mhc_jax.train.step import make_train_step

MATMUL = (2048, 1024, 4096)  # the reference matmul's [m, k] @ [k, n] (--matmul)


def build(cfg, variant: str = "scan"):
  """``(jitted step, state, batch)`` for a config; ``variant == "diag"`` turns the per-layer
  diagnostics on (the other variants are config overrides, made by the caller)."""
  model = Transformer(cfg.model)
  b, t = cfg.data.batch_size, cfg.data.seq_len
  tokens = jax.random.randint(jax.random.PRNGKey(2), (b, t + 1), 0, cfg.model.vocab)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((b, t))}
  tx, schedule = make_optimizer(cfg.optim, 1000)
  params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), batch["inputs"]))
  state = State(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=tx.init(params),
    nonfinite=jnp.zeros((), jnp.int32),
  )
  step = make_train_step(model, tx, schedule, cfg)
  fn = jax.jit(functools.partial(step, diag=variant == "diag"), donate_argnums=0)
  return fn, state, batch


def model_flops(cfg, tokens: int, seq_len: int) -> float:
  """Training FLOPs of one step: 3 x forward, forward per token = 2 x (matmul parameters, the
  embedding excluded, the head counted once) + the attention score and value products
  (2 x 2 x T x C per block, causal counted in full). Mixer arithmetic is not counted: an mHC
  step that takes longer shows as a lower rate."""
  m, c = cfg.model, cfg.model.width
  hidden = int(c * m.mlp_ratio)
  per_block = 4 * c * c + 2 * c * hidden  # q, k, v, out; up, down
  matmul_params = m.depth * per_block + c * m.vocab  # + the LM head
  fwd = 2 * matmul_params + m.depth * 2 * 2 * seq_len * c  # + scores and values
  return 3.0 * fwd * tokens


def matmul_fn(m: int, k: int, n: int, dtype=jnp.float32):
  """``(call, flops)``: one dense ``[m, k] @ [k, n]`` matmul in ``dtype``, jitted and warmed up."""
  a = jax.random.normal(jax.random.PRNGKey(0), (m, k), dtype)
  b = jax.random.normal(jax.random.PRNGKey(1), (k, n), dtype)
  f = jax.jit(jnp.matmul)
  jax.block_until_ready(f(a, b))
  return (lambda: f(a, b)), 2 * m * k * n


def matmul_rate(steps: int = 10, mkn=MATMUL, dtype=jnp.float32) -> float:
  """GFLOP/s of the dense matmul of ``matmul_fn`` in this process (median of ``steps``)."""
  call, flops = matmul_fn(*mkn, dtype=dtype)
  _, t = median_time(call, steps, 3)
  return flops / t / 1e9


def add_shape_args(ap: argparse.ArgumentParser, steps: int) -> None:
  """The step's shape, timing and reference-matmul options."""
  g = ap.add_argument_group("shape and timing (every mode)")
  g.add_argument("--width", type=int, default=256)
  g.add_argument("--depth", type=int, default=8)
  g.add_argument("--heads", type=int, default=4)
  g.add_argument("--batch", type=int, default=8)
  g.add_argument("--seq-len", type=int, default=256)
  g.add_argument("--vocab", type=int, default=256)
  g.add_argument("--n", type=int, default=4, help="streams for multi-stream mixers")
  g.add_argument("--steps", type=int, default=steps)
  g.add_argument("--warmup", type=int, default=2)
  g.add_argument(
    "--matmul",
    default="x".join(map(str, MATMUL)),
    metavar="MxKxN",
    help="the reference matmul [M, K] @ [K, N] (smaller: quicker, for toy runs)",
  )
  g.add_argument(
    "--matmul-dtype",
    default="float32",
    choices=("float32", "bfloat16"),
    help="the reference matmul's dtype (bfloat16: the MFU of a bf16 run on an accelerator)",
  )
  g.add_argument(
    "--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides after the shape's"
  )


def parse_matmul(text: str) -> tuple:
  """``(M, K, N)`` from ``--matmul MxKxN``; ValueError naming the option if malformed."""
  try:
    mkn = tuple(int(d) for d in text.split("x"))
    if len(mkn) == 3 and min(mkn) >= 1:
      return mkn
  except ValueError:
    pass
  raise ValueError(f"--matmul: expected MxKxN (positive integers), got {text!r}")


def shape_overrides(args) -> list[str]:
  """Config overrides for the shape options of ``add_shape_args`` (then ``--set``)."""
  return [
    f"model.width={args.width}",
    f"model.depth={args.depth}",
    f"model.heads={args.heads}",
    f"model.vocab={args.vocab}",
    f"data.batch_size={args.batch}",
    f"data.seq_len={args.seq_len}",
    "data.task=bijection",
    "optim.warmup_steps=0",
    "mesh.data=1",
    *args.set,
  ]


def streams(mixer: str, n: int) -> list[str]:
  """The ``--n`` override for a multi-stream mixer (residual takes none)."""
  return [f"model.mixer_options.n={n}"] if mixer != "residual" else []


def median_ratio(a: list[float], b: list[float]) -> float:
  """Median over rounds of ``a``'s time over ``b``'s in the same round."""
  return statistics.median(x / y for x, y in zip(a, b))
